"""CLIP text encoder (Flux's CLIP-L, SD 2.x / SDXL OpenCLIP encoders) in Flax linen.

Reference: transformers ``CLIPTextModel`` and ``CLIPTextModelWithProjection``
(``transformers/models/clip/modeling_clip.py``). What this file reproduces:

- token + learned absolute position embeddings (positions 0..L-1, L <= max_position_embeddings);
- pre-LayerNorm blocks: x + attn(ln1(x)), x + mlp(ln2(x)); attention with biases, scores scaled
  by 1/sqrt(head_dim), a causal mask combined with the optional padding mask (key j is visible
  to query i iff j <= i and attention_mask[j]); MLP fc1 -> ``hidden_act`` -> fc2;
- a query that sees no key (only under left padding) gets a zero attention output, as torch's
  SDPA (transformers' default attention) gives; these are padding positions and no other
  position attends to them;
- a final LayerNorm; ``hidden_states`` are the embeddings and each block's output *before* the
  final norm (transformers' ``output_hidden_states=True``; SD 2.x / SDXL take ``[-2]``);
- the pooled output is the final-normed state at the EOS position: with the legacy
  ``eos_token_id == 2`` the position of the largest token id (the original CLIP end token is
  the largest id), otherwise the first position equal to ``eos_token_id`` (0 if none);
- ``text_embeds``: the bias-free ``text_projection`` of the pooled output (with projection).

Parameters use the logical axis names of :mod:`jaxcore.sharding`; :func:`weight_map` maps them
from the transformers state-dict keys (``text_model.*``, or the same keys without the prefix
as transformers 5 saves a ``CLIPTextModel``, and ``text_projection.weight``).

The encoder layer (:class:`CLIPBlock`, with :class:`CLIPAttention` and :class:`CLIPMLP`), its
weight map (:func:`encoder_layer_map`), the projection, the config helpers and the loading
(:class:`TowerKind`) are shared with the vision tower, :mod:`jaxcore.models.clip_vision`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from collections.abc import Callable, Mapping
from typing import Protocol

import flax.struct
import jax
import jax.numpy as jnp
from flax import linen as nn

from jaxcore import sharding, weights
from jaxcore.models.layers import HeadsEinsum, gelu_erf, gelu_tanh, silu

log = logging.getLogger(__name__)

# --- config ------------------------------------------------------------------------------------

# config.json keys that describe training, generation or bookkeeping (older transformers
# versions dump every generic PretrainedConfig attribute); the forward pass does not depend on
# them. Anything else not a CLIPTextConfig field is an error.
_IGNORED_WORDS = (
    # bookkeeping and training
    "architectures torch_dtype dtype transformers_version attention_dropout dropout "
    "initializer_range initializer_factor gradient_checkpointing tokenizer_class "
    "use_bfloat16 torchscript return_dict output_attentions output_hidden_states "
    "pruned_heads tie_word_embeddings tie_encoder_decoder is_encoder_decoder is_decoder "
    "add_cross_attention cross_attention_hidden_size chunk_size_feed_forward id2label "
    "label2id finetuning_task problem_type task_specific_params prefix tf_legacy_loss "
    # generation defaults
    "sep_token_id decoder_start_token_id forced_bos_token_id forced_eos_token_id "
    "max_length min_length do_sample early_stopping num_beams num_beam_groups "
    "diversity_penalty temperature top_k top_p typical_p repetition_penalty "
    "length_penalty no_repeat_ngram_size encoder_no_repeat_ngram_size bad_words_ids "
    "num_return_sequences output_scores return_dict_in_generate remove_invalid_values "
    "exponential_decay_length_penalty suppress_tokens begin_suppress_tokens"
)
IGNORED_CONFIG_KEYS = frozenset(_IGNORED_WORDS.split())
MODEL_TYPE = "clip_text_model"
# ``eos_token_id`` of configs written before transformers PR #24773; such models pool at the
# largest token id instead of at the first eos_token_id.
LEGACY_EOS_TOKEN_ID = 2

# hidden_act (transformers ACT2FN name) -> jax function.
ACTIVATIONS = {
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
    "gelu": gelu_erf,
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": gelu_tanh,
    "relu": jax.nn.relu,
    "silu": silu,
    "swish": silu,
}


class EncoderConfig(Protocol):
    """What the shared encoder layers read: ``CLIPTextConfig`` and
    :class:`jaxcore.models.clip_vision.CLIPVisionConfig` both provide it."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    hidden_act: str
    layer_norm_eps: float

    @property
    def head_dim(self) -> int: ...


