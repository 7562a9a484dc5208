"""jaxcore.quantization: weight-only int8 / fp8 denoiser kernels, one mechanism for every family.

Tolerances: int8 values within half a quantization step of the kernel (qwix's symmetric int8:
step absmax / 127.5 per output channel, values rounded to nearest and clipped to [-128, 127]); fp8 (e4m3: 3 mantissa bits)
within 1/16 relative; a tiny pipeline's render with quantized kernels within 5% (int8) / 20%
(fp8) relative L2 of the float render from the same noise (:data:`RENDER_TOLERANCE`), and not
equal to it.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import qwix

from jaxcore import quantization, sharding
from jaxcore.compute import ComputeConfig
from jaxcore.families import FamilyError, load_pipeline
from jaxcore.sampling import initial_latents
from pipelines.embedded.tiny import build_tiny_wan_pipeline
from tests.support.tiny_flux import build_flux_pipeline
from tests.support.tiny_sd import build_sd_pipeline

# relative L2 distance of a 3-step render from the float one, measured on the tiny pipelines:
# int8 0.008 (Wan) / 0.013 (Flux) / 0.030 (SD); fp8 0.047 / 0.049 / 0.124 (3 mantissa bits)
# int8 / fp8 (products quantized too): int8 0.010 / 0.016 / 0.034, fp8 0.065 / 0.052 / 0.152
RENDER_TOLERANCE = {"int8_weights": 0.05, "fp8_weights": 0.2, "int8": 0.05, "fp8": 0.2}


def _tree(rng):
    return {
        "dense": {"kernel": rng.normal(size=(16, 8)).astype(np.float32), "bias": np.ones(8)},
        "packed": {"kernel": rng.normal(size=(8, 4, 8)).astype(np.float32)},
        "conv": {"kernel": rng.normal(size=(3, 3, 4, 6)).astype(np.float32)},
        "norm": {"scale": rng.normal(size=(8,)).astype(np.float32)},
        "embedding": rng.normal(size=(10, 8)).astype(np.float32),  # not a product kernel
    }


def test_int8_weights_are_per_output_channel_absmax_round_to_nearest():
    params = _tree(np.random.default_rng(0))
    quantized = quantization.quantize_params(params, "int8_weights")
    for name in ("dense", "packed", "conv"):
        kernel, q = params[name]["kernel"], quantized[name]["kernel"]
        assert isinstance(q, qwix.QArray) and q.qvalue.dtype == jnp.int8
        reduce = tuple(range(kernel.ndim - 1))
        scale = np.abs(kernel).max(axis=reduce, keepdims=True) / 127.5
        np.testing.assert_allclose(np.asarray(q.scale), scale, rtol=1e-6)
        expected = np.clip(np.round(kernel / scale), -128, 127)
        # the same buckets up to values within float rounding of a bucket's edge
        assert np.abs(np.asarray(q.qvalue) - expected).max() <= 1
        back = np.asarray(quantization.dequantized(quantized, jnp.float32)[name]["kernel"])
        assert np.all(np.abs(back - kernel) <= scale / 2 * (1 + 1e-4))  # + float rounding
    for untouched in (params["dense"]["bias"], params["norm"]["scale"], params["embedding"]):
        assert not isinstance(untouched, qwix.QArray)
    assert quantized["embedding"] is params["embedding"]
    assert quantization.is_quantized(quantized) and not quantization.is_quantized(params)
    assert quantization.quantize_params(params, "none") is params


def test_int8_weights_are_torchaos_int8_weight_only():
    """The same tensor quantized by torchao's Int8WeightOnlyConfig (a diffusers user's int8
    weight-only): equal scales (absmax / 127.5 per output row), equal int8 values except where
    a value sits within float rounding of a bucket's edge (there: one apart)."""
    import torch
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    torch.manual_seed(0)
    linear = torch.nn.Linear(48, 24)
    weight = linear.weight.detach().numpy().copy()  # [out, in]
    quantize_(torch.nn.Sequential(linear), Int8WeightOnlyConfig())
    theirs, their_scale = linear.weight.qdata.numpy(), linear.weight.scale.numpy().reshape(-1)
    ours = quantization.quantize_params({"kernel": weight.T}, "int8_weights")["kernel"]
    values, scale = np.asarray(ours.qvalue).T, np.asarray(ours.scale).reshape(-1)
    np.testing.assert_allclose(scale, their_scale, rtol=1e-6)
    steps = weight / scale[:, None]
    at_edge = np.abs(np.abs(steps - np.trunc(steps)) - 0.5) < 1e-4
    assert np.array_equal(values[~at_edge], theirs[~at_edge])
    assert np.abs(values.astype(int) - theirs).max() <= 1


