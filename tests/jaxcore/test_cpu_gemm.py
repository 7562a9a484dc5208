"""Dense products in MKL on CPU (jaxcore/kernels/cpu_gemm.py, native/mkl_gemm.cc).

Reference: float64 numpy products of the same operands (for bf16, of the bf16-rounded values),
and XLA's own dot on the same inputs. Tolerances: float32 products within 1e-6 of the sum of
the terms' magnitudes (|a| @ |b|: float32 summation error in any order is ~k * 2^-24 of it;
reached ~1e-7). Layer gradients
against XLA's path within 1e-5 of their largest magnitude (two float32 summation orders). Skipped with the reason where
MKL cannot run (not installed: ``pip install 'difforge[mkl]'``); the fallbacks are tested
everywhere.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcore import compute
from jaxcore.kernels import cpu_gemm
from jaxcore.models.layers import linear

REASON = cpu_gemm.unavailable()
needs_mkl = pytest.mark.skipif(REASON is not None, reason=f"MKL unavailable: {REASON}")


def _operands(m, n, k, transpose_a, transpose_b, seed=0):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((k, m) if transpose_a else (m, k)).astype(np.float32)
    b = rng.standard_normal((n, k) if transpose_b else (k, n)).astype(np.float32)
    return jnp.asarray(a), jnp.asarray(b)


def _exact(a, b, transpose_a, transpose_b):
    """(op(a) @ op(b), |op(a)| @ |op(b)|) in float64."""
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    a64 = a64.T if transpose_a else a64
    b64 = b64.T if transpose_b else b64
    return a64 @ b64, np.abs(a64) @ np.abs(b64)


# (m, n, k): single elements and vectors; odd sizes; products big enough to be split over the
# pool by rows (m >= n) and by columns (m < n), with slabs that do not divide evenly
SHAPES = [
    (1, 1, 1),
    (1, 300, 7),
    (300, 1, 7),
    (33, 17, 65),
    (601, 130, 513),
    (70, 1031, 257),
    (257, 129, 1031),
]
LAYOUTS = [(False, False), (False, True), (True, False), (True, True)]


@needs_mkl
@pytest.mark.parametrize("transpose_a,transpose_b", LAYOUTS)
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_gemm_equals_float64_product(m, n, k, transpose_a, transpose_b):
    a, b = _operands(m, n, k, transpose_a, transpose_b)
    got = jax.jit(lambda a, b: cpu_gemm.gemm(a, b, transpose_a, transpose_b))(a, b)
    assert got.shape == (m, n) and got.dtype == jnp.float32
    assert (
        cpu_gemm.TARGET
        in jax.jit(cpu_gemm.gemm, static_argnums=(2, 3))
        .lower(a, b, transpose_a, transpose_b)
        .as_text()
    )
    want, magnitude = _exact(a, b, transpose_a, transpose_b)
    error = np.abs(np.float64(got) - want)
    assert np.all(error <= 1e-6 * magnitude + 1e-30), float((error / magnitude).max())


@needs_mkl
def test_gemm_of_empty_operands():
    """k = 0 is all zeros (MKL itself refuses the zero leading dimension); m or n = 0 is
    empty."""
    a, b = jnp.ones((5, 0)), jnp.ones((0, 3))
    np.testing.assert_array_equal(
        jax.jit(cpu_gemm.gemm, static_argnums=(2, 3))(a, b, False, False), np.zeros((5, 3))
    )
    assert cpu_gemm.gemm(jnp.ones((0, 4)), jnp.ones((4, 3)), False, False).shape == (0, 3)


def _linear_loss(x, kernel, bias, upstream):
    return jnp.sum(linear(x, kernel, bias) * upstream)


@needs_mkl
@pytest.mark.parametrize("shape", [(5, 16), (2, 7, 16), (2, 3, 300, 16)])
def test_linear_forward_and_gradients_equal_xla_dot(shape, request):
    """The three products of a dense layer (x W, dy W^T, x^T dy) in MKL against XLA's dot."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    kernel = jnp.asarray(rng.standard_normal((16, 40)) / 4, jnp.float32)
    bias = jnp.asarray(rng.standard_normal(40), jnp.float32)
    upstream = jnp.asarray(rng.standard_normal((*shape[:-1], 40)), jnp.float32)

    def run():
        value_and_grads = jax.value_and_grad(_linear_loss, argnums=(0, 1, 2))
        forward = jax.jit(lambda *args: linear(*args))  # a new function: traced afresh
        return (
            forward(x, kernel, bias),
            jax.jit(value_and_grads)(x, kernel, bias, upstream),
            forward.lower(x, kernel, bias).as_text(),
        )

    out, (loss, grads), program = run()
    assert cpu_gemm.TARGET in program
    request.getfixturevalue("xla_dots")
    ref_out, (ref_loss, ref_grads), ref_program = run()
    assert cpu_gemm.TARGET not in ref_program
    np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for got, want in zip(grads, ref_grads, strict=True):  # sums over up to 1,800 tokens
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * float(np.abs(want).max()))


