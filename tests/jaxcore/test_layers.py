"""The shared Dense (jaxcore.models.layers): flax nn.Dense's parameters and forward, and a
written-out backward equal to autodiff's, in float32 and bfloat16, unsharded and sharded."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcore.models.layers import Dense, RMSNorm, gelu_erf, gelu_tanh, layer_norm, linear, silu

AXES = ("embed", "mlp")


def _modules(features, dtype=jnp.float32):
    ours = Dense(features, AXES, dtype=dtype, param_dtype=jnp.float32)
    # the initializers difforge's dense always used (xavier-uniform kernel, zero bias)
    flax_dense = nn.Dense(
        features,
        dtype=dtype,
        param_dtype=jnp.float32,
        kernel_init=nn.initializers.xavier_uniform(),
    )
    return ours, flax_dense


def _inputs(shape, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _random_params(module, x, seed):
    """The module's parameters with a non-zero bias (its init is zeros)."""
    params = nn.unbox(module.init(jax.random.key(seed), x))["params"]
    bias = _inputs(params["bias"].shape, seed + 1)
    return {"kernel": params["kernel"], "bias": bias}


def _loss_and_grads(module, params, x, upstream):
    def loss(p, x):
        return jnp.sum(module.apply({"params": p}, x).astype(jnp.float32) * upstream)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, x)


def test_parameters_are_flax_dense_parameters():
    ours, flax_dense = _modules(24)
    x = _inputs((3, 16))
    ours_params = nn.unbox(ours.init(jax.random.key(7), x))["params"]
    flax_params = flax_dense.init(jax.random.key(7), x)["params"]
    assert jax.tree.map(jnp.shape, ours_params) == jax.tree.map(jnp.shape, flax_params)
    np.testing.assert_array_equal(ours_params["kernel"], flax_params["kernel"])
    np.testing.assert_array_equal(ours_params["bias"], flax_params["bias"])
    boxed = ours.init(jax.random.key(7), x)["params"]
    assert boxed["kernel"].names == AXES and boxed["bias"].names == ("mlp",)


@pytest.mark.parametrize("shape", [(5, 16), (2, 7, 16), (2, 3, 4, 16)])
def test_forward_and_gradients_equal_flax_dense_float32(shape):
    ours, flax_dense = _modules(24)
    x = _inputs(shape)
    params = _random_params(ours, x, seed=3)
    upstream = _inputs((*shape[:-1], 24), seed=9)
    np.testing.assert_array_equal(
        ours.apply({"params": params}, x), flax_dense.apply({"params": params}, x)
    )
    (loss, (grad_params, grad_x)) = _loss_and_grads(ours, params, x, upstream)
    (ref_loss, (ref_params, ref_x)) = _loss_and_grads(flax_dense, params, x, upstream)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    # summation order may differ between the two dots; float32 rounding only
    np.testing.assert_allclose(grad_x, ref_x, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grad_params["kernel"], ref_params["kernel"], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grad_params["bias"], ref_params["bias"], rtol=1e-5, atol=1e-5)
    # and the gradients are right, not only equal: against float64 numpy
    x64, k64 = np.float64(x).reshape(-1, 16), np.float64(params["kernel"])
    up64 = np.float64(upstream).reshape(-1, 24)
    np.testing.assert_allclose(grad_params["kernel"], x64.T @ up64, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grad_params["bias"], up64.sum(0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.reshape(grad_x, (-1, 16)), up64 @ k64.T, rtol=1e-5, atol=1e-5)


def test_bfloat16_compute_with_float32_parameters_rounds_once_like_torch():
    """bf16 operands are multiplied and summed in float32, the bias added, and the result
    rounded to bf16 once, as torch's bf16 ``F.linear`` does (flax's Dense rounds the product,
    then the sum with the bias: two roundings). Against the float64 value of the rounded
    operands every output is within half a bf16 ulp plus the float32 sum's error, and torch's
    bf16 output is matched to one ulp."""
    import torch

    ours, flax_dense = _modules(32, dtype=jnp.bfloat16)
    x = _inputs((4, 8, 64))
    params = _random_params(ours, x, seed=5)
    upstream = _inputs((4, 8, 32), seed=11)
    out = ours.apply({"params": params}, x)
    assert out.dtype == jnp.bfloat16
    exact = _as_float64(x) @ _as_float64(params["kernel"]) + _as_float64(params["bias"])
    got = np.asarray(out.astype(jnp.float32), np.float64)
    ulp = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(exact), 1e-30))) - 7)
    assert np.all(np.abs(got - exact) <= 0.5 * ulp + 1e-5 * np.abs(exact) + 1e-6)
    twice = np.asarray(flax_dense.apply({"params": params}, x).astype(jnp.float32), np.float64)
    assert np.abs(got - exact).mean() < np.abs(twice - exact).mean()  # fewer roundings
    reference = torch.nn.functional.linear(
        torch.from_numpy(np.array(x)).bfloat16(),
        torch.from_numpy(np.asarray(params["kernel"]).T.copy()).bfloat16(),
        torch.from_numpy(np.asarray(params["bias"])).bfloat16(),
    ).float()
    assert np.all(np.abs(got - reference.numpy()) <= ulp + 1e-6)
    x = _inputs((4, 8, 16))  # the gradients below: a contraction over 16
    params = _random_params(ours, x, seed=5)
    (_, (grad_params, grad_x)) = _loss_and_grads(ours, params, x, upstream)
    assert grad_params["kernel"].dtype == jnp.float32 and grad_x.dtype == jnp.float32
    # against float64 sums of the bf16-rounded operands: each gradient is a sum of products
    # rounded to bf16 along the way, so its error is bounded by a few bf16 ulps (2^-8) of the
    # sum of the terms' magnitudes (autodiff's bias gradient was 0.097 off where ours was 0.054)
    x64 = _as_float64(x).reshape(-1, 16)
    up64 = _as_float64(upstream).reshape(-1, 32)
    k64 = _as_float64(params["kernel"])
    expected = {
        "x": (up64 @ k64.T, np.abs(up64) @ np.abs(k64.T), np.reshape(grad_x, (-1, 16))),
        "kernel": (x64.T @ up64, np.abs(x64.T) @ np.abs(up64), grad_params["kernel"]),
        "bias": (up64.sum(0), np.abs(up64).sum(0), grad_params["bias"]),
    }
    for name, (want, magnitude, got) in expected.items():
        error = np.abs(np.float64(got) - want)
        assert np.all(error <= 2**-7 * magnitude + 1e-6), (name, float(error.max()))