def test_fp8_weights_are_within_e4m3_rounding():
    params = _tree(np.random.default_rng(1))
    quantized = quantization.quantize_params(params, "fp8_weights")
    assert quantized["dense"]["kernel"].qvalue.dtype == jnp.float8_e4m3fn
    back = quantization.dequantized(quantized, jnp.float32)
    for name in ("dense", "packed", "conv"):
        kernel = params[name]["kernel"]
        np.testing.assert_allclose(back[name]["kernel"], kernel, rtol=1 / 16, atol=1e-6)
    # the dtype the model asked for
    assert quantization.dequantized(quantized, jnp.bfloat16)["conv"]["kernel"].dtype == jnp.bfloat16


def test_abstract_quantized_is_what_quantize_makes_and_keeps_the_sharding():
    mesh = sharding.make_mesh(sharding.MeshConfig(), devices=jax.devices()[:1])
    where = jax.sharding.NamedSharding(mesh, jax.P("fsdp", "tensor"))
    abstract = {"dense": {"kernel": jax.ShapeDtypeStruct((16, 8), jnp.bfloat16, sharding=where)}}
    made = jax.eval_shape(lambda p: quantization.quantize_params(p, "int8_weights"), abstract)
    predicted = quantization.abstract_quantized(abstract, "int8_weights")
    shapes = jax.tree.map(lambda a: (a.shape, a.dtype), made)
    assert jax.tree.map(lambda a: (a.shape, a.dtype), predicted) == shapes
    kernel = predicted["dense"]["kernel"]
    assert kernel.qvalue.sharding == where
    assert kernel.scale.sharding.spec == jax.P(None, "tensor")


def test_an_unknown_mode_names_the_key():
    with pytest.raises(ValueError, match="unknown quantization 'int4'") as err:
        ComputeConfig(quantization="int4")
    assert "compute.quantization" in str(err.value)


@pytest.mark.parametrize("mode", ["int8", "fp8"])
def test_quantized_products_run_on_quantized_values_near_the_float_ones(mode):
    """int8 / fp8 products at each dense seam of jaxcore.models.layers (dense, packed dense,
    heads einsum): the activations quantized per token, the product on the quantized values
    (int8 x int8 -> int32 in the lowered program), within 2% (int8) / 6% (fp8) of the float
    product relative to its largest value (measured 0.9-1.1% / 3-3.6%). A convolution
    dequantizes its kernel and keeps float activations (exactly the weight-only product)."""
    from jaxcore.models import layers

    rng = np.random.default_rng(4)
    tolerance = {"int8": 0.02, "fp8": 0.06}[mode]
    x = jnp.asarray(rng.normal(size=(2, 5, 16)), jnp.float32)
    cases = {
        "dense": ((16, 8), lambda k: layers.projection(x, k, jnp.ones(8))),
        "packed": ((16, 4, 8), lambda k: layers.dense_general(x, k, jnp.ones((4, 8)))),
    }
    for name, (shape, product) in cases.items():
        kernel = jnp.asarray(rng.normal(size=shape), jnp.float32)
        quantized = quantization.quantize_params({"kernel": kernel}, mode)["kernel"]
        want, got = product(kernel), product(quantized)
        error = float(jnp.abs(got - want).max() / jnp.abs(want).max())
        assert 0 < error < tolerance, (name, error)
        if mode == "int8":
            text = jax.jit(product).lower(quantized).as_text()
            int8_product = r"dot_general[^\n]*\(tensor<[^>]*xi8>, tensor<[^>]*xi8>\)"
            assert re.search(int8_product, text), name  # int8 x int8
    heads = layers.HeadsEinsum(
        (16, 2, 4), ("embed", "heads", "kv"), "bld,dnh->blnh", jax.nn.initializers.ones
    )
    kernel = jnp.asarray(rng.normal(size=(16, 2, 4)), jnp.float32)
    want = heads.apply({"params": {"kernel": kernel}}, x)
    got = heads.apply({"params": quantization.quantize_params({"kernel": kernel}, mode)}, x)
    assert 0 < float(jnp.abs(got - want).max() / jnp.abs(want).max()) < tolerance

    image = jnp.asarray(rng.normal(size=(2, 6, 6, 4)), jnp.float32)
    kernel = quantization.quantize_params(
        {"kernel": jnp.asarray(rng.normal(size=(3, 3, 4, 5)), jnp.float32)}, mode
    )["kernel"]
    padding = ((1, 1), (0, 2))
    np.testing.assert_array_equal(
        layers.conv2d(image, kernel, (1, 1), padding),
        layers.conv2d(image, quantization.dequantized(kernel, jnp.float32), (1, 1), padding),
    )


