"""LTX-2's text connectors in Flax linen: the packed Gemma-3 hidden states -> the transformer's
video and audio text conditioning.

Reference: diffusers ``LTX2TextConnectors`` (``diffusers/pipelines/ltx2/connectors.py``,
diffusers 0.42) and the call ``LTX2Pipeline.__call__`` makes of it
(``connectors(prompt_embeds, prompt_attention_mask, padding_side=...)``). Same parameters (loaded
from a diffusers ``connectors/`` folder through :func:`weight_map`), written as JAX code:

1. Features. The input ``[B, L, C * K]`` (C = ``caption_channels``, K = ``text_proj_in_factor``
   hidden states, packed channel ``c * K + k`` as the pipeline packs them) is viewed as
   ``[B, L, C, K]``.

   - LTX-2.0 (``per_modality_projections`` off): each sample's and hidden state's values over
     the real tokens and all C channels are centred by their mean and divided by their range
     (max - min, + 1e-6), times ``scale_factor`` (8); padding is zeroed. Which tokens are real
     follows from the mask's *count* and ``padding_side`` (diffusers'
     ``per_layer_masked_mean_norm``), not from the mask's positions. One Linear
     (``text_proj_in``, C * K -> C) feeds both connectors.
   - LTX-2.3 (``per_modality_projections`` on): an RMS norm over C per token and hidden state,
     padding zeroed, then ``video_text_proj_in`` / ``audio_text_proj_in`` of the features scaled
     by ``sqrt(video_hidden_dim / C)`` / ``sqrt(audio_hidden_dim / C)``.

2. Connectors (video and audio, each a ``LTX2ConnectorTransformer1d``). With learnable
   registers (every released LTX-2: 128) the real tokens move to the front in order and every
   later position ``p`` takes register ``p mod R`` (``L`` must be a multiple of R), after which
   nothing is masked. Then blocks of: RMSNorm (no weight, eps 1e-6) -> self-attention (biased
   q/k/v/out, RMSNorm with weight on q and k across all heads, RoPE, optionally a per-head gate
   ``2 sigmoid(to_gate_logits(x))`` on the output) -> residual; RMSNorm -> GELU-tanh MLP (4x)
   -> residual; a final RMSNorm (no weight). RoPE is 1-D over the position ``p / base_seq_len``
   with ``inner_dim / 2`` frequencies ``theta ** linspace(0, 1) * pi / 2`` (float64 when
   ``rope_double_precision``), angle ``freq * (2 g - 1)``, on ``interleaved`` pairs of the whole
   width or ``split`` halves of each head (every released LTX-2 uses ``split``).

   Without registers the padded keys are masked: diffusers adds ``(mask - 1) * finfo.max``;
   here the keys are masked out of the softmax, the same weights for 0/1 masks (a query whose
   keys are all padded attends uniformly in both).

3. Outputs: the video embedding times diffusers' output mask, the audio embedding, and that mask.
   diffusers' mask is ``connector_mask < 1e-6`` of the connector's *additive* mask (zeros with
   registers, ``0 / -finfo.max`` without), so it is all ones for every 0/1 input mask; it is
   computed here the same way.

Precision: the masked statistics, norms and RoPE are computed in float32; the projections and
attention run in ``dtype``. The RoPE tables are built on the host as torch builds them: with
``rope_double_precision`` (every released config) equal to diffusers' to a float32 ulp at the
real widths; without it, torch's float32 ``pow`` is not correctly rounded (40 of LTX-2.0's 1920
frequencies differ by an ulp), so at the real width some angles (up to ~1.6e4 rad) differ by
~2e-3 rad; at the tiny test widths they are equal.

Public API: :class:`LTX2TextConnectorsConfig`, :class:`LTX2TextConnectors`,
:func:`per_layer_masked_mean_norm`, :func:`per_token_rms_norm`, :func:`encode`,
:func:`weight_map`, :func:`load_ltx2_connectors`, :func:`init_ltx2_connectors`,
:func:`count_params`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from jaxcore import weights
from jaxcore.attention import attention as attention_fn
from jaxcore.models.layers import Dense, RMSNorm, apply_rope, dense, gelu_tanh, rms_norm

__all__ = [
    "LTX2ConnectorsConfigError",
    "LTX2TextConnectors",
    "LTX2TextConnectorsConfig",
    "count_params",
    "encode",
    "init_ltx2_connectors",
    "load_ltx2_connectors",
    "per_layer_masked_mean_norm",
    "per_token_rms_norm",
    "weight_map",
]

Dtype = Any
NORM_EPS = 1e-6  # the blocks', the output norm's and q/k norms' eps (diffusers' defaults)
# diffusers binarises the additive mask at this value when it swaps in the registers.
MASK_BINARIZE_THRESHOLD = -9000.0
ROPE_TYPES = ("interleaved", "split")


class LTX2ConnectorsConfigError(ValueError):
    """A config.json key or value the connectors cannot represent; names the key."""


@dataclasses.dataclass(frozen=True)
class LTX2TextConnectorsConfig:
    """diffusers ``LTX2TextConnectors`` config (its names; its defaults, which are LTX-2.0's
    apart from ``rope_type``: the released 2.0 checkpoint says ``"split"``)."""

    caption_channels: int = 3840
    text_proj_in_factor: int = 49
    video_connector_num_attention_heads: int = 30
    video_connector_attention_head_dim: int = 128
    video_connector_num_layers: int = 2
    video_connector_num_learnable_registers: int | None = 128
    video_gated_attn: bool = False
    audio_connector_num_attention_heads: int = 30
    audio_connector_attention_head_dim: int = 128
    audio_connector_num_layers: int = 2
    audio_connector_num_learnable_registers: int | None = 128
    audio_gated_attn: bool = False
    connector_rope_base_seq_len: int = 4096
    rope_theta: float = 10000.0
    rope_double_precision: bool = True
    causal_temporal_positioning: bool = False  # stored by diffusers, never read by its forward
    rope_type: str = "interleaved"
    per_modality_projections: bool = False
    video_hidden_dim: int = 4096
    audio_hidden_dim: int = 2048
    proj_bias: bool = False

    def __post_init__(self):
        """Refuse what diffusers' forward cannot run, by key."""
        if self.rope_type not in ROPE_TYPES:
            raise LTX2ConnectorsConfigError(f"rope_type={self.rope_type!r} not in {ROPE_TYPES}")
        for side in ("video", "audio"):
            self.connector(side)  # checks its sizes
            if self.per_modality_projections:
                hidden = getattr(self, f"{side}_hidden_dim")
                if hidden != self.connector(side).inner_dim:
                    raise LTX2ConnectorsConfigError(
                        f"{side}_hidden_dim={hidden} must equal the {side} connector's width "
                        f"{side}_connector_num_attention_heads x attention_head_dim"
                    )
            elif self.connector(side).inner_dim != self.caption_channels:
                raise LTX2ConnectorsConfigError(
                    f"caption_channels={self.caption_channels} must equal the {side} "
                    f"connector's width {side}_connector_num_attention_heads x attention_head_dim"
                )

    @property
    def text_encoder_dim(self) -> int:
        """The packed input width ``caption_channels * text_proj_in_factor``."""
        return self.caption_channels * self.text_proj_in_factor

    def connector(self, side: str) -> ConnectorConfig:
        """The ``video`` or ``audio`` connector's own slice of the config."""
        return ConnectorConfig(
            num_attention_heads=getattr(self, f"{side}_connector_num_attention_heads"),
            attention_head_dim=getattr(self, f"{side}_connector_attention_head_dim"),
            num_layers=getattr(self, f"{side}_connector_num_layers"),
            num_learnable_registers=getattr(self, f"{side}_connector_num_learnable_registers"),
            gated_attention=getattr(self, f"{side}_gated_attn"),
            rope_base_seq_len=self.connector_rope_base_seq_len,
            rope_theta=self.rope_theta,
            rope_double_precision=self.rope_double_precision,
            rope_type=self.rope_type,
            name=f"{side}_connector",
        )

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LTX2TextConnectorsConfig:
        """Build from a diffusers config.json dict (``_class_name`` etc. skipped)."""
        kwargs = {k: v for k, v in d.items() if not k.startswith("_")}
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise LTX2ConnectorsConfigError(
                f"unknown LTX2TextConnectors keys {unknown}; known: {sorted(known)}"
            )
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class ConnectorConfig:
    """One ``LTX2ConnectorTransformer1d``'s settings (``name``: its diffusers attribute)."""

    num_attention_heads: int
    attention_head_dim: int
    num_layers: int
    num_learnable_registers: int | None
    gated_attention: bool
    rope_base_seq_len: int
    rope_theta: float
    rope_double_precision: bool
    rope_type: str
    name: str

    def __post_init__(self):
        if self.num_attention_heads < 1 or self.attention_head_dim < 1:
            raise LTX2ConnectorsConfigError(f"{self.name}: heads and head dim must be >= 1")
        if self.rope_type == "split" and self.attention_head_dim % 2:
            raise LTX2ConnectorsConfigError(
                f"{self.name}_attention_head_dim={self.attention_head_dim} must be even for "
                "rope_type 'split'"
            )
        if self.rope_type == "interleaved" and self.inner_dim % 2:
            raise LTX2ConnectorsConfigError(
                f"{self.name} width {self.inner_dim} must be even for rope_type 'interleaved'"
            )
        if self.num_learnable_registers is not None and self.num_learnable_registers < 1:
            raise LTX2ConnectorsConfigError(
                f"{self.name}_num_learnable_registers must be >= 1 or null"
            )

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim


# --- features ------------------------------------------------------------------------------------


def real_token_mask(sequence_lengths_b: jax.Array, length: int, padding_side: str) -> jax.Array:
    """``[B, L]`` bool: the last (left padding) or first (right padding) ``n`` tokens."""
    positions = jnp.arange(length)[None]
    n = sequence_lengths_b[:, None]
    if padding_side == "right":
        return positions < n
    if padding_side == "left":
        return positions >= length - n
    raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")


def per_layer_masked_mean_norm(
    states_blck: jax.Array,
    sequence_lengths_b: jax.Array,
    padding_side: str = "left",
    scale_factor: float = 8,
    eps: float = 1e-6,
) -> jax.Array:
    """diffusers' ``per_layer_masked_mean_norm``: ``[B, L, C, K]`` -> ``[B, L, C * K]``, each
    (sample, hidden state) centred by its mean over the real tokens' C channels, divided by
    their range + ``eps``, times ``scale_factor``; padding zero. In float32."""
    b, length, c, _ = states_blck.shape
    x = states_blck.astype(jnp.float32)
    real = real_token_mask(sequence_lengths_b, length, padding_side)[:, :, None, None]
    count = (sequence_lengths_b * c).astype(jnp.float32).reshape(b, 1, 1, 1)
    mean = jnp.where(real, x, 0.0).sum(axis=(1, 2), keepdims=True) / (count + eps)
    low = jnp.where(real, x, jnp.inf).min(axis=(1, 2), keepdims=True)
    high = jnp.where(real, x, -jnp.inf).max(axis=(1, 2), keepdims=True)
    normed = (x - mean) / (high - low + eps) * scale_factor
    normed = jnp.where(real, normed, 0.0)
    return normed.reshape(b, length, -1).astype(states_blck.dtype)


