"""LTX-Video VAE vs diffusers' AutoencoderKLLTXVideo (random tiny models, fp32, same weights).

Every diffusers parameter (and the latents_mean / latents_std buffers) is perturbed before
save_pretrained, so zero-initialised noise scales, unit norms or a wrong mapping cannot pass;
our side loads the saved directory through :func:`ltx_vae.load_ltx_vae`. References come
from ``AutoencoderKLLTXVideo.encode`` / ``.decode`` themselves.

Noise injection: diffusers draws its decoder noise with ``torch.randn``; the noise test
monkeypatches ``torch.randn`` during the reference decode so that it hands out, in order,
the very arrays our decoder is given (and checks each requested shape), and also decodes the
same model with noise disabled on both sides (separate config) at a non-zero timestep.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from diffusers import AutoencoderKLLTXVideo
from diffusers.pipelines.ltx.pipeline_ltx import LTXPipeline

from jaxcore import weights
from jaxcore.models import ltx_vae

# fp32 on CPU, highest matmul precision (conftest). Bound on outputs of magnitude ~1-3.5;
# reached (max abs): see the REACHED comments at each assertion (the brief's target: 1e-4).
ATOL = 1e-5

# (a) 0.9.0-style: LTXVideoDownBlock3D levels (stride-2 conv, channel-changing conv_out
# resnet), a decoder up block with a conv_in resnet, patch_size 4, no timestep conditioning.
V090 = dict(
    in_channels=3,
    out_channels=3,
    latent_channels=6,
    block_out_channels=(8, 16),
    down_block_types=("LTXVideoDownBlock3D",) * 2,
    decoder_block_out_channels=(8, 16),
    layers_per_block=(1, 1, 1),
    decoder_layers_per_block=(1, 1, 1),
    spatio_temporal_scaling=(True, False),
    decoder_spatio_temporal_scaling=(True, False),
    decoder_inject_noise=(False, False, False),
    downsample_type=("conv", "conv"),
    upsample_residual=(False, False),
    upsample_factor=(1, 1),
    timestep_conditioning=False,
    patch_size=4,
)
# (b) 0.9.1-style: 0.9.0 encoder; decoder with timestep conditioning, residual upsamplers
# dividing the width by upsample_factor 2 and noise injected in the up blocks (not the mid
# block), as Lightricks' 0.9.1 config has it (decoder_inject_noise read reversed).
V091 = dict(
    V090,
    block_out_channels=(8, 16, 16),
    down_block_types=("LTXVideoDownBlock3D",) * 3,
    layers_per_block=(1, 1, 1, 1),
    spatio_temporal_scaling=(True, True, False),
    decoder_block_out_channels=(8, 16),
    decoder_layers_per_block=(1, 2, 1),
    decoder_spatio_temporal_scaling=(True, True),
    decoder_inject_noise=(True, True, False),
    upsample_residual=(True, True),
    upsample_factor=(2, 2),
    timestep_conditioning=True,
)
V091_NO_NOISE = dict(V091, decoder_inject_noise=(False, False, False))
# (c) 0.9.5-style: LTXVideo095DownBlock3D levels mixing spatial / temporal / spatiotemporal
# space-to-depth downsamplers, patch_size 2, a non-causal encoder and a causal decoder (both
# unlike diffusers' defaults), residual and plain upsamplers with factors 2 and 1 and a level
# without upsampler, timestep conditioning.
V095 = dict(
    in_channels=3,
    out_channels=3,
    latent_channels=8,
    block_out_channels=(8, 16, 16, 32),
    down_block_types=("LTXVideo095DownBlock3D",) * 3,
    decoder_block_out_channels=(16, 16, 32),
    layers_per_block=(1, 1, 1, 1),
    decoder_layers_per_block=(1, 1, 2, 1),
    spatio_temporal_scaling=(True, True, True),
    decoder_spatio_temporal_scaling=(True, False, True),
    decoder_inject_noise=(False, False, False, False),
    downsample_type=("spatial", "temporal", "spatiotemporal"),
    upsample_residual=(False, False, True),
    upsample_factor=(2, 1, 2),
    timestep_conditioning=True,
    patch_size=2,
    encoder_causal=False,
    decoder_causal=True,
    spatial_compression_ratio=8,
    temporal_compression_ratio=4,
)
CONFIGS = {"v090": V090, "v091": V091, "v091_no_noise": V091_NO_NOISE, "v095": V095}


def save_reference(directory, config, seed: int = 0) -> AutoencoderKLLTXVideo:
    """A random diffusers VAE with every parameter and buffer perturbed, saved to directory."""
    torch.manual_seed(seed)
    model = AutoencoderKLLTXVideo(**config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("timestep_scale_multiplier"):
                param.mul_(1.0 + 0.1 * torch.randn(()))  # ~1000: keep it a timestep scale
            else:
                param.add_(0.05 * torch.randn_like(param))
        model.latents_mean.copy_(0.5 * torch.randn_like(model.latents_mean))
        model.latents_std.copy_(0.5 + torch.rand_like(model.latents_std))
    model.save_pretrained(directory)
    return model


def video(shape, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-1, 1, size=shape).astype(np.float32)


def latents(shape, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(size=shape).astype(np.float32)


def max_err(got, expected) -> float:
    got = np.asarray(got)
    assert got.shape == expected.shape, (got.shape, expected.shape)
    return float(np.abs(got - expected).max())


def torch_posterior(model, clip):
    with torch.no_grad():
        dist = model.encode(torch.from_numpy(clip)).latent_dist
    return dist.mean.numpy(), dist.logvar.numpy()


def torch_decode(model, z, temb=None):
    t = None if temb is None else torch.tensor(temb, dtype=torch.float32)
    with torch.no_grad():
        return model.decode(torch.from_numpy(z), t).sample.numpy()


def assert_posterior_matches(model, module, params, clip, shape):
    mean_ref, logvar_ref = torch_posterior(model, clip)
    posterior = ltx_vae.encode(module, params, jnp.asarray(clip))
    assert mean_ref.shape == shape
    assert np.abs(mean_ref).max() > 0.1 and np.std(logvar_ref) > 0.01  # not degenerate
    errors = max_err(posterior.mean, mean_ref), max_err(posterior.logvar, logvar_ref)
    assert max(errors) < ATOL, errors
    return errors


def _loaded(tmp_path_factory, name, seed):
    directory = tmp_path_factory.mktemp(f"ltx_vae_{name}")
    model = save_reference(directory, CONFIGS[name], seed=seed)
    module, params = ltx_vae.load_ltx_vae(directory)
    return model, module, params, directory


@pytest.fixture(scope="module")
def v090(tmp_path_factory):
    return _loaded(tmp_path_factory, "v090", 0)


@pytest.fixture(scope="module")
def v095(tmp_path_factory):
    return _loaded(tmp_path_factory, "v095", 2)


def test_v090_encode_and_decode_match_diffusers(v090):
    model, module, params, _ = v090
    config = module.config
    assert (config.spatial_compression, config.temporal_compression) == (8, 2)
    clip = video((1, 3, 9, 16, 24), seed=0)
    # REACHED: mean 1.2e-6, logvar 7.5e-7 (|mean| <= 1.6)
    assert_posterior_matches(model, module, params, clip, (1, 6, 5, 2, 3))

    z = latents((2, 6, 5, 2, 3), seed=1)
    expected = torch_decode(model, z)
    got = ltx_vae.decode(module, params, jnp.asarray(z))
    assert expected.shape == (2, 3, 9, 16, 24)
    assert np.abs(expected).max() > 0.5
    assert max_err(got, expected) < ATOL  # REACHED: 2.6e-6 (|out| <= 2.2)


def test_v090_whole_module_call_and_encoder_only_load(v090):
    """The unjitted ``__call__`` (decode(encode(x).mode())) = diffusers' forward, and an
    encoder-only load reads the encoder's tensors alone and encodes the same."""
    model, module, params, directory = v090
    clip = video((1, 3, 1, 8, 8), seed=3)
    with torch.no_grad():
        expected = model(torch.from_numpy(clip)).sample.numpy()
    assert max_err(module.apply({"params": params}, jnp.asarray(clip)), expected) < ATOL

    enc_module, enc_params = ltx_vae.load_ltx_vae(directory, encoder_only=True)
    assert set(enc_params) == {"encoder", "latents_mean", "latents_std"}
    mean_ref, _ = torch_posterior(model, clip)
    assert max_err(ltx_vae.encode(enc_module, enc_params, jnp.asarray(clip)).mean, mean_ref) < ATOL


