"""Building blocks the diffusion transformers share (Wan, Flux): one definition each.

- :func:`dense`: a Dense (= torch Linear with bias) whose kernel/bias carry logical axis names,
  with its backward written out (:func:`linear`; in bf16 on CPU its weight gradient reads a
  :func:`~jaxcore.kernels.products.transposed_copy` of the input);
- :func:`layer_norm`: LayerNorm without affine, in float32 (diffusers' FP32LayerNorm /
  ``LayerNorm(elementwise_affine=False)``);
- :class:`MLP2`: Linear -> activation -> Linear (diffusers' TimestepEmbedding,
  PixArtAlphaTextProjection), params ``linear_1`` / ``linear_2``;
- :func:`apply_rope`: rotary embedding on interleaved pairs (diffusers' ``apply_rotary_emb``
  with ``use_real_unbind_dim=-1``), in float32;
- :func:`timestep_embedding`: diffusers' sinusoidal ``get_timestep_embedding`` (cos first)
  with torch's float32 frequency table (:func:`timestep_frequencies`);
- :func:`rms_norm` / :class:`RMSNorm`: flax ``nn.RMSNorm`` with the backward written out;
- :func:`scale_shift` (adaLN modulation) and :func:`gated_add` (gated residual), whose
  per-sample parameter gradients are matrix products rather than XLA CPU's slow reductions;
- :func:`gelu_tanh`, :func:`gelu_erf`, :func:`silu`: torch's activation kernels, which compute
  in float32 and round once (:func:`in_float32`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from jaxcore import quantization
from jaxcore.dtypes import is_half_precision
from jaxcore.kernels import cpu_gemm
from jaxcore.kernels.products import transposed_copy

Dtype = Any


def rope_theta_powers(head_dim: int, theta: float) -> np.ndarray:
    """``theta ** (2i / d)`` for i < d / 2 as float32, the power correctly rounded (in float64,
    then rounded): torch's float32 pow, which transformers' RoPE inits use, is within an ulp of
    that; numpy's float32 pow is not (at head_dim 256, 19-26 of 128 frequencies an ulp off
    torch's against 1 this way; an ulp is ~1e-4 rad at 1024 positions)."""
    exponents = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    return np.power(np.float64(theta), exponents.astype(np.float64)).astype(np.float32)


@jax.custom_vjp
def linear(x: jax.Array, kernel: jax.Array, bias: jax.Array) -> jax.Array:
    """``x @ kernel + bias`` over x's last axis: flax ``nn.Dense``'s forward, op for op, with
    the backward written out.

    Why not autodiff: XLA CPU compiles autodiff's transpose of the Dense into weight-gradient
    dots fed by transposed copies, and fuses the residual stream's cotangent chain into those
    copies (one fusion per consumer, the chain recomputed in each); the three explicit
    contractions below keep the cotangent a plain operand. The demo DiT's train step is 1.3x
    faster (bench/train_step.py); the gradients equal autodiff's to float rounding
    (tests/jaxcore/test_layers.py). Remat policies still see the forward's dot (custom_vjp's
    forward is traced under ``jax.checkpoint``): ``dots_saveable`` saves it as before.
    """
    return _linear(x, kernel, bias)


def projection(x: jax.Array, kernel, bias: jax.Array) -> jax.Array:
    """:func:`linear`, or for a kernel held quantized (``compute.quantization=int8`` / ``fp8``)
    its quantized product (:func:`jaxcore.quantization.dot_general`) plus ``bias``, or in a
    training step traced under :func:`jaxcore.quantization.training_products` its fp8
    training product."""
    dimensions = (((x.ndim - 1,), (0,)), ((), ()))
    if quantization.is_quantized_kernel(kernel):
        y = quantization.dot_general(x, kernel, dimensions)
        return y + bias.astype(y.dtype)
    if quantization.trains_quantized():  # a training step in fp8 (compute.quantization=fp8)
        return quantization.training_dot(x, kernel, dimensions) + bias.astype(x.dtype)
    return linear(x, kernel, bias)


