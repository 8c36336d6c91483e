"""Final-answer matching for math tasks: extract the answer from a completion, normalise, compare.

    extract_math_answer("... so the answer is \\boxed{\\frac{1}{2}}.")   # "\\frac{1}{2}"
    normalize_math_answer("\\frac{1}{2}") == normalize_math_answer("0.5") == "1/2"
    math_answers_match("The answer is 1,234.", "1234")                  # True

Where the answer is, in order of trust: the last `\\boxed{...}` (or `\\fbox`,
nested braces allowed); the last `#### X` (GSM8K); the last "answer is X" /
"answer: X" / "final answer = X"; else the last number in the text.

Normalisation (like the Hendrycks MATH / lm-eval checkers, without sympy):
unicode minus, `$`, `\\text{}`, `\\left`/`\\right`, spacing commands, degrees and
percent signs go ("50%" matches "50"); `\\frac{a}{b}` / `\\dfrac` / `\\frac12`
become `a/b`; thousands separators go ("1,234" -> "1234"); a leading "x =" and
a trailing unit word after a number go; then anything that parses as a
rational number is written as the reduced fraction (`0.5`, `1/2`, `2/4` ->
"1/2"; `3.0` -> "3"), so numeric answers compare exactly; other answers
compare as lower-cased strings without whitespace.
"""

from __future__ import annotations

import re
from fractions import Fraction

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_HASHES = re.compile(r"####\s*(.+)")
_PHRASE = re.compile(r"answer\s*(?:is|:|=)\s*:?\s*(.+)", re.IGNORECASE)
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+)?|-?\.\d+")
_TEXT_COMMAND = re.compile(r"\\(?:text|textbf|textrm|mathrm|mathbf|mbox)\s*\{([^{}]*)\}")
_SPACING = re.compile(r"\\[,;:! ]|\\left|\\right|\\displaystyle|~")
_DEGREES = re.compile(r"\^\s*\{?\s*\\circ\s*\}?")
_THOUSANDS = re.compile(r"(\d),(\d{3})(?!\d)")
_NUMBER_WITH_UNIT = re.compile(r"(-?[\d.,/]+)\s+[a-zA-Z][a-zA-Z ]*")
_LEADING_VARIABLE = re.compile(r"^[a-z]\w*=(?=.)")
_FRAC_SHORT = re.compile(r"\\frac\s*(\d)\s*(\d)")


def extract_math_answer(text: str) -> str | None:
    """The final answer a completion gives (raw, not normalised); None when it gives none."""
    text = text.replace("\u2212", "-")
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    for pattern in (_HASHES, _PHRASE):
        matches = list(pattern.finditer(text))
        if matches:
            found = _answer_from_phrase(matches[-1].group(1))
            if found:
                return found
    numbers = _NUMBER.findall(_replace_fracs(text))
    return numbers[-1].strip() if numbers else None


def normalize_math_answer(answer: str) -> str:
    """A canonical string: reduced fraction / integer for numbers, else compact lower-case text."""
    s = answer.strip().replace("\u2212", "-")
    s = s.replace("\\$", "").replace("$", "")
    s = _TEXT_COMMAND.sub(r"\1", s)
    s = _SPACING.sub("", s)
    s = _DEGREES.sub("", s)
    s = s.replace("\\%", "").replace("%", "")
    s = re.sub(r"\s*percent\b", "", s, flags=re.IGNORECASE)
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = _replace_fracs(s)
    while _THOUSANDS.search(s):
        s = _THOUSANDS.sub(r"\1\2", s)
    s = s.strip().rstrip(".").strip()
    unit = _NUMBER_WITH_UNIT.fullmatch(s)
    if unit is not None:
        s = unit.group(1)
    s = re.sub(r"\s+", "", s).lower()
    while s.startswith("{") and _braced(s, 1) == s[1:-1]:  # redundant outer braces: {{5}} -> 5
        s = s[1:-1]
    s = _LEADING_VARIABLE.sub("", s)
    value = _as_number(s)
    return s if value is None else str(value)


def math_answers_match(completion: str, answer: str) -> bool:
    """Whether the completion's final answer equals the reference `answer` after normalisation."""
    got = extract_math_answer(completion)
    if got is None:
        return False
    # References in GSM8K / MATH style carry their own "#### X" or \boxed{X}.
    expected = extract_math_answer(answer) or answer if ("####" in answer or "\\boxed" in answer) else answer
    return normalize_math_answer(got) == normalize_math_answer(expected)


# --- helpers ------------------------------------------------------------------------


def _last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}`, matching nested braces; None without a closed one."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    for start in reversed(starts):
        content = _braced(text, start)
        if content is not None:
            return content
    return None


def _braced(text: str, start: int) -> str | None:
    """The text from `start` up to the brace closing the one just before `start`."""
    depth = 1
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start:i]
    return None


def _answer_from_phrase(rest: str) -> str | None:
    """The answer in the text after "answer is": all of it if it's a number, else its first number."""
    rest = rest.strip()
    inline = re.match(r"\$([^$]+)\$", rest)
    if inline:
        rest = inline.group(1)
    rest = rest.rstrip(" .!;")
    if not rest:
        return None
    if _as_number(normalize_math_answer(rest)) is not None:
        return rest
    number = _NUMBER.search(_replace_fracs(rest))
    if number is not None:
        return number.group().strip()
    return re.split(r"\.\s", rest)[0]


def _replace_fracs(s: str) -> str:
    """`\\frac{a}{b}` -> `a/b` (or `(a)/(b)` when a part isn't a plain number), innermost first."""
    s = _FRAC_SHORT.sub(r"\1/\2", s)
    while True:
        at = s.rfind("\\frac")
        if at < 0:
            return s
        i = at + len("\\frac")
        while i < len(s) and s[i] == " ":
            i += 1
        if i >= len(s) or s[i] != "{":
            return s
        numerator = _braced(s, i + 1)
        if numerator is None:
            return s
        j = i + 1 + len(numerator) + 1
        if j >= len(s) or s[j] != "{":
            return s
        denominator = _braced(s, j + 1)
        if denominator is None:
            return s
        end = j + 1 + len(denominator) + 1
        simple = _as_number(numerator.strip()) is not None and _as_number(denominator.strip()) is not None
        a, b = numerator.strip(), denominator.strip()
        s = s[:at] + (f"{a}/{b}" if simple else f"({a})/({b})") + s[end:]


def _as_number(s: str) -> Fraction | None:
    """`s` as an exact rational ("-3", "0.5", "1/2", "+2", "1e3"), or None."""
    if not s or not re.fullmatch(r"[-+]?[\d.]+(?:e[-+]?\d+)?(?:/[-+]?\d+)?", s, flags=re.IGNORECASE):
        return None
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None
