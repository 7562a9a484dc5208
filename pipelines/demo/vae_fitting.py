"""Fit a (tiny) Wan 2.1 VAE on still images, measure it, and save it in diffusers' format.

Wan's VAE is causal in time: a 1-frame video is encoded and decoded by the first chunk alone
(``first_chunk=True``), so images train the spatial path of every layer while the temporal
resamplers' time convs (used only from the second chunk on) keep their initial values. That
is exactly the path a text-to-image demo uses (1-frame videos end to end).

The objective is the usual KL-regularised autoencoder one (Kingma & Welling 2014; the VAE of
Rombach et al. 2022 without the perceptual/GAN terms): a pixel reconstruction loss (L1 or L2
on [-1, 1] pixels) of ``decode(sample(encode(x)))`` plus ``kl_weight`` x the KL divergence of
the diagonal Gaussian posterior from N(0, I), both averaged per element. Sampling from the
posterior (rather than decoding its mean) teaches the decoder to tolerate small latent errors,
which is what a diffusion model's imperfect latents are.

Public API: :func:`fit_wan_vae`, :func:`latent_stats`, :func:`with_latent_stats`,
:func:`reconstruct`, :func:`psnr`, :func:`save_wan_vae`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm.auto import tqdm

from jaxcore.models import wan_vae
from jaxcore.models.wan_vae import LOGVAR_RANGE, WanVAE, WanVAEConfig

log = logging.getLogger(__name__)

LossKind = Literal["l1", "l2"]

# What diffusers writes into a model's config.json next to the architecture.
DIFFUSERS_VERSION = "0.42.1"
WEIGHTS_FILE = "diffusion_pytorch_model.safetensors"


# ----------------------------------------------------------------------------------------------
# Images <-> model tensors
# ----------------------------------------------------------------------------------------------


def check_images(images: np.ndarray, config: WanVAEConfig, name: str = "images") -> None:
    """Raise ValueError naming ``name`` unless it is uint8 ``[N, H, W, 3]`` the VAE can encode."""
    if images.dtype != np.uint8 or images.ndim != 4 or images.shape[-1] != config.in_channels:
        raise ValueError(
            f"{name} must be uint8 [N, H, W, {config.in_channels}], got {images.dtype} "
            f"{tuple(images.shape)}"
        )
    if images.shape[0] < 1:
        raise ValueError(f"{name} is empty")
    s = config.spatial_compression
    if images.shape[1] % s or images.shape[2] % s:
        raise ValueError(
            f"{name} are {images.shape[1]}x{images.shape[2]}; height and width must be "
            f"divisible by the VAE's spatial compression {s}"
        )


def images_to_frames(images_nhwc: jax.Array) -> jax.Array:
    """uint8 ``[N, H, W, C]`` -> 1-frame channel-last videos ``[N, 1, H, W, C]`` in [-1, 1]."""
    x = images_nhwc.astype(jnp.float32) / 127.5 - 1.0
    return x[:, None]


def images_to_video(images: np.ndarray) -> jax.Array:
    """uint8 ``[N, H, W, C]`` -> 1-frame videos in the diffusers layout ``[N, C, 1, H, W]``."""
    return jnp.transpose(images_to_frames(jnp.asarray(images)), (0, 4, 1, 2, 3))


def video_to_images(video_bcfhw: jax.Array) -> np.ndarray:
    """First frame of ``[N, C, F, H, W]`` videos in [-1, 1] -> uint8 ``[N, H, W, C]``.

    Rounds like ``WanPipeline``'s video processor ((x + 1) / 2 * 255, rounded, clipped).
    """
    frames = np.asarray(jax.device_get(video_bcfhw))[:, :, 0].transpose(0, 2, 3, 1)
    return np.clip(np.round((frames + 1.0) * 127.5), 0, 255).astype(np.uint8)


# ----------------------------------------------------------------------------------------------
# Objective and training step
# ----------------------------------------------------------------------------------------------


def _posterior(module: WanVAE, params, frames_bthwc: jax.Array):
    """Encoder moments of 1-frame videos -> channel-last (mean, clamped logvar)."""
    moments, _ = module.apply(
        {"params": params}, frames_bthwc, True, method="encode_chunk", mutable=["cache"]
    )
    mean, logvar = jnp.split(moments, 2, axis=-1)
    return mean, jnp.clip(logvar, *LOGVAR_RANGE)


def _decode_frames(module: WanVAE, params, z_bthwc: jax.Array) -> jax.Array:
    pixels, _ = module.apply(
        {"params": params}, z_bthwc, True, method="decode_chunk", mutable=["cache"]
    )
    return pixels


def vae_loss(
    module: WanVAE,
    params,
    images_nhwc: jax.Array,
    rng: jax.Array,
    *,
    kl_weight: float,
    loss: LossKind = "l1",
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Reconstruction (per-pixel mean) + kl_weight x KL(q(z|x) || N(0, I)) (per-element mean)."""
    frames = images_to_frames(images_nhwc)
    mean, logvar = _posterior(module, params, frames)
    z = mean + jnp.exp(0.5 * logvar) * jax.random.normal(rng, mean.shape, mean.dtype)
    error = _decode_frames(module, params, z) - frames
    recon = jnp.mean(jnp.abs(error)) if loss == "l1" else jnp.mean(jnp.square(error))
    kl = 0.5 * jnp.mean(jnp.square(mean) + jnp.exp(logvar) - 1.0 - logvar)
    total = recon + kl_weight * kl
    return total, {"loss": total, "recon": recon, "kl": kl}