def linear_runs_in_mkl(x: jax.Array, kernel: jax.Array) -> bool:
    """Whether :func:`linear` of ``x`` and the 2-D ``kernel`` runs its products in MKL here
    (:mod:`jaxcore.kernels.cpu_gemm`: float32 on one CPU device, MKL installed)."""
    return cpu_gemm.takes(x, kernel, (((x.ndim - 1,), (0,)), ((), ())))


def dense_general(x: jax.Array, kernel: jax.Array, bias: jax.Array, in_dims: int = 1):
    """``x``'s last ``in_dims`` axes contracted with ``kernel``'s first ``in_dims``, plus
    ``bias`` (shaped as the kernel's other axes): a Dense with a packed kernel (Flux's
    [D, 4, D] MLP, its [5, D, D] output projection; SD's GEGLU [D, 2, F]).

    One product either way, as a 2-D kernel (a free reshape of the row-major kernel; in MKL
    where :func:`linear` runs there) unless the packed axes are split over a tensor-parallel
    mesh axis: there a ``tensordot`` keeps the kernel's axes, and so their sharding, as they
    are (a merged axis would be split in strides, which the partitioner gathers). The 2-D
    form matters on TPU: with two contracting axes XLA re-lays each packed kernel out before
    the denoising loop and keeps the copies for the whole loop (Flux schnell on a v6e-4: 6.2
    GiB a chip for the 38 single blocks' [D, 4, D] and [5, D, D] kernels). A kernel held
    quantized runs its quantized product over the same axes."""
    contracting = tuple(range(x.ndim - in_dims, x.ndim)), tuple(range(in_dims))
    if quantization.is_quantized_kernel(kernel):
        return quantization.dot_general(x, kernel, (contracting, ((), ()))) + bias
    if quantization.trains_quantized():
        return quantization.training_dot(x, kernel, (contracting, ((), ()))) + bias
    in_size = math.prod(kernel.shape[:in_dims])
    out_shape = kernel.shape[in_dims:]
    flat_x = x.reshape(*x.shape[: x.ndim - in_dims], in_size)
    flat = kernel.reshape(in_size, math.prod(out_shape))
    if linear_runs_in_mkl(flat_x, flat):
        return linear(flat_x, flat, bias.reshape(-1)).reshape(*flat_x.shape[:-1], *out_shape)
    if not mlp_is_split():
        out = jnp.tensordot(flat_x, flat, 1) + bias.reshape(-1)
        return out.reshape(*flat_x.shape[:-1], *out_shape)
    return jnp.tensordot(x, kernel, in_dims) + bias


def mlp_is_split() -> bool:
    """Whether the logical ``mlp`` axis (the packed kernels' chunk width) is split over devices
    under the mesh being traced for and its rules; False outside a mesh. Where it is not,
    packed activations may be kept flat (chunks side by side): what TPU lays out best."""
    from jaxcore import sharding

    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        return False
    return sharding.logical_axis_size(mesh, "mlp", nn.get_logical_axis_rules() or None) > 1


def conv2d(x_bhwc: jax.Array, kernel_hwio: jax.Array, strides, padding) -> jax.Array:
    """A 2-D convolution, NHWC x HWIO with explicit ``padding`` pairs (a VAE's ``Conv2d``);
    this seam decides the library (MKL on one CPU device in float32, else XLA's).

    A kernel held quantized is dequantized here and the activations stay as they are, also
    for ``compute.quantization=int8`` / ``fp8``: a convolution's rows mix every position, so
    its activations can only take one scale per sample, and that costs the tiny SD UNet's
    render 0.161 relative L2 against 0.034 this way (torchao's int8 dynamic quantizes only
    Linear layers too)."""
    numbers = ("NHWC", "HWIO", "NHWC")
    kernel_hwio = quantization.dequantized(kernel_hwio, x_bhwc.dtype)

    def xla_conv(x, kernel):
        return jax.lax.conv_general_dilated(
            x,
            kernel,
            window_strides=strides,
            padding=list(padding),
            dimension_numbers=numbers,
        )

    return cpu_gemm.conv(x_bhwc, kernel_hwio, strides, padding, xla_conv)


