"""Byte-level BPE tokenizer for the embedded toy model, trained with `tokenizers` on the corpus text.

The real Laguna tokenizer has bos=2, eos=[2, 24], pad=9. The toy keeps the same *shape*: bos is a real
token that the chat template emits, the end-of-turn token is a second eos id, pad is its own token. The
special tokens get the lowest ids (in SPECIAL_TOKENS order) because they are registered with the trainer
before any merge.

Determinism: the BPE trainer breaks count ties by pair order, so its result should not depend on
threads; to rule that out, training runs with `TOKENIZERS_PARALLELISM=false` (read by the Rust side on
every call, restored afterwards). Two trainings on the same texts, in one process or in two, give
byte-identical tokenizer.json files (tests/model/test_tokenizer.py).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

BOS_TOKEN = "<|endoftext|>"  # document start; also the first eos id (like the real bos 2 == eos[0])
PAD_TOKEN = "<|pad|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"  # end of a chat turn; the second eos id (like the real eos 24)

# Order fixes the ids: <|endoftext|>=0, <|pad|>=1, <|im_start|>=2, <|im_end|>=3.
SPECIAL_TOKENS: tuple[str, ...] = (BOS_TOKEN, PAD_TOKEN, IM_START, IM_END)

# ChatML-style template: `<|im_start|>role\ncontent<|im_end|>\n` per message, led by the bos token;
# add_generation_prompt opens an assistant turn.
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)

# transformers' save_pretrained(save_jinja_files=True) would move the template into chat_template.jinja;
# we keep it in tokenizer_config.json.
SAVE_KWARGS = {"save_jinja_files": False}


@contextlib.contextmanager
def _single_threaded_tokenizers() -> Iterator[None]:
    previous = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = previous


def train_tokenizer(
    texts: Iterable[str], *, vocab_size: int, min_frequency: int = 2
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer with SPECIAL_TOKENS and CHAT_TEMPLATE on `texts`.

    The returned tokenizer has exactly `vocab_size` tokens when the texts offer enough merges (they may
    offer fewer: callers size the embedding from len(tokenizer)). No post-processor: bos comes from the
    chat template, so rendering + `add_special_tokens=False` is the one way text becomes ids.
    """
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size {vocab_size} is below the byte alphabet plus special tokens")
    tokenizer = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    with _single_threaded_tokenizers():
        tokenizer.train_from_iterator(iter(texts), trainer=trainer)
    return wrap_tokenizer(tokenizer)


def wrap_tokenizer(tokenizer: Tokenizer) -> PreTrainedTokenizerFast:
    """Wrap a raw `tokenizers.Tokenizer` as a PreTrainedTokenizerFast with our special tokens/template."""
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS_TOKEN,
        eos_token=BOS_TOKEN,
        pad_token=PAD_TOKEN,
        extra_special_tokens=[IM_START, IM_END],
        model_max_length=1 << 20,
        padding_side="right",
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def special_token_ids(tokenizer: PreTrainedTokenizerFast) -> dict[str, int | list[int]]:
    """bos/eos/pad ids in the model-config shape: eos is [end-of-text, end-of-turn] like the real model."""
    ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in SPECIAL_TOKENS}
    return {
        "bos_token_id": ids[BOS_TOKEN],
        "eos_token_id": [ids[BOS_TOKEN], ids[IM_END]],
        "pad_token_id": ids[PAD_TOKEN],
    }


def render_conversation(tokenizer: PreTrainedTokenizerFast, messages: list[dict]) -> str:
    """Render one conversation through the chat template (no generation prompt)."""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)


def conversation_texts(conversations: Iterable[list[dict]]) -> Iterator[str]:
    """Tokenizer-training text: each conversation rendered as the template would lay it out, minus the
    special tokens (those are added to the vocabulary, not learned)."""
    for messages in conversations:
        yield "".join(f"{m['role']}\n{m['content']}\n" for m in messages)