ENCODER_POSITIVE_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)


def check_encoder_config(config, error: type[ValueError], extra_positive=()) -> None:
    """Validate the encoder fields shared by the CLIP towers; ``error`` names the field."""
    name = type(config).__name__
    for field in (*ENCODER_POSITIVE_FIELDS, *extra_positive):
        value = getattr(config, field)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise error(f"{name}.{field} must be a positive int, got {value!r}")
    if config.hidden_size % config.num_attention_heads:
        raise error(
            f"{name}.hidden_size {config.hidden_size} is not a multiple of "
            f"num_attention_heads {config.num_attention_heads}"
        )
    if config.hidden_act not in ACTIVATIONS:
        raise error(
            f"{name}.hidden_act {config.hidden_act!r} is not supported; choose one of "
            f"{sorted(ACTIVATIONS)}"
        )


def check_projection_dim(config, error: type[ValueError]) -> None:
    """A CLIP tower's ``projection_dim``: a positive int, or None (no projection possible)."""
    value = config.projection_dim
    if value is not None and (not isinstance(value, int) or value < 1):
        raise error(
            f"{type(config).__name__}.projection_dim must be a positive int or None, got {value!r}"
        )


def config_kwargs(
    cls,
    raw: Mapping[str, object],
    *,
    model_type: str,
    sub_config: str,
    ignored: frozenset[str],
    error: type[ValueError],
) -> dict[str, object]:
    """The fields of the dataclass ``cls`` found in a transformers ``config.json`` dict.

    ``model_type`` must match when present (a full ``CLIPModel`` config, model_type ``clip``,
    is an error that points to its ``sub_config``). Keys starting with ``_`` and those in
    ``ignored`` are skipped; any other unknown key is an ``error`` naming it.
    """
    found = raw.get("model_type", model_type)
    if found != model_type:
        hint = f" (a full CLIPModel config: use its {sub_config!r})" if found == "clip" else ""
        raise error(f"config key 'model_type' is {found!r}, expected {model_type!r}{hint}")
    fields = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in raw.items():
        if key in fields:
            kwargs[key] = value
        elif key == "model_type" or key.startswith("_") or key in ignored:
            continue
        else:
            raise error(
                f"unknown {cls.__name__} key {key!r}; known: {sorted(fields)} "
                f"(ignored: model_type and {len(ignored)} bookkeeping keys)"
            )
    return kwargs


class CLIPTextConfigError(ValueError):
    """A config.json that CLIPTextConfig cannot represent; the message names the key."""


