"""Operations dispatched per step, counted on the CPU: how many kernels a GPU would launch.

    .venv/bin/python benchmarks/dispatch_count.py decode      # one decode step: the engine's ways, transformers'
    .venv/bin/python benchmarks/dispatch_count.py grpo-train  # one GRPO optimizer step: rollout vs TRL (~1 min)

A small model on a GPU is launch-bound: a step costs about what its kernel launches cost, not its
arithmetic (benchmarks/results/2026-12-04-h200.md). Counting the aten operations a step dispatches
(`TorchDispatchMode`; views and other metadata-only operations left out, since they launch nothing)
measures that on any machine, where a GPU is rarely lent. The counts are of operations, not of
kernels: on a GPU most computing operations are one launch each, a few are more or fewer.

`decode`: a bfloat16 Qwen2 (`--layers`, 16 rows, a 9-token cache) through the lean decoder as the
engine ran it on a GPU until 2026-12-05 (`lean_decoder(model)`), as it runs it now (`stacked`,
`fused_norms`), and through `model(...)` with a `DynamicCache` (what `generate` calls each step).

Read-backs are counted beside the operations: a value read (`_local_scalar_dense`: `item`, `float`,
`bool` of a tensor), a `nonzero`, a boolean mask's indexing, a `tolist`; on a GPU each makes the
host wait for the device.

`grpo-train`: `benchmarks/grpo_step.py`'s settings (tiny model, 2 prompts x 8 completions, float32),
a few steps of each library, counting inside the training pass only (rollout: the backend's
`forward_backward` and `optim_step`; TRL: `compute_loss`, `Accelerator.backward`,
`clip_grad_norm_` and `AdamW.step`), per optimizer step.
"""

from __future__ import annotations

import argparse
import collections
import functools
import inspect
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

METADATA = frozenset({
    "view", "reshape", "_unsafe_view", "transpose", "t", "permute", "slice", "select", "unsqueeze",
    "squeeze", "expand", "split", "split_with_sizes", "unbind", "as_strided", "alias", "detach", "lift_fresh",
})
"""Operations that make a view or read metadata: no kernel."""


NOT_COMPUTING = METADATA | {"mask index", "tolist"}
"""Views and metadata, and what is counted beside the operations ("mask index", "tolist")."""
READBACKS = frozenset({"_local_scalar_dense", "nonzero", "mask index", "tolist"})
"""What makes the host wait for a device: a value read (`item`, `float`, `bool`, `int` of a tensor), a
`nonzero`, a boolean mask's indexing or `masked_select` (the result's size is read), a `tolist`."""


class Counter(TorchDispatchMode):
    """Counts every aten operation dispatched inside it, by name, and every `Tensor.tolist` call
    (on the CPU `tolist` reads memory without dispatching anything; on a GPU it is a read-back)."""

    def __init__(self, ops: collections.Counter[str]) -> None:
        super().__init__()
        self.ops = ops
        self._tolist: Any = None

    def __enter__(self) -> Counter:
        tolist = self._tolist = torch.Tensor.tolist
        ops = self.ops

        def counted(t: torch.Tensor) -> Any:
            ops["tolist"] += 1
            return tolist(t)

        torch.Tensor.tolist = counted  # type: ignore[method-assign,assignment]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        torch.Tensor.tolist = self._tolist  # type: ignore[method-assign]
        super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = func.overloadpacket.__name__
        self.ops[name] += 1
        if name == "masked_select" or (name == "index" and any(  # a boolean mask's indexing: its size is read
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else ()))):
            self.ops["mask index"] += 1
        return func(*args, **(kwargs or {}))


def readbacks(ops: collections.Counter[str]) -> int:
    return sum(ops[name] for name in READBACKS)


def readback_kinds(ops: collections.Counter[str], per: float) -> str:
    return ", ".join(f"{name} {ops[name] / per:.1f}" for name in sorted(READBACKS) if ops[name])


def computing(ops: collections.Counter[str]) -> int:
    return sum(n for name, n in ops.items() if name not in NOT_COMPUTING)


def top(ops: collections.Counter[str], per: float, n: int = 12) -> str:
    """The n most frequent computing operations, each with its count divided by `per`."""
    return ", ".join([f"{name} {v / per:.0f}" for name, v in ops.most_common() if name not in NOT_COMPUTING][:n])


