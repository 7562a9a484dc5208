"""Flux.2 transformer (FLUX.2 dev, FLUX.2 Klein 4B / 9B) in Flax linen, with a reference KV cache.

Reference: diffusers ``Flux2Transformer2DModel`` (diffusers/models/transformers/transformer_flux2.py,
diffusers 0.42) and the way ``Flux2KleinPipeline`` / ``Flux2KleinKVPipeline``
(pipelines/flux2/pipeline_flux2_klein{,_kv}.py) call it. Same function and parameters (loaded from
a diffusers checkpoint through :func:`weight_map`). What differs from Flux.1
(:mod:`jaxcore.models.flux_transformer`, whose RoPE tables and attention entry point are reused):

- no biases anywhere, no pooled text embedding: the conditioning is the timestep MLP (plus a
  guidance MLP when ``guidance_embeds``) of the 256-channel sinusoidal embedding of ``t * 1000``,
- modulation is shared by all blocks of a kind: ``double_stream_modulation_img/_txt`` (two sets
  of shift/scale/gate each) and ``single_stream_modulation`` (one set), computed once a forward,
- feed-forwards are SwiGLU (``silu(first half) * second half`` of ``linear_in``) of width
  ``int(D * mlp_ratio)``,
- single blocks fuse q/k/v and the MLP input into one projection (``to_qkv_mlp_proj``) and the
  attention / MLP outputs into one (``to_out``),
- position ids have four axes (t, h, w, l) rotated with ``rope_theta`` (2000), no batch axis
  needed: ``[L, 4]``, or ``[B, L, 4]`` of which sample 0 is used, as diffusers does.

Reference-image KV cache (``Flux2KleinKVPipeline``, diffusers' ``kv_cache_mode``). The KV variant
does *not* simply concatenate reference tokens: in diffusers' "extract" step the sequence is
[text, reference, image], text and image queries attend to every key, reference queries attend
to the reference keys only, and the reference tokens are modulated with the conditioning of a
fixed timestep (``ref_fixed_timestep``, 0) instead of the step's. So every layer's reference
keys/values depend only on the reference tokens, their ids, that fixed timestep and the
guidance, never on the noisy latents or the text: they are computed once
(:meth:`Flux2Transformer.reference_kv`, post-RoPE, one (K, V) per block) and each step's call
takes them (``reference_kv=``), as diffusers' "cached" steps do. ``__call__(...,
reference_tokens=..., reference_ids=...)`` is the uncached equivalent of diffusers' "extract"
call (same output, the cache built inside). The non-KV ``Flux2KleinPipeline`` instead appends
the reference tokens to ``hidden_states`` (``cat([latents, refs])``, ids likewise) with full
attention and the step's timestep, then keeps the first ``L`` outputs: that is the plain call, a
different function whose reference K/V change every step (nothing to cache).

Cached keys/values are appended after the [text; image] keys rather than between them as
diffusers orders them: attention does not depend on the key order (only float summation order).

Tokens are ``[B, L, D]``; time / guidance / modulation math runs in float32, residual adds in
float32 cast to the activation dtype, as in the Flux.1 module.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from jax.ad_checkpoint import checkpoint_name

from jaxcore import compute, sharding, weights
from jaxcore.attention import attention as attention_fn
from jaxcore.compute import BLOCK_INPUT, remat_block
from jaxcore.config import config_json_kwargs
from jaxcore.models.flux_transformer import (
    _IMAGE_EMBED,
    _IMAGE_HEADS,
    _TEXT_EMBED,
    _TEXT_HEADS,
    rope_cos_sin,
)
from jaxcore.models.layers import (
    Dense,
    RMSNorm,
    apply_rope,
    dense_general,
    gated_add,
    layer_norm,
    scale_shift,
    silu,
    timestep_embedding,
)
from jaxcore.quantization import as_dtype

Dtype = Any

TIME_SCALE = 1000.0  # the pipelines pass sigma in [0, 1]; the model embeds sigma * 1000

# ----------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------


class Flux2ConfigError(ValueError):
    """A config.json Flux2TransformerConfig cannot represent; names the key."""


@dataclasses.dataclass(frozen=True)
class Flux2TransformerConfig:
    """Architecture of a Flux.2 transformer; field names and defaults are diffusers'
    ``Flux2Transformer2DModel.__init__`` (the defaults are FLUX.2 dev).

    ``out_channels=None`` means ``in_channels`` (resolved at construction). ``proj_out`` emits
    ``patch_size**2 * out_channels`` per token while ``x_embedder`` takes ``in_channels``, as in
    diffusers (the pipelines patchify the latents themselves and use ``patch_size=1``).
    """

    patch_size: int = 1
    in_channels: int = 128
    out_channels: int | None = None
    num_layers: int = 8
    num_single_layers: int = 48
    attention_head_dim: int = 128
    num_attention_heads: int = 48
    joint_attention_dim: int = 15360
    timestep_guidance_channels: int = 256
    mlp_ratio: float = 3.0
    axes_dims_rope: tuple[int, ...] = (32, 32, 32, 32)
    rope_theta: float = 2000.0
    eps: float = 1e-6
    guidance_embeds: bool = True

    def __post_init__(self):
        """Resolve ``out_channels``; refuse sizes the model cannot be built with, by key."""
        object.__setattr__(self, "axes_dims_rope", tuple(int(d) for d in self.axes_dims_rope))
        if not self.out_channels:
            object.__setattr__(self, "out_channels", self.in_channels)
        for key in (
            "patch_size",
            "in_channels",
            "out_channels",
            "attention_head_dim",
            "num_attention_heads",
            "joint_attention_dim",
            "timestep_guidance_channels",
        ):
            if int(getattr(self, key)) < 1:
                raise Flux2ConfigError(f"{key} must be >= 1, got {getattr(self, key)!r}")
        for key in ("num_layers", "num_single_layers"):
            if int(getattr(self, key)) < 0:
                raise Flux2ConfigError(f"{key} must be >= 0, got {getattr(self, key)!r}")
        if self.mlp_dim < 1:
            raise Flux2ConfigError(f"mlp_ratio={self.mlp_ratio!r} gives no MLP channels")
        axes = self.axes_dims_rope
        if not axes or any(d < 2 or d % 2 for d in axes):
            raise Flux2ConfigError(
                f"axes_dims_rope={list(axes)}: each axis needs a positive even number of dims"
            )
        if sum(axes) != self.attention_head_dim:
            raise Flux2ConfigError(
                f"axes_dims_rope={list(axes)} sums to {sum(axes)} but attention_head_dim="
                f"{self.attention_head_dim}; RoPE must cover the whole head dim"
            )

    @property
    def hidden_dim(self) -> int:
        """Model width D = heads x head dim (diffusers' ``inner_dim``)."""
        return self.num_attention_heads * self.attention_head_dim

    @property
    def mlp_dim(self) -> int:
        """SwiGLU hidden width F (diffusers ``int(dim * mlp_ratio)``)."""
        return int(self.hidden_dim * self.mlp_ratio)

    @property
    def proj_out_dim(self) -> int:
        """Output channels per token, ``patch_size**2 * out_channels``."""
        return self.patch_size * self.patch_size * self.out_channels

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Flux2TransformerConfig:
        """Build from a diffusers config.json dict (``_``-prefixed keys ignored, others checked)."""
        return cls(**config_json_kwargs(cls, d, Flux2ConfigError))

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["axes_dims_rope"] = list(self.axes_dims_rope)
        return d


# ----------------------------------------------------------------------------------------------
# Reference KV cache and small helpers
# ----------------------------------------------------------------------------------------------


class ReferenceKV(NamedTuple):
    """Post-RoPE keys and values of the reference tokens, one ``(k, v)`` pair per block, each
    ``[B_ref, R, heads, head_dim]`` (diffusers ``Flux2KVCache``). ``B_ref`` is the call's batch
    or 1 (one reference set broadcast over the batch). A pytree: pass it through jit."""

    double: tuple[tuple[jax.Array, jax.Array], ...]
    single: tuple[tuple[jax.Array, jax.Array], ...]


def _ids_2d(ids) -> np.ndarray | jax.Array:
    """Ids ``[L, A]`` from ``[L, A]`` or ``[B, L, A]`` (sample 0, as diffusers takes it)."""
    if ids.ndim == 3:
        ids = ids[0]
    if ids.ndim != 2:
        raise ValueError(f"position ids must be [L, A] or [B, L, A], got shape {ids.shape}")
    return ids


def rope_tables(
    config: Flux2TransformerConfig, *named_ids: tuple[str, Any, int]
) -> tuple[jax.Array, jax.Array]:
    """cos/sin ``[sum L, head_dim / 2]`` of the ids ``(name, ids [L, >= A] | [B, L, >= A],
    L)`` in order (diffusers ``Flux2PosEmbed`` of each, concatenated; it reads only the first
    ``A = len(axes_dims_rope)`` id columns). Concrete ids give exact host tables."""
    n_axes, parts = len(config.axes_dims_rope), []
    for name, ids, length in named_ids:
        ids = _ids_2d(ids)
        if ids.shape[0] != length or ids.shape[1] < n_axes:
            raise ValueError(
                f"{name} must be [{length}, >= {n_axes}] (one id row per token; a leading "
                f"batch axis is allowed), got shape {tuple(ids.shape)}"
            )
        parts.append(rope_cos_sin(ids[:, :n_axes], config.axes_dims_rope, config.rope_theta))
    tables = (jnp.concatenate([p[i] for p in parts], axis=0) for i in range(2))
    return tuple(sharding.constrain(t, ("activation_length", "activation_kv")) for t in tables)


def _modulate(x_bld, shift, scale, eps: float, dtype: Dtype):
    """LayerNorm(x) * (1 + scale) + shift; shift/scale [B, 1, D] (or [B, L, D]), float32."""
    return scale_shift(layer_norm(x_bld, eps), scale, shift).astype(dtype)


def _gated_residual(x_bld, h_bld, gate, axes):
    """x + gate * h, added in float32 and cast back to x's dtype."""
    return sharding.constrain(gated_add(x_bld, h_bld, gate).astype(x_bld.dtype), axes)


def swiglu(x_blkf: jax.Array) -> jax.Array:
    """``silu(gate) * value`` of a packed ``[..., 2, F]`` (diffusers ``Flux2SwiGLU`` on the
    halves of its ``[..., 2F]``), the SiLU in float32."""
    return silu(x_blkf[..., 0, :]) * x_blkf[..., 1, :]


def _with_reference(k_blhd, v_blhd, ref_kv):
    """Keys/values with the cached reference ones appended (broadcast over the batch)."""
    if ref_kv is None:
        return k_blhd, v_blhd
    k_ref, v_ref = (jnp.broadcast_to(r, (k_blhd.shape[0], *r.shape[1:])) for r in ref_kv)
    return (
        jnp.concatenate([k_blhd, k_ref.astype(k_blhd.dtype)], axis=1),
        jnp.concatenate([v_blhd, v_ref.astype(v_blhd.dtype)], axis=1),
    )


# ----------------------------------------------------------------------------------------------
# Layers
# ----------------------------------------------------------------------------------------------


def _dense(features: int, axes, name: str | None, dtype: Dtype, param_dtype: Dtype) -> Dense:
    """A bias-free Dense (torch ``Linear(bias=False)``): every Flux.2 projection. ``name=None``
    inside ``setup``, where the attribute names the module."""
    return Dense(features, axes, dtype=dtype, param_dtype=param_dtype, use_bias=False, name=name)


class PackedDense(nn.Module):
    """Bias-free projection ``[..., D] -> [..., *out_shape]`` with the kernel ``[D, *out_shape]``
    kept packed (SwiGLU ``linear_in`` as [D, 2, F]: the F axis split like an MLP width, so gate
    and value halves stay together on each device)."""

    out_shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.xavier_uniform(
            in_axis=0, out_axis=tuple(range(1, 1 + len(self.out_shape)))
        )
        kernel = self.param(
            "kernel",
            nn.with_logical_partitioning(init, self.axes),
            (x.shape[-1], *self.out_shape),
            self.param_dtype,
        )
        bias = jnp.zeros(self.out_shape, self.dtype)
        return dense_general(x.astype(self.dtype), as_dtype(kernel, self.dtype), bias)


class Modulation(nn.Module):
    """SiLU -> bias-free Linear(D, rows*D) of the conditioning, split into ``rows`` float32
    ``[B, 1, D]`` rows: diffusers ``Flux2Modulation`` (rows = 3 per set of shift, scale, gate)
    and the projection of ``AdaLayerNormContinuous`` (rows = 2: scale, shift)."""

    rows: int
    dim: int
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, temb_bd):
        proj = _dense(
            self.rows * self.dim, ("embed", "modulation"), "linear", jnp.float32, self.param_dtype
        )
        out = proj(silu(temb_bd.astype(jnp.float32)))
        return tuple(o[:, None, :] for o in jnp.split(out, self.rows, axis=-1))


