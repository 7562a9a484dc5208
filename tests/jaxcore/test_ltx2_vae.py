"""LTX-2 video VAE vs diffusers' AutoencoderKLLTX2Video (random tiny models, fp32, same weights).

Every diffusers parameter (and the latents_mean / latents_std buffers) is perturbed before
save_pretrained, so zero-initialised noise scales, unit norms or a wrong mapping cannot pass;
our side loads the saved directory through :func:`ltx2_vae.load_ltx2_vae`. References come
from ``AutoencoderKLLTX2Video.encode`` / ``.decode`` themselves and from the LTX-2 pipelines'
static methods; the decode step the pipelines write inline is mirrored in
:func:`pipeline_decode` (pipeline_ltx2.py, ``__call__``'s decode branch).

Noise injection: diffusers draws its decoder noise with ``torch.randn``; the noisy test
monkeypatches ``torch.randn`` during the reference decode so that it hands out, in order, the
very arrays our decoder is given (checking each requested shape).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from diffusers import AutoencoderKLLTX2Video
from diffusers.models.autoencoders.autoencoder_kl_ltx2 import LTX2VideoCausalConv3d
from diffusers.pipelines.ltx2.pipeline_ltx2 import LTX2Pipeline
from diffusers.pipelines.ltx2.pipeline_ltx2_image2video import LTX2ImageToVideoPipeline

from jaxcore import weights
from jaxcore.models import ltx2_vae

# fp32 on CPU, highest matmul precision (conftest). Relative bound: max abs error / max |ref|.
RTOL = 1e-5
DOWN = "LTX2VideoDownBlock3D"

# (a) The released layout in small: space-to-depth downsamplers (spatial, temporal,
# spatiotemporal; one level without resnets), residual upsamplers halving the width, a reflect-
# padded non-causal decoder, and in the outermost up block an upsample_factor-1 level that
# changes width through a conv_in resnet (plain conv_shortcut) and upsamples in space only.
# Compression 8 / 4 in both halves; patch_size 2; no timestep conditioning.
RELEASED_LIKE = dict(
    in_channels=3,
    out_channels=3,
    latent_channels=8,
    block_out_channels=(16, 32, 32),
    down_block_types=(DOWN,) * 3,
    decoder_block_out_channels=(4, 16, 32),
    layers_per_block=(1, 0, 1, 1),
    decoder_layers_per_block=(1, 1, 1, 1),
    spatio_temporal_scaling=(True, True, True),
    decoder_spatio_temporal_scaling=(True, True, True),
    decoder_inject_noise=False,
    downsample_type=("spatial", "temporal", "spatiotemporal"),
    upsample_type=("spatiotemporal", "temporal", "spatial"),
    upsample_residual=(False, True, True),
    upsample_factor=(1, 2, 2),
    timestep_conditioning=False,
    patch_size=2,
    encoder_causal=True,
    decoder_causal=False,
    encoder_spatial_padding_mode="zeros",
    decoder_spatial_padding_mode="reflect",
    spatial_compression_ratio=8,
    temporal_compression_ratio=4,
    scaling_factor=0.8,
)
# (b) Everything else the class allows: a stride-2 "conv" downsampler, a non-causal reflect-
# padded encoder, a causal zero-padded decoder, timestep conditioning, noise injected in the
# mid block and the outer up block (bool shorthands as config.json may hold them), a
# non-residual upsampler, patch_size 4 (compression 16 / 4), resnet eps 1e-5.
CONDITIONED = dict(
    in_channels=3,
    out_channels=3,
    latent_channels=8,
    block_out_channels=(8, 16, 32),
    down_block_types=(DOWN,) * 3,
    decoder_block_out_channels=(16, 32),
    layers_per_block=(1, 1, 1, 1),
    decoder_layers_per_block=(1, 2, 1),
    spatio_temporal_scaling=True,
    decoder_spatio_temporal_scaling=True,
    decoder_inject_noise=(True, False, True),
    downsample_type=("conv", "spatial", "temporal"),
    upsample_type=("spatiotemporal", "spatiotemporal"),
    upsample_residual=(True, False),
    upsample_factor=(2, 2),
    timestep_conditioning=True,
    patch_size=4,
    resnet_norm_eps=1e-5,
    encoder_causal=False,
    decoder_causal=True,
    encoder_spatial_padding_mode="reflect",
    decoder_spatial_padding_mode="zeros",
    spatial_compression_ratio=16,
    temporal_compression_ratio=4,
    scaling_factor=1.3,
)
CONFIGS = {"released_like": RELEASED_LIKE, "conditioned": CONDITIONED}

# The released LTX-2 video VAE: diffusers' scripts/convert_ltx2_to_diffusers.py,
# get_ltx2_video_vae_config("2.0") (timestep_conditioning is a command-line switch there).
LTX2_RELEASED = dict(
    in_channels=3,
    out_channels=3,
    latent_channels=128,
    block_out_channels=(256, 512, 1024, 2048),
    down_block_types=(DOWN,) * 4,
    decoder_block_out_channels=(256, 512, 1024),
    layers_per_block=(4, 6, 6, 2, 2),
    decoder_layers_per_block=(5, 5, 5, 5),
    spatio_temporal_scaling=(True, True, True, True),
    decoder_spatio_temporal_scaling=(True, True, True),
    decoder_inject_noise=(False, False, False, False),
    downsample_type=("spatial", "temporal", "spatiotemporal", "spatiotemporal"),
    upsample_residual=(True, True, True),
    upsample_factor=(2, 2, 2),
    timestep_conditioning=False,
    patch_size=4,
    patch_size_t=1,
    resnet_norm_eps=1e-6,
    encoder_causal=True,
    decoder_causal=False,
    encoder_spatial_padding_mode="zeros",
    decoder_spatial_padding_mode="reflect",
    spatial_compression_ratio=32,
    temporal_compression_ratio=8,
)


def save_reference(directory, config, seed: int) -> AutoencoderKLLTX2Video:
    """A random diffusers VAE with every parameter and buffer perturbed, saved to directory."""
    torch.manual_seed(seed)
    model = AutoencoderKLLTX2Video(**config).eval()
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


def uniform(shape, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-1, 1, size=shape).astype(np.float32)


def normal(shape, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(size=shape).astype(np.float32)


def rel_err(got, expected) -> float:
    """max |got - expected| / max |expected|; the shapes must agree."""
    got = np.asarray(got)
    assert got.shape == expected.shape, (got.shape, expected.shape)
    return float(np.abs(got - expected).max() / np.abs(expected).max())


def t(x) -> torch.Tensor:
    return torch.from_numpy(np.array(x))


def torch_posterior(model, clip):
    with torch.no_grad():
        dist = model.encode(t(clip)).latent_dist
    return dist.mean.numpy(), dist.logvar.numpy()


class SuppliedRandn:
    """Stands in for torch.randn during a reference decode: hands out ``arrays`` in order,
    checking that each requested shape is the one we feed our decoder."""

    def __init__(self, arrays):
        self.arrays = iter([t(a) for a in arrays])

    def __call__(self, *size, generator=None, device=None, dtype=None, **kwargs):
        shape = tuple(size[0]) if len(size) == 1 and not isinstance(size[0], int) else size
        draw = next(self.arrays)
        assert tuple(shape) == tuple(draw.shape)
        return draw.to(dtype=dtype)

    def exhausted(self) -> bool:
        return next(self.arrays, None) is None


def pipeline_decode(model, latents, latent_noise, decode_timestep, decode_noise_scale):
    """LTX2Pipeline.__call__'s decode branch (pipeline_ltx2.py, after _unpack_latents), with the
    pipeline's randn_tensor draw given as ``latent_noise``."""
    latents = t(latents)
    timestep = None
    if model.config.timestep_conditioning:
        batch_size = latents.shape[0]
        if not isinstance(decode_timestep, list):
            decode_timestep = [decode_timestep] * batch_size
        if decode_noise_scale is None:
            decode_noise_scale = decode_timestep
        elif not isinstance(decode_noise_scale, list):
            decode_noise_scale = [decode_noise_scale] * batch_size
        timestep = torch.tensor(decode_timestep, dtype=latents.dtype)
        scale = torch.tensor(decode_noise_scale, dtype=latents.dtype)[:, None, None, None, None]
        latents = (1 - scale) * latents + scale * t(latent_noise)
    latents = LTX2Pipeline._denormalize_latents(
        latents, model.latents_mean, model.latents_std, model.config.scaling_factor
    )
    with torch.no_grad():
        return model.decode(latents, timestep, return_dict=False)[0].numpy()