@dataclasses.dataclass(frozen=True)
class CLIPTextConfig:
    """CLIP text-tower architecture; field names follow transformers' ``config.json``.

    Defaults are transformers' ``CLIPTextConfig`` defaults (clip-vit-base-patch32). Flux's
    CLIP-L: hidden 768, intermediate 3072, 12 layers, 12 heads, quick_gelu, eos_token_id 2.
    ``projection_dim`` matters only with a projection (see ``CLIPTextEncoder.with_projection``).
    ``bos_token_id`` and ``pad_token_id`` are the tokenizer's; only ``eos_token_id`` enters
    the forward pass (it picks the pooled position).
    """

    vocab_size: int = 49408
    hidden_size: int = 512
    intermediate_size: int = 2048
    projection_dim: int | None = 512
    num_hidden_layers: int = 12
    num_attention_heads: int = 8
    max_position_embeddings: int = 77
    hidden_act: str = "quick_gelu"
    layer_norm_eps: float = 1e-5
    pad_token_id: int | None = 1
    bos_token_id: int | None = 49406
    eos_token_id: int = 49407

    def __post_init__(self):
        check_encoder_config(
            self, CLIPTextConfigError, extra_positive=("vocab_size", "max_position_embeddings")
        )
        check_projection_dim(self, CLIPTextConfigError)
        if not isinstance(self.eos_token_id, int) or isinstance(self.eos_token_id, bool):
            raise CLIPTextConfigError(
                f"CLIPTextConfig.eos_token_id must be one int (it picks the pooled position), "
                f"got {self.eos_token_id!r}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def legacy_pooling(self) -> bool:
        """True: pool at argmax(input_ids) (configs with the pre-#24773 eos_token_id 2)."""
        return self.eos_token_id == LEGACY_EOS_TOKEN_ID

    @classmethod
    def from_dict(cls, raw: Mapping[str, object]) -> CLIPTextConfig:
        """Build from a transformers ``config.json`` dict (a ``CLIPTextModel[WithProjection]``).

        ``model_type`` must be ``clip_text_model`` when present (a full ``CLIPModel`` config is
        an error: pass its ``text_config``). Keys starting with ``_`` and those in
        ``IGNORED_CONFIG_KEYS`` are skipped; any other unknown key is an error naming it.
        """
        kwargs = config_kwargs(
            cls,
            raw,
            model_type=MODEL_TYPE,
            sub_config="text_config",
            ignored=IGNORED_CONFIG_KEYS,
            error=CLIPTextConfigError,
        )
        if raw.get("is_decoder"):
            raise CLIPTextConfigError("config key 'is_decoder' is true; CLIP text is an encoder")
        return cls(**kwargs)

    def to_dict(self) -> dict[str, object]:
        """The transformers ``config.json`` fields of this config (with its model_type)."""
        return {"model_type": MODEL_TYPE, **dataclasses.asdict(self)}


# architectures entry -> whether that class has a text_projection.
ARCHITECTURES = {"CLIPTextModel": False, "CLIPTextModelWithProjection": True}


# --- output ------------------------------------------------------------------------------------


@flax.struct.dataclass
class CLIPTextOutput:
    """``last_hidden_state`` [B, L, E] (final-normed); ``pooler_output`` [B, E] (at EOS);
    ``hidden_states``: tuple of num_hidden_layers + 1 arrays [B, L, E] (embeddings, then each
    block, before the final norm); ``text_embeds`` [B, projection_dim] or None."""

    last_hidden_state: jax.Array
    pooler_output: jax.Array
    hidden_states: tuple[jax.Array, ...]
    text_embeds: jax.Array | None = None


# --- layers --------------------------------------------------------------------------------------


def _normal(stddev: float):
    return nn.initializers.normal(stddev=stddev)


def layer_norm(eps: float, dtype, param_dtype, name: str) -> nn.LayerNorm:
    """torch LayerNorm: statistics in float32, two-pass variance (not E[x^2] - E[x]^2)."""
    return nn.LayerNorm(
        epsilon=eps,
        dtype=dtype,
        param_dtype=param_dtype,
        use_fast_variance=False,
        scale_init=nn.with_logical_partitioning(nn.initializers.ones_init(), ("norm",)),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros_init(), ("norm",)),
        name=name,
    )


def _dense(features: int, stddev: float, axes: tuple[str, str], dtype, param_dtype, name: str):
    return nn.Dense(
        features,
        dtype=dtype,
        param_dtype=param_dtype,
        kernel_init=nn.with_logical_partitioning(_normal(stddev), axes),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros_init(), (axes[1],)),
        name=name,
    )


def projection_layer(config, dtype, param_dtype, name: str) -> nn.Dense:
    """The bias-free projection of a tower's pooled output to ``projection_dim``
    (``text_projection`` / ``visual_projection``)."""
    return nn.Dense(
        config.projection_dim,
        use_bias=False,
        dtype=dtype,
        param_dtype=param_dtype,
        kernel_init=nn.with_logical_partitioning(
            _normal(config.hidden_size**-0.5), ("embed", None)
        ),
        name=name,
    )