# --- every family's pipeline ---------------------------------------------------------------


@pytest.fixture(scope="module", params=["wan", "flux", "sd", "ltx"])
def tiny_pipeline_dir(request, tmp_path_factory):
    where = tmp_path_factory.mktemp(f"quantized_{request.param}")
    if request.param == "wan":
        return build_tiny_wan_pipeline(where, seed=1, transformer_output_scale=20.0)
    if request.param == "flux":
        return build_flux_pipeline(where, seed=1)
    if request.param == "ltx":
        from tests.support.tiny_ltx import build_ltx_pipeline

        return build_ltx_pipeline(where, seed=1)
    return build_sd_pipeline(where, seed=1)


@pytest.mark.parametrize("mode", ["int8_weights", "fp8_weights", "int8", "fp8"])
def test_a_quantized_render_is_close_to_the_float_one(tiny_pipeline_dir, mode):
    """The denoiser's kernels are held quantized (fewer bytes) and the render from the same
    noise stays within :data:`RENDER_TOLERANCE` of the float one (relative L2)."""
    float_pipe = load_pipeline(tiny_pipeline_dir)
    pipe = load_pipeline(tiny_pipeline_dir, ComputeConfig(quantization=mode))
    assert quantization.is_quantized(pipe.denoiser_params)
    held, full = map(quantization.weight_bytes, (pipe.denoiser_params, float_pipe.denoiser_params))
    assert held < 0.5 * full

    shape = pipe.latent_shape(32, 32, 1)
    latents = np.stack([initial_latents(3, shape)])
    cond, uncond, scales = pipe.conditioning(["a red circle"], [""], [pipe.guidance(4.0)], 77)

    def render(p):
        return np.asarray(p.sample(latents, cond, uncond, num_inference_steps=3, cfg_scale=scales))

    reference, quantized = render(float_pipe), render(pipe)
    error = np.linalg.norm(quantized - reference) / np.linalg.norm(reference - latents)
    print(f"{mode}: relative L2 {error:.4f}")
    assert 0 < error < RENDER_TOLERANCE[mode], error
    if quantization.quantizes_products(mode):  # the products ran quantized, not only the weights
        weights_only = load_pipeline(
            tiny_pipeline_dir, ComputeConfig(quantization=f"{mode}_weights")
        )
        assert not np.array_equal(render(weights_only), quantized)


def test_loras_without_the_float_weights_are_refused_by_name(tiny_pipeline_dir):
    pipe = load_pipeline(tiny_pipeline_dir, ComputeConfig(quantization="int8_weights"))
    with pytest.raises(FamilyError, match="LoRA style.safetensors: .*keep_float='host'"):
        pipe.apply_loras([("style.safetensors", 1.0)])


@pytest.fixture(scope="module")
def wan_dir(tmp_path_factory):
    return build_tiny_wan_pipeline(
        tmp_path_factory.mktemp("quantized_lora"), seed=1, transformer_output_scale=20.0
    )