def _make_train_step(module: WanVAE, optimizer, kl_weight: float, loss: LossKind):
    """One jitted AdamW step: (params, opt_state, uint8 batch, rng) -> (params, state, metrics)."""

    def step(params, opt_state, batch, rng):
        grad_fn = jax.value_and_grad(
            lambda p: vae_loss(module, p, batch, rng, kl_weight=kl_weight, loss=loss),
            has_aux=True,
        )
        (_, metrics), grads = grad_fn(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, metrics

    return jax.jit(step, donate_argnums=(0, 1))


def _check_fit_args(steps: int, batch_size: int, learning_rate: float, kl_weight: float) -> None:
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not learning_rate > 0:
        raise ValueError(f"learning_rate must be > 0, got {learning_rate}")
    if kl_weight < 0:
        raise ValueError(f"kl_weight must be >= 0, got {kl_weight}")


def fit_wan_vae(
    config: WanVAEConfig,
    images: np.ndarray,
    *,
    steps: int,
    batch_size: int = 32,
    learning_rate: float = 2e-3,
    kl_weight: float = 1e-3,
    seed: int = 0,
    log_every: int = 100,
    loss: LossKind = "l1",
    weight_decay: float = 0.0,
    crop_size: int | None = None,
    params: Any = None,
    progress: bool = True,
) -> tuple[Any, list[dict[str, float]]]:
    """Fit a Wan VAE of ``config`` to uint8 ``images [N, H, W, 3]``; returns (params, history).

    AdamW with a cosine decay to 10% of ``learning_rate`` after a short warmup; batches drawn
    without replacement per epoch by ``np.random.default_rng(seed)``; init and posterior noise
    from ``jax.random.key(seed)``, so a run is reproducible from its seed. ``params`` continues
    from given weights instead of a fresh init. ``history`` holds one dict (step, loss, recon,
    kl) every ``log_every`` steps and at the last step.

    ``crop_size``: train on random square crops of this size (a multiple of the spatial
    compression). The VAE is convolutional with per-pixel norms, so crops teach the same
    weights at a fraction of the cost; only the mid-block attention sees a smaller field.
    """
    _check_fit_args(steps, batch_size, learning_rate, kl_weight)
    if loss not in ("l1", "l2"):
        raise ValueError(f"loss must be 'l1' or 'l2', got {loss!r}")
    check_images(images, config)
    _check_crop(crop_size, images.shape[1:3], config.spatial_compression)
    init_key, noise_key = jax.random.split(jax.random.key(seed))
    module, initial = wan_vae.init_wan_vae(config, init_key)
    params = initial if params is None else params
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, learning_rate, min(100, max(1, steps // 10)), steps, learning_rate * 0.1
    )
    optimizer = optax.chain(
        optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=weight_decay)
    )
    opt_state = optimizer.init(params)
    train_step = _make_train_step(module, optimizer, kl_weight, loss)
    data_rng = np.random.default_rng(seed)
    batches = _batch_indices(len(images), batch_size, data_rng)
    history: list[dict[str, float]] = []
    bar = tqdm(range(steps), desc="fit VAE", disable=not progress, leave=False)
    for step in bar:
        batch = images[next(batches)]
        if crop_size is not None:
            batch = _random_crops(batch, crop_size, data_rng)
        params, opt_state, metrics = train_step(
            params, opt_state, batch, jax.random.fold_in(noise_key, step)
        )
        if (step + 1) % log_every == 0 or step + 1 == steps:
            record = {"step": step + 1, **{k: float(v) for k, v in metrics.items()}}
            history.append(record)
            bar.set_postfix(loss=f"{record['loss']:.4f}")
            log.info("VAE step %d: %s", step + 1, record)
    return params, history


def _check_crop(crop_size: int | None, image_hw: tuple[int, int], compression: int) -> None:
    if crop_size is None:
        return
    if crop_size < compression or crop_size % compression or crop_size > min(image_hw):
        raise ValueError(
            f"crop_size must be a multiple of the spatial compression {compression} and at "
            f"most the image size {tuple(image_hw)}, got {crop_size}"
        )


def _random_crops(batch: np.ndarray, size: int, rng: np.random.Generator) -> np.ndarray:
    """One random ``size`` x ``size`` crop per image of a uint8 ``[B, H, W, C]`` batch."""
    n, height, width, _ = batch.shape
    tops = rng.integers(0, height - size + 1, n)
    lefts = rng.integers(0, width - size + 1, n)
    return np.stack(
        [image[t : t + size, x : x + size] for image, t, x in zip(batch, tops, lefts, strict=True)]
    )


def _batch_indices(n: int, batch_size: int, rng: np.random.Generator):
    """Endless index batches: a fresh permutation per epoch, wrapping to fill the last batch."""
    order = np.empty(0, dtype=np.int64)
    while True:
        while len(order) < batch_size:
            order = np.concatenate([order, rng.permutation(n)])
        yield np.sort(order[:batch_size])
        order = order[batch_size:]


# ----------------------------------------------------------------------------------------------
# Measuring a fitted VAE
# ----------------------------------------------------------------------------------------------


def _batches(n: int, batch_size: int):
    for start in range(0, n, batch_size):
        yield slice(start, min(n, start + batch_size))


def latent_stats(
    module: WanVAE, params, images: np.ndarray, *, batch_size: int = 64
) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel (mean, std) of the posterior means of ``images`` (uint8 [N, H, W, 3]).

    These are the ``latents_mean`` / ``latents_std`` to ship: ``normalize_latents`` (as
    WanPipeline) subtracts the mean and divides by the std, giving ~zero-mean unit-variance
    latents for the diffusion model.
    """
    check_images(images, module.config)
    z_dim = module.config.z_dim
    total = np.zeros(z_dim, np.float64)
    total_sq = np.zeros(z_dim, np.float64)
    count = 0
    for part in _batches(len(images), batch_size):
        mean = np.asarray(wan_vae.encode(module, params, images_to_video(images[part])).mean)
        per_channel = np.moveaxis(mean, 1, -1).reshape(-1, z_dim).astype(np.float64)
        total += per_channel.sum(0)
        total_sq += np.square(per_channel).sum(0)
        count += per_channel.shape[0]
    mu = total / count
    std = np.sqrt(np.maximum(total_sq / count - mu * mu, 0.0))
    if np.any(std <= 0):
        raise ValueError(f"latent channel(s) {np.flatnonzero(std <= 0).tolist()} are constant")
    return mu.astype(np.float32), std.astype(np.float32)


def with_latent_stats(config: WanVAEConfig, mean: np.ndarray, std: np.ndarray) -> WanVAEConfig:
    """``config`` with ``latents_mean`` / ``latents_std`` set (rounded to 5 decimals)."""
    return dataclasses.replace(
        config,
        latents_mean=tuple(round(float(m), 5) for m in mean),
        latents_std=tuple(round(float(s), 5) for s in std),
    )


def reconstruct(module: WanVAE, params, images: np.ndarray, *, batch_size: int = 64) -> np.ndarray:
    """uint8 images -> decode(posterior mean) as uint8, through the public encode/decode path."""
    check_images(images, module.config)
    out = []
    for part in _batches(len(images), batch_size):
        posterior = wan_vae.encode(module, params, images_to_video(images[part]))
        out.append(video_to_images(wan_vae.decode(module, params, posterior.mean)))
    return np.concatenate(out)


def psnr(reference: np.ndarray, test: np.ndarray) -> float:
    """Peak signal-to-noise ratio in dB of uint8 images (over the whole set; inf if equal)."""
    if reference.shape != test.shape:
        raise ValueError(f"psnr: shapes differ, {reference.shape} vs {test.shape}")
    mse = np.mean(np.square(reference.astype(np.float64) - test.astype(np.float64)))
    return float("inf") if mse == 0 else float(10.0 * np.log10(255.0**2 / mse))


# ----------------------------------------------------------------------------------------------
# Saving in diffusers' format
# ----------------------------------------------------------------------------------------------


def diffusers_vae_config(config: WanVAEConfig) -> dict[str, Any]:
    """config.json for diffusers' ``AutoencoderKLWan``, with the real compression factors.

    diffusers' WanPipeline sizes latents from ``scale_factor_*`` (metadata it does not check
    against the architecture), so they are set to what this architecture really does.
    """
    config = dataclasses.replace(
        config,
        scale_factor_temporal=config.temporal_compression,
        scale_factor_spatial=config.spatial_compression,
    )
    return {
        "_class_name": "AutoencoderKLWan",
        "_diffusers_version": DIFFUSERS_VERSION,
        **config.to_dict(),
    }


def save_wan_vae(directory: str | os.PathLike, config: WanVAEConfig, params) -> Path:
    """Write ``config.json`` + ``diffusion_pytorch_model.safetensors`` (fp32) into ``directory``.

    The result loads with :func:`jaxcore.models.wan_vae.load_wan_vae` and with diffusers'
    ``AutoencoderKLWan.from_pretrained``. Weights are exported through the VAE's weight map,
    every tensor checked by a round trip (:func:`jaxcore.weights.export_state_dict`).
    """
    from jaxcore import weights

    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    params32 = jax.tree.map(lambda p: np.asarray(p, np.float32), params)
    tensors = weights.export_state_dict(params32, wan_vae.weight_map(config))
    weights.save_safetensors(tensors, folder / WEIGHTS_FILE, {"format": "pt"})
    text = json.dumps(diffusers_vae_config(config), indent=2, sort_keys=True) + "\n"
    (folder / "config.json").write_text(text)
    return folder
