"""The "bare PyTorch" yardstick: the same SFT / DPO batches through a minimal training loop.

    .venv/bin/python benchmarks/bare_loop.py sft --threads 1 --steps 60     # tok/s, padded and packed SFT
    .venv/bin/python benchmarks/bare_loop.py dpo --threads 1 --steps 60     # steps/s, DPO
    make bench                                                               # runs it beside rollout and TRL

No framework: the tiny Qwen2 loaded with transformers (float32, sdpa), batches made
before the loop with rollout's own tokenizer, planner and collator (`tokenize_sft` +
`collate_padded`, or packed: `MicroBatchPlan` bfd + `collate_packed`; `tokenize_pairs` +
`collate_pairs`: the same rows, padding and loss masks as rollout trains on), then per step: forward, loss, backward,
`clip_grad_norm_(1.0)`, `torch.optim.AdamW(fused=True)`, `zero_grad`. Like rollout and
TRL it projects only the loss positions through the LM head. Nothing is recorded or
logged inside the loop. It is the floor a framework's step could reach on this machine
with this math: the issue's target is rollout >= 0.95 of it.

SFT: cross-entropy, mean over the step's target tokens. DPO: sigmoid loss, beta 0.1,
log-probs summed over the answer tokens, reference = a second, separately loaded copy
scored every step under `torch.no_grad()`. Settings (steps, warm-up, batch, max length,
threads, lr) come from sft_throughput.py's / dpo_throughput.py's arguments, and the
runners return those scripts' `Measurement`, so `run_all.py` interleaves them with the
rollout and TRL runs. Batches are drawn in a seeded random order (seed 0), cycling
through the data.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import dpo_throughput
import sft_throughput

DPO_LR = 5e-4
DPO_BETA = 0.1


def run_bare_sft(
    work: Path, model_dir: Path, data_path: Path, args: argparse.Namespace, *, packed: bool
) -> sft_throughput.Measurement:
    """Padded SFT, or packed: rollout's bfd rows (`MicroBatchPlan`, the same seed, so the same
    rows per step as rollout trains on) collated by `collate_packed` and passed to the model as
    transformers takes them (the 4D block-diagonal bool mask and restarting `position_ids`)."""
    import torch
    import torch.nn.functional as F

    from rollout.data.collate import collate_packed, collate_padded
    from rollout.data.jsonl import read_rows
    from rollout.data.loader import DataCursor, MicroBatchPlan, iterate_micro_batches
    from rollout.data.tokenize import tokenize_sft

    tok, model = _load(model_dir, args.threads)
    rows, _ = read_rows(data_path, "sft")
    samples, _ = tokenize_sft(rows, tok, loss_on=args.loss_on, max_seq_len=args.max_seq_len)
    if packed:
        plan = MicroBatchPlan([len(s.input_ids) for s in samples], micro_batch_size=args.batch_size,
                              packing="bfd", max_seq_len=args.max_seq_len, seed=sft_throughput.SEED)
        stream = iterate_micro_batches(plan, DataCursor())
        batches = [collate_packed(next(stream)[1], samples, tok.pad_token_id) for _ in range(args.steps)]
    else:
        batches = [collate_padded(chunk, tok.pad_token_id) for chunk in _chunks(samples, args)]
    decoder, head = model.get_decoder(), model.get_output_embeddings()

    def step_loss(batch: Any) -> Any:
        valid = batch.loss_mask[:, 1:]
        positions = batch.position_ids if packed else None
        hidden = decoder(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=positions,
                         use_cache=False)
        logits = head(hidden.last_hidden_state[:, :-1][valid])
        return F.cross_entropy(logits, batch.input_ids[:, 1:][valid])

    marks, losses = _train(model, batches, step_loss, lr=sft_throughput.LR)
    first, last = args.warmup_steps, args.steps
    return sft_throughput.Measurement(
        tokens=sum(b.num_tokens for b in batches[first:last]),
        seconds=marks[last - 1] - marks[first - 1],
        final_loss=float(torch.stack(losses[-sft_throughput.LOSS_WINDOW :]).mean()),
    )


def run_bare_dpo(
    work: Path, model_dir: Path, data_path: Path, args: argparse.Namespace
) -> dpo_throughput.Measurement:
    import torch
    import torch.nn.functional as F

    from rollout.data.collate import collate_pairs
    from rollout.data.jsonl import read_rows
    from rollout.data.tokenize import tokenize_pairs

    tok, model = _load(model_dir, args.threads)
    _, reference = _load(model_dir, args.threads)
    reference.eval().requires_grad_(False)
    rows, _ = read_rows(data_path, "preference")
    pairs, _ = tokenize_pairs(rows, tok, max_seq_len=args.max_seq_len)
    batches = [collate_pairs(chunk, tok.pad_token_id)[0] for chunk in _chunks(pairs, args)]

    def answer_logps(m: Any, batch: Any) -> Any:  # [2B]: summed log-probs of each row's answer tokens
        valid = batch.loss_mask[:, 1:]
        hidden = m.get_decoder()(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
        logits = m.get_output_embeddings()(hidden.last_hidden_state[:, :-1][valid])
        token_logps = logits.log_softmax(-1).gather(-1, batch.input_ids[:, 1:][valid].unsqueeze(-1)).squeeze(-1)
        row = torch.arange(valid.shape[0]).unsqueeze(1).expand_as(valid)[valid]
        return torch.zeros(valid.shape[0]).index_add(0, row, token_logps)

    def step_loss(batch: Any) -> Any:
        with torch.no_grad():
            ref_chosen, ref_rejected = answer_logps(reference, batch).chunk(2)
        chosen, rejected = answer_logps(model, batch).chunk(2)
        margin = (chosen - ref_chosen) - (rejected - ref_rejected)
        return -F.logsigmoid(DPO_BETA * margin).mean()

    marks, losses = _train(model, batches, step_loss, lr=DPO_LR)
    first, last = args.warmup_steps, args.steps
    return dpo_throughput.Measurement(
        steps=last - first,
        seconds=marks[last - 1] - marks[first - 1],
        tokens=sum(b.num_tokens for b in batches[first:last]),
        final_loss=float(torch.stack(losses[-dpo_throughput.LOSS_WINDOW :]).mean()),
    )


def _load(model_dir: Path, threads: int) -> tuple[Any, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    return tok, model.train()


def _chunks(items: list[Any], args: argparse.Namespace) -> list[list[Any]]:
    """`args.steps` batches of `args.batch_size` items, in a seeded random order, cycling."""
    import torch

    order = torch.randperm(len(items), generator=torch.Generator().manual_seed(0)).tolist()
    b = args.batch_size
    return [[items[order[(s * b + i) % len(items)]] for i in range(b)] for s in range(args.steps)]


def _train(model: Any, batches: list[Any], step_loss: Any, *, lr: float) -> tuple[list[float], list[Any]]:
    """The loop: forward + loss, backward, clip, fused AdamW. Returns each step's end time and loss."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, fused=True)
    marks, losses = [], []
    for batch in batches:
        loss = step_loss(batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())  # no .item(): no extra sync inside the loop
        marks.append(time.perf_counter())
    return marks, losses


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in ("sft", "dpo"):
        sys.exit("usage: bare_loop.py {sft,dpo} [sft_throughput.py / dpo_throughput.py flags]")
    kind, rest = argv[0], argv[1:]
    script = sft_throughput if kind == "sft" else dpo_throughput
    args = script.parse_args(rest)
    with tempfile.TemporaryDirectory(prefix="bare-loop-") as tmp:
        work = Path(tmp)
        if kind == "sft":
            model_dir, data_path = sft_throughput.prepare_inputs(work)
            for mode in args.modes:
                m = run_bare_sft(work, model_dir, data_path, args, packed=mode == "packed")
                print(f"bare SFT {mode}: {m.tokens_per_s:,.0f} tok/s, final loss {m.final_loss:.3f}")
        else:
            model_dir, data_path = dpo_throughput.prepare_inputs(work, args.model_dir)
            m = run_bare_dpo(work, model_dir, data_path, args)
            print(f"bare DPO: {m.steps_per_s:.2f} steps/s, {m.tokens / m.steps:,.0f} tokens/step, "
                  f"final loss {m.final_loss:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
