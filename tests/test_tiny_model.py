"""`rollout model init-tiny`: the tiny random model + locally trained tokenizer.

Run:

    HF_HUB_OFFLINE=1 .venv/bin/pytest tests/test_tiny_model.py -q
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from rollout.errors import ConfigError, RolloutError  # noqa: E402
from rollout.models.tiny import (  # noqa: E402
    CHAT_TEMPLATE,
    ENDOFTEXT,
    IM_END,
    IM_START,
    count_saved_parameters,
    init_tiny_model,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def tokenizer(tiny_dir: Path):
    return transformers.AutoTokenizer.from_pretrained(tiny_dir)


@pytest.fixture(scope="module")
def model(tiny_dir: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_dir)


def _digests(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def _rollout_command() -> list[str]:
    script = Path(sys.executable).with_name("rollout")
    return [str(script)] if script.exists() else [sys.executable, "-m", "rollout.cli.main"]


def test_loads_offline_with_auto_classes(tiny_dir: Path, tokenizer, model) -> None:
    assert isinstance(model, transformers.Qwen2ForCausalLM)
    assert model.dtype == torch.float32
    assert len(tokenizer) == 512 == model.config.vocab_size
    assert tokenizer.model_max_length == 512
    assert tokenizer.padding_side == "right"
    assert (tiny_dir / "model.safetensors").exists()


def test_parameter_count_in_expected_range(tiny_dir: Path, model) -> None:
    num_params = sum(p.numel() for p in model.parameters())
    assert 1_000_000 <= num_params <= 1_100_000
    assert count_saved_parameters(tiny_dir) == num_params == 1_050_752


def test_special_tokens_and_eos_ids_are_consistent(tokenizer, model) -> None:
    ids = tokenizer.convert_tokens_to_ids([ENDOFTEXT, IM_START, IM_END])
    assert ids == [0, 1, 2]
    assert tokenizer.pad_token == ENDOFTEXT and tokenizer.pad_token_id == 0
    assert tokenizer.eos_token == IM_END and tokenizer.eos_token_id == 2
    assert (
        model.config.pad_token_id == 0 and model.config.eos_token_id == 2 and model.config.bos_token_id == 0
    )
    assert model.config.use_cache is True
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id
    # special tokens are whole tokens, never split, and no BOS is prepended
    assert tokenizer("<|im_start|>user<|im_end|>")["input_ids"][0] == 1
    assert tokenizer("hi")["input_ids"][0] != 0


def test_same_arguments_give_identical_bytes(tmp_path: Path, tiny_dir: Path) -> None:
    again = init_tiny_model(tmp_path / "again")
    assert _digests(again) == _digests(tiny_dir)
    state = torch.random.get_rng_state()
    other_seed = _digests(init_tiny_model(tmp_path / "seed1", seed=1))
    assert torch.equal(torch.random.get_rng_state(), state)  # the caller's RNG is untouched
    assert other_seed["model.safetensors"] != _digests(tiny_dir)["model.safetensors"]
    assert other_seed["tokenizer.json"] == _digests(tiny_dir)["tokenizer.json"]  # one tokenizer for all seeds


def test_forward_pass(tokenizer, model) -> None:
    batch = tokenizer(["What is 3+8?", "hello there, friend"], padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = model(**batch).logits
    assert logits.shape == (2, batch["input_ids"].shape[1], 512)
    assert torch.isfinite(logits).all()


def test_digits_are_individual_tokens(tokenizer) -> None:
    assert tokenizer.tokenize("123") == ["1", "2", "3"]
    assert (
        len(tokenizer("What is 123+45?", add_special_tokens=False)["input_ids"])
        == len(tokenizer("What is ", add_special_tokens=False)["input_ids"]) + 7
    )


def test_loaded_tokenizer_encodes_like_the_trained_one(tiny_dir: Path, tokenizer) -> None:
    # For qwen2, AutoTokenizer rebuilds the pre-tokenizer (Qwen2Tokenizer); it must match ours.
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    texts = [
        "<|im_start|>user\nWhat is 12-30?<|im_end|>\n<|im_start|>assistant\n-18<|im_end|>\n",
        "The model learns the sum quickly, said Kalo!",
        "  odd\t\tspacing  \n\n x  ",
        "héllo wörld 日本語 🙂 it's 3.14",
    ]
    for text in texts:
        assert tokenizer(text)["input_ids"] == raw.encode(text).ids, text
        assert tokenizer.decode(raw.encode(text).ids) == text


def test_chat_template_renders_chatml(tokenizer) -> None:
    assert tokenizer.chat_template == CHAT_TEMPLATE
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 3+8?"},
        {"role": "assistant", "content": "11"},
    ]
    assert tokenizer.apply_chat_template(messages, tokenize=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is 3+8?<|im_end|>\n"
        "<|im_start|>assistant\n11<|im_end|>\n"
    )
    assert tokenizer.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True).endswith(
        "What is 3+8?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_assistant_mask_covers_exactly_answers_and_im_end(tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 3+8?"},
        {"role": "assistant", "content": "11"},
        {"role": "user", "content": "And 12-30?"},
        {"role": "assistant", "content": "The answer is -18."},
    ]
    out = tokenizer.apply_chat_template(messages, return_assistant_tokens_mask=True, return_dict=True)

    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    expected_ids: list[int] = []
    expected_mask: list[int] = []
    for message in messages:
        trained = int(message["role"] == "assistant")
        for text, flag in (
            (f"<|im_start|>{message['role']}\n", 0),
            (message["content"] + IM_END, trained),
            ("\n", 0),
        ):
            ids = encode(text)
            expected_ids += ids
            expected_mask += [flag] * len(ids)
    assert out["input_ids"] == expected_ids
    assert out["assistant_masks"] == expected_mask
    masked = [i for i, m in zip(out["input_ids"], out["assistant_masks"], strict=True) if m]
    assert tokenizer.decode(masked) == "11<|im_end|>The answer is -18.<|im_end|>"


class _ForceTokenAt:
    """Logits processor forcing `token_id` as the `step`-th new token."""

    def __init__(self, prompt_len: int, step: int, token_id: int) -> None:
        self.prompt_len, self.step, self.token_id = prompt_len, step, token_id

    def __call__(self, input_ids, scores):
        if input_ids.shape[1] - self.prompt_len == self.step:
            scores = torch.full_like(scores, float("-inf"))
            scores[:, self.token_id] = 0.0
        return scores


def test_generation_stops_at_im_end(tokenizer, model) -> None:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 3+8?"}], tokenize=False, add_generation_prompt=True
    )
    batch = tokenizer(text, return_tensors="pt", add_special_tokens=False)
    prompt_len = batch["input_ids"].shape[1]
    forced = transformers.LogitsProcessorList([_ForceTokenAt(prompt_len, 2, tokenizer.eos_token_id)])
    with torch.no_grad():
        out = model.generate(**batch, do_sample=False, max_new_tokens=10, logits_processor=forced)
    new = out[0, prompt_len:].tolist()
    assert new[-1] == tokenizer.eos_token_id and len(new) == 3  # stopped right after <|im_end|>


def test_llama_arch(tmp_path: Path) -> None:
    out = init_tiny_model(tmp_path / "llama", arch="llama", num_layers=2)
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert isinstance(model, transformers.LlamaForCausalLM)
    assert tokenizer.tokenize("123") == ["1", "2", "3"]
    with torch.no_grad():
        logits = model(**tokenizer(["What is 3+8?"], return_tensors="pt")).logits
    assert logits.shape[-1] == 512


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"hidden_size": 0}, "hidden_size must be positive"),
        ({"num_layers": -1}, "num_layers must be positive"),
        ({"num_heads": 3}, "must divide hidden_size"),
        ({"num_kv_heads": 3}, "must divide num_heads"),
        ({"vocab_size": 100}, "vocab_size must be at least 266"),
        ({"arch": "gpt2"}, "unknown arch"),
    ],
)
def test_bad_arguments_raise(tmp_path: Path, kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        init_tiny_model(tmp_path / "m", **kwargs)
    assert not (tmp_path / "m").exists()


def test_non_empty_out_dir_needs_force(tmp_path: Path) -> None:
    out = tmp_path / "m"
    out.mkdir()
    (out / "vocab.json").write_text("{}")
    with pytest.raises(RolloutError, match="not empty"):
        init_tiny_model(out)
    init_tiny_model(out, force=True, num_layers=1)
    assert not (out / "vocab.json").exists()  # stale tokenizer file removed
    assert transformers.AutoTokenizer.from_pretrained(out).tokenize("42") == ["4", "2"]


def test_cli_init_tiny(tmp_path: Path) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    out = tmp_path / "cli"
    done = subprocess.run(
        [*_rollout_command(), "model", "init-tiny", str(out), "--num-layers", "1"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "parameters" in done.stdout and str(out) in done.stdout
    assert (out / "config.json").exists()

    again = subprocess.run(
        [*_rollout_command(), "model", "init-tiny", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert again.returncode == 2
    assert again.stderr.startswith("error:") and "not empty" in again.stderr
