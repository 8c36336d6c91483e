"""The `hf` engine: transformers models, batched decoding with a KV cache and continuous batching.

    from rollout.inference import SamplingParams, load_hf_engine
    engine = load_hf_engine("local/models/sft-tiny")                 # CPU, float32
    [choices] = engine.generate([[{"role": "user", "content": "What is 3+8?"}]],
                                SamplingParams(temperature=0, max_tokens=8))
    choices[0].text, choices[0].token_ids, choices[0].logprobs

The decode loop is our own rather than `model.generate`, for two reasons:

- every choice samples from its own `torch.Generator` seeded from (request
  seed, choice index) (see `sampling.py`), so a seed pins the tokens whether
  the request runs alone or in a batch; `generate` draws from one global RNG;
- rows join and leave the running batch between steps (continuous batching):
  finished rows are dropped from the batch and the KV cache, new requests are
  prefilled in one forward pass and merged in, left-padded to a common length
  (with `pad_multiple > 1`, a multiple of it: batch-invariant log-probs, see
  `BATCH_INVARIANT_PAD`).

Rows are left-padded; position ids count each row's real tokens, so padding
never shifts a row's positions and the cache of two batches can be merged by
left-padding the shorter one. A request with a `cache_key` keeps its finished
row's cache in the engine, and the conversation's next turn prefills only its
new tokens on top of it (`kept_cache.py`, `HFSession._prefill_kept`).

The log-prob of each sampled token is the log-softmax of the raw (unfiltered, temperature-1) logits, computed in float32
(of the logits divided by the row's temperature when it asks for `tempered_logprobs`).

One module of ~600 lines on purpose: the engine, its decode session and the
row / cache bookkeeping share private state (per-row generators, the merged
KV cache, left padding), and read as one algorithm.
"""

from __future__ import annotations

import secrets
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from os import PathLike
from pathlib import Path
from typing import Any

import torch

from rollout.errors import ModelError
from rollout.inference.detokenize import IncrementalText
from rollout.inference.kept_cache import DEFAULT_KEPT_CACHE_BYTES, KeptCache, KeptCacheStore
from rollout.inference.sampling import choose_tokens
from rollout.inference.types import (
    Completion,
    FinishReason,
    GenerationError,
    GenerationRequest,
    Prompt,
    PromptLike,
    SamplingParams,
    StateDict,
    TokenEvent,
    as_request,
    derive_seed,
)
from rollout.models.kv_cache import cache_kwarg, returned_cache
from rollout.models.lean_decoder import lean_decoder

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

BATCH_INVARIANT_PAD = 16
"""The `pad_multiple` RL rollout engines use. A row's log-probs depend on its left padding only
through the padding modulo the width of the CPU kernels' vectorised reductions over the keys
(16 float32 lanes with AVX-512; 8 with AVX2): padded by 0, 16, 32 or 64 columns a prompt's logits
are bitwise equal, by 1..15 they differ in the last bits. With the cache width kept a multiple of
16 (the prefill rounded up, dead columns trimmed in multiples, joiners merged only at a multiple),
a row's padding is fixed modulo 16 by its own length; the matrix products run on a fixed number of
rows whatever the batch (`lean_decoder.INVARIANT_ROWS`), so its tokens *and* log-probs are the same
whichever requests share the batch: a group made by a Ray rollout worker with some groups equals
the group made locally with all of them (`rollout.rl.ray_rollout`). That holds where the lean
decoder runs (llama, mistral, qwen2, qwen3); other models get `BATCH_INVARIANT_ROWS`."""

PREPACKED_MAX_BYTES = 1 << 30
"""The largest weights (bytes) the CPU engine keeps prepacked copies of (`LeanDecoder`): the copies
double the weights' memory (benchmarks/README.md has what they gain)."""

BATCH_INVARIANT_ROWS = 16
"""With `pad_multiple > 1`, for a model the lean decoder does not run (its products are
transformers'), the fewest rows a forward pass runs with (copies of a row fill it up): the CPU
matrix products choose their kernel path by the row count. A best effort, not a guarantee: one
thread, a row's product was bitwise the same for every count from 4 on an AMD EPYC with AVX-512
and from 16 on an Intel Xeon with AVX-512 (up to 300 rows measured), but MKL's AVX2 kernels take
one path for 4-48 rows and another from 64, and a prefill's count is rows x width."""