def _as_float64(a):
    """The array as bf16 rounds it, in float64."""
    return np.asarray(jnp.asarray(a).astype(jnp.bfloat16).astype(jnp.float32), np.float64)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gradients_sharded_over_data_and_tensor_equal_unsharded(dtype):
    """bf16: the weight gradient's transposed copy (a while loop, on CPU) is partitioned as
    the product it feeds, tokens sharded over ``data``."""
    devices = np.array(jax.devices()[:4]).reshape(2, 2)
    mesh = jax.sharding.Mesh(devices, ("data", "tensor"))
    x = _inputs((4, 6, 16)).astype(dtype)
    kernel, bias = _inputs((16, 8), 1).astype(dtype), _inputs((8,), 2).astype(dtype)
    upstream = _inputs((4, 6, 8), 3).astype(dtype)

    def loss(x, kernel, bias):
        return jnp.sum(linear(x, kernel, bias) * upstream)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    unsharded = grads(x, kernel, bias)
    sharded = grads(
        jax.device_put(x, NamedSharding(mesh, P("data", None, None))),
        jax.device_put(kernel, NamedSharding(mesh, P(None, "tensor"))),
        jax.device_put(bias, NamedSharding(mesh, P("tensor"))),
    )
    # bf16: the same float32 sums, split over devices in another order, then rounded to bf16
    tolerance = 1e-6 if dtype == jnp.float32 else 2**-7
    for got, want in zip(sharded, unsharded, strict=True):
        assert got.dtype == dtype
        np.testing.assert_allclose(
            np.float32(got), np.float32(want), rtol=tolerance, atol=tolerance
        )


def _fused_parameter_types(program: str, result: str) -> list[str]:
    """The element types of the parameters of the YNNPACK fusion computing ``result`` (e.g.
    ``f32[16,24]``) in a compiled CPU program's text."""
    (line,) = [
        line for line in program.splitlines() if f"= {result}" in line and "kind=kCustom" in line
    ]
    computation = line.split("calls=")[1].split(",")[0]
    header = next(line for line in program.splitlines() if line.startswith(f"{computation} ("))
    return [part.split("[")[0].split(": ")[1] for part in header.split(") ->")[0].split(", ")]