def _accumulation_dtype(dtype):
    """float32 for bfloat16/float16 operands (as torch's bf16 GEMMs and the TPU's MXU
    accumulate), else the operands' own dtype."""
    return jnp.float32 if is_half_precision(dtype) else None


def _dot(a, b, dimensions):
    """``dot_general`` accumulating low-precision operands in float32 (see
    :func:`_accumulation_dtype`): on XLA CPU that is the dot which runs on AMX / AVX512-BF16
    (a bf16-in bf16-out dot does not): the Wan S forward in bf16 505 -> 295 ms on an AMX host,
    outputs no further from float32's (max 0.023). float32 products on CPU run in MKL where it
    is installed (:mod:`jaxcore.kernels.cpu_gemm`)."""
    return cpu_gemm.product(a, b, dimensions, _xla_dot)


def _xla_dot(a, b, dimensions):
    return jax.lax.dot_general(
        a, b, dimensions, preferred_element_type=_accumulation_dtype(a.dtype)
    )


def _linear(x, kernel, bias):
    y = _dot(x, kernel, (((x.ndim - 1,), (0,)), ((), ())))
    # bias added before the one rounding to x's dtype, as a GEMM epilogue does
    return (y + jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,)).astype(y.dtype)).astype(x.dtype)


def _linear_forward(x, kernel, bias):
    return _linear(x, kernel, bias), (x, kernel, bias)


def _linear_backward(residuals, dy):
    x, kernel, bias = residuals
    # as matrices [tokens, features]: dots with several contracting dimensions are slower
    x_2d = x.reshape(-1, x.shape[-1])
    dy_2d = dy.reshape(-1, dy.shape[-1])
    dx = _dot(dy_2d, kernel, (((1,), (1,)), ((), ()))).reshape(x.shape)
    dkernel = _weight_gradient(x_2d, dy_2d)
    dbias = jnp.sum(dy_2d, axis=0, dtype=_accumulation_dtype(dy_2d.dtype))
    return dx.astype(x.dtype), dkernel.astype(kernel.dtype), dbias.astype(bias.dtype)


linear.defvjp(_linear_forward, _linear_backward)


def _weight_gradient(x_2d: jax.Array, dy_2d: jax.Array) -> jax.Array:
    """``x^T dy`` over the tokens: [in, out]. In bf16 the left operand is a
    :func:`~jaxcore.kernels.products.transposed_copy` (on CPU written out first), so the
    product is the row-major one XLA CPU runs on YNNPACK in bf16 (AMX) instead of upcasting both
    operands to float32 for Eigen: 2.86 -> 0.57 ms at [1024, 512] x [1024, 512], the Wan S
    mixed-precision train step 1184 -> 960 ms. In float32 the copy does not pay (the step
    1676 vs 1701 ms), and XLA CPU upcasts fp16 products whatever their form (YNNPACK has no
    fp16 kernel). The product's result is only converted, never transposed (see
    :mod:`jaxcore.kernels.products` for why that matters)."""
    if x_2d.dtype != jnp.bfloat16:
        return _dot(x_2d, dy_2d, (((0,), (0,)), ((), ())))
    return _dot(transposed_copy(x_2d), dy_2d, (((1,), (0,)), ((), ())))


class Dense(nn.Module):
    """flax ``nn.Dense`` (parameters ``kernel`` [in, out] and ``bias`` [out], computed in
    ``dtype``) through :func:`linear`; the kernel and bias carry logical axis names. Without
    ``use_bias`` (torch ``Linear(bias=False)``) there is no bias parameter: :func:`linear` adds a
    zero constant, whose gradient nothing uses (XLA drops it)."""

    features: int
    axes: tuple[str | None, str | None]
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    use_bias: bool = True

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = self.param(
            "kernel",
            nn.with_logical_partitioning(nn.initializers.xavier_uniform(), self.axes),
            (x.shape[-1], self.features),
            self.param_dtype,
        )
        if self.use_bias:
            bias = self.param(
                "bias",
                nn.with_logical_partitioning(nn.initializers.zeros_init(), (self.axes[1],)),
                (self.features,),
                self.param_dtype,
            )
        else:
            bias = jnp.zeros((self.features,), self.param_dtype)
        dtype = self.dtype or jnp.result_type(x, bias)
        kernel = quantization.as_dtype(kernel, dtype)
        return projection(x.astype(dtype), kernel, bias.astype(dtype))


