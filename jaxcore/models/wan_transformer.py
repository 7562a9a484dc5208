"""Wan 2.1 text-to-video diffusion transformer (DiT) in Flax linen.

Reference: diffusers ``WanTransformer3DModel`` (diffusers/models/transformers/transformer_wan.py,
diffusers 0.42). Same function, same parameters (loaded from a diffusers checkpoint through
:func:`weight_map`), written as JAX code:

- 3D patch embedding (a Conv3d whose stride equals its kernel, done as a reshape + contraction),
- 3D rotary embedding with the head dim split over frames / height / width as
  ``WanRotaryPosEmbed`` does,
- sinusoidal time embedding (cos first) -> MLP -> a 6-way modulation per block,
- a GELU-tanh text projection,
- blocks: modulated LayerNorm -> self-attention (RMS-norm on q and k across all heads, RoPE)
  -> gated residual; LayerNorm (affine) -> cross-attention to the text -> residual;
  modulated LayerNorm -> GELU-tanh FFN -> gated residual,
- output LayerNorm modulated by the model's ``scale_shift_table``, ``proj_out``, unpatchify.

Public tensors use the diffusers layout (video ``[B, C, F, H, W]``); inside, tokens are
``[B, L, D]`` with L = F' * H' * W' in (frame, height, width) order.

Only text-to-video (Wan 2.1 T2V) is implemented: image conditioning (``image_dim``,
``added_kv_proj_dim``) and Wan 2.2 per-token timesteps are rejected with an error.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from jaxcore import sharding, weights
from jaxcore.attention import attention as attention_fn
from jaxcore.compute import remat_block
from jaxcore.config import config_json_kwargs
from jaxcore.models.layers import (
    MLP2,
    apply_rope,
    dense,
    gelu_tanh,
    layer_norm,
    timestep_embedding,
)

Dtype = Any

# ----------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------

SUPPORTED_QK_NORM = "rms_norm_across_heads"


class WanConfigError(ValueError):
    """A config.json / YAML section that WanTransformerConfig cannot represent; names the key."""


@dataclasses.dataclass(frozen=True)
class WanTransformerConfig:
    """Architecture of a Wan 2.1 transformer; field names follow diffusers' config.json."""

    patch_size: tuple[int, int, int] = (1, 2, 2)
    num_attention_heads: int = 40
    attention_head_dim: int = 128
    in_channels: int = 16
    out_channels: int = 16
    text_dim: int = 4096
    freq_dim: int = 256
    ffn_dim: int = 13824
    num_layers: int = 40
    cross_attn_norm: bool = True
    qk_norm: str | None = SUPPORTED_QK_NORM
    eps: float = 1e-6
    image_dim: int | None = None
    added_kv_proj_dim: int | None = None
    rope_max_seq_len: int = 1024
    pos_embed_seq_len: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "patch_size", tuple(int(p) for p in self.patch_size))
        if len(self.patch_size) != 3 or min(self.patch_size) < 1:
            raise WanConfigError(f"patch_size must be 3 positive ints, got {self.patch_size}")
        unsupported = {
            "image_dim": self.image_dim,
            "added_kv_proj_dim": self.added_kv_proj_dim,
            "pos_embed_seq_len": self.pos_embed_seq_len,
        }
        for key, value in unsupported.items():
            if value is not None:
                raise WanConfigError(
                    f"{key}={value!r}: image conditioning (Wan I2V / FLF2V) is not implemented; "
                    f"only text-to-video configs ({key}=None) are supported"
                )
        if self.qk_norm != SUPPORTED_QK_NORM:
            raise WanConfigError(
                f"qk_norm={self.qk_norm!r} is not supported; only {SUPPORTED_QK_NORM!r}"
            )
        if self.attention_head_dim % 2:
            raise WanConfigError(
                f"attention_head_dim={self.attention_head_dim} must be even for rotary embedding"
            )
        for key in (
            "num_attention_heads",
            "attention_head_dim",
            "in_channels",
            "out_channels",
            "text_dim",
            "freq_dim",
            "ffn_dim",
            "num_layers",
            "rope_max_seq_len",
        ):
            if int(getattr(self, key)) < 1:
                raise WanConfigError(f"{key} must be >= 1, got {getattr(self, key)!r}")

    @property
    def hidden_dim(self) -> int:
        """Model width D = heads x head dim (diffusers' ``inner_dim``)."""
        return self.num_attention_heads * self.attention_head_dim

    @property
    def patch_volume(self) -> int:
        return math.prod(self.patch_size)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> WanTransformerConfig:
        """Build from a diffusers config.json dict (``_``-prefixed keys ignored)."""
        kwargs = config_json_kwargs(cls, d, WanConfigError)
        if kwargs.get("out_channels") is None and "in_channels" in kwargs:
            # diffusers: ``out_channels = out_channels or in_channels``
            kwargs["out_channels"] = kwargs["in_channels"]
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["patch_size"] = list(self.patch_size)
        return d