def load_hf_engine(
    model_path: str | Path,
    *,
    dtype: str = "float32",
    device: str = "auto",
    max_batch_size: int = 32,
    max_model_len: int | None = None,
    attn_implementation: str = "sdpa",
    trust_remote_code: bool = False,
    model_name: str | None = None,
    pad_multiple: int = 1,
    kept_cache_bytes: int = DEFAULT_KEPT_CACHE_BYTES,
    lean: bool = True,
) -> HFEngine:
    """Load a causal LM and its tokenizer from a folder (or a hub id when online) into an `HFEngine`
    (`lean`: prefill and decode through `rollout.models.lean_decoder` where the model has one)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollout.models.load import NO_HUB_KERNELS

    if dtype not in DTYPES:
        raise ModelError(f"unknown dtype {dtype!r}; expected one of {', '.join(DTYPES)}")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(
            model_path,
            dtype=DTYPES[dtype],
            attn_implementation=attn_implementation,
            trust_remote_code=trust_remote_code,
            **NO_HUB_KERNELS,
        )
    except Exception as err:  # transformers raises OSError / ValueError / hub errors
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ModelError(f"cannot load model from {model_path}: {first}") from None
    model.to(device).eval()
    name = model_name or Path(str(model_path)).name or str(model_path)
    return HFEngine(
        model, tokenizer, model_name=name, max_batch_size=max_batch_size, max_model_len=max_model_len,
        pad_multiple=pad_multiple, kept_cache_bytes=kept_cache_bytes, lean=lean,
    )


class HFEngine:
    """Generation with a live transformers model (the trainer can share it and push weights)."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        model_name: str,
        max_batch_size: int = 32,
        max_model_len: int | None = None,
        pad_multiple: int = 1,
        kept_cache_bytes: int = DEFAULT_KEPT_CACHE_BYTES,
        lean: bool = True,
    ) -> None:
        if max_batch_size < 1:
            raise ModelError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if pad_multiple < 1:
            raise ModelError(f"pad_multiple must be >= 1, got {pad_multiple}")
        self.pad_multiple = pad_multiple
        """Batch-invariant log-probs when > 1 (see `BATCH_INVARIANT_PAD`): the cache width is kept a
        multiple of it, so a row's left padding changes only by whole multiples with the batch."""
        self.model = model
        device_type = next(model.parameters()).device.type
        small = sum(p.numel() * p.element_size() for p in model.parameters()) <= PREPACKED_MAX_BYTES
        self._prepack = device_type == "cpu" and small and pad_multiple == 1
        on_gpu = device_type == "cuda"
        self.lean = lean_decoder(
            model, prepacked=self._prepack, invariant=pad_multiple > 1,
            stacked=on_gpu and small and pad_multiple == 1, fused_norms=on_gpu,
        ) if lean else None
        """The lean prefill/decode forward (`rollout.models.lean_decoder`) where the model has one;
        on the CPU, for weights up to `PREPACKED_MAX_BYTES`, with prepacked weight copies; under
        `pad_multiple`, every product on a fixed number of rows instead (`INVARIANT_ROWS`). On a GPU,
        with fewer launches a layer: fused RMSNorms, and for weights up to `PREPACKED_MAX_BYTES`
        stacked q/k/v and gate/up copies (`LeanDecoder`)."""
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_batch_size = max_batch_size
        limit = getattr(model.config, "max_position_embeddings", None) or 2048
        self.max_model_len = min(max_model_len, limit) if max_model_len else limit
        self.device = next(model.parameters()).device
        self.pad_token_id = _pad_token_id(tokenizer, model)
        self.eos_token_ids = frozenset(_eos_token_ids(tokenizer, model))
        self._lock = threading.Lock()  # one forward pass, weight update or kept-cache change at a time
        self._weights_version = 0
        self._kept = KeptCacheStore(kept_cache_bytes)
        self.kept_cache_stats = {"kept": 0, "reused": 0, "reused_tokens": 0, "prefilled_tokens": 0}
        """Rows whose cache was kept for a `cache_key`; rows that continued a kept cache; the prompt
        tokens those did not prefill again; prompt tokens prefilled (every request)."""

    # ----------------------------------------------------------------- protocol

    @property
    def weights_version(self) -> int:
        return self._weights_version

    def tokenize(self, prompt: Prompt, tools: Sequence[Mapping[str, Any]] | None = None) -> tuple[int, ...]:
        if isinstance(prompt, str):
            if not prompt:
                raise GenerationError("the prompt is empty")
            ids = self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        else:
            if not prompt:
                raise GenerationError("the message list is empty")
            if not getattr(self.tokenizer, "chat_template", None):
                raise GenerationError(f"model {self.model_name} has no chat template; send a text prompt")
            rendered = self.tokenizer.apply_chat_template(
                [dict(m) for m in prompt], add_generation_prompt=True, tokenize=True,
                tools=[dict(t) for t in tools] if tools else None,
            )
            ids = (
                rendered["input_ids"] if isinstance(rendered, dict) or hasattr(rendered, "keys") else rendered
            )
        return tuple(int(t) for t in ids)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def generate(
        self, requests: Sequence[PromptLike], params: SamplingParams | None = None
    ) -> list[tuple[Completion, ...]]:
        """Complete every request; rows join the running batch as others finish.

        Requests without their own params use `params` (default `SamplingParams()`).
        Every prompt is checked before any decoding starts.
        """
        default = params or SamplingParams()
        reqs: list[GenerationRequest] = []
        seen: set[int] = set()
        for r in map(as_request, requests):  # the same request object twice: two separate requests
            r = replace(r) if id(r) in seen else r
            seen.add(id(r))
            reqs.append(r)
        session = self.open_session()
        prepared = deque(session.prepare(r, default) for r in reqs)
        position = {id(r): i for i, r in enumerate(reqs)}
        results: list[tuple[Completion, ...] | None] = [None] * len(reqs)
        admit_at = max(1, self.max_batch_size // 4)  # merge joiners in groups: a merge copies the cache
        while prepared or session.num_rows:
            free = self.max_batch_size - session.num_rows
            joinable = session.num_rows == 0 or (
                free >= min(admit_at, _rows(prepared)) and session.width % self.pad_multiple == 0
            )
            if prepared and joinable:
                batch = [prepared.popleft()]
                free -= batch[0].params.n
                while prepared and prepared[0].params.n <= free:
                    free -= prepared[0].params.n
                    batch.append(prepared.popleft())
                session.add_prepared(batch)
            for request, completions in session.step():
                results[position[id(request)]] = completions
        assert all(r is not None for r in results)
        return results  # type: ignore[return-value]

    def open_session(self) -> HFSession:
        return HFSession(self)

    def release_cache(self, key_prefix: str) -> int:
        """Drop the kept caches (see `kept_cache.py`) whose `cache_key` starts with `key_prefix`."""
        with self._lock:
            return self._kept.release(key_prefix)

    def update_weights(self, weights: StateDict | str | PathLike[str]) -> int:
        """Copy new weights into the live model in place (no rebuild); returns the new version.

        `weights` is a state dict (names as in `model.state_dict()`, a subset is
        fine) or a folder / file of safetensors, e.g. a `save_pretrained` output.
        It waits for the forward pass in progress; sequences still decoding in
        another thread continue with the new weights (the server avoids that by
        draining its batch first, see `inference/sampler.py`).
        """
        state = _read_safetensors(Path(weights)) if isinstance(weights, str | PathLike) else weights
        current = self.model.state_dict(keep_vars=True)  # the live parameters and buffers themselves
        unknown = sorted(k for k in state if k not in current)
        if unknown:
            raise ModelError(f"weights do not fit model {self.model_name}: unknown tensors {unknown[:3]}")
        wrong = [k for k, v in state.items() if tuple(v.shape) != tuple(current[k].shape)]
        if wrong:
            k = wrong[0]
            raise ModelError(
                f"weights do not fit model {self.model_name}: {k} has shape {tuple(state[k].shape)},"
                f" expected {tuple(current[k].shape)}"
            )
        # What load_state_dict(strict=False) does for these tensors (copy_ under no_grad, converting
        # dtype and device), without its walk over every module: ~1 ms instead of ~2-7 ms per push
        # on the tiny model, which GRPO pays every step (benchmarks/README.md, grpo_step.py).
        # A tensor that already is the live one's storage (`share_parameters`) needs no copy.
        with self._lock, torch.no_grad():
            for name, value in state.items():
                live = current[name]
                if value.data_ptr() != live.data_ptr() or value.dtype != live.dtype or value.device != live.device:
                    live.copy_(value)
            if self.lean is not None:
                self.lean.refresh()
            self._weights_version += 1
            self._kept.clear()  # computed with the old weights
            return self._weights_version

    def share_parameters(self, model: torch.nn.Module) -> bool:
        """Make the live model's parameters use `model`'s storage (a trainer's policy of the same
        architecture, dtype and device): no second copy of the weights, and a push of `model`'s own
        tensors (`update_weights`) copies nothing. The trainer must not step the optimizer while this
        engine generates (on-policy RL: generate, then train) and must still call `update_weights`
        after each step, which marks the new weights (version, kept caches). False, and nothing
        changed, when the parameters' names, shapes, dtypes or devices differ."""
        mine, theirs = dict(self.model.named_parameters()), dict(model.named_parameters())
        if mine.keys() != theirs.keys() or any(
            (p.shape, p.dtype, p.device) != (theirs[k].shape, theirs[k].dtype, theirs[k].device)
            for k, p in mine.items()
        ):
            return False
        with self._lock, torch.no_grad():
            for name, param in mine.items():
                param.data = theirs[name].data
            if self.lean is not None:
                self.lean.refresh()
            self._weights_version += 1
            self._kept.clear()
        return True

    def use_prepacked_weights(self, enabled: bool) -> bool:
        """Whether the lean forward multiplies by prepacked weight copies (on where it can: the CPU,
        weights up to `PREPACKED_MAX_BYTES`, no `pad_multiple`). Copies are made again after every
        weight change, so an RL trainer whose rounds are short turns them off for its run
        (`rl_common.plan_weight_copies`). Returns whether copies are used now."""
        with self._lock:
            if self.lean is None or not self._prepack:
                return False
            self.lean.set_prepacked(enabled)
            return enabled

    def close(self) -> None:
        """Nothing to release beyond the model itself (garbage collected)."""


# --------------------------------------------------------------------------- session


@dataclass
class _Job:
    """One request: its `n` rows finish independently; it completes when all have."""

    request: GenerationRequest
    params: SamplingParams
    prompt_ids: tuple[int, ...]
    seed: int
    completions: list[Completion | None] = field(default_factory=list)
    remaining: int = 0
    weights_version: int = 0
    """The engine's weights when the job was admitted: its cache is kept only if they still are."""


@dataclass
class _Row:
    job: _Job
    index: int
    max_new: int
    generator: torch.Generator | None
    text: IncrementalText | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[tuple[tuple[int, float], ...]] | None = None
    finish_reason: FinishReason | None = None


@dataclass(frozen=True)
class PreparedRequest:
    """A request with its prompt tokenized and checked and its params resolved."""

    request: GenerationRequest
    params: SamplingParams
    prompt_ids: tuple[int, ...]


class HFSession:
    """The running batch: rows, their KV cache, attention mask and per-row sampling settings."""

    def __init__(self, engine: HFEngine) -> None:
        self.engine = engine
        self.rows: list[_Row] = []
        self.cache: Any = None  # transformers DynamicCache, batch-aligned with self.rows
        self.mask = torch.zeros(0, 0, dtype=torch.long, device=engine.device)  # (rows, cache_len)
        self.next_tokens = torch.zeros(0, dtype=torch.long, device=engine.device)  # fed at the next step
        self.positions = torch.zeros(0, dtype=torch.long, device=engine.device)  # next position id per row
        self.temperature = torch.zeros(0)  # the sampling params stay on the CPU (`choose_tokens`)
        self.top_k = torch.zeros(0, dtype=torch.long)
        self.top_p = torch.zeros(0)
        self.finished: list[tuple[GenerationRequest, tuple[Completion, ...]]] = []
        self.waiting: deque[list[PreparedRequest]] = deque()  # only for caches that can't be merged

    @property
    def num_rows(self) -> int:
        return len(self.rows) + sum(p.params.n for batch in self.waiting for p in batch)

    @property
    def width(self) -> int:
        """Columns of the cache (prompt, padding and generated tokens)."""
        return int(self.mask.shape[1])

    def prepare(self, request: GenerationRequest, default: SamplingParams) -> PreparedRequest:
        """Tokenize and check one request (raises `GenerationError` for a prompt that can't run)."""
        params = request.params or default
        ids = (
            request.prompt_token_ids
            if request.prompt_token_ids is not None
            else self.engine.tokenize(request.prompt, request.tools)  # type: ignore[arg-type]
        )
        if not ids:
            raise GenerationError("the prompt has no tokens")
        limit = self.engine.max_model_len
        if len(ids) >= limit:
            raise GenerationError(f"the prompt has {len(ids)} tokens; this model takes at most {limit - 1}")
        vocab = self.engine.model.config.vocab_size
        if any(t < 0 or t >= vocab for t in ids):
            raise GenerationError(f"prompt token ids must be in [0, {vocab})")
        return PreparedRequest(request, params, ids)

    def add(self, requests: Sequence[GenerationRequest], default: SamplingParams | None = None) -> None:
        prepared = [self.prepare(r, default or SamplingParams()) for r in requests]
        self.add_prepared(prepared)

    def add_prepared(self, prepared: Sequence[PreparedRequest]) -> None:
        """Prefill the prompts, sample each row's first token, merge the rows into the batch.

        Rows of a request whose `cache_key` has a kept cache (`kept_cache.py`) prefill only their new
        tokens on top of it (`_prefill_kept`); the others prefill their whole prompt (`_prefill`)."""
        if not prepared:
            return
        if self.rows and not _mergeable(self.cache):
            self.waiting.append(list(prepared))
            return
        rows = [row for p in prepared for row in self._make_rows(p)]
        kept = self._take_kept(rows)
        fresh = [row for row, entry in zip(rows, kept, strict=True) if entry is None]
        for group in self._prefill_groups(fresh, key=lambda row: row.job.prompt_ids):
            self._join(group, *self._prefill(group))
        continuing = [(row, entry) for row, entry in zip(rows, kept, strict=True) if entry is not None]
        for pairs in self._prefill_groups(continuing, key=id):  # batch-invariant: each row's new tokens alone
            self._join([row for row, _ in pairs], *self._prefill_kept(pairs))

    def _prefill_groups(self, items: list[Any], *, key: Callable[[Any], Any]) -> list[list[Any]]:
        """The items prefilled together: all of them; with `pad_multiple > 1` those of each `key`
        (a prompt, or a continued row alone), so that a prefill's shapes -- and with them the paths
        the CPU kernels take inside its attention, whose products some CPUs (MKL's AVX2 kernels) sum
        in another order for another width -- depend on that prompt or row alone."""
        if not items:
            return []
        if self.engine.pad_multiple == 1:
            return [items]
        groups: dict[Any, list[Any]] = {}
        for item in items:
            groups.setdefault(key(item), []).append(item)
        return list(groups.values())

    def _prefill(self, rows: list[_Row]) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """Cache, mask and last logits of the rows' whole prompts, left-padded to a common width.

        Each distinct prompt is prefilled once (n choices, or equal prompts, share it); its cache,
        mask and last logits are then gathered to one copy per row. Prompts of uneven length run as
        one packed row where the lean forward has them cheaper that way (`LeanDecoder.packs`)."""
        unique: dict[tuple[int, ...], int] = {}
        owner = [unique.setdefault(r.job.prompt_ids, len(unique)) for r in rows]
        width = _round_up(max(len(p) for p in unique), self.engine.pad_multiple)
        device = self.engine.device
        mask = torch.zeros((len(unique), width), dtype=torch.long, device=device)
        for i, p in enumerate(unique):
            mask[i, width - len(p) :] = 1
        lean = self.engine.lean
        if lean is not None and self.engine.pad_multiple == 1 and lean.packs([len(p) for p in unique], width):
            # prompts of uneven length: one packed row computes no padding (not batch-invariant:
            # a prompt's reductions would run over the other prompts' masked keys)
            from transformers import DynamicCache

            cache = DynamicCache(config=self.engine.model.config)
            with self.engine._lock, torch.inference_mode():
                logits = lean.prefill_packed(list(unique), width, cache).float()
        else:
            ids = torch.full((len(unique), width), self.engine.pad_token_id, dtype=torch.long, device=device)
            for i, p in enumerate(unique):
                ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long, device=device)
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            cache, logits = self._forward(ids, mask, positions, cache=None)
        if len(unique) < len(rows):
            index = torch.tensor(owner, dtype=torch.long, device=device)
            with torch.inference_mode():
                cache.reorder_cache(index)
            mask, logits = mask.index_select(0, index), logits.index_select(0, index)
        self.engine.kept_cache_stats["prefilled_tokens"] += sum(len(p) for p in unique)
        return cache, mask, logits

    def _prefill_kept(self, pairs: list[tuple[_Row, KeptCache]]) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """Cache, mask and last logits of rows that continue a kept cache: only the tokens after it are fed.

        Row i's columns are [pad, kept tokens, pad, new tokens]: the kept part is left-padded to a
        common width and the new part too, each width a multiple of `pad_multiple`, so a row's padding
        before either part is fixed modulo it by the row's own lengths and its log-probs do not depend
        on the other rows (`BATCH_INVARIANT_PAD`). The mask holds the hole; positions count real tokens."""
        from transformers import DynamicCache

        device, multiple = self.engine.device, self.engine.pad_multiple
        kept_lens = [len(entry.token_ids) for _, entry in pairs]
        new_ids = [row.job.prompt_ids[n:] for (row, _), n in zip(pairs, kept_lens, strict=True)]
        kept_width = _round_up(max(kept_lens), multiple)
        new_width = _round_up(max(len(t) for t in new_ids), multiple)
        ids = torch.full((len(pairs), new_width), self.engine.pad_token_id, dtype=torch.long, device=device)
        positions = torch.zeros((len(pairs), new_width), dtype=torch.long, device=device)
        mask = torch.zeros((len(pairs), kept_width + new_width), dtype=torch.long, device=device)
        for i, (n, tokens) in enumerate(zip(kept_lens, new_ids, strict=True)):
            mask[i, kept_width - n : kept_width] = 1
            mask[i, kept_width + new_width - len(tokens) :] = 1
            ids[i, new_width - len(tokens) :] = torch.tensor(tokens, dtype=torch.long, device=device)
            positions[i, new_width - len(tokens) :] = torch.arange(n, n + len(tokens), device=device)
        cache = DynamicCache(config=self.engine.model.config)
        pads = [kept_width - n for n in kept_lens]
        with torch.inference_mode():
            for i, layer in enumerate(cache.layers):  # each entry's (keys, values): (kv_heads, n, head_dim)
                keys = torch.stack([_left_pad(e.layers[i][0], pad, 1) for (_, e), pad in zip(pairs, pads, strict=True)])
                values = torch.stack([_left_pad(e.layers[i][1], pad, 1) for (_, e), pad in zip(pairs, pads, strict=True)])
                layer.update(keys, values)
        cache, logits = self._forward(ids, mask, positions, cache=cache)
        stats = self.engine.kept_cache_stats
        stats["reused"] += len(pairs)
        stats["reused_tokens"] += sum(kept_lens)
        stats["prefilled_tokens"] += sum(len(t) for t in new_ids)
        return cache, mask, logits

    def _join(self, rows: list[_Row], cache: Any, mask: torch.Tensor, logits: torch.Tensor) -> None:
        """Merge freshly prefilled rows into the batch and sample their first token."""
        new = _BatchState(
            cache=cache,
            mask=mask,
            positions=mask.sum(-1),
            temperature=torch.tensor([r.job.params.temperature for r in rows]),
            top_k=torch.tensor([r.job.params.top_k for r in rows], dtype=torch.long),
            top_p=torch.tensor([r.job.params.top_p for r in rows]),
        )
        self._merge(rows, new)
        self._advance(logits, first=len(self.rows) - len(rows))

    def _take_kept(self, rows: list[_Row]) -> list[KeptCache | None]:
        """The kept cache each row continues (one per request, shared by its n rows), or None."""
        taken: dict[int, KeptCache | None] = {}
        with self.engine._lock:
            for row in rows:
                job = row.job
                if id(job) not in taken:
                    key = job.request.cache_key
                    taken[id(job)] = (
                        None if key is None else self.engine._kept.take(key, job.prompt_ids, job.weights_version)
                    )
        return [taken[id(row.job)] for row in rows]

    def _keep(self, row: _Row, index: int) -> None:
        """Keep a finishing row's keys/values (batch row `index`) under its request's `cache_key`."""
        job = row.job
        key = job.request.cache_key
        if key is None or not job.request.keep_cache or job.params.n != 1 or not _mergeable(self.cache):
            return
        tokens = job.prompt_ids + tuple(row.token_ids[:-1])  # the last sampled token was never fed
        columns = self.mask[index].nonzero().squeeze(-1)
        assert columns.numel() == len(tokens), (columns.numel(), len(tokens))
        layers = tuple(
            (layer.keys[index].index_select(1, columns), layer.values[index].index_select(1, columns))
            for layer in self.cache.layers
        )
        with self.engine._lock:
            # not computed across a weight update
            if job.weights_version == self.engine.weights_version and self.engine._kept.put(
                key, KeptCache(tokens, layers, job.weights_version)
            ):
                self.engine.kept_cache_stats["kept"] += 1

    def step(self) -> list[tuple[GenerationRequest, tuple[Completion, ...]]]:
        """One decode step for every row; returns the requests whose choices have all finished."""
        self._drop_cancelled()
        if not self.rows and self.waiting:
            self.add_prepared(self.waiting.popleft())
        if self.rows:
            ones = torch.ones((len(self.rows), 1), dtype=torch.long, device=self.engine.device)
            self.mask = torch.cat([self.mask, ones], dim=1)
            self.cache, logits = self._forward(
                self.next_tokens.unsqueeze(-1), self.mask, self.positions.unsqueeze(-1), cache=self.cache
            )
            self.positions = self.positions + 1
            self._advance(logits, first=0)
        done, self.finished = self.finished, []
        return done

    # ----------------------------------------------------------------- internals

    def _make_rows(self, prepared: PreparedRequest) -> list[_Row]:
        params, request = prepared.params, prepared.request
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        job = _Job(
            request, params, prepared.prompt_ids, seed, [None] * params.n, params.n, self.engine.weights_version
        )
        needs_text = bool(params.stop) or request.on_token is not None
        max_new = min(params.max_tokens, self.engine.max_model_len - len(prepared.prompt_ids))
        rows = []
        for j in range(params.n):
            generator = None
            if not params.greedy:
                generator = torch.Generator()  # on the CPU, also for a GPU engine (`choose_tokens`)
                generator.manual_seed(derive_seed(seed, j))
            text = IncrementalText(self.engine.tokenizer, params.stop) if needs_text else None
            top = [] if params.top_logprobs else None
            rows.append(_Row(job, j, max_new, generator, text, top=top))
        return rows

    def _forward(
        self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, *, cache: Any
    ) -> tuple[Any, torch.Tensor]:
        """Logits (rows, vocab) of the last position, float32; the updated cache.

        With `pad_multiple > 1` and no lean decoder (whose products run on fixed row counts), a
        pass over fewer than `BATCH_INVARIANT_ROWS` rows runs with copies of the first row added
        (and dropped from the cache and logits after)."""
        from transformers import DynamicCache

        if cache is None:
            cache = DynamicCache(config=self.engine.model.config)
        rows = ids.shape[0]
        invariant_rows = self.engine.pad_multiple > 1 and self.engine.lean is None
        extra = max(0, BATCH_INVARIANT_ROWS - rows) if invariant_rows else 0
        with self.engine._lock, torch.inference_mode():
            if extra:
                index = torch.cat([torch.arange(rows), torch.zeros(extra, dtype=torch.long)]).to(ids.device)
                ids, mask, positions = ids[index], mask[index], positions[index]
                _select_cache_rows(cache, index)
            if self.engine.lean is not None:
                logits = self.engine.lean(ids, mask, positions, cache)
            else:
                out = self.engine.model(
                    input_ids=ids,
                    attention_mask=mask,
                    position_ids=positions,
                    **cache_kwarg(cache),
                    use_cache=True,
                    logits_to_keep=1,
                )
                cache, logits = returned_cache(out), out.logits[:, -1, :]
            if extra:
                _select_cache_rows(cache, torch.arange(rows, device=ids.device))
        return cache, logits[:rows].float()

    def _advance(self, logits: torch.Tensor, *, first: int) -> None:
        """Sample the next token of rows[first:] (whose logits these are), record it, retire finished rows."""
        rows = self.rows[first:]
        sl = slice(first, None)
        with torch.inference_mode():
            logprobs_all = _logprob_logits(logits, rows).log_softmax(dim=-1)
            tokens = choose_tokens(
                logits, self.temperature[sl], self.top_k[sl], self.top_p[sl], [r.generator for r in rows]
            )
            chosen = logprobs_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
            k = max((r.job.params.top_logprobs for r in rows), default=0)
            top_values, top_ids = logprobs_all.topk(k, dim=-1) if k else (None, None)
        self.next_tokens = torch.cat([self.next_tokens[:first], tokens])
        token_list, logprob_list = tokens.tolist(), chosen.tolist()
        top_pairs = (
            [list(zip(i, v, strict=True)) for i, v in zip(top_ids.tolist(), top_values.tolist(), strict=True)]
            if top_ids is not None and top_values is not None
            else None
        )
        keep = list(range(first))
        eos = self.engine.eos_token_ids
        for i, (row, token, logprob) in enumerate(zip(rows, token_list, logprob_list, strict=True)):
            params = row.job.params
            row.token_ids.append(token)
            row.logprobs.append(logprob)
            top = (
                tuple(top_pairs[i][: params.top_logprobs])
                if top_pairs is not None and params.top_logprobs
                else ()
            )
            if row.top is not None:
                row.top.append(top)
            if token in params.stop_token_ids or (token in eos and not params.ignore_eos):
                row.finish_reason = "stop"
            if row.text is not None:
                row.text.push(token)
                if row.text.stopped:
                    row.finish_reason = "stop"
            if row.finish_reason is None and len(row.token_ids) >= row.max_new:
                row.finish_reason = "length"
            if row.job.request.on_token is not None:
                assert row.text is not None
                if row.finish_reason is not None:
                    row.text.finish()
                new_text = row.text.take_new_text(final=row.finish_reason is not None)
                row.job.request.on_token(
                    TokenEvent(row.index, token, logprob, top, new_text, row.finish_reason)
                )
            if row.finish_reason is None:
                keep.append(first + i)
            else:
                self._keep(row, first + i)
                self._retire(row)
        if len(keep) < len(self.rows):
            self._select(keep)

    def _retire(self, row: _Row) -> None:
        job = row.job
        if row.text is not None:
            row.text.finish()
            text = row.text.text
        else:
            text = self.engine.tokenizer.decode(row.token_ids, skip_special_tokens=True)
        job.completions[row.index] = Completion(
            index=row.index,
            text=text,
            token_ids=tuple(row.token_ids),
            logprobs=tuple(row.logprobs),
            finish_reason=row.finish_reason or "stop",
            prompt_tokens=len(job.prompt_ids),
            completion_tokens=len(row.token_ids),
            prompt_token_ids=job.prompt_ids,
            top_logprobs=tuple(row.top) if row.top is not None else None,
            weights_version=self.engine.weights_version,
        )
        job.remaining -= 1
        if job.remaining == 0:
            completions = tuple(c for c in job.completions if c is not None)
            if job.request.on_finish is not None:
                job.request.on_finish(completions)
            self.finished.append((job.request, completions))

    def _drop_cancelled(self) -> None:
        cancelled = [
            i
            for i, r in enumerate(self.rows)
            if r.job.request.cancel is not None and r.job.request.cancel.is_set()
        ]
        if not cancelled:
            return
        for i in cancelled:
            self.rows[i].finish_reason = "cancelled"
            self._retire(self.rows[i])
        gone = set(cancelled)
        self._select([i for i in range(len(self.rows)) if i not in gone])

    def _select(self, keep: list[int]) -> None:
        """Keep only these rows (in this order) in every per-row tensor and the cache; trim dead columns."""
        self.rows = [self.rows[i] for i in keep]
        if not self.rows:
            self.cache = None
            self.mask = self.mask[:0, :0]
            for name in ("next_tokens", "positions", "temperature", "top_k", "top_p"):
                setattr(self, name, getattr(self, name)[:0])
            return
        host_index = torch.tensor(keep, dtype=torch.long)
        index = host_index.to(self.engine.device, non_blocking=True)
        for name in ("mask", "next_tokens", "positions"):
            setattr(self, name, getattr(self, name).index_select(0, index))
        for name in ("temperature", "top_k", "top_p"):
            setattr(self, name, getattr(self, name).index_select(0, host_index))
        dead = (
            int(self.mask.any(dim=0).long().argmax()) if _mergeable(self.cache) else 0
        )  # leading pad-only columns
        dead -= dead % self.engine.pad_multiple
        self.mask = self.mask[:, dead:]
        for layer in self.cache.layers:
            if getattr(layer, "is_initialized", True) and layer.keys is not None and layer.keys.numel():
                layer.keys = layer.keys.index_select(0, index)[:, :, dead:, :]
                layer.values = layer.values.index_select(0, index)[:, :, dead:, :]

    def _merge(self, rows: list[_Row], new: _BatchState) -> None:
        """Append rows with their fresh cache to the running batch, left-padding the shorter side."""
        if not self.rows:
            self.rows = list(rows)
            self.cache, self.mask, self.positions = new.cache, new.mask, new.positions
            self.temperature, self.top_k, self.top_p = new.temperature, new.top_k, new.top_p
            self.next_tokens = self.next_tokens[:0]
            return
        old_len, new_len = self.mask.shape[1], new.mask.shape[1]
        width = max(old_len, new_len)
        self.mask = torch.cat(
            [_left_pad(self.mask, width - old_len, 1), _left_pad(new.mask, width - new_len, 1)]
        )
        for old_layer, new_layer in zip(self.cache.layers, new.cache.layers, strict=True):
            old_layer.keys = torch.cat(
                [_left_pad(old_layer.keys, width - old_len, 2), _left_pad(new_layer.keys, width - new_len, 2)]
            )
            old_layer.values = torch.cat(
                [
                    _left_pad(old_layer.values, width - old_len, 2),
                    _left_pad(new_layer.values, width - new_len, 2),
                ]
            )
        self.positions = torch.cat([self.positions, new.positions])
        self.temperature = torch.cat([self.temperature, new.temperature])
        self.top_k = torch.cat([self.top_k, new.top_k])
        self.top_p = torch.cat([self.top_p, new.top_p])
        self.rows.extend(rows)