class _Mlp2(nn.Module):
    """Bias-free Linear -> SiLU -> Linear in float32 (diffusers ``TimestepEmbedding`` with
    ``sample_proj_bias=False``); params ``linear_1`` / ``linear_2``."""

    dim: int
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        x = _dense(self.dim, (None, "embed"), "linear_1", jnp.float32, self.param_dtype)(x)
        return _dense(self.dim, ("embed", None), "linear_2", jnp.float32, self.param_dtype)(silu(x))


class TimestepGuidanceEmbedder(nn.Module):
    """(timestep, guidance) -> conditioning [B, D], float32 (diffusers
    ``Flux2TimestepGuidanceEmbeddings``: bias-free SiLU MLPs of the sinusoidal embeddings,
    cos first, of ``t * 1000`` and ``g * 1000``, summed)."""

    config: Flux2TransformerConfig
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, timestep_b, guidance_b):
        cfg = self.config

        def embed(t):
            return timestep_embedding(
                jnp.asarray(t).astype(jnp.float32) * TIME_SCALE, cfg.timestep_guidance_channels
            )

        temb = _Mlp2(cfg.hidden_dim, self.param_dtype, name="timestep_embedder")(embed(timestep_b))
        if cfg.guidance_embeds:
            mlp = _Mlp2(cfg.hidden_dim, self.param_dtype, name="guidance_embedder")
            temb = temb + mlp(embed(guidance_b))
        return temb


