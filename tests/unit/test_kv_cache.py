"""The key/value cache goes into and comes out of a forward under the installed transformers' name."""

from __future__ import annotations

import inspect
import logging

import torch

from rollout.models.kv_cache import cache_field, cache_kwarg, returned_cache


def test_the_cache_name_is_the_forward_argument_and_its_output(tmp_path, caplog, monkeypatch):
    from transformers import AutoModelForCausalLM, DynamicCache

    from rollout.models.tiny import init_tiny_model

    init_tiny_model(tmp_path / "tiny")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "tiny")
    assert cache_field() in inspect.signature(type(model).forward).parameters
    cache = DynamicCache(config=model.config)
    monkeypatch.setattr(logging.getLogger("transformers"), "propagate", True)
    with caplog.at_level(logging.WARNING), torch.inference_mode():
        first = model(input_ids=torch.tensor([[5, 6, 7]]), **cache_kwarg(cache), use_cache=True)
        second = model(input_ids=torch.tensor([[8]]), **cache_kwarg(returned_cache(first)), use_cache=True)
        whole = model(input_ids=torch.tensor([[5, 6, 7, 8]]), use_cache=False)
    assert returned_cache(second) is cache and cache.get_seq_length() == 4
    torch.testing.assert_close(second.logits[0, -1], whole.logits[0, -1], rtol=1e-5, atol=1e-5)
    assert not [r for r in caplog.records if "deprecated" in r.getMessage()]
