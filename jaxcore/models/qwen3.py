"""The Qwen3 text encoder of Flux.2 [klein] in Flax linen (= transformers ``Qwen3ForCausalLM``,
its decoder stack only), and the prompt embedding of diffusers' ``Flux2KleinPipeline``.

References: ``transformers/models/qwen3/modeling_qwen3.py`` (transformers 5.x) and
``diffusers/pipelines/flux2/pipeline_flux2_klein.py`` (``_get_qwen3_prompt_embeds``).

The network is the shared Llama-style decoder (:mod:`jaxcore.models.decoder_lm`, which
describes it) with Qwen3's switches: q/k/v/o biases if ``attention_bias``, an RMSNorm over each
head's ``head_dim`` on q and k (Qwen3's q/k norms, before RoPE), the full causal mask, and
transformers' default RoPE with ``rope_theta``. This file holds what is Qwen3's: its config
(transformers' names), the chat-template prompt embedding and the checkpoint layout
(``model.`` prefix).

``hidden_states`` are numbered as transformers' ``output_hidden_states``: index 0 is the
embedding, index k < N the output of layer k (1-based), and index N (the last layer) has the
final ``model.norm`` applied (= ``last_hidden_state``), as transformers returns it.

Only what the encoder needs is supported: ``rope_type`` "default" (Qwen3-4B / 8B use no
scaling) and no sliding window; anything else is refused by its config key. The LM head is
never loaded (its ``lm_head.weight`` is ignored).

Public API: :class:`Qwen3Config`, :class:`Qwen3Model`, :func:`hidden_states`,
:func:`stacked_hidden_states`, :func:`tokenize_prompts`, :func:`prompt_embeds`,
:func:`weight_map`, :func:`load_qwen3`, :func:`init_qwen3`, :func:`count_params`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxcore import weights
from jaxcore.models import decoder_lm
from jaxcore.models.decoder_lm import hidden_states

__all__ = [
    "Qwen3Config",
    "Qwen3ConfigError",
    "Qwen3Model",
    "count_params",
    "hidden_states",
    "init_qwen3",
    "load_qwen3",
    "prompt_embeds",
    "stacked_hidden_states",
    "tokenize_prompts",
    "weight_map",
]

# Flux2KleinPipeline's defaults (``text_encoder_out_layers``, ``max_sequence_length``).
KLEIN_LAYERS = (9, 18, 27)
KLEIN_MAX_SEQUENCE_LENGTH = 512

# config.json keys about training, generation or bookkeeping; the hidden states do not depend
# on them. Any other key that is no Qwen3Config field is an error naming it.
IGNORED_CONFIG_KEYS = frozenset(
    {
        "architectures",
        "attention_dropout",
        "bos_token_id",
        "dtype",
        "eos_token_id",
        "initializer_range",
        "pad_token_id",
        "torch_dtype",
        "transformers_version",
        "use_cache",
    }
)


class Qwen3ConfigError(ValueError):
    """A config.json key or value Qwen3Config cannot represent; names the key."""


@dataclasses.dataclass(frozen=True)
class Qwen3Config:
    """transformers ``Qwen3Config`` fields the encoder uses; defaults are transformers'.

    ``rope_theta`` / ``rope_scaling`` are the transformers 4.x keys; a 5.x ``rope_parameters``
    dict is read into them by :meth:`from_dict`. ``max_position_embeddings`` and
    ``tie_word_embeddings`` (the unused LM head's) are kept for round trips.
    """

    vocab_size: int = 151936
    hidden_size: int = 4096
    intermediate_size: int = 22016
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    head_dim: int = 128
    hidden_act: str = "silu"
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Mapping | None = None
    attention_bias: bool = False
    use_sliding_window: bool = False
    sliding_window: int | None = None
    max_window_layers: int = 28
    layer_types: tuple[str, ...] | None = None
    tie_word_embeddings: bool = False
    model_type: str = "qwen3"

    def __post_init__(self):
        """Tuples for lists; refuse unsupported variants and bad sizes by key."""
        if self.layer_types is not None:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        self._check_supported()
        # Only the default RoPE passes the check, and it has no parameters: drop the dict
        # (modules holding this config must hash).
        object.__setattr__(self, "rope_scaling", None)
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers"):
            if getattr(self, key) < 1:
                raise Qwen3ConfigError(f"{key} must be >= 1, got {getattr(self, key)}")
        if self.num_key_value_heads < 1 or self.num_attention_heads % self.num_key_value_heads:
            raise Qwen3ConfigError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise Qwen3ConfigError(f"head_dim={self.head_dim} must be even for RoPE")

    def _check_supported(self) -> None:
        """Variants the encoder does not implement are refused by the key that asks for them."""
        if self.model_type != "qwen3":
            raise Qwen3ConfigError(f"model_type={self.model_type!r} is not 'qwen3'")
        if self.hidden_act != "silu":
            raise Qwen3ConfigError(f"hidden_act={self.hidden_act!r} is not supported (silu only)")
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type != "default":
            raise Qwen3ConfigError(f"rope_scaling rope_type={rope_type!r} is not supported")
        if self.use_sliding_window:
            raise Qwen3ConfigError("use_sliding_window=true is not supported")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_hidden_layers:
                raise Qwen3ConfigError("layer_types must have num_hidden_layers entries")
            if set(self.layer_types) != {"full_attention"}:
                raise Qwen3ConfigError(f"layer_types {sorted(set(self.layer_types))} unsupported")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Qwen3Config:
        """Build from a transformers config.json dict (4.x or 5.x keys)."""
        kwargs = {k: v for k, v in d.items() if not k.startswith("_")}
        kwargs = {k: v for k, v in kwargs.items() if k not in IGNORED_CONFIG_KEYS}
        rope = kwargs.pop("rope_parameters", None)
        if rope is not None:  # transformers 5: {"rope_theta": ..., "rope_type": ...}
            rope = dict(rope)
            kwargs["rope_theta"] = rope.pop("rope_theta", cls.rope_theta)
            kwargs["rope_scaling"] = rope or None
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise Qwen3ConfigError(f"unknown Qwen3Config keys {unknown}; known: {sorted(known)}")
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        """The fields as a dict (lists, not tuples)."""
        d = dataclasses.asdict(self)
        return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}

    def decoder_options(self) -> decoder_lm.DecoderOptions:
        """The shared decoder's view: Qwen3's q/k norms, its biases, the full causal mask and
        the default RoPE (the only one the config accepts)."""
        return decoder_lm.DecoderOptions.of(
            self,
            decoder_lm.default_inv_freq(self.head_dim, self.rope_theta),
            attention_bias=self.attention_bias,
            qk_norm=True,
        )


# --- the model ----------------------------------------------------------------------------------


class Qwen3Model(decoder_lm.DecoderLM):
    """transformers ``Qwen3Model``; ``__call__(ids, mask, layers)`` -> the hidden states
    ``layers`` (default all; 0: the embedding, k: the output of layer k, the last layer's
    through ``model.norm``) stacked ``[K, B, L, D]``, running only the first ``max(layers)``
    layers: the shared :class:`~jaxcore.models.decoder_lm.DecoderLM` built from
    :meth:`Qwen3Config.decoder_options`."""

    config: Qwen3Config


def stacked_hidden_states(module, params, ids_bl, mask_bl, layers=KLEIN_LAYERS) -> jax.Array:
    """The pipeline's prompt embedding from token ids: ``[B, L, K * D]``, channel
    ``k * D + d`` = hidden state ``layers[k]`` (its ``stack(dim=1).permute(0, 2, 1, 3)``)."""
    return decoder_lm.stacked_hidden_states(module, params, ids_bl, mask_bl, layers)


def tokenize_prompts(tokenizer, prompts, max_sequence_length: int = KLEIN_MAX_SEQUENCE_LENGTH):
    """ids and attention mask int32 ``[B, max_sequence_length]`` as ``_get_qwen3_prompt_embeds``
    makes them: each prompt as one user message through the chat template (generation prompt
    added, thinking disabled), then padded to ``max_sequence_length`` (the tokenizer's own
    padding side) and truncated."""
    from jaxcore.text import call_tokenizer

    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    ids, masks = [], []
    for prompt in prompts:  # one call per prompt, as the pipeline (same padding per row)
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}],
            tokenize=False,
            add_generation_prompt=True,
            enable_thinking=False,
        )
        encoded = call_tokenizer(
            tokenizer,
            text,
            padding="max_length",
            truncation=True,
            max_length=max_sequence_length,
            return_tensors="np",
        )
        ids.append(np.asarray(encoded["input_ids"], np.int32))
        masks.append(np.asarray(encoded["attention_mask"], np.int32))
    return np.concatenate(ids), np.concatenate(masks)


def prompt_embeds(
    tokenizer,
    module: Qwen3Model,
    params,
    prompts,
    max_sequence_length: int = KLEIN_MAX_SEQUENCE_LENGTH,
    layers: Sequence[int] = KLEIN_LAYERS,
) -> np.ndarray:
    """``Flux2KleinPipeline._get_qwen3_prompt_embeds``: ``[B, max_sequence_length, K * D]``
    float32 on the host; padding rows are kept (the pipeline keeps them too)."""
    ids_bl, mask_bl = tokenize_prompts(tokenizer, prompts, max_sequence_length)
    embeds = stacked_hidden_states(module, params, ids_bl, mask_bl, layers)
    return np.asarray(embeds.astype(jnp.float32))


# --- weights -------------------------------------------------------------------------------------

# Qwen3ForCausalLM's LM head (or a tied copy) is not part of the encoder.
UNUSED_PREFIXES = ("lm_head.",)


def weight_map(config: Qwen3Config) -> dict:
    """Flax param path -> (transformers ``Qwen3ForCausalLM`` key, transform)."""
    return decoder_lm.weight_map(config.decoder_options(), "model.")


def count_params(config: Qwen3Config, *, with_lm_head: bool = False) -> int:
    """Parameters of the encoder (``Qwen3Model``); ``with_lm_head`` adds the untied LM head,
    giving ``Qwen3ForCausalLM``'s count."""
    n = decoder_lm.count_params(Qwen3Model(config))
    if with_lm_head and not config.tie_word_embeddings:
        n += config.vocab_size * config.hidden_size
    return n


def init_qwen3(config: Qwen3Config, rng, *, dtype=jnp.float32, param_dtype=None):
    """Random-init ``(module, params)`` (unboxed, on the default device)."""
    module = Qwen3Model(config, dtype=dtype, param_dtype=param_dtype or dtype)
    return module, decoder_lm.init_params(module, rng)


def load_qwen3(
    directory: str | os.PathLike,
    *,
    dtype=jnp.float32,
    param_dtype=None,
    mesh: jax.sharding.Mesh | None = None,
    rules=None,
) -> tuple[Qwen3Model, dict]:
    """A transformers Qwen3 (``Qwen3ForCausalLM`` / ``Qwen3Model`` saved with a ``model.``
    prefix) directory -> ``(module, params)``; ``lm_head.*`` is not read."""
    config = Qwen3Config.from_dict(weights.read_config(directory))
    module = Qwen3Model(config, dtype=dtype, param_dtype=param_dtype or dtype)
    reader = weights.SafetensorsReader(directory)
    params = decoder_lm.load_params(
        module, reader, weight_map(config), mesh=mesh, rules=rules, ignore_unused=UNUSED_PREFIXES
    )
    return module, params