class HeadsEinsum(nn.Module):
    """A projection into or out of the attention heads' axes, ``einsum(spec, x, kernel)``, plus
    a bias over the kernel's last ``len(bias_axes)`` axes when ``bias_axes`` is given (CLIP's
    q/k/v/o; T5's are bias-free).

    The kernel keeps its 3-D shape from creation on, so a 3-name logical partitioning
    describes it under an active mesh (DenseGeneral creates a flattened 2-D kernel)."""

    shape: tuple[int, int, int]
    axes: tuple[str, str, str]
    spec: str
    kernel_init: Callable
    bias_axes: tuple[str, ...] | None = None
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = self.param(
            "kernel",
            nn.with_logical_partitioning(self.kernel_init, self.axes),
            self.shape,
            self.param_dtype,
        )
        x = x.astype(self.dtype)
        if quantization.is_quantized_kernel(kernel):
            out = quantization.einsum(self.spec, x, kernel)
        else:
            out = jnp.einsum(self.spec, x, kernel.astype(self.dtype))
        if self.bias_axes is None:
            return out
        bias = self.param(
            "bias",
            nn.with_logical_partitioning(nn.initializers.zeros_init(), self.bias_axes),
            self.shape[-len(self.bias_axes) :],
            self.param_dtype,
        )
        return out + bias.astype(self.dtype)


def dense(
    features: int,
    axes: tuple[str | None, str | None],
    name: str,
    dtype: Dtype,
    param_dtype: Dtype,
) -> Dense:
    """A Dense (= torch Linear with bias) whose kernel/bias carry logical axis names."""
    return Dense(features, axes, dtype=dtype, param_dtype=param_dtype, name=name)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def layer_norm(x: jax.Array, eps: float) -> jax.Array:
    """LayerNorm without affine over the last axis, in float32.

    The backward is written out, ``dx = rstd * (g - mean(g) - y * mean(g * y))`` from the saved
    output y: two reductions where autodiff's chain through mean, variance and rsqrt made
    more, and the demo DiT's train step 5% faster (the gradient equals autodiff's to float32
    rounding, tests/jaxcore/test_layers.py)."""
    return _layer_norm_forward(x, eps)[0]


def _layer_norm_forward(x, eps):
    x32 = x.astype(jnp.float32)
    centered = x32 - x32.mean(-1, keepdims=True)
    var = jnp.mean(centered * centered, axis=-1, keepdims=True)
    rstd = jax.lax.rsqrt(var + eps)
    y = centered * rstd
    # the input's dtype rides along as a scalar: custom_vjp residuals must be arrays
    return y, (y, rstd, jnp.zeros((), x.dtype))


def _layer_norm_backward(eps, residuals, g):
    del eps
    y, rstd, like_x = residuals
    g = g.astype(jnp.float32)
    return ((rstd * (g - mean_over_last(g) - y * mean_over_last(g * y))).astype(like_x.dtype),)


layer_norm.defvjp(_layer_norm_forward, _layer_norm_backward)


# Reductions in the backward passes below are matrix-vector products with a ones vector: XLA
# CPU's fused multiply-and-reduce (an XNNPACK "reduce" fusion) ran 4-16x slower than the same
# product, over tokens and over features alike (Wan S, [1, 1024, 512] float32, 2-core VM: over
# tokens 6.4 / 4.7 ms against 0.39 / 0.57; over features 1.7-2.0 ms against 0.36; the layer
# norm's backward 2.0 -> 0.6 ms). HIGHEST precision: a TPU otherwise multiplies float32 in one
# bf16 pass, which would round every gradient term before the sum.
_EXACT = jax.lax.Precision.HIGHEST


def mean_over_last(t: jax.Array) -> jax.Array:
    """``t.mean(-1, keepdims=True)`` (float32) as a product with ones."""
    ones = jnp.ones((t.shape[-1], 1), t.dtype)
    total = jnp.einsum(
        "...d,dk->...k", t, ones, precision=_EXACT, preferred_element_type=jnp.float32
    )
    return total / t.shape[-1]