def _loaded(tmp_path_factory, name, seed):
    directory = tmp_path_factory.mktemp(f"ltx2_vae_{name}")
    model = save_reference(directory, CONFIGS[name], seed=seed)
    module, params = ltx2_vae.load_ltx2_vae(directory)
    return model, module, params, directory


@pytest.fixture(scope="module")
def released_like(tmp_path_factory):
    return _loaded(tmp_path_factory, "released_like", 0)


@pytest.fixture(scope="module")
def conditioned(tmp_path_factory):
    return _loaded(tmp_path_factory, "conditioned", 1)


def assert_posterior_matches(model, module, params, clip, shape):
    mean_ref, logvar_ref = torch_posterior(model, clip)
    posterior = ltx2_vae.encode(module, params, jnp.asarray(clip))
    assert mean_ref.shape == shape
    assert np.abs(mean_ref).max() > 0.1 and np.std(logvar_ref) > 0.01  # not degenerate
    errors = rel_err(posterior.mean, mean_ref), rel_err(posterior.logvar, logvar_ref)
    assert max(errors) < RTOL, errors
    return errors


@pytest.mark.parametrize("padding_mode", list(ltx2_vae.PADDING_MODES))
@pytest.mark.parametrize("causal", [True, False])
def test_causal_conv_padding_modes_match_diffusers(padding_mode, causal):
    """Every torch padding_mode the config accepts (the tiny VAEs below use zeros and reflect),
    causal and not, on a stride-2 conv: LTX2VideoCausalConv3d vs ours."""
    torch.manual_seed(0)
    conv = LTX2VideoCausalConv3d(4, 6, 3, stride=2, spatial_padding_mode=padding_mode)
    x = normal((2, 4, 5, 6, 7), seed=11)
    with torch.no_grad():
        expected = conv(t(x), causal=causal).numpy()
    ours = ltx2_vae.CausalConv3d(6, 3, (2, 2, 2), causal, padding_mode)
    params = {
        "conv": {
            "kernel": weights.conv3d(conv.conv.weight.detach().numpy()),
            "bias": conv.conv.bias.detach().numpy(),
        }
    }
    got = ours.apply({"params": params}, jnp.asarray(x).transpose(0, 2, 3, 4, 1))
    assert rel_err(np.asarray(got).transpose(0, 4, 1, 2, 3), expected) < RTOL


