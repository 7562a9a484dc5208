"""AutoencoderKLFlux2 (the Flux.2 VAE) and Flux2KleinPipeline's latent handling vs diffusers.

A tiny diffusers AutoencoderKLFlux2 with every parameter perturbed and its bn statistics set
away from 0 / 1, saved with ``save_pretrained`` and loaded by our loader; the references are
diffusers' own ``encode`` / ``decode`` and the pipeline's own static methods and lines.
"""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from diffusers import AutoencoderKLFlux2 as TorchAutoencoderKLFlux2
from diffusers.pipelines.flux2.pipeline_flux2_klein import Flux2KleinPipeline

from jaxcore import weights
from jaxcore.models import autoencoder_kl_flux2 as flux2_vae

# fp32 on CPU, highest matmul precision (conftest); relative to the output's largest value.
RTOL = 1e-5

_DOWN, _UP = "DownEncoderBlock2D", "UpDecoderBlock2D"
# diffusers' defaults are the published Flux.2 VAE's architecture (FLUX.2-dev / klein vae).
REAL_CONFIG = {}
# diffusers' count on the meta device (checked again below); the bn has no parameters.
REAL_PARAM_COUNT = 84_046_115
TINY = {
    "block_out_channels": [8, 16],
    "decoder_block_out_channels": [4, 12],  # the decoder's own widths
    "down_block_types": [_DOWN] * 2,
    "up_block_types": [_UP] * 2,
    "layers_per_block": 1,
    "latent_channels": 6,
    "norm_num_groups": 4,
    "sample_size": 16,
    "batch_norm_eps": 1e-3,
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """(diffusers model, our module, params, bn, directory), built once."""
    directory = tmp_path_factory.mktemp("autoencoder_kl_flux2")
    torch.manual_seed(0)
    model = TorchAutoencoderKLFlux2(**TINY).eval()
    with torch.no_grad():
        for param in model.parameters():  # norms start at 1/0, biases at 0: perturb them all
            param.add_(0.1 * torch.randn_like(param))
        n = model.bn.running_mean.shape[0]
        model.bn.running_mean.copy_(torch.randn(n))
        model.bn.running_var.copy_(torch.rand(n) * 3 + 0.2)
    model.save_pretrained(directory)
    module, params = flux2_vae.load_autoencoder_kl_flux2(directory)
    bn = flux2_vae.load_latent_bn(directory)
    return model, module, params, bn, directory


def _rel_err(got, expected) -> float:
    """Max abs difference over the reference's max abs."""
    got = np.asarray(got, np.float32)
    assert got.shape == expected.shape, (got.shape, expected.shape)
    return float(np.abs(got - expected).max() / np.abs(expected).max())


def test_encode_mean_and_decode_match_diffusers(reference):
    model, module, params, _, _ = reference
    images = np.random.default_rng(0).uniform(-1, 1, (2, 3, 16, 24)).astype(np.float32)
    z = np.random.default_rng(1).standard_normal((2, 6, 8, 12)).astype(np.float32)
    with torch.no_grad():
        dist = model.encode(torch.from_numpy(images)).latent_dist
        pixels = model.decode(torch.from_numpy(z)).sample.numpy()

    posterior = flux2_vae.encode(module, params, jnp.asarray(images))
    got_pixels = flux2_vae.decode(module, params, jnp.asarray(z))

    assert _rel_err(posterior.mean, dist.mean.numpy()) < RTOL
    assert _rel_err(posterior.logvar, dist.logvar.numpy()) < RTOL
    assert _rel_err(got_pixels, pixels) < RTOL
    assert np.abs(pixels).max() > 0.1


def test_bn_statistics_are_the_checkpoint_buffers(reference):
    model, _, params, bn, _ = reference
    np.testing.assert_array_equal(bn.running_mean, model.bn.running_mean.numpy())
    np.testing.assert_array_equal(bn.running_var, model.bn.running_var.numpy())
    assert bn.eps == model.config.batch_norm_eps == 1e-3
    assert "bn" not in params  # buffers, not parameters


@pytest.mark.parametrize("shape", [(2, 6, 6, 10), (1, 6, 2, 14)])  # odd h/2, w/2; non-square
def test_latent_path_matches_the_pipeline(reference, shape):
    model, _, _, bn, _ = reference
    z = np.random.default_rng(2).standard_normal(shape).astype(np.float32) * 2
    z_t = torch.from_numpy(z)
    # Flux2KleinPipeline._encode_vae_image, after vae.encode; then prepare_latents' packing
    patches_t = Flux2KleinPipeline._patchify_latents(z_t)
    mean_t = model.bn.running_mean.view(1, -1, 1, 1)
    std_t = torch.sqrt(model.bn.running_var.view(1, -1, 1, 1) + model.config.batch_norm_eps)
    normalized_t = (patches_t - mean_t) / std_t
    packed_t = Flux2KleinPipeline._pack_latents(normalized_t)
    # __call__ before vae.decode
    latent_ids = Flux2KleinPipeline._prepare_latent_ids(normalized_t)
    h, w = normalized_t.shape[2:]
    unpacked_t = Flux2KleinPipeline._unpack_latents_with_ids(packed_t, latent_ids, h, w)
    raw_t = Flux2KleinPipeline._unpatchify_latents(unpacked_t * std_t + mean_t)

    patches = flux2_vae.patchify(jnp.asarray(z))
    normalized = flux2_vae.normalize_latents(patches, bn)
    packed = flux2_vae.pack_latents(normalized)
    unpacked = flux2_vae.unpack_latents(packed, h, w)
    raw = flux2_vae.from_model_latents(unpacked, bn)

    np.testing.assert_array_equal(patches, patches_t.numpy())
    np.testing.assert_allclose(normalized, normalized_t.numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(packed, packed_t.numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(raw, raw_t.numpy(), rtol=1e-6, atol=1e-5)
    np.testing.assert_allclose(flux2_vae.to_model_latents(jnp.asarray(z), bn), normalized)
    np.testing.assert_array_equal(flux2_vae.unpatchify(patches), z)
    # channel c * 4 + dy * 2 + dx holds pixel (2i + dy, 2j + dx) of channel c
    np.testing.assert_array_equal(patches[:, 1 * 4 + 1 * 2 + 0], z[:, 1, 1::2, 0::2])


def test_latent_path_errors(reference):
    bn = reference[3]
    with pytest.raises(ValueError, match="height 5 and width 4 must be even"):
        flux2_vae.patchify(jnp.zeros((1, 6, 5, 4)))
    with pytest.raises(ValueError, match="6 channels but the bn has 24"):
        flux2_vae.normalize_latents(jnp.zeros((1, 6, 4, 4)), bn)
    with pytest.raises(ValueError, match="12 tokens do not fill a 3 x 5"):
        flux2_vae.unpack_latents(jnp.zeros((1, 12, 24)), 3, 5)


def test_real_config_param_count():
    with torch.device("meta"):
        model = TorchAutoencoderKLFlux2(**REAL_CONFIG)
    expected = sum(p.numel() for p in model.parameters())
    config = flux2_vae.AutoencoderKLFlux2Config.from_dict(dict(model.config))
    assert config.latent_channels == 32 and config.spatial_compression == 8
    assert flux2_vae.count_params(config) == expected == REAL_PARAM_COUNT


def test_config_round_trip_and_refusals(reference):
    model = reference[0]
    config = flux2_vae.AutoencoderKLFlux2Config.from_dict(dict(model.config))
    assert config == reference[1].config
    assert flux2_vae.AutoencoderKLFlux2Config.from_dict(config.to_dict()) == config
    error = flux2_vae.AutoencoderKLFlux2ConfigError
    for change, message in (
        ({"scaling_factor": 0.5}, "scaling_factor"),
        ({"patch_size": [1, 1]}, "patch_size"),
        ({"norm_num_groups": 3}, "norm_num_groups=3"),
        ({"batch_norm_eps": 0.0}, "batch_norm_eps"),
    ):
        with pytest.raises(error, match=message):
            flux2_vae.AutoencoderKLFlux2Config.from_dict({**TINY, **change})


def test_weights_round_trip_and_encoder_only_load(reference):
    _, module, params, _, directory = reference
    exported = weights.export_state_dict(params, flux2_vae.weight_map(module.config))
    checkpoint = weights.SafetensorsReader(directory).as_dict()
    assert set(checkpoint) - set(exported) == {
        "bn.running_mean",
        "bn.running_var",
        "bn.num_batches_tracked",
    }
    for key, value in exported.items():
        np.testing.assert_array_equal(value, checkpoint[key], err_msg=key)
    _, encoder_params = flux2_vae.load_autoencoder_kl_flux2(directory, encoder_only=True)
    assert set(encoder_params) == {"encoder", "quant_conv"}


def test_init_has_the_loaded_layout(reference):
    _, module, params, _, _ = reference
    import jax

    _, fresh = flux2_vae.init_autoencoder_kl_flux2(module.config, jax.random.key(0))
    assert jax.tree.map(jnp.shape, fresh) == jax.tree.map(jnp.shape, params)
    initial = flux2_vae.LatentBatchNorm.initial(module.config)
    assert initial.running_mean.shape == (24,) and initial.eps == 1e-3
