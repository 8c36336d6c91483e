"""A plugin module that fails while importing (for the resolution error test)."""

raise RuntimeError("this plugin is broken")