# ----------------------------------------------------------------------------------------------
# Pure helpers: time embedding, rotary embedding, patchify
# ----------------------------------------------------------------------------------------------


def rope_axis_dims(head_dim: int) -> tuple[int, int, int]:
    """How WanRotaryPosEmbed splits the head dim: (frames, height, width)."""
    hw = 2 * (head_dim // 6)
    return head_dim - 2 * hw, hw, hw


def _rope_angles_1d(dim: int, positions: int, theta: float) -> np.ndarray:
    """Angles [positions, dim/2] = pos * theta^(-2i/dim), in float64 like diffusers."""
    inv_freq = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    return np.outer(np.arange(positions, dtype=np.float64), inv_freq)


def rope_cos_sin(
    grid: tuple[int, int, int], head_dim: int, max_seq_len: int, theta: float = 10000.0
) -> tuple[jax.Array, jax.Array]:
    """cos/sin tables [L, head_dim/2] (float32) for a (frames, height, width) token grid.

    Each pair (2i, 2i+1) of the head dim rotates by one angle; the pairs are split into a
    frame part, a height part and a width part (diffusers WanRotaryPosEmbed). The small
    per-axis tables are computed on the host in float64 and rounded to float32, as diffusers
    does; only their broadcast to the token grid happens in the graph, so a 75k-token video
    does not embed a large constant.
    """
    for axis, n in zip(("frames", "height", "width"), grid, strict=True):
        if n > max_seq_len:
            raise ValueError(
                f"{n} latent {axis} after patching exceed rope_max_seq_len={max_seq_len}"
            )
    f, h, w = grid
    axis_angles = [
        _rope_angles_1d(dim, n, theta)
        for dim, n in zip(rope_axis_dims(head_dim), grid, strict=True)
    ]
    expand = (
        lambda t: t[:, None, None, :],
        lambda t: t[None, :, None, :],
        lambda t: t[None, None, :, :],
    )

    def table(fn: Callable[[np.ndarray], np.ndarray]) -> jax.Array:
        parts = [
            jnp.broadcast_to(put(jnp.asarray(fn(a).astype(np.float32))), (f, h, w, a.shape[-1]))
            for put, a in zip(expand, axis_angles, strict=True)
        ]
        return jnp.concatenate(parts, axis=-1).reshape(f * h * w, head_dim // 2)

    return table(np.cos), table(np.sin)


def patch_grid(video_shape: tuple[int, ...], patch_size: tuple[int, int, int]) -> tuple[int, ...]:
    """(F', H', W') token grid of a [B, C, F, H, W] video; errors if a side does not divide."""
    if len(video_shape) != 5:
        raise ValueError(f"hidden_states must be [B, C, F, H, W], got shape {tuple(video_shape)}")
    grid = []
    for axis, n, p in zip(("frames", "height", "width"), video_shape[2:], patch_size, strict=True):
        if n % p:
            raise ValueError(f"hidden_states {axis}={n} is not divisible by patch size {p}")
        grid.append(n // p)
    return tuple(grid)


def patchify(video_bcfhw: jax.Array, patch_size: tuple[int, int, int]) -> jax.Array:
    """[B, C, F, H, W] -> [B, F', H', W', pt, ph, pw, C] (patch contents channel-last)."""
    b, c = video_bcfhw.shape[:2]
    (f, h, w), (pt, ph, pw) = patch_grid(video_bcfhw.shape, patch_size), patch_size
    x = video_bcfhw.reshape(b, c, f, pt, h, ph, w, pw)
    return x.transpose(0, 2, 4, 6, 3, 5, 7, 1)


def unpatchify(
    tokens_blp: jax.Array, grid: tuple[int, int, int], patch_size: tuple[int, int, int]
) -> jax.Array:
    """[B, L, pt*ph*pw*C] (patch-major, channel-last) -> [B, C, F, H, W], as diffusers."""
    b = tokens_blp.shape[0]
    (f, h, w), (pt, ph, pw) = grid, patch_size
    x = tokens_blp.reshape(b, f, h, w, pt, ph, pw, -1)
    x = x.transpose(0, 7, 1, 4, 2, 5, 3, 6)
    return x.reshape(b, x.shape[1], f * pt, h * ph, w * pw)


# ----------------------------------------------------------------------------------------------
# Layers
# ----------------------------------------------------------------------------------------------

_BATCH_LENGTH_EMBED = ("activation_batch", "activation_length", "activation_embed")
_TEXT_EMBED = ("activation_batch", "activation_kv_length", "activation_embed")
_BATCH_LENGTH_HEADS = ("activation_batch", "activation_length", "activation_heads", "activation_kv")
_TEXT_HEADS = ("activation_batch", "activation_kv_length", "activation_heads", "activation_kv")


def _modulation_table(module: nn.Module, rows: int, dim: int, param_dtype: Dtype) -> jax.Array:
    """The learnt ``scale_shift_table`` [1, rows, D] added to the time projection."""
    init = nn.initializers.normal(stddev=dim**-0.5)
    return module.param(
        "scale_shift_table",
        nn.with_logical_partitioning(init, (None, "modulation", "embed")),
        (1, rows, dim),
        param_dtype,
    )


class ConditionEmbedder(nn.Module):
    """Timestep -> (temb [B, D], 6-way projection [B, 6, D]); text -> [B, L, D].

    diffusers ``WanTimeTextImageEmbedding`` without the image branch. The time path runs in
    float32 (diffusers keeps ``time_embedder`` in fp32; we keep ``time_proj`` there too since it
    feeds every modulation).
    """

    config: WanTransformerConfig
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, timestep: jax.Array, text_blt: jax.Array):
        cfg = self.config
        dim = cfg.hidden_dim
        t_freq = timestep_embedding(timestep, cfg.freq_dim)
        temb = MLP2(
            dim,
            dim,
            nn.silu,
            (None, "embed"),
            ("embed", None),
            dtype=jnp.float32,
            param_dtype=self.param_dtype,
            name="time_embedder",
        )(t_freq)
        proj = dense(6 * dim, ("embed", "modulation"), "time_proj", jnp.float32, self.param_dtype)
        temb_6d = proj(nn.silu(temb)).reshape(temb.shape[0], 6, dim)
        text = MLP2(
            dim,
            dim,
            gelu_tanh,
            (None, "embed"),
            ("embed", None),
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            name="text_embedder",
        )(text_blt.astype(self.dtype))
        return temb, temb_6d, sharding.constrain(text, _TEXT_EMBED)


class WanAttention(nn.Module):
    """Multi-head attention with RMS-norm on q and k over all heads (diffusers WanAttention).

    Self-attention when ``context`` is None (RoPE applied to q and k), else cross-attention
    to ``context`` (no RoPE, no mask: diffusers passes none; Wan pads prompts with zeros).
    """

    config: WanTransformerConfig
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    attention: str = "dot_product"
    mesh: Any = None

    def _rms_norm(self, name: str) -> nn.RMSNorm:
        return nn.RMSNorm(
            epsilon=self.config.eps,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            scale_init=nn.with_logical_partitioning(nn.initializers.ones_init(), ("norm",)),
            name=name,
        )

    @nn.compact
    def __call__(self, x_bld, context_bmd=None, rope=None):
        cfg = self.config
        dim, heads, head_dim = cfg.hidden_dim, cfg.num_attention_heads, cfg.attention_head_dim
        kv_source = x_bld if context_bmd is None else context_bmd
        kv_axes = _BATCH_LENGTH_HEADS if context_bmd is None else _TEXT_HEADS

        def project(name, source):
            return dense(dim, ("embed", "heads"), name, self.dtype, self.param_dtype)(source)

        q = self._rms_norm("norm_q")(project("to_q", x_bld))
        k = self._rms_norm("norm_k")(project("to_k", kv_source))
        v = project("to_v", kv_source)
        q = sharding.constrain(q.reshape(*q.shape[:2], heads, head_dim), _BATCH_LENGTH_HEADS)
        k = sharding.constrain(k.reshape(*k.shape[:2], heads, head_dim), kv_axes)
        v = sharding.constrain(v.reshape(*v.shape[:2], heads, head_dim), kv_axes)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        out = attention_fn(q, k, v, backend=self.attention, mesh=self.mesh)
        out = sharding.constrain(out, _BATCH_LENGTH_HEADS).reshape(*out.shape[:2], dim)
        out = dense(dim, ("heads", "embed"), "to_out", self.dtype, self.param_dtype)(out)
        return sharding.constrain(out, _BATCH_LENGTH_EMBED)


class FeedForward(nn.Module):
    """Linear -> GELU(tanh) -> Linear (diffusers FeedForward, activation "gelu-approximate")."""

    config: WanTransformerConfig
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x_bld):
        cfg = self.config
        h = dense(cfg.ffn_dim, ("embed", "mlp"), "proj_in", self.dtype, self.param_dtype)(x_bld)
        h = sharding.constrain(
            gelu_tanh(h), ("activation_batch", "activation_length", "activation_mlp")
        )
        out = dense(cfg.hidden_dim, ("mlp", "embed"), "proj_out", self.dtype, self.param_dtype)(h)
        return sharding.constrain(out, _BATCH_LENGTH_EMBED)


def _modulate(x_bld: jax.Array, eps: float, shift_b1d, scale_b1d, dtype: Dtype) -> jax.Array:
    """LayerNorm(x) * (1 + scale) + shift, in float32, cast to the activation dtype."""
    return (layer_norm(x_bld, eps) * (1.0 + scale_b1d) + shift_b1d).astype(dtype)


class WanBlock(nn.Module):
    """One transformer block (diffusers WanTransformerBlock, Wan 2.1 per-sample timestep)."""

    config: WanTransformerConfig
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    attention: str = "dot_product"
    mesh: Any = None

    @nn.compact
    def __call__(self, x_bld, context_bmd, temb_b6d, rope_cos, rope_sin):
        cfg = self.config
        table = _modulation_table(self, 6, cfg.hidden_dim, self.param_dtype)
        mod = table.astype(jnp.float32) + temb_b6d.astype(jnp.float32)  # [B, 6, D]
        shift_sa, scale_sa, gate_sa, shift_ff, scale_ff, gate_ff = jnp.split(mod, 6, axis=1)
        attn_kw = dict(
            config=cfg,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            attention=self.attention,
            mesh=self.mesh,
        )

        # 1. self-attention, modulated and gated; the residual add happens in float32
        h = _modulate(x_bld, cfg.eps, shift_sa, scale_sa, self.dtype)
        h = WanAttention(**attn_kw, name="attn1")(h, rope=(rope_cos, rope_sin))
        x_bld = (x_bld.astype(jnp.float32) + h * gate_sa).astype(self.dtype)
        x_bld = sharding.constrain(x_bld, _BATCH_LENGTH_EMBED)

        # 2. cross-attention to the text, ungated
        if cfg.cross_attn_norm:
            norm2 = nn.LayerNorm(
                epsilon=cfg.eps,
                dtype=jnp.float32,
                param_dtype=self.param_dtype,
                use_fast_variance=False,
                scale_init=nn.with_logical_partitioning(nn.initializers.ones_init(), ("norm",)),
                bias_init=nn.with_logical_partitioning(nn.initializers.zeros_init(), ("norm",)),
                name="norm2",
            )
            h = norm2(x_bld.astype(jnp.float32)).astype(self.dtype)
        else:
            h = x_bld
        x_bld = x_bld + WanAttention(**attn_kw, name="attn2")(h, context_bmd)

        # 3. feed-forward, modulated and gated
        h = _modulate(x_bld, cfg.eps, shift_ff, scale_ff, self.dtype)
        h = FeedForward(cfg, self.dtype, self.param_dtype, name="ffn")(h)
        x_bld = (x_bld.astype(jnp.float32) + h.astype(jnp.float32) * gate_ff).astype(self.dtype)
        return sharding.constrain(x_bld, _BATCH_LENGTH_EMBED)


class PatchEmbedding(nn.Module):
    """diffusers' Conv3d(in, D, kernel=stride=patch) as a contraction over patch contents.

    The kernel keeps the flax Conv3d layout [pt, ph, pw, C, D] so ``weights.conv3d`` loads it.
    """

    config: WanTransformerConfig
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, patches):
        cfg = self.config
        kernel = self.param(
            "kernel",
            nn.with_logical_partitioning(
                nn.initializers.xavier_uniform(in_axis=(0, 1, 2, 3), out_axis=4),
                (None, None, None, "conv_in", "embed"),
            ),
            (*cfg.patch_size, cfg.in_channels, cfg.hidden_dim),
            self.param_dtype,
        )
        bias = self.param(
            "bias",
            nn.with_logical_partitioning(nn.initializers.zeros_init(), ("embed",)),
            (cfg.hidden_dim,),
            self.param_dtype,
        )
        out = jnp.einsum("bfhwtpqc,tpqcd->bfhwd", patches, kernel.astype(self.dtype))
        return out + bias.astype(self.dtype)


