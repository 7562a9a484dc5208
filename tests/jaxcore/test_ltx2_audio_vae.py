"""LTX-2 audio VAE vs diffusers' AutoencoderKLLTX2Audio (random tiny models, fp32, same weights).

Every diffusers parameter and the latents_mean / latents_std buffers are perturbed before
save_pretrained, so unit norms, zero biases or a wrong mapping cannot pass; our side loads the
saved directory through :func:`ltx2_audio_vae.load_ltx2_audio_vae`. References come from
``AutoencoderKLLTX2Audio.encode`` / ``.decode`` and LTX2Pipeline's static latent helpers.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from diffusers import AutoencoderKLLTX2Audio
from diffusers.pipelines.ltx2.pipeline_ltx2 import LTX2Pipeline
from flax import linen as nn

from jaxcore.models import ltx2_audio_vae as lav

# fp32 on CPU, highest matmul precision (conftest); relative to the reference's max |value|.
RTOL = 1e-5

# (a) LTX-2 as released, shrunk: pixel norm, time-causal ("height"), three levels, an odd
# time length; base_channels = latent_channels * mel_bins / 4 so the statistics fit packed
# latents, as 128 = 8 * 16 in the real model.
HEIGHT = dict(
    base_channels=12,
    output_channels=2,
    ch_mult=(1, 2, 3),
    num_res_blocks=1,
    in_channels=2,
    latent_channels=3,
    norm_type="pixel",
    causality_axis="height",
    mel_bins=16,
)
# (b) GroupNorm, no causality, attention at resolution 8 (level 1 of encoder and decoder) and
# in both mid blocks; two levels, so the decoder's 2 L frames are zero-padded to 4 L - 3.
GROUP = dict(
    base_channels=32,
    output_channels=3,
    ch_mult=(1, 2),
    num_res_blocks=1,
    attn_resolutions=(8,),
    in_channels=1,
    resolution=16,
    latent_channels=4,
    norm_type="group",
    causality_axis="none",
    mid_block_add_attention=True,
    mel_bins=12,
)
# (c) mel-causal ("width") pixel-norm model, mel_bins=None (the decoder keeps the latent's
# mel width), a non-multiple-of-four mel count.
WIDTH = dict(
    base_channels=8,
    output_channels=1,
    ch_mult=(1, 2, 2),
    num_res_blocks=2,
    in_channels=1,
    latent_channels=2,
    norm_type="pixel",
    causality_axis="width",
    mel_bins=None,
)
# "width-compatibility": the mel-causal conv padding with the symmetric upsampler.
WIDTH_COMPAT = dict(WIDTH, causality_axis="width-compatibility", num_res_blocks=1)
CONFIGS = {"height": HEIGHT, "group": GROUP, "width": WIDTH, "width_compat": WIDTH_COMPAT}
# Spectrogram [B, C, T, M] per config (odd T everywhere).
MEL_SHAPES = {
    "height": (2, 2, 13, 16),
    "group": (1, 1, 9, 12),
    "width": (1, 1, 11, 10),
    "width_compat": (1, 1, 7, 10),
}


def save_reference(directory, config, seed: int = 0) -> AutoencoderKLLTX2Audio:
    """A random diffusers audio VAE, every parameter and buffer perturbed, saved to directory."""
    torch.manual_seed(seed)
    model = AutoencoderKLLTX2Audio(**config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
        model.latents_mean.copy_(0.5 * torch.randn_like(model.latents_mean))
        model.latents_std.copy_(0.5 + torch.rand_like(model.latents_std))
    model.save_pretrained(directory)
    return model


def rel_err(got, expected) -> float:
    got = np.asarray(got)
    expected = np.asarray(expected)
    assert got.shape == expected.shape, (got.shape, expected.shape)
    return float(np.abs(got - expected).max() / np.abs(expected).max())


def normal(shape, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(size=shape).astype(np.float32)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def loaded(request, tmp_path_factory):
    name = request.param
    directory = tmp_path_factory.mktemp(f"ltx2_audio_{name}")
    model = save_reference(directory, CONFIGS[name])
    module, params = lav.load_ltx2_audio_vae(directory)
    return name, model, module, params, directory


def test_encode_mean_logvar_and_sample_match_diffusers(loaded):
    name, model, module, params, _ = loaded
    mel = normal(MEL_SHAPES[name], seed=3)
    with torch.no_grad():
        dist = model.encode(torch.from_numpy(mel)).latent_dist
        sample_ref = dist.sample(generator=torch.Generator().manual_seed(7)).numpy()
    noise = torch.randn(dist.mean.shape, generator=torch.Generator().manual_seed(7)).numpy()
    posterior = lav.encode(module, params, jnp.asarray(mel))
    assert posterior.mean.shape == lav.latent_shape(module.config, mel.shape)
    assert rel_err(posterior.mean, dist.mean.numpy()) < RTOL  # REACHED <= 1.3e-6
    assert rel_err(posterior.logvar, dist.logvar.numpy()) < RTOL
    # The pipelines' sample path (retrieve_latents -> latent_dist.sample): mean + std * noise.
    sampled = posterior.mean + jnp.exp(0.5 * posterior.logvar) * noise
    assert rel_err(sampled, sample_ref) < RTOL


def test_decode_matches_diffusers(loaded):
    name, model, module, params, _ = loaded
    cfg = module.config
    z = normal((2, cfg.latent_channels, 5, 4), seed=4)  # odd latent length
    with torch.no_grad():
        ref = model.decode(torch.from_numpy(z)).sample.numpy()
    got = lav.decode(module, params, jnp.asarray(z))
    assert got.shape == lav.decoded_shape(cfg, z.shape)
    assert rel_err(got, ref) < RTOL  # REACHED <= 1.8e-6


def test_whole_forward_matches_diffusers(tmp_path):
    """``AutoencoderKLLTX2Audio.forward``: decode(encode(mel).mode())."""
    model = save_reference(tmp_path, HEIGHT, seed=2)
    module, params = lav.load_ltx2_audio_vae(tmp_path)
    mel = normal(MEL_SHAPES["height"], seed=5)
    with torch.no_grad():
        ref = model(torch.from_numpy(mel)).sample.numpy()
    got = jax.jit(lambda p, x: module.apply({"params": p}, x))(params, jnp.asarray(mel))
    assert got.shape == mel.shape  # 13 frames -> 4 latents -> 13 frames
    assert rel_err(got, ref) < RTOL


def test_pipeline_decode_chain_matches_diffusers(tmp_path):
    """packed [B, L, C*M] -> denormalise -> unpack -> decode, as LTX2Pipeline.__call__ does,
    and the normalise / pack direction of prepare_audio_latents."""
    model = save_reference(tmp_path, HEIGHT, seed=1)
    module, params = lav.load_ltx2_audio_vae(tmp_path)
    cfg = module.config
    length, latent_mel = 5, cfg.latent_mel_bins
    packed = normal((2, length, cfg.latent_channels * latent_mel), seed=6)
    with torch.no_grad():
        t = LTX2Pipeline._denormalize_audio_latents(
            torch.from_numpy(packed), model.latents_mean, model.latents_std
        )
        t = LTX2Pipeline._unpack_audio_latents(t, length, num_mel_bins=latent_mel)
        mel_ref = model.decode(t).sample.numpy()
        unpacked = normal((2, cfg.latent_channels, length, latent_mel), seed=8)
        norm_ref = LTX2Pipeline._normalize_audio_latents(
            LTX2Pipeline._pack_audio_latents(torch.from_numpy(unpacked)),
            model.latents_mean,
            model.latents_std,
        ).numpy()
    z = lav.unpack_audio_latents(lav.denormalize_audio_latents(jnp.asarray(packed), params), 4)
    assert rel_err(z, t.numpy()) < 1e-6
    assert rel_err(lav.decode(module, params, z), mel_ref) < RTOL
    normed = lav.normalize_audio_latents(lav.pack_audio_latents(jnp.asarray(unpacked)), params)
    assert rel_err(normed, norm_ref) < 1e-6
    roundtrip = lav.denormalize_audio_latents(normed, params)
    np.testing.assert_allclose(
        lav.unpack_audio_latents(roundtrip, latent_mel), unpacked, rtol=1e-5, atol=1e-5
    )


def test_audio_latent_length_is_the_pipelines_rule():
    cfg = lav.LTX2AudioVAEConfig()
    # LTX2Pipeline: round(num_frames / frame_rate * sample_rate / hop / 4) = 25 latents/s.
    assert lav.audio_latent_length(cfg, 121, 24.0) == round(121 / 24.0 * 16000 / 160 / 4) == 126
    assert lav.audio_latent_length(cfg, 1, 25.0) == 1  # half to even: round(1.0)
    assert lav.decoded_shape(cfg, (1, 8, 126, 16)) == (1, 2, 501, 64)
    assert lav.mel_frames_per_second(cfg) == 100.0


def test_encoder_only_load_reads_the_encoder_alone(loaded):
    name, _, module, params, directory = loaded
    enc_module, enc_params = lav.load_ltx2_audio_vae(directory, encoder_only=True)
    assert "decoder" not in enc_params and "encoder" in enc_params
    assert {"latents_mean", "latents_std"} <= set(enc_params)
    mel = jnp.asarray(normal(MEL_SHAPES[name], seed=9))
    full = lav.encode(module, params, mel).mean
    np.testing.assert_array_equal(lav.encode(enc_module, enc_params, mel).mean, full)


def test_parameter_count_of_the_released_config_equals_diffusers():
    """LTX-2's audio VAE config (diffusers scripts/convert_ltx2_to_diffusers.py,
    get_ltx2_audio_vae_config("2.0")) is AutoencoderKLLTX2Audio's defaults."""
    released = dict(
        base_channels=128,
        output_channels=2,
        ch_mult=(1, 2, 4),
        num_res_blocks=2,
        attn_resolutions=None,
        in_channels=2,
        resolution=256,
        latent_channels=8,
        norm_type="pixel",
        causality_axis="height",
        dropout=0.0,
        mid_block_add_attention=False,
        sample_rate=16000,
        mel_hop_length=160,
        is_causal=True,
        mel_bins=64,
        double_z=True,
    )
    with torch.device("meta"):
        model = AutoencoderKLLTX2Audio(**released)
    expected = sum(p.numel() for p in model.parameters())
    assert lav.LTX2AudioVAEConfig(**released) == lav.LTX2AudioVAEConfig()
    assert lav.count_params(lav.LTX2AudioVAEConfig(**released)) == expected
    buffers = sum(b.numel() for b in model.buffers())
    with_buffers = lav.count_params(lav.LTX2AudioVAEConfig(), include_buffers=True)
    assert with_buffers == expected + buffers


