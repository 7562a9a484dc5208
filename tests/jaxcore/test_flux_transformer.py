"""Flux.1 transformer vs diffusers FluxTransformer2DModel (random-init tiny models, fp32).

Parity tolerance: max abs diff <= 2e-5 on outputs of magnitude ~3-4 (reached: 1.1e-6 to 2.4e-6
over the three tiny configs), with position ids closed over (host RoPE tables) and passed as jit
arguments (in-graph tables). Other tolerances, with what was reached: RoPE tables bit-identical
(host) / <= 2.5e-7 (traced; 6e-8); timestep embedding <= 2e-7 (6e-8); bf16 <= 3% of max |out|
(~1%); sharded vs unsharded <= 1e-5 (~2e-6); remat gradients <= 1e-6.

The reference runs with a correctly rounded float32 ``torch.exp`` (:func:`_correctly_rounded_exp`).
torch's CPU float32 exp is off by one ulp at 3 of the 128 timestep frequencies; Flux embeds
sigma * 1000, so that ulp moves a sin/cos argument by ~3e-5 and the output by ~4e-5, a platform
artifact of the reference (CUDA's expf differs again). :func:`test_timestep_frequencies_vs_torch`
pins exactly that deviation down; everything else in the reference is untouched.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import linen as nn
from jax.ad_checkpoint import print_saved_residuals
from jax.sharding import PartitionSpec

from jaxcore import sharding, weights
from jaxcore.layer_stack import LayerStack
from jaxcore.models import flux_transformer as ft
from jaxcore.models.layers import timestep_frequencies

PARITY_ATOL = 2e-5

# The released configs (to move into configs/models/*.yml); exact diffusers parameter counts,
# checked against FluxTransformer2DModel built on the meta device.
FLUX1_DEV = {
    "attention_head_dim": 128,
    "guidance_embeds": True,
    "in_channels": 64,
    "joint_attention_dim": 4096,
    "num_attention_heads": 24,
    "num_layers": 19,
    "num_single_layers": 38,
    "patch_size": 1,
    "pooled_projection_dim": 768,
    "axes_dims_rope": [16, 56, 56],
}
FLUX1_SCHNELL = {**FLUX1_DEV, "guidance_embeds": False}
PUBLISHED_COUNTS = {"dev": 11_901_408_320, "schnell": 11_891_178_560}

# dev-like (guidance embedder), the known-good tiny config
TINY_DEV = dict(
    patch_size=1,
    in_channels=16,
    num_layers=1,
    num_single_layers=1,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=32,
    pooled_projection_dim=16,
    guidance_embeds=True,
    axes_dims_rope=(4, 6, 6),
)
# schnell-like (no guidance), more heads, 2 double blocks
TINY_SCHNELL = dict(
    patch_size=1,
    in_channels=12,
    num_layers=2,
    num_single_layers=1,
    attention_head_dim=16,
    num_attention_heads=4,
    joint_attention_dim=24,
    pooled_projection_dim=8,
    guidance_embeds=False,
    axes_dims_rope=(8, 4, 4),
)
# odd: 3 heads of 8, rope (2, 4, 2), 2 single blocks, out_channels != in_channels
TINY_ODD = dict(
    patch_size=1,
    in_channels=8,
    out_channels=12,
    num_layers=1,
    num_single_layers=2,
    attention_head_dim=8,
    num_attention_heads=3,
    joint_attention_dim=20,
    pooled_projection_dim=12,
    guidance_embeds=True,
    axes_dims_rope=(2, 4, 2),
)
# name: (config, batch, latent height, latent width, text length, fractional txt ids, id paths)
# Id paths: "host" = ids closed over as numpy (exact tables), "traced" = ids as jit arguments.
CASES = {
    "dev": (TINY_DEV, 2, 8, 6, 5, False, ("host", "traced")),
    "schnell": (TINY_SCHNELL, 2, 6, 10, 7, False, ("host",)),
    "odd": (TINY_ODD, 2, 4, 8, 3, True, ("traced",)),
}


@contextlib.contextmanager
def _correctly_rounded_exp():
    """torch.exp on float32 computed in float64 and rounded (see the module docstring)."""
    exp = torch.exp

    def rounded(x, *args, **kwargs):
        if isinstance(x, torch.Tensor) and x.dtype == torch.float32 and not args and not kwargs:
            return exp(x.double()).float()
        return exp(x, *args, **kwargs)

    torch.exp = rounded
    try:
        yield
    finally:
        torch.exp = exp


def _save_reference(directory: Path, config: dict, seed: int = 0):
    """A random diffusers model with every parameter perturbed (norm weights are not 1, biases
    not 0, so a mis-mapped parameter changes the output), saved as safetensors."""
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    model = FluxTransformer2DModel(**config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(directory)
    return model


def _inputs(config: dict, batch: int, height: int, width: int, text_len: int, fractional=False):
    """FluxPipeline-shaped inputs: packed latents, ids from latent_image_ids, non-zero txt_ids
    (integers, or arbitrary floats when ``fractional``), distinct timesteps and guidance."""
    rng = np.random.default_rng(1)
    latents = rng.standard_normal((batch, config["in_channels"] // 4, height, width), np.float32)
    n_axes = len(config["axes_dims_rope"])
    txt_ids = rng.integers(0, 5, (text_len, n_axes)).astype(np.float32)
    if fractional:
        txt_ids += rng.uniform(-3, 3, txt_ids.shape).astype(np.float32)
    guidance = np.array([3.5, 5.0, 1.0, 7.5][:batch], np.float32)
    return dict(
        hidden_states=np.asarray(ft.pack_latents(latents)),
        encoder_hidden_states=rng.standard_normal(
            (batch, text_len, config["joint_attention_dim"]), np.float32
        ),
        pooled_projections=rng.standard_normal(
            (batch, config["pooled_projection_dim"]), np.float32
        ),
        timestep=np.array([0.93, 0.21, 0.5, 1.0][:batch], np.float32),
        img_ids=ft.latent_image_ids(height, width),
        txt_ids=txt_ids,
        guidance=guidance if config["guidance_embeds"] else None,
    )


def _reference_output(model, inputs: dict) -> np.ndarray:
    args = {k: torch.from_numpy(v) for k, v in inputs.items() if v is not None}
    with torch.no_grad(), _correctly_rounded_exp():
        return model(**args).sample.numpy()


def _apply(module, params, inputs: dict, ids: str = "traced"):
    """Run jitted; ids "traced" pass as jit arguments, "host" are closed over as numpy."""
    if ids == "traced":
        return jax.jit(module.apply)({"params": params}, **inputs)
    rest = {k: v for k, v in inputs.items() if k not in ("img_ids", "txt_ids")}
    fn = functools.partial(module.apply, img_ids=inputs["img_ids"], txt_ids=inputs["txt_ids"])
    return jax.jit(fn)({"params": params}, **rest)


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> tuple[Path, object]:
    directory = tmp_path_factory.mktemp("flux_tiny")
    return directory, _save_reference(directory, TINY_DEV)


def _max_diff(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))


# --- parity ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_diffusers(tmp_path, name):
    config, batch, height, width, text_len, fractional, id_paths = CASES[name]
    reference = _save_reference(tmp_path, config)
    inputs = _inputs(config, batch, height, width, text_len, fractional)
    expected = _reference_output(reference, inputs)

    module, params = ft.load_flux_transformer(tmp_path)
    out_channels = config.get("out_channels") or config["in_channels"]
    assert expected.shape == (batch, (height // 2) * (width // 2), out_channels)
    for ids in id_paths:
        got = _apply(module, params, inputs, ids)
        assert got.shape == expected.shape
        diff = _max_diff(got, expected)
        assert diff <= PARITY_ATOL, f"{name}/{ids}: max abs diff {diff}"


def test_rope_tables_match_diffusers():
    """Concrete ids: bit-identical tables. Traced ids (in-graph, float32 only): ~1 ulp."""
    from diffusers.models.transformers.transformer_flux import FluxPosEmbed

    axes = (16, 56, 56)  # Flux.1's split of the 128 head dim
    rng = np.random.default_rng(0)
    txt_ids = np.zeros((512, 3), np.float32)
    txt_ids[:64] = rng.uniform(-5, 300, (64, 3)).astype(np.float32)  # arbitrary, fractional
    ids = np.concatenate([txt_ids, ft.latent_image_ids(128, 96)])  # a 1024 x 768 image
    cos_ref, sin_ref = FluxPosEmbed(10000, list(axes))(torch.from_numpy(ids))
    # diffusers repeats each angle for the two members of a pair
    cos_ref, sin_ref = cos_ref[:, 0::2].numpy(), sin_ref[:, 1::2].numpy()

    cos, sin = ft.rope_cos_sin(ids, axes)
    np.testing.assert_array_equal(np.asarray(cos), cos_ref)
    np.testing.assert_array_equal(np.asarray(sin), sin_ref)

    cos_t, sin_t = jax.jit(lambda i: ft.rope_cos_sin(i, axes))(ids)
    np.testing.assert_allclose(np.asarray(cos_t), cos_ref, rtol=0, atol=2.5e-7)
    np.testing.assert_allclose(np.asarray(sin_t), sin_ref, rtol=0, atol=2.5e-7)


def test_timestep_frequencies_vs_torch():
    """Our table is the correctly rounded exp of torch's float32 exponents; torch's own CPU exp
    differs from it by at most 1 ulp in a few entries (the reason for _correctly_rounded_exp)."""
    half = ft.TIMESTEP_CHANNELS // 2
    exponent = -np.log(10000.0) * torch.arange(0, half, dtype=torch.float32) / half
    ours = timestep_frequencies(ft.TIMESTEP_CHANNELS)
    np.testing.assert_array_equal(ours, torch.exp(exponent.double()).float().numpy())
    torch_f32 = torch.exp(exponent).numpy()
    ulps = np.abs(ours.view(np.int32) - torch_f32.view(np.int32))
    assert ulps.max() <= 1 and (ulps > 0).sum() <= 8, ulps


def test_timestep_embedding_matches_diffusers():
    from diffusers.models.embeddings import get_timestep_embedding

    t = np.array([0.0, 0.25, 17.3, 500.0, 930.0, 999.0, 1000.0, 3500.0], np.float32)
    with _correctly_rounded_exp():
        ref = get_timestep_embedding(torch.from_numpy(t), 256, True, 0).numpy()
    got = np.asarray(ft.timestep_embedding(jnp.asarray(t), 256))
    np.testing.assert_allclose(got, ref, rtol=0, atol=2e-7)


# --- latent layout --------------------------------------------------------------------------


def test_pack_unpack_latent_ids_match_flux_pipeline():
    from diffusers import FluxPipeline

    batch, channels, height, width = 2, 16, 12, 10  # latent size, non-square
    latents = np.random.default_rng(0).standard_normal((batch, channels, height, width), np.float32)
    tokens = np.asarray(ft.pack_latents(latents))
    expected = FluxPipeline._pack_latents(torch.from_numpy(latents), batch, channels, height, width)
    np.testing.assert_array_equal(tokens, expected.numpy())
    assert tokens.shape == (batch, 6 * 5, 4 * channels)

    np.testing.assert_array_equal(np.asarray(ft.unpack_latents(tokens, height, width)), latents)
    # the pipeline takes the pixel size (any that rounds down to this latent) and the VAE factor
    for pixel_h, pixel_w in ((height * 8, width * 8), (height * 8 + 15, width * 8 + 9)):
        ref = FluxPipeline._unpack_latents(torch.from_numpy(tokens), pixel_h, pixel_w, 8)
        np.testing.assert_array_equal(ref.numpy(), latents)

    ids = ft.latent_image_ids(height, width)
    ref_ids = FluxPipeline._prepare_latent_image_ids(batch, height // 2, width // 2, "cpu", None)
    assert ids.dtype == np.float32 and ids.shape == (30, 3)
    np.testing.assert_array_equal(ids, ref_ids.numpy())
    assert ids[7].tolist() == [0.0, 1.0, 2.0]  # token 7 = row 1, column 2

    with pytest.raises(ValueError, match="even"):
        ft.pack_latents(latents[:, :, :11])
    with pytest.raises(ValueError, match="do not unpack"):
        ft.unpack_latents(tokens, height, width + 2)


# --- dtype, sharding, remat -----------------------------------------------------------------


def test_bf16_close_to_fp32(tiny_checkpoint):
    """bf16 weights and activations vs the fp32 reference: within bf16 accuracy (reached ~1% of
    max |out|)."""
    directory, reference = tiny_checkpoint
    inputs = _inputs(TINY_DEV, 2, 8, 6, 5)
    full = _reference_output(reference, inputs)
    module, params = ft.load_flux_transformer(
        directory, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16
    )
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params))
    half = _apply(module, params, inputs, "host")
    assert half.dtype == jnp.bfloat16
    assert _max_diff(half, full) <= 0.03 * np.abs(full).max()


def test_sharded_equals_unsharded(tiny_checkpoint):
    """dp2 x fsdp2 x tp2 on 8 CPU devices: params land on their logical shardings and the
    output equals the single-device run (fp32, reached ~2e-6)."""
    directory, _ = tiny_checkpoint
    mesh = sharding.make_mesh(
        sharding.MeshConfig(
            ici_data_parallelism=2, ici_fsdp_parallelism=2, ici_tensor_parallelism=2
        )
    )
    module, params = ft.load_flux_transformer(directory, mesh=mesh)
    double, single = params["transformer_blocks_0"], params["single_transformer_blocks_0"]
    assert double["attn"]["to_q"]["kernel"].sharding.spec == PartitionSpec(
        ("fsdp", "context"), "tensor"
    )
    assert double["attn"]["to_add_out"]["kernel"].sharding.spec == PartitionSpec(
        "tensor", ("fsdp", "context")
    )
    assert double["ff"]["proj_in"]["kernel"].sharding.spec == PartitionSpec(
        ("fsdp", "context"), "tensor"
    )
    assert single["proj_mlp"]["kernel"].sharding.spec == PartitionSpec(
        ("fsdp", "context"), None, "tensor"
    )
    assert single["proj_out"]["kernel"].sharding.spec == PartitionSpec(
        None, "tensor", ("fsdp", "context")
    )

    _, plain = ft.load_flux_transformer(directory)
    inputs = _inputs(TINY_DEV, 4, 8, 6, 5)  # batch 4 = data x fsdp
    expected = np.asarray(_apply(ft.FluxTransformer(module.config), plain, inputs))
    with sharding.mesh_context(mesh):
        compiled = jax.jit(module.apply).lower({"params": params}, **inputs).compile()
        got = compiled({"params": params}, **inputs)
    assert "all-reduce" in compiled.as_text()  # tensor-parallel partial sums: it is sharded
    assert got.sharding.num_devices == 8
    assert _max_diff(got, expected) <= 1e-5


@pytest.mark.slow  # compiling the random init of ~70 parameters takes 5-10 s on CPU
def test_init_from_scratch_on_a_mesh():
    """init_flux_transformer creates every parameter already on its logical sharding."""
    mesh = sharding.make_mesh(
        sharding.MeshConfig(
            ici_data_parallelism=1, ici_fsdp_parallelism=4, ici_tensor_parallelism=2
        )
    )
    config = ft.FluxTransformerConfig.from_dict(TINY_DEV)
    _, params = ft.init_flux_transformer(config, jax.random.key(0), mesh=mesh)
    spec = params["single_transformer_blocks_0"]["proj_out"]["kernel"].sharding.spec
    assert spec == PartitionSpec(None, "tensor", ("fsdp", "context"))
    assert ft.count_params(config) == sum(x.size for x in jax.tree.leaves(params))


@pytest.mark.parametrize(
    "policy",
    ["full", "offload_block_inputs", pytest.param("dots_saveable", marks=pytest.mark.slow)],
)
def test_remat_same_output_and_gradients(tiny_checkpoint, policy):
    directory, _ = tiny_checkpoint
    plain, params = ft.load_flux_transformer(directory)
    remat = ft.FluxTransformer(plain.config, remat_policy=policy)
    inputs = _inputs(TINY_DEV, 2, 4, 4, 3)

    def loss(module):
        def fn(p):
            return jnp.mean(module.apply({"params": p}, **inputs) ** 2)

        return jax.jit(jax.value_and_grad(fn))(params)

    def jaxpr(module):
        return str(jax.make_jaxpr(lambda p: module.apply({"params": p}, **inputs))(params))

    assert "remat" in jaxpr(remat) and "remat" not in jaxpr(plain)  # blocks are checkpointed
    (loss_plain, grad_plain), (loss_remat, grad_remat) = loss(plain), loss(remat)
    np.testing.assert_allclose(loss_remat, loss_plain, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), grad_remat, grad_plain)
    assert all(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(grad_plain))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_saved_residuals(lambda p: jnp.mean(remat.apply({"params": p}, **inputs)), params)
    on_host = [line for line in out.getvalue().splitlines() if "<host>" in line]
    # offloaded: the double block's image and text streams, the single block's joined stream
    assert len(on_host) == (3 if policy == "offload_block_inputs" else 0), on_host


# remat under scan: the Wan twin (tests/jaxcore/test_wan_transformer.py) runs both in the
# default tier, in 8 s each against Flux's 19
@pytest.mark.parametrize("remat_policy", ["none", pytest.param("full", marks=pytest.mark.slow)])
def test_scan_layers_equals_the_unrolled_blocks(tmp_path, remat_policy):
    """scan_layers (the double blocks as one lax.scan, the single blocks as another, over
    stacks of their per-layer parameters): same output and per-layer gradients; a block range
    that starts inside the double blocks and ends inside the single ones (step caching) too."""
    _save_reference(tmp_path, dict(TINY_DEV, num_layers=2, num_single_layers=3))
    plain, params = ft.load_flux_transformer(tmp_path, remat_policy=remat_policy)
    scanned = ft.FluxTransformer(plain.config, remat_policy=remat_policy, scan_layers=True)
    inputs = _inputs(TINY_DEV, 2, 4, 4, 3)

    def loss(module):
        def fn(p):
            return jnp.mean(module.apply({"params": p}, **inputs) ** 2)

        return jax.jit(jax.value_and_grad(fn))(params)

    (loss_plain, grad_plain), (loss_scan, grad_scan) = loss(plain), loss(scanned)
    np.testing.assert_allclose(loss_scan, loss_plain, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), grad_scan, grad_plain)

    cfg = plain.config
    start, stop = 1, cfg.num_layers + cfg.num_single_layers - 1

    def partial(module):
        def run_stack(streams, run_blocks, num_blocks):
            return run_blocks(streams, start, stop), None

        fn = functools.partial(module.apply, run_stack=run_stack)
        return jax.jit(fn)({"params": params}, **inputs)[0]

    assert _max_diff(partial(scanned), partial(plain)) <= 1e-6

    # the stacked layout of a scanned train run (jaxcore.layer_stack), two groups; a block
    # range slices the stacks (the single blocks' from their own index 0)
    layers = LayerStack.of(scanned, params)
    assert layers == LayerStack((("transformer_blocks", 2), ("single_transformer_blocks", 3)))
    stacked = layers.stack(params)

    def stacked_loss(p):
        return jnp.mean(scanned.apply({"params": p}, **inputs) ** 2)

    loss_stacked, grad_stacked = jax.jit(jax.value_and_grad(stacked_loss))(stacked)
    np.testing.assert_allclose(loss_stacked, loss_plain, rtol=1e-6)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6),
        layers.unstack(grad_stacked),
        grad_plain,
    )

    def partial_stacked():
        def run_stack(streams, run_blocks, num_blocks):
            return run_blocks(streams, start, stop), None

        fn = functools.partial(scanned.apply, run_stack=run_stack)
        return jax.jit(fn)({"params": stacked}, **inputs)[0]

    assert _max_diff(partial_stacked(), partial(plain)) <= 1e-6

    def jaxpr(module):
        return str(jax.make_jaxpr(lambda p: module.apply({"params": p}, **inputs))(params))

    assert "scan" in jaxpr(scanned) and "scan" not in jaxpr(plain)


def test_unknown_remat_policy():
    module = ft.FluxTransformer(ft.FluxTransformerConfig.from_dict(TINY_DEV), remat_policy="often")
    with pytest.raises(ValueError, match="remat_policy"):
        ft.abstract_params(module)


# --- weights ----------------------------------------------------------------------------------


@pytest.mark.parametrize("guidance_embeds", [True, False])
def test_weight_map_covers_every_parameter(guidance_embeds):
    config = ft.FluxTransformerConfig.from_dict({**TINY_ODD, "guidance_embeds": guidance_embeds})
    abstract = nn.meta.unbox(ft.abstract_params(ft.FluxTransformer(config)))
    assert set(weights._flatten(abstract)) == set(ft.weight_map(config))


def test_export_round_trips_the_checkpoint(tiny_checkpoint):
    directory, _ = tiny_checkpoint
    module, params = ft.load_flux_transformer(directory)
    exported = weights.export_state_dict(params, ft.weight_map(module.config))
    original = weights.SafetensorsReader(directory).as_dict()
    assert set(exported) == set(original)
    for key, value in original.items():
        np.testing.assert_array_equal(exported[key], value, err_msg=key)


def _copy_checkpoint(src: Path, dst: Path, tensors: dict):
    from safetensors.numpy import save_file

    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    save_file(tensors, str(dst / "diffusion_pytorch_model.safetensors"))


@pytest.mark.parametrize(
    ("key", "shape", "param"),
    [
        (
            "transformer_blocks.0.attn.to_q.weight",
            (32, 16),
            "transformer_blocks_0/attn/to_q/kernel",
        ),
        (
            "single_transformer_blocks.0.proj_out.weight",
            (32, 128),
            "single_transformer_blocks_0/proj_out/kernel",
        ),
        (
            "single_transformer_blocks.0.proj_mlp.weight",
            (96, 32),
            "single_transformer_blocks_0/proj_mlp/kernel",
        ),
    ],
)
def test_wrong_shape_names_the_parameter(tiny_checkpoint, tmp_path, key, shape, param):
    directory, _ = tiny_checkpoint
    tensors = weights.SafetensorsReader(directory).as_dict()
    tensors[key] = np.zeros(shape, np.float32)
    _copy_checkpoint(directory, tmp_path / "bad", tensors)
    with pytest.raises(weights.WeightsError, match=param) as err:
        ft.load_flux_transformer(tmp_path / "bad")
    assert key in str(err.value)


def test_missing_key_is_named(tiny_checkpoint, tmp_path):
    directory, _ = tiny_checkpoint
    tensors = weights.SafetensorsReader(directory).as_dict()
    del tensors["time_text_embed.guidance_embedder.linear_2.bias"]
    _copy_checkpoint(directory, tmp_path / "bad", tensors)
    with pytest.raises(
        weights.WeightsError, match=r"missing keys.*time_text_embed\.guidance_embedder"
    ):
        ft.load_flux_transformer(tmp_path / "bad")


# --- config and inputs ----------------------------------------------------------------------


def test_config_from_diffusers_json(tiny_checkpoint):
    directory, _ = tiny_checkpoint
    raw = json.loads((directory / "config.json").read_text())
    assert raw["out_channels"] is None
    config = ft.FluxTransformerConfig.from_dict(raw)
    assert config.out_channels == 16 and config.hidden_dim == 32 and config.mlp_dim == 128
    assert config.axes_dims_rope == (4, 6, 6)
    assert ft.FluxTransformerConfig.from_dict(config.to_dict()) == config


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_heads": 4}, "num_heads"),
        ({"patch_size": 2}, "patch_size=2 is not supported"),
        ({"axes_dims_rope": [4, 6, 4]}, "sums to 14 but attention_head_dim=16"),
        ({"axes_dims_rope": [5, 5, 6]}, "even"),
        ({"num_attention_heads": 0}, "num_attention_heads"),
    ],
)
def test_config_errors_name_the_key(change, message):
    with pytest.raises(ft.FluxConfigError, match=message):
        ft.FluxTransformerConfig.from_dict({**TINY_DEV, **change})


@pytest.mark.parametrize(("name", "published"), sorted(PUBLISHED_COUNTS.items()))
def test_released_param_counts(name, published):
    """count_params (eval_shape, nothing allocated) = diffusers on the meta device."""
    from diffusers import FluxTransformer2DModel

    section = {"dev": FLUX1_DEV, "schnell": FLUX1_SCHNELL}[name]
    with torch.device("meta"):
        reference = FluxTransformer2DModel(**section)
    meta_count = sum(p.numel() for p in reference.parameters())
    assert ft.count_params(ft.FluxTransformerConfig.from_dict(section)) == meta_count == published


def test_bad_inputs_are_named():
    config = ft.FluxTransformerConfig.from_dict(TINY_DEV)
    module = ft.FluxTransformer(config)
    params = nn.meta.unbox(ft.abstract_params(module))
    good = _inputs(TINY_DEV, 2, 4, 4, 3)

    def run(**changes):  # shape checks fire while tracing; nothing is computed
        return jax.eval_shape(
            functools.partial(module.apply, **{**good, **changes}), {"params": params}
        )

    assert run().shape == (2, 4, 16)
    cases = [
        ({"hidden_states": good["hidden_states"][..., :8]}, "hidden_states"),
        ({"encoder_hidden_states": good["encoder_hidden_states"][:1]}, "encoder_hidden_states"),
        ({"pooled_projections": good["pooled_projections"][:, :3]}, "pooled_projections"),
        ({"timestep": good["timestep"][:1]}, "timestep"),
        ({"img_ids": good["img_ids"][:3]}, r"img_ids must be \[4, 3\]"),
        ({"txt_ids": good["txt_ids"][None]}, "txt_ids"),
        ({"guidance": None}, "guidance is required"),
        ({"guidance": good["guidance"][:1]}, "guidance must be"),
    ]
    for changes, message in cases:
        with pytest.raises(ValueError, match=message):
            run(**changes)

    schnell = ft.FluxTransformer(ft.FluxTransformerConfig.from_dict(TINY_SCHNELL))
    inputs = _inputs(TINY_SCHNELL, 1, 4, 4, 3)
    with pytest.raises(ValueError, match="guidance_embeds=False"):
        jax.eval_shape(
            functools.partial(schnell.apply, **{**inputs, "guidance": np.ones(1, np.float32)}),
            {"params": nn.meta.unbox(ft.abstract_params(schnell))},
        )


def test_mesh_that_does_not_divide_is_refused():
    mesh = sharding.make_mesh(
        sharding.MeshConfig(
            ici_data_parallelism=2, ici_fsdp_parallelism=2, ici_tensor_parallelism=2
        )
    )
    config = ft.FluxTransformerConfig.from_dict(TINY_ODD)  # 3 heads over tensor 2
    module = ft.FluxTransformer(config, mesh=mesh)
    params = nn.meta.unbox(ft.abstract_params(module))
    inputs = _inputs(TINY_ODD, 4, 4, 4, 3)
    with pytest.raises(sharding.ShardingError, match="num_attention_heads 3"):
        jax.eval_shape(functools.partial(module.apply, **inputs), {"params": params})


# --- FLOPs ----------------------------------------------------------------------------------


@pytest.mark.usefixtures("xla_dots")  # XLA counts no custom call's FLOPs
def test_flops_formula_matches_xla_count():
    """The analytic matmul FLOPs agree with XLA's cost analysis of the lowered forward (within
    10%, reached 3%: XLA also counts elementwise work: norms, GELU, softmax, RoPE)."""
    shapes = dict(
        num_attention_heads=4,
        attention_head_dim=32,
        axes_dims_rope=(8, 12, 12),
        joint_attention_dim=64,
        pooled_projection_dim=32,
    )
    config = ft.FluxTransformerConfig.from_dict({**TINY_DEV, **shapes})
    module = ft.FluxTransformer(config)
    inputs = _inputs({**TINY_DEV, **shapes}, 1, 32, 32, 64)  # 256 image tokens, 64 text tokens
    specs = {
        k: None if v is None else jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in inputs.items()
    }
    params = jax.eval_shape(lambda: ft.init_flux_transformer(config, jax.random.key(0))[1])
    cost = jax.jit(module.apply).lower({"params": params}, **specs).cost_analysis()
    formula = ft.flops_per_forward(config, batch=1, image_tokens=256, text_tokens=64)
    assert formula == pytest.approx(cost["flops"], rel=0.10)