def visibility_mask(attention_mask: jax.Array | None, batch: int, length: int) -> jax.Array:
    """[B, Lq, Lk] bool: key j visible to query i iff j <= i and attention_mask[b, j].

    transformers' ``create_causal_mask`` (causal AND padding on the keys).
    """
    causal_qk = jnp.tril(jnp.ones((length, length), bool))
    if attention_mask is None:
        return jnp.broadcast_to(causal_qk, (batch, length, length))
    return causal_qk[None] & (attention_mask > 0)[:, None, :]


class CLIPAttention(nn.Module):
    """Multi-head self-attention with biases; softmax(q k^T / sqrt(d)) in float32.

    ``visible_bqk``: [B, Lq, Lk] bool (see :func:`visibility_mask`), or None for full
    bidirectional attention (the vision tower).
    """

    config: EncoderConfig
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    def _projection(self, name: str) -> HeadsEinsum:
        c = self.config
        return HeadsEinsum(
            (c.hidden_size, c.num_attention_heads, c.head_dim),
            ("embed", "heads", "kv"),
            "ble,ehd->blhd",
            _normal(c.hidden_size**-0.5),
            ("heads", "kv"),
            self.dtype,
            self.param_dtype,
            name=name,
        )

    @nn.compact
    def __call__(self, x_ble: jax.Array, visible_bqk: jax.Array | None) -> jax.Array:
        c = self.config
        heads = ("activation_batch", "activation_length", "activation_heads", "activation_kv")
        q_blhd, k_blhd, v_blhd = (
            sharding.constrain(self._projection(name)(x_ble), heads) for name in ("q", "k", "v")
        )
        scores_bhqk = jnp.einsum(
            "bqhd,bkhd->bhqk", q_blhd, k_blhd, preferred_element_type=jnp.float32
        ) * jnp.float32(c.head_dim**-0.5)
        if visible_bqk is None:
            probs_bhqk = jax.nn.softmax(scores_bhqk, axis=-1)
        else:
            scores_bhqk = jnp.where(visible_bqk[:, None], scores_bhqk, jnp.finfo(jnp.float32).min)
            probs_bhqk = jax.nn.softmax(scores_bhqk, axis=-1)
            # A query with no visible key: zero output (torch SDPA), not a uniform average.
            any_visible_bq = visible_bqk.any(axis=-1)
            probs_bhqk = jnp.where(any_visible_bq[:, None, :, None], probs_bhqk, 0.0)
        out_blhd = jnp.einsum(
            "bhqk,bkhd->bqhd",
            probs_bhqk.astype(self.dtype),
            v_blhd,
            preferred_element_type=jnp.float32,
        ).astype(self.dtype)
        return HeadsEinsum(
            (c.num_attention_heads, c.head_dim, c.hidden_size),
            ("heads", "kv", "embed"),
            "blhd,hde->ble",
            _normal(c.hidden_size**-0.5),
            ("embed",),
            self.dtype,
            self.param_dtype,
            name="o",
        )(out_blhd)


class CLIPMLP(nn.Module):
    """fc2(act(fc1 x)), both with biases."""

    config: EncoderConfig
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x_ble: jax.Array) -> jax.Array:
        c = self.config
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        hidden_blf = _dense(
            c.intermediate_size, c.hidden_size**-0.5, ("embed", "mlp"), **kw, name="fc1"
        )(x_ble)
        hidden_blf = ACTIVATIONS[c.hidden_act](hidden_blf)
        hidden_blf = sharding.constrain(
            hidden_blf, ("activation_batch", "activation_length", "activation_mlp")
        )
        return _dense(c.hidden_size, c.intermediate_size**-0.5, ("mlp", "embed"), **kw, name="fc2")(
            hidden_blf
        )