class WanTransformer(nn.Module):
    """Wan 2.1 T2V transformer: ``(video [B,C,F,H,W], timestep [B], text [B,L,text_dim])
    -> prediction [B, out_channels, F, H, W]`` (= diffusers WanTransformer3DModel.forward)."""

    config: WanTransformerConfig
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    attention: str = "dot_product"
    mesh: Any = None
    remat_policy: str = "none"

    def _check_inputs(self, hidden_states, timestep, encoder_hidden_states):
        cfg = self.config
        if hidden_states.ndim != 5 or hidden_states.shape[1] != cfg.in_channels:
            raise ValueError(
                f"hidden_states must be [B, {cfg.in_channels}, F, H, W], got {hidden_states.shape}"
            )
        batch = hidden_states.shape[0]
        if timestep.shape != (batch,):
            raise ValueError(
                f"timestep must be [B]=[{batch}] (one per sample), got shape {timestep.shape}"
            )
        if encoder_hidden_states.ndim != 3 or encoder_hidden_states.shape[::2] != (
            batch,
            cfg.text_dim,
        ):
            raise ValueError(
                f"encoder_hidden_states must be [{batch}, L, text_dim={cfg.text_dim}], "
                f"got {encoder_hidden_states.shape}"
            )

    @nn.compact
    def __call__(self, hidden_states, timestep, encoder_hidden_states):
        cfg = self.config
        timestep = jnp.asarray(timestep)
        self._check_inputs(hidden_states, timestep, encoder_hidden_states)
        grid = patch_grid(hidden_states.shape, cfg.patch_size)
        batch, dim = hidden_states.shape[0], cfg.hidden_dim
        if self.mesh is not None:
            sharding.check_divisible(self.mesh, batch=batch, heads=cfg.num_attention_heads)

        # patch embedding: a stride=kernel Conv3d is a contraction over each patch
        patches = patchify(hidden_states.astype(self.dtype), cfg.patch_size)
        x = PatchEmbedding(cfg, self.dtype, self.param_dtype, name="patch_embedding")(patches)
        x = sharding.constrain(x.reshape(batch, -1, dim), _BATCH_LENGTH_EMBED)

        rope = tuple(
            sharding.constrain(t, ("activation_length", "activation_kv"))
            for t in rope_cos_sin(grid, cfg.attention_head_dim, cfg.rope_max_seq_len)
        )
        temb, temb_6d, context = ConditionEmbedder(
            cfg, self.dtype, self.param_dtype, name="condition_embedder"
        )(timestep, encoder_hidden_states)

        block_cls = remat_block(WanBlock, self.remat_policy)
        for i in range(cfg.num_layers):
            x = block_cls(
                cfg, self.dtype, self.param_dtype, self.attention, self.mesh, name=f"blocks_{i}"
            )(x, context, temb_6d, *rope)

        table = _modulation_table(self, 2, dim, self.param_dtype)
        shift, scale = jnp.split(table.astype(jnp.float32) + temb[:, None, :], 2, axis=1)
        x = _modulate(x, cfg.eps, shift, scale, self.dtype)
        x = dense(
            cfg.out_channels * cfg.patch_volume,
            ("embed", "conv_out"),
            "proj_out",
            self.dtype,
            self.param_dtype,
        )(x)
        return unpatchify(x, grid, cfg.patch_size)