@needs_mkl
def test_vmapped_linear_runs_each_product():
    rng = np.random.default_rng(2)
    xs = jnp.asarray(rng.standard_normal((3, 4, 16)), jnp.float32)
    kernels = jnp.asarray(rng.standard_normal((3, 16, 8)), jnp.float32)
    bias = jnp.zeros((8,), jnp.float32)
    got = jax.jit(jax.vmap(linear, in_axes=(0, 0, None)))(xs, kernels, bias)
    np.testing.assert_allclose(got, np.einsum("bik,bkn->bin", xs, kernels), rtol=1e-5, atol=1e-5)


def _grad_program(x, kernel, bias, upstream) -> str:
    return jax.jit(jax.grad(_linear_loss, argnums=(0, 1, 2))).lower(x, kernel, bias, upstream)


def test_products_over_several_devices_stay_xla_dots():
    """A custom call has no sharding rule: under a multi-device mesh, and on operands placed
    over several devices, the products are XLA's dots (and the gradients still right)."""
    devices = np.array(jax.devices()[:4]).reshape(2, 2)
    mesh = jax.sharding.Mesh(devices, ("data", "tensor"))
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((4, 6, 16)), jnp.float32)
    kernel = jnp.asarray(rng.standard_normal((16, 8)), jnp.float32)
    bias, upstream = jnp.zeros((8,), jnp.float32), jnp.ones((4, 6, 8), jnp.float32)
    with jax.set_mesh(mesh):
        assert cpu_gemm.TARGET not in _grad_program(x, kernel, bias, upstream).as_text()
    placed = jax.device_put(x, NamedSharding(mesh, P("data", None, None)))
    assert cpu_gemm.TARGET not in _grad_program(placed, kernel, bias, upstream).as_text()
    one_device = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    with jax.set_mesh(one_device):
        program = _grad_program(x, kernel, bias, upstream).as_text()
    assert (cpu_gemm.TARGET in program) == (REASON is None)


def test_bf16_and_batched_products_stay_xla_dots():
    """MKL takes float32 dense products only (its bf16 GEMM was no faster than XLA's AMX
    products in the Wan models); other products are XLA's."""
    x, kernel = jnp.ones((4, 16), jnp.bfloat16), jnp.ones((16, 8), jnp.bfloat16)
    program = jax.jit(linear).lower(x, kernel, jnp.zeros((8,), jnp.bfloat16)).as_text()
    assert cpu_gemm.TARGET not in program
    batched = (((2,), (1,)), ((0,), (0,)))
    a, b = jnp.ones((2, 4, 16)), jnp.ones((2, 16, 8))
    assert not cpu_gemm.takes(a, b, batched)


def test_other_platforms_lower_xla_dots():
    """Lowered for a TPU (the fit check compiles for TPUs on a CPU host) the products are dots."""
    x, kernel = jnp.ones((4, 16), jnp.float32), jnp.ones((16, 8), jnp.float32)
    bias, upstream = jnp.zeros((8,), jnp.float32), jnp.ones((4, 8), jnp.float32)
    traced = jax.jit(jax.grad(_linear_loss, argnums=(0, 1, 2))).trace(x, kernel, bias, upstream)
    for_tpu = traced.lower(lowering_platforms=("tpu",)).as_text()
    assert cpu_gemm.TARGET not in for_tpu and "dot_general" in for_tpu