def test_bf16_weight_gradient_is_a_bf16_product_on_cpu():
    """The reason the weight gradient reads a ``transposed_copy``: compiled for the CPU, the
    bf16 weight gradient x^T dy is a YNNPACK (AMX) product of bf16 operands, not the float32
    Eigen product XLA upcasts a dot contracting its left operand's first axis to (fails with
    the plain ``_dot(x, dy, TN)``). Lowered for a TPU, the same gradient has no loop: the
    transpose folds into the product there."""
    x = _inputs((2, 32, 16)).astype(jnp.bfloat16)
    kernel, bias = _inputs((16, 24), 1).astype(jnp.bfloat16), jnp.zeros((24,), jnp.bfloat16)

    def loss(x, kernel, bias):
        return jnp.sum(linear(x, kernel, bias).astype(jnp.float32) ** 2)

    weight_gradient = jax.jit(jax.grad(loss, argnums=1))
    program = weight_gradient.lower(x, kernel, bias).compile().as_text()
    assert _fused_parameter_types(program, "f32[16,24]") == ["bf16", "bf16"]
    for_tpu = weight_gradient.trace(x, kernel, bias).lower(lowering_platforms=("tpu",))
    assert "while" not in for_tpu.as_text()


def _autodiff_layer_norm(x, eps):
    x = x.astype(jnp.float32)
    centered = x - x.mean(-1, keepdims=True)
    var = jnp.mean(centered * centered, axis=-1, keepdims=True)
    return centered * jax.lax.rsqrt(var + eps)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_layer_norm_gradient_equals_autodiff(dtype):
    # an offset and a scale per row, so mean and variance both matter
    x = (_inputs((3, 5, 64)) * 3.0 + _inputs((3, 5, 1), 1) * 4.0).astype(dtype)
    upstream = _inputs((3, 5, 64), 2)

    def loss(norm):
        return lambda x: jnp.sum(norm(x, 1e-6) * upstream)

    np.testing.assert_array_equal(layer_norm(x, 1e-6), _autodiff_layer_norm(x, 1e-6))
    grad = jax.jit(jax.grad(loss(layer_norm)))(x)
    want = jax.jit(jax.grad(loss(_autodiff_layer_norm)))(x)
    assert grad.dtype == dtype
    if dtype == jnp.float32:
        np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-6)
    else:  # both computed in float32, rounded once to bf16: one bf16 ulp apart at most
        np.testing.assert_allclose(
            np.float32(grad), np.float32(want), rtol=2**-7, atol=2**-7 * float(jnp.abs(want).max())
        )
    # and right: against float64 finite differences along a random direction
    direction = _inputs((3, 5, 64), 3)
    x64 = np.float64(np.asarray(x.astype(jnp.float32)))

    def loss64(v):
        c = v - v.mean(-1, keepdims=True)
        return np.sum(c / np.sqrt((c * c).mean(-1, keepdims=True) + 1e-6) * np.float64(upstream))

    h = 1e-4
    numeric = (loss64(x64 + h * direction) - loss64(x64 - h * direction)) / (2 * h)
    analytic = float(jnp.sum(np.float64(np.float32(grad)) * np.float64(direction)))
    assert abs(analytic - numeric) <= 2e-2 * max(1.0, abs(numeric)), (analytic, numeric)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rms_norm_equals_flax_rms_norm_and_its_autodiff(dtype):
    """RMSNorm's forward, input gradient and scale gradient against flax nn.RMSNorm (the module
    Wan's and Flux's q/k norms used before), which autodiff differentiates; same parameters."""
    x = (_inputs((3, 5, 64)) * 3.0).astype(dtype)
    scale = 1.0 + 0.1 * _inputs((64,), 1)
    upstream = _inputs((3, 5, 64), 2)
    ours_module = RMSNorm(1e-6, dtype=dtype)
    flax_module = nn.RMSNorm(epsilon=1e-6, dtype=dtype)
    assert jax.tree.map(
        jnp.shape, nn.unbox(ours_module.init(jax.random.key(0), x))
    ) == jax.tree.map(jnp.shape, flax_module.init(jax.random.key(0), x))

    def loss(module):
        return lambda x, scale: jnp.sum(
            module.apply({"params": {"scale": scale}}, x).astype(jnp.float32) * upstream
        )

    got_out = ours_module.apply({"params": {"scale": scale}}, x)
    want_out = flax_module.apply({"params": {"scale": scale}}, x)
    assert got_out.dtype == want_out.dtype == dtype
    got = jax.jit(jax.grad(loss(ours_module), argnums=(0, 1)))(x, scale)
    want = jax.jit(jax.grad(loss(flax_module), argnums=(0, 1)))(x, scale)
    if dtype == jnp.float32:
        np.testing.assert_allclose(got_out, want_out, rtol=1e-6, atol=1e-6)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
    else:  # both in float32 inside, rounded once to bf16: an ulp apart at most
        for g, w in zip((got_out, *got), (want_out, *want), strict=True):
            g, w = np.float32(g), np.float32(w)
            np.testing.assert_allclose(g, w, rtol=2**-7, atol=2**-7 * float(np.abs(w).max()))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_affine_layer_norm_equals_torch_layer_norm_and_its_gradients(dtype):
    """AffineLayerNorm (Wan's norm2 and image-embedder norms, the UNet's transformer norms)
    against torch nn.LayerNorm: output and the gradients of the input, weight and bias, with the
    parameter tree flax nn.LayerNorm (the module it replaced) has, so checkpoints load as
    before."""
    import torch

    from jaxcore.models.layers import AffineLayerNorm

    x = (_inputs((2, 9, 48)) * 3.0 + _inputs((2, 9, 1), 1)).astype(dtype)
    weight, bias = 1.0 + 0.1 * _inputs((48,), 2), 0.1 * _inputs((48,), 3)
    upstream = _inputs((2, 9, 48), 4)
    module = AffineLayerNorm(eps=1e-5)
    shapes = jax.tree.map(jnp.shape, nn.unbox(module.init(jax.random.key(0), x)))
    assert shapes == jax.tree.map(jnp.shape, nn.LayerNorm().init(jax.random.key(0), x))

    def loss(x, scale, bias):
        out = module.apply({"params": {"scale": scale, "bias": bias}}, x)
        return jnp.sum(out * upstream), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
        x, weight, bias
    )
    torch_norm = torch.nn.LayerNorm(48, eps=1e-5)
    with torch.no_grad():
        torch_norm.weight.copy_(torch.from_numpy(np.array(weight)))
        torch_norm.bias.copy_(torch.from_numpy(np.array(bias)))
    x_t = torch.from_numpy(np.float32(np.asarray(x.astype(jnp.float32)))).requires_grad_()
    out_t = torch_norm(x_t)  # float32 inside, as diffusers' FP32LayerNorm
    (out_t * torch.from_numpy(np.asarray(upstream))).sum().backward()
    want = (x_t.grad, torch_norm.weight.grad, torch_norm.bias.grad)
    assert out.dtype == jnp.float32 and grads[0].dtype == dtype
    np.testing.assert_allclose(out, out_t.detach().numpy(), rtol=1e-5, atol=1e-5)
    tolerance = 1e-5 if dtype == jnp.float32 else 2**-7  # bf16: dx rounded once to bf16
    for got, w in zip(grads, want, strict=True):
        w = w.numpy()
        np.testing.assert_allclose(
            np.float32(got), w, rtol=tolerance, atol=tolerance * abs(w).max()
        )


