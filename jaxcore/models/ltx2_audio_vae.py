"""LTX-2 audio VAE in Flax linen, numerically equal to diffusers' ``AutoencoderKLLTX2Audio``.

Reference: ``diffusers/models/autoencoders/autoencoder_kl_ltx2_audio.py`` (diffusers 0.42) and
the audio-latent helpers of ``diffusers/pipelines/ltx2/pipeline_ltx2.py``
(``_pack_audio_latents``, ``_unpack_audio_latents``, ``_normalize_audio_latents``,
``_denormalize_audio_latents`` and the ``audio_num_frames`` rule of ``LTX2Pipeline.__call__``).

Layout: public tensors use the diffusers layout, mel spectrograms ``[B, C, time, mel]`` and
latents ``[B, latent_channels, time / 4, mel / 4]``. Inside, activations are channel-last
``[B, time, mel, C]`` (NHWC with H = time, W = mel bins).

What makes it equal to diffusers:
- ``LTX2AudioCausalConv2d``: zero padding of ``(k - 1) * d`` per axis, all of it before the
  data on the causal axis (``height`` = time, ``width`` = mel), split ``p // 2`` / ``p - p // 2``
  on the other axis (both axes for ``none``).
- The downsamplers are plain stride-2 3x3 convs after a fixed zero pad per causality axis;
  the upsamplers repeat nearest x2 on both axes, convolve causally, then drop the first row
  (``height``) or column (``width``), so causal time goes ``T -> 2 T - 1``.
- ``pixel`` norm is ``x / sqrt(mean_c(x^2) + 1e-6)`` without affine; ``group`` norm is
  ``GroupNorm(32, eps=1e-6)`` with affine (diffusers allows it only with ``causality_axis="none"``).
- The decoder crops / zero-pads its output to ``4 L - 3`` frames (``max(., 1)``) and
  ``mel_bins`` bins, as ``LTX2AudioDecoder.forward`` does.
- The posterior is diffusers' ``DiagonalGaussianDistribution``: the encoder's channels split in
  halves (mean, logvar), logvar clamped to [-30, 20].
- ``latents_mean`` / ``latents_std`` are the checkpoint's buffers, ``[base_channels]`` long: the
  pipeline normalises *packed* latents ``[B, L, C * M]`` with them, so the released config has
  ``base_channels == latent_channels * mel_bins / 4`` (128 = 8 * 16).

The pipeline's decode chain (LTX2Pipeline, diffusers 0.42), with the released LTX-2 config
(latent 8 channels, 64 mel bins, 16 kHz, hop 160)::

    L = round(num_frames / frame_rate * sample_rate / mel_hop_length / 4)   # audio_latent_length
    packed [B, L, 128] -> denormalize_audio_latents -> unpack_audio_latents(., 16)
      -> [B, 8, L, 16] -> decode -> mel [B, 2, 4 L - 3, 64] -> vocoder -> [B, 2, samples]

(:mod:`jaxcore.models.ltx2_vocoder`: ``samples = (4 L - 3) * 240`` at 24 kHz for LTX-2.0's
``LTX2Vocoder``, ``(4 L - 3) * 160 * 3`` at 48 kHz for LTX-2.3's ``LTX2VocoderWithBWE``.)

Parity reached (tests/jaxcore/test_ltx2_audio_vae.py, fp32 on CPU, every diffusers parameter
and buffer perturbed): posterior mean / logvar <= 1.3e-6 and decoded mel <= 1.8e-6 relative to
the reference's max |value| (pixel / height, group norm + attention / none, pixel / width and
width-compatibility tiny configs; test bound 1e-5). Parameter count equals diffusers' for the
released config (class defaults).

Public API: :class:`LTX2AudioVAEConfig`, :class:`LTX2AudioVAE`, :func:`encode`,
:func:`decode`, :func:`pack_audio_latents`, :func:`unpack_audio_latents`,
:func:`normalize_audio_latents`, :func:`denormalize_audio_latents`,
:func:`audio_latent_length`, :func:`latent_shape`, :func:`decoded_shape`,
:func:`weight_map`, :func:`abstract_params`, :func:`count_params`, :func:`load_ltx2_audio_vae`,
:func:`init_ltx2_audio_vae`.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

from jaxcore import weights
from jaxcore.config import config_json_kwargs
from jaxcore.models.layers import conv2d, silu
from jaxcore.models.wan_vae import LOGVAR_RANGE, DiagonalGaussian

Dtype = Any

# diffusers' LATENT_DOWNSAMPLE_FACTOR: the pipeline's time and mel compression of the latents.
LATENT_DOWNSAMPLE_FACTOR = 4
# LTX2AudioPixelNorm(dim=1, eps=1e-6) and nn.GroupNorm(32, eps=1e-6) in every block and head.
NORM_EPS = 1e-6
GROUPS = 32
CAUSALITY_AXES = ("none", "width", "height", "width-compatibility")
NORM_TYPES = ("group", "pixel")
# LTX2AudioDownsample's zero pad ((time before, after), (mel before, after)) before its
# unpadded stride-2 conv, per causality axis (diffusers writes (left, right, top, bottom)).
DOWNSAMPLE_PADS = {
    "none": ((0, 1), (0, 1)),
    "width": ((0, 1), (2, 0)),
    "height": ((2, 0), (0, 1)),
    "width-compatibility": ((0, 1), (1, 0)),
}


# ----------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------


class LTX2AudioVAEConfigError(ValueError):
    """A config.json / YAML section LTX2AudioVAEConfig cannot represent; names the key."""


@dataclasses.dataclass(frozen=True)
class LTX2AudioVAEConfig:
    """Architecture of the LTX-2 audio VAE; field names and defaults are diffusers'
    ``AutoencoderKLLTX2Audio`` arguments, which are also the released LTX-2 config
    (diffusers ``scripts/convert_ltx2_to_diffusers.py``, ``get_ltx2_audio_vae_config("2.0")``).

    ``resolution`` only decides which levels carry attention (``attn_resolutions``, compared
    with ``resolution / 2^level``); ``sample_rate`` / ``mel_hop_length`` set the pipeline's
    audio latent rate; ``is_causal`` and ``dropout`` (inference) change nothing diffusers
    computes. ``mel_bins=None`` makes the decoder crop its output to the latent's mel width,
    as diffusers does.
    """

    base_channels: int = 128
    output_channels: int = 2
    ch_mult: tuple[int, ...] = (1, 2, 4)
    num_res_blocks: int = 2
    attn_resolutions: tuple[int, ...] | None = None
    in_channels: int = 2
    resolution: int = 256
    latent_channels: int = 8
    norm_type: str = "pixel"
    causality_axis: str = "height"
    dropout: float = 0.0
    mid_block_add_attention: bool = False
    sample_rate: int = 16000
    mel_hop_length: int = 160
    is_causal: bool = True
    mel_bins: int | None = 64
    double_z: bool = True

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, list):
                object.__setattr__(self, f.name, tuple(value))
        if self.causality_axis not in CAUSALITY_AXES:
            raise LTX2AudioVAEConfigError(
                f"causality_axis={self.causality_axis!r} is not one of {list(CAUSALITY_AXES)}"
            )
        if self.norm_type not in NORM_TYPES:
            raise LTX2AudioVAEConfigError(
                f"norm_type={self.norm_type!r} is not one of {list(NORM_TYPES)}"
            )
        if self.norm_type == "group" and self.causality_axis != "none":
            raise LTX2AudioVAEConfigError(
                f"norm_type='group' needs causality_axis='none' (diffusers' ResnetBlock refuses "
                f"GroupNorm with causality_axis={self.causality_axis!r})"
            )
        for key in ("base_channels", "output_channels", "in_channels", "latent_channels"):
            if int(getattr(self, key)) < 1:
                raise LTX2AudioVAEConfigError(f"{key} must be >= 1, got {getattr(self, key)!r}")
        if not self.ch_mult:
            raise LTX2AudioVAEConfigError("ch_mult must name at least one level")
        if self.encoder_out_channels % 2:
            raise LTX2AudioVAEConfigError(
                f"double_z={self.double_z} with latent_channels={self.latent_channels} gives an "
                f"odd {self.encoder_out_channels} encoder channels: the posterior cannot split "
                "them into mean and logvar halves"
            )
        if self.norm_type == "group":
            self._check_group_widths()

    def _check_group_widths(self) -> None:
        widths = {self.base_channels * m for m in self.ch_mult}
        bad = sorted(w for w in widths if w % GROUPS)
        if bad:
            raise LTX2AudioVAEConfigError(
                f"norm_type='group' uses GroupNorm({GROUPS}); base_channels * ch_mult gives "
                f"widths {bad} not divisible by {GROUPS}"
            )

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LTX2AudioVAEConfig:
        """Build from a diffusers config.json dict (``_``-prefixed keys ignored; any other
        unknown key is an error naming it)."""
        return cls(**config_json_kwargs(cls, d, LTX2AudioVAEConfigError))

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}

    @property
    def num_levels(self) -> int:
        return len(self.ch_mult)

    @property
    def encoder_out_channels(self) -> int:
        return 2 * self.latent_channels if self.double_z else self.latent_channels

    @property
    def posterior_channels(self) -> int:
        """Channels of the posterior mean (diffusers halves the encoder's output)."""
        return self.encoder_out_channels // 2

    def level_width(self, level: int) -> int:
        return self.base_channels * self.ch_mult[level]

    def encoder_attention(self, level: int) -> bool:
        """Whether the encoder's level carries an attention per block (its resolution,
        ``resolution / 2^level``, is in ``attn_resolutions``)."""
        return bool(self.attn_resolutions) and (
            self.resolution // 2**level in set(self.attn_resolutions)
        )

    def decoder_attention(self, level: int) -> bool:
        """The decoder's ``up[level]`` resolution is diffusers' ``resolution // 2^(n - 1)``
        doubled per level above the innermost (not always ``resolution // 2^level``)."""
        inner = self.resolution // 2 ** (self.num_levels - 1)
        res = inner * 2 ** (self.num_levels - 1 - level)
        return bool(self.attn_resolutions) and res in set(self.attn_resolutions)

    @property
    def latent_mel_bins(self) -> int:
        """Latent mel width the pipeline allocates: ``mel_bins // 4``."""
        if self.mel_bins is None:
            raise LTX2AudioVAEConfigError(
                "mel_bins is None: LTX2Pipeline sizes the audio latents from config.mel_bins"
            )
        return self.mel_bins // LATENT_DOWNSAMPLE_FACTOR


# ----------------------------------------------------------------------------------------------
# The pipeline's latent helpers (LTX2Pipeline static methods)
# ----------------------------------------------------------------------------------------------


def pack_audio_latents(latents_bclm: jax.Array) -> jax.Array:
    """``_pack_audio_latents`` (no patch sizes, the pipeline's call): ``[B, C, L, M] ->
    [B, L, C * M]``, feature ``c * M + m``. diffusers' patched variant divides lengths with
    ``/`` and cannot reshape, so it is not offered."""
    if latents_bclm.ndim != 4:
        raise ValueError(f"audio latents must be [B, C, L, M], got shape {latents_bclm.shape}")
    b, c, length, m = latents_bclm.shape
    return jnp.transpose(latents_bclm, (0, 2, 1, 3)).reshape(b, length, c * m)


def unpack_audio_latents(packed_bld: jax.Array, num_mel_bins: int) -> jax.Array:
    """``_unpack_audio_latents`` (no patch sizes): ``[B, L, C * M] -> [B, C, L, M]`` with
    ``M = num_mel_bins`` (the *latent* mel width, ``mel_bins // 4``)."""
    if packed_bld.ndim != 3 or packed_bld.shape[2] % num_mel_bins:
        raise ValueError(
            f"packed audio latents must be [B, L, C * {num_mel_bins}], got {packed_bld.shape}"
        )
    b, length, d = packed_bld.shape
    x = packed_bld.reshape(b, length, d // num_mel_bins, num_mel_bins)
    return jnp.transpose(x, (0, 2, 1, 3))


def _latent_stats(params: Mapping, packed: jax.Array) -> tuple[jax.Array, jax.Array]:
    mean = jnp.asarray(params["latents_mean"], packed.dtype)
    std = jnp.asarray(params["latents_std"], packed.dtype)
    if packed.ndim != 3 or packed.shape[-1] != mean.shape[0]:
        raise ValueError(
            f"audio latent statistics have {mean.shape[0]} entries (base_channels) and apply "
            f"to packed latents [B, L, {mean.shape[0]}]; got shape {packed.shape}"
        )
    return mean, std


def normalize_audio_latents(packed_bld: jax.Array, params: Mapping) -> jax.Array:
    """``_normalize_audio_latents``: ``(x - latents_mean) / latents_std`` over the last axis of
    *packed* latents (the checkpoint's buffers, kept in ``params``)."""
    mean, std = _latent_stats(params, packed_bld)
    return (packed_bld - mean) / std


def denormalize_audio_latents(packed_bld: jax.Array, params: Mapping) -> jax.Array:
    """``_denormalize_audio_latents``: ``x * latents_std + latents_mean``, before unpacking."""
    mean, std = _latent_stats(params, packed_bld)
    return packed_bld * std + mean


def audio_latent_length(config: LTX2AudioVAEConfig, num_frames: int, frame_rate: float) -> int:
    """LTX2Pipeline's ``audio_num_frames``: ``round(num_frames / frame_rate * sample_rate /
    mel_hop_length / 4)`` (Python's round, half to even, as the pipeline)."""
    per_second = config.sample_rate / config.mel_hop_length / float(LATENT_DOWNSAMPLE_FACTOR)
    return round(num_frames / frame_rate * per_second)


# ----------------------------------------------------------------------------------------------
# Shapes
# ----------------------------------------------------------------------------------------------


def _downsampled(size: int, pad: tuple[int, int]) -> int:
    return (size + sum(pad) - 3) // 2 + 1


def latent_shape(config: LTX2AudioVAEConfig, mel_shape: Sequence[int]) -> tuple[int, ...]:
    """Posterior shape of a ``[B, in_channels, time, mel]`` spectrogram; ValueError naming the
    dimension where a downsampler would get nothing to convolve."""
    if len(mel_shape) != 4:
        raise ValueError(f"mel spectrogram must be [B, C, time, mel], got {tuple(mel_shape)}")
    b, c, t, m = (int(s) for s in mel_shape)
    if c != config.in_channels:
        raise ValueError(f"spectrogram has {c} channels but in_channels is {config.in_channels}")
    pad_t, pad_m = DOWNSAMPLE_PADS[config.causality_axis]
    for level in range(config.num_levels - 1):
        if t + sum(pad_t) < 3 or m + sum(pad_m) < 3:
            raise ValueError(
                f"encoder level {level} downsamples a {t} x {m} (time x mel) map: too small for "
                "its 3x3 stride-2 conv"
            )
        t, m = _downsampled(t, pad_t), _downsampled(m, pad_m)
    return (b, config.posterior_channels, t, m)


def decoded_shape(config: LTX2AudioVAEConfig, z_shape: Sequence[int]) -> tuple[int, ...]:
    """Mel shape ``decode`` returns for latents ``[B, latent_channels, L, M]``: diffusers'
    target ``max(4 L - 3, 1)`` frames (causal axis set) and ``mel_bins`` (or ``M``) bins."""
    b, _, frames, mel = (int(s) for s in z_shape)
    # AutoencoderKLLTX2Audio always sets a causality_axis, so the causal target applies.
    target_frames = max(frames * LATENT_DOWNSAMPLE_FACTOR - (LATENT_DOWNSAMPLE_FACTOR - 1), 1)
    target_mel = config.mel_bins if config.mel_bins is not None else mel
    return (b, config.output_channels, target_frames, target_mel)


def check_latents(config: LTX2AudioVAEConfig, z_shape: Sequence[int]) -> None:
    if len(z_shape) != 4:
        raise ValueError(f"audio latents must be [B, C, L, M], got shape {tuple(z_shape)}")
    if z_shape[1] != config.latent_channels:
        raise ValueError(
            f"audio latents have {z_shape[1]} channels but latent_channels is "
            f"{config.latent_channels}"
        )
    if min(z_shape[2:]) < 1:
        raise ValueError(f"audio latents have an empty dimension: shape {tuple(z_shape)}")


# ----------------------------------------------------------------------------------------------
# Layers (channel-last [B, time, mel, C])
# ----------------------------------------------------------------------------------------------


_KERNEL_INIT = nn.with_logical_partitioning(
    nn.initializers.lecun_normal(), (None, None, "conv_in", "conv_out")
)
_BIAS_INIT = nn.with_logical_partitioning(nn.initializers.zeros_init(), ("conv_out",))
_CHANNEL_ZEROS = nn.with_logical_partitioning(nn.initializers.zeros_init(), ("norm",))
_CHANNEL_ONES = nn.with_logical_partitioning(nn.initializers.ones_init(), ("norm",))


def causal_pads(axis: str, kernel: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """``LTX2AudioCausalConv2d``'s zero pad ((time), (mel)) for a ``kernel`` x ``kernel``
    conv (dilation 1, as every conv of the VAE)."""
    p = kernel - 1
    centred = (p // 2, p - p // 2)
    if axis == "none":
        return centred, centred
    if axis in ("width", "width-compatibility"):
        return centred, (p, 0)
    return (p, 0), centred  # height


def pixel_norm(x: jax.Array) -> jax.Array:
    """``LTX2AudioPixelNorm(dim=1, eps=1e-6)`` over channels, statistics in float32."""
    x32 = x.astype(jnp.float32)
    rms = jnp.sqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + NORM_EPS)
    return (x32 / rms).astype(x.dtype)


class Norm(nn.Module):
    """The config's norm: :func:`pixel_norm`, or ``GroupNorm(32, eps=1e-6)`` with its affine
    (``scale`` / ``bias``, diffusers' ``weight`` / ``bias``)."""

    norm_type: str
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        if self.norm_type == "pixel":
            return pixel_norm(x)
        c = x.shape[-1]
        scale = self.param("scale", _CHANNEL_ONES, (c,), self.param_dtype)
        bias = self.param("bias", _CHANNEL_ZEROS, (c,), self.param_dtype)
        x32 = x.astype(jnp.float32)
        groups = x32.reshape(*x.shape[:-1], GROUPS, c // GROUPS)
        axes = tuple(range(1, groups.ndim - 2)) + (groups.ndim - 1,)
        mean = jnp.mean(groups, axis=axes, keepdims=True)
        var = jnp.mean(jnp.square(groups - mean), axis=axes, keepdims=True)
        y = ((groups - mean) / jnp.sqrt(var + NORM_EPS)).reshape(x.shape)
        return (y * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


class Conv2d(nn.Module):
    """torch ``nn.Conv2d`` (bias) on ``[B, T, M, C]`` with explicit zero ``padding`` pairs."""

    features: int
    kernel_size: int = 3
    stride: int = 1
    padding: tuple[tuple[int, int], tuple[int, int]] = ((0, 0), (0, 0))
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        k = self.kernel_size
        kernel = self.param(
            "kernel", _KERNEL_INIT, (k, k, x.shape[-1], self.features), self.param_dtype
        )
        bias = self.param("bias", _BIAS_INIT, (self.features,), self.param_dtype)
        y = conv2d(
            x.astype(self.dtype),
            kernel.astype(self.dtype),
            (self.stride, self.stride),
            self.padding,
        )
        return y + bias.astype(self.dtype)


class CausalConv2d(nn.Module):
    """diffusers ``LTX2AudioCausalConv2d``: :func:`causal_pads`, then the conv (parameters
    under ``conv``, as diffusers' ``self.conv``)."""

    features: int
    kernel_size: int
    causality_axis: str
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        pads = causal_pads(self.causality_axis, self.kernel_size)
        kw = {"dtype": self.dtype, "param_dtype": self.param_dtype}
        return Conv2d(self.features, self.kernel_size, 1, pads, name="conv", **kw)(x)


class ResnetBlock(nn.Module):
    """diffusers ``LTX2AudioResnetBlock`` (no time embedding): norm, SiLU, causal 3x3 conv,
    twice, plus the input (through a 1x1 ``nin_shortcut`` where the width changes)."""

    out_channels: int
    norm_type: str
    causality_axis: str
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kw = {"dtype": self.dtype, "param_dtype": self.param_dtype}
        axis, c = self.causality_axis, self.out_channels
        h = silu(Norm(self.norm_type, self.param_dtype, name="norm1")(x))
        h = CausalConv2d(c, 3, axis, name="conv1", **kw)(h)
        h = silu(Norm(self.norm_type, self.param_dtype, name="norm2")(h))
        h = CausalConv2d(c, 3, axis, name="conv2", **kw)(h)
        if x.shape[-1] != c:
            x = CausalConv2d(c, 1, axis, name="nin_shortcut", **kw)(x)
        return x + h


class AttnBlock(nn.Module):
    """diffusers ``LTX2AudioAttnBlock``: single-head self-attention over all time x mel
    positions with 1x1-conv q / k / v / proj_out, scaled by ``C ** -0.5``, plus the input."""

    norm_type: str
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kw = {"dtype": self.dtype, "param_dtype": self.param_dtype}
        b, t, m, c = x.shape
        h = Norm(self.norm_type, self.param_dtype, name="norm")(x)
        q, k, v = (Conv2d(c, 1, name=n, **kw)(h).reshape(b, t * m, c) for n in ("q", "k", "v"))
        scores = jnp.einsum("bic,bjc->bij", q, k) * (int(c) ** -0.5)
        probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(v.dtype)
        out = jnp.einsum("bij,bjc->bic", probs, v).reshape(b, t, m, c)
        return x + Conv2d(c, 1, name="proj_out", **kw)(out)


class Downsample(nn.Module):
    """diffusers ``LTX2AudioDownsample(with_conv=True)``: the fixed zero pad of
    :data:`DOWNSAMPLE_PADS`, then a plain 3x3 stride-2 conv (under ``conv``)."""

    causality_axis: str
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        pads = DOWNSAMPLE_PADS[self.causality_axis]
        kw = {"dtype": self.dtype, "param_dtype": self.param_dtype}
        return Conv2d(x.shape[-1], 3, 2, pads, name="conv", **kw)(x)


class Upsample(nn.Module):
    """diffusers ``LTX2AudioUpsample(with_conv=True)``: nearest x2 on both axes, a causal 3x3
    conv, then the first time row (``height``) or mel column (``width``) dropped."""

    causality_axis: str
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kw = {"dtype": self.dtype, "param_dtype": self.param_dtype}
        x = jnp.repeat(jnp.repeat(x, 2, axis=1), 2, axis=2)
        x = CausalConv2d(x.shape[-1], 3, self.causality_axis, name="conv", **kw)(x)
        if self.causality_axis == "height":
            return x[:, 1:]
        if self.causality_axis == "width":
            return x[:, :, 1:]
        return x  # none, width-compatibility


class MidBlock(nn.Module):
    """diffusers' ``mid``: ``block_1``, optional ``attn_1``, ``block_2`` at one width."""

    config: LTX2AudioVAEConfig
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        kw = {"dtype": self.dtype, "param_dtype": self.param_dtype}
        c = x.shape[-1]
        x = ResnetBlock(c, cfg.norm_type, cfg.causality_axis, name="block_1", **kw)(x)
        if cfg.mid_block_add_attention:
            x = AttnBlock(cfg.norm_type, name="attn_1", **kw)(x)
        return ResnetBlock(c, cfg.norm_type, cfg.causality_axis, name="block_2", **kw)(x)


class Level(nn.Module):
    """One encoder ``down[i]`` / decoder ``up[i]`` stage: ``num_blocks`` resnets (each followed
    by an attention where the level has them), then the ``downsample`` / ``upsample``."""

    config: LTX2AudioVAEConfig
    width: int
    num_blocks: int
    attention: bool
    resample: str | None  # "downsample", "upsample" or None
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        kw = {"dtype": self.dtype, "param_dtype": self.param_dtype}
        for i in range(self.num_blocks):
            x = ResnetBlock(self.width, cfg.norm_type, cfg.causality_axis, name=f"block_{i}", **kw)(
                x
            )
            if self.attention:
                x = AttnBlock(cfg.norm_type, name=f"attn_{i}", **kw)(x)
        if self.resample == "downsample":
            x = Downsample(cfg.causality_axis, name="downsample", **kw)(x)
        elif self.resample == "upsample":
            x = Upsample(cfg.causality_axis, name="upsample", **kw)(x)
        return x


class Encoder(nn.Module):
    """diffusers ``LTX2AudioEncoder``: conv_in, the levels (downsampling but the last), the mid
    block, norm, SiLU, conv_out to ``2 latent_channels`` (``double_z``) channels."""

    config: LTX2AudioVAEConfig
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        kw = {"dtype": self.dtype, "param_dtype": self.param_dtype}
        x = CausalConv2d(cfg.base_channels, 3, cfg.causality_axis, name="conv_in", **kw)(x)
        for level in range(cfg.num_levels):
            resample = "downsample" if level != cfg.num_levels - 1 else None
            x = Level(
                cfg,
                cfg.level_width(level),
                cfg.num_res_blocks,
                cfg.encoder_attention(level),
                resample,
                name=f"down_{level}",
                **kw,
            )(x)
        x = MidBlock(cfg, name="mid", **kw)(x)
        x = silu(Norm(cfg.norm_type, self.param_dtype, name="norm_out")(x))
        out = cfg.encoder_out_channels
        return CausalConv2d(out, 3, cfg.causality_axis, name="conv_out", **kw)(x)


class Decoder(nn.Module):
    """diffusers ``LTX2AudioDecoder``: conv_in, the mid block, the levels from the innermost
    out (``num_res_blocks + 1`` resnets each, upsampling but level 0), norm, SiLU, conv_out,
    then the crop / zero pad to :func:`decoded_shape`."""

    config: LTX2AudioVAEConfig
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, z: jax.Array) -> jax.Array:
        cfg = self.config
        kw = {"dtype": self.dtype, "param_dtype": self.param_dtype}
        width = cfg.level_width(cfg.num_levels - 1)
        x = CausalConv2d(width, 3, cfg.causality_axis, name="conv_in", **kw)(z)
        x = MidBlock(cfg, name="mid", **kw)(x)
        for level in reversed(range(cfg.num_levels)):
            x = Level(
                cfg,
                cfg.level_width(level),
                cfg.num_res_blocks + 1,
                cfg.decoder_attention(level),
                "upsample" if level != 0 else None,
                name=f"up_{level}",
                **kw,
            )(x)
        x = silu(Norm(cfg.norm_type, self.param_dtype, name="norm_out")(x))
        x = CausalConv2d(cfg.output_channels, 3, cfg.causality_axis, name="conv_out", **kw)(x)
        return _crop_or_pad(x, decoded_shape(cfg, (z.shape[0], z.shape[3], z.shape[1], z.shape[2])))


def _crop_or_pad(x_btmc: jax.Array, target_bctm: Sequence[int]) -> jax.Array:
    """``LTX2AudioDecoder.forward``'s tail: crop time / mel to the target, zero-pad what is
    short (at the end)."""
    _, _, t, m = target_bctm
    x = x_btmc[:, :t, :m]
    return jnp.pad(x, ((0, 0), (0, t - x.shape[1]), (0, m - x.shape[2]), (0, 0)))


# ----------------------------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------------------------


def _to_channel_last(x_bctm: jax.Array) -> jax.Array:
    return jnp.transpose(x_bctm, (0, 2, 3, 1))


def _to_channel_first(x_btmc: jax.Array) -> jax.Array:
    return jnp.transpose(x_btmc, (0, 3, 1, 2))


def _moments_to_posterior(h_btmc: jax.Array) -> DiagonalGaussian:
    """``DiagonalGaussianDistribution``: channel halves (mean, logvar clamped to [-30, 20])."""
    h = _to_channel_first(h_btmc)
    half = h.shape[1] // 2
    return DiagonalGaussian(h[:, :half], jnp.clip(h[:, half:], *LOGVAR_RANGE))


class LTX2AudioVAE(nn.Module):
    """LTX-2 audio VAE (= diffusers ``AutoencoderKLLTX2Audio``), parameters named as in diffusers.

    ``encode(mel [B, C, T, M]) -> DiagonalGaussian`` (``[B, latent, T', M']``);
    ``decode(z [B, latent, L, M']) -> mel`` of :func:`decoded_shape`; ``__call__`` =
    decode(encode(mel).mode()). The checkpoint's ``latents_mean`` / ``latents_std`` buffers
    (``[base_channels]``) are top-level entries of ``params``
    (:func:`normalize_audio_latents` reads them). Prefer the jitted :func:`encode` /
    :func:`decode`.
    """

    config: LTX2AudioVAEConfig
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    mesh: jax.sharding.Mesh | None = None

    def setup(self):
        cfg = self.config
        kw = {"dtype": self.dtype, "param_dtype": self.param_dtype}
        self.encoder = Encoder(cfg, **kw)
        self.decoder = Decoder(cfg, **kw)
        shape = (cfg.base_channels,)
        self.latents_mean = self.param("latents_mean", _CHANNEL_ZEROS, shape, self.param_dtype)
        self.latents_std = self.param("latents_std", _CHANNEL_ONES, shape, self.param_dtype)

    def encode(self, mel_bctm: jax.Array) -> DiagonalGaussian:
        latent_shape(self.config, mel_bctm.shape)
        x = _to_channel_last(mel_bctm).astype(self.dtype)
        return _moments_to_posterior(self.encoder(x))

    def decode(self, z_bclm: jax.Array) -> jax.Array:
        check_latents(self.config, z_bclm.shape)
        return _to_channel_first(self.decoder(_to_channel_last(z_bclm).astype(self.dtype)))

    def __call__(self, mel_bctm: jax.Array) -> jax.Array:
        return self.decode(self.encode(mel_bctm).mode())


@functools.lru_cache(maxsize=32)
def _jitted(module: LTX2AudioVAE, method: str):
    def run(params, *args):
        return module.apply({"params": params}, *args, method=method)

    return jax.jit(run)


def encode(module: LTX2AudioVAE, params, mel_bctm: jax.Array) -> DiagonalGaussian:
    """Encode a log-mel spectrogram ``[B, in_channels, T, mel_bins]`` -> posterior
    ``[B, latent, T', M']`` (``.mode()`` the mean, ``.sample(rng)`` the sampled path), jitted."""
    latent_shape(module.config, mel_bctm.shape)
    return _jitted(module, "encode")(params, jnp.asarray(mel_bctm))


def decode(module: LTX2AudioVAE, params, z_bclm: jax.Array) -> jax.Array:
    """Decode *denormalised, unpacked* latents ``[B, latent, L, M']`` -> mel
    ``[B, output_channels, max(4 L - 3, 1), mel_bins]`` (the vocoder's input), jitted."""
    check_latents(module.config, z_bclm.shape)
    return _jitted(module, "decode")(params, jnp.asarray(z_bclm))


# ----------------------------------------------------------------------------------------------
# Weights
# ----------------------------------------------------------------------------------------------


def _dummy_inputs(config: LTX2AudioVAEConfig):
    """(a spectrogram every encoder level accepts, one latent frame): what ``init`` traces."""
    side = 2 ** (config.num_levels + 1)
    mel = jax.ShapeDtypeStruct((1, config.in_channels, side, side), jnp.float32)
    z = jax.ShapeDtypeStruct((1, config.latent_channels, 1, 1), jnp.float32)
    return mel, z


def _create_parameters(module: LTX2AudioVAE, mel, z):
    """``init``'s method: the encoder and the decoder."""
    module.encode(mel)
    return module.decode(z)


def _create_encoder_parameters(module: LTX2AudioVAE, mel, z):
    """``init``'s method for an encoder-only load: the encoder and the latent statistics."""
    return module.encode(mel)


_LIST_MODULE = re.compile(r"^(down|up|block|attn)_(\d+)$")


def _diffusers_module(name: str, parent: str | None) -> str:
    """Flax module name -> diffusers attribute path; ``mid``'s ``block_1`` / ``attn_1`` are
    attribute names, every other ``block_3`` is the list entry ``block.3``."""
    return name if parent == "mid" else _LIST_MODULE.sub(r"\1.\2", name)


def _source_entry(path: tuple[str, ...], ndim: int) -> tuple[str, weights.Transform]:
    """Flax param path -> (diffusers key, transform)."""
    *modules, leaf = path
    parents = [None, *modules]  # each module's parent (one longer: zip stops at modules)
    key = ".".join(_diffusers_module(m, p) for m, p in zip(modules, parents, strict=False))
    prefix = f"{key}." if key else ""
    if leaf == "kernel" and ndim == 4:
        return f"{prefix}weight", weights.conv2d
    if leaf == "scale":  # GroupNorm
        return f"{prefix}weight", weights.identity
    if leaf in ("bias", "latents_mean", "latents_std"):
        return f"{prefix}{leaf}", weights.identity
    raise ValueError(f"no diffusers name for parameter {'/'.join(path)}")


_FILL = {"bias": 0.0, "scale": 1.0, "latents_mean": 0.0, "latents_std": 1.0}


def _fill(name: str, shape: tuple[int, ...], dtype: Dtype) -> jax.Array:
    """init_ltx2_audio_vae's value of every parameter but the kernels."""
    return jnp.full(shape, _FILL[name], dtype)


KIND = weights.VAEKind(
    LTX2AudioVAE,
    LTX2AudioVAEConfig,
    _dummy_inputs,
    lambda config, boxed: weights.weight_map_by_path(boxed, _source_entry),
    trace_method=_create_parameters,
    encoder_method=_create_encoder_parameters,
    fill=_fill,
)
abstract_params = KIND.abstract_params
# AutoencoderKLLTX2Audio's register_buffer entries (persistent: in the checkpoint).
BUFFERS = ("latents_mean", "latents_std")


def count_params(config: LTX2AudioVAEConfig, *, include_buffers: bool = False) -> int:
    """Parameters from eval_shape (nothing allocated); by default without the two latent
    statistics buffers, i.e. diffusers' ``sum(p.numel() for p in model.parameters())``."""
    total = KIND.count_params(config)
    return total if include_buffers else total - len(BUFFERS) * config.base_channels


def weight_map(config: LTX2AudioVAEConfig) -> dict:
    """{flax param path: (diffusers AutoencoderKLLTX2Audio key, transform)}."""
    return KIND.weight_map(config, abstract_params(LTX2AudioVAE(config)))


def load_ltx2_audio_vae(directory: str | os.PathLike, *, dtype: Dtype = jnp.float32, **options):
    """:meth:`jaxcore.weights.VAEKind.load` of a diffusers ``AutoencoderKLLTX2Audio`` directory
    (config.json + safetensors, buffers included): ``(module, params)``; ``encoder_only`` reads
    the encoder and the latent statistics alone."""
    return KIND.load(directory, dtype=dtype, param_dtype=dtype, **options)


def init_ltx2_audio_vae(
    config: LTX2AudioVAEConfig, rng: jax.Array, *, dtype: Dtype = jnp.float32, **kw
):
    """:meth:`jaxcore.weights.VAEKind.init`: kernels LeCun normal, the rest :data:`_FILL`."""
    return KIND.init(config, rng, dtype=dtype, param_dtype=dtype, **kw)


def mel_frames_per_second(config: LTX2AudioVAEConfig) -> float:
    """Mel frames per second of audio (``sample_rate / mel_hop_length``, 100 for LTX-2)."""
    return config.sample_rate / config.mel_hop_length