@needs_mkl
def test_remat_policies_save_the_mkl_products():
    """``dots_saveable`` keeps saving the dense products when they are MKL custom calls: the
    rematerialised gradient runs no more products than the plain one (jax's own policy alone
    would recompute the first layer's)."""
    x, kernel = jnp.ones((8, 16), jnp.float32), jnp.ones((16, 16), jnp.float32) / 16
    bias = jnp.zeros((16,), jnp.float32)

    def two_layers(x, kernel):
        return jnp.sum(linear(jnp.tanh(linear(x, kernel, bias)), kernel, bias) ** 2)

    def products(policy) -> int:
        fn = two_layers if policy is None else jax.checkpoint(two_layers, policy=policy)
        program = jax.jit(jax.grad(fn, argnums=(0, 1))).lower(x, kernel).as_text()
        return program.count(cpu_gemm.TARGET)

    plain = products(None)
    assert products(compute.REMAT_POLICIES["dots_saveable"]) == plain
    assert products(compute.REMAT_POLICIES["dots_with_no_batch_dims_saveable"]) == plain
    assert products(jax.checkpoint_policies.dots_saveable) > plain


def test_switches_and_library_lookup(monkeypatch, tmp_path):
    monkeypatch.setenv(cpu_gemm.ENV, "0")
    assert cpu_gemm._unavailable_reason() == "DIFFORGE_MKL=0"
    monkeypatch.setenv(cpu_gemm.ENV, "1")
    monkeypatch.setenv("DIFFORGE_NATIVE_KERNELS", "0")
    assert cpu_gemm._unavailable_reason() == "DIFFORGE_NATIVE_KERNELS=0"
    monkeypatch.delenv("DIFFORGE_NATIVE_KERNELS")
    missing = tmp_path / "libmkl_rt.so.3"
    monkeypatch.setenv(cpu_gemm.ENV, str(missing))
    assert cpu_gemm.find_library() == str(missing)
    assert cpu_gemm._unavailable_reason() == f"{tmp_path} lacks libmkl_intel_lp64.so.3"
    for part in ("rt", "intel_lp64", "sequential", "core"):
        (tmp_path / f"libmkl_{part}.so.3").touch()
    assert cpu_gemm.link_flags(missing)[2:] == (
        "-l:libmkl_intel_lp64.so.3",
        "-l:libmkl_sequential.so.3",
        "-l:libmkl_core.so.3",
    )


@needs_mkl
def test_mkl_stays_out_of_the_global_symbol_scope():
    """After a product has run, MKL's libraries are not in the process's global symbol scope.
    Loaded through ``libmkl_rt`` they were (``cblas_sgemm`` and MKL's service calls resolvable
    from anywhere), and a PyTorch imported afterwards bound its own MKL's threading calls to
    them and ran its GEMM single-threaded (336 -> 175 GFLOP/s). ``cblas_sgemm`` is the witness:
    no library the suite loads exports it (PyTorch exports MKL's service calls, not it; numpy's
    and scipy's OpenBLAS prefix theirs)."""
    import ctypes

    x = jnp.ones((64, 64), jnp.float32)
    jax.jit(lambda a: cpu_gemm.gemm(a, a, False, False))(x).block_until_ready()
    assert not hasattr(ctypes.CDLL(None), "cblas_sgemm")


def _packed_runs(module, params, x):
    """(output, (loss, gradients), the gradient program's text) of ``module`` at ``x``."""

    def loss(params, x):
        return jnp.sum(jnp.sin(module.apply(params, x)))

    grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    program = grads.lower(params, x).as_text()
    forward = jax.jit(lambda params, x: module.apply(params, x))  # a new function: traced afresh
    return forward(params, x), grads(params, x), program


