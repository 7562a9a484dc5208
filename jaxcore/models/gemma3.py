"""The Gemma-3 text model (LTX-2's prompt encoder) in Flax linen, and the prompt embedding of
diffusers' ``LTX2Pipeline``.

References: ``transformers/models/gemma3/modeling_gemma3.py`` (``Gemma3TextModel``, as
``Gemma3ForConditionalGeneration`` runs it on text; transformers 5.25) and
``diffusers/pipelines/ltx2/pipeline_ltx2.py`` (``_get_gemma_prompt_embeds``, diffusers 0.42).

The network: token embedding times ``sqrt(hidden_size)`` (the scale rounded to the weights'
dtype, as transformers' ``Gemma3TextScaledWordEmbedding``), then per layer

    x = x + post_attention_norm(attn(input_norm(x)))
    x = x + post_feedforward_norm(mlp(pre_feedforward_norm(x)))

and a final norm. Every norm is Gemma's RMSNorm: statistics and the ``(1 + weight)`` factor in
float32, one rounding to the activation dtype. Attention: q/k/v projections, Gemma's RMSNorm
over each head's ``head_dim`` on q and k (before RoPE), rotate-half RoPE at positions
``0..L-1`` whatever the padding (transformers' default ``position_ids``), grouped-query
attention, scores scaled by ``query_pre_attn_scalar ** -0.5`` (not ``head_dim``), causal AND
padding mask. Layers are local or global by ``layer_types`` (default from
``sliding_window_pattern``: every ``pattern``-th layer global): a local layer's query q sees
only keys k with ``q - sliding_window < k <= q`` and rotates by ``rope_local_base_freq``; a
global layer sees every earlier key and rotates by ``rope_theta`` with ``rope_scaling``
(``linear``: the frequencies divided by ``factor``; 8 for the 12B). The MLP is
``down(gelu_tanh(gate x) * up x)``. A query with no visible key (a left pad) gets a zero
attention output, as torch's SDPA (transformers' default attention) gives a fully masked row.

``attn_logit_softcapping`` is accepted and, as in transformers' Gemma3 (whose attention never
passes it on; Gemma-2 applied it), not applied: every released Gemma-3 sets it to null.
``final_logit_softcapping`` belongs to the LM head, which an encoder does not have.

``hidden_states`` are numbered as transformers' ``output_hidden_states``: index 0 is the scaled
embedding, index k < N the output of layer k, and index N has the final norm applied (transformers
ties the last hidden state to ``last_hidden_state``).

The prompt embedding (:func:`prompt_embeds`) is ``_get_gemma_prompt_embeds``: the prompts
stripped, tokenized with the tokenizer's padding side set to ``"left"`` (the pipeline sets it on
the tokenizer; so does this), padded to ``max_sequence_length`` and truncated, BOS added; all
N + 1 hidden states stacked on a last axis and packed ``[B, L, D * (N + 1)]`` (channel
``d * (N + 1) + k`` is hidden state k's channel d), and repeated per video as the pipeline does.
The normalisation of those states is the connectors' (:mod:`jaxcore.models.ltx2_connectors`).

Weights: a saved ``Gemma3ForConditionalGeneration`` (text config nested under
``text_config``; tensors under ``language_model.model.`` as transformers writes them, or
``model.language_model.`` as it names them in memory), a ``Gemma3ForCausalLM`` (``model.``) or a
``Gemma3TextModel`` (no prefix). The vision tower, the projector and the LM head are not read.

Shared with Qwen3 / Mistral (:mod:`jaxcore.models.decoder_lm`) where the computation is the
same: RoPE tables and rotation, masks, grouped attention, the q/k/v/o projections, the gated MLP
(here with ``gelu_tanh``), the embedding, the attention / MLP weight layouts, loading. Gemma's
own: its ``(1 + w)`` RMSNorm, the sandwich-norm layer, the scaled embedding and the local /
global layer dispatch (the shared decoder layer and stack are not bent to fit them).

Public API: :class:`Gemma3TextConfig`, :class:`Gemma3TextModel`, :func:`hidden_states`,
:func:`packed_hidden_states`, :func:`tokenize_prompts`, :func:`prompt_embeds`,
:func:`weight_map`, :func:`load_gemma3`, :func:`init_gemma3`, :func:`count_params`.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from jaxcore import weights
from jaxcore.models import decoder_lm
from jaxcore.models.decoder_lm import GatedMLP, apply_rope, grouped_attention
from jaxcore.models.layers import gelu_tanh

__all__ = [
    "Gemma3ConfigError",
    "Gemma3TextConfig",
    "Gemma3TextModel",
    "count_params",
    "hidden_states",
    "init_gemma3",
    "load_gemma3",
    "packed_hidden_states",
    "prompt_embeds",
    "tokenize_prompts",
    "weight_map",
]

# LTX2Pipeline's default ``max_sequence_length``.
LTX2_MAX_SEQUENCE_LENGTH = 1024

SLIDING, FULL = "sliding_attention", "full_attention"

# config.json keys about training, generation, caching or the LM head; the hidden states do not
# depend on them. Any other key that is no Gemma3TextConfig field is an error naming it.
IGNORED_CONFIG_KEYS = frozenset(
    {
        "architectures",
        "attention_dropout",
        "bos_token_id",
        "cache_implementation",
        "dtype",
        "eos_token_id",
        "final_logit_softcapping",
        "initializer_range",
        "pad_token_id",
        "torch_dtype",
        "transformers_version",
        "use_cache",
    }
)
SUPPORTED_ROPE_TYPES = ("default", "linear")


class Gemma3ConfigError(ValueError):
    """A config.json key or value Gemma3TextConfig cannot represent; names the key."""


@dataclasses.dataclass(frozen=True)
class Gemma3TextConfig:
    """transformers ``Gemma3TextConfig`` fields the encoder uses; defaults are transformers'
    (what a Hub config.json leaves out, as google/gemma-3-12b-it's text_config does).

    The RoPE is held in the transformers 4.x keys (``rope_theta`` and ``rope_scaling`` for
    global layers, ``rope_local_base_freq`` for local ones); a 5.x ``rope_parameters`` dict per
    layer type is read into them by :meth:`from_dict`. ``rope_scaling`` is kept as sorted
    ``(key, value)`` pairs so the config hashes (modules holding it must).
    """

    vocab_size: int = 262_208
    hidden_size: int = 2304
    intermediate_size: int = 9216
    num_hidden_layers: int = 26
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int = 256
    hidden_activation: str = "gelu_pytorch_tanh"
    max_position_embeddings: int = 131_072
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_local_base_freq: float = 10_000.0
    rope_scaling: Any = None
    attention_bias: bool = False
    query_pre_attn_scalar: float = 256
    sliding_window: int = 4096
    sliding_window_pattern: int = 6
    layer_types: tuple[str, ...] | None = None
    attn_logit_softcapping: float | None = None
    use_bidirectional_attention: bool = False
    tie_word_embeddings: bool = True
    model_type: str = "gemma3_text"

    def __post_init__(self):
        """Derive ``layer_types``, freeze ``rope_scaling``; refuse what is not implemented."""
        if self.layer_types is None:
            pattern = self.sliding_window_pattern
            types = [SLIDING if (i + 1) % pattern else FULL for i in range(self.num_hidden_layers)]
            object.__setattr__(self, "layer_types", tuple(types))
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        scaling = self.rope_scaling
        if isinstance(scaling, Mapping):
            object.__setattr__(self, "rope_scaling", tuple(sorted(scaling.items())))
        self._check_supported()
        self._check_sizes()

    def _check_supported(self) -> None:
        """Variants the encoder does not implement are refused by the key that asks for them."""
        if self.model_type != "gemma3_text":
            raise Gemma3ConfigError(f"model_type={self.model_type!r} is not 'gemma3_text'")
        if self.hidden_activation != "gelu_pytorch_tanh":
            raise Gemma3ConfigError(
                f"hidden_activation={self.hidden_activation!r} is not supported "
                "(gelu_pytorch_tanh only)"
            )
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise Gemma3ConfigError(
                f"rope_scaling rope_type={self.rope_type!r} is not supported "
                f"({', '.join(SUPPORTED_ROPE_TYPES)})"
            )
        if self.use_bidirectional_attention:
            raise Gemma3ConfigError("use_bidirectional_attention=true is not supported")
        if len(self.layer_types) != self.num_hidden_layers:
            raise Gemma3ConfigError(
                f"layer_types has {len(self.layer_types)} entries for "
                f"num_hidden_layers={self.num_hidden_layers}"
            )
        unknown = sorted(set(self.layer_types) - {SLIDING, FULL})
        if unknown:
            raise Gemma3ConfigError(f"layer_types {unknown} unsupported ({SLIDING}, {FULL})")

    def _check_sizes(self) -> None:
        """Positive sizes; q heads a multiple of kv heads; an even head_dim for RoPE."""
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers"):
            if getattr(self, key) < 1:
                raise Gemma3ConfigError(f"{key} must be >= 1, got {getattr(self, key)}")
        if self.sliding_window < 1:
            raise Gemma3ConfigError(f"sliding_window must be >= 1, got {self.sliding_window}")
        if self.num_key_value_heads < 1 or self.num_attention_heads % self.num_key_value_heads:
            raise Gemma3ConfigError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise Gemma3ConfigError(f"head_dim={self.head_dim} must be even for RoPE")

    @property
    def rope_type(self) -> str:
        """The global layers' RoPE type ("default" without ``rope_scaling``)."""
        return dict(self.rope_scaling or ()).get("rope_type", "default")

    @property
    def rope_factor(self) -> float:
        """The global layers' linear scaling factor (1 for the default RoPE)."""
        if self.rope_type == "default":
            return 1.0
        factor = dict(self.rope_scaling).get("factor")
        if factor is None:
            raise Gemma3ConfigError("rope_scaling of rope_type 'linear' needs a 'factor'")
        return float(factor)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Gemma3TextConfig:
        """Build from a config.json dict: a ``Gemma3Config`` (its ``text_config`` is read) or a
        ``Gemma3TextConfig``, transformers 4.x or 5.x keys."""
        if "text_config" in d:
            d = d["text_config"] or {}
        kwargs = {k: v for k, v in d.items() if not k.startswith("_")}
        kwargs = {k: v for k, v in kwargs.items() if k not in IGNORED_CONFIG_KEYS}
        rope = kwargs.pop("rope_parameters", None)
        if rope is not None:  # transformers 5: {layer type: {"rope_theta": ..., ...}}
            kwargs.update(_rope_parameters_to_keys(rope))
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise Gemma3ConfigError(
                f"unknown Gemma3TextConfig keys {unknown}; known: {sorted(known)}"
            )
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        """The fields as a dict in the transformers 4.x keys (lists, a rope_scaling dict)."""
        d = dataclasses.asdict(self)
        d["rope_scaling"] = dict(self.rope_scaling) if self.rope_scaling else None
        return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}