def test_kernels_are_quantized_as_they_load(wan_dir, monkeypatch):
    """A quantized pipeline's denoiser is quantized kernel by kernel as the weights are placed
    (the same values as quantizing the float tree), so the float kernels are never on the
    device together: while loading, live float kernels stay under half of the model's."""
    float_params = load_pipeline(wan_dir).denoiser_params
    expected = quantization.quantize_params(float_params, "int8_weights")
    kernel_bytes = sum(
        a.nbytes for a in jax.tree.leaves(float_params) if a.ndim >= 2 and a.dtype == jnp.float32
    )
    del float_params

    def float_kernel_bytes():
        return sum(a.nbytes for a in jax.live_arrays() if a.ndim >= 2 and a.dtype == jnp.float32)

    live, real = [], quantization.quantizer

    def watched(mode):
        quantize = real(mode)

        def one(tree):
            live.append(float_kernel_bytes())
            return quantize(tree)

        return one

    before = float_kernel_bytes()
    monkeypatch.setattr(quantization, "quantizer", watched)
    pipe = load_pipeline(wan_dir, ComputeConfig(quantization="int8_weights"))
    assert len(live) == sum(
        quantization.is_quantized_kernel(x)
        for x in jax.tree.leaves(expected, is_leaf=quantization.is_quantized_kernel)
    )  # once per kernel, as it loads
    assert max(live) - before < kernel_bytes / 2
    for got, want in zip(
        jax.tree.leaves(pipe.denoiser_params), jax.tree.leaves(expected), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_a_lora_set_merges_into_the_float_weights_then_requantizes(wan_dir, tmp_path):
    """keep_float='host': a set's weights are exactly quantize(float + LoRAs) (a float
    pipeline's merge, quantized), another set merges from the float base again, the empty set
    restores the loaded quantized weights bit for bit, and no set recompiles the denoising
    program; the float weights wait in host memory."""
    from jaxcore import sampling, step_cache
    from tests.stages.test_lora_render import write_peft_lora

    a = write_peft_lora(tmp_path / "a.safetensors", wan_dir, seed=1)
    b = write_peft_lora(tmp_path / "b.safetensors", wan_dir, seed=2, every=2)
    compute = ComputeConfig(quantization="int8_weights")
    pipe = load_pipeline(wan_dir, compute, keep_float="host")
    assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(pipe.float_weights.high))
    loaded = [np.asarray(x) for x in jax.tree.leaves(pipe.denoiser_params)]
    float_pipe = load_pipeline(wan_dir)

    def expected(loras):
        float_pipe.apply_loras(loras)
        return jax.tree.leaves(
            quantization.quantize_params(float_pipe.denoiser_params, compute.quantization)
        )

    cond = pipe.encode_prompts(["a red circle"], 16)
    latents = initial_latents(0, pipe.latent_shape(16, 16, 1))[None]
    _, step_fn = pipe.family.make_schedule(pipe, "unipc", 2, 3.0, latents.shape)
    jitted = sampling.denoise_fn(
        pipe.family, pipe.denoiser, step_fn, False, None, step_cache.NO_CACHE, True
    )
    pipe.sample(latents, cond, num_inference_steps=2)
    compiled = jitted._cache_size()
    for loras in ([(a, 0.8), (b, 0.5)], [(b, 1.0)]):
        pipe.apply_loras(loras)
        held = jax.tree.leaves(pipe.denoiser_params)
        for got, want in zip(held, expected(loras), strict=True):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        assert any(not np.array_equal(x, y) for x, y in zip(held, loaded, strict=True))
        pipe.sample(latents, cond, num_inference_steps=2)
    pipe.apply_loras([])
    for got, want in zip(jax.tree.leaves(pipe.denoiser_params), loaded, strict=True):
        np.testing.assert_array_equal(np.asarray(got), want)
    assert jitted._cache_size() == compiled  # one program for every set


def test_the_float_reference_renders_the_unquantized_model(wan_dir):
    """keep_float='device': inside float_reference() the pipeline renders what the float
    pipeline renders (bit for bit), and the quantized weights come back after."""
    pipe = load_pipeline(wan_dir, ComputeConfig(quantization="int8_weights"), keep_float="device")
    float_pipe = load_pipeline(wan_dir)
    cond = pipe.encode_prompts(["a red circle"], 16)
    latents = initial_latents(0, pipe.latent_shape(16, 16, 1))[None]

    def render(p):
        return np.asarray(p.sample(latents, cond, num_inference_steps=2))

    with pipe.float_reference():
        np.testing.assert_array_equal(render(pipe), render(float_pipe))
    assert quantization.is_quantized(pipe.denoiser_params)
    assert not np.array_equal(render(pipe), render(float_pipe))


def test_both_experts_are_quantized_and_host_swapping_is_refused_before_loading(
    tmp_path, monkeypatch
):
    from jaxcore.families.wan import WanFamily
    from tests.support.wan_variants import build_two_expert_pipeline

    directory = build_two_expert_pipeline(tmp_path / "a14b", seed=2)
    pipe = load_pipeline(directory, ComputeConfig(quantization="int8_weights"))
    assert quantization.is_quantized(pipe.denoiser_params)
    assert quantization.is_quantized(pipe.second_expert.params)

    def loads(*args, **kwargs):
        raise AssertionError("the components loaded before the refusal")

    monkeypatch.setattr(WanFamily, "load_components", loads)
    compute = ComputeConfig(quantization="int8_weights", idle_expert="host")
    with pytest.raises(
        FamilyError, match="quantization=int8_weights with compute.idle_expert=host"
    ):
        load_pipeline(directory, compute)
