"""Building blocks the diffusion transformers share (Wan, Flux): one definition each.

- :func:`dense`: a Dense (= torch Linear with bias) whose kernel/bias carry logical axis names;
- :func:`layer_norm`: LayerNorm without affine, in float32 (diffusers' FP32LayerNorm /
  ``LayerNorm(elementwise_affine=False)``);
- :class:`MLP2`: Linear -> activation -> Linear (diffusers' TimestepEmbedding,
  PixArtAlphaTextProjection), params ``linear_1`` / ``linear_2``;
- :func:`apply_rope`: rotary embedding on interleaved pairs (diffusers' ``apply_rotary_emb``
  with ``use_real_unbind_dim=-1``), in float32;
- :func:`timestep_embedding`: diffusers' sinusoidal ``get_timestep_embedding`` (cos first)
  with torch's float32 frequency table (:func:`timestep_frequencies`);
- :func:`gelu_tanh`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

Dtype = Any


def dense(
    features: int,
    axes: tuple[str | None, str | None],
    name: str,
    dtype: Dtype,
    param_dtype: Dtype,
) -> nn.Dense:
    """A Dense (= torch Linear with bias) whose kernel/bias carry logical axis names."""
    return nn.Dense(
        features,
        dtype=dtype,
        param_dtype=param_dtype,
        kernel_init=nn.with_logical_partitioning(nn.initializers.xavier_uniform(), axes),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros_init(), (axes[1],)),
        name=name,
    )


def layer_norm(x: jax.Array, eps: float) -> jax.Array:
    """LayerNorm without affine over the last axis, in float32."""
    x = x.astype(jnp.float32)
    centered = x - x.mean(-1, keepdims=True)
    var = jnp.mean(centered * centered, axis=-1, keepdims=True)
    return centered * jax.lax.rsqrt(var + eps)


def gelu_tanh(x: jax.Array) -> jax.Array:
    return jax.nn.gelu(x, approximate=True)


class MLP2(nn.Module):
    """Linear -> activation -> Linear, the shape of diffusers' TimestepEmbedding (SiLU) and
    PixArtAlphaTextProjection (GELU-tanh); params named ``linear_1`` / ``linear_2``."""

    hidden: int
    out: int
    activation: Callable[[jax.Array], jax.Array]
    axes_1: tuple[str | None, str | None]
    axes_2: tuple[str | None, str | None]
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = dense(self.hidden, self.axes_1, "linear_1", self.dtype, self.param_dtype)(x)
        x = self.activation(x)
        return dense(self.out, self.axes_2, "linear_2", self.dtype, self.param_dtype)(x)


def apply_rope(x_blhd: jax.Array, cos_lk: jax.Array, sin_lk: jax.Array) -> jax.Array:
    """Rotate interleaved pairs (x[2i], x[2i+1]) by the given angles; computed in float32."""
    *lead, d = x_blhd.shape
    pairs = x_blhd.astype(jnp.float32).reshape(*lead, d // 2, 2)
    x_even, x_odd = pairs[..., 0], pairs[..., 1]
    cos = cos_lk[None, :, None, :]
    sin = sin_lk[None, :, None, :]
    rotated = jnp.stack([x_even * cos - x_odd * sin, x_even * sin + x_odd * cos], axis=-1)
    return rotated.reshape(x_blhd.shape).astype(x_blhd.dtype)


def timestep_frequencies(dim: int, max_period: float = 10000.0) -> np.ndarray:
    """The float32 frequencies [dim // 2] of diffusers' ``get_timestep_embedding``.

    torch rounds the exponent ``-ln(max_period) * i / half`` to float32 before ``exp``; doing
    the same, then a correctly rounded exp (float64, rounded), gives torch's table up to its
    float32 exp, which is not correctly rounded: 3 of Flux's 128 entries differ by 1 ulp on a
    CPU (rounding the float64 exponent instead would differ in 87). An ulp matters: the
    timesteps are up to 1000 (Flux embeds sigma * 1000), so it moves sin/cos arguments by ~3e-5.
    """
    half = dim // 2
    exponent = np.float32(-math.log(max_period)) * np.arange(half, dtype=np.float32)
    exponent = exponent / np.float32(half)
    return np.exp(exponent.astype(np.float64)).astype(np.float32)


def timestep_embedding(timestep: jax.Array, dim: int, max_period: float = 10000.0) -> jax.Array:
    """Sinusoidal embedding [B] -> [B, dim] float32, cos half first (diffusers
    ``get_timestep_embedding(t, dim, flip_sin_to_cos=True, downscale_freq_shift=0)``)."""
    freqs = jnp.asarray(timestep_frequencies(dim, max_period))
    args = timestep.astype(jnp.float32)[:, None] * freqs[None, :]
    emb = jnp.concatenate([jnp.cos(args), jnp.sin(args)], axis=-1)
    if dim % 2:
        emb = jnp.pad(emb, ((0, 0), (0, 1)))
    return emb