def test_released_like_encode_and_decode_match_diffusers(released_like):
    """9 frames (1 + 2 x 4) at 16 x 24 -> 3 x 2 x 3 latents and back, batch 2 on decode, no
    timestep (the unconditioned VAE, as the pipeline calls it: temb None)."""
    model, module, params, _ = released_like
    config = module.config
    assert (config.spatial_compression, config.temporal_compression) == (8, 4)
    clip = uniform((1, 3, 9, 16, 24), seed=0)
    # REACHED: mean 1.1e-6, logvar 7.1e-7 relative (|mean| <= 1.6)
    assert_posterior_matches(model, module, params, clip, (1, 8, 3, 2, 3))

    z = normal((2, 8, 3, 2, 3), seed=1)
    with torch.no_grad():
        expected = model.decode(t(z), None).sample.numpy()
    got = ltx2_vae.decode(module, params, jnp.asarray(z))
    assert expected.shape == ltx2_vae.video_shape(config, z.shape) == (2, 3, 9, 16, 24)
    assert np.abs(expected).max() > 0.5
    assert rel_err(got, expected) < RTOL  # REACHED: 3.3e-6 (7.9e-6 abs, |out| <= 2.4)


def test_released_like_forward_and_encoder_only_load(released_like):
    """``__call__`` (decode(encode(x).mode())) = diffusers' forward, and an
    encoder-only load reads the encoder's tensors alone and encodes the same."""
    model, module, params, directory = released_like
    clip = uniform((1, 3, 5, 16, 16), seed=3)
    with torch.no_grad():
        expected = model(t(clip)).sample.numpy()
    forward = jax.jit(lambda p, x: module.apply({"params": p}, x))
    assert rel_err(forward(params, jnp.asarray(clip)), expected) < RTOL  # REACHED: 3.0e-6

    enc_module, enc_params = ltx2_vae.load_ltx2_vae(directory, encoder_only=True)
    assert set(enc_params) == {"encoder", "latents_mean", "latents_std"}
    mean_ref, _ = torch_posterior(model, clip)
    got = ltx2_vae.encode(enc_module, enc_params, jnp.asarray(clip)).mean
    assert rel_err(got, mean_ref) < RTOL  # REACHED: 7.5e-7