# ----------------------------------------------------------------------------------------------
# Weights: diffusers checkpoint <-> flax params
# ----------------------------------------------------------------------------------------------


def _dense_entries(flax_prefix: tuple[str, ...], torch_prefix: str) -> dict:
    return {
        (*flax_prefix, "kernel"): (f"{torch_prefix}.weight", weights.linear),
        (*flax_prefix, "bias"): (f"{torch_prefix}.bias", weights.identity),
    }


def _attention_entries(flax_prefix: tuple[str, ...], torch_prefix: str) -> dict:
    entries: dict = {}
    for proj in ("to_q", "to_k", "to_v"):
        entries |= _dense_entries((*flax_prefix, proj), f"{torch_prefix}.{proj}")
    entries |= _dense_entries((*flax_prefix, "to_out"), f"{torch_prefix}.to_out.0")
    for norm in ("norm_q", "norm_k"):
        entries[(*flax_prefix, norm, "scale")] = (f"{torch_prefix}.{norm}.weight", weights.identity)
    return entries


def _block_entries(i: int, config: WanTransformerConfig) -> dict:
    flax, torch = (f"blocks_{i}",), f"blocks.{i}"
    entries = {(*flax, "scale_shift_table"): (f"{torch}.scale_shift_table", weights.identity)}
    entries |= _attention_entries((*flax, "attn1"), f"{torch}.attn1")
    entries |= _attention_entries((*flax, "attn2"), f"{torch}.attn2")
    if config.cross_attn_norm:
        entries[(*flax, "norm2", "scale")] = (f"{torch}.norm2.weight", weights.identity)
        entries[(*flax, "norm2", "bias")] = (f"{torch}.norm2.bias", weights.identity)
    entries |= _dense_entries((*flax, "ffn", "proj_in"), f"{torch}.ffn.net.0.proj")
    entries |= _dense_entries((*flax, "ffn", "proj_out"), f"{torch}.ffn.net.2")
    return entries