@pytest.mark.parametrize("name", ["v091_no_noise", "v091"])
def test_v091_timestep_conditioned_decoder(tmp_path_factory, monkeypatch, name):
    """Decoder at non-zero per-sample timesteps (batch 2), with noise injection off, then on
    with the same noise on both sides; the 3-level 0.9.0 encoder too (no-noise case)."""
    model, module, params, _ = _loaded(tmp_path_factory, name, 1)
    config = module.config
    assert (config.spatial_compression, config.temporal_compression) == (16, 4)
    if name == "v091_no_noise":
        clip = video((1, 3, 9, 32, 48), seed=4)
        # REACHED: mean 1.1e-6, logvar 7.2e-7
        assert_posterior_matches(model, module, params, clip, (1, 6, 3, 2, 3))

    z = latents((2, 6, 3, 2, 3), seed=5)
    temb = [0.05, 0.4]
    noise = ltx_vae.sample_decoder_noise(config, (2, 3), jax.random.key(0))
    if config.injects_noise:
        # 2 up blocks x (2, 1) resnets x 2 draws, at 4x6 then 8x12 latent pixels.
        assert [n.shape for n in noise] == [(4, 6)] * 4 + [(8, 12)] * 2
        supplied = iter([torch.from_numpy(np.array(n)) for n in noise])

        def randn(*size, generator=None, device=None, dtype=None, **kwargs):
            shape = tuple(size[0]) if len(size) == 1 and not isinstance(size[0], int) else size
            draw = next(supplied)
            assert tuple(shape) == tuple(draw.shape)
            return draw.to(dtype=dtype)

        monkeypatch.setattr(torch, "randn", randn)
    else:
        assert noise == ()
    expected = torch_decode(model, z, temb)
    monkeypatch.undo()
    if config.injects_noise:
        assert next(supplied, None) is None  # diffusers drew exactly as many arrays

    got = ltx_vae.decode(module, params, jnp.asarray(z), temb, noise=noise)
    assert expected.shape == (2, 3, 9, 32, 48)
    assert np.abs(expected).max() > 0.5
    assert max_err(got, expected) < ATOL  # REACHED: 2.9e-6 / 2.2e-6 (|out| <= 2.0)
    # The timestep matters, and so does the noise where there is some.
    other_t = ltx_vae.decode(module, params, jnp.asarray(z), [0.05, 0.05], noise=noise)
    assert np.abs(np.asarray(other_t)[1] - expected[1]).max() > 1e-3
    if config.injects_noise:
        drawn = ltx_vae.decode(module, params, jnp.asarray(z), temb, rng=jax.random.key(1))
        assert np.abs(np.asarray(drawn) - expected).max() > 1e-3


