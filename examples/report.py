"""Score the demo's models on the held-out arithmetic sets.

    .venv/bin/python examples/report.py --data local/data/arithmetic \
        --sft local/models/sft-tiny --rm local/models/rm-tiny

Prints SFT greedy accuracy on `eval_prompts.jsonl` (the base tiny model's
too, for contrast), RM pair accuracy on `eval_pref.jsonl` and, with `--rl`,
the held-out mean reward before and after RL.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--sft", type=Path, required=True)
    parser.add_argument("--rm", type=Path, required=True)
    parser.add_argument("--base", type=Path, default=None, help="base model for contrast (default: sibling 'tiny')")
    parser.add_argument("--rl", type=Path, nargs=2, metavar=("BEFORE", "AFTER"), default=None,
                        help="RL start and result: held-out mean reward of 8 sampled completions per prompt")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
    from transformers.utils import logging

    from rollout.algorithms.rm import pair_accuracy
    from rollout.tasks.arithmetic import greedy_accuracy

    logging.disable_progress_bar()
    prompts = _rows(args.data / "eval_prompts.jsonl")
    base = args.base or args.sft.parent / "tiny"
    for label, path in (("base", base), ("sft", args.sft)):
        if path.exists():
            acc = greedy_accuracy(AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path), prompts)
            print(f"{label:>4} greedy accuracy on {len(prompts)} held-out prompts: {acc:.1%}  ({path})")
    pairs = _rows(args.data / "eval_pref.jsonl")
    rm = AutoModelForSequenceClassification.from_pretrained(args.rm)
    acc = pair_accuracy(rm, AutoTokenizer.from_pretrained(args.rm), pairs, max_seq_len=64)
    print(f"  rm pair accuracy on {len(pairs)} held-out pairs: {acc:.1%}  ({args.rm})")
    if args.rl:
        from rollout.inference.hf_engine import load_hf_engine
        from rollout.inference.types import GenerationRequest, SamplingParams
        from rollout.tasks.arithmetic import is_correct

        for label, path in zip(("rl start", "rl after"), args.rl, strict=True):
            engine = load_hf_engine(str(path))
            out = engine.generate([GenerationRequest(prompt=r["prompt"]) for r in prompts],
                                  SamplingParams(temperature=1.0, max_tokens=6, n=8, seed=123))
            reward = sum(is_correct(x.text, r["answer"]) for c, r in zip(out, prompts, strict=True) for x in c)
            print(f"{label}: mean reward of 8 samples on {len(prompts)} held-out prompts: "
                  f"{reward / (8 * len(prompts)):.1%}  ({path})")


if __name__ == "__main__":
    main()