@dataclass
class _BatchState:
    cache: Any
    mask: torch.Tensor
    positions: torch.Tensor
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor


def _logprob_logits(logits: torch.Tensor, rows: Sequence[_Row]) -> torch.Tensor:
    """`logits` divided, row by row, by the temperature of rows that ask for tempered log-probs."""
    temps = [
        r.job.params.temperature if r.job.params.tempered_logprobs and r.job.params.temperature > 0 else 1.0
        for r in rows
    ]
    if all(t == 1.0 for t in temps):
        return logits
    return logits / torch.tensor(temps, dtype=logits.dtype).to(logits.device, non_blocking=True).unsqueeze(-1)


def _select_cache_rows(cache: Any, index: torch.Tensor) -> None:
    for layer in cache.layers:
        if getattr(layer, "is_initialized", True) and layer.keys is not None and layer.keys.numel():
            layer.keys = layer.keys.index_select(0, index)
            layer.values = layer.values.index_select(0, index)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _rows(prepared: deque[PreparedRequest]) -> int:
    return sum(p.params.n for p in prepared)


def _left_pad(t: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    if n == 0:
        return t
    shape = list(t.shape)
    shape[dim] = n
    return torch.cat([torch.zeros(shape, dtype=t.dtype, device=t.device), t], dim=dim)


def _mergeable(cache: Any) -> bool:
    """Only plain full-attention dynamic layers can be padded and concatenated along the batch."""
    from transformers.cache_utils import DynamicLayer

    return cache is not None and all(type(layer) is DynamicLayer for layer in cache.layers)


def _pad_token_id(tokenizer: Any, model: Any) -> int:
    for candidate in (
        tokenizer.pad_token_id,
        getattr(model.config, "pad_token_id", None),
        tokenizer.eos_token_id,
    ):
        if candidate is not None:
            return int(candidate)
    return 0


def _eos_token_ids(tokenizer: Any, model: Any) -> set[int]:
    ids: set[int] = set()
    for source in (
        tokenizer.eos_token_id,
        getattr(getattr(model, "generation_config", None), "eos_token_id", None),
    ):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, list | tuple):
            ids.update(int(t) for t in source)
    return ids


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files or not all(f.is_file() for f in files):
        raise ModelError(f"no safetensors weights at {path}")
    state: dict[str, torch.Tensor] = {}
    try:
        for f in files:
            state.update(load_file(str(f)))
    except Exception as err:  # safetensors raises its own error types for bad files
        raise ModelError(f"cannot read weights from {f}: {err}") from None
    return state