def weight_map(config: WanTransformerConfig) -> dict:
    """{flax param path: (diffusers key, transform)} for every parameter of the model."""
    entries = {
        ("patch_embedding", "kernel"): ("patch_embedding.weight", weights.conv3d),
        ("patch_embedding", "bias"): ("patch_embedding.bias", weights.identity),
        ("scale_shift_table",): ("scale_shift_table", weights.identity),
    }
    cond = ("condition_embedder",)
    for sub in ("time_embedder", "text_embedder"):
        for lin in ("linear_1", "linear_2"):
            entries |= _dense_entries((*cond, sub, lin), f"condition_embedder.{sub}.{lin}")
    entries |= _dense_entries((*cond, "time_proj"), "condition_embedder.time_proj")
    for i in range(config.num_layers):
        entries |= _block_entries(i, config)
    entries |= _dense_entries(("proj_out",), "proj_out")
    return entries


def _dummy_inputs(config: WanTransformerConfig, batch: int = 1):
    """Smallest valid input shapes (one patch, one text token) for init / eval_shape."""
    video = jax.ShapeDtypeStruct((batch, config.in_channels, *config.patch_size), jnp.float32)
    timestep = jax.ShapeDtypeStruct((batch,), jnp.float32)
    text = jax.ShapeDtypeStruct((batch, 1, config.text_dim), jnp.float32)
    return video, timestep, text


