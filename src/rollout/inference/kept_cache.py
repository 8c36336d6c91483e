"""Key/value caches kept between `generate` calls, so the next turn of a conversation prefills only its new tokens.

    request = GenerationRequest(prompt_token_ids=turn_1, params=params, cache_key="run-7/3/0")
    engine.generate([request])                      # the row's cache is kept under "run-7/3/0" when it finishes
    request = GenerationRequest(prompt_token_ids=turn_1 + reply + tool_answer, params=params, cache_key="run-7/3/0")
    engine.generate([request])                      # prefills reply[-1:] + tool_answer on top of the kept cache
    engine.release_cache("run-7/")                  # the conversations are over: free what is left

Multi-turn episodes (`rl/episode.py`) call the engine once per turn; without
this, each turn prefills the whole conversation again. An entry is keyed by
the caller's `cache_key` (one per conversation), not looked up by token
prefix: a request only ever continues its own conversation, so whether the
cache is reused -- and with it the last bits of the log-probs -- depends on
the request alone, never on what other requests left behind.

An entry is taken (removed) by the request that continues it, and kept only
while the engine's weights are those it was computed with: `update_weights`
drops every entry, and an entry from another weights version is never used.
An engine whose model is trained in place without `update_weights` (the
during-training evaluator shares the trainer's model) must not be asked to
keep caches across optimizer steps; `rl/episode.py` releases its keys when its
episodes end, so nothing outlives one rollout. The store is capped in bytes;
the least recently kept entries go first (their conversations then prefill
again, correctly, only slower).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

DEFAULT_KEPT_CACHE_BYTES = 1 << 30
"""1 GiB: ~40k tokens of a 0.5B model's float32 keys/values (24 layers x 2 KV heads x 64 dims)."""


@dataclass(frozen=True)
class KeptCache:
    """The keys and values of one finished row, padding removed."""

    token_ids: tuple[int, ...]
    """The tokens these keys/values are of: the prompt and every sampled token but the last (never fed)."""
    layers: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    """Per layer (keys, values), each (kv_heads, len(token_ids), head_dim)."""
    weights_version: int

    @property
    def nbytes(self) -> int:
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.layers)


class KeptCacheStore:
    """Entries by key, least recently kept first; not thread-safe (the engine holds its lock)."""

    def __init__(self, max_bytes: int = DEFAULT_KEPT_CACHE_BYTES) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, KeptCache] = OrderedDict()
        self._bytes = 0
        self.evicted = 0
        """Entries dropped to stay under `max_bytes` (their conversations prefill again)."""

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def put(self, key: str, entry: KeptCache) -> bool:
        """Keep `entry` under `key` (replacing any), then drop the oldest entries over the cap;
        False when `entry` alone is over the cap (not kept)."""
        self._pop(key)
        size = entry.nbytes
        if size > self.max_bytes:
            self.evicted += 1
            return False
        self._entries[key] = entry
        self._bytes += size
        while self._bytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self._bytes -= old.nbytes
            self.evicted += 1
        return True

    def take(self, key: str, prompt_ids: tuple[int, ...], weights_version: int) -> KeptCache | None:
        """Remove and return the entry under `key` when `prompt_ids` extends its tokens by at least one
        token and it was computed with `weights_version`; an entry that does not fit is dropped."""
        entry = self._pop(key)
        if entry is None or entry.weights_version != weights_version:
            return None
        n = len(entry.token_ids)
        if n == 0 or len(prompt_ids) <= n or prompt_ids[:n] != entry.token_ids:
            return None
        return entry

    def release(self, prefix: str) -> int:
        """Drop every entry whose key starts with `prefix`; how many there were."""
        keys = [k for k in self._entries if k.startswith(prefix)]
        for k in keys:
            self._pop(k)
        return len(keys)

    def clear(self) -> None:
        self._entries.clear()
        self._bytes = 0

    def _pop(self, key: str) -> KeptCache | None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._bytes -= entry.nbytes
        return entry