class _BlockBase(nn.Module):
    """Fields shared by the attention modules and blocks."""

    config: Flux2TransformerConfig
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    attention: str = "dot_product"
    mesh: Any = None

    def _heads(self, x_bld, axes):
        """[B, L, D] -> [B, L, heads, head_dim]."""
        cfg = self.config
        out = x_bld.reshape(*x_bld.shape[:2], cfg.num_attention_heads, cfg.attention_head_dim)
        return sharding.constrain(out, axes)

    def _norm(self) -> RMSNorm:
        return RMSNorm(self.config.eps, self.dtype, self.param_dtype)

    def _attend(self, q, k, v):
        """Softmax attention through the configured backend (:mod:`jaxcore.attention`)."""
        out = attention_fn(q, k, v, backend=self.attention, mesh=self.mesh)
        return sharding.constrain(out, _IMAGE_HEADS)


class Flux2Attention(_BlockBase):
    """Double-stream attention (diffusers ``Flux2Attention`` + its processors): per-stream
    bias-free q/k/v, per-head RMS q/k norms, RoPE over [text; image], one joint attention,
    per-stream output projections. :meth:`reference` is the reference stream alone (image
    weights, self-attention): its output and its post-RoPE (k, v)."""

    def setup(self):
        dim, dt, pdt = self.config.hidden_dim, self.dtype, self.param_dtype
        for name in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj"):
            setattr(self, name, _dense(dim, ("embed", "heads"), None, dt, pdt))
        self.to_out = _dense(dim, ("heads", "embed"), None, dt, pdt)
        self.to_add_out = _dense(dim, ("heads", "embed"), None, dt, pdt)
        self.norm_q, self.norm_k = self._norm(), self._norm()
        self.norm_added_q, self.norm_added_k = self._norm(), self._norm()

    def _image_qkv(self, x_bld):
        q, k, v = (self._heads(p(x_bld), _IMAGE_HEADS) for p in (self.to_q, self.to_k, self.to_v))
        return self.norm_q(q), self.norm_k(k), v

    def _text_qkv(self, c_btd):
        projs = (self.add_q_proj, self.add_k_proj, self.add_v_proj)
        q, k, v = (self._heads(p(c_btd), _TEXT_HEADS) for p in projs)
        return self.norm_added_q(q), self.norm_added_k(k), v

    def _project(self, proj, out_blhd, axes):
        flat = out_blhd.reshape(*out_blhd.shape[:2], self.config.hidden_dim)
        return sharding.constrain(proj(flat), axes)

    def __call__(self, x_bld, c_btd, rope, ref_kv=None):
        """(image out [B, L, D], text out [B, T, D]); ``rope`` covers [text; image] and
        ``ref_kv`` (cached reference keys/values) joins the keys every query sees."""
        (q, k, v), (cq, ck, cv) = self._image_qkv(x_bld), self._text_qkv(c_btd)
        q, k, v = (jnp.concatenate([c, i], axis=1) for c, i in ((cq, q), (ck, k), (cv, v)))
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        out = self._attend(q, *_with_reference(k, v, ref_kv))
        text_len = c_btd.shape[1]
        image = self._project(self.to_out, out[:, text_len:], _IMAGE_EMBED)
        text = self._project(self.to_add_out, out[:, :text_len], _TEXT_EMBED)
        return image, text

    def reference(self, r_brd, rope):
        """(reference out [B, R, D], post-RoPE (k, v)) of the reference stream alone."""
        q, k, v = self._image_qkv(r_brd)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        out = self._attend(q, k, v)  # reference queries see the reference keys only
        return self._project(self.to_out, out, _IMAGE_EMBED), (k, v)


