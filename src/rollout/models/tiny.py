"""A tiny random model + tokenizer, made locally, for tests, demos and CPU smoke runs.

    rollout model init-tiny ./models/tiny                 # Qwen2, ~1.05M params, a few seconds on a CPU
    rollout model init-tiny ./models/tiny-llama --arch llama --seed 1

or from Python:

    from rollout.models.tiny import init_tiny_model
    init_tiny_model(Path("models/tiny"))

Nothing comes from the hub. The tokenizer is a byte-level BPE trained with the
`tokenizers` library on a synthetic corpus built here (arithmetic questions and
answers, chat-shaped turns and English-like filler text). Digits are split into
single tokens, like Qwen2, so "123" is three tokens and the arithmetic task is
learnable by a tiny model. The model is a randomly initialised `Qwen2ForCausalLM`
(or `LlamaForCausalLM`) saved with `save_pretrained`, so the Auto classes load it
offline. The same arguments always give byte-identical files.

Special tokens (ids are fixed by their order in the BPE trainer):
`<|endoftext|>` = 0 (pad, and bos in the model config), `<|im_start|>` = 1,
`<|im_end|>` = 2 (the tokenizer's eos and the generation eos).

Tool-call markup: the last `len(TOOL_MARKUP_TOKENS)` ids are whole (non-special)
added tokens for the Hermes tool-call frame, `<tool_call>`, `{"name": "`,
`", "arguments": {"`, … (Qwen2.5 has `<tool_call>` as an added token too). A
call then costs ~25 tokens instead of ~70 byte-sized pieces, which a tiny model
learns to copy in a few hundred SFT steps. The BPE trains `vocab_size - 7`
merges and BPE merges are learned in order, so every other token keeps the id
and the encoding it had before the markup existed (the dropped last merges are
rare words of the filler corpus that no dataset of ours uses).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rollout.errors import ConfigError

if TYPE_CHECKING:  # heavy imports stay inside the functions
    from tokenizers import Tokenizer
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
# The Hermes/Qwen tool-call frame as `json.dumps` writes it:
#   <tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>
# Matched leftmost-longest before the BPE, so `", "arguments": {"` wins over `": "`.
TOOL_MARKUP_TOKENS = ("<tool_call>", "</tool_call>", '{"name": "', '", "arguments": {"', '": "', '", "', '"}}')
ARCHS = ("qwen2", "llama")
# every byte plus the special tokens and the tool-call markup
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS) + len(TOOL_MARKUP_TOKENS)

# Qwen2's pre-tokenizer regex (transformers' `tokenization_qwen2.PRETOKENIZE_REGEX`).
# `\p{N}` isolates every digit, so "123" is three tokens. We must use exactly this
# split: for `model_type = "qwen2"` `AutoTokenizer` builds a `Qwen2Tokenizer`, which
# rebuilds the pre-tokenizer from this regex (ignoring the one in tokenizer.json),
# and the tokenizer we train must encode the same way after the round trip.
QWEN2_PRETOKENIZE_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""

# ChatML. The `{% generation %}` block covers exactly `{content}<|im_end|>` of
# assistant turns, so `apply_chat_template(..., return_assistant_tokens_mask=True)`
# marks the tokens an assistant-only SFT loss should train on.
# `tools=[...]` (OpenAI tool schemas) renders as one leading system block listing
# signatures only, e.g. "Tools: calculator(expression: string)" ("?" marks an
# optional parameter): descriptions would eat the tiny model's 512 positions.
# Without tools the rendering is plain ChatML, byte for byte.
CHAT_TEMPLATE = (
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\nTools: ' -}}"
    "{%- for tool in tools -%}"
    "{%- set fn = tool['function'] if tool['function'] is defined else tool -%}"
    "{%- set params = fn['parameters'] if fn['parameters'] is defined else {} -%}"
    "{%- set required = params['required'] if params['required'] is defined else [] -%}"
    "{{- (', ' if not loop.first else '') + fn['name'] + '(' -}}"
    "{%- if params['properties'] is defined -%}"
    "{%- for name, spec in params['properties'].items() -%}"
    "{%- set kind = spec['type'] if spec['type'] is defined else 'any' -%}"
    "{{- (', ' if not loop.first else '') + name + ('' if name in required else '?') + ': ' -}}"
    "{{- kind if kind is string else kind | join('|') -}}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- ')' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['role'] == 'assistant' -%}"
    "{%- generation -%}{{- message['content'] + '<|im_end|>' -}}{%- endgeneration -%}"
    "{{- '\\n' -}}"
    "{%- else -%}"
    "{{- message['content'] + '<|im_end|>' + '\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


@dataclass(frozen=True)
class TinyModelSpec:
    """The sizes of a tiny model; `validate_spec` checks them."""

    arch: str = "qwen2"
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 512
    vocab_size: int = 512
    max_position_embeddings: int = 512
    tie_word_embeddings: bool = True


def validate_spec(spec: TinyModelSpec) -> None:
    """Raise `ConfigError` for sizes no model can have."""
    if spec.arch not in ARCHS:
        raise ConfigError(f"unknown arch {spec.arch!r}: expected one of {', '.join(ARCHS)}")
    sizes = {
        "hidden_size": spec.hidden_size,
        "num_layers": spec.num_layers,
        "num_heads": spec.num_heads,
        "num_kv_heads": spec.num_kv_heads,
        "intermediate_size": spec.intermediate_size,
        "vocab_size": spec.vocab_size,
        "max_position_embeddings": spec.max_position_embeddings,
    }
    for name, value in sizes.items():
        if value <= 0:
            raise ConfigError(f"{name} must be positive, got {value}")
    if spec.hidden_size % spec.num_heads:
        raise ConfigError(f"num_heads ({spec.num_heads}) must divide hidden_size ({spec.hidden_size})")
    if spec.num_heads % spec.num_kv_heads:
        raise ConfigError(f"num_kv_heads ({spec.num_kv_heads}) must divide num_heads ({spec.num_heads})")
    if (spec.hidden_size // spec.num_heads) % 2:
        raise ConfigError(
            f"head dim hidden_size/num_heads = {spec.hidden_size // spec.num_heads} must be even (rotary embeddings)"
        )
    if spec.vocab_size < MIN_VOCAB_SIZE:
        raise ConfigError(
            f"vocab_size must be at least {MIN_VOCAB_SIZE} (256 bytes + {len(SPECIAL_TOKENS)} special tokens"
            f" + {len(TOOL_MARKUP_TOKENS)} tool-call markup tokens),"
            f" got {spec.vocab_size}"
        )


# --- tokenizer corpus ---------------------------------------------------------

# fmt: off
_SUBJECTS = (
    "the model", "a student", "the teacher", "my friend", "the system", "every agent", "this policy",
    "our team", "the reader", "a robot", "the writer", "each player", "the critic", "a learner",
)
_VERBS = (
    "learns", "reads", "writes", "answers", "checks", "computes", "explains", "solves", "counts",
    "finds", "builds", "trains", "measures", "prefers", "rejects", "chooses", "remembers", "follows",
)
_OBJECTS = (
    "the question", "a short answer", "the sum", "each number", "the result", "a simple problem",
    "the next token", "the reward", "this example", "the difference", "the product", "a long story",
    "the small garden", "some water", "the morning light", "every word", "a quiet river", "the old house",
)
_ADVERBS = ("quickly", "carefully", "again", "today", "well", "slowly", "correctly", "at once", "together")
_CONNECTIVES = ("and then", "because", "but", "so", "while", "after that", "although", "when")
_REPLIES = ("Sure.", "Yes, that is right.", "No, try again.", "The answer is", "Let me think.", "Thank you!")
_SYLLABLES = (
    "ka", "lo", "mi", "ne", "ra", "to", "vu", "sen", "tar", "bel", "dor", "fin", "gal", "hup", "jor",
    "kel", "mon", "pra", "qui", "sta", "tre", "wal", "zen", "ish", "ent", "ous", "ing", "er", "al", "on",
)
# fmt: on


def _english_line(rng: random.Random) -> str:
    """One procedurally generated English-like sentence."""
    clause = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_ADVERBS)}"
    if rng.random() < 0.5:
        clause += (
            f" {rng.choice(_CONNECTIVES)} {rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}"
        )
    if rng.random() < 0.3:
        clause += f", said {_made_up_word(rng).capitalize()}"
    return clause[0].upper() + clause[1:] + rng.choice((".", ".", "!", "?"))


def _made_up_word(rng: random.Random) -> str:
    """A pronounceable made-up word (gives the BPE trainer enough distinct pairs to merge)."""
    return "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 4)))


def iter_tokenizer_corpus(seed: int = 0) -> Iterator[str]:
    """The deterministic synthetic text the tokenizer is trained on.

    Chat turns appear without the special-token strings (those are added as
    whole tokens, never merged from pieces); role names and newlines remain so
    `user` / `assistant` get their own merges.
    """
    rng = random.Random(f"tokenizer-corpus:{seed}")
    for a in range(0, 20):
        for b in range(0, 20):
            for op, result in (("+", a + b), ("-", a - b), ("*", a * b)):
                yield f"What is {a}{op}{b}?"
                yield f"user\nWhat is {a}{op}{b}?\nassistant\n{result}\n"
    for _ in range(400):
        yield _english_line(rng)
    for _ in range(200):
        question = _english_line(rng)
        yield f"system\nYou are a helpful assistant.\nuser\n{question}\nassistant\n{rng.choice(_REPLIES)} {_english_line(rng)}\n"
    for _ in range(200):
        yield " ".join(_made_up_word(rng) for _ in range(rng.randint(3, 8)))


def train_tokenizer(vocab_size: int) -> Tokenizer:
    """Train the byte-level BPE (digits split one per token) on the synthetic corpus.

    It depends on `vocab_size` only, never on the model seed: tiny models of
    different seeds (a policy and its reward model, say) share one tokenizer.
    The BPE fills `vocab_size - len(TOOL_MARKUP_TOKENS)` ids; the tool-call
    markup takes the ids right after it.
    """
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        trainers,
    )

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(TOOL_MARKUP_TOKENS),
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(iter_tokenizer_corpus(), trainer=trainer)
    # normalized=False: matched on the raw text, so NFC can never change what matches.
    tokenizer.add_tokens([AddedToken(t, normalized=False) for t in TOOL_MARKUP_TOKENS])
    return tokenizer


def wrap_tokenizer(tokenizer: Tokenizer, *, model_max_length: int) -> PreTrainedTokenizerBase:
    """Wrap a `tokenizers.Tokenizer` as a transformers fast tokenizer with the ChatML template."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=None,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        unk_token=None,
        additional_special_tokens=[IM_START],
        padding_side="right",
        model_max_length=model_max_length,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


