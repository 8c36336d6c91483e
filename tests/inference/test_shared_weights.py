"""The hf engine sampling with a trainer's own parameters (`HFEngine.share_parameters`): no second
copy, pushes copy nothing, and it samples exactly what an engine with a copy of the weights samples."""

from __future__ import annotations

from pathlib import Path

import torch

from rollout.inference.hf_engine import load_hf_engine
from rollout.inference.types import GenerationRequest, SamplingParams

PARAMS = SamplingParams(temperature=1.0, max_tokens=8, seed=3, n=2)
PROMPTS = [tuple(range(5, 14)), tuple(range(7, 20))]


def sample(engine) -> list[tuple[tuple[int, ...], tuple[float, ...]]]:
    out = engine.generate([GenerationRequest(prompt_token_ids=p, params=PARAMS) for p in PROMPTS])
    return [(c.token_ids, c.logprobs) for choices in out for c in choices]


def train_step(model) -> None:
    """One AdamW step on a next-token loss: the parameters change in place, as in a trainer."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    ids = torch.tensor([list(PROMPTS[1])], device=model.device)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()


def test_a_shared_engine_samples_what_a_copy_samples_and_pushes_copy_nothing(tiny_model_dir: Path, monkeypatch):
    from transformers import AutoModelForCausalLM

    shared = load_hf_engine(tiny_model_dir, model_name="shared")
    copied = load_hf_engine(tiny_model_dir, model_name="copied")
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir).to(shared.model.device).train()
    assert shared.share_parameters(policy)
    for name, param in shared.model.named_parameters():
        assert param.data_ptr() == dict(policy.named_parameters())[name].data_ptr()
    assert sample(shared) == sample(copied)

    train_step(policy)  # the shared engine sees it at once; the copy after its push
    weights = {k: v.detach() for k, v in policy.state_dict().items()}
    version = shared.weights_version
    shared.generate([GenerationRequest(prompt_token_ids=PROMPTS[0], params=SamplingParams(max_tokens=3),
                                       cache_key="k")])
    assert len(shared._kept) == 1
    copies = []
    real_copy = torch.Tensor.copy_
    monkeypatch.setattr(torch.Tensor, "copy_", lambda self, src, *a, **k: copies.append(1) or real_copy(self, src, *a, **k))
    shared.update_weights(weights)
    assert copies == []
    copied.update_weights(weights)
    assert len(copies) == len(weights)
    monkeypatch.undo()
    assert shared.weights_version == version + 1 and len(shared._kept) == 0  # the push still marks new weights
    for name, param in shared.model.named_parameters():  # and left the storage shared
        assert param.data_ptr() == dict(policy.named_parameters())[name].data_ptr()
    assert sample(shared) == sample(copied)
    assert not policy.lm_head.weight.is_inference()  # inference-mode sampling left the trainer's tensors alone
    assert policy.training and not shared.model.training


def test_parameters_that_do_not_match_are_not_shared(tiny_model_dir: Path):
    from transformers import AutoModelForCausalLM

    engine = load_hf_engine(tiny_model_dir, model_name="tiny")
    before = sample(engine)
    other = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
    assert not engine.share_parameters(other)
    assert sample(engine) == before and engine.weights_version == 0