class FeedForward(_BlockBase):
    """``linear_out(swiglu(linear_in(x)))``, bias-free (diffusers ``Flux2FeedForward``)."""

    length_axis: str = "activation_length"

    @nn.compact
    def __call__(self, x_bld):
        cfg = self.config
        packed = PackedDense(
            (2, cfg.mlp_dim), ("embed", None, "mlp"), self.dtype, self.param_dtype, name="linear_in"
        )(x_bld)
        h = sharding.constrain(
            swiglu(packed), ("activation_batch", self.length_axis, "activation_mlp")
        )
        out = _dense(cfg.hidden_dim, ("mlp", "embed"), "linear_out", self.dtype, self.param_dtype)
        return sharding.constrain(
            out(h), ("activation_batch", self.length_axis, "activation_embed")
        )


class DoubleStreamBlock(_BlockBase):
    """diffusers ``Flux2TransformerBlock``: text and image streams, their own weights, joint
    attention; the modulation rows come from the model (shared by every double block)."""

    def setup(self):
        kw = dict(
            config=self.config,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            attention=self.attention,
            mesh=self.mesh,
        )
        self.attn = Flux2Attention(**kw)
        self.ff = FeedForward(**kw)
        self.ff_context = FeedForward(**kw, length_axis="activation_kv_length")

    def _stream(self, x, attn_out, mod, ff, axes):
        """Gated attention residual, then the modulated SwiGLU feed-forward residual."""
        _, _, gate, shift_ff, scale_ff, gate_ff = mod
        x = _gated_residual(x, attn_out, gate, axes)
        h = ff(_modulate(x, shift_ff, scale_ff, self.config.eps, self.dtype))
        return _gated_residual(x, h, gate_ff, axes)

    def __call__(self, x_bld, c_btd, mod_img, mod_txt, rope_cos, rope_sin, ref_kv=None):
        """(image, text) streams after the block; ``mod_*`` the six shared modulation rows."""
        eps = self.config.eps
        x_bld, c_btd = checkpoint_name(x_bld, BLOCK_INPUT), checkpoint_name(c_btd, BLOCK_INPUT)
        x_attn, c_attn = self.attn(
            _modulate(x_bld, mod_img[0], mod_img[1], eps, self.dtype),
            _modulate(c_btd, mod_txt[0], mod_txt[1], eps, self.dtype),
            (rope_cos, rope_sin),
            ref_kv,
        )
        x_bld = self._stream(x_bld, x_attn, mod_img, self.ff, _IMAGE_EMBED)
        c_btd = self._stream(c_btd, c_attn, mod_txt, self.ff_context, _TEXT_EMBED)
        return x_bld, c_btd

    def reference(self, r_brd, mod_ref, rope):
        """The reference stream through this block: (new stream, its post-RoPE (k, v))."""
        h = _modulate(r_brd, mod_ref[0], mod_ref[1], self.config.eps, self.dtype)
        r_attn, kv = self.attn.reference(h, rope)
        return self._stream(r_brd, r_attn, mod_ref, self.ff, _IMAGE_EMBED), kv