def test_v095_encode_and_decode_match_diffusers(v095):
    model, module, params, _ = v095
    config = module.config
    assert (config.spatial_compression, config.temporal_compression) == (8, 4)
    levels = [lv.downsample for lv in config.encoder_levels]
    assert levels == [(1, 2, 2), (2, 1, 1), (2, 2, 2)]
    clip = video((1, 3, 9, 16, 24), seed=6)
    # REACHED: mean 1.3e-6, logvar 1.2e-6 (|mean| <= 1.9)
    assert_posterior_matches(model, module, params, clip, (1, 8, 3, 2, 3))

    z = latents((1, 8, 3, 2, 3), seed=7)
    expected = torch_decode(model, z, [0.05])
    got = ltx_vae.decode(module, params, jnp.asarray(z), 0.05)
    assert expected.shape == (1, 3, 9, 16, 24)
    assert np.abs(expected).max() > 0.5
    assert max_err(got, expected) < ATOL  # REACHED: 3.6e-6 (|out| <= 3.2)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_parameter_count_equals_diffusers(name):
    config = ltx_vae.LTXVideoVAEConfig.from_dict(CONFIGS[name])
    with torch.device("meta"):
        model = AutoencoderKLLTXVideo(**CONFIGS[name])
    n_params = sum(p.numel() for p in model.parameters())
    n_buffers = sum(b.numel() for b in model.buffers())
    assert ltx_vae.count_params(config) == n_params
    assert ltx_vae.count_params(config, include_buffers=True) == n_params + n_buffers


def test_weight_map_covers_the_checkpoint_and_init_has_its_layout(v095):
    _, module, params, directory = v095
    keys = {src for src, _ in ltx_vae.weight_map(module.config).values()}
    assert keys == set(weights.SafetensorsReader(directory).keys())
    assert "decoder.up_blocks.0.upsamplers.0.conv.conv.weight" in keys
    assert "encoder.down_blocks.1.downsamplers.0.conv.conv.bias" in keys
    init_module, init_params = ltx_vae.init_ltx_vae(module.config, jax.random.key(0))
    assert jax.tree.map(lambda x: x.shape, init_params) == jax.tree.map(lambda x: x.shape, params)
    assert float(init_params["decoder"]["timestep_scale_multiplier"][0]) == 1000.0
    assert init_module.config == module.config