class CLIPBlock(nn.Module):
    """Pre-LayerNorm residual block: x + attn(ln(x)), then x + mlp(ln(x)).

    transformers' ``CLIPEncoderLayer``, shared by the text and vision towers;
    ``visible_bqk`` as in :class:`CLIPAttention` (None: no mask).
    """

    config: EncoderConfig
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x_ble: jax.Array, visible_bqk: jax.Array | None) -> jax.Array:
        c = self.config
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        normed = layer_norm(c.layer_norm_eps, **kw, name="attention_norm")(x_ble)
        x_ble = x_ble + CLIPAttention(c, **kw, name="attention")(normed, visible_bqk)
        normed = layer_norm(c.layer_norm_eps, **kw, name="mlp_norm")(x_ble)
        x_ble = x_ble + CLIPMLP(c, **kw, name="mlp")(normed)
        return sharding.constrain(
            x_ble, ("activation_batch", "activation_length", "activation_embed")
        )


def pooled_positions(input_ids: jax.Array, eos_token_id: int) -> jax.Array:
    """[B] index of the pooled (EOS) token, as transformers picks it.

    Legacy ``eos_token_id == 2``: the first position of the largest id. Otherwise: the first
    position equal to ``eos_token_id`` (0 when the sequence has none).
    """
    if eos_token_id == LEGACY_EOS_TOKEN_ID:
        return jnp.argmax(input_ids, axis=-1)
    return jnp.argmax((input_ids == eos_token_id).astype(jnp.int32), axis=-1)


class CLIPTextEncoder(nn.Module):
    """CLIP text tower; ``__call__(input_ids, attention_mask) -> CLIPTextOutput``.

    ``with_projection``: ``CLIPTextModelWithProjection`` (adds ``text_projection`` and
    ``text_embeds``) instead of ``CLIPTextModel``. ``attention``: only ``"dot_product"``; the
    backends of :mod:`jaxcore.attention` take a key mask, not the causal [Lq, Lk] one.
    """

    config: CLIPTextConfig
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32
    with_projection: bool = False
    attention: str = "dot_product"
    mesh: jax.sharding.Mesh | None = None

    @nn.compact
    def __call__(
        self, input_ids: jax.Array, attention_mask: jax.Array | None = None
    ) -> CLIPTextOutput:
        """input_ids [B, L] int, attention_mask [B, L] (1/True = real token) or None."""
        c = self.config
        if self.attention != "dot_product":
            raise ValueError(
                f"CLIPTextEncoder.attention={self.attention!r} is not supported: CLIP needs a "
                "causal mask, only 'dot_product' implements it here"
            )
        if self.with_projection and c.projection_dim is None:
            raise CLIPTextConfigError("with_projection needs CLIPTextConfig.projection_dim")
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be [batch, length], got shape {input_ids.shape}")
        batch, length = input_ids.shape
        if length > c.max_position_embeddings:
            raise ValueError(
                f"sequence length {length} exceeds max_position_embeddings "
                f"{c.max_position_embeddings}"
            )
        if attention_mask is not None and attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"attention_mask shape {attention_mask.shape} != input_ids shape {input_ids.shape}"
            )

        token_table = self.param(
            "token_embedding",
            nn.with_logical_partitioning(_normal(0.02), ("vocab", "embed")),
            (c.vocab_size, c.hidden_size),
            self.param_dtype,
        )
        position_table = self.param(
            "position_embedding",
            nn.with_logical_partitioning(_normal(0.01), (None, "embed")),
            (c.max_position_embeddings, c.hidden_size),
            self.param_dtype,
        )
        x_ble = jnp.take(token_table, input_ids, axis=0) + position_table[None, :length]
        x_ble = sharding.constrain(
            x_ble.astype(self.dtype), ("activation_batch", "activation_length", "activation_embed")
        )
        visible_bqk = visibility_mask(attention_mask, batch, length)

        hidden_states = [x_ble]
        for i in range(c.num_hidden_layers):
            x_ble = CLIPBlock(c, self.dtype, self.param_dtype, name=f"block_{i}")(
                x_ble, visible_bqk
            )
            hidden_states.append(x_ble)
        last_ble = layer_norm(c.layer_norm_eps, self.dtype, self.param_dtype, "final_norm")(x_ble)

        pooled_be = last_ble[jnp.arange(batch), pooled_positions(input_ids, c.eos_token_id)]
        text_embeds = None
        if self.with_projection:
            projection = projection_layer(c, self.dtype, self.param_dtype, "text_projection")
            text_embeds = projection(pooled_be)
        return CLIPTextOutput(
            last_hidden_state=last_ble,
            pooler_output=pooled_be,
            hidden_states=tuple(hidden_states),
            text_embeds=text_embeds,
        )