class SingleStreamBlock(_BlockBase):
    """diffusers ``Flux2SingleTransformerBlock`` on the joint [text; image] sequence: one fused
    projection gives q, k, v and the SwiGLU input; one fused projection takes
    ``cat([attention, swiglu])``. Kernels keep diffusers' fused layouts ([D, 3D + 2F],
    [D + F, D])."""

    def setup(self):
        cfg, dt, pdt = self.config, self.dtype, self.param_dtype
        fused = 3 * cfg.hidden_dim + 2 * cfg.mlp_dim
        self.to_qkv_mlp_proj = _dense(fused, ("embed", None), None, dt, pdt)
        self.to_out = _dense(cfg.hidden_dim, (None, "embed"), None, dt, pdt)
        self.norm_q, self.norm_k = self._norm(), self._norm()

    def _qkv_mlp(self, h_bnd, rope):
        """(q, k, v) post-norm and post-RoPE [B, N, H, Dh], and the SwiGLU output [B, N, F]."""
        d = self.config.hidden_dim
        fused = self.to_qkv_mlp_proj(h_bnd)
        q, k, v = (self._heads(fused[..., i * d : (i + 1) * d], _IMAGE_HEADS) for i in range(3))
        mlp = fused[..., 3 * d :].reshape(*fused.shape[:2], 2, self.config.mlp_dim)
        q, k = apply_rope(self.norm_q(q), *rope), apply_rope(self.norm_k(k), *rope)
        return (q, k, v), swiglu(mlp)

    def _out(self, x_bnd, attn_bnhd, mlp_bnf, gate):
        """Fused output projection of [attention, SwiGLU], gated into the residual."""
        attn = attn_bnhd.reshape(*attn_bnhd.shape[:2], self.config.hidden_dim)
        out = self.to_out(jnp.concatenate([attn, mlp_bnf.astype(attn.dtype)], axis=-1))
        return _gated_residual(x_bnd, out, gate, _IMAGE_EMBED)

    def __call__(self, x_bnd, mod, rope_cos, rope_sin, ref_kv=None):
        """The joint [text; image] stream after the block (``ref_kv`` joins the keys)."""
        x_bnd = checkpoint_name(x_bnd, BLOCK_INPUT)  # what an offloading remat policy keeps
        shift, scale, gate = mod
        h = _modulate(x_bnd, shift, scale, self.config.eps, self.dtype)
        (q, k, v), mlp = self._qkv_mlp(h, (rope_cos, rope_sin))
        return self._out(x_bnd, self._attend(q, *_with_reference(k, v, ref_kv)), mlp, gate)

    def reference(self, r_brd, mod_ref, rope):
        """The reference stream through this block: (new stream, its post-RoPE (k, v))."""
        shift, scale, gate = mod_ref
        h = _modulate(r_brd, shift, scale, self.config.eps, self.dtype)
        (q, k, v), mlp = self._qkv_mlp(h, rope)
        return self._out(r_brd, self._attend(q, k, v), mlp, gate), (k, v)


# ----------------------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------------------