def count_decode(layers: int) -> None:
    from transformers import DynamicCache, Qwen2Config, Qwen2ForCausalLM

    from rollout.models.lean_decoder import lean_decoder

    config = Qwen2Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16).eval()
    rows, width = 16, 8
    ids = torch.randint(0, config.vocab_size, (rows, width))

    def ones(n: int) -> torch.Tensor:
        return torch.ones(rows, n, dtype=torch.long)

    def lean_step(**options: bool) -> Callable[[DynamicCache, int], Any]:
        lean = lean_decoder(model, **options)
        assert lean is not None

        def step(cache: DynamicCache, t: int) -> Any:  # t: the new token's position; 0 = the prefill
            if t == 0:
                return lean(ids, ones(width), torch.arange(width).expand(rows, width), cache)
            return lean(ids[:, :1], ones(t + 1), torch.full((rows, 1), t), cache)

        return step

    def model_step(cache: DynamicCache, t: int) -> Any:
        if t == 0:
            return model(input_ids=ids, attention_mask=ones(width), cache=cache, use_cache=True)
        return model(input_ids=ids[:, :1], attention_mask=ones(t + 1), position_ids=torch.full((rows, 1), t),
                     cache=cache, use_cache=True)

    ways = {
        "lean decoder, as a GPU engine ran it until 2026-12-05": lean_step(),
        "lean decoder, stacked + fused_norms (a GPU engine now)": lean_step(stacked=True, fused_norms=True),
        "transformers model(...) (generate's step)": model_step,
    }
    print(f"one decode step, bfloat16 Qwen2, {layers} layers + head, {rows} rows; computing operations")
    for name, step in ways.items():
        cache = DynamicCache(config=config)
        ops: collections.Counter[str] = collections.Counter()
        with torch.inference_mode():
            step(cache, 0)  # the prefill
            step(cache, width)  # a first decode step makes any weight copies
            with Counter(ops):
                step(cache, width + 1)
        print(f"  {name}: {computing(ops)} ({computing(ops) / layers:.1f} a layer)")
        print(f"      {top(ops, 1)}")


def count_grpo_train(steps: int) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import accelerate
    import grpo_step
    import trl

    from rollout.backends import torch_backend

    counting = [False]  # inside a counted run
    inside = [False]  # inside a counted call already (rollout's optim_step calls AdamW.step): count once
    ops = {"pass": collections.Counter(), "optimizer": collections.Counter()}

    def wrap(kind: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        if inspect.iscoroutinefunction(fn):  # the backend's methods are async
            @functools.wraps(fn)
            async def awaited(*a: Any, **kw: Any) -> Any:
                if not counting[0] or inside[0]:
                    return await fn(*a, **kw)
                inside[0] = True
                try:
                    with Counter(ops[kind]):
                        return await fn(*a, **kw)
                finally:
                    inside[0] = False

            return awaited

        @functools.wraps(fn)
        def called(*a: Any, **kw: Any) -> Any:
            if not counting[0] or inside[0]:
                return fn(*a, **kw)
            inside[0] = True
            try:
                with Counter(ops[kind]):
                    return fn(*a, **kw)
            finally:
                inside[0] = False

        return called

    def switched(fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*a: Any, **kw: Any) -> Any:
            counting[0] = True
            try:
                return fn(*a, **kw)
            finally:
                counting[0] = False

        return run

    backend = torch_backend.TorchBackend
    backend.forward_backward = wrap("pass", backend.forward_backward)  # type: ignore[method-assign]
    backend.optim_step = wrap("optimizer", backend.optim_step)  # type: ignore[method-assign]
    trl.GRPOTrainer.compute_loss = wrap("pass", trl.GRPOTrainer.compute_loss)  # type: ignore[method-assign]
    accelerate.Accelerator.backward = wrap("pass", accelerate.Accelerator.backward)  # type: ignore[method-assign]
    accelerate.Accelerator.clip_grad_norm_ = wrap("optimizer", accelerate.Accelerator.clip_grad_norm_)  # type: ignore[method-assign]
    torch.optim.AdamW.step = wrap("optimizer", torch.optim.AdamW.step)  # type: ignore[method-assign]
    grpo_step.run_rollout = switched(grpo_step.run_rollout)
    grpo_step.run_trl = switched(grpo_step.run_trl)
    results = {}
    for library in ("rollout", "trl"):
        for c in ops.values():
            c.clear()
        grpo_step.main(["--steps", str(steps), "--warmup-steps", "1", "--reward-window", "1", "--repeats", "1",
                        "--runs", library])
        results[library] = {kind: collections.Counter(c) for kind, c in ops.items()}
    print(f"\none GRPO optimizer step (grpo_step.py's settings, {steps} steps counted, the first one's"
          " optimizer-state set-up included); computing operations a step")
    for library, kinds in results.items():
        for kind, c in kinds.items():
            print(f"  {library} {kind}: {computing(c) / steps:.0f}, read-backs {readbacks(c) / steps:.1f}"
                  f" [{readback_kinds(c, steps)}]"
                  f"   ({top(c, steps, 10)})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", choices=("decode", "grpo-train"))
    p.add_argument("--layers", type=int, default=4, help="decode: the model's layers (default 4)")
    p.add_argument("--steps", type=int, default=8, help="grpo-train: optimizer steps counted (default 8)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if args.what == "decode":
        count_decode(args.layers)
    else:
        count_grpo_train(args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
