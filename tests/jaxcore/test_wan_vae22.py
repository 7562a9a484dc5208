"""Wan 2.2 VAE (AutoencoderKLWan(is_residual=True, patch_size=2)) vs diffusers, fp32.

Random tiny models with perturbed RMS-norm gammas, saved with ``save_pretrained`` (plus the
``clip_output`` key that the real Wan2.2-TI2V-5B vae/config.json carries) and reloaded by
both sides. References come from diffusers' own ``encode`` / ``decode``, i.e. its frame
chunking, feature cache and first-chunk rules, so a wrong chunk rule cannot pass.

Reached (fp32 on CPU, highest matmul precision, max abs, |values| ~1): TINY22 encode mean
3.3e-7, logvar 2.1e-7, decode 1.3e-6; ODD 3.0e-7, 2.8e-7, 2.8e-6; the slow TI2V-5B-shaped
model (17 frames) 1.9e-7, 2.3e-7, 2.7e-6. The rest is conv summation order. Asserted at
ATOL = 1e-5, as for Wan 2.1 (test_wan_vae.py). The layout functions match exactly (AvgDown3D's
mean to 1e-6).
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from diffusers import AutoencoderKLWan
from diffusers.models.autoencoders import autoencoder_kl_wan as reference
from flax import linen as nn

from jaxcore.models import wan_vae, wan_vae_residual
from tests.jaxcore.test_wan_vae import assert_abstract_params_equal_whole_video_init
from tests.support import wan_vae_reference as ref

ATOL = 1e-5

# Patchified residual VAE shaped like Wan 2.2 at three levels: spatial 2 (patch) x 4 = 8,
# temporal 2, its own decoder width, non-trivial latent statistics.
TINY22 = dict(
    base_dim=8,
    decoder_base_dim=12,
    z_dim=8,
    dim_mult=[1, 2, 2],
    num_res_blocks=1,
    attn_scales=[],
    temperal_downsample=[False, True],
    is_residual=True,
    in_channels=12,
    out_channels=12,
    patch_size=2,
    scale_factor_spatial=8,
    scale_factor_temporal=2,
    latents_mean=[0.1 * i - 0.3 for i in range(8)],
    latents_std=[0.5 + 0.1 * i for i in range(8)],
)
# Residual without patchify, four levels like the real model, where a decoder level halves
# the channels while it upsamples in time (DupUp3D repeats fewer times than it unfolds), a
# temporal downsample in the first level, and attn_scales that diffusers' residual branch
# ignores. (num_res_blocks=2 and the exact TI2V-5B structure: the slow test below.)
ODD = dict(
    base_dim=4,
    decoder_base_dim=6,
    z_dim=8,
    dim_mult=[1, 1, 2, 2],
    num_res_blocks=1,
    attn_scales=[0.5],
    temperal_downsample=[True, False, True],
    is_residual=True,
    latents_mean=[0.0] * 8,
    latents_std=[1.0] * 8,
)

# Wan-AI/Wan2.2-TI2V-5B-Diffusers vae/config.json, as written by diffusers'
# scripts/convert_wan_to_diffusers.py (vae22_diffusers_config); dim_mult, num_res_blocks,
# attn_scales, temperal_downsample and dropout are AutoencoderKLWan's defaults there.
# Latent statistics are replaced by placeholders of the right length (they hold no weights).
WAN22_TI2V_5B = dict(
    base_dim=160,
    decoder_base_dim=256,
    z_dim=48,
    dim_mult=[1, 2, 4, 4],
    num_res_blocks=2,
    attn_scales=[],
    temperal_downsample=[False, True, True],
    dropout=0.0,
    is_residual=True,
    in_channels=12,
    out_channels=12,
    patch_size=2,
    scale_factor_spatial=16,
    scale_factor_temporal=4,
    latents_mean=[0.0] * 48,
    latents_std=[1.0] * 48,
)


def _save_reference(directory, config_kwargs, seed=0):
    """Random diffusers model saved like a hub checkpoint; returns it reloaded from disk."""
    ref.save_reference(directory, config_kwargs, seed)
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    config["clip_output"] = False  # as in the real Wan2.2-TI2V-5B-Diffusers config
    config_path.write_text(json.dumps(config))
    return AutoencoderKLWan.from_pretrained(directory).eval()


@pytest.fixture(scope="module")
def tiny22(tmp_path_factory):
    directory = tmp_path_factory.mktemp("wan_vae22_tiny")
    model = _save_reference(directory, TINY22)
    module, params = wan_vae.load_wan_vae(directory)
    return model, module, params, directory


# -- the parameter-free reshapes, against diffusers' own functions and modules ---------------


def _channel_last(x):
    return jnp.asarray(np.moveaxis(x, 1, -1))


def _channel_first(x):
    return np.moveaxis(np.asarray(x), -1, 1)


def test_patchify_and_unpatchify_match_diffusers():
    video = ref.video((2, 3, 2, 6, 8), seed=1)
    expected = reference.patchify(torch.from_numpy(video), 2).numpy()
    got = wan_vae_residual.patchify(_channel_last(video), 2)
    np.testing.assert_array_equal(_channel_first(got), expected)
    np.testing.assert_array_equal(
        _channel_first(wan_vae_residual.unpatchify(got, 2)),
        reference.unpatchify(torch.from_numpy(expected), 2).numpy(),
    )
    np.testing.assert_array_equal(_channel_first(wan_vae_residual.unpatchify(got, 2)), video)


@pytest.mark.parametrize(
    ("c_in", "c_out", "factor_t", "factor_s", "frames"),
    [(8, 16, 2, 2, 1), (8, 8, 1, 2, 4), (6, 8, 2, 2, 3)],
)
def test_avg_down_3d_matches_diffusers(c_in, c_out, factor_t, factor_s, frames):
    x = ref.video((2, c_in, frames, 4, 6), seed=c_in + frames)
    module = reference.AvgDown3D(c_in, c_out, factor_t, factor_s)
    expected = module(torch.from_numpy(x)).numpy()
    got = wan_vae_residual.avg_down_3d(_channel_last(x), c_out, factor_t, factor_s)
    assert ref.max_err(_channel_first(got), expected) < 1e-6


@pytest.mark.parametrize(
    ("c_in", "c_out", "factor_t", "first_chunk"),
    [(16, 16, 2, True), (16, 8, 2, False), (8, 6, 1, True)],
)
def test_dup_up_3d_matches_diffusers(c_in, c_out, factor_t, first_chunk):
    x = ref.video((2, c_in, 2, 2, 3), seed=c_in)
    module = reference.DupUp3D(c_in, c_out, factor_t, 2)
    expected = module(torch.from_numpy(x), first_chunk=first_chunk).numpy()
    got = wan_vae_residual.dup_up_3d(_channel_last(x), c_out, factor_t, 2, first_chunk)
    np.testing.assert_array_equal(_channel_first(got), expected)


# -- the whole VAE ----------------------------------------------------------------------------


@pytest.mark.parametrize("frames", [1, 5, 9])
def test_encode_matches_diffusers(tiny22, frames):
    model, module, params, _ = tiny22
    video = ref.video((1, 3, frames, 16, 24), seed=frames)
    mean_ref, logvar_ref = ref.torch_posterior(model, video)

    posterior = wan_vae.encode(module, params, jnp.asarray(video))

    # x8 spatial (patch 2, two downsampling levels), x2 temporal.
    assert mean_ref.shape == (1, 8, 1 + (frames - 1) // 2, 2, 3)
    assert ref.max_err(posterior.mean, mean_ref) < ATOL
    assert ref.max_err(posterior.logvar, logvar_ref) < ATOL
    assert np.abs(mean_ref).max() > 0.05  # not a degenerate all-zero comparison


@pytest.mark.parametrize("latent_frames", [1, 2, 3])
def test_decode_matches_diffusers(tiny22, latent_frames):
    model, module, params, _ = tiny22
    z = ref.latents((1, 8, latent_frames, 2, 3), seed=latent_frames)
    expected = ref.torch_decode(model, z)
    ref.assert_not_all_clamped(expected)

    got = wan_vae.decode(module, params, jnp.asarray(z))

    assert expected.shape == (1, 3, 1 + 2 * (latent_frames - 1), 16, 24)
    assert ref.max_err(got, expected) < ATOL


def test_config_geometry_and_checkpoint_layout(tiny22):
    model, module, params, directory = tiny22
    config = module.config
    assert (config.spatial_compression, config.temporal_compression) == (8, 2)
    assert (config.video_channels, config.output_video_channels, config.patch) == (3, 3, 2)
    assert config == wan_vae.WanVAEConfig.from_dict(dict(model.config))
    # load_wan_vae already refused missing/unexpected keys; these are the new module names.
    assert "clip_output" in json.loads((directory / "config.json").read_text())
    down, up = params["encoder"]["down_blocks_1"], params["decoder"]["up_blocks_0"]
    assert set(down) == {"resnets_0", "downsampler"}
    assert set(down["downsampler"]) == {"resample_1", "time_conv"}
    assert set(up) == {"resnets_0", "resnets_1", "upsampler"}
    assert up["upsampler"]["resample_1"]["kernel"].shape == (3, 3, 24, 24)  # keeps channels


def test_abstract_params_equal_those_of_a_whole_video_init():
    assert_abstract_params_equal_whole_video_init(wan_vae.WanVAEConfig.from_dict(TINY22))


def test_odd_residual_config_batch_two_matches_diffusers(tmp_path):
    model = _save_reference(tmp_path, ODD, seed=3)
    module, params = wan_vae.load_wan_vae(tmp_path)
    assert (module.config.spatial_compression, module.config.temporal_compression) == (8, 4)
    video = ref.video((2, 3, 9, 16, 24), seed=3)
    ref.assert_matches_reference(model, module, params, video, (2, 8, 3, 2, 3), 4, ATOL)


def _meta_model(config_kwargs):
    with torch.device("meta"):
        return AutoencoderKLWan(**config_kwargs)


def _param_sizes(config: wan_vae.WanVAEConfig) -> dict[str, int]:
    """{diffusers key: element count} of our parameters, from shapes only."""
    boxed = wan_vae.abstract_params(wan_vae.WanVAE(config))
    flat = dict(jax.tree_util.tree_flatten_with_path(nn.meta.unbox(boxed))[0])
    sizes = {}
    # = weight_map(config), without tracing the model a second time
    for path, (key, _) in wan_vae.KIND.weight_map(config, boxed).items():
        leaf = flat[tuple(jax.tree_util.DictKey(k) for k in path)]
        sizes[key] = int(np.prod(leaf.shape))
    return sizes


def test_real_ti2v_5b_config_parameter_count():
    """The real Wan 2.2 VAE, built on torch's meta device: same tensors, same element counts."""
    model = _meta_model(WAN22_TI2V_5B)
    config = wan_vae.WanVAEConfig.from_dict({**dict(model.config), "clip_output": False})
    assert (config.spatial_compression, config.temporal_compression) == (16, 4)
    assert config.spatial_compression == config.scale_factor_spatial
    assert config.temporal_compression == config.scale_factor_temporal
    assert config.video_channels == 3

    expected = {k: v.numel() for k, v in model.state_dict().items()}
    got = _param_sizes(config)

    assert got == expected
    assert sum(got.values()) == 704_688_668