def per_token_rms_norm(states_blck: jax.Array, eps: float = 1e-6) -> jax.Array:
    """diffusers' ``per_token_rms_norm``: RMS over the C channels of each token and hidden
    state (axis 2 of ``[B, L, C, K]``), no weight. In float32."""
    x = states_blck.astype(jnp.float32)
    normed = x * jax.lax.rsqrt(jnp.mean(x * x, axis=2, keepdims=True) + eps)
    return normed.astype(states_blck.dtype)


# --- RoPE ----------------------------------------------------------------------------------------


def _torch_linspace_0_1(n: int, dtype) -> np.ndarray:
    """``torch.linspace(0, 1, n, dtype)`` as torch's CPU kernel forms it: a step, then
    ``step * i`` for the first half and ``1 - step * (n - 1 - i)`` for the rest, each rounded
    once to ``dtype``."""
    if n < 2:
        return np.zeros(n, dtype)
    step = np.float64(dtype(1.0) / dtype(n - 1))
    i = np.arange(n, dtype=np.float64)
    return np.where(i < n // 2, step * i, 1.0 - step * (n - 1 - i)).astype(dtype)


def rope_frequencies(dim: int, theta: float, double_precision: bool) -> np.ndarray:
    """float32 ``[dim // 2]``: ``theta ** linspace(0, 1) * pi / 2`` (``LTX2RotaryPosEmbed1d``)
    computed in float64 and rounded once (double precision), else in float32 ops."""
    n = dim // 2
    if double_precision:
        return (
            np.power(np.float64(theta), _torch_linspace_0_1(n, np.float64)) * math.pi / 2.0
        ).astype(np.float32)
    powers = np.power(np.float64(theta), _torch_linspace_0_1(n, np.float32).astype(np.float64))
    return powers.astype(np.float32) * np.float32(math.pi) / np.float32(2.0)


def rope_cos_sin(length: int, config: ConnectorConfig) -> tuple[np.ndarray, np.ndarray]:
    """cos / sin float32 of ``freq * (2 p / base_seq_len - 1)`` for positions 0..L-1:
    ``[L, inner_dim / 2]``, one angle per rotated pair (both layouts use the same angles;
    ``split`` gives head h the angles ``h * r .. (h + 1) * r - 1``, r = head_dim / 2)."""
    freqs = rope_frequencies(config.inner_dim, config.rope_theta, config.rope_double_precision)
    grid = np.arange(length, dtype=np.float32) / np.float32(config.rope_base_seq_len)
    angles = (grid[:, None] * np.float32(2) - np.float32(1)) * freqs[None]
    angles = angles.astype(np.float32).astype(np.float64)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def apply_split_rope(x_blhd: jax.Array, cos_lhr: jax.Array, sin_lhr: jax.Array) -> jax.Array:
    """diffusers' ``apply_split_rotary_emb``: each head's first and second halves (x1, x2)
    become ``x1 cos - x2 sin`` and ``x2 cos + x1 sin``; in float32."""
    half = x_blhd.shape[-1] // 2
    x = x_blhd.astype(jnp.float32)
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos_lhr[None], sin_lhr[None]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_blhd.dtype)


