"""Tokenizer loading and prompt encoding, as diffusers' ``WanPipeline`` does it.

Reference: ``diffusers/pipelines/wan/pipeline_wan.py`` (``prompt_clean`` and
``WanPipeline._get_t5_prompt_embeds``): clean each prompt, tokenize with padding to
``max_sequence_length`` and truncation (``</s>`` appended), run the UMT5 encoder with the
attention mask, then keep each prompt's first ``length`` embeddings and zero the rest.

The encoder call is jitted once per (module, padded batch, sequence length); pass
``pad_batch_to`` to keep the batch shape fixed so varying prompt counts do not recompile.

The encoder runs on the batch's real tokens only, rounded up to a power of two
(:func:`encoding_length`), and the result is zero-padded to ``max_sequence_length``: with the
attention mask, a real token never sees a padding token (UMT5's relative position bias depends
on distances alone), so its embedding is the one the full-length call gives (float rounding
aside, tests/jaxcore/test_text.py), and a typical prompt of a few dozen tokens costs a tenth
of the 512-token call diffusers makes.
"""

from __future__ import annotations

import functools
import html
import os
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import regex

from jaxcore.weights import WeightsError


class TokenizerNotFoundError(WeightsError, FileNotFoundError):
    """A tokenizer directory that does not exist: a model directory's fault, reported by the
    CLI as a user error (a :class:`~jaxcore.weights.WeightsError`), and a FileNotFoundError."""


def load_tokenizer(directory: str | os.PathLike):
    """``AutoTokenizer`` from a local directory only; never runs code shipped with it. Every
    family's tokenizers load here."""
    from transformers import AutoTokenizer

    path = Path(directory)
    if not path.is_dir():
        raise TokenizerNotFoundError(f"tokenizer directory {path} does not exist")
    return AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)


def prompt_clean(text: str) -> str:
    """diffusers' Wan ``prompt_clean``: ftfy (if installed), unescape HTML twice, squash spaces."""
    try:
        import ftfy
    except ModuleNotFoundError:  # diffusers skips ftfy too when it is absent
        ftfy = None
    if ftfy is not None:
        text = ftfy.fix_text(text)
    text = html.unescape(html.unescape(text)).strip()
    # `regex` (not `re`), as diffusers uses: its \s matches the same Unicode spaces.
    return regex.sub(r"\s+", " ", text).strip()


# A transformers fast tokenizer keeps its truncation / padding settings on the shared backend
# object and sets them on every call (transformers#47085): two threads tokenizing at different
# lengths at once got each other's (255 of 2,400 calls padded to the wrong length, 8 threads),
# and other versions raise "Already borrowed". Convert's encoder threads, a multi-threaded
# DirectRunner and generate's text encoding share tokenizers, so every call takes this lock.
_TOKENIZER_LOCK = threading.Lock()


def call_tokenizer(tokenizer, texts: list[str], **kwargs):
    """``tokenizer(texts, **kwargs)``, one call at a time in this process (see above)."""
    with _TOKENIZER_LOCK:
        return tokenizer(texts, **kwargs)


def padded_token_ids(tokenizer, prompts, max_length: int) -> np.ndarray:
    """The pipelines' plain tokenization (Flux's CLIP and T5, SD's CLIPs): padded to
    ``max_length``, truncated; int32 ``[B, max_length]``."""
    encoded = call_tokenizer(
        tokenizer,
        list(prompts),
        padding="max_length",
        max_length=max_length,
        truncation=True,
        return_tensors="np",
    )
    return np.asarray(encoded["input_ids"], np.int32)


def tokenize_prompts(
    tokenizer, prompts: list[str], max_sequence_length: int = 512
) -> tuple[np.ndarray, np.ndarray]:
    """Cleaned, padded, truncated token ids and attention mask, both int32 [B, max_len]."""
    if isinstance(prompts, str) or not all(isinstance(p, str) for p in prompts):
        raise TypeError("prompts must be a list of strings")
    if max_sequence_length < 1:
        raise ValueError(f"max_sequence_length must be >= 1, got {max_sequence_length}")
    encoded = call_tokenizer(
        tokenizer,
        [prompt_clean(p) for p in prompts],
        padding="max_length",
        max_length=max_sequence_length,
        truncation=True,
        add_special_tokens=True,
        return_attention_mask=True,
        return_tensors="np",
    )
    return (
        np.asarray(encoded["input_ids"], np.int32),
        np.asarray(encoded["attention_mask"], np.int32),
    )


@functools.lru_cache(maxsize=8)
def _jitted_encoder(module):
    """One jitted encode function per module (modules are hashable frozen dataclasses)."""

    def encode(params, ids_bl, mask_bl):
        hidden_bld = module.apply({"params": params}, ids_bl, mask_bl).astype(jnp.float32)
        lengths_b = (mask_bl > 0).sum(axis=1)
        # WanPipeline keeps u[:length] and appends zeros: select, so NaN/inf cannot leak in.
        keep_bl = jnp.arange(ids_bl.shape[1])[None, :] < lengths_b[:, None]
        return jnp.where(keep_bl[..., None], hidden_bld, 0.0), lengths_b

    return jax.jit(encode)


MIN_ENCODING_LENGTH = 16


def encoding_length(longest: int, max_sequence_length: int) -> int:
    """Tokens the encoder runs on for a batch whose longest prompt has ``longest`` tokens: the
    next power of two (at least :data:`MIN_ENCODING_LENGTH`), at most ``max_sequence_length``.
    Powers of two bound the compilations per batch shape to ~log2(max_sequence_length)."""
    length = MIN_ENCODING_LENGTH
    while length < longest:
        length *= 2
    return min(length, max_sequence_length)


def encode_prompts(
    tokenizer,
    module,
    params,
    prompts: list[str],
    max_sequence_length: int = 512,
    *,
    pad_batch_to: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Prompt embeddings as WanPipeline computes them, from ``module``: an encoder-only text
    model (UMT5, T5) whose ``apply({"params": params}, ids, mask)`` is its last hidden state.

    Returns ``(embeddings [B, max_sequence_length, d_model] float32, lengths [B] int32)`` where
    ``lengths`` counts real tokens (``</s>`` included) and rows past it are exactly zero.
    ``pad_batch_to``: run the encoder on a batch padded to this many rows (extra rows are
    dropped from the result), so calls with 1..pad_batch_to prompts share one compilation.
    """
    ids_bl, mask_bl = tokenize_prompts(tokenizer, prompts, max_sequence_length)
    batch = ids_bl.shape[0]
    if pad_batch_to is not None:
        if batch > pad_batch_to:
            raise ValueError(f"{batch} prompts do not fit in pad_batch_to={pad_batch_to}")
        extra = pad_batch_to - batch
        ids_bl = np.pad(ids_bl, ((0, extra), (0, 0)), constant_values=tokenizer.pad_token_id)
        mask_bl = np.pad(mask_bl, ((0, extra), (0, 0)))
    length = encoding_length(int(mask_bl.sum(axis=1).max(initial=0)), max_sequence_length)
    embeddings, lengths = _jitted_encoder(module)(params, ids_bl[:, :length], mask_bl[:, :length])
    embeddings = np.asarray(embeddings[:batch])
    if length < max_sequence_length:
        embeddings = np.pad(embeddings, ((0, 0), (0, max_sequence_length - length), (0, 0)))
    return embeddings, np.asarray(lengths[:batch], np.int32)
