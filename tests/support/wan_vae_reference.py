"""The diffusers ``AutoencoderKLWan`` reference both Wan VAE test files compare against
(Wan 2.1 and the Wan 2.2 residual VAE): a random model saved like a hub checkpoint, inputs,
its outputs, and the error measure."""

from __future__ import annotations

import numpy as np
import torch
from diffusers import AutoencoderKLWan


def save_reference(directory, config_kwargs, seed: int = 0) -> AutoencoderKLWan:
    """A random diffusers VAE saved to ``directory``; RMS-norm gammas start at ones, so they
    are perturbed: a wrong weight mapping cannot pass."""
    torch.manual_seed(seed)
    model = AutoencoderKLWan(**config_kwargs).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("gamma"):
                param.add_(0.2 * torch.randn_like(param))
    model.save_pretrained(directory)
    return model


def video(shape, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-1, 1, size=shape).astype(np.float32)


def latents(shape, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(size=shape).astype(np.float32)


def torch_posterior(model, clip: np.ndarray):
    with torch.no_grad():
        dist = model.encode(torch.from_numpy(clip)).latent_dist
    return dist.mean.numpy(), dist.logvar.numpy()


def torch_decode(model, z: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model.decode(torch.from_numpy(z)).sample.numpy()


def max_err(got, expected) -> float:
    got = np.asarray(got)
    assert got.shape == expected.shape, (got.shape, expected.shape)
    return float(np.abs(got - expected).max())


def assert_not_all_clamped(decoded) -> None:
    """Decoder output is clamped to [-1, 1]; most of it must not be a saturated constant."""
    inside = np.abs(decoded) < 0.999
    assert inside.mean() > 0.5, f"only {inside.mean():.0%} of the reference is unclamped"


def assert_matches_reference(model, module, params, clip, latent_shape, z_seed, atol) -> None:
    """Ours vs the diffusers ``model``: the posterior of ``clip`` (mean and log-variance, of
    ``latent_shape``) and the decoding of random latents drawn with ``z_seed``, within ``atol``."""
    import jax.numpy as jnp

    from jaxcore.models import wan_vae

    mean_ref, logvar_ref = torch_posterior(model, clip)
    posterior = wan_vae.encode(module, params, jnp.asarray(clip))
    assert mean_ref.shape == tuple(latent_shape)
    assert max_err(posterior.mean, mean_ref) < atol
    assert max_err(posterior.logvar, logvar_ref) < atol
    z = latents(latent_shape, seed=z_seed)
    expected = torch_decode(model, z)
    assert_not_all_clamped(expected)
    assert expected.shape[:2] == (clip.shape[0], 3)
    assert max_err(wan_vae.decode(module, params, jnp.asarray(z)), expected) < atol