def test_wan21_configs_refuse_nothing_new():
    """Wan 2.1 configs parse and build exactly as before: the Wan 2.1 14B/1.3B VAE (diffusers'
    defaults) has diffusers' tensors, and only the refusals that predate Wan 2.2 remain."""
    model = _meta_model({})
    config = wan_vae.WanVAEConfig.from_dict(dict(model.config))
    assert (config.spatial_compression, config.temporal_compression) == (8, 4)
    assert (config.patch, config.video_channels, config.is_residual) == (1, 3, False)
    assert _param_sizes(config) == {k: v.numel() for k, v in model.state_dict().items()}
    tiny21 = dict(base_dim=8, z_dim=4, dim_mult=[1, 2], num_res_blocks=1, attn_scales=[])
    tiny21 |= dict(temperal_downsample=[True], latents_mean=[0.0] * 4, latents_std=[1.0] * 4)
    assert wan_vae.WanVAEConfig.from_dict(tiny21).spatial_compression == 2
    # Still refused in the Wan 2.1 branch: encoder attention scales, which diffusers cannot run.
    with pytest.raises(wan_vae.WanVAEConfigError, match="attn_scales"):
        wan_vae.WanVAEConfig.from_dict({**tiny21, "attn_scales": [0.5]})
    # A plain Wan 2.1 architecture with patchify is valid in diffusers, so valid here.
    patched = wan_vae.WanVAEConfig(patch_size=2, in_channels=12, out_channels=12)
    assert (patched.spatial_compression, patched.video_channels) == (16, 3)