class Flux2Transformer(nn.Module):
    """Flux.2 transformer (= diffusers ``Flux2Transformer2DModel.forward``).

    ``(hidden_states [B, L, in_channels], encoder_hidden_states [B, T, joint_attention_dim],
    timestep [B], img_ids [L, A] | [B, L, A], txt_ids [T, A] | [B, T, A], guidance [B] | None)
    -> [B, L, patch_size**2 * out_channels]``, A >= len(axes_dims_rope) (4 in every release).

    ``timestep`` is what the pipelines pass (sigma in [0, 1]), ``guidance`` the guidance scale;
    both are multiplied by 1000 inside. ``guidance`` is required iff ``guidance_embeds`` (FLUX.2
    dev) and refused otherwise (Klein; its pipelines pass None; diffusers would ignore one).
    Ids given as numpy arrays give bit-exact RoPE tables; traced ids work too.

    Reference images (Klein KV, see the module docstring): ``reference_kv=`` the output of
    :meth:`reference_kv` (computed once), or ``reference_tokens`` / ``reference_ids`` (and
    ``ref_timestep``) to build it inside the call, diffusers' "extract" step. ``hidden_states``
    then holds only the tokens being denoised and the output covers those.
    """

    config: Flux2TransformerConfig
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    attention: str = "dot_product"
    mesh: Any = None
    remat_policy: str = "none"
    scan_layers: bool = False  # each block kind as one lax.scan (without a reference cache)
    scanned_blocks: ClassVar[tuple[str, ...]] = ("transformer_blocks", "single_transformer_blocks")

    def _block_kw(self) -> dict:
        return dict(
            config=self.config,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            attention=self.attention,
            mesh=self.mesh,
        )

    def setup(self):
        cfg, dim, dt, pdt = self.config, self.config.hidden_dim, self.dtype, self.param_dtype
        self.time_guidance_embed = TimestepGuidanceEmbedder(cfg, pdt)
        self.double_stream_modulation_img = Modulation(6, dim, pdt)
        self.double_stream_modulation_txt = Modulation(6, dim, pdt)
        self.single_stream_modulation = Modulation(3, dim, pdt)
        self.x_embedder = _dense(dim, ("conv_in", "embed"), None, dt, pdt)
        self.context_embedder = _dense(dim, (None, "embed"), None, dt, pdt)
        double_cls = remat_block(DoubleStreamBlock, self.remat_policy)
        single_cls = remat_block(SingleStreamBlock, self.remat_policy)
        self.transformer_blocks = [double_cls(**self._block_kw()) for _ in range(cfg.num_layers)]
        self.single_transformer_blocks = [
            single_cls(**self._block_kw()) for _ in range(cfg.num_single_layers)
        ]
        self.norm_out = Modulation(2, dim, pdt)
        self.proj_out = _dense(cfg.proj_out_dim, ("embed", "conv_out"), None, dt, pdt)

    def __call__(
        self,
        hidden_states,
        encoder_hidden_states,
        timestep,
        img_ids,
        txt_ids,
        guidance=None,
        reference_kv: ReferenceKV | None = None,
        reference_tokens=None,
        reference_ids=None,
        ref_timestep: float = 0.0,
        run_stack=None,
    ):
        """The prediction for ``hidden_states`` (see the class docstring); with ``run_stack``
        (step caching, :mod:`jaxcore.step_cache`), ``(prediction, extra)`` where the stack of
        double then single blocks ran as ``run_stack((image, text), run_blocks, num_blocks) ->
        ((image, text), extra)`` (see :meth:`_block_stack`)."""
        timestep = jnp.asarray(timestep)
        guidance = None if guidance is None else jnp.asarray(guidance)
        check_inputs(self.config, hidden_states, encoder_hidden_states, timestep, guidance)
        if self.mesh is not None:
            sharding.check_divisible(
                self.mesh, batch=hidden_states.shape[0], heads=self.config.num_attention_heads
            )
        if reference_tokens is not None:
            if reference_kv is not None:
                raise ValueError("pass reference_kv or reference_tokens, not both")
            reference_kv = self.reference_kv(
                reference_tokens, reference_ids, guidance, ref_timestep
            )
        if reference_kv is not None:
            check_reference_kv(self.config, reference_kv, hidden_states.shape[0])
        temb = self.time_guidance_embed(timestep, guidance)
        x = sharding.constrain(self.x_embedder(hidden_states.astype(self.dtype)), _IMAGE_EMBED)
        c = sharding.constrain(
            self.context_embedder(encoder_hidden_states.astype(self.dtype)), _TEXT_EMBED
        )
        rope = rope_tables(
            self.config,
            ("txt_ids", txt_ids, encoder_hidden_states.shape[1]),
            ("img_ids", img_ids, hidden_states.shape[1]),
        )
        run_blocks = self._block_stack(temb, rope, reference_kv, text_len=c.shape[1])
        num_blocks = self.config.num_layers + self.config.num_single_layers
        extra = None
        if run_stack is None:
            x, _ = run_blocks((x, c), 0, num_blocks)
        else:
            (x, _), extra = run_stack((x, c), run_blocks, num_blocks)
        scale, shift = self.norm_out(temb)  # AdaLayerNormContinuous: scale first
        out = self.proj_out(_modulate(x, shift, scale, self.config.eps, self.dtype))
        out = sharding.constrain(out, _IMAGE_EMBED)
        return out if run_stack is None else (out, extra)

    def _block_stack(self, temb, rope, reference_kv, text_len: int):
        """``run_blocks(streams, start, stop)``: blocks ``start..stop-1`` of the stack of double
        then single blocks on ``streams = (image, text)`` ([B, L, D], [B, T, D]; the image
        stream holds the non-KV render's reference tokens after the latents' too).

        The single blocks run on the joint [text; image] sequence, as diffusers' do; a run
        that reaches them concatenates the streams once before them and splits the result
        after them (concatenation and slicing are exact), so a stack run in pieces (step
        caching's first block, then the rest) equals one run. This is what diffusers' cache
        hooks see: the first double block's ``hidden_states`` is the image stream (the
        "first stream" whose residual First-Block-Cache compares and MagCache keeps), and the
        last single block returns the joint sequence whose image tokens sit at the end."""
        cfg = self.config
        mod_img = self.double_stream_modulation_img(temb)
        mod_txt = self.double_stream_modulation_txt(temb)
        mod_single = self.single_stream_modulation(temb)
        kv = reference_kv or ReferenceKV((None,) * cfg.num_layers, (None,) * cfg.num_single_layers)
        scan = self.scan_layers and reference_kv is None  # per-layer caches: the plain loop
        kw = self._block_kw()

        def one_double(block, streams, layer_kv=None):
            return block(*streams, mod_img, mod_txt, *rope, layer_kv)

        def one_single(block, joint, layer_kv=None):
            return block(joint, mod_single, *rope, layer_kv)

        def run(blocks, carry, one, layer_kvs, template_cls):
            if scan:
                return compute.run_blocks(self, blocks, carry, one, template_cls(**kw, parent=None))
            for block, layer_kv in zip(blocks, layer_kvs, strict=True):
                carry = one(block, carry, layer_kv)
            return carry

        def run_blocks(streams, start, stop):
            x, c = streams
            last_double = min(stop, cfg.num_layers)
            if start < last_double:
                chosen = slice(start, last_double)
                x, c = run(
                    self.transformer_blocks[chosen],
                    (x, c),
                    one_double,
                    kv.double[chosen],
                    DoubleStreamBlock,
                )
            first, last = max(start, cfg.num_layers) - cfg.num_layers, stop - cfg.num_layers
            if first < last:
                chosen = slice(first, last)
                joint = sharding.constrain(jnp.concatenate([c, x], axis=1), _IMAGE_EMBED)
                joint = run(
                    self.single_transformer_blocks[chosen],
                    joint,
                    one_single,
                    kv.single[chosen],
                    SingleStreamBlock,
                )
                c = sharding.constrain(joint[:, :text_len], _TEXT_EMBED)
                x = sharding.constrain(joint[:, text_len:], _IMAGE_EMBED)
            return x, c

        return run_blocks

    def reference_kv(
        self, reference_tokens, reference_ids, guidance=None, ref_timestep: float = 0.0
    ) -> ReferenceKV:
        """Every block's post-RoPE (k, v) of the reference tokens ``[B_ref, R, in_channels]``
        (ids ``[R, A]`` or ``[B_ref, R, A]``; several reference images concatenated, as the
        pipeline's ``prepare_image_latents`` packs them), modulated at ``ref_timestep`` (diffusers
        ``ref_fixed_timestep``) and attending to themselves only. ``guidance`` [B_ref] iff
        ``guidance_embeds``. ``B_ref`` = 1 serves any batch."""
        cfg = self.config
        tokens = jnp.asarray(reference_tokens)
        if tokens.ndim != 3 or tokens.shape[2] != cfg.in_channels:
            raise ValueError(
                f"reference_tokens must be [B, R, in_channels={cfg.in_channels}], "
                f"got shape {tokens.shape}"
            )
        batch = tokens.shape[0]
        guidance = None if guidance is None else jnp.asarray(guidance)
        _check_guidance(cfg, guidance, batch)
        temb = self.time_guidance_embed(jnp.full((batch,), ref_timestep, jnp.float32), guidance)
        mod_img = self.double_stream_modulation_img(temb)
        mod_single = self.single_stream_modulation(temb)
        rope = rope_tables(cfg, ("reference_ids", reference_ids, tokens.shape[1]))
        r = sharding.constrain(self.x_embedder(tokens.astype(self.dtype)), _IMAGE_EMBED)
        double, single = [], []
        for block in self.transformer_blocks:
            r, layer_kv = block.reference(r, mod_img, rope)
            double.append(layer_kv)
        for block in self.single_transformer_blocks:
            r, layer_kv = block.reference(r, mod_single, rope)
            single.append(layer_kv)
        return ReferenceKV(tuple(double), tuple(single))