def test_config_from_saved_json_and_real_configs(v095):
    model, module, _, _ = v095
    assert ltx_vae.LTXVideoVAEConfig.from_dict(dict(model.config)) == module.config
    default = ltx_vae.LTXVideoVAEConfig()  # 0.9.0's architecture
    assert (default.spatial_compression, default.temporal_compression) == (32, 8)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"bogus_key": 1}, "bogus_key"),
        ({"patch_size_t": 2}, "patch_size_t"),
        ({"down_block_types": ("Nope",) * 3}, "down_block_types"),
        ({"downsample_type": ("spatial", "sideways", "temporal")}, "downsample_type"),
        ({"layers_per_block": (1, 1)}, "layers_per_block"),
        ({"decoder_inject_noise": (False,)}, "decoder_inject_noise"),
        ({"block_out_channels": (8, 12, 16, 32)}, "block_out_channels"),
        ({"upsample_factor": (1, 1, 1)}, "upsample_factor"),
    ],
)
def test_bad_config_is_an_error_naming_the_key(change, message):
    with pytest.raises(ltx_vae.LTXVideoVAEConfigError, match=message):
        ltx_vae.LTXVideoVAEConfig.from_dict({**V095, **change})


def test_conv_in_with_timestep_conditioning_is_refused():
    """An up block that changes width through a conv_in resnet crashes diffusers when the
    decoder is timestep-conditioned; refused at config time."""
    with pytest.raises(ltx_vae.LTXVideoVAEConfigError, match="conv_in"):
        ltx_vae.LTXVideoVAEConfig.from_dict({**V090, "timestep_conditioning": True})


@pytest.mark.parametrize(
    ("shape", "message"),
    [
        ((1, 3, 8, 16, 24), "8 frames"),
        ((1, 4, 9, 16, 24), "4 channels"),
        ((1, 3, 9, 15, 24), "height 15"),
        ((1, 3, 9, 16, 20), "width"),
        ((3, 9, 16, 24), r"\[B, C, F, H, W\]"),
    ],
)
def test_bad_video_is_an_error_naming_the_dimension(shape, message):
    config = ltx_vae.LTXVideoVAEConfig.from_dict(V095)
    with pytest.raises(ValueError, match=message):
        ltx_vae.check_video(config, shape)


def test_decode_argument_errors():
    noisy = ltx_vae.LTXVideoVAE(ltx_vae.LTXVideoVAEConfig.from_dict(V091))
    plain = ltx_vae.LTXVideoVAE(ltx_vae.LTXVideoVAEConfig.from_dict(V090))
    z = jnp.zeros((1, 6, 2, 2, 3))
    with pytest.raises(ValueError, match="noise= or rng="):
        ltx_vae.decode(noisy, None, z, 0.05)
    with pytest.raises(ValueError, match="decoder noise has shapes"):
        ltx_vae.decode(noisy, None, z, 0.05, noise=(jnp.zeros((4, 6)),))
    with pytest.raises(ValueError, match="timestep_conditioning=False"):
        ltx_vae.decode(plain, None, z, 0.05)
    with pytest.raises(ValueError, match="5 channels"):
        ltx_vae.decode(plain, None, jnp.zeros((1, 5, 2, 2, 3)))


def test_latent_statistics_and_decode_noise_match_the_pipeline(v095):
    _, module, params, _ = v095
    config = module.config
    z = latents((2, 8, 2, 3, 4), seed=8)
    mean_t = torch.from_numpy(np.array(params["latents_mean"]))
    std_t = torch.from_numpy(np.array(params["latents_std"]))
    expected = LTXPipeline._normalize_latents(torch.from_numpy(z), mean_t, std_t, 0.7).numpy()
    cfg = ltx_vae.LTXVideoVAEConfig(**{**config.to_dict(), "scaling_factor": 0.7})
    z_norm = ltx_vae.normalize_latents(jnp.asarray(z), params, cfg)
    assert max_err(z_norm, expected) < 1e-5
    assert max_err(ltx_vae.denormalize_latents(z_norm, params, cfg), z) < 1e-5

    noise = latents(z.shape, seed=9)
    scale = torch.tensor([0.025, 0.1])[:, None, None, None, None]
    mixed = (1 - scale) * torch.from_numpy(z) + scale * torch.from_numpy(noise)
    got = ltx_vae.mix_decode_noise(jnp.asarray(z), jnp.asarray(noise), [0.025, 0.1])
    assert max_err(got, mixed.numpy()) < 1e-6