# --- layers --------------------------------------------------------------------------------------


def _rms_no_weight(x: jax.Array, eps: float = NORM_EPS) -> jax.Array:
    """``torch.nn.RMSNorm(elementwise_affine=False)``."""
    return rms_norm(x, jnp.ones((x.shape[-1],), jnp.float32), eps)


class ConnectorAttention(nn.Module):
    """diffusers ``LTX2Attention`` as a connector block uses it (self-attention, kv heads = q
    heads, ``rms_norm_across_heads``, biases on, an optional per-head output gate)."""

    config: ConnectorConfig
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    attention: str = "dot_product"

    def _dense(self, features: int, axes, name: str) -> Dense:
        return dense(features, axes, name, self.dtype, self.param_dtype)

    def _rotate(self, x_bld: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        """RoPE in the configured layout; returns heads ``[B, L, H, D]``."""
        c = self.config
        b, length, _ = x_bld.shape
        if c.rope_type == "interleaved":  # pairs of the whole width, before the heads split
            x_bld = apply_rope(x_bld[:, :, None, :], cos, sin)[:, :, 0, :]
            return x_bld.reshape(b, length, c.num_attention_heads, c.attention_head_dim)
        x_blhd = x_bld.reshape(b, length, c.num_attention_heads, c.attention_head_dim)
        per_head = (length, c.num_attention_heads, c.attention_head_dim // 2)
        return apply_split_rope(x_blhd, cos.reshape(per_head), sin.reshape(per_head))

    @nn.compact
    def __call__(self, x_bld, cos, sin, kv_mask_bl=None):
        c = self.config
        width = c.inner_dim
        q = RMSNorm(NORM_EPS, self.dtype, self.param_dtype, name="norm_q")(
            self._dense(width, ("embed", "heads"), "to_q")(x_bld)
        )
        k = RMSNorm(NORM_EPS, self.dtype, self.param_dtype, name="norm_k")(
            self._dense(width, ("embed", "heads"), "to_k")(x_bld)
        )
        v = self._dense(width, ("embed", "heads"), "to_v")(x_bld)
        q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
        v = v.reshape(*v.shape[:2], c.num_attention_heads, c.attention_head_dim)
        out = attention_fn(q, k, v, backend=self.attention, kv_mask=kv_mask_bl)
        if c.gated_attention:  # 2 sigmoid: zero-initialised logits open every gate fully
            logits = self._dense(c.num_attention_heads, ("embed", None), "to_gate_logits")(x_bld)
            gates = 2.0 * jax.nn.sigmoid(logits.astype(jnp.float32))
            out = (out.astype(jnp.float32) * gates[..., None]).astype(out.dtype)
        out = out.reshape(*out.shape[:2], width)
        return self._dense(width, ("heads", "embed"), "to_out")(out)


class ConnectorBlock(nn.Module):
    """diffusers ``LTX2TransformerBlock1d``: pre-norm attention and GELU-tanh MLP, residuals."""

    config: ConnectorConfig
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    attention: str = "dot_product"

    @nn.compact
    def __call__(self, x_bld, cos, sin, kv_mask_bl=None):
        width = self.config.inner_dim
        kw = {"dtype": self.dtype, "param_dtype": self.param_dtype}
        attn = ConnectorAttention(self.config, attention=self.attention, name="attn1", **kw)
        x_bld = x_bld + attn(_rms_no_weight(x_bld), cos, sin, kv_mask_bl)
        return x_bld + FeedForward(width, name="ff", **kw)(_rms_no_weight(x_bld))


class FeedForward(nn.Module):
    """diffusers ``FeedForward(dim, activation_fn="gelu-approximate")``: Linear(D, 4D) ->
    GELU-tanh -> Linear(4D, D), biased."""

    width: int
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x_bld):
        h = dense(4 * self.width, ("embed", "mlp"), "proj_in", self.dtype, self.param_dtype)(x_bld)
        return dense(self.width, ("mlp", "embed"), "proj_out", self.dtype, self.param_dtype)(
            gelu_tanh(h)
        )


def with_registers(x_bld: jax.Array, real_bl: jax.Array, registers_rd: jax.Array) -> jax.Array:
    """The real tokens moved to the front in their order, every later position p holding
    register ``p mod R`` (diffusers' stable argsort of the inverted mask, then ``where``)."""
    b, length, _ = x_bld.shape
    order_bl = jnp.argsort(~real_bl, axis=1, stable=True)
    front_bld = jnp.take_along_axis(x_bld, order_bl[..., None], axis=1)
    num_real_b1 = real_bl.sum(axis=1, keepdims=True)
    is_front_bl1 = (jnp.arange(length)[None] < num_real_b1)[..., None]
    tiled_ld = jnp.tile(registers_rd, (length // registers_rd.shape[0], 1))
    return jnp.where(is_front_bl1, front_bld, tiled_ld[None].astype(x_bld.dtype))


class Connector(nn.Module):
    """diffusers ``LTX2ConnectorTransformer1d``: ``(x [B, L, D], additive mask [B, L])`` ->
    ``(x, the additive mask it leaves: zeros with registers, else the one given)``."""

    config: ConnectorConfig
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    attention: str = "dot_product"

    @nn.compact
    def __call__(self, x_bld: jax.Array, additive_mask_bl: jax.Array):
        c = self.config
        length = x_bld.shape[1]
        real_bl = additive_mask_bl >= MASK_BINARIZE_THRESHOLD
        kv_mask_bl = real_bl
        if c.num_learnable_registers is not None:
            registers = self.param(
                "learnable_registers",
                nn.with_logical_partitioning(_uniform_pm1, (None, "embed")),
                (c.num_learnable_registers, c.inner_dim),
                self.param_dtype,
            )
            if length % c.num_learnable_registers:
                raise ValueError(
                    f"{c.name}: the text length {length} must be a multiple of its "
                    f"num_learnable_registers={c.num_learnable_registers}"
                )
            x_bld = with_registers(x_bld, real_bl, registers)
            additive_mask_bl = jnp.zeros_like(additive_mask_bl)
            kv_mask_bl = None  # registers fill the padding: every key is attended
        cos, sin = (jnp.asarray(t) for t in rope_cos_sin(length, c))
        kw = {"dtype": self.dtype, "param_dtype": self.param_dtype, "attention": self.attention}
        for i in range(c.num_layers):
            block = ConnectorBlock(c, name=f"transformer_blocks_{i}", **kw)
            x_bld = block(x_bld, cos, sin, kv_mask_bl)
        return _rms_no_weight(x_bld), additive_mask_bl


def _uniform_pm1(key, shape, dtype=jnp.float32):
    """diffusers' register init: uniform in [-1, 1)."""
    return jax.random.uniform(key, shape, dtype, -1.0, 1.0)


class LTX2TextConnectors(nn.Module):
    """diffusers ``LTX2TextConnectors``. ``__call__(text_states, attention_mask, padding_side,
    scale_factor)`` -> (video embedding ``[B, L, Dv]``, audio embedding ``[B, L, Da]``, video
    mask int32 ``[B, L]``), as the pipeline calls it. ``text_states``: ``[B, L, C * K]`` packed
    (or ``[B, L, C, K]``); ``attention_mask``: 0/1 ``[B, L]``."""

    config: LTX2TextConnectorsConfig
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    attention: str = "dot_product"

    def _proj(self, features: int, name: str) -> Dense:
        c = self.config
        return Dense(
            features,
            (None, "embed"),
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            use_bias=c.proj_bias,
            name=name,
        )

    def _features(self, states_blck, mask_bl, padding_side, scale_factor):
        """(video, audio) features ``[B, L, D]`` before the connectors (module docstring, 1)."""
        c = self.config
        if not c.per_modality_projections:  # LTX-2.0: one shared projection
            lengths_b = mask_bl.astype(jnp.int32).sum(axis=-1)
            normed = per_layer_masked_mean_norm(states_blck, lengths_b, padding_side, scale_factor)
            shared = self._proj(c.caption_channels, "text_proj_in")(normed.astype(self.dtype))
            return shared, shared
        normed = per_token_rms_norm(states_blck).astype(jnp.float32)
        normed = normed.reshape(*normed.shape[:2], -1)
        normed = jnp.where(mask_bl.astype(bool)[..., None], normed, 0.0)
        out = []
        for side in ("video", "audio"):
            hidden = getattr(c, f"{side}_hidden_dim")
            scaled = (normed * math.sqrt(hidden / c.caption_channels)).astype(self.dtype)
            out.append(self._proj(hidden, f"{side}_text_proj_in")(scaled))
        return tuple(out)

    @nn.compact
    def __call__(self, text_states, attention_mask_bl, padding_side="left", scale_factor=8):
        c = self.config
        b, length = text_states.shape[:2]
        states_blck = text_states.reshape(b, length, c.caption_channels, -1)
        if states_blck.shape[-1] != c.text_proj_in_factor:
            raise ValueError(
                f"text states of width {text_states.shape[2:]} are not caption_channels="
                f"{c.caption_channels} x text_proj_in_factor={c.text_proj_in_factor}"
            )
        video_bld, audio_bld = self._features(
            states_blck, attention_mask_bl, padding_side, scale_factor
        )
        # diffusers' additive mask: (mask - 1) * finfo(dtype).max
        big = float(jnp.finfo(video_bld.dtype).max)
        additive_bl = (attention_mask_bl.astype(jnp.int32) - 1).astype(jnp.float32) * big
        kw = {"dtype": self.dtype, "param_dtype": self.param_dtype, "attention": self.attention}
        video_bld, video_mask_bl = Connector(c.connector("video"), name="video_connector", **kw)(
            video_bld, additive_bl
        )
        binary_bl = (video_mask_bl < 1e-6).astype(jnp.int32)
        video_bld = video_bld * binary_bl[..., None].astype(video_bld.dtype)
        audio_bld, _ = Connector(c.connector("audio"), name="audio_connector", **kw)(
            audio_bld, additive_bl
        )
        return video_bld, audio_bld, binary_bl


# --- running it ----------------------------------------------------------------------------------


@functools.lru_cache(maxsize=16)
def _jitted(module: LTX2TextConnectors, padding_side: str, scale_factor: float):
    def run(params, text_states, attention_mask_bl):
        variables = {"params": params}
        return module.apply(variables, text_states, attention_mask_bl, padding_side, scale_factor)

    return jax.jit(run)


def encode(
    module: LTX2TextConnectors,
    params,
    text_states,
    attention_mask_bl,
    padding_side: str = "left",
    scale_factor: float = 8,
):
    """``connectors(prompt_embeds, prompt_attention_mask, padding_side=...)`` as
    ``LTX2Pipeline`` calls it (jitted): (video embedding, audio embedding, video mask)."""
    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
    states = jnp.asarray(text_states, module.dtype)
    mask = jnp.asarray(attention_mask_bl, jnp.int32)
    return _jitted(module, padding_side, scale_factor)(params, states, mask)


# --- weights -------------------------------------------------------------------------------------


def _dense_entries(flax_path: tuple[str, ...], torch_key: str, bias: bool = True) -> dict:
    entries = {(*flax_path, "kernel"): (f"{torch_key}.weight", weights.linear)}
    if bias:
        entries[(*flax_path, "bias")] = (f"{torch_key}.bias", weights.identity)
    return entries


def _connector_entries(config: ConnectorConfig) -> dict:
    """Weight map entries of one connector (``video_connector`` / ``audio_connector``)."""
    flax, torch = (config.name,), config.name
    entries: dict = {}
    if config.num_learnable_registers is not None:
        key = f"{torch}.learnable_registers"
        entries[(*flax, "learnable_registers")] = (key, weights.identity)
    for i in range(config.num_layers):
        fb, tb = (*flax, f"transformer_blocks_{i}"), f"{torch}.transformer_blocks.{i}"
        attn, tattn = (*fb, "attn1"), f"{tb}.attn1"
        for proj in ("to_q", "to_k", "to_v"):
            entries |= _dense_entries((*attn, proj), f"{tattn}.{proj}")
        entries |= _dense_entries((*attn, "to_out"), f"{tattn}.to_out.0")
        if config.gated_attention:
            entries |= _dense_entries((*attn, "to_gate_logits"), f"{tattn}.to_gate_logits")
        for norm in ("norm_q", "norm_k"):
            entries[(*attn, norm, "scale")] = (f"{tattn}.{norm}.weight", weights.identity)
        entries |= _dense_entries((*fb, "ff", "proj_in"), f"{tb}.ff.net.0.proj")
        entries |= _dense_entries((*fb, "ff", "proj_out"), f"{tb}.ff.net.2")
    return entries


def weight_map(config: LTX2TextConnectorsConfig) -> dict:
    """{flax param path: (diffusers key, transform)} for every parameter."""
    entries: dict = {}
    names = ("video_text_proj_in", "audio_text_proj_in")
    for name in names if config.per_modality_projections else ("text_proj_in",):
        entries |= _dense_entries((name,), name, config.proj_bias)
    for side in ("video", "audio"):
        entries |= _connector_entries(config.connector(side))
    return entries


def _dummy_length(config: LTX2TextConnectorsConfig) -> int:
    """The shortest text length both connectors' registers divide."""
    counts = [config.connector(s).num_learnable_registers or 1 for s in ("video", "audio")]
    return math.lcm(*counts)


def _abstract_params(module: LTX2TextConnectors):
    """The ``params`` collection as boxed ShapeDtypeStructs (nothing allocated)."""
    c = module.config
    length = _dummy_length(c)
    states = jax.ShapeDtypeStruct((1, length, c.text_encoder_dim), jnp.float32)
    mask = jax.ShapeDtypeStruct((1, length), jnp.int32)
    return weights.shapes_of_init(module.init, states, mask)["params"]


def count_params(config: LTX2TextConnectorsConfig) -> int:
    """Parameters of the connectors, from abstract shapes."""
    return weights.count_elements(_abstract_params(LTX2TextConnectors(config)))


def init_ltx2_connectors(
    config: LTX2TextConnectorsConfig, rng, *, dtype=jnp.float32, param_dtype=None
):
    """Random-init ``(module, params)`` (unboxed, on the default device)."""
    module = LTX2TextConnectors(config, dtype=dtype, param_dtype=param_dtype or dtype)
    length = _dummy_length(config)
    states = jnp.zeros((1, length, config.text_encoder_dim), jnp.float32)
    mask = jnp.ones((1, length), jnp.int32)
    return module, nn.meta.unbox(jax.jit(module.init)(rng, states, mask)["params"])


def load_ltx2_connectors(
    directory: str | os.PathLike,
    *,
    dtype=jnp.float32,
    param_dtype=None,
    attention: str = "dot_product",
    mesh: jax.sharding.Mesh | None = None,
    rules=None,
) -> tuple[LTX2TextConnectors, dict]:
    """A diffusers ``LTX2TextConnectors`` directory (``connectors/``) -> ``(module, params)``."""
    config = LTX2TextConnectorsConfig.from_dict(weights.read_config(directory))
    module = LTX2TextConnectors(
        config, dtype=dtype, param_dtype=param_dtype or dtype, attention=attention
    )
    params = weights.load_placed(
        weights.SafetensorsReader(directory),
        weight_map(config),
        _abstract_params(module),
        mesh=mesh,
        rules=rules,
        dtype=param_dtype or dtype,
    )
    return module, params
