"""Acceptance: on the same batch, model and settings, rollout's DPO loss equals TRL's DPOTrainer loss.

    HF_HUB_OFFLINE=1 .venv/bin/pytest tests/integration/test_dpo_trl_parity.py -q

TRL (a test-only extra) is driven through its own code path: `DPOTrainer` prepares
(tokenizes) the rows, its `data_collator` builds the batch and `compute_loss` runs
its fused-LM-head forward and loss. Ours: `tokenize_pairs` -> `collate_pairs` ->
`sequence_logps` -> `dpo_loss`. We first assert that both sides feed the model the
very same tokens, so any loss difference is in the math.

How TRL 1.16 tokenizes a plain-text preference row: it appends the eos token *as
text* to `chosen` / `rejected`, tokenizes `prompt` and `prompt + answer` as whole
strings, and takes the completion to start where the two token lists diverge. Ours
tokenizes `prompt` and `answer` separately and appends the eos id. The two agree
whenever the prompt ends on a token boundary, as these rows (ending in "? " before
a digit, digits being single tokens) do. Rows are far below `max_length`, so TRL's
truncation never applies.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

pytest.importorskip("trl")

import torch  # noqa: E402

BETA = 0.1
ROWS = [
    {"prompt": "What is 3+4? ", "chosen": "7", "rejected": "8"},
    {"prompt": "What is 5+7? ", "chosen": "12", "rejected": "9"},
    {"prompt": "What is 9*9? ", "chosen": "81", "rejected": "72"},
    {"prompt": "What is 6-2? ", "chosen": "4", "rejected": "13"},
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    from rollout.models.tiny import init_tiny_model

    return init_tiny_model(tmp_path_factory.mktemp("dpo-parity") / "tiny")


def load_models(tiny_dir: Path):
    """Policy = the tiny model plus small seeded noise; reference = the tiny model itself."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    policy = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    ref = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    return tokenizer, policy, ref


def rollout_dpo(policy, ref, tokenizer, loss_type: str, label_smoothing: float):
    from rollout.data.collate import collate_pairs
    from rollout.data.jsonl import Row
    from rollout.data.tokenize import tokenize_pairs
    from rollout.losses.logps import average_logps, sequence_logps
    from rollout.losses.preference import LENGTH_AVERAGED_LOSS_TYPES, dpo_loss

    pairs, stats = tokenize_pairs(
        [Row(line=i + 1, data=row) for i, row in enumerate(ROWS)], tokenizer, max_seq_len=64
    )
    assert stats.num_samples == len(ROWS) and stats.num_truncated == 0
    batch, n = collate_pairs(pairs, tokenizer.pad_token_id)
    with torch.no_grad():
        logps, counts = sequence_logps(policy, batch)
        ref_logps, _ = sequence_logps(ref, batch)
    if loss_type in LENGTH_AVERAGED_LOSS_TYPES:
        logps, ref_logps = average_logps(logps, counts), average_logps(ref_logps, counts)
    loss, metrics = dpo_loss(
        logps[:n],
        logps[n:],
        ref_logps[:n],
        ref_logps[n:],
        beta=BETA,
        loss_type=loss_type,
        label_smoothing=label_smoothing,
        normalizer=n,
    )
    return pairs, batch, loss, metrics


def trl_dpo(policy, ref, tokenizer, loss_type: str, label_smoothing: float, out_dir: Path):
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    args = DPOConfig(
        output_dir=str(out_dir),
        beta=BETA,
        loss_type=[loss_type],  # TRL >= 1.0: a list of loss types (weighted sum)
        label_smoothing=label_smoothing,
        bf16=False,
        use_cpu=True,
        report_to=[],
        per_device_train_batch_size=len(ROWS),
        max_length=64,
        disable_dropout=True,
    )
    trainer = DPOTrainer(
        model=policy,
        ref_model=ref,
        args=args,
        train_dataset=Dataset.from_list(ROWS),
        processing_class=tokenizer,
    )
    # The batch TRL's dataloader would build, in dataset order (its sampler shuffles).
    examples = [trainer.train_dataset[i] for i in range(len(ROWS))]
    batch = trainer.data_collator(examples)
    trainer.model.eval()
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, batch)
    return examples, batch, float(loss), trainer._metrics["eval"]


@pytest.mark.parametrize(
    ("loss_type", "label_smoothing"),
    # TRL's "sigmoid" ignores label_smoothing (no cDPO term), so it is compared at 0 only.
    [("sigmoid", 0.0), ("ipo", 0.0), ("hinge", 0.0), ("robust", 0.1)],
)
def test_dpo_loss_matches_trl(tiny_dir, tmp_path, loss_type, label_smoothing):
    tokenizer, policy, ref = load_models(tiny_dir)
    pairs, ours_batch, ours_loss, metrics = rollout_dpo(policy, ref, tokenizer, loss_type, label_smoothing)
    examples, trl_batch, trl_loss, trl_metrics = trl_dpo(
        policy, ref, tokenizer, loss_type, label_smoothing, tmp_path / "trl"
    )

    # Same tokens: per row, and the padded batch (chosen rows, then rejected rows).
    for pair, ex in zip(pairs, examples, strict=True):
        prompt = tuple(ex["prompt_ids"])
        assert pair.chosen_ids == prompt + tuple(ex["chosen_ids"])
        assert pair.rejected_ids == prompt + tuple(ex["rejected_ids"])
        assert pair.prompt_len_chosen == pair.prompt_len_rejected == len(prompt)
    assert torch.equal(ours_batch.input_ids, trl_batch["input_ids"])
    assert torch.equal(ours_batch.attention_mask, trl_batch["attention_mask"])
    assert torch.equal(ours_batch.loss_mask, trl_batch["completion_mask"].bool())

    # Not a trivial point (policy == reference would give log 2 for sigmoid).
    assert abs(float(ours_loss) - math.log(2)) > 1e-3
    assert abs(float(ours_loss) - trl_loss) < 1e-5, (float(ours_loss), trl_loss)

    if loss_type != "ipo":  # TRL's IPO reward metrics use summed, not averaged, log-probs
        n = metrics["num_pairs"]
        assert metrics["margin_sum"] / n == pytest.approx(trl_metrics["rewards/margins"][-1], abs=1e-5)
        assert metrics["reward_chosen_sum"] / n == pytest.approx(trl_metrics["rewards/chosen"][-1], abs=1e-5)
        assert metrics["correct"] / n == pytest.approx(trl_metrics["rewards/accuracies"][-1])
