"""LTX-Video diffusion transformer (DiT) in Flax linen.

Reference: diffusers ``LTXVideoTransformer3DModel`` (diffusers/models/transformers/
transformer_ltx.py, diffusers 0.42) and the token layout of ``LTXPipeline`` /
``LTXConditionPipeline`` (pipelines/ltx/). Same function, same parameters (loaded from a
diffusers checkpoint through :func:`weight_map`), written as JAX code:

- tokens: the pipeline packs the latent video [B, C, F, H, W] into tokens [B, L, C * pt * p * p]
  (:func:`pack_latents`, ``LTXPipeline._pack_latents``; every released LTX-Video has
  ``patch_size = patch_size_t = 1``, so a token is one latent voxel's C channels), L = F' * H' * W'
  in (frame, height, width) order; the model embeds them with ``proj_in`` (a Linear),
- 3D rotary embedding over the *whole* width D = heads x head dim (applied before the heads are
  split, ``LTXVideoRotaryPosEmbed``): ``D // 6`` frequencies ``theta ** linspace(0, 1) * pi / 2``,
  each rotating three pairs by ``freq * (2 g - 1)`` for the frame, height and width coordinate g;
  the first ``D % 6`` channels are not rotated. g is the grid position scaled by
  ``rope_interpolation_scale * patch / base`` (base = 20 frames, 2048 x 2048), or the given
  ``video_coords / base`` (:func:`rope_cos_sin`),
- timestep -> 256-channel sinusoidal embedding (cos first) -> SiLU MLP (``AdaLayerNormSingle``):
  ``embedded_timestep`` [B, T, D] for the output modulation and a 6-way projection for the
  blocks; T = 1 (a timestep per sample) or L (a timestep per token, as LTX 0.9.x image/condition
  pipelines pass),
- captions [B, S, caption_channels] -> GELU-tanh MLP to D (``PixArtAlphaTextProjection``),
- blocks: RMSNorm (no affine by default) modulated by ``scale_shift_table + temb`` -> self-attention
  (q/k RMSNorm across all heads, eps 1e-5, RoPE) -> gated residual; cross-attention of the
  *unnormalised* stream to the captions with the encoder attention mask -> residual; modulated
  RMSNorm -> GELU-tanh FFN (4 D) -> gated residual,
- output LayerNorm (eps 1e-6, no affine) modulated by the model's ``scale_shift_table`` +
  ``embedded_timestep``, ``proj_out`` -> [B, L, out_channels].

Config options (diffusers' names): ``attention_bias`` / ``attention_out_bias`` (q/k/v and output
projection biases), ``norm_elementwise_affine`` (a weight on the blocks' two RMSNorms),
``norm_eps`` (their eps), ``activation_fn`` ``"gelu-approximate"`` (default) or ``"gelu"``,
``patch_size`` / ``patch_size_t`` (they only scale the RoPE grid: the model takes packed tokens).
``qk_norm`` other than ``"rms_norm_across_heads"`` is refused (diffusers refuses it too), as are
other activations and a ``cross_attention_dim`` that differs from D (diffusers builds such a model
but its forward cannot run: the captions are projected to D).

Encoder attention mask: diffusers turns a [B, S] mask into the bias ``(1 - mask) * -10000``; here
``mask > 0.5`` selects the attended tokens, the same result for 0/1 masks (exp(-10000) is 0 in
float32), and a sample whose mask is all zeros attends to every token, as diffusers' constant
bias makes it do. 3-D masks (diffusers takes them as a ready bias) are refused.

RoPE tables: diffusers computes them in float32, and the angles reach ~1.6e4 rad, where one
float32 ulp is ~1e-3 rad, so the tables are only comparable when built with the same float32
operations: concrete grids and coords are done on the host as torch does them (float32 ops in
torch's order, torch's CPU linspace; cos/sin correctly rounded): equal to diffusers' tables to
a float32 ulp at small widths; at the real widths a few frequencies differ by one ulp, because
torch's pow is not correctly rounded (:func:`rope_frequencies`). Traced ``video_coords`` /
``rope_interpolation_scale`` are computed in the graph (XLA CPU divides through a reciprocal,
so a coordinate may differ by one ulp).

Public tensors use diffusers' layout: tokens [B, L, C] in, [B, L, out_channels] out.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from jax.ad_checkpoint import checkpoint_name

from jaxcore import compute, sharding, weights
from jaxcore.attention import attention as attention_fn
from jaxcore.compute import BLOCK_INPUT, remat_block
from jaxcore.config import config_json_kwargs
from jaxcore.models.layers import (
    MLP2,
    Dense,
    RMSNorm,
    apply_rope,
    dense,
    gated_add,
    gelu_erf,
    gelu_tanh,
    layer_norm,
    rms_norm,
    scale_shift,
    timestep_embedding,
)

Dtype = Any

SUPPORTED_QK_NORM = "rms_norm_across_heads"
# diffusers FeedForward activation names -> torch's kernels
ACTIVATIONS = {"gelu-approximate": gelu_tanh, "gelu": gelu_erf}
TIMESTEP_CHANNELS = 256  # AdaLayerNormSingle's Timesteps(num_channels=256)
MLP_RATIO = 4  # FeedForward(dim) hidden = 4 * D
QK_NORM_EPS = 1e-5  # LTXAttention's torch.nn.RMSNorm, whatever the config's norm_eps
OUT_NORM_EPS = 1e-6  # norm_out = LayerNorm(D, eps=1e-6, elementwise_affine=False)
ROPE_THETA = 10000.0
# LTXVideoRotaryPosEmbed(base_num_frames=20, base_height=2048, base_width=2048) as the model builds it
ROPE_BASE = (20, 2048, 2048)
# The LTX-Video VAE's compression: 8 frames, 32 x 32 pixels per latent voxel
VAE_TEMPORAL_COMPRESSION = 8
VAE_SPATIAL_COMPRESSION = 32

# ----------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------


class LTXConfigError(ValueError):
    """A config.json / YAML section LTXVideoTransformerConfig cannot represent; names the key."""


@dataclasses.dataclass(frozen=True)
class LTXVideoTransformerConfig:
    """Architecture of an LTX-Video transformer; field names follow diffusers' config.json.

    ``out_channels`` 0 / None means ``in_channels`` (diffusers: ``out_channels or in_channels``);
    it is resolved at construction, so ``to_dict`` writes the number.
    """

    in_channels: int = 128
    out_channels: int | None = 128
    patch_size: int = 1
    patch_size_t: int = 1
    num_attention_heads: int = 32
    attention_head_dim: int = 64
    cross_attention_dim: int = 2048
    num_layers: int = 28
    activation_fn: str = "gelu-approximate"
    qk_norm: str = SUPPORTED_QK_NORM
    norm_elementwise_affine: bool = False
    norm_eps: float = 1e-6
    caption_channels: int = 4096
    attention_bias: bool = True
    attention_out_bias: bool = True

    def __post_init__(self):
        if not self.out_channels:
            object.__setattr__(self, "out_channels", self.in_channels)
        if self.qk_norm != SUPPORTED_QK_NORM:
            raise LTXConfigError(
                f"qk_norm={self.qk_norm!r} is not supported; only {SUPPORTED_QK_NORM!r} "
                "(diffusers' LTXAttention refuses the others too)"
            )
        if self.activation_fn not in ACTIVATIONS:
            raise LTXConfigError(
                f"activation_fn={self.activation_fn!r} is not supported; "
                f"choose one of {sorted(ACTIVATIONS)}"
            )
        for key in (
            "in_channels",
            "out_channels",
            "patch_size",
            "patch_size_t",
            "num_attention_heads",
            "attention_head_dim",
            "cross_attention_dim",
            "caption_channels",
        ):
            if int(getattr(self, key)) < 1:
                raise LTXConfigError(f"{key} must be >= 1, got {getattr(self, key)!r}")
        if int(self.num_layers) < 0:
            raise LTXConfigError(f"num_layers must be >= 0, got {self.num_layers!r}")
        if not self.norm_eps > 0:
            raise LTXConfigError(f"norm_eps must be > 0, got {self.norm_eps!r}")
        if self.hidden_dim % 2:
            raise LTXConfigError(
                f"num_attention_heads x attention_head_dim = {self.hidden_dim} must be even: "
                "the rotary embedding rotates channel pairs across the whole width"
            )
        if self.cross_attention_dim != self.hidden_dim:
            raise LTXConfigError(
                f"cross_attention_dim={self.cross_attention_dim!r} must equal num_attention_heads "
                f"x attention_head_dim = {self.hidden_dim}: the cross-attention's to_k / to_v read "
                "the caption projection's output, which has the model width"
            )

    @property
    def hidden_dim(self) -> int:
        """Model width D = heads x head dim (diffusers' ``inner_dim``)."""
        return self.num_attention_heads * self.attention_head_dim

    @property
    def mlp_dim(self) -> int:
        return MLP_RATIO * self.hidden_dim

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LTXVideoTransformerConfig:
        """Build from a diffusers config.json dict (``_``-prefixed keys ignored)."""
        return cls(**config_json_kwargs(cls, d, LTXConfigError))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ----------------------------------------------------------------------------------------------
# Pure helpers: packing, coordinates, rotary tables
# ----------------------------------------------------------------------------------------------


def pack_latents(latents_bcfhw: jax.Array, patch_size: int = 1, patch_size_t: int = 1):
    """[B, C, F, H, W] -> tokens [B, F/pt * H/p * W/p, C * pt * p * p], (frame, height, width)
    order, channel-major within a token (``LTXPipeline._pack_latents``)."""
    if latents_bcfhw.ndim != 5:
        raise ValueError(f"latents must be [B, C, F, H, W], got shape {latents_bcfhw.shape}")
    b, c, f, h, w = latents_bcfhw.shape
    pt, p = patch_size_t, patch_size
    for axis, n, size in (("frames", f, pt), ("height", h, p), ("width", w, p)):
        if n % size:
            raise ValueError(f"latent {axis}={n} is not divisible by patch size {size}")
    x = latents_bcfhw.reshape(b, c, f // pt, pt, h // p, p, w // p, p)
    x = x.transpose(0, 2, 4, 6, 1, 3, 5, 7)
    return x.reshape(b, (f // pt) * (h // p) * (w // p), c * pt * p * p)


def unpack_latents(
    tokens_blc: jax.Array,
    num_frames: int,
    height: int,
    width: int,
    patch_size: int = 1,
    patch_size_t: int = 1,
):
    """Inverse of :func:`pack_latents`: tokens [B, L, C * pt * p * p] of a (num_frames, height,
    width) token grid -> [B, C, num_frames * pt, height * p, width * p]
    (``LTXPipeline._unpack_latents``, which takes the same post-patch grid)."""
    b, length, channels = tokens_blc.shape
    pt, p = patch_size_t, patch_size
    if length != num_frames * height * width or channels % (pt * p * p):
        raise ValueError(
            f"tokens {tokens_blc.shape} do not unpack to a {num_frames} x {height} x {width} "
            f"grid of {pt} x {p} x {p} patches"
        )
    x = tokens_blc.reshape(b, num_frames, height, width, -1, pt, p, p)
    x = x.transpose(0, 4, 1, 5, 2, 6, 3, 7)
    return x.reshape(b, x.shape[1], num_frames * pt, height * p, width * p)


def frame_rate_rope_scale(
    frame_rate: float,
    vae_temporal_compression_ratio: int = VAE_TEMPORAL_COMPRESSION,
    vae_spatial_compression_ratio: int = VAE_SPATIAL_COMPRESSION,
) -> tuple[float, float, float]:
    """``rope_interpolation_scale`` as LTXPipeline / LTXImageToVideoPipeline derive it:
    (temporal compression / frame_rate, spatial compression, spatial compression)."""
    return (
        vae_temporal_compression_ratio / frame_rate,
        vae_spatial_compression_ratio,
        vae_spatial_compression_ratio,
    )


def condition_video_coords(
    batch: int,
    num_frames: int,
    height: int,
    width: int,
    frame_rate: float,
    *,
    vae_temporal_compression_ratio: int = VAE_TEMPORAL_COMPRESSION,
    vae_spatial_compression_ratio: int = VAE_SPATIAL_COMPRESSION,
    frame_index: int = 0,
) -> np.ndarray:
    """``video_coords`` [B, 3, L] float32 of a (num_frames, height, width) latent grid as
    LTXConditionPipeline builds them (``_prepare_video_ids`` with patch size 1,
    ``_scale_video_ids``, then frames x ``1 / frame_rate``): pixel-space coordinates, the first
    latent frame at 0 and latent frame f > 0 at ``f * t + 1 - t`` (t = temporal compression).
    Extra conditioning tokens the pipeline appends carry their own coordinates (not built here)."""
    t, s = vae_temporal_compression_ratio, vae_spatial_compression_ratio
    ids = np.stack(
        np.meshgrid(np.arange(num_frames), np.arange(height), np.arange(width), indexing="ij")
    ).reshape(3, -1)
    ids = ids * np.array([t, s, s])[:, None]
    ids[0] = np.maximum(ids[0] + 1 - t, 0) + frame_index
    coords = ids.astype(np.float32)
    coords[0] = coords[0] * np.float32(1.0 / frame_rate)
    return np.broadcast_to(coords, (batch, *coords.shape)).copy()


def _linspace_0_1(n: int) -> np.ndarray:
    """float32 ``torch.linspace(0, 1, n)`` as torch's CPU kernel forms it: a float32 step, then
    ``step * i`` for the first half and ``1 - step * (n - 1 - i)`` for the rest, each rounded
    once (the kernel's fused multiply-add; equal to torch's for every n < 800)."""
    if n < 2:
        return np.zeros(n, np.float32)
    step = np.float64(np.float32(1.0) / np.float32(n - 1))
    i = np.arange(n, dtype=np.float64)
    values = np.where(i < n // 2, step * i, 1.0 - step * (n - 1 - i))  # exact in float64
    return values.astype(np.float32)


def rope_frequencies(dim: int, theta: float = ROPE_THETA) -> np.ndarray:
    """float32 [dim // 6]: ``theta ** linspace(0, 1, dim // 6) * pi / 2`` as
    LTXVideoRotaryPosEmbed computes it in float32. The power is correctly rounded here; torch's
    CPU pow (SLEEF, 1 ulp) is not always, so from ~34 frequencies on a few entries (1-2%) may
    differ from torch's by one float32 ulp (up to ~1e-3 of the largest, 1.6e4)."""
    powers = np.power(np.float64(theta), _linspace_0_1(dim // 6).astype(np.float64))
    return (powers.astype(np.float32) * np.float32(math.pi)) / np.float32(2.0)


def _cos_sin(g, freqs: np.ndarray):
    """cos / sin [..., n] of ``freqs * (2 g - 1)``, the angle in float32 as torch forms it; for a
    numpy ``g`` on the host (cos/sin of the float32 angle correctly rounded), else in the graph."""
    if isinstance(g, np.ndarray):
        angles = freqs * (g.astype(np.float32)[..., None] * np.float32(2) - np.float32(1))
        angles = angles.astype(np.float64)
        return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    angles = jnp.asarray(freqs) * (g.astype(jnp.float32)[..., None] * 2.0 - 1.0)
    return jnp.cos(angles), jnp.sin(angles)


def _is_traced(x) -> bool:
    return isinstance(x, jax.core.Tracer)


def _grid_positions(n: int, scale, patch: int, base: int):
    """One axis of diffusers' ``_prepare_video_coords``: ``arange(n) * scale * patch / base``
    (left to right, float32), or the raw positions when no scale is given."""
    positions = np.arange(n, dtype=np.float32)
    if scale is None:
        return positions
    if _is_traced(scale):
        return positions * jnp.asarray(scale, jnp.float32) * patch / base
    return ((positions * np.float32(scale)) * np.float32(patch)) / np.float32(base)


def _interleave_and_pad(parts_cos, parts_sin, dim: int):
    """Per-axis tables [..., n] (frame, height, width) -> [..., dim/2] per channel pair: pair
    ``pad + 3j + axis`` rotates by frequency j of that axis, the first ``pad = (dim % 6) / 2``
    pairs not at all (cos 1, sin 0), as diffusers lays them out."""
    pad = (dim % 6) // 2

    def assemble(parts, fill):
        table = jnp.stack([jnp.asarray(p) for p in parts], axis=-1)
        table = table.reshape(*table.shape[:-2], -1)
        if not pad:
            return table
        padding = jnp.full((*table.shape[:-1], pad), fill, table.dtype)
        return jnp.concatenate([padding, table], axis=-1)

    return assemble(parts_cos, 1.0), assemble(parts_sin, 0.0)


def _grid_tables(dim, grid, rope_interpolation_scale, patch, theta):
    """[L, dim/2] tables of a (frames, height, width) grid: small per-axis tables broadcast to
    the grid in the graph (a long video embeds no large constant)."""
    freqs = rope_frequencies(dim, theta)
    scale = (None,) * 3 if rope_interpolation_scale is None else tuple(rope_interpolation_scale)
    axes = [
        _cos_sin(_grid_positions(n, s, p, base), freqs)
        for n, s, p, base in zip(grid, scale, patch, ROPE_BASE, strict=True)
    ]
    f, h, w = grid
    expand = (
        lambda t: t[:, None, None, :],
        lambda t: t[None, :, None, :],
        lambda t: t[None, None, :, :],
    )

    def on_grid(which: int):  # 0: cos, 1: sin
        parts = []
        for put, axis in zip(expand, axes, strict=True):
            table = jnp.broadcast_to(put(jnp.asarray(axis[which])), (f, h, w, freqs.size))
            parts.append(table.reshape(f * h * w, freqs.size))
        return parts

    return _interleave_and_pad(on_grid(0), on_grid(1), dim)


def _coords_tables(dim, video_coords, theta):
    """[B, L, dim/2] tables of per-token coordinates [B, 3, L] (``video_coords / base``):
    concrete coords on the host, one small table per axis over its distinct values gathered per
    token in the graph; traced coords in the graph."""
    freqs = rope_frequencies(dim, theta)
    parts_cos, parts_sin = [], []
    for axis, base in enumerate(ROPE_BASE):
        if _is_traced(video_coords):
            g = video_coords[:, axis].astype(jnp.float32) / base
            cos, sin = _cos_sin(g, freqs)
        else:
            g = np.asarray(video_coords)[:, axis].astype(np.float32) / np.float32(base)
            values, index = np.unique(g, return_inverse=True)
            cos, sin = _cos_sin(values, freqs)
            index = jnp.asarray(index.reshape(g.shape).astype(np.int32))
            cos, sin = jnp.take(jnp.asarray(cos), index, 0), jnp.take(jnp.asarray(sin), index, 0)
        parts_cos.append(cos)
        parts_sin.append(sin)
    return _interleave_and_pad(parts_cos, parts_sin, dim)


def rope_cos_sin(
    dim: int,
    *,
    grid: tuple[int, int, int] | None = None,
    rope_interpolation_scale: Sequence[float] | None = None,
    patch_size: tuple[int, int] = (1, 1),
    video_coords=None,
    theta: float = ROPE_THETA,
) -> tuple[jax.Array, jax.Array]:
    """cos / sin tables per channel pair of the whole width ``dim`` (LTXVideoRotaryPosEmbed,
    whose tables repeat each value for both members of a pair: ours = theirs[..., 0::2]).

    Either a token ``grid`` (frames, height, width) with ``rope_interpolation_scale`` (t, h, w)
    (None: unscaled positions, as diffusers) and ``patch_size`` (patch_size_t, patch_size) ->
    [L, dim/2]; or ``video_coords`` [B, 3, L] (frame, height, width coordinate per token, as
    LTXConditionPipeline passes them) -> [B, L, dim/2].
    """
    if video_coords is not None:
        return _coords_tables(dim, video_coords, theta)
    patch = (patch_size[0], patch_size[1], patch_size[1])
    return _grid_tables(dim, tuple(grid), rope_interpolation_scale, patch, theta)


def rotate_across_heads(x_bld: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """diffusers' LTX ``apply_rotary_emb``: RoPE on the pairs of the whole width (before the
    heads are split), with tables [L, D/2] shared by the batch or [B, L, D/2] per sample."""
    if cos.ndim == 2:
        return apply_rope(x_bld[:, :, None, :], cos, sin)[:, :, 0, :]

    def one_sample(x_ld, cos_lk, sin_lk):
        return apply_rope(x_ld[None, :, None, :], cos_lk, sin_lk)[0, :, 0, :]

    shape = (x_bld.shape[0], *cos.shape[1:])
    return jax.vmap(one_sample)(x_bld, jnp.broadcast_to(cos, shape), jnp.broadcast_to(sin, shape))


# ----------------------------------------------------------------------------------------------
# Layers
# ----------------------------------------------------------------------------------------------

_BATCH_LENGTH_EMBED = ("activation_batch", "activation_length", "activation_embed")
_TEXT_EMBED = ("activation_batch", "activation_kv_length", "activation_embed")
_BATCH_LENGTH_HEADS = ("activation_batch", "activation_length", "activation_heads", "activation_kv")
_TEXT_HEADS = ("activation_batch", "activation_kv_length", "activation_heads", "activation_kv")
# modulation [B, T, 6, D], T = 1 or L (per-token timesteps)
_BATCH_LENGTH_MOD_EMBED = ("activation_batch", "activation_length", None, "activation_embed")


def _modulation_table(module: nn.Module, rows: int, dim: int, param_dtype: Dtype) -> jax.Array:
    """A learnt ``scale_shift_table`` [rows, D] (diffusers: ``randn(rows, D) / D ** 0.5``)."""
    return module.param(
        "scale_shift_table",
        nn.with_logical_partitioning(
            nn.initializers.normal(stddev=dim**-0.5), ("modulation", "embed")
        ),
        (rows, dim),
        param_dtype,
    )


def _split_modulation(table_nd: jax.Array, temb_btnd: jax.Array) -> list[jax.Array]:
    """``table + temb`` in float32, [B, T, n, D] split into n parts of [B, T, D]."""
    mod = table_nd.astype(jnp.float32) + temb_btnd.astype(jnp.float32)
    return [mod[:, :, i] for i in range(table_nd.shape[0])]


def encoder_kv_mask(encoder_attention_mask) -> jax.Array | None:
    """[B, S] mask (1 / True = attend) -> booleans for :func:`jaxcore.attention.attention`,
    equal to diffusers' ``(1 - mask) * -10000`` bias for 0/1 masks: a sample with no attended
    token attends to all (a constant bias cancels in the softmax)."""
    if encoder_attention_mask is None:
        return None
    keep = jnp.asarray(encoder_attention_mask).astype(jnp.float32) > 0.5
    return keep | ~jnp.any(keep, axis=-1, keepdims=True)


class TimeEmbedding(nn.Module):
    """diffusers ``AdaLayerNormSingle`` (no additional conditions), in float32: timesteps
    [B, T] -> (6-way projection [B, T, 6, D], embedded timestep [B, T, D])."""

    config: LTXVideoTransformerConfig
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, timestep_bt: jax.Array):
        dim = self.config.hidden_dim
        b, t = timestep_bt.shape
        t_freq = timestep_embedding(timestep_bt.reshape(-1), TIMESTEP_CHANNELS)
        emb = MLP2(
            dim,
            dim,
            nn.silu,
            (None, "embed"),
            ("embed", None),
            dtype=jnp.float32,
            param_dtype=self.param_dtype,
            name="timestep_embedder",
        )(t_freq)
        proj = dense(6 * dim, ("embed", "modulation"), "linear", jnp.float32, self.param_dtype)
        temb = proj(nn.silu(emb)).reshape(b, t, 6, dim)
        emb = emb.reshape(b, t, dim)
        if t > 1:
            temb = sharding.constrain(temb, _BATCH_LENGTH_MOD_EMBED)
            emb = sharding.constrain(emb, _BATCH_LENGTH_EMBED)
        return temb, emb


class LTXAttention(nn.Module):
    """Multi-head attention with RMSNorm on q and k across all heads (diffusers LTXAttention).

    Self-attention when ``context`` is None (RoPE over the whole width on q and k, before the
    heads split), else cross-attention to ``context`` under ``kv_mask`` [B, S] (no RoPE).
    """

    config: LTXVideoTransformerConfig
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    attention: str = "dot_product"
    mesh: Any = None

    def _project(self, name: str, axes, use_bias: bool, source: jax.Array) -> jax.Array:
        dense_layer = Dense(
            self.config.hidden_dim,
            axes,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            use_bias=use_bias,
            name=name,
        )
        return dense_layer(source)

    def _qk_norm(self, name: str, x: jax.Array) -> jax.Array:
        return RMSNorm(QK_NORM_EPS, self.dtype, self.param_dtype, name=name)(x)

    @nn.compact
    def __call__(self, x_bld, context_bmd=None, rope=None, kv_mask=None):
        cfg = self.config
        heads, head_dim = cfg.num_attention_heads, cfg.attention_head_dim
        kv_source = x_bld if context_bmd is None else context_bmd
        kv_axes = _BATCH_LENGTH_HEADS if context_bmd is None else _TEXT_HEADS
        bias = cfg.attention_bias

        q = self._qk_norm("norm_q", self._project("to_q", ("embed", "heads"), bias, x_bld))
        k = self._qk_norm("norm_k", self._project("to_k", ("embed", "heads"), bias, kv_source))
        v = self._project("to_v", ("embed", "heads"), bias, kv_source)
        if rope is not None:
            q, k = rotate_across_heads(q, *rope), rotate_across_heads(k, *rope)

        def split_heads(t, axes):
            return sharding.constrain(t.reshape(*t.shape[:2], heads, head_dim), axes)

        q = split_heads(q, _BATCH_LENGTH_HEADS)
        k, v = split_heads(k, kv_axes), split_heads(v, kv_axes)
        out = attention_fn(q, k, v, backend=self.attention, kv_mask=kv_mask, mesh=self.mesh)
        out = sharding.constrain(out, _BATCH_LENGTH_HEADS).reshape(*out.shape[:2], -1)
        out = self._project("to_out", ("heads", "embed"), cfg.attention_out_bias, out)
        return sharding.constrain(out, _BATCH_LENGTH_EMBED)


class FeedForward(nn.Module):
    """Linear(D, 4D) -> GELU (tanh or erf) -> Linear(4D, D) (diffusers FeedForward)."""

    config: LTXVideoTransformerConfig
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x_bld):
        cfg = self.config
        h = dense(cfg.mlp_dim, ("embed", "mlp"), "proj_in", self.dtype, self.param_dtype)(x_bld)
        h = ACTIVATIONS[cfg.activation_fn](h)
        h = sharding.constrain(h, ("activation_batch", "activation_length", "activation_mlp"))
        out = dense(cfg.hidden_dim, ("mlp", "embed"), "proj_out", self.dtype, self.param_dtype)(h)
        return sharding.constrain(out, _BATCH_LENGTH_EMBED)


class LTXBlock(nn.Module):
    """One transformer block (diffusers LTXVideoTransformerBlock)."""

    config: LTXVideoTransformerConfig
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    attention: str = "dot_product"
    mesh: Any = None

    def _norm(self, name: str, x_bld: jax.Array) -> jax.Array:
        """The blocks' RMSNorm (diffusers ``RMSNorm(D, norm_eps, norm_elementwise_affine)``),
        float32 out for the modulation."""
        cfg = self.config
        x32 = x_bld.astype(jnp.float32)
        if cfg.norm_elementwise_affine:
            return RMSNorm(cfg.norm_eps, jnp.float32, self.param_dtype, name=name)(x32)
        return rms_norm(x32, jnp.ones((x32.shape[-1],), jnp.float32), cfg.norm_eps)

    @nn.compact
    def __call__(self, x_bld, context_bmd, temb_bt6d, rope_cos, rope_sin, kv_mask=None):
        cfg = self.config
        x_bld = checkpoint_name(x_bld, BLOCK_INPUT)  # what an offloading remat policy keeps
        table = _modulation_table(self, 6, cfg.hidden_dim, self.param_dtype)
        shift_sa, scale_sa, gate_sa, shift_ff, scale_ff, gate_ff = _split_modulation(
            table, temb_bt6d
        )
        attn_kw = dict(
            config=cfg,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            attention=self.attention,
            mesh=self.mesh,
        )

        # 1. self-attention on the modulated RMSNorm, gated; residual adds in float32
        h = scale_shift(self._norm("norm1", x_bld), scale_sa, shift_sa).astype(self.dtype)
        h = LTXAttention(**attn_kw, name="attn1")(h, rope=(rope_cos, rope_sin))
        x_bld = sharding.constrain(
            gated_add(x_bld, h, gate_sa).astype(self.dtype), _BATCH_LENGTH_EMBED
        )

        # 2. cross-attention of the unnormalised stream to the captions, ungated
        h = LTXAttention(**attn_kw, name="attn2")(x_bld, context_bmd, kv_mask=kv_mask)
        x_bld = (x_bld.astype(jnp.float32) + h.astype(jnp.float32)).astype(self.dtype)

        # 3. feed-forward on the modulated RMSNorm, gated
        h = scale_shift(self._norm("norm2", x_bld), scale_ff, shift_ff).astype(self.dtype)
        h = FeedForward(cfg, self.dtype, self.param_dtype, name="ff")(h)
        x_bld = gated_add(x_bld, h, gate_ff).astype(self.dtype)
        return sharding.constrain(x_bld, _BATCH_LENGTH_EMBED)


class LTXVideoTransformer(nn.Module):
    """LTX-Video transformer (= diffusers LTXVideoTransformer3DModel.forward)::

        (hidden_states [B, L, in_channels] (packed tokens, :func:`pack_latents`),
         encoder_hidden_states [B, S, caption_channels], timestep [B] | [B, 1] | [B, L],
         encoder_attention_mask [B, S] | None, num_frames, height, width (the token grid,
         F' * H' * W' = L), rope_interpolation_scale (t, h, w) | None, video_coords [B, 3, L] | None)
        -> prediction [B, L, out_channels]

    The RoPE positions come from the grid (``num_frames``/``height``/``width``, Python ints)
    scaled by ``rope_interpolation_scale`` (LTXPipeline: :func:`frame_rate_rope_scale`; None
    leaves them unscaled, as diffusers does), or from ``video_coords`` (LTXConditionPipeline:
    :func:`condition_video_coords`), which carry their own scaling: passing a
    ``rope_interpolation_scale`` with them is an error (diffusers ignores it). Grid sizes and
    scales are Python values (close over them under ``jax.jit``; a traced scale works, its
    tables then computed in the graph); concrete (numpy) ``video_coords`` give host tables
    built with diffusers' float32 operations (:func:`rope_cos_sin`), traced ones are computed
    in the graph. ``timestep`` per token (T = L) modulates every token on its own, as the image-
    and condition-to-video pipelines use it.
    """

    config: LTXVideoTransformerConfig
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    attention: str = "dot_product"
    mesh: Any = None
    remat_policy: str = "none"
    scan_layers: bool = False  # the blocks as one lax.scan (jaxcore.compute.run_blocks)
    # the block groups scan_layers scans (their stacked layout: jaxcore.layer_stack)
    scanned_blocks: ClassVar[tuple[str, ...]] = ("transformer_blocks",)

    def _check_inputs(self, hidden, text, timestep, mask, grid, scale, coords) -> None:
        """Raise ValueError naming the argument whose shape does not fit the config."""
        cfg = self.config
        if hidden.ndim != 3 or hidden.shape[2] != cfg.in_channels:
            raise ValueError(
                f"hidden_states must be packed tokens [B, L, in_channels={cfg.in_channels}] "
                f"(pack_latents), got {tuple(hidden.shape)}"
            )
        batch, tokens = hidden.shape[:2]
        if text.ndim != 3 or (text.shape[0], text.shape[2]) != (batch, cfg.caption_channels):
            raise ValueError(
                f"encoder_hidden_states must be [{batch}, S, caption_channels="
                f"{cfg.caption_channels}], got {tuple(text.shape)}"
            )
        if tuple(timestep.shape) not in ((batch,), (batch, 1), (batch, tokens)):
            raise ValueError(
                f"timestep must be [B]=[{batch}] or [B, 1] (one per sample) or [B, L]=[{batch}, "
                f"{tokens}] (one per token), got shape {tuple(timestep.shape)}"
            )
        if mask is not None and tuple(mask.shape) != (batch, text.shape[1]):
            raise ValueError(
                f"encoder_attention_mask must be [B, S]=[{batch}, {text.shape[1]}] (1 = attend), "
                f"got shape {tuple(mask.shape)}"
            )
        if coords is not None:
            if tuple(coords.shape) != (batch, 3, tokens):
                raise ValueError(
                    f"video_coords must be [B, 3, L]=[{batch}, 3, {tokens}], "
                    f"got shape {tuple(coords.shape)}"
                )
            if scale is not None:
                raise ValueError(
                    "rope_interpolation_scale is not used with video_coords (the coordinates "
                    "carry their scaling); pass one or the other"
                )
        if coords is None and any(n is None for n in grid):
            raise ValueError(
                "num_frames, height and width (the token grid) are required without video_coords"
            )
        if any(n is not None for n in grid):
            if not all(isinstance(n, (int, np.integer)) for n in grid):
                raise ValueError(
                    f"num_frames, height, width must be Python ints (static under jit), got {grid}"
                )
            if math.prod(grid) != tokens:
                raise ValueError(
                    f"num_frames x height x width = {' x '.join(map(str, grid))} != the "
                    f"{tokens} tokens of hidden_states"
                )
        if scale is not None and len(scale) != 3:
            raise ValueError(f"rope_interpolation_scale must be 3 numbers (t, h, w), got {scale!r}")

    def _rope(self, grid, scale, coords):
        cfg = self.config
        cos, sin = rope_cos_sin(
            cfg.hidden_dim,
            grid=grid,
            rope_interpolation_scale=scale,
            patch_size=(cfg.patch_size_t, cfg.patch_size),
            video_coords=coords,
        )
        axes = (
            ("activation_length", None)
            if cos.ndim == 2
            else ("activation_batch", "activation_length", None)
        )
        return sharding.constrain(cos, axes), sharding.constrain(sin, axes)

    def _caption_projection(self, encoder_hidden_states):
        """Captions [B, S, caption_channels] -> [B, S, D] (``PixArtAlphaTextProjection``)."""
        dim = self.config.hidden_dim
        context = MLP2(
            dim,
            dim,
            gelu_tanh,
            (None, "embed"),
            ("embed", None),
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            name="caption_projection",
        )(encoder_hidden_states.astype(self.dtype))
        return sharding.constrain(context, _TEXT_EMBED)

    @nn.compact
    def __call__(
        self,
        hidden_states,
        encoder_hidden_states,
        timestep,
        encoder_attention_mask=None,
        num_frames=None,
        height=None,
        width=None,
        rope_interpolation_scale=None,
        video_coords=None,
        run_stack=None,
    ):
        """The prediction [B, L, out_channels]; with ``run_stack`` (step caching,
        :mod:`jaxcore.step_cache`), ``(prediction, extra)`` where the block stack ran as
        ``run_stack((x,), run_blocks, num_blocks) -> ((x,), extra)`` and
        ``run_blocks(streams, start, stop)`` runs blocks ``start..stop-1``."""
        cfg = self.config
        timestep = jnp.asarray(timestep)
        grid = (num_frames, height, width)
        self._check_inputs(
            hidden_states,
            encoder_hidden_states,
            timestep,
            encoder_attention_mask,
            grid,
            rope_interpolation_scale,
            video_coords,
        )
        batch, dim = hidden_states.shape[0], cfg.hidden_dim
        if self.mesh is not None:
            sharding.check_divisible(self.mesh, batch=batch, heads=cfg.num_attention_heads)

        rope = self._rope(grid, rope_interpolation_scale, video_coords)
        kv_mask = encoder_kv_mask(encoder_attention_mask)
        x = dense(dim, ("conv_in", "embed"), "proj_in", self.dtype, self.param_dtype)(
            hidden_states.astype(self.dtype)
        )
        x = sharding.constrain(x, _BATCH_LENGTH_EMBED)
        temb, embedded_timestep = TimeEmbedding(cfg, self.param_dtype, name="time_embed")(
            timestep.reshape(batch, -1)
        )
        context = self._caption_projection(encoder_hidden_states)

        def one_block(block, h):
            return block(h, context, temb, *rope, kv_mask)

        block_cls = remat_block(LTXBlock, self.remat_policy)
        block_args = (cfg, self.dtype, self.param_dtype, self.attention, self.mesh)
        x, extra = compute.block_stack(
            self,
            block_cls,
            block_args,
            "transformer_blocks_",
            cfg.num_layers,
            one_block,
            x,
            run_stack,
            self.scan_layers,
        )

        table = _modulation_table(self, 2, dim, self.param_dtype)
        shift, scale = _split_modulation(table, embedded_timestep[:, :, None, :])
        x = scale_shift(layer_norm(x, OUT_NORM_EPS), scale, shift).astype(self.dtype)
        out_axes = ("embed", "conv_out")
        out = dense(cfg.out_channels, out_axes, "proj_out", self.dtype, self.param_dtype)(x)
        return out if run_stack is None else (out, extra)


# ----------------------------------------------------------------------------------------------
# Weights: diffusers checkpoint <-> flax params
# ----------------------------------------------------------------------------------------------


def _dense_entries(flax_prefix: tuple[str, ...], torch_prefix: str, bias: bool = True) -> dict:
    entries = {(*flax_prefix, "kernel"): (f"{torch_prefix}.weight", weights.linear)}
    if bias:
        entries[(*flax_prefix, "bias")] = (f"{torch_prefix}.bias", weights.identity)
    return entries


def _scale_entry(flax_prefix: tuple[str, ...], torch_prefix: str) -> dict:
    return {(*flax_prefix, "scale"): (f"{torch_prefix}.weight", weights.identity)}


def _attention_entries(
    flax_prefix: tuple[str, ...], torch_prefix: str, config: LTXVideoTransformerConfig
) -> dict:
    entries: dict = {}
    for proj in ("to_q", "to_k", "to_v"):
        entries |= _dense_entries(
            (*flax_prefix, proj), f"{torch_prefix}.{proj}", config.attention_bias
        )
    entries |= _dense_entries(
        (*flax_prefix, "to_out"), f"{torch_prefix}.to_out.0", config.attention_out_bias
    )
    for norm in ("norm_q", "norm_k"):
        entries |= _scale_entry((*flax_prefix, norm), f"{torch_prefix}.{norm}")
    return entries


def _block_entries(i: int, config: LTXVideoTransformerConfig) -> dict:
    flax, torch = (f"transformer_blocks_{i}",), f"transformer_blocks.{i}"
    entries = {(*flax, "scale_shift_table"): (f"{torch}.scale_shift_table", weights.identity)}
    entries |= _attention_entries((*flax, "attn1"), f"{torch}.attn1", config)
    entries |= _attention_entries((*flax, "attn2"), f"{torch}.attn2", config)
    if config.norm_elementwise_affine:
        entries |= _scale_entry((*flax, "norm1"), f"{torch}.norm1")
        entries |= _scale_entry((*flax, "norm2"), f"{torch}.norm2")
    entries |= _dense_entries((*flax, "ff", "proj_in"), f"{torch}.ff.net.0.proj")
    entries |= _dense_entries((*flax, "ff", "proj_out"), f"{torch}.ff.net.2")
    return entries


def weight_map(config: LTXVideoTransformerConfig) -> dict:
    """{flax param path: (diffusers key, transform)} for every parameter of the model."""
    entries = {("scale_shift_table",): ("scale_shift_table", weights.identity)}
    entries |= _dense_entries(("proj_in",), "proj_in")
    time = ("time_embed",)
    for lin in ("linear_1", "linear_2"):
        entries |= _dense_entries(
            (*time, "timestep_embedder", lin), f"time_embed.emb.timestep_embedder.{lin}"
        )
        entries |= _dense_entries(("caption_projection", lin), f"caption_projection.{lin}")
    entries |= _dense_entries((*time, "linear"), "time_embed.linear")
    for i in range(config.num_layers):
        entries |= _block_entries(i, config)
    entries |= _dense_entries(("proj_out",), "proj_out")
    return entries


def _dummy_inputs(config: LTXVideoTransformerConfig, batch: int = 1):
    """Smallest valid input shapes (one token, one caption token; the position given as
    ``video_coords`` since the loaders pass arrays only) for init / eval_shape."""
    f32 = jnp.float32
    tokens = jax.ShapeDtypeStruct((batch, 1, config.in_channels), f32)
    text = jax.ShapeDtypeStruct((batch, 1, config.caption_channels), f32)
    timestep = jax.ShapeDtypeStruct((batch,), f32)
    coords = jax.ShapeDtypeStruct((batch, 3, 1), f32)
    # positional: hidden_states, encoder_hidden_states, timestep, encoder_attention_mask,
    # num_frames, height, width, rope_interpolation_scale, video_coords
    return tokens, text, timestep, None, None, None, None, None, coords


# build / load / init / shape / count: one definition for every model (jaxcore.weights.ModelKind)
KIND = weights.ModelKind(
    LTXVideoTransformer,
    LTXVideoTransformerConfig,
    _dummy_inputs,
    lambda config, boxed: weight_map(config),
)
abstract_params = KIND.abstract_params
load_ltx_transformer = KIND.load  # a diffusers LTXVideoTransformer3DModel directory
init_ltx_transformer = KIND.init
count_params = KIND.count_params


def flops_per_forward(
    config: LTXVideoTransformerConfig, batch: int, video_tokens: int, text_tokens: int
) -> int:
    """Matmul FLOPs of one forward pass of the blocks (the :mod:`wan_transformer` formula with
    the FFN at 4 D), for MFU. Per block, with D the width, s video and L text tokens:
    self-attention QKV 3*2*s*D^2 and scores + values 2*2*s^2*D; cross-attention Q 2*s*D^2,
    K/V 2*2*L*D^2, scores + values 2*2*s*L*D; both output projections 2*2*s*D^2; FFN
    2*2*s*D*4D. Embeddings and the output head are left out. Training = 3x this."""
    d, s, t = config.hidden_dim, video_tokens, text_tokens
    self_attn = 3 * 2 * s * d * d + 2 * 2 * s * s * d
    cross_attn = 2 * s * d * d + 2 * 2 * t * d * d + 2 * 2 * s * t * d
    out_proj = 2 * 2 * s * d * d
    ffn = 2 * 2 * s * d * config.mlp_dim
    return batch * config.num_layers * (self_attn + cross_attn + out_proj + ffn)