def _check_guidance(cfg: Flux2TransformerConfig, guidance, batch: int) -> None:
    """guidance [B] iff the model has a guidance embedder."""
    if cfg.guidance_embeds and guidance is None:
        raise ValueError(
            "guidance is required: this model has guidance_embeds=True (FLUX.2 dev-like); pass "
            "the guidance scale per sample, e.g. [4.0] * B"
        )
    if not cfg.guidance_embeds and guidance is not None:
        raise ValueError(
            "guidance was given but this model has guidance_embeds=False (FLUX.2 Klein-like) "
            "and no guidance embedder; pass guidance=None"
        )
    if guidance is not None and guidance.shape != (batch,):
        raise ValueError(f"guidance must be [B]=[{batch}], got shape {guidance.shape}")


def check_inputs(cfg: Flux2TransformerConfig, hidden, text, timestep, guidance) -> None:
    """Shape checks of the transformer inputs; errors name the argument and the shape needed."""
    if hidden.ndim != 3 or hidden.shape[2] != cfg.in_channels:
        raise ValueError(
            f"hidden_states must be [B, L, in_channels={cfg.in_channels}], got {hidden.shape}"
        )
    batch = hidden.shape[0]
    if text.ndim != 3 or (text.shape[0], text.shape[2]) != (batch, cfg.joint_attention_dim):
        raise ValueError(
            f"encoder_hidden_states must be [{batch}, T, joint_attention_dim="
            f"{cfg.joint_attention_dim}], got {text.shape}"
        )
    if timestep.shape != (batch,):
        raise ValueError(f"timestep must be [B]=[{batch}], got shape {timestep.shape}")
    _check_guidance(cfg, guidance, batch)


def check_reference_kv(cfg: Flux2TransformerConfig, kv: ReferenceKV, batch: int) -> None:
    """A cache from :meth:`Flux2Transformer.reference_kv` of a model of this config."""
    if (len(kv.double), len(kv.single)) != (cfg.num_layers, cfg.num_single_layers):
        raise ValueError(
            f"reference_kv holds {len(kv.double)} double / {len(kv.single)} single layers; "
            f"this model has {cfg.num_layers} / {cfg.num_single_layers}"
        )
    heads = (cfg.num_attention_heads, cfg.attention_head_dim)
    for k, v in (*kv.double, *kv.single):
        if (
            k.shape != v.shape
            or k.ndim != 4
            or k.shape[0] not in (1, batch)
            or k.shape[2:] != heads
        ):
            raise ValueError(
                f"reference_kv entries must be [1 or B={batch}, R, {heads[0]}, {heads[1]}], got "
                f"k {k.shape}, v {v.shape}"
            )


