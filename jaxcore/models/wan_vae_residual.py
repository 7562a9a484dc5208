"""Parameter-free reshapes of the Wan 2.2 VAE (diffusers ``AutoencoderKLWan(is_residual=True)``).

Reference: ``diffusers/models/autoencoders/autoencoder_kl_wan.py`` (diffusers 0.42):
``patchify`` / ``unpatchify`` (around the whole encoder / decoder when ``patch_size`` is set)
and the shortcuts of the residual blocks, ``AvgDown3D`` (encoder) and ``DupUp3D`` (decoder).
All four only move values between positions and channels (AvgDown3D also averages); getting
diffusers' channel order exactly right is the whole job, so each function states the order.

Everything here is channel-last ``[B, T, H, W, C]`` like the rest of :mod:`wan_vae`; the Flax
blocks that use these shortcuts live in :mod:`jaxcore.models.wan_vae`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def patchify(x_bthwc: jax.Array, patch: int) -> jax.Array:
    """[B, T, H, W, C] -> [B, T, H/p, W/p, C p p]; pixel (p i + a, p j + b) -> channel c p² + b p + a.

    diffusers' ``patchify`` permutes to [C, p_w, p_h]: the W offset is the slower of the two,
    so this is not the row-major space-to-depth of most ports.
    """
    if patch == 1:
        return x_bthwc
    b, t, h, w, c = x_bthwc.shape
    if h % patch or w % patch:
        raise ValueError(f"height {h} and width {w} must be divisible by patch_size {patch}")
    x = x_bthwc.reshape(b, t, h // patch, patch, w // patch, patch, c)
    # [B, T, H', p_h, W', p_w, C] -> [B, T, H', W', C, p_w, p_h]
    x = jnp.transpose(x, (0, 1, 2, 4, 6, 5, 3))
    return x.reshape(b, t, h // patch, w // patch, c * patch * patch)


def unpatchify(x_bthwc: jax.Array, patch: int) -> jax.Array:
    """Inverse of :func:`patchify`: [B, T, H, W, C p p] -> [B, T, p H, p W, C]."""
    if patch == 1:
        return x_bthwc
    b, t, h, w, cpp = x_bthwc.shape
    c = cpp // (patch * patch)
    x = x_bthwc.reshape(b, t, h, w, c, patch, patch)
    # [B, T, H, W, C, p_w, p_h] -> [B, T, H, p_h, W, p_w, C]
    x = jnp.transpose(x, (0, 1, 2, 6, 3, 5, 4))
    return x.reshape(b, t, h * patch, w * patch, c)


def avg_down_3d(x_bthwc: jax.Array, out_channels: int, factor_t: int, factor_s: int) -> jax.Array:
    """diffusers ``AvgDown3D``: the residual down block's shortcut, with no parameters.

    Folds each (factor_t, factor_s, factor_s) block into channels, ordered
    ``c * factor + (t_off * s + h_off) * s + w_off``, then averages consecutive groups of
    ``C * factor / out_channels`` channels. Time is first left-padded with zero frames to a
    multiple of ``factor_t``: it runs on each encoder chunk alone (no cache), so the 1-frame
    first chunk averages its frame with a zero frame, as in diffusers.
    """
    b, t, h, w, c = x_bthwc.shape
    factor = factor_t * factor_s * factor_s
    if (c * factor) % out_channels:
        raise ValueError(f"{c} channels x factor {factor} is not divisible by {out_channels}")
    pad_t = (-t) % factor_t
    x = jnp.pad(x_bthwc, ((0, 0), (pad_t, 0), (0, 0), (0, 0), (0, 0)))
    t = (t + pad_t) // factor_t
    h, w = h // factor_s, w // factor_s
    x = x.reshape(b, t, factor_t, h, factor_s, w, factor_s, c)
    # [B, T', f_t, H', f_h, W', f_w, C] -> [B, T', H', W', C, f_t, f_h, f_w]
    x = jnp.transpose(x, (0, 1, 3, 5, 7, 2, 4, 6))
    x = x.reshape(b, t, h, w, out_channels, c * factor // out_channels)
    return jnp.mean(x, axis=-1)


def dup_up_3d(
    x_bthwc: jax.Array, out_channels: int, factor_t: int, factor_s: int, first_chunk: bool
) -> jax.Array:
    """diffusers ``DupUp3D``: the residual up block's shortcut, with no parameters.

    Repeats every channel ``out_channels * factor / C`` times in place (``repeat_interleave``),
    reads the result as channels ordered ``(out, t_off, h_off, w_off)`` and unfolds the offsets
    into a (factor_t, factor_s, factor_s) block. On the decoder's first chunk the first
    ``factor_t - 1`` frames are dropped, matching the temporal upsampler, which leaves the
    first latent frame as one frame.
    """
    b, t, h, w, c = x_bthwc.shape
    factor = factor_t * factor_s * factor_s
    if (out_channels * factor) % c:
        raise ValueError(f"{out_channels} channels x factor {factor} is not divisible by {c}")
    x = jnp.repeat(x_bthwc, out_channels * factor // c, axis=-1)
    x = x.reshape(b, t, h, w, out_channels, factor_t, factor_s, factor_s)
    # [B, T, H, W, O, f_t, f_h, f_w] -> [B, T, f_t, H, f_h, W, f_w, O]
    x = jnp.transpose(x, (0, 1, 5, 2, 6, 3, 7, 4))
    x = x.reshape(b, t * factor_t, h * factor_s, w * factor_s, out_channels)
    return x[:, factor_t - 1 :] if first_chunk else x