def _rope_parameters_to_keys(rope: Mapping[str, Any]) -> dict[str, Any]:
    """transformers 5 ``rope_parameters`` per layer type -> the 4.x keys. Local layers only
    take the default RoPE (as transformers' Gemma3 config builds them)."""
    full = dict(rope.get(FULL) or {})
    local = dict(rope.get(SLIDING) or {})
    out: dict[str, Any] = {}
    if "rope_theta" in full:
        out["rope_theta"] = full.pop("rope_theta")
    if "rope_theta" in local:
        out["rope_local_base_freq"] = local.pop("rope_theta")
    if local.get("rope_type", "default") != "default":
        raise Gemma3ConfigError(
            f"rope_parameters.{SLIDING}.rope_type={local['rope_type']!r} is not supported"
        )
    out["rope_scaling"] = full if full.get("rope_type", "default") != "default" else None
    return out


# --- layers --------------------------------------------------------------------------------------


def rope_cos_sin(length: int, head_dim: int, theta: float, factor: float = 1.0):
    """cos, sin ``[L, head_dim]`` float32 for positions 0..L-1, as transformers' Gemma3 RoPE:
    ``inv_freq = theta ** (-2i / d) / factor`` (factor 1: the default RoPE, else ``linear``),
    the frequencies repeated twice for rotate-half."""
    inv_freq = decoder_lm.default_inv_freq(head_dim, theta)
    return decoder_lm.rope_cos_sin(length, (inv_freq / np.float32(factor)).astype(np.float32))


