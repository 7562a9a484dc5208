"""Flux.1 text-to-image transformer (MMDiT) in Flax linen.

Reference: diffusers ``FluxTransformer2DModel`` (diffusers/models/transformers/transformer_flux.py,
diffusers 0.42) and the latent layout of ``FluxPipeline`` (pipelines/flux/pipeline_flux.py).
Same function, same parameters (loaded from a diffusers checkpoint through :func:`weight_map`),
written as JAX code:

- tokens: the pipeline packs each 2x2 patch of the VAE latent into one token of 4*C channels
  (:func:`pack_latents`); every token carries position ids (:func:`latent_image_ids`: channel 1 =
  row, 2 = column; text tokens get their own ids, zeros in FluxPipeline),
- conditioning: sinusoidal timestep embedding (x1000, cos first) -> MLP, plus a guidance
  embedding (guidance-distilled "dev" models), plus an MLP of the pooled CLIP text embedding,
- RoPE over the concatenated [text; image] ids, the head dim split over ``axes_dims_rope``
  (``FluxPosEmbed``; the tables are float64 on the host rounded to float32, as diffusers),
- double-stream blocks: text and image keep separate weights (AdaLN-Zero modulation, q/k/v
  projections, per-head RMS q/k norms, output projections, GELU-tanh FFNs) and attend jointly
  over the concatenated sequence,
- single-stream blocks on the joint sequence: one modulated LayerNorm feeds both attention and a
  GELU-tanh MLP, whose outputs are concatenated and projected together (``proj_out``),
- output: LayerNorm modulated by the conditioning (``AdaLayerNormContinuous``: scale first,
  then shift), ``proj_out``.

Tokens are ``[B, L, D]``; the joint sequence is text first, then image, as diffusers orders it.
The time / guidance / pooled-text path and every modulation run in float32; residual adds happen
in float32 and are cast to the activation dtype.

Single-stream MLP layout. diffusers' ``proj_mlp`` [4D, D] and ``proj_out`` [D, 5D] act on an MLP
hidden of 4D channels and on ``cat([attention, mlp])``. Here the hidden is kept as 4 chunks of D
(``proj_mlp`` kernel [D, 4, D], ``proj_out`` kernel [5, D, D] whose chunk 0 takes the attention
output), so the tensor axis splits every chunk the same way it splits the attention heads: both
projections are plain column / row parallel with no reshuffle of the concatenation (diffusers
needs a "packed rowwise" plan for the same reason). :func:`weight_map` reshapes on load/export.

Only ``patch_size=1`` is implemented (every released Flux.1 checkpoint): diffusers' module with
``patch_size=p>1`` still embeds ``in_channels`` per token but emits ``p*p*out_channels`` with no
unpatchify, which FluxPipeline cannot use. IP-adapter inputs are not implemented; ControlNet
residuals (``controlnet_block_samples`` / ``controlnet_single_block_samples``, from
:mod:`jaxcore.models.flux_controlnet`) are added after the blocks as diffusers adds them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
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
    RMSNorm,
    apply_rope,
    dense,
    dense_general,
    gated_add,
    gelu_tanh,
    layer_norm,
    mlp_is_split,
    scale_shift,
    timestep_embedding,
)
from jaxcore.quantization import as_dtype, reshape_kernel

Dtype = Any

TIMESTEP_CHANNELS = 256  # diffusers Timesteps(num_channels=256) in the conditioning embedder
TIME_SCALE = 1000.0  # FluxPipeline passes sigma in [0, 1]; the model embeds sigma * 1000
ROPE_THETA = 10000.0
MLP_RATIO = 4  # FluxSingleTransformerBlock / FeedForward hidden = 4 * D
NORM_EPS = 1e-6  # every LayerNorm and the q/k RMS norms of Flux use 1e-6

# ----------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------


class FluxConfigError(ValueError):
    """A config.json / YAML section FluxTransformerConfig cannot represent; names the key."""


@dataclasses.dataclass(frozen=True)
class FluxTransformerConfig:
    """Architecture of a Flux.1 transformer; field names follow diffusers' config.json.

    ``out_channels=None`` means ``in_channels`` (diffusers: ``out_channels or in_channels``); it is
    resolved at construction, so ``to_dict`` writes the number.
    """

    patch_size: int = 1
    in_channels: int = 64
    out_channels: int | None = None
    num_layers: int = 19
    num_single_layers: int = 38
    attention_head_dim: int = 128
    num_attention_heads: int = 24
    joint_attention_dim: int = 4096
    pooled_projection_dim: int = 768
    guidance_embeds: bool = False
    axes_dims_rope: tuple[int, ...] = (16, 56, 56)

    def __post_init__(self):
        object.__setattr__(self, "axes_dims_rope", tuple(int(d) for d in self.axes_dims_rope))
        if not self.out_channels:
            object.__setattr__(self, "out_channels", self.in_channels)
        if self.patch_size != 1:
            raise FluxConfigError(
                f"patch_size={self.patch_size!r} is not supported, only 1. diffusers' "
                "FluxTransformer2DModel does not patchify for patch_size>1 (x_embedder still takes "
                "in_channels per token; proj_out just widens to patch_size**2 * out_channels); "
                "Flux packs 2x2 latent patches in the pipeline instead (pack_latents)."
            )
        for key in (
            "in_channels",
            "out_channels",
            "attention_head_dim",
            "num_attention_heads",
            "joint_attention_dim",
            "pooled_projection_dim",
        ):
            if int(getattr(self, key)) < 1:
                raise FluxConfigError(f"{key} must be >= 1, got {getattr(self, key)!r}")
        for key in ("num_layers", "num_single_layers"):
            if int(getattr(self, key)) < 0:
                raise FluxConfigError(f"{key} must be >= 0, got {getattr(self, key)!r}")
        axes = self.axes_dims_rope
        if not axes or any(d < 2 or d % 2 for d in axes):
            raise FluxConfigError(
                f"axes_dims_rope={list(axes)}: each axis needs a positive even number of dims "
                "(rotary pairs)"
            )
        if sum(axes) != self.attention_head_dim:
            raise FluxConfigError(
                f"axes_dims_rope={list(axes)} sums to {sum(axes)} but attention_head_dim="
                f"{self.attention_head_dim}; RoPE must cover the whole head dim"
            )

    @property
    def hidden_dim(self) -> int:
        """Model width D = heads x head dim (diffusers' ``inner_dim``)."""
        return self.num_attention_heads * self.attention_head_dim

    @property
    def mlp_dim(self) -> int:
        return MLP_RATIO * self.hidden_dim

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> FluxTransformerConfig:
        """Build from a diffusers config.json dict (``_``-prefixed keys ignored)."""
        return cls(**config_json_kwargs(cls, d, FluxConfigError))

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["axes_dims_rope"] = list(self.axes_dims_rope)
        return d


# ----------------------------------------------------------------------------------------------
# Pure helpers: latent packing, position ids, rotary tables, time embedding
# ----------------------------------------------------------------------------------------------


def _check_even_latent(height: int, width: int) -> None:
    if height % 2 or width % 2:
        raise ValueError(
            f"latent height and width must be even (2x2 packing), got {height} x {width}"
        )


def pack_latents(latents_bchw: jax.Array) -> jax.Array:
    """[B, C, H, W] -> [B, (H/2)*(W/2), 4C]: each 2x2 patch becomes one token, channel-major
    within the token (c, dy, dx), tokens in row-major order (FluxPipeline._pack_latents)."""
    if latents_bchw.ndim != 4:
        raise ValueError(f"latents must be [B, C, H, W], got shape {latents_bchw.shape}")
    b, c, h, w = latents_bchw.shape
    _check_even_latent(h, w)
    x = latents_bchw.reshape(b, c, h // 2, 2, w // 2, 2).transpose(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), 4 * c)


def unpack_latents(tokens_blc: jax.Array, latent_height: int, latent_width: int) -> jax.Array:
    """Inverse of :func:`pack_latents`: [B, (H/2)*(W/2), 4C] -> [B, C, H, W].

    FluxPipeline._unpack_latents takes the *pixel* size and the VAE scale factor; this takes the
    latent size ``H = 2 * (pixel_height // (2 * vae_scale_factor))`` directly.
    """
    _check_even_latent(latent_height, latent_width)
    if tokens_blc.ndim != 3:
        raise ValueError(f"tokens must be [B, L, 4C], got shape {tokens_blc.shape}")
    b, length, channels = tokens_blc.shape
    hp, wp = latent_height // 2, latent_width // 2
    if length != hp * wp or channels % 4:
        raise ValueError(
            f"tokens {tokens_blc.shape} do not unpack to a {latent_height} x {latent_width} latent "
            f"(need L = {hp * wp} and channels divisible by 4)"
        )
    x = tokens_blc.reshape(b, hp, wp, channels // 4, 2, 2).transpose(0, 3, 1, 4, 2, 5)
    return x.reshape(b, channels // 4, latent_height, latent_width)


def latent_image_ids(latent_height: int, latent_width: int) -> np.ndarray:
    """Position ids [(H/2)*(W/2), 3] float32 of the packed image tokens: channel 0 = 0,
    1 = token row, 2 = token column (FluxPipeline._prepare_latent_image_ids at H/2, W/2).

    A numpy array on purpose: concrete ids give bit-exact RoPE tables (see :func:`rope_cos_sin`).
    """
    _check_even_latent(latent_height, latent_width)
    hp, wp = latent_height // 2, latent_width // 2
    ids = np.zeros((hp, wp, 3), np.float32)
    ids[..., 1] = np.arange(hp, dtype=np.float32)[:, None]
    ids[..., 2] = np.arange(wp, dtype=np.float32)[None, :]
    return ids.reshape(hp * wp, 3)


def rope_inv_freq(dim: int, theta: float = ROPE_THETA) -> np.ndarray:
    """theta^(-2i/dim) for i < dim/2, float64 (diffusers get_1d_rotary_pos_embed, Flux dtype)."""
    return 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)


def _rope_host(ids: np.ndarray, axes_dims: Sequence[int], theta: float):
    """Exact tables for concrete ids: float64 angles of the float32 ids, rounded to float32.

    Each axis has few distinct positions (rows, columns, zeros for text), so only a small
    [distinct, dim/2] table per axis and an int32 index per token become graph constants.
    """
    pos = ids.astype(np.float32).astype(np.float64)  # diffusers: ids.float(), then float64 math
    cos_parts, sin_parts = [], []
    for axis, dim in enumerate(axes_dims):
        values, index = np.unique(pos[:, axis], return_inverse=True)
        angles = np.outer(values, rope_inv_freq(dim, theta))
        index = jnp.asarray(index.reshape(-1).astype(np.int32))
        cos_parts.append(jnp.take(jnp.asarray(np.cos(angles).astype(np.float32)), index, axis=0))
        sin_parts.append(jnp.take(jnp.asarray(np.sin(angles).astype(np.float32)), index, axis=0))
    return jnp.concatenate(cos_parts, axis=-1), jnp.concatenate(sin_parts, axis=-1)


_HI_MASK = 0xFFFFF000  # keep sign, exponent and the top 11 of 23 mantissa bits


def _split_hi(x: jax.Array) -> jax.Array:
    """x truncated to 12 significant bits: a product of two such values is exact in float32."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    return jax.lax.bitcast_convert_type(bits & jnp.uint32(_HI_MASK), jnp.float32)


def _split_hi_host(x: np.ndarray) -> np.ndarray:
    """:func:`_split_hi` for host constants."""
    return (x.astype(np.float32).view(np.uint32) & np.uint32(_HI_MASK)).view(np.float32)


def _rope_traced(ids: jax.Array, axes_dims: Sequence[int], theta: float):
    """In-graph tables for traced ids, without float64.

    A float32 ``pos * freq`` is off by half an ulp of an angle that reaches ~100 rad (5e-6 in
    cos). Instead both factors are split into a 12-bit head and a tail: ``a_hi = pos_hi *
    freq_hi`` is exact, the small rest ``a_lo`` is accurate, and ``cos(a_hi + a_lo)`` comes from
    the angle-addition formula: ~1 float32 ulp from diffusers' tables for any ids.
    """
    pos = ids.astype(jnp.float32)
    pos_hi = _split_hi(pos)
    pos_lo = pos - pos_hi  # exact: the bits that _split_hi dropped
    cos_parts, sin_parts = [], []
    for axis, dim in enumerate(axes_dims):
        freq64 = rope_inv_freq(dim, theta)
        freq = freq64.astype(np.float32)
        freq_hi = _split_hi_host(freq)
        freq_lo = (freq64 - freq_hi.astype(np.float64)).astype(np.float32)
        p_hi, p_lo = pos_hi[:, axis, None], pos_lo[:, axis, None]
        a_hi = p_hi * freq_hi
        a_lo = p_hi * freq_lo + p_lo * freq
        cos_hi, sin_hi, cos_lo, sin_lo = jnp.cos(a_hi), jnp.sin(a_hi), jnp.cos(a_lo), jnp.sin(a_lo)
        cos_parts.append(cos_hi * cos_lo - sin_hi * sin_lo)
        sin_parts.append(sin_hi * cos_lo + cos_hi * sin_lo)
    return jnp.concatenate(cos_parts, axis=-1), jnp.concatenate(sin_parts, axis=-1)


def rope_cos_sin(
    ids: jax.Array | np.ndarray, axes_dims: Sequence[int], theta: float = ROPE_THETA
) -> tuple[jax.Array, jax.Array]:
    """cos/sin tables [L, sum(axes_dims)/2] float32 for position ids [L, len(axes_dims)].

    Pair (2i, 2i+1) of the head dim rotates by one angle; the first ``axes_dims[0]/2`` pairs
    follow id channel 0, the next ``axes_dims[1]/2`` channel 1, ... (diffusers FluxPosEmbed,
    which repeats each value for both members of a pair). Concrete ids (numpy, or jax arrays
    outside a trace: pass them closed over / as constants) give tables bit-identical to
    diffusers'; traced ids are computed in the graph to ~1 float32 ulp.
    """
    if isinstance(ids, jax.core.Tracer):
        return _rope_traced(ids, axes_dims, theta)
    return _rope_host(np.asarray(ids), axes_dims, theta)


# ----------------------------------------------------------------------------------------------
# Layers
# ----------------------------------------------------------------------------------------------

_IMAGE_EMBED = ("activation_batch", "activation_length", "activation_embed")
_TEXT_EMBED = ("activation_batch", "activation_kv_length", "activation_embed")
_IMAGE_HEADS = ("activation_batch", "activation_length", "activation_heads", "activation_kv")
_TEXT_HEADS = ("activation_batch", "activation_kv_length", "activation_heads", "activation_kv")
_MLP_CHUNKS = ("activation_batch", "activation_length", None, "activation_mlp")


def _modulate(x_bld: jax.Array, shift_bd: jax.Array, scale_bd: jax.Array, dtype: Dtype):
    """LayerNorm(x) * (1 + scale) + shift with per-sample [B, D] modulation, float32 inside."""
    out = scale_shift(layer_norm(x_bld, NORM_EPS), scale_bd[:, None, :], shift_bd[:, None, :])
    return out.astype(dtype)


def _gated_residual(x_bld: jax.Array, h_bld: jax.Array, gate_bd: jax.Array, axes) -> jax.Array:
    """x + gate * h, added in float32 and cast back to x's dtype."""
    out = gated_add(x_bld, h_bld, gate_bd[:, None, :])
    return sharding.constrain(out.astype(x_bld.dtype), axes)


class Modulation(nn.Module):
    """SiLU -> Linear(D, n*D) of the conditioning, split into n [B, D] rows, float32.

    The projection half of diffusers' AdaLayerNormZero (n=6), AdaLayerNormZeroSingle (n=3) and
    AdaLayerNormContinuous (n=2); the param is ``<norm>/linear`` as there.
    """

    rows: int
    dim: int
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, temb_bd: jax.Array) -> list[jax.Array]:
        proj = dense(
            self.rows * self.dim, ("embed", "modulation"), "linear", jnp.float32, self.param_dtype
        )
        out = proj(nn.silu(temb_bd.astype(jnp.float32)))
        return jnp.split(out, self.rows, axis=-1)  # torch .chunk(rows, dim=1)


class ConditionEmbedder(nn.Module):
    """(timestep, guidance, pooled text) -> conditioning [B, D] in float32.

    diffusers CombinedTimestep(Guidance)TextProjEmbeddings: SiLU MLPs of the 256-channel
    sinusoidal embeddings of ``timestep * 1000`` (and ``guidance * 1000``) plus a SiLU MLP of the
    pooled projection, summed in that order.
    """

    config: FluxTransformerConfig
    param_dtype: Dtype = jnp.float32

    def _mlp(self, name: str) -> MLP2:
        dim = self.config.hidden_dim
        return MLP2(
            dim,
            dim,
            nn.silu,
            (None, "embed"),
            ("embed", None),
            dtype=jnp.float32,
            param_dtype=self.param_dtype,
            name=name,
        )

    @nn.compact
    def __call__(self, timestep_b, guidance_b, pooled_bp):
        def embed(t):
            return timestep_embedding(t.astype(jnp.float32) * TIME_SCALE, TIMESTEP_CHANNELS)

        temb = self._mlp("timestep_embedder")(embed(timestep_b))
        if self.config.guidance_embeds:
            temb = temb + self._mlp("guidance_embedder")(embed(guidance_b))
        return temb + self._mlp("text_embedder")(pooled_bp.astype(jnp.float32))


class FluxAttention(nn.Module):
    """Multi-head attention with per-head RMS q/k norms and RoPE (diffusers FluxAttention).

    ``__call__(x, rope)`` is the single-stream form: self-attention over x, returning the heads
    flattened to [B, L, D] without an output projection (diffusers ``pre_only``). ``__call__(x,
    rope, context)`` is the double-stream form: the text ``context`` gets its own projections
    (``add_*_proj``, ``norm_added_*``), attention runs over [context; x] and each stream gets its
    own output projection; returns (x_out, context_out).
    """

    config: FluxTransformerConfig
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    attention: str = "dot_product"
    mesh: Any = None

    def _qkv(self, x_bld, names: tuple[str, str, str, str, str], axes):
        cfg = self.config
        heads, head_dim = cfg.num_attention_heads, cfg.attention_head_dim
        q_name, k_name, v_name, qn_name, kn_name = names

        def project(name):
            layer = dense(cfg.hidden_dim, ("embed", "heads"), name, self.dtype, self.param_dtype)
            out = layer(x_bld)
            return sharding.constrain(out.reshape(*out.shape[:2], heads, head_dim), axes)

        q, k, v = project(q_name), project(k_name), project(v_name)
        return self._rms_norm(qn_name)(q), self._rms_norm(kn_name)(k), v

    def _rms_norm(self, name: str) -> RMSNorm:
        return RMSNorm(NORM_EPS, self.dtype, self.param_dtype, name=name)

    def _out(self, name: str, x_blhd, heads_axes, embed_axes):
        dim = self.config.hidden_dim
        x = sharding.constrain(x_blhd, heads_axes).reshape(*x_blhd.shape[:2], dim)
        out = dense(dim, ("heads", "embed"), name, self.dtype, self.param_dtype)(x)
        return sharding.constrain(out, embed_axes)

    @nn.compact
    def __call__(self, x_bld, rope, context_btd=None):
        q, k, v = self._qkv(x_bld, ("to_q", "to_k", "to_v", "norm_q", "norm_k"), _IMAGE_HEADS)
        if context_btd is not None:
            names = ("add_q_proj", "add_k_proj", "add_v_proj", "norm_added_q", "norm_added_k")
            cq, ck, cv = self._qkv(context_btd, names, _TEXT_HEADS)
            q, k, v = (
                sharding.constrain(jnp.concatenate([c, i], axis=1), _IMAGE_HEADS)
                for c, i in ((cq, q), (ck, k), (cv, v))
            )
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        out = attention_fn(q, k, v, backend=self.attention, mesh=self.mesh)
        out = sharding.constrain(out, _IMAGE_HEADS)
        if context_btd is None:
            return out.reshape(*out.shape[:2], self.config.hidden_dim)
        text_len = context_btd.shape[1]
        image_out = self._out("to_out", out[:, text_len:], _IMAGE_HEADS, _IMAGE_EMBED)
        text_out = self._out("to_add_out", out[:, :text_len], _TEXT_HEADS, _TEXT_EMBED)
        return image_out, text_out


class FeedForward(nn.Module):
    """Linear(D, 4D) -> GELU(tanh) -> Linear(4D, D) (diffusers FeedForward "gelu-approximate")."""

    config: FluxTransformerConfig
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    length_axis: str = "activation_length"

    @nn.compact
    def __call__(self, x_bld):
        cfg = self.config
        up = dense(cfg.mlp_dim, ("embed", "mlp"), "proj_in", self.dtype, self.param_dtype)
        h = sharding.constrain(
            gelu_tanh(up(x_bld)), ("activation_batch", self.length_axis, "activation_mlp")
        )
        out = dense(cfg.hidden_dim, ("mlp", "embed"), "proj_out", self.dtype, self.param_dtype)(h)
        return sharding.constrain(out, ("activation_batch", self.length_axis, "activation_embed"))


class DoubleStreamBlock(nn.Module):
    """diffusers FluxTransformerBlock: separate text / image weights, joint attention."""

    config: FluxTransformerConfig
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    attention: str = "dot_product"
    mesh: Any = None

    @nn.compact
    def __call__(self, x_bld, context_btd, temb_bd, rope_cos, rope_sin):
        cfg, dim = self.config, self.config.hidden_dim
        # what an offloading remat policy keeps
        x_bld, context_btd = (
            checkpoint_name(x_bld, BLOCK_INPUT),
            checkpoint_name(context_btd, BLOCK_INPUT),
        )
        shift, scale, gate, shift_ff, scale_ff, gate_ff = Modulation(
            6, dim, self.param_dtype, name="norm1"
        )(temb_bd)
        c_shift, c_scale, c_gate, c_shift_ff, c_scale_ff, c_gate_ff = Modulation(
            6, dim, self.param_dtype, name="norm1_context"
        )(temb_bd)

        attn = FluxAttention(
            cfg, self.dtype, self.param_dtype, self.attention, self.mesh, name="attn"
        )
        x_attn, c_attn = attn(
            _modulate(x_bld, shift, scale, self.dtype),
            (rope_cos, rope_sin),
            _modulate(context_btd, c_shift, c_scale, self.dtype),
        )

        x_bld = _gated_residual(x_bld, x_attn, gate, _IMAGE_EMBED)
        ff = FeedForward(cfg, self.dtype, self.param_dtype, name="ff")
        x_bld = _gated_residual(
            x_bld, ff(_modulate(x_bld, shift_ff, scale_ff, self.dtype)), gate_ff, _IMAGE_EMBED
        )

        context_btd = _gated_residual(context_btd, c_attn, c_gate, _TEXT_EMBED)
        ff_context = FeedForward(
            cfg, self.dtype, self.param_dtype, "activation_kv_length", name="ff_context"
        )
        h = ff_context(_modulate(context_btd, c_shift_ff, c_scale_ff, self.dtype))
        context_btd = _gated_residual(context_btd, h, c_gate_ff, _TEXT_EMBED)
        return x_bld, context_btd


class ChunkedMLPIn(nn.Module):
    """Single-stream ``proj_mlp``: [B, L, D] -> [B, L, 4, D] (diffusers' 4D hidden in 4 chunks).

    Kernel [D, 4, D] with the chunk width split like the attention heads (``mlp``).
    """

    dim: int
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x_bld):
        init = nn.initializers.xavier_uniform(in_axis=0, out_axis=(1, 2))
        kernel = self.param(
            "kernel",
            nn.with_logical_partitioning(init, ("embed", None, "mlp")),
            (self.dim, MLP_RATIO, self.dim),
            self.param_dtype,
        )
        bias = self.param(
            "bias",
            nn.with_logical_partitioning(nn.initializers.zeros_init(), (None, "mlp")),
            (MLP_RATIO, self.dim),
            self.param_dtype,
        )
        x, kernel, bias = (as_dtype(a, self.dtype) for a in (x_bld, kernel, bias))
        return dense_general(x, kernel, bias)  # [B, L, 4, D]


class PackedProjOut(nn.Module):
    """Single-stream ``proj_out``: [B, L, 5, D] (attention, then 4 MLP chunks), or the same
    flat as [B, L, 5D], -> [B, L, D].

    Kernel [5, D, D]: row-parallel over each chunk's width, like an attention output projection.
    """

    dim: int
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x_blkm):
        init = nn.initializers.xavier_uniform(in_axis=(0, 1), out_axis=2)
        kernel = self.param(
            "kernel",
            nn.with_logical_partitioning(init, (None, "mlp", "embed")),
            (1 + MLP_RATIO, self.dim, self.dim),
            self.param_dtype,
        )
        bias = self.param(
            "bias",
            nn.with_logical_partitioning(nn.initializers.zeros_init(), ("embed",)),
            (self.dim,),
            self.param_dtype,
        )
        x, kernel, bias = (as_dtype(a, self.dtype) for a in (x_blkm, kernel, bias))
        if x.ndim == 3:  # [B, L, 5D]: the chunks side by side (SingleStreamBlock)
            out = dense_general(x, reshape_kernel(kernel, (-1, self.dim)), bias)
        else:
            out = dense_general(x, kernel, bias, in_dims=2)
        return sharding.constrain(out, _IMAGE_EMBED)