def sum_over_leading(t: jax.Array) -> jax.Array:
    """``t`` summed over every axis but the last (float32 ``[D]``) as a product with ones (no
    reshape: the leading axes may be sharded over different mesh axes)."""
    leading = "abcdefghijklmnopqrstuvwxy"[: t.ndim - 1]
    ones = jnp.ones(t.shape[:-1], t.dtype)
    return jnp.einsum(
        f"{leading},{leading}z->z", ones, t, precision=_EXACT, preferred_element_type=jnp.float32
    )


def _sum_over_tokens(t_bld: jax.Array, like: jax.Array) -> jax.Array:
    """``t`` [B, L, D] summed to ``like``'s shape: over L when ``like`` is [B, 1, D] (one value
    per sample), unchanged when it is [B, L, D] (one per token); a product with ones."""
    if like.shape[1] != 1:
        return t_bld
    ones_bl = jnp.ones(t_bld.shape[:2], t_bld.dtype)
    summed = jnp.einsum(
        "bl,bld->bd", ones_bl, t_bld, precision=_EXACT, preferred_element_type=jnp.float32
    )
    return summed[:, None]


@jax.custom_vjp
def scale_shift(y: jax.Array, scale: jax.Array, shift: jax.Array) -> jax.Array:
    """``y * (1 + scale) + shift`` in float32 (adaLN modulation), ``y`` [B, L, D] and
    ``scale``/``shift`` [B, 1, D] or [B, L, D]; their gradients sum over tokens as matrix
    products (:func:`_sum_over_tokens`)."""
    return y * (1.0 + scale) + shift


def _scale_shift_forward(y, scale, shift):
    return scale_shift(y, scale, shift), (y, scale, shift)


def _scale_shift_backward(residuals, g):
    y, scale, shift = residuals
    g = g.astype(jnp.float32)
    return (
        (g * (1.0 + scale)).astype(y.dtype),
        _sum_over_tokens(g * y, scale).astype(scale.dtype),
        _sum_over_tokens(g, shift).astype(shift.dtype),
    )


scale_shift.defvjp(_scale_shift_forward, _scale_shift_backward)


@jax.custom_vjp
def gated_add(x: jax.Array, h: jax.Array, gate: jax.Array) -> jax.Array:
    """``x + h * gate`` in float32 (a gated residual), ``gate`` [B, 1, D] or [B, L, D]; its
    gradient sums over tokens as a matrix product (:func:`_sum_over_tokens`)."""
    return x.astype(jnp.float32) + h.astype(jnp.float32) * gate


def _gated_add_forward(x, h, gate):
    return gated_add(x, h, gate), (h, gate, jnp.zeros((), x.dtype))


def _gated_add_backward(residuals, g):
    h, gate, like_x = residuals
    g = g.astype(jnp.float32)
    return (
        g.astype(like_x.dtype),
        (g * gate).astype(h.dtype),
        _sum_over_tokens(g * h.astype(jnp.float32), gate).astype(gate.dtype),
    )


gated_add.defvjp(_gated_add_forward, _gated_add_backward)


@jax.custom_vjp
def affine(y: jax.Array, weight: jax.Array, bias: jax.Array) -> jax.Array:
    """``y * weight + bias`` in float32, ``weight``/``bias`` ``[D]`` over y's last axis (a
    LayerNorm's elementwise affine); their gradients sum as products with ones."""
    return y.astype(jnp.float32) * weight.astype(jnp.float32) + bias.astype(jnp.float32)


def _affine_forward(y, weight, bias):
    return affine(y, weight, bias), (y, weight, jnp.zeros((), bias.dtype))


def _affine_backward(residuals, g):
    y, weight, like_bias = residuals
    g = g.astype(jnp.float32)
    return (
        (g * weight.astype(jnp.float32)).astype(y.dtype),
        sum_over_leading(g * y.astype(jnp.float32)).astype(weight.dtype),
        sum_over_leading(g).astype(like_bias.dtype),
    )