def visibility_masks(mask_bl: jax.Array, sliding_window: int) -> dict[str, jax.Array]:
    """``[B, Lq, Lk]`` bool per layer type (:func:`jaxcore.models.decoder_lm.visibility_mask`):
    causal and padding; for local layers also ``k > q - sliding_window``."""
    return {
        FULL: decoder_lm.visibility_mask(mask_bl),
        SLIDING: decoder_lm.visibility_mask(mask_bl, sliding_window),
    }


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: ``x / rms(x) * (1 + weight)`` over the last axis, in float32, one
    rounding to ``dtype``. The parameter is transformers' ``weight`` (zeros-initialised), not a
    scale: the factor applied is ``1 + weight``."""

    eps: float
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        init = nn.with_logical_partitioning(nn.initializers.zeros_init(), ("norm",))
        weight = self.param("weight", init, (x.shape[-1],), self.param_dtype)
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
        return (normed * (1.0 + weight.astype(jnp.float32))).astype(self.dtype)


class Attention(nn.Module):
    """Gemma-3 self-attention: (1 + w) q/k norms, RoPE, GQA, ``query_pre_attn_scalar``
    scaling; the projections and the attention itself are the shared decoder's."""

    config: Gemma3TextConfig
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x_bld, visible_bqk, cos_ld, sin_ld):
        """Attention output ``[B, L, E]`` of the normed ``x_bld``; ``visible_bqk``: this layer
        type's mask from :func:`visibility_masks`; ``cos_ld`` / ``sin_ld``: its RoPE."""
        c = self.config
        kw = {"dtype": self.dtype, "param_dtype": self.param_dtype}

        def project(heads, name):
            return decoder_lm.project_in(
                c.hidden_size, heads, c.head_dim, bias=c.attention_bias, name=name, **kw
            )

        q_blhd = GemmaRMSNorm(c.rms_norm_eps, name="q_norm", **kw)(
            project(c.num_attention_heads, "q_proj")(x_bld)
        )
        k_blgd = GemmaRMSNorm(c.rms_norm_eps, name="k_norm", **kw)(
            project(c.num_key_value_heads, "k_proj")(x_bld)
        )
        v_blgd = project(c.num_key_value_heads, "v_proj")(x_bld)
        q_blhd, k_blgd = apply_rope(q_blhd, cos_ld, sin_ld), apply_rope(k_blgd, cos_ld, sin_ld)
        scale = float(c.query_pre_attn_scalar) ** -0.5  # Gemma's, not head_dim's
        out_blhd = grouped_attention(q_blhd, k_blgd, v_blgd, visible_bqk, scale)
        heads, bias = c.num_attention_heads, c.attention_bias
        out_proj = decoder_lm.project_out(
            heads, c.head_dim, c.hidden_size, bias=bias, name="o_proj", **kw
        )
        return out_proj(out_blhd.astype(self.dtype))