class SingleStreamBlock(nn.Module):
    """diffusers FluxSingleTransformerBlock on the joint [text; image] sequence.

    ``x + gate * proj_out(cat([attn(n), gelu(proj_mlp(n))]))`` with ``n`` the modulated
    LayerNorm of x. The MLP hidden is kept as [B, L, 4, D]; the attention output joins it as
    chunk 0 of [B, L, 5, D] (see the module docstring).
    """

    config: FluxTransformerConfig
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    attention: str = "dot_product"
    mesh: Any = None

    @nn.compact
    def __call__(self, x_bnd, temb_bd, rope_cos, rope_sin):
        cfg, dim = self.config, self.config.hidden_dim
        x_bnd = checkpoint_name(x_bnd, BLOCK_INPUT)  # what an offloading remat policy keeps
        shift, scale, gate = Modulation(3, dim, self.param_dtype, name="norm")(temb_bd)
        h = _modulate(x_bnd, shift, scale, self.dtype)
        mlp = ChunkedMLPIn(dim, self.dtype, self.param_dtype, name="proj_mlp")(h)
        mlp = sharding.constrain(gelu_tanh(mlp), _MLP_CHUNKS)
        attn = FluxAttention(
            cfg, self.dtype, self.param_dtype, self.attention, self.mesh, name="attn"
        )(h, (rope_cos, rope_sin))
        if mlp_is_split():  # chunk by chunk, each split over the tensor axis as the heads are
            joined = sharding.constrain(
                jnp.concatenate([attn[:, :, None, :], mlp], axis=2), _MLP_CHUNKS
            )
        else:  # [B, L, 5D]: a [B, L, 5, D] pads its 5 to the TPU's tile of 8, and XLA then
            # made proj_out a convolution over a relaid copy of every block's kernel, held for
            # the whole loop (3.3 GiB a chip, Flux schnell on a v6e-4)
            joined = jnp.concatenate([attn, mlp.reshape(*mlp.shape[:-2], -1)], axis=-1)
        out = PackedProjOut(dim, self.dtype, self.param_dtype, name="proj_out")(joined)
        return _gated_residual(x_bnd, out, gate, _IMAGE_EMBED)


