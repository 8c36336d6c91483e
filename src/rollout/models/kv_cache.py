"""A forward's key/value cache argument and output, under the installed transformers' name.

transformers 5.24 renamed the `past_key_values` argument and output field of a model's forward to
`cache` (the old name warns on every process and is to go in 5.40); the pinned range spans both.
"""

from __future__ import annotations

from functools import cache as _memo
from typing import Any


@_memo
def cache_field() -> str:
    """"cache" where this transformers names it so, else "past_key_values"."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def cache_kwarg(cache: Any) -> dict[str, Any]:
    """`{name: cache}` to pass to a model's forward."""
    return {cache_field(): cache}


def returned_cache(out: Any) -> Any:
    """The key/value cache a forward returned (None when it kept none)."""
    return getattr(out, cache_field())
