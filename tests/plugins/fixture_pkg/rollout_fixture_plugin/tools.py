"""A tool plugin: `fixture_upper`."""


def upper(text: str) -> str:
    """Upper-case a text.

    Args:
        text: The text.
    """
    return text.upper()