def test_norm_backwards_reduce_as_matrix_products():
    """The reason the norms' backward passes are written out with products: compiled for the
    CPU, their gradients contain no reduction over the [tokens, D] data (XLA CPU's reductions
    ran 4-16x slower than the products; the comment above ``mean_over_last``)."""
    from jaxcore.models.layers import AffineLayerNorm

    x = _inputs((1, 256, 64))
    # module, the reductions its forward's statistics need (mean and variance; mean square)
    norms = {"affine": (AffineLayerNorm(), 2), "rms": (RMSNorm(1e-6), 1)}
    for name, (module, forward_reductions) in norms.items():
        params = nn.unbox(module.init(jax.random.key(0), x))

        def loss(params, x, module=module):
            return jnp.sum(module.apply(params, x) ** 2)

        backward = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, x).compile().as_text()
        reductions = [line for line in backward.splitlines() if " reduce(" in line]
        # autodiff's (or jnp.mean / jnp.sum's) backward adds 2-4 more: per token and per feature
        assert len(reductions) == forward_reductions, (name, reductions)
        assert " dot(" in backward


@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("batch", [1, 3])
def test_scale_shift_and_gated_add_gradients_equal_autodiff(batch, per_token):
    """The modulation and the gated residual against autodiff of the same expressions, for
    per-sample ([B, 1, D]: gradients summed over tokens) and per-token ([B, L, D]) parameters."""
    from jaxcore.models.layers import gated_add, scale_shift

    tokens = 7
    x, y, h = (_inputs((batch, tokens, 16), seed) for seed in (0, 1, 2))
    rows = tokens if per_token else 1
    scale, shift, gate = (_inputs((batch, rows, 16), seed) for seed in (3, 4, 5))
    upstream = _inputs((batch, tokens, 16), 6)

    def loss(fn):
        return lambda *args: jnp.sum(fn(*args) * upstream)

    cases = (
        (scale_shift, lambda y, s, b: y * (1.0 + s) + b, (y, scale, shift)),
        (gated_add, lambda x, h, g: x + h * g, (x, h, gate)),
    )
    for ours, plain, args in cases:
        np.testing.assert_allclose(ours(*args), plain(*args), rtol=1e-6, atol=1e-6)
        got = jax.jit(jax.grad(loss(ours), argnums=(0, 1, 2)))(*args)
        want = jax.grad(loss(plain), argnums=(0, 1, 2))(*args)
        for g, w in zip(got, want, strict=True):
            assert g.shape == w.shape
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("ours", "torch_name", "kwargs"),
    [(gelu_tanh, "gelu", {"approximate": "tanh"}), (gelu_erf, "gelu", {}), (silu, "silu", {})],
    ids=["gelu_tanh", "gelu_erf", "silu"],
)
def test_bf16_activations_round_once_as_torch_kernels_do(ours, torch_name, kwargs):
    """In bf16, torch's GELU/SiLU kernels compute in float32 and round once: ours give the same
    bf16 values but for a few (<10% for the tanh form) one ulp away, where XLA's float32 tanh is
    an ulp off torch's before rounding. jax's composite on bf16 rounds after every op: ~40% of
    values differ (the control)."""
    import torch

    x = np.random.default_rng(0).standard_normal(100_000).astype(np.float32) * 3
    x_bf16 = torch.from_numpy(x).bfloat16()
    want = getattr(torch.nn.functional, torch_name)(x_bf16, **kwargs).float().numpy()
    inputs = jnp.asarray(x_bf16.float().numpy(), jnp.bfloat16)

    def outputs(fn):
        assert fn(inputs).dtype == jnp.bfloat16
        return np.asarray(jax.jit(fn)(inputs), np.float32)

    got = outputs(ours)
    ulp = np.spacing(np.abs(want).astype(np.float32)) * 2.0**16  # bf16 has 16 fewer bits
    # one ulp, or 1e-6 in GELU's far negative tail (|value| < 1e-4, where 1 + tanh cancels)
    assert np.all(np.abs(got - want) <= ulp + 1e-6)
    assert np.mean(got != want) < 0.1
    composite = {"gelu": lambda v: jax.nn.gelu(v, approximate="approximate" in kwargs)}
    composite["silu"] = jax.nn.silu
    assert np.mean(outputs(composite[torch_name]) != want) > 0.2