@needs_mkl
@pytest.mark.parametrize(
    "name,shape", [("ChunkedMLPIn", (2, 5, 32)), ("PackedProjOut", (2, 5, 5, 32))]
)
def test_flux_packed_projections_are_one_mkl_product_each(name, shape, request):
    """Flux's single-stream ``proj_mlp`` ([D, 4, D]) and ``proj_out`` ([5, D, D]) on one CPU
    device: one flat dense product each (forward and gradients) in MKL, equal to the chunked
    einsums XLA runs where they are sharded."""
    from jaxcore.models import flux_transformer

    module = getattr(flux_transformer, name)(32)
    x = jnp.asarray(np.random.default_rng(4).standard_normal(shape), jnp.float32)
    params = jax.tree.map(lambda p: p + 0.1, nn.unbox(module.init(jax.random.key(0), x)))
    out, (value, grads), program = _packed_runs(module, params, x)
    assert program.count(cpu_gemm.TARGET) == 3
    request.getfixturevalue("xla_dots")
    ref_out, (ref_value, ref_grads), ref_program = _packed_runs(module, params, x)
    assert cpu_gemm.TARGET not in ref_program and "dot_general" in ref_program
    np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * float(np.abs(want).max()))


# --- convolutions ----------------------------------------------------------------------------


def _xla_conv(padding, strides=(1, 1)):
    def conv(x, kernel):
        return jax.lax.conv_general_dilated(
            x, kernel, strides, list(padding), dimension_numbers=("NHWC", "HWIO", "NHWC")
        )

    return conv


def _conv_exact(x, kernel, padding):
    """(the convolution, the same of |x| and |kernel|) in float64, tap by tap."""
    (top, bottom), (left, right) = padding
    x64 = np.pad(np.asarray(x, np.float64), ((0, 0), (top, bottom), (left, right), (0, 0)))
    k64 = np.asarray(kernel, np.float64)
    kh, kw = k64.shape[:2]
    h, w = x64.shape[1] - kh + 1, x64.shape[2] - kw + 1
    out = np.zeros((x64.shape[0], h, w, k64.shape[-1]))
    bound = np.zeros_like(out)
    for i in range(kh):
        for j in range(kw):
            window = x64[:, i : i + h, j : j + w]
            out += window @ k64[i, j]
            bound += np.abs(window) @ np.abs(k64[i, j])
    return out, bound


# (x shape, kernel size, padding): 3 x 3 "same"; odd sizes and a batch; a 1 x 1; asymmetric
# and one-sided padding; an image no wider than the kernel; big enough to be split in blocks
CONVS = [
    ((1, 5, 5, 3, 4), 3, ((1, 1), (1, 1))),
    ((3, 7, 5, 8, 3), 3, ((1, 1), (1, 1))),
    ((2, 6, 9, 16, 5), 1, ((0, 0), (0, 0))),
    ((1, 6, 9, 5, 7), 3, ((0, 1), (2, 0))),
    ((1, 1, 1, 4, 6), 3, ((1, 1), (1, 1))),
    ((2, 37, 29, 24, 40), 3, ((1, 1), (1, 1))),
]


@needs_mkl
@pytest.mark.parametrize("shape,size,padding", CONVS)
def test_conv_equals_float64_convolution_and_xla_gradients(shape, size, padding):
    """The custom call's convolution against a float64 one within float32 rounding of its terms
    (|x| * |kernel| bounds them); its gradients are XLA's convolution's (the custom VJP)."""
    b, h, w, c, o = shape
    rng = np.random.default_rng(sum(shape))
    x = jnp.asarray(rng.standard_normal((b, h, w, c)), jnp.float32)
    kernel = jnp.asarray(rng.standard_normal((size, size, c, o)), jnp.float32)
    xla = _xla_conv(padding)
    ours = jax.jit(lambda x, k: cpu_gemm.conv(x, k, (1, 1), padding, xla))
    assert cpu_gemm.CONV_TARGET in ours.lower(x, kernel).as_text()
    exact, bound = _conv_exact(x, kernel, padding)
    got = np.asarray(ours(x, kernel))
    assert got.shape == exact.shape
    assert np.all(np.abs(got - exact) <= 4 * size * size * c * 2**-24 * bound + 1e-30)

    def loss(conv):
        return lambda x, k: jnp.sum(jnp.sin(conv(x, k)))

    grads = jax.jit(jax.grad(loss(lambda x, k: cpu_gemm.conv(x, k, (1, 1), padding, xla)), (0, 1)))
    want = jax.jit(jax.grad(loss(xla), (0, 1)))(x, kernel)
    for g, r in zip(grads(x, kernel), want, strict=True):
        np.testing.assert_allclose(g, r, rtol=0, atol=1e-4 * float(np.abs(r).max()))