# --- weights ---------------------------------------------------------------------------------

# transformers' key prefixes: hub checkpoints (and transformers 4, and
# CLIPTextModelWithProjection) store the text model under "text_model."; transformers 5 saves a
# bare CLIPTextModel without it (and strips it on load).
PREFIXES = ("text_model.", "")
PROJECTION_KEY = "text_projection.weight"
# Checkpoints written before transformers 4.31 also hold the position_ids buffer.
POSITION_IDS_KEY = "embeddings.position_ids"


def _heads_in(num_heads: int, head_dim: int):
    """torch Linear weight [H*D, E] -> kernel [E, H, D]; bias [H*D] -> [H, D]."""
    kernel = weights.Invertible(
        lambda w: w.T.reshape(w.shape[1], num_heads, head_dim),
        lambda k: k.reshape(k.shape[0], -1).T,
    )
    bias = weights.Invertible(lambda b: b.reshape(num_heads, head_dim), lambda b: b.reshape(-1))
    return kernel, bias


def _heads_out(num_heads: int, head_dim: int):
    """torch Linear weight [E, H*D] -> kernel [H, D, E]."""
    return weights.Invertible(
        lambda w: w.T.reshape(num_heads, head_dim, w.shape[0]),
        lambda k: k.reshape(-1, k.shape[-1]).T,
    )


def norm_map(dst: tuple[str, ...], src: str) -> dict:
    return {
        (*dst, "scale"): (f"{src}.weight", weights.identity),
        (*dst, "bias"): (f"{src}.bias", weights.identity),
    }


def encoder_layer_map(config: EncoderConfig, src: str, dst: str) -> dict:
    """Weight map of one :class:`CLIPBlock` named ``dst`` from the transformers
    ``CLIPEncoderLayer`` keys under ``src`` (e.g. ``"text_model.encoder.layers.3"``)."""
    heads_kernel, heads_bias = _heads_in(config.num_attention_heads, config.head_dim)
    out_kernel = _heads_out(config.num_attention_heads, config.head_dim)
    mapping = {}
    for name in ("q", "k", "v"):
        proj = f"{src}.self_attn.{name}_proj"
        mapping[(dst, "attention", name, "kernel")] = (f"{proj}.weight", heads_kernel)
        mapping[(dst, "attention", name, "bias")] = (f"{proj}.bias", heads_bias)
    mapping[(dst, "attention", "o", "kernel")] = (f"{src}.self_attn.out_proj.weight", out_kernel)
    mapping[(dst, "attention", "o", "bias")] = (
        f"{src}.self_attn.out_proj.bias",
        weights.identity,
    )
    mapping.update(norm_map((dst, "attention_norm"), f"{src}.layer_norm1"))
    mapping.update(norm_map((dst, "mlp_norm"), f"{src}.layer_norm2"))
    for name in ("fc1", "fc2"):
        mapping[(dst, "mlp", name, "kernel")] = (f"{src}.mlp.{name}.weight", weights.linear)
        mapping[(dst, "mlp", name, "bias")] = (f"{src}.mlp.{name}.bias", weights.identity)
    return mapping


def weight_map(
    config: CLIPTextConfig, with_projection: bool = False, prefix: str = "text_model."
) -> dict:
    """Flax param path -> (transformers key, transform) for ``weights.load_params``.

    ``prefix``: ``"text_model."`` (hub layout) or ``""`` (a CLIPTextModel saved by
    transformers 5); ``text_projection.weight`` never has one.
    """
    if prefix not in PREFIXES:
        raise ValueError(f"prefix must be one of {PREFIXES}, got {prefix!r}")
    mapping = {
        ("token_embedding",): (f"{prefix}embeddings.token_embedding.weight", weights.identity),
        ("position_embedding",): (
            f"{prefix}embeddings.position_embedding.weight",
            weights.identity,
        ),
        **norm_map(("final_norm",), f"{prefix}final_layer_norm"),
    }
    for i in range(config.num_hidden_layers):
        mapping.update(encoder_layer_map(config, f"{prefix}encoder.layers.{i}", f"block_{i}"))
    if with_projection:
        mapping[("text_projection", "kernel")] = (PROJECTION_KEY, weights.linear)
    return mapping