class DecoderLayer(nn.Module):
    """transformers ``Gemma3DecoderLayer``: sandwich norms around attention and the MLP."""

    config: Gemma3TextConfig
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x_bld, visible_bqk, cos_ld, sin_ld):
        """One layer on ``x_bld [B, L, E]`` with its layer type's mask and RoPE."""
        c = self.config
        kw = {"dtype": self.dtype, "param_dtype": self.param_dtype}

        def norm(name):
            return GemmaRMSNorm(c.rms_norm_eps, name=name, **kw)

        h = Attention(c, name="self_attn", **kw)(
            norm("input_layernorm")(x_bld), visible_bqk, cos_ld, sin_ld
        )
        x_bld = x_bld + norm("post_attention_layernorm")(h)
        mlp = GatedMLP(c.hidden_size, c.intermediate_size, gelu_tanh, name="mlp", **kw)
        h = mlp(norm("pre_feedforward_layernorm")(x_bld))
        return x_bld + norm("post_feedforward_layernorm")(h)


class Gemma3TextModel(nn.Module):
    """transformers ``Gemma3TextModel``; ``__call__(ids, mask)`` -> all hidden states
    ``[N + 1, B, L, E]`` numbered as transformers' (0: the scaled embedding, k: the output of
    layer k, the last through the final ``norm``)."""

    config: Gemma3TextConfig
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    def setup(self):
        """Embedding, layers and the final norm, named as transformers' ``model.*``."""
        c = self.config
        kw = {"dtype": self.dtype, "param_dtype": self.param_dtype}
        self.embed_tokens = decoder_lm.token_embedding(c.vocab_size, c.hidden_size, **kw)
        self.layers = [DecoderLayer(c, **kw) for _ in range(c.num_hidden_layers)]
        self.norm = GemmaRMSNorm(c.rms_norm_eps, **kw)

    def _rope_tables(self, length: int) -> dict[str, tuple[jax.Array, jax.Array]]:
        """cos / sin per layer type: local ``rope_local_base_freq``, global ``rope_theta``
        with the scaling factor."""
        c = self.config
        local = rope_cos_sin(length, c.head_dim, c.rope_local_base_freq)
        full = rope_cos_sin(length, c.head_dim, c.rope_theta, c.rope_factor)
        return {SLIDING: tuple(map(jnp.asarray, local)), FULL: tuple(map(jnp.asarray, full))}

    def embed(self, ids_bl: jax.Array) -> jax.Array:
        """Token embeddings times ``sqrt(hidden_size)``, the scale rounded to the embedding's
        dtype first (transformers: ``embed_scale.to(weight.dtype)``)."""
        scale = jnp.asarray(np.float32(self.config.hidden_size**0.5), self.param_dtype)
        return (self.embed_tokens(ids_bl) * scale.astype(self.dtype)).astype(self.dtype)

    def __call__(self, ids_bl: jax.Array, mask_bl: jax.Array) -> jax.Array:
        """Hidden states ``[N + 1, B, L, E]`` of ``ids_bl`` / ``mask_bl [B, L]``."""
        c = self.config
        tables = self._rope_tables(ids_bl.shape[1])
        masks = visibility_masks(mask_bl, c.sliding_window)
        x_bld = self.embed(ids_bl)
        states = [x_bld]
        for layer, kind in zip(self.layers, c.layer_types, strict=True):
            x_bld = layer(x_bld, masks[kind], *tables[kind])
            states.append(x_bld)
        states[-1] = self.norm(x_bld)  # transformers' last hidden state is normed
        return jnp.stack(states)