def test_conditioned_encode_matches_diffusers(conditioned):
    """Reflect-padded non-causal encoder with a stride-2 conv level."""
    model, module, params, _ = conditioned
    config = module.config
    assert (config.spatial_compression, config.temporal_compression) == (16, 4)
    clip = uniform((1, 3, 9, 32, 48), seed=4)
    # REACHED: mean 1.1e-6, logvar 1.5e-6 relative (|mean| <= 2.3)
    assert_posterior_matches(model, module, params, clip, (1, 8, 3, 2, 3))


def test_conditioned_noisy_timestep_decode_matches_diffusers(conditioned, monkeypatch):
    """Decoder at per-sample timesteps (batch 2) with the same injected noise on both sides."""
    model, module, params, _ = conditioned
    config = module.config
    z = normal((2, 8, 3, 2, 3), seed=5)
    temb = [0.05, 0.4]
    noise = ltx2_vae.sample_decoder_noise(config, (2, 3), jax.random.key(0))
    # mid block: 1 resnet x 2 draws at 2x3; outer up block: 1 resnet x 2 at 8x12.
    assert [n.shape for n in noise] == [(2, 3)] * 2 + [(8, 12)] * 2
    randn = SuppliedRandn(noise)
    monkeypatch.setattr(torch, "randn", randn)
    with torch.no_grad():
        expected = model.decode(t(z), torch.tensor(temb)).sample.numpy()
    monkeypatch.undo()
    assert randn.exhausted()  # diffusers drew exactly as many arrays

    got = ltx2_vae.decode(module, params, jnp.asarray(z), temb, noise=noise)
    assert expected.shape == (2, 3, 9, 32, 48)
    assert np.abs(expected).max() > 0.5
    assert rel_err(got, expected) < RTOL  # REACHED: 1.4e-6 (3.2e-6 abs, |out| <= 2.4)
    # The timestep matters, and so does the noise.
    other_t = ltx2_vae.decode(module, params, jnp.asarray(z), [0.05, 0.05], noise=noise)
    assert np.abs(np.asarray(other_t)[1] - expected[1]).max() > 1e-3
    drawn = ltx2_vae.decode(module, params, jnp.asarray(z), temb, rng=jax.random.key(1))
    assert np.abs(np.asarray(drawn) - expected).max() > 1e-3


@pytest.mark.parametrize(
    ("decode_timestep", "decode_noise_scale"), [([0.05, 0.4], None), (0.05, [0.025, 0.1])]
)
def test_pipeline_decode_step_matches_ltx2_pipeline(
    conditioned, monkeypatch, decode_timestep, decode_noise_scale
):
    """decode_inputs + decode = the pipeline's decode branch: noise mixed into the normalised
    latents (scale defaulting to the decode timestep), then denormalised, then decoded at the
    decode timestep."""
    model, module, params, _ = conditioned
    latents = normal((2, 8, 2, 2, 3), seed=6)
    latent_noise = normal(latents.shape, seed=7)
    vae_noise = ltx2_vae.sample_decoder_noise(module.config, (2, 3), jax.random.key(2))
    monkeypatch.setattr(torch, "randn", SuppliedRandn(vae_noise))
    expected = pipeline_decode(model, latents, latent_noise, decode_timestep, decode_noise_scale)
    monkeypatch.undo()

    z, timestep = ltx2_vae.decode_inputs(
        jnp.asarray(latents),
        params,
        module.config,
        decode_timestep=decode_timestep,
        decode_noise_scale=decode_noise_scale,
        noise_bcfhw=jnp.asarray(latent_noise),
    )
    got = ltx2_vae.decode(module, params, z, timestep, noise=vae_noise)
    assert rel_err(got, expected) < RTOL  # REACHED: 1.5e-6 / 1.4e-6


def test_pipeline_decode_step_without_conditioning(released_like):
    model, module, params, _ = released_like
    latents = normal((1, 8, 2, 2, 3), seed=8)
    expected = pipeline_decode(model, latents, None, 0.05, None)
    z, timestep = ltx2_vae.decode_inputs(jnp.asarray(latents), params, module.config)
    assert timestep is None
    assert rel_err(ltx2_vae.decode(module, params, z), expected) < RTOL  # REACHED: 1.5e-6