def build_model(spec: TinyModelSpec, *, seed: int, pad_id: int, eos_id: int) -> PreTrainedModel:
    """A randomly initialised float32 causal LM; `torch.manual_seed(seed)` right before init.

    The caller's torch RNG state is left as it was.
    """
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_cls, model_cls = (
        (Qwen2Config, Qwen2ForCausalLM) if spec.arch == "qwen2" else (LlamaConfig, LlamaForCausalLM)
    )
    config = config_cls(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=pad_id,  # like Qwen2.5: no BOS is prepended, <|endoftext|> doubles as bos
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        use_cache=True,
        dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):  # seed the init without touching the caller's RNG
        torch.manual_seed(seed)
        model = model_cls(config).to(torch.float32)
    model.generation_config = GenerationConfig(bos_token_id=pad_id, eos_token_id=eos_id, pad_token_id=pad_id)
    model.eval()
    return model


def count_saved_parameters(model_dir: Path) -> int:
    """Parameters stored in `model_dir`'s safetensors files (a tied lm_head is stored once)."""
    from safetensors import safe_open

    total = 0
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
                total += math.prod(f.get_slice(name).get_shape())
    return total


@contextmanager
def _quiet_progress_bars() -> Iterator[None]:
    """Hide transformers' "Writing model shards" bar for a sub-second write."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


# Files an older model directory may hold that would shadow or contradict ours.
# fmt: off
_STALE_FILES = (
    "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json",
    "vocab.json", "merges.txt", "special_tokens_map.json", "added_tokens.json", "tokenizer.model",
)
# fmt: on


def init_tiny_model(
    out_dir: Path,
    *,
    arch: str = "qwen2",
    seed: int = 0,
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 512,
    vocab_size: int = 512,
    max_position_embeddings: int = 512,
    tie_word_embeddings: bool = True,
    force: bool = False,
) -> Path:
    """Write a tiny random model + tokenizer to `out_dir` and return it.

    Raises `ConfigError` for bad sizes, or when `out_dir` is a non-empty
    directory and `force` is False. With `force`, our files overwrite theirs and
    known stale model/tokenizer files are removed; anything else is left alone.
    """
    spec = TinyModelSpec(
        arch=arch,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
    )
    validate_spec(spec)
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"{out_dir}: exists and is not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not force:
        raise ConfigError(f"{out_dir}: directory is not empty (pass --force to overwrite)")

    # A corpus too small for a huge vocab gives fewer tokens than vocab_size; the
    # model keeps vocab_size rows anyway (like Qwen's padded embeddings).
    tokenizer = wrap_tokenizer(train_tokenizer(vocab_size), model_max_length=max_position_embeddings)
    assert len(tokenizer) <= vocab_size, (len(tokenizer), vocab_size)
    pad_id = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    eos_id = tokenizer.convert_tokens_to_ids(IM_END)
    model = build_model(spec, seed=seed, pad_id=pad_id, eos_id=eos_id)

    out_dir.mkdir(parents=True, exist_ok=True)
    for name in _STALE_FILES:
        (out_dir / name).unlink(missing_ok=True)
    with _quiet_progress_bars():
        model.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
    return out_dir
