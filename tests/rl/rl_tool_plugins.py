"""Tools for the tool-resolution tests, loaded through `module:attr` references (a unique module name)."""

from __future__ import annotations

from rollout.rl.tools import tool_from_function


def word_count(text: str) -> int:
    """Count the words of a text.

    Args:
        text: The text to count.
    """
    return len(text.split())


def _shout(text: str) -> str:
    """Upper-case a text."""
    return text.upper()


shout = tool_from_function(_shout, name="shout", timeout_s=1.5)
"""A ready-made `Tool` with its own name and timeout."""


def calculator(expression: str) -> str:
    """A user tool whose name clashes with the built-in calculator."""
    return expression


def untyped(x):  # type: ignore[no-untyped-def]
    """A tool without annotations: its schema can't be built."""
    return x
