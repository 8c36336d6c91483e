"""Does rollout's GRPO step compute TRL's gradient on the same batch? (CPU, needs the bench extra.)

    .venv/bin/python benchmarks/grpo_trl_parity.py                      # makes an SFT-warmed tiny model first
    .venv/bin/python benchmarks/grpo_trl_parity.py --model-dir local/models/sft-warmup --batches 4

`grpo_step.py` compares the two libraries' GRPO runs at equal settings, but each samples its own
completions, so their reward curves differ by chance as well as by any difference in the update.
This script takes the chance out: TRL's `GRPOTrainer` (`grpo_step.py`'s settings: beta 0, eps 0.2,
group-std advantages, `loss_type="dapo"`, one generation batch per step) samples a batch of
`--prompts` x `--generations` completions and scores it with rollout's `arithmetic_correct`, and
then on that one batch, from the same weights:

  TRL      `GRPOTrainer._compute_loss(model, batch)`, backward;
  rollout  the rewards of the decoded completions -> `compute_group_advantages`, the rows through
           `collate_prefix` (each prompt once, its completions after it, as the trainer batches
           them) and GRPO's own loss function (`algorithms.grpo.make_grpo_loss_fn`: `prefix_logps`,
           `grpo_loss`, the step's token count as the normalizer), backward.

It prints, per batch, both losses, both gradient norms, the relative difference of the gradients
(||g_rollout - g_TRL|| / ||g_TRL||) and of the advantages, and fails (exit 1) where the gradients
differ by more than `--tolerance` (default 1e-5; float32 rounding gives ~1e-7).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import grpo_step
from bench_common import quiet_stderr


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-dir", type=Path, help="an SFT-warmed model folder (default: make one, ~10-20 s)")
    p.add_argument("--prompts", type=int, default=16, help="prompts per batch (default 16)")
    p.add_argument("--generations", type=int, default=8, help="completions per prompt (default 8)")
    p.add_argument("--max-tokens", type=int, default=6, help="max completion tokens (default 6)")
    p.add_argument("--batches", type=int, default=3, help="batches compared, each from other prompts (default 3)")
    p.add_argument("--tolerance", type=float, default=1e-5, help="largest relative gradient difference allowed")
    args = p.parse_args(argv)
    if args.generations < 2 or args.prompts < 1 or args.batches < 1 or args.max_tokens < 1:
        p.error("--prompts, --batches, --max-tokens must be >= 1 and --generations >= 2")
    return args


def compare(args: argparse.Namespace, work: Path) -> list[dict[str, float]]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOTrainer

    from rollout.algorithms.config import GRPOConfig as RolloutGRPOConfig
    from rollout.algorithms.grpo import GRPOBatch, make_grpo_loss_fn
    from rollout.losses.grpo import compute_group_advantages
    from rollout.models.prefix import collate_prefix

    torch.manual_seed(0)
    torch.set_num_threads(1)
    step_args = grpo_step.parse_args(["--steps", "10", "--warmup-steps", "1", "--reward-window", "1",
                                      "--prompts", str(args.prompts), "--generations", str(args.generations),
                                      "--max-tokens", str(args.max_tokens),
                                      *(["--model-dir", str(args.model_dir)] if args.model_dir else [])])
    with quiet_stderr():
        model_dir, prompts_path, _ = grpo_step.prepare_inputs(work, step_args)
    dataset = grpo_step.trl_dataset(prompts_path)

    def arithmetic_correct(completions: list, answer: list, **_: object) -> list[float]:
        return grpo_step.trl_scores(completions, answer)

    size = args.prompts * args.generations
    config = grpo_step.trl_config(work / "trl", step_args, seed=0)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    trainer = GRPOTrainer(model=policy, reward_funcs=[arithmetic_correct], args=config, train_dataset=dataset,
                          processing_class=tokenizer)
    model = trainer.model
    trainer.current_gradient_accumulation_steps = 1  # set by its training loop, read by `_compute_loss`
    settings = RolloutGRPOConfig.model_validate({
        "minibatch_size": args.prompts, "num_generations": args.generations, "max_tokens": args.max_tokens,
        "temperature": 1.0, "beta": 0.0, "scale_rewards": "group", "clip_low": grpo_step.CLIP,
        "clip_high": grpo_step.CLIP, "loss_agg": "token_mean", "num_iterations": 1, "dynamic_sampling": False,
        "rewards": [{"name": "arithmetic_correct"}], "base_model": {"uri": str(model_dir)},
        "dataset": {"kind": "jsonl_path", "path": str(prompts_path)},
        "optimizer": {"kind": "adamw", "lr": grpo_step.LR}, "budget": {"max_steps": 1},
    })

    def gradient(loss: Any) -> list[Any]:
        model.zero_grad(set_to_none=True)
        loss.backward()
        grads = [p.grad.detach().clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        return grads

    def norm(tensors: list[Any]) -> float:
        return float(sum((t.double() ** 2).sum() for t in tensors) ** 0.5)

    results = []
    for b in range(args.batches):
        chosen = range(b * args.prompts, (b + 1) * args.prompts)
        inputs = [dataset[i] for i in chosen for _ in range(args.generations)]  # TRL's layout: each prompt n times
        model.eval()
        batch = trainer._generate_and_score_completions(inputs)
        model.train()
        trl_loss = trainer._compute_loss(model, batch)
        g_trl = gradient(trl_loss)

        prompt_rows = [ids[m.bool()].tolist() for ids, m in zip(batch["prompt_ids"], batch["prompt_mask"], strict=True)]
        completion_rows = [ids[m.bool()].tolist()
                           for ids, m in zip(batch["completion_ids"], batch["completion_mask"], strict=True)]
        texts = tokenizer.batch_decode(completion_rows, skip_special_tokens=True)
        rewards = torch.tensor(grpo_step.trl_scores(texts, [x["answer"] for x in inputs]))
        groups = torch.arange(size) // args.generations
        advantages = compute_group_advantages(rewards, groups, scale_rewards="group")
        prefix = collate_prefix(prompt_rows, completion_rows, tokenizer.pad_token_id)
        loss_fn = make_grpo_loss_fn(settings, float(prefix.target_mask.sum()))
        ro_loss, _ = loss_fn(model, GRPOBatch(prefix, advantages, None, None, None))
        g_ro = gradient(ro_loss)
        diff = norm([a - b for a, b in zip(g_ro, g_trl, strict=True)]) / norm(g_trl)
        results.append({"reward": float(rewards.mean()), "trl_loss": float(trl_loss.detach()),
                        "rollout_loss": float(ro_loss.detach()),
                        "trl_grad_norm": norm(g_trl), "rollout_grad_norm": norm(g_ro), "grad_rel_diff": diff,
                        "adv_max_diff": float((advantages - batch["advantages"]).abs().max()),
                        "tokens": int(prefix.target_mask.sum())})
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="grpo-parity-") as tmp:
        results = compare(args, Path(tmp))
    print(f"GRPO on TRL's batches ({args.prompts} prompts x {args.generations}, <= {args.max_tokens} tokens): "
          "rollout's step vs TRL's `_compute_loss`, the same weights and tokens")
    print(f"{'batch':>5} {'reward':>7} {'tokens':>6} {'loss TRL':>12} {'loss rollout':>12} {'|g| TRL':>9} "
          f"{'|g| rollout':>11} {'grad rel diff':>13} {'adv max diff':>12}")
    worst = 0.0
    for i, r in enumerate(results):
        worst = max(worst, r["grad_rel_diff"])
        print(f"{i:>5} {r['reward']:>7.3f} {r['tokens']:>6} {r['trl_loss']:>12.6g} {r['rollout_loss']:>12.6g} "
              f"{r['trl_grad_norm']:>9.4g} {r['rollout_grad_norm']:>11.4g} {r['grad_rel_diff']:>13.2e} "
              f"{r['adv_max_diff']:>12.2e}")
    ok = worst <= args.tolerance
    print(f"largest relative gradient difference {worst:.2e}: {'within' if ok else 'OVER'} {args.tolerance:g}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
