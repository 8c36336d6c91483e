"""Loading the model and tokenizer training starts from, and LoRA adapters on top.

    source = ModelSource("local/models/tiny")                  # or ModelSource(**cfg_block.model_dump())
    tokenizer = load_tokenizer(source)
    model = load_trainable(source, task="causal_lm", pad_token_id=tokenizer.pad_token_id, seed=0,
                           device=torch.device("cpu"), lora={"r": 8, "alpha": 16.0, "dropout": 0.0,
                                                             "target_modules": ["q_proj", "v_proj"]})

Everything here takes plain values (a `ModelSource`, LoRA keyword arguments),
never a config object: the recipes read the config. transformers and peft are
imported inside the functions that need them (peft only under LoRA).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from rollout.errors import ModelError

ModelTask = Literal["causal_lm", "reward"]
"""causal_lm: a language model; reward: a 1-logit sequence-classification head on the same body."""


@dataclass(frozen=True)
class ModelSource:
    """Where a model's files come from (a local folder or a hub id) and how its weights load."""

    uri: str
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    revision: str | None = None
    trust_remote_code: bool = False


# transformers 5.25 swaps layers for kernels fetched from the hub on CUDA unless told not to
# (`use_kernels`, on by default there): code run from a download nobody asked for, not the modules
# the lean decoder and the bit-level tests read, and, offline, a model that does not load at all
# (seen on a lent H200: "Version 2 of 'kernels-community/rotary' is not available in the local
# cache"). Every model rollout loads passes this.
NO_HUB_KERNELS: dict[str, bool] = {"use_kernels": False}


def load_tokenizer(source: ModelSource) -> Any:
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(
            source.uri, revision=source.revision, trust_remote_code=source.trust_remote_code
        )
    except Exception as err:  # transformers raises OSError/ValueError/HF errors
        raise ModelError(f"cannot load tokenizer from {source.uri}: {_first_line(err)}") from None
    if tok.pad_token_id is None:
        if tok.eos_token_id is None:
            raise ModelError(f"tokenizer at {source.uri} has neither a pad nor an eos token")
        tok.pad_token = tok.eos_token
    return tok


def load_model(source: ModelSource, *, task: ModelTask, pad_token_id: int, seed: int) -> Any:
    """`task`: "causal_lm" or "reward" (a 1-logit sequence-classification head)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    torch.manual_seed(seed)  # new heads (the RM score layer) are initialised from the run's seed
    kwargs = dict(
        revision=source.revision,
        trust_remote_code=source.trust_remote_code,
        dtype=getattr(torch, source.dtype),
        attn_implementation="sdpa",
        **NO_HUB_KERNELS,
    )
    try:
        if task == "causal_lm":
            model = AutoModelForCausalLM.from_pretrained(source.uri, **kwargs)
        else:
            from transformers.utils import logging as hf_logging

            verbosity = hf_logging.get_verbosity()
            hf_logging.set_verbosity_error()  # "score.weight newly initialized" is expected here
            try:
                model = AutoModelForSequenceClassification.from_pretrained(
                    source.uri, num_labels=1, pad_token_id=pad_token_id, **kwargs
                )
            finally:
                hf_logging.set_verbosity(verbosity)
    except Exception as err:
        raise ModelError(f"cannot load model from {source.uri}: {_first_line(err)}") from None
    model.config.pad_token_id = pad_token_id
    model.config.use_cache = False
    return model


def load_trainable(
    source: ModelSource, *, task: ModelTask, pad_token_id: int, seed: int, device: Any,
    lora: Mapping[str, Any] | None,
) -> Any:
    """The model an algorithm trains: base weights, LoRA adapters if `lora` (apply_lora's keyword
    arguments) is given, on `device`."""
    model = load_model(source, task=task, pad_token_id=pad_token_id, seed=seed)
    if lora is not None:
        model = apply_lora(model, task=task, **lora)
    return model.to(device)


def apply_lora(
    model: Any, *, task: ModelTask, r: int, alpha: float, dropout: float, target_modules: Sequence[str]
) -> Any:
    """Wrap `model` in peft LoRA adapters (Hu et al., 2021); only the adapters train."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import TaskType, get_peft_model

    peft_cfg = PeftLoraConfig(
        r=r,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=list(target_modules),
        task_type=TaskType.CAUSAL_LM if task == "causal_lm" else TaskType.SEQ_CLS,
    )
    try:
        return get_peft_model(model, peft_cfg)
    except ValueError as err:
        raise ModelError(f"LoRA: {_first_line(err)}") from None


def hf_model(model: Any) -> Any:
    """The transformers model under a peft wrapper (LoRA layers stay active)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _first_line(err: BaseException) -> str:
    text = str(err).strip() or type(err).__name__
    return text.splitlines()[0]