def test_convolutions_mkl_does_not_take_stay_xla():
    """Strided, bf16, negatively padded and several-device convolutions are XLA's."""
    x, kernel = jnp.ones((1, 8, 8, 4), jnp.float32), jnp.ones((3, 3, 4, 4), jnp.float32)
    same = ((1, 1), (1, 1))
    assert not cpu_gemm.conv_takes(x, kernel, (2, 2), same)
    assert not cpu_gemm.conv_takes(x.astype(jnp.bfloat16), kernel, (1, 1), same)
    assert not cpu_gemm.conv_takes(x, kernel, (1, 1), ((-1, 0), (0, 0)))
    assert not cpu_gemm.conv_takes(x[:, :1, :1], kernel, (1, 1), ((0, 0), (0, 0)))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))
    placed = jax.device_put(jnp.ones((2, 8, 8, 4)), NamedSharding(mesh, P("data")))
    conv = jax.jit(lambda x, k: cpu_gemm.conv(x, k, (1, 1), same, _xla_conv(same)))
    program = conv.lower(placed, kernel).as_text()
    assert cpu_gemm.CONV_TARGET not in program and "convolution" in program
    for_tpu = conv.trace(x, kernel).lower(lowering_platforms=("tpu",)).as_text()
    assert cpu_gemm.CONV_TARGET not in for_tpu and "convolution" in for_tpu


@needs_mkl
def test_unet_and_vae_convolutions_and_projections_run_in_mkl(request):
    """The SD UNet's stride-1 convolutions and its attention / GEGLU projections are MKL custom
    calls on one CPU device (the stride-2 downsamplers stay XLA's), and the forward equals the
    all-XLA one."""
    from jaxcore.models import unet_2d_condition as unet

    config = unet.UNet2DConditionConfig.from_dict(
        {
            "block_out_channels": [32, 64],
            "down_block_types": [unet.CROSS_DOWN, unet.DOWN],
            "up_block_types": [unet.UP, unet.CROSS_UP],
            "layers_per_block": 1,
            "attention_head_dim": [2, 4],
            "use_linear_projection": True,
            "cross_attention_dim": 16,
            "norm_num_groups": 8,
            "sample_size": 8,
        }
    )
    module, params = unet.init_unet_2d_condition(config, jax.random.key(0))
    rng = np.random.default_rng(5)
    args = (
        jnp.asarray(rng.standard_normal((1, 4, 8, 8)), jnp.float32),
        jnp.full((1,), 500.0),
        jnp.asarray(rng.standard_normal((1, 7, 16)), jnp.float32),
    )

    def forward():
        fn = jax.jit(lambda params, *args: module.apply({"params": params}, *args))
        return fn(params, *args), fn.lower(params, *args).as_text()

    out, program = forward()
    # stride-1 convolutions: conv_in, conv_out, 8 resnets' conv1 / conv2, 5 of them widening
    # (a 1 x 1 shortcut), the upsampler; only the stride-2 downsampler is XLA's
    assert program.count(cpu_gemm.CONV_TARGET) == 2 + 8 * 2 + 5 + 1
    assert program.count("convolution") == 1
    # dense products: 4 transformers x (proj_in, proj_out, self and cross q / k / v / out,
    # GEGLU's two), 8 resnets' time projections, the time MLP's two; XLA's dots are left to the
    # attention scores and values (4 x 2 attentions x 2)
    assert program.count(cpu_gemm.TARGET) == 4 * 12 + 8 + 2
    assert program.count("dot_general") == 4 * 2 * 2
    request.getfixturevalue("xla_dots")
    ref, ref_program = forward()
    assert cpu_gemm.CONV_TARGET not in ref_program
    np.testing.assert_allclose(out, ref, rtol=0, atol=2e-5 * float(np.abs(ref).max()))