# --- running it ----------------------------------------------------------------------------------


@functools.lru_cache(maxsize=16)
def _jitted_packed(module: Gemma3TextModel):
    """jit(params, ids, mask) -> the hidden states packed ``[B, L, D * (N + 1)]``."""

    def run(params, ids_bl, mask_bl):
        states_kbld = module.apply({"params": params}, ids_bl, mask_bl)
        return _pack(states_kbld)

    return jax.jit(run)


def _pack(states_kbld: jax.Array) -> jax.Array:
    """The pipeline's ``torch.stack(states, dim=-1).flatten(2, 3)``: ``[K, B, L, D]`` ->
    ``[B, L, D * K]``, channel ``d * K + k``."""
    k, b, length, d = states_kbld.shape
    return jnp.transpose(states_kbld, (1, 2, 3, 0)).reshape(b, length, d * k)


@functools.lru_cache(maxsize=16)
def _jitted_states(module: Gemma3TextModel):
    """jit(params, ids, mask) -> the hidden states stacked ``[N + 1, B, L, D]``."""
    return jax.jit(
        lambda params, ids_bl, mask_bl: module.apply({"params": params}, ids_bl, mask_bl)
    )


def hidden_states(module: Gemma3TextModel, params, ids_bl, mask_bl) -> jax.Array:
    """transformers' ``output_hidden_states`` stacked ``[N + 1, B, L, D]`` (jitted)."""
    ids_bl, mask_bl = jnp.asarray(ids_bl, jnp.int32), jnp.asarray(mask_bl, jnp.int32)
    return _jitted_states(module)(params, ids_bl, mask_bl)


def packed_hidden_states(module: Gemma3TextModel, params, ids_bl, mask_bl) -> jax.Array:
    """All hidden states packed as the pipeline does: ``[B, L, D * (N + 1)]``, channel
    ``d * (N + 1) + k`` = hidden state k's channel d (jitted)."""
    ids_bl, mask_bl = jnp.asarray(ids_bl, jnp.int32), jnp.asarray(mask_bl, jnp.int32)
    return _jitted_packed(module)(params, ids_bl, mask_bl)


def tokenize_prompts(tokenizer, prompts, max_sequence_length: int = LTX2_MAX_SEQUENCE_LENGTH):
    """ids and attention mask int32 ``[B, max_sequence_length]`` as ``_get_gemma_prompt_embeds``
    makes them: the tokenizer's padding side set to ``"left"`` and, without a pad token, its
    EOS made the pad token (both on the tokenizer, as the pipeline does); prompts stripped,
    special tokens added, padded to ``max_sequence_length`` and truncated."""
    from jaxcore.text import call_tokenizer

    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    tokenizer.padding_side = "left"  # Gemma's chat-style prompts are left-padded
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    encoded = call_tokenizer(
        tokenizer,
        [p.strip() for p in prompts],
        padding="max_length",
        max_length=max_sequence_length,
        truncation=True,
        add_special_tokens=True,
        return_tensors="np",
    )
    return (
        np.asarray(encoded["input_ids"], np.int32),
        np.asarray(encoded["attention_mask"], np.int32),
    )


