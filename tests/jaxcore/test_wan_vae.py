"""Wan 2.1 VAE vs diffusers' AutoencoderKLWan (random tiny models, fp32, same weights).

Reference outputs come from ``AutoencoderKLWan.encode`` / ``.decode`` themselves, i.e. from
diffusers' own frame chunking and feature cache, so a wrong chunk rule cannot pass.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxcore import sharding, weights
from jaxcore.models import wan_vae
from tests.support import wan_vae_reference as ref

# fp32 on CPU, highest matmul precision (conftest). Reached: encode mean/logvar <= 6e-7,
# decode <= 1.3e-6 max abs (|values| ~1) on the tiny configs; the rest is conv summation order.
ATOL = 1e-5

TINY = dict(
    base_dim=8,
    z_dim=4,
    dim_mult=[1, 2],
    num_res_blocks=1,
    attn_scales=[],
    temperal_downsample=[True],
    latents_mean=[0.0] * 4,
    latents_std=[1.0] * 4,
)
# Three levels (x4 spatial, x4 temporal like Wan 2.1), its own decoder width, non-trivial
# latent statistics. (The slow test adds num_res_blocks=2, as in Wan 2.1.)
TINY_3LEVEL = dict(
    base_dim=8,
    decoder_base_dim=6,
    z_dim=4,
    dim_mult=[1, 2, 2],
    num_res_blocks=1,
    attn_scales=[],
    temperal_downsample=[True, True],
    latents_mean=[0.3, -0.5, 1.2, 0.0],
    latents_std=[2.0, 0.5, 1.5, 3.0],
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("wan_vae_tiny")
    model = ref.save_reference(directory, TINY)
    module, params = wan_vae.load_wan_vae(directory)
    return model, module, params, directory


@pytest.mark.parametrize("frames", [1, 5, 9])
def test_encode_matches_diffusers(tiny, frames):
    model, module, params, _ = tiny
    video = ref.video((1, 3, frames, 16, 24), seed=frames)
    mean_ref, logvar_ref = ref.torch_posterior(model, video)

    posterior = wan_vae.encode(module, params, jnp.asarray(video))

    # tiny: x2 temporal -> 1 + 2k latent frames for 1 + 4k frames, x2 spatial.
    assert mean_ref.shape == (1, 4, 1 + (frames - 1) // 2, 8, 12)
    assert ref.max_err(posterior.mean, mean_ref) < ATOL
    assert ref.max_err(posterior.logvar, logvar_ref) < ATOL
    assert np.abs(mean_ref).max() > 0.05  # not a degenerate all-zero comparison


@pytest.mark.parametrize("latent_frames", [1, 2, 3])
def test_decode_matches_diffusers(tiny, latent_frames):
    model, module, params, _ = tiny
    z = ref.latents((1, 4, latent_frames, 8, 12), seed=latent_frames)
    expected = ref.torch_decode(model, z)
    ref.assert_not_all_clamped(expected)

    got = wan_vae.decode(module, params, jnp.asarray(z))

    assert expected.shape == (1, 3, 1 + 2 * (latent_frames - 1), 16, 24)
    assert ref.max_err(got, expected) < ATOL


def test_module_methods_match_diffusers_forward(tiny):
    """The unjitted whole-video path (apply with method=..., mutable cache) = diffusers forward.

    One frame keeps this eager (op-by-op) run fast; the multi-chunk rules are covered above.
    """
    model, module, params, _ = tiny
    video = ref.video((1, 3, 1, 8, 8), seed=7)
    with torch.no_grad():
        expected = model(torch.from_numpy(video)).sample.numpy()
    mean_ref, _ = ref.torch_posterior(model, video)

    got, _ = module.apply({"params": params}, jnp.asarray(video), mutable=["cache"])
    posterior, _ = module.apply(
        {"params": params}, jnp.asarray(video), method="encode", mutable=["cache"]
    )

    assert ref.max_err(got, expected) < ATOL
    assert ref.max_err(posterior.mean, mean_ref) < ATOL


def test_three_levels_batch_two_and_latent_statistics(tmp_path):
    model = ref.save_reference(tmp_path, TINY_3LEVEL, seed=3)
    module, params = wan_vae.load_wan_vae(tmp_path)
    config = module.config
    assert (config.spatial_compression, config.temporal_compression) == (4, 4)
    video = ref.video((2, 3, 9, 16, 16), seed=3)
    mean_ref, logvar_ref = ref.torch_posterior(model, video)

    posterior = wan_vae.encode(module, params, jnp.asarray(video))

    assert mean_ref.shape == (2, 4, 3, 4, 4)
    assert ref.max_err(posterior.mean, mean_ref) < ATOL
    assert ref.max_err(posterior.logvar, logvar_ref) < ATOL

    # The pipeline path: the diffusion model works on normalised latents; before decoding they
    # are denormalised with WanPipeline's formula z / (1 / std) + mean.
    z_norm = ref.latents((2, 4, 3, 4, 4), seed=4)
    mean_t = torch.tensor(TINY_3LEVEL["latents_mean"]).view(1, 4, 1, 1, 1)
    inv_std_t = 1.0 / torch.tensor(TINY_3LEVEL["latents_std"]).view(1, 4, 1, 1, 1)
    z_ref = (torch.from_numpy(z_norm) / inv_std_t + mean_t).numpy()
    z = wan_vae.denormalize_latents(jnp.asarray(z_norm), config)
    assert ref.max_err(z, z_ref) < 1e-6
    expected = ref.torch_decode(model, z_ref)
    ref.assert_not_all_clamped(expected)
    assert expected.shape == (2, 3, 9, 16, 16)
    assert ref.max_err(wan_vae.decode(module, params, z), expected) < ATOL


def test_normalize_latents_matches_pipeline_and_round_trips():
    config = wan_vae.WanVAEConfig.from_dict(TINY_3LEVEL)
    z = ref.latents((1, 4, 2, 3, 5), seed=5)
    mean_t = torch.tensor(config.latents_mean).view(1, 4, 1, 1, 1)
    inv_std_t = 1.0 / torch.tensor(config.latents_std).view(1, 4, 1, 1, 1)
    # WanImageToVideoPipeline.prepare_latents: (latents - mean) * (1 / std)
    expected = ((torch.from_numpy(z) - mean_t) * inv_std_t).numpy()

    z_norm = wan_vae.normalize_latents(jnp.asarray(z), config)

    assert ref.max_err(z_norm, expected) < 1e-6
    assert not np.allclose(np.asarray(z_norm), z)  # the statistics really apply
    assert ref.max_err(wan_vae.denormalize_latents(z_norm, config), z) < 1e-6
    with pytest.raises(ValueError, match=r"\[B, 4, F, H, W\]"):
        wan_vae.normalize_latents(jnp.zeros((1, 3, 1, 2, 2)), config)


def test_sharded_load_matches_unsharded(tiny):
    model, module, params, directory = tiny
    mesh = sharding.make_mesh()
    sharded_module, sharded_params = wan_vae.load_wan_vae(directory, mesh=mesh)
    leaf = sharded_params["decoder"]["conv_in"]["kernel"]
    assert len(leaf.sharding.device_set) == 8 and leaf.sharding.is_fully_replicated
    video = ref.video((1, 3, 1, 8, 8), seed=11)

    got = wan_vae.encode(sharded_module, sharded_params, jnp.asarray(video)).mean
    expected = wan_vae.encode(module, params, jnp.asarray(video)).mean

    assert ref.max_err(got, np.asarray(expected)) < 1e-6


def test_init_matches_checkpoint_layout(tiny):
    _, module, params, _ = tiny
    init_module, init_params = wan_vae.init_wan_vae(module.config, jax.random.key(0))
    shapes = jax.tree.map(lambda x: x.shape, params)
    assert jax.tree.map(lambda x: x.shape, init_params) == shapes
    conv = init_params["encoder"]["mid_block"]["resnets_0"]["conv1"]
    fan_in = np.prod(conv["kernel"].shape[:-1])
    assert 0.7 < float(jnp.std(conv["kernel"])) * np.sqrt(fan_in) < 1.3  # lecun normal
    assert not np.any(np.asarray(conv["bias"]))
    assert np.all(np.asarray(init_params["decoder"]["norm_out"]["gamma"]) == 1.0)
    # Every diffusers tensor has exactly one parameter (load_params checks the converse).
    keys = {src for src, _ in wan_vae.weight_map(module.config).values()}
    assert keys == set(weights.SafetensorsReader(tiny[3]).keys())
    assert init_module.config == module.config


@pytest.mark.parametrize(
    "config",
    [TINY_3LEVEL, dict(TINY_3LEVEL, temperal_downsample=[False, True])],
    ids=["three_levels", "one_time_level"],
)
def test_abstract_params_equal_those_of_a_whole_video_init(config):
    """abstract_params traces one later chunk each way; the parameters (names, shapes,
    partitioning) are those a whole first-plus-later-chunk video creates (test_wan_vae22
    runs this on a Wan 2.2 config)."""
    assert_abstract_params_equal_whole_video_init(wan_vae.WanVAEConfig.from_dict(config))


def assert_abstract_params_equal_whole_video_init(config: wan_vae.WanVAEConfig):
    module = wan_vae.WanVAE(config)
    s = config.spatial_compression
    video = jax.ShapeDtypeStruct((1, config.video_channels, 5, s, s), jnp.float32)  # 1 + 4
    whole = jax.eval_shape(lambda v: module.init(jax.random.key(0), v), video)["params"]
    got = wan_vae.abstract_params(module)
    assert jax.tree.structure(got) == jax.tree.structure(whole)
    assert jax.tree.map(lambda x: x.shape, got) == jax.tree.map(lambda x: x.shape, whole)


def test_config_from_diffusers_json(tiny):
    model, module, _, _ = tiny
    config = wan_vae.WanVAEConfig.from_dict(dict(model.config))  # includes _use_default_values
    assert config == module.config
    assert config.temperal_upsample == (True,)
    # A real Wan 2.1 config.json omits most fields; the defaults are diffusers' defaults.
    wan21 = wan_vae.WanVAEConfig.from_dict(
        {"_class_name": "AutoencoderKLWan", "base_dim": 96, "z_dim": 16}
    )
    assert (wan21.spatial_compression, wan21.temporal_compression) == (8, 4)
    assert len(wan21.latents_mean) == len(wan21.latents_std) == 16


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"bogus_key": 1}, "bogus_key"),
        ({"is_residual": True}, "is_residual"),
        ({"patch_size": 2}, "patch_size"),
        ({"attn_scales": [0.5]}, "attn_scales"),
        ({"temperal_downsample": [True, False]}, "temperal_downsample"),
        ({"latents_std": [1.0] * 3}, "latents_std"),
        ({"base_dim": 0}, "base_dim"),
    ],
)
def test_bad_config_is_an_error_naming_the_key(change, message):
    with pytest.raises(wan_vae.WanVAEConfigError, match=message):
        wan_vae.WanVAEConfig.from_dict({**TINY, **change})


@pytest.mark.parametrize(
    ("shape", "message"),
    [
        ((1, 3, 6, 16, 16), "6 frames"),
        ((1, 4, 5, 16, 16), "4 channels"),
        ((1, 3, 5, 15, 16), "height 15"),
        ((3, 5, 16, 16), r"\[B, C, F, H, W\]"),
    ],
)
def test_bad_video_is_an_error_naming_the_dimension(shape, message):
    config = wan_vae.WanVAEConfig.from_dict(TINY)
    with pytest.raises(ValueError, match=message):
        wan_vae.check_video(config, shape)


def test_bad_latents_and_missing_cache_are_errors(tiny):
    _, module, params, _ = tiny
    with pytest.raises(ValueError, match="3 channels but z_dim is 4"):
        wan_vae.decode(module, params, jnp.zeros((1, 3, 1, 2, 2)))
    with pytest.raises(ValueError, match="mutable=\\['cache'\\]"):
        module.apply({"params": params}, jnp.zeros((1, 3, 1, 8, 8)), method="encode")


def test_unexpected_checkpoint_key_is_reported(tmp_path):
    model = ref.save_reference(tmp_path, TINY)
    config = wan_vae.WanVAEConfig.from_dict(dict(model.config))
    assert dataclasses.asdict(config)["z_dim"] == 4
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    state["decoder.extra.weight"] = np.zeros((1,), np.float32)
    (tmp_path / "diffusion_pytorch_model.safetensors").unlink()
    weights.save_safetensors(state, tmp_path / "diffusion_pytorch_model.safetensors")
    with pytest.raises(weights.WeightsError, match="decoder.extra.weight"):
        wan_vae.load_wan_vae(tmp_path)


def test_encoder_only_load_reads_the_encoder_alone_and_encodes_the_same(tiny, tmp_path):
    model, module, params, directory = tiny
    enc_module, enc_params = wan_vae.load_wan_vae(directory, encoder_only=True)
    assert set(enc_params) == {"encoder", "quant_conv"} < set(params)
    for name in enc_params:
        jax.tree.map(np.testing.assert_array_equal, enc_params[name], params[name])
    video = jnp.asarray(ref.video((1, 3, 5, 16, 24), seed=2))
    full = wan_vae.encode(module, params, video)
    alone = wan_vae.encode(enc_module, enc_params, video)
    np.testing.assert_array_equal(alone.mean, full.mean)
    # the decoder's keys are not read; a missing encoder key still is an error
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    del state["decoder.conv_out.weight"]
    weights.save_safetensors(state, tmp_path / "diffusion_pytorch_model.safetensors")
    (tmp_path / "config.json").write_text((directory / "config.json").read_text())
    wan_vae.load_wan_vae(tmp_path, encoder_only=True)
    with pytest.raises(weights.WeightsError, match="decoder.conv_out.weight"):
        wan_vae.load_wan_vae(tmp_path)
    del state["encoder.conv_out.weight"]
    weights.save_safetensors(state, tmp_path / "diffusion_pytorch_model.safetensors")
    with pytest.raises(weights.WeightsError, match="encoder.conv_out.weight"):
        wan_vae.load_wan_vae(tmp_path, encoder_only=True)


@pytest.mark.slow
@pytest.mark.parametrize("frames", [13, 17])
def test_larger_video_round_trip_matches_diffusers(tmp_path, frames):
    model = ref.save_reference(tmp_path, {**TINY_3LEVEL, "num_res_blocks": 2}, seed=5)
    module, params = wan_vae.load_wan_vae(tmp_path)
    video = ref.video((1, 3, frames, 32, 48), seed=frames)
    mean_ref, logvar_ref = ref.torch_posterior(model, video)
    posterior = wan_vae.encode(module, params, jnp.asarray(video))
    assert ref.max_err(posterior.mean, mean_ref) < ATOL
    assert ref.max_err(posterior.logvar, logvar_ref) < ATOL
    expected = ref.torch_decode(model, mean_ref)
    assert ref.max_err(wan_vae.decode(module, params, jnp.asarray(mean_ref)), expected) < ATOL


def test_bfloat16_encode_tracks_float32(tiny):
    """bf16 activations and weights (the production dtype) run the same chunk loop; caches
    follow the dtype. Bound: bf16 has 8 mantissa bits, |mean| ~1 -> within 3e-2."""
    _, module, params, directory = tiny
    module16, params16 = wan_vae.load_wan_vae(directory, dtype=jnp.bfloat16)
    video = jnp.asarray(ref.video((1, 3, 5, 8, 8), seed=13))

    got = wan_vae.encode(module16, params16, video).mean
    expected = wan_vae.encode(module, params, video).mean

    assert got.dtype == jnp.bfloat16
    assert ref.max_err(got.astype(jnp.float32), np.asarray(expected)) < 3e-2