affine.defvjp(_affine_forward, _affine_backward)


class AffineLayerNorm(nn.Module):
    """torch ``nn.LayerNorm(D, eps)`` with its elementwise affine (diffusers' ``FP32LayerNorm``
    too), computed in float32: :func:`layer_norm`, then :func:`affine`. Parameters ``scale``
    (ones) and ``bias`` (zeros) with the logical axis ``norm``, as flax ``nn.LayerNorm`` names
    them."""

    eps: float = 1e-5
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        d = x.shape[-1]
        init_one = nn.with_logical_partitioning(nn.initializers.ones_init(), ("norm",))
        init_zero = nn.with_logical_partitioning(nn.initializers.zeros_init(), ("norm",))
        scale = self.param("scale", init_one, (d,), self.param_dtype)
        bias = self.param("bias", init_zero, (d,), self.param_dtype)
        return affine(layer_norm(x, self.eps), scale, bias).astype(self.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """``x * rsqrt(mean(x^2) + eps) * scale`` over the last axis, statistics in float32, the
    result in x's dtype: flax ``nn.RMSNorm`` (diffusers' ``RMSNorm``), with the backward
    written out as :func:`layer_norm`'s is (two reductions from the saved normalised input)."""
    return _rms_norm_forward(x, scale, eps)[0]


def _rms_norm_forward(x, scale, eps):
    x32 = x.astype(jnp.float32)
    rstd = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    normed = x32 * rstd
    out = (normed * scale.astype(jnp.float32)).astype(x.dtype)
    return out, (normed, rstd, scale)


def _rms_norm_backward(eps, residuals, g):
    del eps
    normed, rstd, scale = residuals
    g32 = g.astype(jnp.float32)
    g_normed = g32 * scale.astype(jnp.float32)
    dx = rstd * (g_normed - normed * mean_over_last(g_normed * normed))
    dscale = sum_over_leading(g32 * normed)
    return dx.astype(g.dtype), dscale.astype(scale.dtype)


rms_norm.defvjp(_rms_norm_forward, _rms_norm_backward)


class RMSNorm(nn.Module):
    """flax ``nn.RMSNorm`` over the last axis (its ``scale`` parameter, ones-initialised, with
    the logical axis ``norm``) through :func:`rms_norm`."""

    epsilon: float = 1e-6
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param(
            "scale",
            nn.with_logical_partitioning(nn.initializers.ones_init(), ("norm",)),
            (x.shape[-1],),
            self.param_dtype,
        )
        return rms_norm(x.astype(self.dtype), scale, self.epsilon)


def gelu_tanh(x: jax.Array) -> jax.Array:
    """GELU with the tanh approximation (torch ``F.gelu(approximate="tanh")``), computed in
    float32 and rounded once to x's dtype."""
    return in_float32(functools.partial(jax.nn.gelu, approximate=True))(x)


def gelu_erf(x: jax.Array) -> jax.Array:
    """Exact (erf) GELU, torch's default ``F.gelu``, computed in float32 and rounded once."""
    return in_float32(functools.partial(jax.nn.gelu, approximate=False))(x)


def silu(x: jax.Array) -> jax.Array:
    """SiLU (torch ``F.silu``), computed in float32 and rounded once to x's dtype."""
    return in_float32(jax.nn.silu)(x)


def in_float32(activation: Callable[[jax.Array], jax.Array]) -> Callable[[jax.Array], jax.Array]:
    """``activation`` computed in float32, its result rounded once to the input's dtype.

    torch's CPU and CUDA kernels for GELU/SiLU in bf16/fp16 do this (and diffusers calls
    them); jax's composite ``gelu`` on a bf16 array instead rounds after each of its ~8 ops,
    which differs from torch (~40% of bf16 values, tests/jaxcore/test_layers.py) and, on XLA
    CPU, costs a bf16 -> f32 -> bf16 round trip per op (the Wan S forward in bf16 305 -> 285
    ms on an AMX host, alternated in one process).
    """

    def rounded_once(x: jax.Array) -> jax.Array:
        return activation(x.astype(jnp.float32)).astype(x.dtype)

    return rounded_once


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