def prompt_embeds(
    tokenizer,
    module: Gemma3TextModel,
    params,
    prompts,
    num_videos_per_prompt: int = 1,
    max_sequence_length: int = LTX2_MAX_SEQUENCE_LENGTH,
) -> tuple[np.ndarray, np.ndarray]:
    """``LTX2Pipeline._get_gemma_prompt_embeds``: (packed hidden states float32
    ``[B * n, L, D * (N + 1)]`` in the module's precision, attention mask int32 ``[B * n, L]``)
    on the host, n = ``num_videos_per_prompt``.

    The repeats are the pipeline's, which differ: the embeddings repeat each prompt n times in
    a row (p0, p0, p1, p1), the mask repeats the whole batch n times (p0, p1, p0, p1). With
    several prompts and n > 1 the rows' masks then belong to other prompts; kept, since the
    point is to equal the pipeline."""
    ids_bl, mask_bl = tokenize_prompts(tokenizer, prompts, max_sequence_length)
    packed = packed_hidden_states(module, params, ids_bl, mask_bl)
    packed = np.asarray(packed.astype(jnp.float32))
    n = int(num_videos_per_prompt)
    return np.repeat(packed, n, axis=0), np.tile(mask_bl, (n, 1))


# --- weights -------------------------------------------------------------------------------------

# Where the text model's tensors live in each saved transformers class, tried in order.
TEXT_PREFIXES = ("language_model.model.", "model.language_model.", "model.", "")
# Gemma3ForConditionalGeneration's other parts; never part of the encoder.
UNUSED_PREFIXES = (
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
    "lm_head.",
    "language_model.lm_head.",
)


LAYER_NORMS = (
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
)


def weight_map(config: Gemma3TextConfig, prefix: str = "language_model.model.") -> dict:
    """Flax param path -> (transformers key under ``prefix``, transform); the default prefix
    is where ``Gemma3ForConditionalGeneration.save_pretrained`` writes the text model."""
    ident = weights.identity
    mapping = {
        ("embed_tokens", "embedding"): (f"{prefix}embed_tokens.weight", ident),
        ("norm", "weight"): (f"{prefix}norm.weight", ident),
    }
    for i in range(config.num_hidden_layers):
        src, dst = f"{prefix}layers.{i}", f"layers_{i}"
        mapping |= decoder_lm.attention_weight_map(
            f"{src}.self_attn",
            (dst, "self_attn"),
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            bias=config.attention_bias,
            qk_norm_param="weight",  # GemmaRMSNorm's parameter
        )
        mapping |= decoder_lm.mlp_weight_map(f"{src}.mlp", (dst, "mlp"))
        for name in LAYER_NORMS:
            mapping[(dst, name, "weight")] = (f"{src}.{name}.weight", ident)
    return mapping


def count_params(config: Gemma3TextConfig) -> int:
    """Parameters of the text model (``Gemma3TextModel``; the LM head is tied to the
    embedding in every Gemma-3)."""
    return decoder_lm.count_params(Gemma3TextModel(config))


def init_gemma3(config: Gemma3TextConfig, rng, *, dtype=jnp.float32, param_dtype=None):
    """Random-init ``(module, params)`` (unboxed, on the default device)."""
    module = Gemma3TextModel(config, dtype=dtype, param_dtype=param_dtype or dtype)
    return module, decoder_lm.init_params(module, rng)


def load_gemma3(
    directory: str | os.PathLike,
    *,
    dtype=jnp.float32,
    param_dtype=None,
    mesh: jax.sharding.Mesh | None = None,
    rules=None,
) -> tuple[Gemma3TextModel, dict]:
    """A saved Gemma-3 (``Gemma3ForConditionalGeneration``, ``Gemma3ForCausalLM`` or
    ``Gemma3TextModel``) directory -> ``(module, text model params)``; the vision tower, the
    projector and the LM head are not read."""
    config = Gemma3TextConfig.from_dict(weights.read_config(directory))
    module = Gemma3TextModel(config, dtype=dtype, param_dtype=param_dtype or dtype)
    reader = weights.SafetensorsReader(directory)
    prefix = decoder_lm.find_prefix(reader, TEXT_PREFIXES, "Gemma-3 text model")
    mapping = weight_map(config, prefix)
    params = decoder_lm.load_params(
        module, reader, mapping, mesh=mesh, rules=rules, ignore_unused=UNUSED_PREFIXES
    )
    return module, params