def _dummy_inputs(config: CLIPTextConfig) -> tuple:
    ids = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    return ids, ids  # input ids, attention mask


def resolve_projection(
    raw: Mapping[str, object],
    reader: weights.SafetensorsReader,
    with_projection: bool | None,
    projection_key: str,
    architectures: Mapping[str, bool],
) -> bool:
    """Whether to load the projection ``projection_key``: the checkpoint's keys decide unless
    the caller does; ``architectures`` (class name -> has the projection) in config.json only
    warns when it disagrees with the weights."""
    has_key = projection_key in reader
    if with_projection is None:
        with_projection = has_key
    elif with_projection and not has_key:
        plain, projected = sorted(architectures, key=architectures.get)[:2]
        raise weights.WeightsError(
            f"{reader.directory}: with_projection=True but the checkpoint has no "
            f"{projection_key!r} (a {plain}, not {projected})"
        )
    declared = {architectures[a] for a in raw.get("architectures") or () if a in architectures}
    if len(declared) == 1 and declared != {has_key}:
        log.warning(
            "%s: config.json architectures %s disagree with the weights (%s %s)",
            reader.directory,
            raw.get("architectures"),
            projection_key,
            "present" if has_key else "absent",
        )
    return with_projection


def checkpoint_prefix(
    reader: weights.SafetensorsReader, prefixes: tuple[str, ...], probe: str, what: str
) -> str:
    """The first of ``prefixes`` under which ``probe`` is in the checkpoint."""
    for prefix in prefixes:
        if f"{prefix}{probe}" in reader:
            return prefix
    raise weights.WeightsError(
        f"{reader.directory}: not a {what} checkpoint; expected one of "
        f"{[p + probe for p in prefixes]}"
    )


