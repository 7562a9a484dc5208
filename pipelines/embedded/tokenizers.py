"""Tiny tokenizers built offline (T5-style and CLIP-style), for tests and the CPU demo.

Real Wan checkpoints ship the umt5-xxl SentencePiece tokenizer (256k pieces), which cannot be
downloaded here. This builds the same *kind* of tokenizer, small: a transformers
``T5Tokenizer`` (tokenizers ``Unigram`` model, ``▁`` metaspace pre-tokenizer, ``</s>`` appended
by the post-processor) with ``<pad>`` = 0, ``</s>`` = 1, ``<unk>`` = 2 as in T5. The vocabulary is
a fixed word list (colours, shapes, a few scene words) as whole-word pieces, plus single
characters as fallback pieces so unseen words still tokenize (spelled out). Like T5 it is
case-sensitive: "Red" is spelled out while "red" is one piece. (A custom normalizer would not
survive ``save_pretrained``/``AutoTokenizer``: ``T5Tokenizer`` rebuilds its pipeline on load.)
"""

from __future__ import annotations

import os
import string
from pathlib import Path

PAD, EOS, UNK = "<pad>", "</s>", "<unk>"

COLOURS = [
    "red",
    "green",
    "blue",
    "yellow",
    "orange",
    "purple",
    "pink",
    "brown",
    "black",
    "white",
    "gray",
    "cyan",
    "magenta",
    "gold",
    "silver",
]
SHAPES = [
    "circle",
    "square",
    "triangle",
    "star",
    "rectangle",
    "hexagon",
    "ring",
    "cross",
    "heart",
    "diamond",
    "dot",
]
WORDS = [
    "a",
    "the",
    "on",
    "in",
    "of",
    "and",
    "with",
    "background",
    "small",
    "big",
    "large",
    "bright",
    "dark",
    "moving",
    "rotating",
    "spinning",
    "bouncing",
    "sliding",
    "left",
    "right",
    "up",
    "down",
    "slowly",
    "quickly",
    "over",
    "under",
]
DEFAULT_WORDS: tuple[str, ...] = (*COLOURS, *SHAPES, *WORDS)

# Fallback pieces: every ASCII letter and digit, and common punctuation.
_CHARACTERS = tuple(string.ascii_letters + string.digits + ",.!?'-")


def _vocabulary(words: tuple[str, ...], vocab_size: int) -> list[tuple[str, float]]:
    """(piece, log-prob score) in id order; whole words score far above spelling them out."""
    pieces: list[tuple[str, float]] = [(PAD, 0.0), (EOS, 0.0), (UNK, 0.0), ("▁", -2.0)]
    seen = {p for p, _ in pieces}
    for word in words:
        piece = "▁" + word
        if piece not in seen:
            pieces.append((piece, -3.0))
            seen.add(piece)
    for char in _CHARACTERS:
        if char not in seen:
            pieces.append((char, -8.0))
            seen.add(char)
    if len(pieces) > vocab_size:
        raise ValueError(
            f"vocab_size={vocab_size} is too small for {len(pieces)} pieces "
            f"({len(words)} words + specials + {len(_CHARACTERS)} characters)"
        )
    # Fill the rest with unused sentinel-like pieces so len(tokenizer) == vocab_size exactly,
    # which a model built with the same vocab_size then covers.
    for i in range(vocab_size - len(pieces)):
        pieces.append((f"<unused_{i}>", -100.0))
    return pieces


def build_tiny_tokenizer(
    directory: str | os.PathLike,
    vocab_size: int = 128,
    words: tuple[str, ...] = DEFAULT_WORDS,
    model_max_length: int = 512,
):
    """Build the tokenizer, ``save_pretrained`` it to ``directory`` and return it.

    ``transformers.AutoTokenizer.from_pretrained(directory)`` loads it back (class
    ``T5Tokenizer``). Ids are ``< vocab_size``, so it pairs with a tiny UMT5 of that vocab.
    """
    from transformers import T5Tokenizer

    tokenizer = T5Tokenizer(
        vocab=_vocabulary(tuple(words), vocab_size),
        eos_token=EOS,
        unk_token=UNK,
        pad_token=PAD,
        extra_ids=0,
        additional_special_tokens=[],
        model_max_length=model_max_length,
    )
    Path(directory).mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(directory)
    return tokenizer


CLIP_BOS, CLIP_EOS = "<|startoftext|>", "<|endoftext|>"
_CLIP_CHARACTERS = tuple(string.ascii_lowercase + string.digits + ",.!?'-")


def _clip_vocabulary(words: tuple[str, ...]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A byte-pair vocabulary: every character alone and word-final (``</w>``), then the merges
    that build each word left to right, then CLIP's two special tokens last."""
    vocab: dict[str, int] = {}

    def add(token: str) -> None:
        vocab.setdefault(token, len(vocab))

    for char in _CLIP_CHARACTERS:
        add(char)
    for char in _CLIP_CHARACTERS:
        add(char + "</w>")
    merges: list[tuple[str, str]] = []
    for word in words:
        parts = [*word[:-1], word[-1] + "</w>"]
        while len(parts) > 1:
            pair = (parts[0], parts[1])
            if pair not in merges:
                merges.append(pair)
            parts = [parts[0] + parts[1], *parts[2:]]
            add(parts[0])
    add(CLIP_BOS)
    add(CLIP_EOS)
    return vocab, merges


def build_tiny_clip_tokenizer(
    directory: str | os.PathLike,
    words: tuple[str, ...] = DEFAULT_WORDS,
    model_max_length: int = 77,
):
    """A tiny CLIP (byte-pair) tokenizer, ``save_pretrained`` to ``directory``; returns it.

    Lower-cased like CLIP's; whole words of ``words`` are one token each, anything else is
    spelled out from single characters (characters outside the alphabet become
    ``<|endoftext|>``, CLIP's unknown token). ``<|startoftext|>`` / ``<|endoftext|>`` are the
    last two ids, so ``len(tokenizer)`` is the vocabulary a tiny CLIP text model needs.
    """
    from transformers import CLIPTokenizer

    vocab, merges = _clip_vocabulary(tuple(words))
    tokenizer = CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=model_max_length)
    Path(directory).mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(directory)
    return tokenizer