def test_image_condition_latents_match_image_to_video_pipeline(released_like):
    """LTX2ImageToVideoPipeline.prepare_latents: encode each image as one frame, take the mode
    and normalise with the static method's default scaling factor 1.0."""
    model, module, params, _ = released_like
    images = uniform((2, 3, 16, 24), seed=9)
    with torch.no_grad():
        modes = [model.encode(t(img)[None, :, None]).latent_dist.mode() for img in images]
    expected = LTX2ImageToVideoPipeline._normalize_latents(
        torch.cat(modes), model.latents_mean, model.latents_std
    ).numpy()
    got = ltx2_vae.encode_condition_latents(module, params, jnp.asarray(images))
    assert expected.shape == (2, 8, 1, 2, 3)
    assert rel_err(got, expected) < RTOL  # REACHED: 7.8e-7


def test_normalize_and_pack_helpers_match_the_pipeline_static_methods(released_like):
    _, module, params, _ = released_like
    z = normal((2, 8, 3, 4, 6), seed=10)
    mean, std = t(params["latents_mean"]), t(params["latents_std"])
    scale = module.config.scaling_factor
    expected = LTX2Pipeline._normalize_latents(t(z), mean, std, scale).numpy()
    normalized = ltx2_vae.normalize_latents(jnp.asarray(z), params, scale)
    assert np.abs(np.asarray(normalized) - expected).max() < 1e-5
    back = LTX2Pipeline._denormalize_latents(t(expected), mean, std, scale).numpy()
    assert (
        np.abs(np.asarray(ltx2_vae.denormalize_latents(normalized, params, scale)) - back).max()
        < 1e-5
    )
    assert np.abs(back - z).max() < 1e-5

    for p, pt in ((1, 1), (2, 1), (2, 3)):
        packed = LTX2Pipeline._pack_latents(t(z), p, pt).numpy()
        ours = ltx2_vae.pack_latents(jnp.asarray(z), p, pt)
        np.testing.assert_array_equal(np.asarray(ours), packed)
        grid = (3 // pt, 4 // p, 6 // p)
        unpacked = LTX2Pipeline._unpack_latents(t(packed), *grid, p, pt).numpy()
        np.testing.assert_array_equal(
            np.asarray(ltx2_vae.unpack_latents(ours, *grid, p, pt)), unpacked
        )
        np.testing.assert_array_equal(unpacked, z)


@pytest.mark.parametrize("conditioning", [False, True])
def test_released_parameter_count_equals_diffusers(conditioning):
    """The released LTX-2 video VAE (and its timestep-conditioned conversion): diffusers on the
    meta device vs ours from eval_shape."""
    config_dict = dict(LTX2_RELEASED, timestep_conditioning=conditioning)
    with torch.device("meta"):
        model = AutoencoderKLLTX2Video(**config_dict)
    n_params = sum(p.numel() for p in model.parameters())
    n_buffers = sum(b.numel() for b in model.buffers())
    config = ltx2_vae.LTX2VideoVAEConfig.from_dict(config_dict)
    assert ltx2_vae.count_params(config) == n_params
    assert ltx2_vae.count_params(config, include_buffers=True) == n_params + n_buffers
    assert (config.spatial_compression, config.temporal_compression) == (32, 8)
    print(f"LTX-2 video VAE parameters (timestep_conditioning={conditioning}): {n_params:,}")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_tiny_parameter_counts_and_levels_equal_diffusers(name):
    """Our reading of the config (bool shorthands, reversed decoder tuples, conv_in resnets,
    upsampler strides) is diffusers' module tree."""
    config = ltx2_vae.LTX2VideoVAEConfig.from_dict(CONFIGS[name])
    with torch.device("meta"):
        model = AutoencoderKLLTX2Video(**CONFIGS[name])
    assert ltx2_vae.count_params(config) == sum(p.numel() for p in model.parameters())
    for level, block in zip(config.decoder_levels, model.decoder.up_blocks, strict=True):
        assert level.conv_in == (block.conv_in is not None)
        upsampler = block.upsamplers[0] if block.upsamplers is not None else None
        assert level.upsample == (upsampler.stride if upsampler else None)
        if upsampler:
            assert (level.residual, level.factor) == (upsampler.residual, upsampler.upscale_factor)
        assert level.inject_noise == (block.resnets[0].per_channel_scale1 is not None)


def test_weight_map_covers_the_checkpoint_and_init_has_its_layout(released_like, conditioned):
    for _, module, _, directory in (released_like, conditioned):
        keys = {src for src, _ in ltx2_vae.weight_map(module.config).values()}
        assert keys == set(weights.SafetensorsReader(directory).keys())
    keys = {src for src, _ in ltx2_vae.weight_map(released_like[1].config).values()}
    assert "decoder.up_blocks.2.conv_in.conv_shortcut.weight" in keys  # a plain Conv3d
    assert "decoder.up_blocks.2.conv_in.conv1.conv.weight" in keys
    assert "encoder.down_blocks.2.downsamplers.0.conv.conv.bias" in keys
    _, module, params, _ = conditioned
    init_module, init_params = ltx2_vae.init_ltx2_vae(module.config, jax.random.key(0))
    assert jax.tree.map(lambda x: x.shape, init_params) == jax.tree.map(lambda x: x.shape, params)
    assert float(init_params["decoder"]["timestep_scale_multiplier"][0]) == 1000.0
    assert init_module.config == module.config


def test_config_from_saved_json_and_defaults(conditioned):
    model, module, _, _ = conditioned
    assert ltx2_vae.LTX2VideoVAEConfig.from_dict(dict(model.config)) == module.config
    # diffusers' bool shorthands, expanded as its __init__ does.
    assert module.config.spatio_temporal_scaling == (True, True, True)
    assert module.config.decoder_spatio_temporal_scaling == (True, True)
    default = ltx2_vae.LTX2VideoVAEConfig()  # diffusers' defaults = the released architecture
    assert (default.spatial_compression, default.temporal_compression) == (32, 8)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"bogus_key": 1}, "bogus_key"),
        ({"patch_size_t": 2}, "patch_size_t"),
        ({"down_block_types": ("LTXVideoDownBlock3D",) * 3}, "down_block_types"),
        ({"downsample_type": ("spatial", "sideways", "temporal")}, "downsample_type"),
        ({"upsample_type": ("spatiotemporal", "conv")}, "upsample_type"),
        ({"decoder_spatial_padding_mode": "mirror"}, "decoder_spatial_padding_mode"),
        ({"layers_per_block": (1, 1)}, "layers_per_block"),
        ({"decoder_inject_noise": (False,)}, "decoder_inject_noise"),
        ({"block_out_channels": (12, 16, 32)}, "block_out_channels"),
        ({"upsample_factor": (3, 2)}, "upsample_factor 3"),
    ],
)
def test_bad_config_is_an_error_naming_the_key(change, message):
    with pytest.raises(ltx2_vae.LTX2VideoVAEConfigError, match=message):
        ltx2_vae.LTX2VideoVAEConfig.from_dict({**CONDITIONED, **change})