# ----------------------------------------------------------------------------------------------
# Weights: diffusers checkpoint <-> flax params
# ----------------------------------------------------------------------------------------------


def _halves(w: np.ndarray) -> np.ndarray:
    """SwiGLU ``linear_in.weight`` [2F, D] -> kernel [D, 2, F] (gate half first); a tensor
    that does not split is passed through so the loader's shape check names the parameter."""
    k = w.T
    if k.ndim != 2 or k.shape[1] % 2:
        return k
    return k.reshape(k.shape[0], 2, k.shape[1] // 2)


_SWIGLU_IN = weights.Invertible(_halves, lambda k: k.reshape(k.shape[0], -1).T)


def _linear(flax_path: tuple[str, ...], torch_key: str) -> dict:
    """The entry of a bias-free ``Dense`` from a torch ``Linear(bias=False)``."""
    return {(*flax_path, "kernel"): (f"{torch_key}.weight", weights.linear)}


def _norm(flax_path: tuple[str, ...], torch_key: str) -> dict:
    """The entry of an ``RMSNorm`` scale."""
    return {(*flax_path, "scale"): (f"{torch_key}.weight", weights.identity)}


def _double_block_entries(i: int) -> dict:
    """Entries of double block ``i`` (``attn.to_out.0`` is flax ``attn/to_out``)."""
    flax, torch = (f"transformer_blocks_{i}",), f"transformer_blocks.{i}"
    attn, tattn = (*flax, "attn"), f"{torch}.attn"
    entries: dict = {}
    for proj in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"):
        entries |= _linear((*attn, proj), f"{tattn}.{proj}")
    entries |= _linear((*attn, "to_out"), f"{tattn}.to_out.0")
    for norm in ("norm_q", "norm_k", "norm_added_q", "norm_added_k"):
        entries |= _norm((*attn, norm), f"{tattn}.{norm}")
    for ff in ("ff", "ff_context"):
        entries[(*flax, ff, "linear_in", "kernel")] = (f"{torch}.{ff}.linear_in.weight", _SWIGLU_IN)
        entries |= _linear((*flax, ff, "linear_out"), f"{torch}.{ff}.linear_out")
    return entries


def _single_block_entries(i: int) -> dict:
    """Entries of single block ``i``: diffusers' ``attn.*`` live directly in the block."""
    flax, torch = (f"single_transformer_blocks_{i}",), f"single_transformer_blocks.{i}.attn"
    entries = _linear((*flax, "to_qkv_mlp_proj"), f"{torch}.to_qkv_mlp_proj")
    entries |= _linear((*flax, "to_out"), f"{torch}.to_out")
    entries |= _norm((*flax, "norm_q"), f"{torch}.norm_q")
    return entries | _norm((*flax, "norm_k"), f"{torch}.norm_k")


def weight_map(config: Flux2TransformerConfig) -> dict:
    """{flax param path: (diffusers key, transform)} for every parameter of the model."""
    entries: dict = {}
    for name in ("x_embedder", "context_embedder", "proj_out"):
        entries |= _linear((name,), name)
    for name in (
        "double_stream_modulation_img",
        "double_stream_modulation_txt",
        "single_stream_modulation",
        "norm_out",
    ):
        entries |= _linear((name, "linear"), f"{name}.linear")
    embedders = ["timestep_embedder"] + (["guidance_embedder"] if config.guidance_embeds else [])
    for sub in embedders:
        for lin in ("linear_1", "linear_2"):
            entries |= _linear(
                ("time_guidance_embed", sub, lin), f"time_guidance_embed.{sub}.{lin}"
            )
    for i in range(config.num_layers):
        entries |= _double_block_entries(i)
    for i in range(config.num_single_layers):
        entries |= _single_block_entries(i)
    return entries


def _dummy_inputs(config: Flux2TransformerConfig, batch: int = 1) -> tuple:
    """Smallest valid inputs (one image token, one text token) for init / eval_shape."""
    n_axes, f32 = len(config.axes_dims_rope), jnp.float32
    return (
        jax.ShapeDtypeStruct((batch, 1, config.in_channels), f32),
        jax.ShapeDtypeStruct((batch, 1, config.joint_attention_dim), f32),
        jax.ShapeDtypeStruct((batch,), f32),
        jax.ShapeDtypeStruct((1, n_axes), f32),
        jax.ShapeDtypeStruct((1, n_axes), f32),
        jax.ShapeDtypeStruct((batch,), f32) if config.guidance_embeds else None,
    )


# build / load / init / shape / count: one definition for every model (jaxcore.weights.ModelKind)
KIND = weights.ModelKind(
    Flux2Transformer,
    Flux2TransformerConfig,
    _dummy_inputs,
    lambda config, boxed: weight_map(config),
)
abstract_params = KIND.abstract_params
load_flux2_transformer = KIND.load  # a diffusers Flux2Transformer2DModel directory
init_flux2_transformer = KIND.init
count_params = KIND.count_params