@pytest.mark.parametrize(
    ("change", "message", "diffusers_refuses"),
    [
        # diffusers' AvgDown3D raises: the last encoder level maps 8 -> 16 channels at x1.
        ({"dim_mult": [1, 2, 4]}, "encoder level 2", ValueError),
        # diffusers' DupUp3D asserts: decoder level 2 maps 96 -> 12 channels at x4.
        (
            {"dim_mult": [1, 1, 8, 8], "temperal_downsample": [False, False, True]},
            "decoder level 2",
            AssertionError,
        ),
        # diffusers builds this but its encoder's conv_in then gets 12 channels, not 3.
        ({"in_channels": 3}, "in_channels", None),
        ({"out_channels": 6}, "out_channels", None),
        ({"patch_size": 0}, "patch_size", None),
    ],
)
def test_bad_wan22_config_is_an_error_naming_the_key(change, message, diffusers_refuses):
    config = {**TINY22, **change}
    with pytest.raises(wan_vae.WanVAEConfigError, match=message):
        wan_vae.WanVAEConfig.from_dict(config)
    if diffusers_refuses is not None:
        with pytest.raises(diffusers_refuses):
            _meta_model(config)


def test_bad_video_for_patched_vae_names_the_dimension():
    config = wan_vae.WanVAEConfig.from_dict(TINY22)
    with pytest.raises(ValueError, match=r"12 channels but the VAE takes 3"):
        wan_vae.check_video(config, (1, 12, 1, 16, 16))
    with pytest.raises(ValueError, match="width 20 is not divisible by the spatial compression 8"):
        wan_vae.check_video(config, (1, 3, 1, 16, 20))


@pytest.mark.slow
def test_real_shaped_tiny_model_long_clip_matches_diffusers(tmp_path):
    """TI2V-5B's exact structure (levels, res blocks, patch, x16 x4) at tiny width, 17 frames."""
    config = {**WAN22_TI2V_5B, "base_dim": 4, "decoder_base_dim": 6, "z_dim": 8}
    config |= {"latents_mean": [0.0] * 8, "latents_std": [1.0] * 8}
    model = _save_reference(tmp_path, config, seed=5)
    module, params = wan_vae.load_wan_vae(tmp_path)
    video = ref.video((1, 3, 17, 32, 48), seed=17)
    mean_ref, logvar_ref = ref.torch_posterior(model, video)
    posterior = wan_vae.encode(module, params, jnp.asarray(video))
    assert mean_ref.shape == (1, 8, 5, 2, 3)
    assert ref.max_err(posterior.mean, mean_ref) < ATOL
    assert ref.max_err(posterior.logvar, logvar_ref) < ATOL
    expected = ref.torch_decode(model, mean_ref)
    assert ref.max_err(wan_vae.decode(module, params, jnp.asarray(mean_ref)), expected) < ATOL