def test_conv_in_with_timestep_conditioning_is_refused():
    with pytest.raises(ltx2_vae.LTX2VideoVAEConfigError, match="conv_in"):
        ltx2_vae.LTX2VideoVAEConfig.from_dict({**RELEASED_LIKE, "timestep_conditioning": True})


@pytest.mark.parametrize(
    ("shape", "message"),
    [
        ((1, 3, 8, 32, 48), r"1 \+ 4k frames"),
        ((1, 4, 9, 32, 48), "4 channels"),
        ((1, 3, 9, 30, 48), "height 30"),
        ((1, 3, 9, 32, 40), "width"),
        ((1, 3, 9, 16, 48), "reflect"),
        ((3, 9, 32, 48), r"\[B, C, F, H, W\]"),
    ],
)
def test_bad_video_is_an_error_naming_the_dimension(shape, message):
    config = ltx2_vae.LTX2VideoVAEConfig.from_dict(CONDITIONED)
    with pytest.raises(ValueError, match=message):
        ltx2_vae.check_video(config, shape)


def test_decode_argument_errors():
    noisy = ltx2_vae.LTX2VideoVAE(ltx2_vae.LTX2VideoVAEConfig.from_dict(CONDITIONED))
    plain = ltx2_vae.LTX2VideoVAE(ltx2_vae.LTX2VideoVAEConfig.from_dict(RELEASED_LIKE))
    z = jnp.zeros((1, 8, 2, 2, 3))
    with pytest.raises(ValueError, match="noise= or rng="):
        ltx2_vae.decode(noisy, None, z, 0.05)
    with pytest.raises(ValueError, match="decoder noise has shapes"):
        ltx2_vae.decode(noisy, None, z, 0.05, noise=(jnp.zeros((2, 3)),))
    with pytest.raises(ValueError, match="timestep_conditioning=False"):
        ltx2_vae.decode(plain, None, z, 0.05)
    with pytest.raises(ValueError, match="5 channels"):
        ltx2_vae.decode(plain, None, jnp.zeros((1, 5, 2, 2, 3)))
    with pytest.raises(ValueError, match="reflect"):
        ltx2_vae.decode(plain, None, jnp.zeros((1, 8, 2, 1, 3)))
