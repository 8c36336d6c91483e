"""A tiny ChatML tokenizer for the data tests, trained here (no hub).

Kept out of conftest.py so test modules can import it by a unique name.
"""

from __future__ import annotations

CHATML_TEMPLATE = (
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

_CORPUS = [
    "user\nWhat is 2+3?\nassistant\n5\n",
    "system\nYou are a helpful assistant.\nuser\nHello there!\nassistant\nHi, how can I help?\n",
    "The quick brown fox jumps over the lazy dog.",
    "the model learns the answer and then the student checks the result",
    "Question: what is the capital of France? Answer: Paris.",
]


def build_chatml_tokenizer(vocab_size: int = 400, template: str | None = CHATML_TEMPLATE):
    """A byte-level BPE trained here, wrapped as a fast tokenizer with ChatML.

    Special tokens: `<|endoftext|>` = 0 (pad), `<|im_start|>` = 1, `<|im_end|>` = 2 (eos).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)  # exact offsets for the assistant mask
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 20, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        chat_template=template,
        clean_up_tokenization_spaces=False,
    )