def check_inputs(
    cfg: FluxTransformerConfig, hidden, text, pooled, timestep, img_ids, txt_ids, guidance
):
    """Shape checks of the transformer inputs (shared with the ControlNet); errors name the
    argument and the shape it must have."""
    if hidden.ndim != 3 or hidden.shape[2] != cfg.in_channels:
        raise ValueError(
            f"hidden_states must be [B, L_img, in_channels={cfg.in_channels}], got {hidden.shape}"
        )
    batch, image_len = hidden.shape[:2]
    if text.ndim != 3 or (text.shape[0], text.shape[2]) != (batch, cfg.joint_attention_dim):
        raise ValueError(
            f"encoder_hidden_states must be [{batch}, L_txt, joint_attention_dim="
            f"{cfg.joint_attention_dim}], got {text.shape}"
        )
    if pooled.shape != (batch, cfg.pooled_projection_dim):
        raise ValueError(
            f"pooled_projections must be [{batch}, pooled_projection_dim="
            f"{cfg.pooled_projection_dim}], got {pooled.shape}"
        )
    if timestep.shape != (batch,):
        raise ValueError(f"timestep must be [B]=[{batch}], got shape {timestep.shape}")
    n_axes = len(cfg.axes_dims_rope)
    for name, ids, length in (
        ("img_ids", img_ids, image_len),
        ("txt_ids", txt_ids, text.shape[1]),
    ):
        if tuple(ids.shape) != (length, n_axes):
            raise ValueError(
                f"{name} must be [{length}, {n_axes}] (one id row per token, no batch dim), "
                f"got shape {tuple(ids.shape)}"
            )
    if cfg.guidance_embeds and guidance is None:
        raise ValueError(
            "guidance is required: this model has guidance_embeds=True (a guidance-distilled "
            "FLUX.1-dev-like model); pass the guidance scale per sample, e.g. [3.5] * B"
        )
    if not cfg.guidance_embeds and guidance is not None:
        raise ValueError(
            "guidance was given but this model has guidance_embeds=False (FLUX.1-schnell-like) "
            "and has no guidance embedder; pass guidance=None"
        )
    if guidance is not None and guidance.shape != (batch,):
        raise ValueError(f"guidance must be [B]=[{batch}], got shape {guidance.shape}")