def test_weight_map_names_every_checkpoint_key(tmp_path):
    model = save_reference(tmp_path, GROUP)
    cfg = lav.LTX2AudioVAEConfig(**GROUP)
    keys = {src for src, _ in lav.weight_map(cfg).values()}
    assert keys == set(model.state_dict())
    assert "decoder.mid.block_1.norm1.weight" in keys  # mid's attribute names stay
    assert "encoder.down.1.attn.0.q.weight" in keys


def test_init_has_the_loaded_layout():
    cfg = lav.LTX2AudioVAEConfig(**GROUP)
    _, params = lav.init_ltx2_audio_vae(cfg, jax.random.key(0))
    shapes = jax.tree.map(lambda a: a.shape, params)
    abstract = jax.tree.map(
        lambda a: a.shape, nn.meta.unbox(lav.abstract_params(lav.LTX2AudioVAE(cfg)))
    )
    assert shapes == abstract
    np.testing.assert_array_equal(params["latents_std"], np.ones(cfg.base_channels))
    np.testing.assert_array_equal(params["encoder"]["norm_out"]["scale"], np.ones(64))


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(norm_type="group"), "causality_axis='none'"),
        (dict(causality_axis="diagonal"), "causality_axis"),
        (dict(norm_type="batch"), "norm_type"),
        (dict(double_z=False, latent_channels=3), "double_z"),
        (dict(norm_type="group", causality_axis="none", base_channels=48), "GroupNorm"),
    ],
)
def test_bad_config_is_an_error_naming_the_key(change, message):
    with pytest.raises(lav.LTX2AudioVAEConfigError, match=message):
        lav.LTX2AudioVAEConfig(**change)


def test_unknown_config_json_key_and_bad_shapes_are_errors():
    with pytest.raises(lav.LTX2AudioVAEConfigError, match="mel_channels"):
        lav.LTX2AudioVAEConfig.from_dict(
            {"_class_name": "AutoencoderKLLTX2Audio", "mel_channels": 1}
        )
    cfg = lav.LTX2AudioVAEConfig(**HEIGHT)
    with pytest.raises(ValueError, match="in_channels"):
        lav.latent_shape(cfg, (1, 3, 13, 16))
    with pytest.raises(ValueError, match="latent_channels"):
        lav.check_latents(cfg, (1, 4, 5, 4))
    with pytest.raises(ValueError, match="base_channels"):
        lav.normalize_audio_latents(
            jnp.zeros((1, 5, 8)), {"latents_mean": jnp.zeros(12), "latents_std": jnp.ones(12)}
        )
