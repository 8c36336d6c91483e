"""The built-in `calculator` tool: arithmetic on integers and decimals, never `eval`.

    calculator("(12 + 7) * 3 / 2")   # "28.5"

The expression is parsed with `ast` and walked over a whitelist of nodes; sizes,
digits, exponents and nesting are bounded, and every problem comes back as an
"error: ..." string for the model (a tool never raises at the model). Kept
apart from `rl/tools.py` (the tool machinery) so each stays readable.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from fractions import Fraction
from typing import Any

# --- limits -----------------------------------------------------------------

_CALC_MAX_CHARS = 1000
_CALC_MAX_DIGITS = 100
_CALC_MAX_ABS = 10**_CALC_MAX_DIGITS
"""Every intermediate result must stay below this in magnitude."""
_CALC_MAX_EXPONENT = 10_000
_CALC_MAX_DEPTH = 200
"""Nested operations (a 200-term sum nests 200 deep): bounded so Python's recursion limit never is."""
_BINARY_OPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / // % ** and parentheses on integers and decimals.

    Args:
        expression: The expression to evaluate, e.g. "(12 + 7) * 3 / 2".
    """
    # The expression is parsed with `ast` and walked over a whitelist of nodes: never eval. Numbers are
    # exact fractions (0.1 + 0.2 is 0.3) until a fractional power makes them floats; exponents and every
    # intermediate magnitude are capped before anything big is computed (9**9**9 fails at once).
    if len(expression) > _CALC_MAX_CHARS:
        raise ValueError(f"expression too long ({len(expression)} characters, limit {_CALC_MAX_CHARS})")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as err:
        raise ValueError(f"invalid expression: {getattr(err, 'msg', None) or err}") from None
    try:
        value = _calc_eval(tree.body)
    except ZeroDivisionError:
        raise ValueError("division by zero") from None
    except OverflowError:
        raise ValueError(f"result too large (limit 1e{_CALC_MAX_DIGITS})") from None
    return _format_number(value)


def _calc_eval(node: ast.AST, depth: int = 0) -> Fraction | float:
    if depth > _CALC_MAX_DEPTH:
        raise ValueError(f"expression nested too deeply (limit {_CALC_MAX_DEPTH} operations deep)")
    if isinstance(node, ast.Constant):
        value = node.value
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"only numbers are allowed, got {value!r}")
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"number too large: {ast.unparse(node)}")
        # repr() gives the literal's shortest decimal form, so 0.1 becomes exactly 1/10.
        return _checked(Fraction(value) if isinstance(value, int) else Fraction(repr(value)))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.UAdd | ast.USub):
        operand = _calc_eval(node.operand, depth + 1)
        return operand if isinstance(node.op, ast.UAdd) else -operand
    if isinstance(node, ast.BinOp):
        left, right = _calc_eval(node.left, depth + 1), _calc_eval(node.right, depth + 1)
        if isinstance(node.op, ast.Pow):
            return _checked(_power(left, right))
        if type(node.op) in _BINARY_OPS:
            return _checked(_BINARY_OPS[type(node.op)](left, right))
    if isinstance(node, ast.Name):
        raise ValueError(
            f"unknown name {node.id!r}: only numbers, + - * / // % ** and parentheses are allowed"
        )
    if isinstance(node, ast.Call):
        raise ValueError("function calls are not allowed")
    if isinstance(node, ast.Attribute):
        raise ValueError("attribute access is not allowed")
    raise ValueError(f"unsupported syntax: {type(node).__name__} (only + - * / // % ** and parentheses)")


def _power(base: Fraction | float, exponent: Fraction | float) -> Fraction | float:
    """base ** exponent, refusing before computing anything past the caps."""
    if isinstance(exponent, float) and exponent.is_integer():
        exponent = Fraction(int(exponent))  # (-8) ** 2.0 is a real number
    if abs(exponent) > _CALC_MAX_EXPONENT:
        raise ValueError(f"exponent too large ({_format_number(exponent)}, limit {_CALC_MAX_EXPONENT})")
    if isinstance(exponent, Fraction) and exponent.denominator == 1:
        e = exponent.numerator
        if isinstance(base, Fraction) and base != 0 and e != 0:
            num, den = abs(base.numerator), base.denominator
            if e * (math.log10(num) - math.log10(den)) > _CALC_MAX_DIGITS:
                raise ValueError(f"result too large (limit 1e{_CALC_MAX_DIGITS})")
            if abs(e) * max(math.log10(num), math.log10(den)) > 2 * _CALC_MAX_DIGITS:
                return float(base) ** e  # an exact result would need huge numerators: use a float
        return base**e
    if base < 0:
        raise ValueError("a negative number to a fractional power is not a real number")
    return float(base) ** float(exponent)


def _checked(value: Fraction | float | int) -> Fraction | float:
    if isinstance(value, int):  # Fraction // Fraction is an int
        value = Fraction(value)
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("the result is not a finite number")
    if abs(value) >= _CALC_MAX_ABS:
        raise ValueError(f"result too large (limit 1e{_CALC_MAX_DIGITS})")
    if isinstance(value, Fraction) and value.denominator > _CALC_MAX_ABS:
        return float(value)  # keep exact arithmetic cheap: a long chain of divisions goes to floats
    return value


def _format_number(value: Fraction | float) -> str:
    """Integers without ".0"; anything else as Python's shortest float repr."""
    if isinstance(value, Fraction):
        if value.denominator == 1:
            return str(value.numerator)
        value = float(value)
    if value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(value)