def joint_rope(txt_ids, img_ids, axes_dims: Sequence[int]) -> tuple[jax.Array, jax.Array]:
    """RoPE tables for the joint [text; image] sequence; concrete ids stay on the host (exact
    tables, :func:`rope_cos_sin`)."""
    concrete = not any(isinstance(i, jax.core.Tracer) for i in (img_ids, txt_ids))
    cat = np.concatenate if concrete else jnp.concatenate
    to_array = np.asarray if concrete else jnp.asarray
    ids = cat([to_array(txt_ids, np.float32), to_array(img_ids, np.float32)], axis=0)
    return tuple(
        sharding.constrain(t, ("activation_length", "activation_kv"))
        for t in rope_cos_sin(ids, axes_dims)
    )


def control_sample_index(num_blocks: int, num_samples: int, repeat: bool = False) -> list[int]:
    """Which of ``num_samples`` ControlNet residuals each of ``num_blocks`` blocks adds.

    diffusers: block i takes sample ``i // ceil(num_blocks / num_samples)`` (a shallow ControlNet
    spreads each sample over consecutive blocks), or ``i % num_samples`` with
    ``controlnet_blocks_repeat`` (XLabs ControlNets cycle theirs)."""
    if num_samples < 1:
        raise ValueError("ControlNet residuals must hold at least one sample (or be None)")
    if repeat:
        return [i % num_samples for i in range(num_blocks)]
    interval = math.ceil(num_blocks / num_samples)
    return [i // interval for i in range(num_blocks)]


def _check_control_samples(name: str, samples, shape_bld: tuple[int, ...]) -> tuple:
    """``samples`` as a tuple, each checked to be shaped like the image stream."""
    samples = tuple(samples)
    for i, sample in enumerate(samples):
        if tuple(sample.shape) != tuple(shape_bld):
            raise ValueError(
                f"{name}[{i}] must be [B, L_img, D]={list(shape_bld)} (the image stream), got "
                f"shape {tuple(sample.shape)}"
            )
    return samples


def control_residuals(
    cfg: FluxTransformerConfig, shape_bld, block_samples, single_block_samples, repeat=False
) -> list | None:
    """The ControlNet residual added after each block of the stack (double blocks first), None
    where that block adds none; None when both sample sequences are None. ``repeat`` applies
    to the double blocks only, as in diffusers."""
    if block_samples is None and single_block_samples is None:
        return None
    per_block: list = [None] * (cfg.num_layers + cfg.num_single_layers)
    if block_samples is not None:
        samples = _check_control_samples("controlnet_block_samples", block_samples, shape_bld)
        for i, k in enumerate(control_sample_index(cfg.num_layers, len(samples), repeat)):
            per_block[i] = samples[k]
    if single_block_samples is not None:
        name = "controlnet_single_block_samples"
        samples = _check_control_samples(name, single_block_samples, shape_bld)
        for i, k in enumerate(control_sample_index(cfg.num_single_layers, len(samples))):
            per_block[cfg.num_layers + i] = samples[k]
    return per_block


def _add_to_image(streams, residual_bld):
    """(image + residual, text), added in float32 and cast to the image stream's dtype."""
    img, txt = streams
    if residual_bld is None:
        return img, txt
    out = img.astype(jnp.float32) + residual_bld.astype(jnp.float32)
    return sharding.constrain(out.astype(img.dtype), _IMAGE_EMBED), txt


def with_control_residuals(run_blocks: Callable, residuals: Sequence) -> Callable:
    """``run_blocks(streams, start, stop)`` that adds ``residuals[i]`` to the image stream after
    block i: the blocks between two residuals still run as one ``run_blocks`` call (one scan
    with ``scan_layers``). Single blocks split the joint sequence back into (image, text) after
    every call, so their residual reaches the image tokens alone, as in diffusers."""

    def run(streams, start, stop):
        first = start
        for i in range(start, stop):
            if residuals[i] is not None or i == stop - 1:
                streams = _add_to_image(run_blocks(streams, first, i + 1), residuals[i])
                first = i + 1
        return streams

    return run


class FluxTransformer(nn.Module):
    """Flux.1 transformer (= diffusers FluxTransformer2DModel.forward).

    ``(hidden_states [B, L_img, in_channels], encoder_hidden_states [B, L_txt,
    joint_attention_dim], pooled_projections [B, pooled_projection_dim], timestep [B],
    img_ids [L_img, 3], txt_ids [L_txt, 3], guidance [B] | None) -> [B, L_img, out_channels]``.

    ``timestep`` is what FluxPipeline passes (sigma in [0, 1]) and ``guidance`` the guidance
    scale (e.g. 3.5); both are multiplied by 1000 inside, as diffusers does. ``guidance`` is
    required iff ``config.guidance_embeds``. Ids given as numpy arrays (e.g. from
    :func:`latent_image_ids`) give bit-exact RoPE tables; traced ids work too (:func:`rope_cos_sin`).

    ControlNet: ``controlnet_block_samples`` / ``controlnet_single_block_samples`` are sequences
    of [B, L_img, D] residuals (:class:`~jaxcore.models.flux_controlnet.FluxControlNetModel`'s
    outputs) added to the image stream after the double / single blocks, as diffusers adds them
    (:func:`control_residuals`; ``controlnet_blocks_repeat``: XLabs' cycling). The stack then
    runs in segments ending at each block that takes a residual (:func:`with_control_residuals`):
    with ``scan_layers`` every segment is its own scan, so a residual after every block (the
    usual case) means the layers are in effect unrolled, compiled one scan of length 1 each.
    ``run_stack`` receives the ``run_blocks`` that adds them. Without residuals nothing changes.
    """

    config: FluxTransformerConfig
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    attention: str = "dot_product"
    mesh: Any = None
    remat_policy: str = "none"
    scan_layers: bool = False  # each block kind as one lax.scan (jaxcore.compute.run_blocks)
    # the block groups scan_layers scans (their stacked layout: jaxcore.layer_stack)
    scanned_blocks: ClassVar[tuple[str, ...]] = ("transformer_blocks", "single_transformer_blocks")

    def _check_inputs(self, hidden, text, pooled, timestep, img_ids, txt_ids, guidance):
        check_inputs(self.config, hidden, text, pooled, timestep, img_ids, txt_ids, guidance)

    def _rope(self, img_ids, txt_ids):
        return joint_rope(txt_ids, img_ids, self.config.axes_dims_rope)

    @nn.compact
    def __call__(
        self,
        hidden_states,
        encoder_hidden_states,
        pooled_projections,
        timestep,
        img_ids,
        txt_ids,
        guidance=None,
        run_stack=None,
        controlnet_block_samples=None,
        controlnet_single_block_samples=None,
        controlnet_blocks_repeat: bool = False,
    ):
        """The prediction; with ``run_stack`` (step caching, :mod:`jaxcore.step_cache`),
        ``(prediction, extra)`` where the stack of double then single blocks ran as
        ``run_stack((image, text), run_blocks, num_blocks) -> ((image, text), extra)``;
        ``run_blocks(streams, start, stop)`` runs blocks ``start..stop-1`` of that stack (with
        the ControlNet residuals, if given: see the class docstring)."""
        cfg = self.config
        timestep = jnp.asarray(timestep)
        guidance = None if guidance is None else jnp.asarray(guidance)
        self._check_inputs(
            hidden_states,
            encoder_hidden_states,
            pooled_projections,
            timestep,
            img_ids,
            txt_ids,
            guidance,
        )
        if self.mesh is not None:
            batch = hidden_states.shape[0]
            sharding.check_divisible(self.mesh, batch=batch, heads=cfg.num_attention_heads)
        x, context, temb = self._embed(
            hidden_states, encoder_hidden_states, pooled_projections, timestep, guidance
        )
        rope = self._rope(img_ids, txt_ids)
        run_blocks = self._block_stack(temb, rope, text_len=encoder_hidden_states.shape[1])
        residuals = control_residuals(
            cfg,
            x.shape,
            controlnet_block_samples,
            controlnet_single_block_samples,
            controlnet_blocks_repeat,
        )
        if residuals is not None:
            run_blocks = with_control_residuals(run_blocks, residuals)
        num_blocks = cfg.num_layers + cfg.num_single_layers
        extra = None
        if run_stack is None:
            x, context = run_blocks((x, context), 0, num_blocks)
        else:
            (x, context), extra = run_stack((x, context), run_blocks, num_blocks)
        out = self._project_out(x, temb)
        return out if run_stack is None else (out, extra)

    def _embed(self, hidden_states, encoder_hidden_states, pooled_projections, timestep, guidance):
        """(image stream [B, L_img, D], text stream [B, L_txt, D], conditioning [B, D]): the
        embedders before the blocks."""
        cfg, dim = self.config, self.config.hidden_dim
        x = dense(dim, ("conv_in", "embed"), "x_embedder", self.dtype, self.param_dtype)(
            hidden_states.astype(self.dtype)
        )
        x = sharding.constrain(x, _IMAGE_EMBED)
        temb = ConditionEmbedder(cfg, self.param_dtype, name="time_text_embed")(
            timestep, guidance, pooled_projections
        )
        context = dense(dim, (None, "embed"), "context_embedder", self.dtype, self.param_dtype)(
            encoder_hidden_states.astype(self.dtype)
        )
        context = sharding.constrain(context, _TEXT_EMBED)
        return x, context, temb

    def _blocks(self, block_cls: type[nn.Module], prefix: str, count: int):
        """``count`` blocks named ``prefix_i`` (rematerialised by ``remat_policy``) and, with
        ``scan_layers``, the unbound template :func:`jaxcore.compute.run_blocks` scans."""
        block_cls = remat_block(block_cls, self.remat_policy)
        block_kw = dict(
            config=self.config,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            attention=self.attention,
            mesh=self.mesh,
        )
        blocks = [block_cls(**block_kw, name=f"{prefix}_{i}") for i in range(count)]
        template = block_cls(**block_kw, parent=None) if self.scan_layers else None
        return blocks, template

    def _block_stack(self, temb, rope, text_len: int):
        """``run_blocks(streams, start, stop)``: blocks ``start..stop-1`` of the stack of double
        then single blocks, on ``streams = (image, text)``."""
        cfg = self.config
        doubles, double_template = self._blocks(
            DoubleStreamBlock, "transformer_blocks", cfg.num_layers
        )
        singles, single_template = self._blocks(
            SingleStreamBlock, "single_transformer_blocks", cfg.num_single_layers
        )

        def one_double(block, streams):
            return block(*streams, temb, *rope)

        def one_single(block, joint):
            return block(joint, temb, *rope)

        def run_blocks(streams, start, stop):
            img, txt = compute.run_blocks(
                self, doubles[start:stop], tuple(streams), one_double, double_template
            )
            first, last = max(start, cfg.num_layers), stop
            if first < last:
                # diffusers concatenates and splits in every single block; once around the
                # run is the same (concatenation and slicing are exact)
                joint = sharding.constrain(jnp.concatenate([txt, img], axis=1), _IMAGE_EMBED)
                chosen = singles[first - cfg.num_layers : last - cfg.num_layers]
                joint = compute.run_blocks(self, chosen, joint, one_single, single_template)
                txt = joint[:, :text_len]
                img = sharding.constrain(joint[:, text_len:], _IMAGE_EMBED)
            return img, txt

        return run_blocks

    def _project_out(self, x, temb):
        """The output head: norm_out's modulation, then proj_out to ``out_channels``."""
        cfg = self.config
        scale, shift = Modulation(2, cfg.hidden_dim, self.param_dtype, name="norm_out")(temb)
        x = _modulate(x, shift, scale, self.dtype)
        out = dense(
            cfg.out_channels, ("embed", "conv_out"), "proj_out", self.dtype, self.param_dtype
        )(x)
        return sharding.constrain(out, _IMAGE_EMBED)


# ----------------------------------------------------------------------------------------------
# Weights: diffusers checkpoint <-> flax params
# ----------------------------------------------------------------------------------------------


def _split_last(parts: int) -> Callable[[np.ndarray], np.ndarray]:
    """[..., parts*n] -> [..., parts, n]; an indivisible tensor is passed through unchanged so
    the loader's shape check names the parameter."""

    def split(w: np.ndarray) -> np.ndarray:
        if w.ndim == 0 or w.shape[-1] % parts:
            return w
        return w.reshape(*w.shape[:-1], parts, w.shape[-1] // parts)

    return split


def _merge_last(w: np.ndarray) -> np.ndarray:
    return w.reshape(*w.shape[:-2], w.shape[-2] * w.shape[-1])


# proj_mlp.weight [4D, D] -> kernel [D, 4, D]; proj_mlp.bias [4D] -> [4, D]
_MLP_IN_KERNEL = weights.Invertible(
    lambda w: _split_last(MLP_RATIO)(w.T), lambda k: _merge_last(k).T
)
_MLP_IN_BIAS = weights.Invertible(_split_last(MLP_RATIO), _merge_last)


def _rows_to_chunks(w: np.ndarray) -> np.ndarray:
    """proj_out.weight [D, 5D] -> kernel [5, D, D] (input chunk, chunk row, output)."""
    k = w.T
    if k.ndim != 2 or k.shape[0] % (1 + MLP_RATIO):
        return k
    return k.reshape(1 + MLP_RATIO, k.shape[0] // (1 + MLP_RATIO), k.shape[1])


_PACKED_OUT_KERNEL = weights.Invertible(_rows_to_chunks, lambda k: k.reshape(-1, k.shape[-1]).T)


def dense_entries(flax_prefix: tuple[str, ...], torch_prefix: str) -> dict:
    """Weight-map entries of one ``dense`` layer from a torch ``nn.Linear``."""
    return {
        (*flax_prefix, "kernel"): (f"{torch_prefix}.weight", weights.linear),
        (*flax_prefix, "bias"): (f"{torch_prefix}.bias", weights.identity),
    }


def _norm_entries(flax_prefix: tuple[str, ...], torch_prefix: str, names) -> dict:
    return {
        (*flax_prefix, n, "scale"): (f"{torch_prefix}.{n}.weight", weights.identity) for n in names
    }


def _double_block_entries(i: int) -> dict:
    flax, torch = (f"transformer_blocks_{i}",), f"transformer_blocks.{i}"
    entries: dict = {}
    for norm in ("norm1", "norm1_context"):
        entries |= dense_entries((*flax, norm, "linear"), f"{torch}.{norm}.linear")
    attn, tattn = (*flax, "attn"), f"{torch}.attn"
    for proj in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"):
        entries |= dense_entries((*attn, proj), f"{tattn}.{proj}")
    entries |= dense_entries((*attn, "to_out"), f"{tattn}.to_out.0")
    entries |= _norm_entries(attn, tattn, ("norm_q", "norm_k", "norm_added_q", "norm_added_k"))
    for ff in ("ff", "ff_context"):
        entries |= dense_entries((*flax, ff, "proj_in"), f"{torch}.{ff}.net.0.proj")
        entries |= dense_entries((*flax, ff, "proj_out"), f"{torch}.{ff}.net.2")
    return entries


def _single_block_entries(i: int) -> dict:
    flax, torch = (f"single_transformer_blocks_{i}",), f"single_transformer_blocks.{i}"
    entries = dense_entries((*flax, "norm", "linear"), f"{torch}.norm.linear")
    for proj in ("to_q", "to_k", "to_v"):
        entries |= dense_entries((*flax, "attn", proj), f"{torch}.attn.{proj}")
    entries |= _norm_entries((*flax, "attn"), f"{torch}.attn", ("norm_q", "norm_k"))
    entries[(*flax, "proj_mlp", "kernel")] = (f"{torch}.proj_mlp.weight", _MLP_IN_KERNEL)
    entries[(*flax, "proj_mlp", "bias")] = (f"{torch}.proj_mlp.bias", _MLP_IN_BIAS)
    entries[(*flax, "proj_out", "kernel")] = (f"{torch}.proj_out.weight", _PACKED_OUT_KERNEL)
    entries[(*flax, "proj_out", "bias")] = (f"{torch}.proj_out.bias", weights.identity)
    return entries


def weight_map(config: FluxTransformerConfig) -> dict:
    """{flax param path: (diffusers key, transform)} for every parameter of the model."""
    entries = backbone_weight_entries(config)
    entries |= dense_entries(("norm_out", "linear"), "norm_out.linear")
    entries |= dense_entries(("proj_out",), "proj_out")
    return entries


def backbone_weight_entries(config: FluxTransformerConfig) -> dict:
    """The :func:`weight_map` entries of the embedders and both block stacks: what the Flux
    ControlNet shares with the transformer, under the same names."""
    entries = dense_entries(("x_embedder",), "x_embedder")
    entries |= dense_entries(("context_embedder",), "context_embedder")
    embedders = ["timestep_embedder", "text_embedder"]
    if config.guidance_embeds:
        embedders.append("guidance_embedder")
    for sub in embedders:
        for lin in ("linear_1", "linear_2"):
            entries |= dense_entries(("time_text_embed", sub, lin), f"time_text_embed.{sub}.{lin}")
    for i in range(config.num_layers):
        entries |= _double_block_entries(i)
    for i in range(config.num_single_layers):
        entries |= _single_block_entries(i)
    return entries


def _dummy_inputs(config: FluxTransformerConfig, batch: int = 1) -> tuple:
    """Smallest valid inputs (one image token, one text token) for init / eval_shape."""
    n_axes = len(config.axes_dims_rope)
    f32 = jnp.float32
    return (
        jax.ShapeDtypeStruct((batch, 1, config.in_channels), f32),
        jax.ShapeDtypeStruct((batch, 1, config.joint_attention_dim), f32),
        jax.ShapeDtypeStruct((batch, config.pooled_projection_dim), f32),
        jax.ShapeDtypeStruct((batch,), f32),
        jax.ShapeDtypeStruct((1, n_axes), f32),
        jax.ShapeDtypeStruct((1, n_axes), f32),
        jax.ShapeDtypeStruct((batch,), f32) if config.guidance_embeds else None,
    )


# build / load / init / shape / count: one definition for every model (jaxcore.weights.ModelKind)
KIND = weights.ModelKind(
    FluxTransformer,
    FluxTransformerConfig,
    _dummy_inputs,
    lambda config, boxed: weight_map(config),
)
abstract_params = KIND.abstract_params
load_flux_transformer = KIND.load  # a diffusers FluxTransformer2DModel directory
init_flux_transformer = KIND.init
count_params = KIND.count_params


def flops_per_forward(
    config: FluxTransformerConfig, batch: int, image_tokens: int, text_tokens: int
) -> int:
    """Matmul FLOPs (2 per multiply-add) of one forward pass, for MFU. Training = 3x this.

    With D = hidden dim, s image tokens, t text tokens, n = s + t:

    - each double-stream block: q/k/v 3*2*n*D^2 (both streams), scores + values 2*2*n^2*D,
      output projections 2*n*D^2, FFNs 2*2*n*D*4D, i.e. 24*n*D^2 + 4*n^2*D;
    - each single-stream block: q/k/v 3*2*n*D^2, proj_mlp 2*n*D*4D, scores + values
      2*2*n^2*D, proj_out 2*n*5D*D: the same 24*n*D^2 + 4*n^2*D;
    - per token outside the blocks: x_embedder 2*s*C_in*D, context_embedder 2*t*J*D,
      proj_out 2*s*D*C_out;
    - per sample: timestep (and guidance) MLPs 2*(256*D + D^2) each, pooled MLP 2*(P*D + D^2),
      modulations 2*D*6D*2 per double block, 2*D*3D per single block, 2*D*2D at the output.
    """
    d, s, t = config.hidden_dim, image_tokens, text_tokens
    n = s + t
    blocks = (config.num_layers + config.num_single_layers) * (24 * n * d * d + 4 * n * n * d)
    tokens = 2 * d * (s * config.in_channels + t * config.joint_attention_dim)
    tokens += 2 * s * d * config.out_channels
    embedders = 2 * (TIMESTEP_CHANNELS * d + d * d) * (2 if config.guidance_embeds else 1)
    embedders += 2 * (config.pooled_projection_dim * d + d * d)
    modulation = d * d * (24 * config.num_layers + 6 * config.num_single_layers + 4)
    return batch * (blocks + tokens + embedders + modulation)


def joint_attention_flops(
    config: FluxTransformerConfig, batch: int, image_tokens: int, text_tokens: int
) -> int:
    """The joint attention's scores and values of :func:`flops_per_forward` (4*n^2*D a block of
    either kind, n = image + text tokens): the part the splash kernel runs on TPU."""
    n = image_tokens + text_tokens
    return batch * (config.num_layers + config.num_single_layers) * 4 * n * n * config.hidden_dim
