"""Log-probs of completions that share prompts, with each prompt run once.

GRPO samples `num_generations` completions per prompt and DPO scores a chosen
and a rejected answer after the same prompt: a padded batch of full rows runs
each prompt through the model several times. Here the distinct prompts run
once (left-padded, so each prompt's last token sits in the last column), their
key/value cache is gathered to one copy per row (`index_select`, differentiable:
the backward sums each prompt's gradient over its rows), and the completions
run on top of it (right-padded). Log-probs and gradients equal those of the
full rows up to float rounding (tested against each row run alone); the tokens
computed fall from B·(Lp + Lc) to P·Lp + B·Lc.

Layout: everything is completion-major — column j of a row is completion
token j, predicted from the prompt and completion tokens < j.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from rollout.data.collate import flat_tensor, to_additive_mask
from rollout.losses.logps import decoder_and_head, sequence_logps, unwrap_peft
from rollout.models.arch import forward_cost, hidden_size, sliding_window
from rollout.models.cpu_matmul import project
from rollout.models.kv_cache import cache_kwarg, returned_cache

if TYPE_CHECKING:
    from transformers import PretrainedConfig


@dataclass(frozen=True)
class PrefixBatch:
    """B completion rows over P ≤ B distinct prompts."""

    prompt_ids: torch.Tensor  # [P, Lp] left-padded
    prompt_mask: torch.Tensor  # [P, Lp] bool
    completion_ids: torch.Tensor  # [B, Lc] right-padded
    completion_mask: torch.Tensor  # [B, Lc] bool: real completion tokens
    owner: torch.Tensor  # [B] long: the prompt row of each completion row
    loss_mask: torch.Tensor | None = None
    """[B, Lc] bool: the completion tokens a loss counts, when not all of them (a multi-turn
    episode's env and tool tokens are attended to but not trained on); None: `completion_mask`."""
    completion_index: torch.Tensor | None = field(default=None, repr=False, compare=False)
    """[N] long: the flat positions (row * Lc + column) of `completion_mask`'s real tokens, made by
    `to` where the mask is (on the host, before a device copy) so that nothing on a device has to
    read the mask's count back; None: found from the mask when asked (`completion_tokens`)."""

    @property
    def target_mask(self) -> torch.Tensor:
        """The tokens losses count: `loss_mask` where given, else every real completion token."""
        return self.completion_mask if self.loss_mask is None else self.loss_mask

    @property
    def num_rows(self) -> int:
        return int(self.completion_ids.shape[0])

    @property
    def num_tokens(self) -> int:
        """Tokens the forward computes (each prompt once)."""
        return int(self.prompt_mask.sum()) + int(self.completion_mask.sum())

    @property
    def num_row_tokens(self) -> int:
        """Tokens of the rows as full sequences (prompt + completion each)."""
        return int(self.prompt_mask.sum(1)[self.owner].sum()) + int(self.completion_mask.sum())

    def to(self, device: Any) -> PrefixBatch:
        return PrefixBatch(*(t.to(device) for t in (self.prompt_ids, self.prompt_mask, self.completion_ids,
                                                     self.completion_mask, self.owner)),
                           loss_mask=None if self.loss_mask is None else self.loss_mask.to(device),
                           completion_index=self._completion_index().to(device))

    def _completion_index(self) -> torch.Tensor:
        if self.completion_index is not None:
            return self.completion_index
        return self.completion_mask.reshape(-1).nonzero().squeeze(1)  # on a device, a read-back

    def completion_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """`x[self.completion_mask]` for an `x` of [B, Lc, ...]: its real completion tokens' entries,
        in the same order and bits, gathered by `completion_index` (no device read-back)."""
        return x.reshape(-1, *x.shape[2:]).index_select(0, self._completion_index())

    def select(self, rows: Sequence[int]) -> PrefixBatch:
        """Some rows, with only the prompts they use (in their original order). The completion
        columns stay as they are, so [B, Lc] tensors of this batch index the same way."""
        idx = torch.as_tensor(list(rows), dtype=torch.long, device=self.owner.device)
        used, owner = torch.unique(self.owner[idx], sorted=True, return_inverse=True)
        pmask = self.prompt_mask[used]
        keep = int(pmask.sum(1).max())
        return PrefixBatch(self.prompt_ids[used][:, -keep:], pmask[:, -keep:], self.completion_ids[idx],
                           self.completion_mask[idx], owner,
                           loss_mask=None if self.loss_mask is None else self.loss_mask[idx])


def collate_prefix(
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    pad_id: int,
    loss_masks: Sequence[Sequence[bool] | None] | None = None,
) -> PrefixBatch:
    """Rows (prompt_i + completion_i); equal prompts are stored once, in order of first appearance.

    `loss_masks[i]` (one bool per completion token, or None for all) sets the batch's `loss_mask`
    when any row has one; rows without one count every token."""
    if len(prompts) != len(completions) or not prompts:
        raise ValueError("collate_prefix needs one prompt per completion and at least one row")
    index: dict[tuple[int, ...], int] = {}
    owner = [index.setdefault(tuple(p), len(index)) for p in prompts]
    unique = list(index)
    if any(not p for p in unique):
        raise ValueError("every row needs at least one prompt token")
    lp = max(len(p) for p in unique)
    lc = max(1, max(len(c) for c in completions))
    if loss_masks is not None and len(loss_masks) != len(completions):
        raise ValueError("collate_prefix needs one loss mask (or None) per completion")
    # Flat lists, one buffer per tensor (`flat_tensor`): RL collates a batch on every step, and a
    # tensor per row cost ~195 us for 16 rows against ~30 us so.
    prompt_ids: list[int] = []
    prompt_mask: list[bool] = []
    for p in unique:
        pad = lp - len(p)
        prompt_ids += [pad_id] * pad
        prompt_ids += p
        prompt_mask += [False] * pad
        prompt_mask += [True] * len(p)
    completion_ids: list[int] = []
    completion_mask: list[bool] = []
    for c in completions:
        pad = lc - len(c)
        completion_ids += c
        completion_ids += [pad_id] * pad
        completion_mask += [True] * len(c)
        completion_mask += [False] * pad
    loss_mask = None
    if loss_masks is not None and any(m is not None for m in loss_masks):
        flat: list[bool] = []
        for i, (m, c) in enumerate(zip(loss_masks, completions, strict=True)):
            if m is not None and len(m) != len(c):
                raise ValueError(f"row {i}: a loss mask of {len(m)} for {len(c)} completion tokens")
            flat += [True] * len(c) if m is None else m
            flat += [False] * (lc - len(c))
        loss_mask = flat_tensor(flat, (len(completions), lc), torch.bool)
    return PrefixBatch(flat_tensor(prompt_ids, (len(unique), lp), torch.long),
                       flat_tensor(prompt_mask, (len(unique), lp), torch.bool),
                       flat_tensor(completion_ids, (len(completions), lc), torch.long),
                       flat_tensor(completion_mask, (len(completions), lc), torch.bool),
                       flat_tensor(owner, (len(completions),), torch.long), loss_mask)


def pad_rows(values: Sequence[Sequence[float]], width: int) -> torch.Tensor:
    """[B, width] float32: row i holds values[i] from column 0, zeros after (completion-major)."""
    flat: list[float] = []
    for row in values:
        n = len(row) if row else 0  # a row without values (empty, or None): zeros
        if n > width:
            raise ValueError(f"pad_rows: a row of {n} values for {width} columns")
        if n:
            flat += row
        flat += [0.0] * (width - n)
    return flat_tensor(flat, (len(values), width), torch.float32)


def prefix_outputs(
    module: Any, batch: PrefixBatch, field: str, config: PretrainedConfig, *, causal_lm: Any = None
) -> torch.Tensor:
    """[B, Lc, ·]: `field` of `module`'s output at the position that predicts each completion token.

    `module` is a decoder (field "last_hidden_state") or a whole causal LM ("logits"); `config`
    is its transformers config (it builds the key/value cache and sets the layout). `causal_lm`:
    the causal LM whose decoder `module` is, when it is one: packed rows then run through
    `lean_decoder.lean_hidden_states` where it can stand in for `module(...)`."""
    return _predictor_outputs(module, batch, field, config, causal_lm)[:, :-1]


def prefix_last_hidden(
    decoder: Any, batch: PrefixBatch, config: PretrainedConfig, *, model: Any = None
) -> torch.Tensor:
    """[B, H]: the decoder's last hidden state at each row's last real token (its last completion
    token; the prompt's last token for an empty completion) -- what a reward head scores. `model`:
    the transformers model whose decoder `decoder` is (packed rows then run lean, as in
    `prefix_outputs`)."""
    hidden = _predictor_outputs(decoder, batch, "last_hidden_state", config, model)
    length = batch.completion_mask.sum(1)
    return hidden[torch.arange(hidden.shape[0], device=hidden.device), length]


def _predictor_outputs(
    module: Any, batch: PrefixBatch, field: str, config: PretrainedConfig, causal_lm: Any = None
) -> torch.Tensor:
    """[B, Lc + 1, ·]: column j holds `field` at the position just before completion token j (the
    prompt's last token for j = 0, completion token j - 1 after). Columns past a row's length hold
    some valid position of the row, to be masked by the caller."""
    packed = packed_layout(batch, config, next(module.parameters()).dtype)
    sharded = _fsdp_sharded(module)
    if sharded:  # every rank must call the sharded modules alike: one layout for all
        packed = _agreed_layout(packed, batch.completion_ids.device)
    if packed is not None:
        out = None
        if (causal_lm is not None and not sharded and field == "last_hidden_state"
                and getattr(causal_lm, "model", None) is module and packed.attention_mask.dtype == torch.bool):
            from rollout.models.lean_decoder import lean_hidden_states

            out = lean_hidden_states(causal_lm, packed.input_ids, packed.position_ids, packed.attention_mask)
        if out is None:
            out = getattr(module(input_ids=packed.input_ids, attention_mask=packed.attention_mask,
                                 position_ids=packed.position_ids, use_cache=False), field)
        return take_rows(out.flatten(0, 1), packed.row * out.shape[1] + packed.column)
    prompt_out, completion_out = _prefix_forward(module, batch, config)
    last_prompt = take_rows(getattr(prompt_out, field)[:, -1], batch.owner)  # left padding: the last column is real
    return torch.cat([last_prompt[:, None], getattr(completion_out, field)], dim=1)


def take_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`x[index]` for a tensor `index` of rows of `x` that repeat (a prompt's position read by each of
    its completions), with a gradient that is the same bits run to run. On the CPU the backward of
    `x[index]` (`index_put_` with accumulation) adds the repeated rows' gradients with atomic adds on
    several threads, in whatever order the threads reach them; `index_select`'s (`index_add_`) adds
    them in index order, as one thread does. Measured: a GRPO batch's gradients at two threads took
    14 different values in 20 backward passes through `x[index]`, one through this. On CUDA it is
    the other way round (`index_add_` adds atomically, `index_put_` sorts the indices first:
    torch's `use_deterministic_algorithms` notes), so there `x[index]` stays."""
    if x.device.type != "cpu":
        return x[index]
    return x.index_select(0, index.reshape(-1)).view(*index.shape, *x.shape[1:])


@dataclass(frozen=True)
class PackedRows:
    """Each prompt with all its completions in one row: [prompt | completion a | completion b | ...],
    right-padded. The 4D mask lets a completion see its prompt and itself (causally), never another
    completion; positions restart after the prompt for each completion. So each token is computed
    once, with no padding inside the group: what the per-row cache layout pads to the longest
    completion is not computed at all."""

    input_ids: torch.Tensor  # [P, L]
    position_ids: torch.Tensor  # [P, L]
    attention_mask: torch.Tensor  # [P, 1, L, L]: bool for sdpa, additive float for eager
    row: torch.Tensor  # [B, 1]: the packed row of each completion row (its prompt's)
    column: torch.Tensor  # [B, Lc + 1]: where in it each predictor of `_predictor_outputs` sits


MAX_PACKED_MASK = 1 << 26
"""Largest P·L² (elements of the packed 4D mask) the packed layout is used for (64 MiB as bool)."""


def packed_layout(
    batch: PrefixBatch, config: PretrainedConfig, dtype: torch.dtype = torch.float32, *, force: bool | None = None
) -> PackedRows | None:
    """The packed rows of `batch` when they cost fewer FLOPs than the cache layout, else None.

    Per layer, a token's projections cost ~24·h² FLOPs and each (query, key) pair ~4·h, so the
    cost is compared as 6·h·tokens + pairs: the cache layout computes P·Lp + B·Lc tokens (every
    completion padded to the longest) and P·Lp² + B·Lc·(Lp + Lc) pairs, and pays its second
    forward call as `call_tokens` more tokens (far more on a GPU, where a call is its kernel
    launches); the packed one P·L tokens and P·L² pairs (every
    completion's queries against the whole group, most of them masked).
    Short completions of uneven length (RL on small tasks) pack; long ones with a long shared
    prompt keep the cache. Only for the dense-mask attention kernels (sdpa, eager), with no
    sliding window shorter than a packed row. `dtype`: the eager kernel's additive mask's.
    `force`: True packs whatever the cost, False never packs (tests compare the two layouts)."""
    kernel = getattr(config, "_attn_implementation", None)
    if force is False or kernel not in ("sdpa", "eager"):
        return None
    n_prompts, lp = batch.prompt_ids.shape
    n_rows, lc = batch.completion_ids.shape
    host = torch.cat([batch.prompt_mask.sum(1), batch.completion_mask.sum(1), batch.owner]).tolist()  # one copy
    plen, clen, owner = host[:n_prompts], host[n_prompts : n_prompts + n_rows], host[n_prompts + n_rows :]
    group = [0] * n_prompts
    for b, p in enumerate(owner):
        group[p] += clen[b]
    width = max(plen[p] + group[p] for p in range(n_prompts))
    window = sliding_window(config)
    if n_prompts * width * width > MAX_PACKED_MASK or (window is not None and width > window):
        return None
    device = batch.completion_ids.device
    if force is None and not packing_is_cheaper(config, n_prompts, lp, n_rows, lc, width, device.type):
        return None
    # host-side layout: each row's segment (-2 pad, -1 prompt, b completion row b) and positions
    segment = [[-1] * n for n in plen]
    position = [list(range(n)) for n in plen]
    start = [0] * n_rows
    for b, p in enumerate(owner):
        start[b] = len(segment[p])
        segment[p] += [b] * clen[b]
        position[p] += range(plen[p], plen[p] + clen[b])
    for p in range(n_prompts):
        pad = width - len(segment[p])
        segment[p] += [-2] * pad
        position[p] += [0] * pad
    j = torch.arange(lc + 1)
    length, first = torch.tensor(clen), torch.tensor(start)
    last_prompt = torch.tensor(plen)[batch.owner.cpu()] - 1
    column = torch.where((j[None, :] >= 1) & (j[None, :] <= length[:, None]),
                         first[:, None] + j[None, :] - 1, last_prompt[:, None])
    segment = torch.tensor(segment, device=device)
    real = segment != -2
    causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
    # a query sees the prompt and its own segment, causally; a pad query sees the prompt (so no row
    # of the softmax is empty), and no query sees a pad
    mask = causal & real[:, None, :] & ((segment[:, None, :] == -1) | (segment[:, None, :] == segment[:, :, None]))
    # the prompt's tokens (taken from after its left padding), then each completion's where its segment is
    shift = torch.tensor([[lp - n] for n in plen], device=device)
    src = (torch.arange(width, device=device)[None, :] + shift).clamp(max=lp - 1)
    ids = torch.gather(batch.prompt_ids, 1, src).masked_fill(segment != -1, 0)  # pads: any id, masked
    dest_col = batch.completion_tokens(first.to(device)[:, None] + torch.arange(lc, device=device)[None, :])
    ids[batch.completion_tokens(batch.owner[:, None].expand(n_rows, lc)), dest_col] = batch.completion_tokens(
        batch.completion_ids)
    attention_mask = mask[:, None] if kernel == "sdpa" else to_additive_mask(mask[:, None], dtype)
    return PackedRows(ids, torch.tensor(position, device=device), attention_mask, batch.owner[:, None], column.to(device))


def _fsdp_sharded(module: Any) -> bool:
    """Whether some part of `module` is an FSDP2 `fully_shard` unit (its forward all-gathers)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return False
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in module.modules())


def _agreed_layout(packed: PackedRows | None, device: Any) -> PackedRows | None:
    """`packed` where every rank's batch packs, else None on every rank. Under FSDP the two
    layouts make different numbers of forward calls (one, or the prompt pass then the completion
    pass), each all-gathering the parameters; ranks with different rows could choose differently
    and wait on each other forever. One all-reduce of a flag (MIN) per forward settles it."""
    flag = torch.tensor([0 if packed is None else 1], device=device)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
    return packed if int(flag) == 1 else None


CALL_TOKENS = 64
"""What the cache layout's second forward call costs whatever the model's size, counted as this
many tokens of projections: the weights read once more forward and backward and the gradients
summed over two calls. Fitted on the 48M model (`benchmarks/bench_common.MODEL_SIZES["mid"]`,
h = 640) on one CPU thread: forward + backward of 16 shapes in both layouts, time ~ FLOPs + a
second call, put the call at ~60 tokens (~180 ms)."""

CALL_DISPATCH = 1 << 21
"""The rest of a forward call's cost, a fixed time per layer (dispatch, kernel launches, the
backward's nodes), is worth fewer tokens the wider the model: `CALL_DISPATCH / h²` of them. Fitted
on the tiny Qwen2 (h = 128, forward + backward of 64 shapes on one CPU thread, 16 on two): the
second call cost ~137 tokens on one thread and ~269 on two, so 64 + 2^21 / 128² = 192; 69 at
h = 640, 66 at h = 1024. With 64 alone the DPO batches of `benchmarks/dpo_throughput.py` (16
pairs, short answers) kept the cache layout, which ran them 1.4-1.5x slower."""


CALL_LAUNCHES = 1 << 32
"""On a GPU the second call costs its kernel launches instead: ~45 a layer forward and backward,
each ~8 µs of host time in which the device (~400 TFLOP/s on bf16 products) could have run a token's
24·h² FLOPs per layer for ~6e9 / h² tokens; taken as 2^32 / h² (4,096 tokens at h = 1024, 256 at
h = 4096, where a call's arithmetic hides its launches). Measured on an H200 (2026-11-27, bf16,
`grpo_step.py --model large`: h = 1024, 8 prompts x 8 completions x 32 tokens): the training pass
took 0.051 s/step packed and 0.115 with the cache's two calls, at equal tokens, where the CPU's
price (66 tokens there) kept the cache layout."""


def call_tokens(config: PretrainedConfig, device_type: str = "cpu") -> int:
    """The cost of one more forward call in tokens of `forward_cost`: `CALL_TOKENS` + `CALL_DISPATCH` / h²
    on the CPU, `CALL_TOKENS` + `CALL_LAUNCHES` / h² on an accelerator (`device_type` other than cpu)."""
    h = hidden_size(config)
    return CALL_TOKENS + (CALL_DISPATCH if device_type == "cpu" else CALL_LAUNCHES) // (h * h)


def packing_is_cheaper(config: PretrainedConfig, n_prompts: int, lp: int, n_rows: int, lc: int, width: int,
                       device_type: str = "cpu") -> bool:
    """Whether P packed rows of `width` cost less than the cache layout's prompt pass (P x `lp`) and
    completion pass (B x `lc`) with its second call (`call_tokens`) on this kind of device."""
    packed = forward_cost(config, n_prompts * width, n_prompts * width * width)
    cache = forward_cost(config, n_prompts * lp + n_rows * lc + call_tokens(config, device_type),
                         n_prompts * lp * lp + n_rows * lc * (lp + lc))
    return packed < cache


def _prefix_forward(module: Any, batch: PrefixBatch, config: PretrainedConfig) -> tuple[Any, Any]:
    """The prompt pass (each prompt once) and the completion pass on its gathered cache."""
    from transformers import DynamicCache

    pmask = batch.prompt_mask.long()
    prompt_out = module(
        input_ids=batch.prompt_ids, attention_mask=pmask, position_ids=(pmask.cumsum(1) - 1).clamp(min=0),
        **cache_kwarg(DynamicCache(config=config)), use_cache=True,
    )
    cache = returned_cache(prompt_out)
    if cache is None:
        raise RuntimeError("the model returned no key/value cache (is gradient checkpointing on?)")
    cache.reorder_cache(batch.owner)  # one copy of its prompt's keys/values per row
    lengths = pmask.sum(1)[batch.owner]
    lc = batch.completion_ids.shape[1]
    completion_out = module(
        input_ids=batch.completion_ids,
        attention_mask=torch.cat([pmask[batch.owner], batch.completion_mask.long()], dim=1),
        position_ids=lengths[:, None] + torch.arange(lc, device=lengths.device)[None, :],
        **cache_kwarg(cache), use_cache=True,
    )
    return prompt_out, completion_out


def prefix_logps(
    model: Any, batch: PrefixBatch, *, with_entropy: bool = False, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[B, Lc] log p(completion token j | prompt, tokens < j) (0 off the mask) and, optionally, the
    per-token entropies [B, Lc] (detached). The LM head runs only at real completion tokens, unless
    the model transforms its logits (soft-capping, scaling), when its own full forward is used.

    `temperature`: the distribution is softmax(logits / temperature), the one RL samples from
    (as TRL and verl train it), so that ratios and gradients are of the sampling policy."""
    sel = batch.completion_mask
    parts = decoder_and_head(model)
    if parts is not None:
        base = unwrap_peft(model)
        hidden = prefix_outputs(parts[0], batch, "last_hidden_state", base.config, causal_lm=base)
        logits = project(parts[1], batch.completion_tokens(hidden)).float()
    else:
        logits = batch.completion_tokens(prefix_outputs(model, batch, "logits", unwrap_peft(model).config)).float()
    if temperature != 1.0:
        logits = logits / temperature
    logp_all = F.log_softmax(logits, dim=-1)
    picked = logp_all.gather(1, batch.completion_tokens(batch.completion_ids).unsqueeze(1)).squeeze(1)
    logps = torch.zeros(sel.shape, dtype=picked.dtype, device=picked.device).masked_scatter(sel, picked)
    entropy = None
    if with_entropy:
        with torch.no_grad():  # -sum p log p, p from softmax: `logp_all.exp()` takes the CPU's slow
            # path wherever log p < -87 (exp underflows), ~10x slower on a peaked policy's rows
            ent = -(torch.softmax(logits.detach(), dim=-1) * logp_all.detach()).sum(-1)
        entropy = torch.zeros(sel.shape, dtype=ent.dtype, device=ent.device).masked_scatter(sel, ent)
    return logps, entropy


def frozen_prefix_logps(
    model: Any, batch: PrefixBatch, *, adapter_disabled: bool = False, temperature: float = 1.0
) -> torch.Tensor:
    """`prefix_logps` without grad, in eval mode (the reference, or old log-probs)."""
    guard = model.disable_adapter() if adapter_disabled else nullcontext()
    with eval_mode(model), torch.no_grad(), guard:
        return prefix_logps(model, batch, temperature=temperature)[0]


@contextmanager
def eval_mode(model: Any) -> Iterator[None]:
    """`model` in eval mode inside, back in training mode after if it was. A model kept in eval
    (a frozen reference copy) is left alone: switching walks every module twice a call."""
    if not model.training:
        yield
        return
    model.eval()
    try:
        yield
    finally:
        model.train()


def rows_logps(model: Any, tokens: Any, shared: PrefixBatch | None) -> tuple[torch.Tensor, torch.Tensor]:
    """`sequence_logps` of a batch's rows (log-prob sums [B] float32, token counts [B] long): from
    `shared` (each prompt run once) when given, else from the full rows `tokens`. Over `shared`'s
    target tokens (its `loss_mask` where it has one)."""
    if shared is None:
        return sequence_logps(model, tokens)
    logps, _ = prefix_logps(model, shared)
    if shared.loss_mask is not None:
        logps = logps.masked_fill(~shared.loss_mask, 0.0)
    return logps.sum(1), shared.target_mask.sum(1)


def collate_shared_pairs(pairs: Sequence[Any], pad_id: int) -> PrefixBatch | None:
    """The pairs as a PrefixBatch — rows 0..n-1 chosen, n..2n-1 rejected, each prompt once — or
    None when some pair's chosen and rejected do not start with the same prompt tokens (then the
    full rows of `collate_pairs` are used)."""
    prompts, completions = [], []
    for side in ("chosen", "rejected"):
        for p in pairs:
            ids, cut = (p.chosen_ids, p.prompt_len_chosen) if side == "chosen" else (p.rejected_ids,
                                                                                      p.prompt_len_rejected)
            prompts.append(tuple(ids[:cut]))
            completions.append(tuple(ids[cut:]))
    n = len(pairs)
    if any(prompts[i] != prompts[n + i] or not prompts[i] for i in range(n)):
        return None
    return collate_prefix(prompts, completions, pad_id)