@dataclasses.dataclass(frozen=True)
class TowerKind:
    """How a CLIP tower is built, loaded, initialised, shaped and counted: the text tower
    (:data:`TOWER`) and the vision tower (``clip_vision.TOWER``) differ only in this data.

    ``module``: the flax Module class, called ``module(config, dtype=, param_dtype=,
    with_projection=, mesh=)``; ``config``: its config dataclass (``from_dict`` of a
    transformers ``config.json``); ``dummy_inputs``: config -> the ShapeDtypeStructs ``init``
    traces with; ``weight_map``: ``(config, with_projection, prefix)`` -> its weight map;
    ``prefixes``: the key prefixes a checkpoint may hold the tower under; ``probe``: a key
    (after the prefix) every checkpoint of the tower holds; ``projection_key`` and
    ``architectures``: see :func:`resolve_projection`; ``name``: the tower, in errors."""

    module: type
    config: type
    dummy_inputs: Callable
    weight_map: Callable
    prefixes: tuple[str, ...]
    probe: str
    projection_key: str
    architectures: Mapping[str, bool]
    name: str

    def build(
        self, config, with_projection=False, *, dtype=jnp.float32, param_dtype=None, mesh=None
    ):
        """The module; ``param_dtype`` None: ``dtype``."""
        return self.module(
            config,
            dtype=dtype,
            param_dtype=param_dtype or dtype,
            with_projection=with_projection,
            mesh=mesh,
        )

    def abstract_variables(self, module):
        return weights.shapes_of_init(module.init, *self.dummy_inputs(module.config))

    def count_params(self, config, with_projection: bool = False) -> int:
        """Number of parameters, from shapes only (nothing is allocated)."""
        module = self.build(config, with_projection)
        return weights.count_elements(self.abstract_variables(module)["params"])

    def init(self, config, rng: jax.Array, with_projection: bool = False, **options):
        """Random-init encoder -> (module, params); params is the unboxed ``params`` collection,
        on the default device (``mesh`` is only kept on the module). ``options``: ``dtype``,
        ``param_dtype``, ``mesh`` (see :meth:`build`)."""
        module = self.build(config, with_projection, **options)
        return module, weights.init_placed(module, self.dummy_inputs(config), rng)

    def load(
        self,
        directory: str | os.PathLike,
        *,
        dtype=jnp.float32,
        param_dtype=None,
        mesh: jax.sharding.Mesh | None = None,
        rules=None,
        with_projection: bool | None = None,
    ):
        """Load a transformers directory of the tower (config.json + safetensors), its keys
        under any of ``prefixes`` (the hub layout, or a bare model as transformers 5 saves it).

        Returns ``(module, params)``; call ``module.apply({"params": params}, ...)``.
        ``with_projection``: None = as the checkpoint has it (``projection_key`` present);
        False loads only the tower of a checkpoint with projection; True requires it.
        ``dtype`` is the activation dtype and, unless ``param_dtype`` is given, the weight
        dtype. With a ``mesh`` every parameter is placed on its logical sharding (``rules``:
        logical axis rules, default :data:`jaxcore.sharding.LOGICAL_AXIS_RULES`).
        """
        raw = weights.read_config(directory)
        config = self.config.from_dict(raw)
        reader = weights.SafetensorsReader(directory)
        with_projection = resolve_projection(
            raw, reader, with_projection, self.projection_key, self.architectures
        )
        module = self.build(
            config, with_projection, dtype=dtype, param_dtype=param_dtype, mesh=mesh
        )
        prefix = checkpoint_prefix(reader, self.prefixes, self.probe, self.name)
        unused = (f"{prefix}{POSITION_IDS_KEY}",)
        if not with_projection:
            unused += (self.projection_key,)
        params = weights.load_placed(
            reader,
            self.weight_map(config, with_projection, prefix),
            self.abstract_variables(module)["params"],
            mesh=mesh,
            rules=rules,
            dtype=module.param_dtype,
            ignore_unused=unused,
        )
        return module, params


# build / load / init / shape / count (the vision tower: clip_vision.TOWER)
TOWER = TowerKind(
    CLIPTextEncoder,
    CLIPTextConfig,
    _dummy_inputs,
    weight_map,
    PREFIXES,
    "final_layer_norm.weight",
    PROJECTION_KEY,
    ARCHITECTURES,
    "CLIP text",
)
abstract_variables = TOWER.abstract_variables
count_params = TOWER.count_params
init_clip_text = TOWER.init
load_clip_text = TOWER.load  # a transformers CLIPTextModel[WithProjection] directory


@functools.lru_cache(maxsize=8)
def _jitted_encoder(module: CLIPTextEncoder, hidden_layer: int | None):
    """jit(params, ids) -> (hidden states, pooler_output, text_embeds or None): the final-normed
    last hidden state (``hidden_layer`` None) or ``hidden_states[hidden_layer]`` (before the
    final norm)."""

    def run(params, ids):
        out = module.apply({"params": params}, ids)
        hidden = out.last_hidden_state if hidden_layer is None else out.hidden_states[hidden_layer]
        return hidden, out.pooler_output, out.text_embeds

    return jax.jit(run)


def encode_prompts(
    tokenizer, module: CLIPTextEncoder, params, prompts, max_length: int, hidden_layer=None
):
    """(hidden states ``[B, max_length, D]``, pooler output ``[B, D]``, text_embeds ``[B, P]`` or
    None), float32 on the host, from ids padded to ``max_length``: what the pipelines take
    from a CLIP text encoder (Flux the pooled output; SD the hidden states of ``hidden_layer``,
    SDXL also the projected embeds). Every CLIP family encodes here."""
    import numpy as np

    from jaxcore.text import padded_token_ids

    ids = padded_token_ids(tokenizer, prompts, max_length)
    hidden, pooled, embeds = _jitted_encoder(module, hidden_layer)(params, ids)
    as_host = (None if x is None else np.asarray(x, np.float32) for x in (hidden, pooled, embeds))
    return tuple(as_host)