def abstract_params(module: WanTransformer) -> dict:
    """The ``params`` collection as boxed ShapeDtypeStructs (nn.Partitioned kept), no allocation."""
    return weights.abstract_from_inputs(module, _dummy_inputs(module.config))


def load_wan_transformer(
    directory: str | os.PathLike,
    *,
    dtype: Dtype = jnp.float32,
    param_dtype: Dtype = jnp.float32,
    attention: str = "dot_product",
    mesh: jax.sharding.Mesh | None = None,
    rules=None,
    remat_policy: str = "none",
) -> tuple[WanTransformer, dict]:
    """Load a diffusers ``WanTransformer3DModel`` directory (config.json + safetensors).

    Returns ``(module, params)``; params are the unboxed ``params`` collection, cast to
    ``param_dtype`` and placed on ``mesh`` by the logical axis ``rules`` when a mesh is given
    (else on the first device). Raises WeightsError naming missing/unexpected keys or the
    parameter whose shape does not match.
    """
    config = WanTransformerConfig.from_dict(weights.read_config(directory))
    module = WanTransformer(
        config,
        dtype=dtype,
        param_dtype=param_dtype,
        attention=attention,
        mesh=mesh,
        remat_policy=remat_policy,
    )
    params = weights.load_placed(
        directory,
        weight_map(config),
        abstract_params(module),
        mesh=mesh,
        rules=rules,
        dtype=param_dtype,
    )
    return module, params