def _rhs_ranks(fn, *args) -> list[int]:
    """The kernel ranks of the dot_generals ``fn`` lowers to (StableHLO operand types)."""
    import re

    text = jax.jit(fn).lower(*args).as_text()
    found = re.findall(r"stablehlo\.dot_general.*?\(tensor<[^>]*>, tensor<([^>]*)>\)", text)
    return [len(shape.split("x")) - 1 for shape in found]


@pytest.mark.parametrize(
    "kernel_shape, in_dims", [((16, 4, 8), 1), ((5, 16, 8), 2)], ids=["mlp", "proj_out"]
)
def test_dense_general_flattens_unless_the_packed_axis_is_tensor_split(
    kernel_shape, in_dims, xla_dots
):
    """A packed kernel ([D, 4, D], [5, D, D]) is one 2-D product (a free reshape: XLA on TPU
    re-lays out a kernel with two contracting axes and keeps the copy for a whole loop), except
    where the mesh splits the packed ``mlp`` axis: there the axes stay as they are. Both equal
    the einsum."""
    from jaxcore import sharding
    from jaxcore.models.layers import dense_general

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, 3, *kernel_shape[:in_dims]), np.float32))
    kernel = jnp.asarray(rng.standard_normal(kernel_shape, np.float32))
    bias = jnp.asarray(rng.standard_normal(kernel_shape[in_dims:], np.float32))
    expected = np.tensordot(np.asarray(x), np.asarray(kernel), in_dims) + np.asarray(bias)

    def call(x, kernel, bias):
        return dense_general(x, kernel, bias, in_dims=in_dims)

    untensored = sharding.make_mesh(sharding.MeshConfig(ici_data_parallelism=2), jax.devices()[:2])
    tensored = sharding.make_mesh(
        sharding.MeshConfig(ici_data_parallelism=1, ici_tensor_parallelism=2), jax.devices()[:2]
    )
    with jax.default_matmul_precision("highest"):
        for mesh, rank in ((None, 2), (untensored, 2), (tensored, len(kernel_shape))):
            with sharding.mesh_context(mesh):
                assert _rhs_ranks(call, x, kernel, bias) == [rank], mesh
                np.testing.assert_allclose(call(x, kernel, bias), expected, rtol=1e-5, atol=1e-5)