def init_wan_transformer(
    config: WanTransformerConfig,
    rng: jax.Array,
    *,
    dtype: Dtype = jnp.float32,
    param_dtype: Dtype = jnp.float32,
    attention: str = "dot_product",
    mesh: jax.sharding.Mesh | None = None,
    rules=None,
    remat_policy: str = "none",
) -> tuple[WanTransformer, dict]:
    """Random-init (training from scratch). With a mesh, params are created already sharded."""
    module = WanTransformer(
        config,
        dtype=dtype,
        param_dtype=param_dtype,
        attention=attention,
        mesh=mesh,
        remat_policy=remat_policy,
    )
    return module, weights.init_placed(module, _dummy_inputs(config), rng, mesh=mesh, rules=rules)


def count_params(config: WanTransformerConfig) -> int:
    """Number of parameters, from eval_shape (nothing is allocated)."""
    return weights.count_elements(abstract_params(WanTransformer(config)))


def flops_per_forward(
    config: WanTransformerConfig, batch: int, video_tokens: int, text_tokens: int
) -> int:
    """Matmul FLOPs of one forward pass of the blocks (MaxDiffusion's Wan formula, for MFU).

    Per block, with D = hidden dim, F = ffn dim, s video tokens, L text tokens:
    self-attn QKV 3*2*s*D^2, scores+values 2*2*s^2*D, cross-attn K/V 2*2*L*D^2, Q 2*s*D^2,
    scores+values 2*2*s*L*D, both output projections 2*2*s*D^2, FFN 2*2*s*D*F. Embeddings and
    the output head are left out (negligible). (MaxDiffusion counts 3*2*L*D^2 for the cross
    K/V projections, one projection too many; we count two.) Training = 3x this.
    """
    d, f, s, t = config.hidden_dim, config.ffn_dim, video_tokens, text_tokens
    self_attn = 3 * 2 * s * d * d + 2 * 2 * s * s * d
    cross_attn = 2 * 2 * t * d * d + 2 * s * d * d + 2 * 2 * s * t * d
    out_proj = 2 * 2 * s * d * d
    ffn = 2 * 2 * s * d * f
    return batch * config.num_layers * (self_attn + cross_attn + out_proj + ffn)
