"""LTX-2 vocoders in Flax linen, numerically equal to diffusers' ``LTX2Vocoder`` and
``LTX2VocoderWithBWE`` (mel spectrogram -> stereo waveform).

Reference: ``diffusers/pipelines/ltx2/vocoder.py`` (diffusers 0.42). Both are HiFi-GAN
generators: ``conv_in`` (k 7), per upsampling stage a ``ConvTranspose1d`` (stride
``upsample_factors[i]``, width halved) followed by the *mean* of ``len(resnet_kernel_sizes)``
multi-receptive-field residual blocks, then ``act_out``, ``conv_out`` (k 7) and the final
activation. The config picks the variant:

- LTX-2.0 (``LTX2Vocoder`` defaults, the released 2.0 config): ``leaky_relu`` (slope
  ``leaky_relu_negative_slope`` before every upsampler and inside the blocks, torch's default
  0.01 in ``act_out``), no anti-aliasing, ``tanh`` out; 24 kHz from 100 mel frames/s (x240).
- LTX-2.3 (``LTX2VocoderWithBWE`` defaults): ``snakebeta`` activations (``x + sin^2(a x) / b``
  with ``a = exp(alpha)``, ``b = exp(beta)``, per channel) wrapped in BigVGAN's anti-aliased
  activation (Kaiser-sinc x2 upsample, act, Kaiser-sinc /2 downsample, replicate padding), no
  activation before the upsamplers (diffusers applies none there), no final activation or
  ``conv_out`` bias; a 16 kHz stage-1 waveform whose causal log-mel (``MelSTFT``) drives a
  second generator (bandwidth extension, ``bwe_*``) that adds its output to a Hann-sinc
  x3 resampling of the stage-1 waveform, clamped to [-1, 1] at 48 kHz.
- ``snake`` (``alpha`` alone) and ``clamp`` are supported as diffusers builds them: ``snake``
  blocks use one parameter, ``act_out`` is still a SnakeBeta with ``beta``.

Refused (naming the key): ``leaky_relu`` with ``antialias=True``: diffusers' ``ResBlock``
then wraps the *previous* activation again for every ``acts2`` entry (nested anti-aliasing,
depth 2, 3, ...), an accident no released config uses.

The anti-alias filters (``*.filter``) and the STFT / mel bases are checkpoint buffers
(persistent in diffusers), so they are loaded, not recomputed: a bf16 checkpoint's rounded
filters are used exactly as diffusers uses them. The BWE resampler's Hann filter is not
persistent; it is computed here (float64, rounded to float32).

Layout: the input is the audio VAE's mel ``[B, C, T, M]`` (``time_last=False``, the pipeline's
call ``vocoder(audio_vae.decode(z))``), flattened to ``C * M`` channels (``c * M + m``); the
output is ``[B, out_channels, samples]``. Inside, activations are channel-last ``[B, T, C]``.

Parity reached (tests/jaxcore/test_ltx2_vocoder.py, fp32 on CPU, every parameter and
persistent buffer perturbed): waveform <= 5e-7 relative to the reference's max |value|
(leaky ReLU, anti-aliased SnakeBeta, plain snake + clamp, and the two-stage BWE vocoder; test
bound 1e-5). Parameter counts equal diffusers' for the LTX-2.0 and LTX-2.3 configs.

Public API: :class:`LTX2VocoderConfig`, :class:`LTX2VocoderWithBWEConfig`,
:class:`LTX2Vocoder`, :class:`LTX2VocoderWithBWE`, :func:`vocode`, :func:`output_samples`,
:func:`kaiser_sinc_filter`, :func:`hann_sinc_filter`, :func:`weight_map`, :func:`count_params`,
:func:`load_ltx2_vocoder` (either class, by ``_class_name``), :func:`init_ltx2_vocoder`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
import types
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from jaxcore import weights
from jaxcore.config import config_json_kwargs

Dtype = Any

ACT_FNS = ("snakebeta", "snake", "leaky_relu")
FINAL_ACT_FNS = ("tanh", "clamp", None)
# SnakeBeta's eps in 1 / (amplitude + eps).
SNAKE_EPS = 1e-9
# nn.LeakyReLU() default slope: diffusers' act_out for leaky_relu ignores the config's slope.
ACT_OUT_SLOPE = 0.01
# MelSTFT's floor before the log.
LOG_MEL_FLOOR = 1e-5
# UpSample1d(window_type="hann"): torchaudio-style sinc resampler constants.
HANN_ROLLOFF = 0.99
HANN_LOWPASS_WIDTH = 6


# ----------------------------------------------------------------------------------------------
# Configs
# ----------------------------------------------------------------------------------------------


class LTX2VocoderConfigError(ValueError):
    """A config.json / YAML section the vocoder configs cannot represent; names the key."""


@dataclasses.dataclass(frozen=True)
class LTX2VocoderConfig:
    """``LTX2Vocoder``'s arguments, diffusers' names and defaults (= the released LTX-2.0
    vocoder, diffusers ``scripts/convert_ltx2_to_diffusers.py`` ``get_ltx2_vocoder_config``)."""

    in_channels: int = 128
    hidden_channels: int = 1024
    out_channels: int = 2
    upsample_kernel_sizes: tuple[int, ...] = (16, 15, 8, 4, 4)
    upsample_factors: tuple[int, ...] = (6, 5, 2, 2, 2)
    resnet_kernel_sizes: tuple[int, ...] = (3, 7, 11)
    resnet_dilations: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    act_fn: str = "leaky_relu"
    leaky_relu_negative_slope: float = 0.1
    antialias: bool = False
    antialias_ratio: int = 2
    antialias_kernel_size: int = 12
    final_act_fn: str | None = "tanh"
    final_bias: bool = True
    output_sampling_rate: int = 24000

    def __post_init__(self):
        object.__setattr__(self, "upsample_kernel_sizes", tuple(self.upsample_kernel_sizes))
        object.__setattr__(self, "upsample_factors", tuple(self.upsample_factors))
        object.__setattr__(self, "resnet_kernel_sizes", tuple(self.resnet_kernel_sizes))
        object.__setattr__(self, "resnet_dilations", tuple(tuple(d) for d in self.resnet_dilations))
        _check_vocoder(self, prefix="")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LTX2VocoderConfig:
        return cls(**config_json_kwargs(cls, d, LTX2VocoderConfigError))

    def to_dict(self) -> dict[str, Any]:
        return _json_dict(self)

    @property
    def upsample_factor(self) -> int:
        """Waveform samples per mel frame (240 for LTX-2.0: 100 frames/s -> 24 kHz)."""
        return math.prod(self.upsample_factors)

    def stage_widths(self) -> tuple[int, ...]:
        """Channels after each upsampler: ``hidden_channels // 2^(i + 1)``."""
        return tuple(
            self.hidden_channels // 2 ** (i + 1) for i in range(len(self.upsample_factors))
        )


def _check_vocoder(cfg: LTX2VocoderConfig | types.SimpleNamespace, prefix: str) -> None:
    """Refuse what diffusers refuses (or builds by accident), naming the key."""
    if len(cfg.upsample_kernel_sizes) != len(cfg.upsample_factors):
        raise LTX2VocoderConfigError(
            f"{prefix}upsample_kernel_sizes ({len(cfg.upsample_kernel_sizes)}) and "
            f"{prefix}upsample_factors ({len(cfg.upsample_factors)}) must have the same length"
        )
    if len(cfg.resnet_kernel_sizes) != len(cfg.resnet_dilations):
        raise LTX2VocoderConfigError(
            f"{prefix}resnet_kernel_sizes ({len(cfg.resnet_kernel_sizes)}) and "
            f"{prefix}resnet_dilations ({len(cfg.resnet_dilations)}) must have the same length"
        )
    if cfg.act_fn not in ACT_FNS:
        raise LTX2VocoderConfigError(f"{prefix}act_fn={cfg.act_fn!r} is not one of {ACT_FNS}")
    if cfg.final_act_fn not in FINAL_ACT_FNS:
        raise LTX2VocoderConfigError(
            f"{prefix}final_act_fn={cfg.final_act_fn!r} is not one of {FINAL_ACT_FNS}"
        )
    if cfg.act_fn == "leaky_relu" and cfg.antialias:
        raise LTX2VocoderConfigError(
            f"{prefix}act_fn='leaky_relu' with {prefix}antialias=True is not supported: "
            "diffusers' ResBlock nests its acts2 anti-aliasing wrappers (depth 2, 3, ...), "
            "which no released vocoder uses"
        )


def _json_dict(cfg) -> dict[str, Any]:
    def plain(v):
        return [plain(x) for x in v] if isinstance(v, tuple) else v

    return {k: plain(v) for k, v in dataclasses.asdict(cfg).items()}


# LTX2VocoderWithBWE's own keys (beyond the stage-1 vocoder's, which it takes unprefixed).
_BWE_PREFIX = "bwe_"


@dataclasses.dataclass(frozen=True)
class LTX2VocoderWithBWEConfig:
    """``LTX2VocoderWithBWE``'s arguments, diffusers' names and defaults (the LTX-2.3
    vocoder): the stage-1 vocoder's keys, the same keys prefixed ``bwe_`` for the bandwidth
    extender, the MelSTFT sizes and the two sampling rates."""

    in_channels: int = 128
    hidden_channels: int = 1536
    out_channels: int = 2
    upsample_kernel_sizes: tuple[int, ...] = (11, 4, 4, 4, 4, 4)
    upsample_factors: tuple[int, ...] = (5, 2, 2, 2, 2, 2)
    resnet_kernel_sizes: tuple[int, ...] = (3, 7, 11)
    resnet_dilations: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    act_fn: str = "snakebeta"
    leaky_relu_negative_slope: float = 0.1
    antialias: bool = True
    antialias_ratio: int = 2
    antialias_kernel_size: int = 12
    final_act_fn: str | None = None
    final_bias: bool = False
    bwe_in_channels: int = 128
    bwe_hidden_channels: int = 512
    bwe_out_channels: int = 2
    bwe_upsample_kernel_sizes: tuple[int, ...] = (12, 11, 4, 4, 4)
    bwe_upsample_factors: tuple[int, ...] = (6, 5, 2, 2, 2)
    bwe_resnet_kernel_sizes: tuple[int, ...] = (3, 7, 11)
    bwe_resnet_dilations: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    bwe_act_fn: str = "snakebeta"
    bwe_leaky_relu_negative_slope: float = 0.1
    bwe_antialias: bool = True
    bwe_antialias_ratio: int = 2
    bwe_antialias_kernel_size: int = 12
    bwe_final_act_fn: str | None = None
    bwe_final_bias: bool = False
    filter_length: int = 512
    hop_length: int = 80
    window_length: int = 512
    num_mel_channels: int = 64
    input_sampling_rate: int = 16000
    output_sampling_rate: int = 48000

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, list):
                nested = tuple(tuple(v) if isinstance(v, list) else v for v in value)
                object.__setattr__(self, f.name, nested)
        for prefix in ("", _BWE_PREFIX):  # each stage, its keys named as written here
            _check_vocoder(self._stage_view(prefix), prefix=prefix)
        if self.filter_length != self.window_length:
            raise LTX2VocoderConfigError(
                f"filter_length={self.filter_length} must equal window_length="
                f"{self.window_length}: MelSTFT then yields one frame per hop_length samples, "
                "the count the extender's upsampling assumes"
            )
        if self.output_sampling_rate % self.input_sampling_rate:
            raise LTX2VocoderConfigError(
                f"output_sampling_rate={self.output_sampling_rate} must be a multiple of "
                f"input_sampling_rate={self.input_sampling_rate} (the resampler's ratio)"
            )
        if self.bwe.upsample_factor != self.resample_ratio * self.hop_length:
            raise LTX2VocoderConfigError(
                f"prod(bwe_upsample_factors)={self.bwe.upsample_factor} must equal "
                f"(output_sampling_rate // input_sampling_rate) * hop_length = "
                f"{self.resample_ratio * self.hop_length}: the extender's output is added to "
                "the resampled stage-1 waveform sample by sample"
            )

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LTX2VocoderWithBWEConfig:
        return cls(**config_json_kwargs(cls, d, LTX2VocoderConfigError))

    def to_dict(self) -> dict[str, Any]:
        return _json_dict(self)

    def _stage_view(self, prefix: str) -> types.SimpleNamespace:
        """One stage's LTX2VocoderConfig fields, read from the keys starting ``prefix``."""
        names = [f.name for f in dataclasses.fields(LTX2VocoderConfig)]
        return types.SimpleNamespace(
            **{n: getattr(self, prefix + n) for n in names if n != "output_sampling_rate"}
        )

    def _stage(self, prefix: str, sampling_rate: int) -> LTX2VocoderConfig:
        kw = vars(self._stage_view(prefix))
        return LTX2VocoderConfig(**kw, output_sampling_rate=sampling_rate)

    @property
    def vocoder(self) -> LTX2VocoderConfig:
        """The stage-1 generator (diffusers' ``self.vocoder``), at ``input_sampling_rate``."""
        return self._stage("", self.input_sampling_rate)

    @property
    def bwe(self) -> LTX2VocoderConfig:
        """The bandwidth extender (``self.bwe_generator``), at ``output_sampling_rate``."""
        return self._stage(_BWE_PREFIX, self.output_sampling_rate)

    @property
    def resample_ratio(self) -> int:
        return self.output_sampling_rate // self.input_sampling_rate

    @property
    def num_freqs(self) -> int:
        return self.filter_length // 2 + 1


# ----------------------------------------------------------------------------------------------
# Fixed filters (the values diffusers computes; checkpoints hold the anti-alias ones)
# ----------------------------------------------------------------------------------------------


def kaiser_sinc_filter(cutoff: float, half_width: float, kernel_size: int) -> np.ndarray:
    """diffusers ``kaiser_sinc_filter1d`` (BigVGAN): a Kaiser-windowed sinc low-pass with unit
    sum; the window's beta from the Kaiser design formula for the transition width."""
    delta_f = 4 * half_width
    half_size = kernel_size // 2
    amplitude = 2.285 * (half_size - 1) * math.pi * delta_f + 7.95
    if amplitude > 50.0:
        beta = 0.1102 * (amplitude - 8.7)
    elif amplitude >= 21.0:
        beta = 0.5842 * (amplitude - 21) ** 0.4 + 0.07886 * (amplitude - 21.0)
    else:
        beta = 0.0
    window = np.kaiser(kernel_size, beta)
    if kernel_size % 2 == 0:
        time = np.arange(-half_size, half_size) + 0.5
    else:
        time = np.arange(kernel_size) - half_size
    if cutoff == 0.0:
        return np.zeros(kernel_size, np.float32)
    taps = 2 * cutoff * window * np.sinc(2 * cutoff * time)
    return (taps / taps.sum()).astype(np.float32)


@functools.lru_cache(maxsize=64)
def antialias_filter(ratio: int, kernel_size: int) -> np.ndarray:
    """The filter of UpSample1d / DownSample1d(ratio, kernel_size) (kaiser, the same for both);
    cached (every anti-aliased activation asks), so read-only."""
    taps = kaiser_sinc_filter(0.5 / ratio, 0.6 / ratio, kernel_size)
    taps.setflags(write=False)
    return taps


def hann_sinc_filter(ratio: int) -> np.ndarray:
    """``UpSample1d(window_type="hann")``'s filter (LTX2VocoderWithBWE's resampler, not in the
    checkpoint): a sinc at ``rolloff / ratio`` under a squared-cosine window of half-width 6."""
    width = math.ceil(HANN_LOWPASS_WIDTH / HANN_ROLLOFF)
    kernel_size = 2 * width * ratio + 1
    time = (np.arange(kernel_size) / ratio - width) * HANN_ROLLOFF
    clamped = np.clip(time, -HANN_LOWPASS_WIDTH, HANN_LOWPASS_WIDTH)
    window = np.cos(clamped * math.pi / HANN_LOWPASS_WIDTH / 2) ** 2
    return (np.sinc(time) * window * HANN_ROLLOFF / ratio).astype(np.float32)


# ----------------------------------------------------------------------------------------------
# Layers (channel-last [B, T, C])
# ----------------------------------------------------------------------------------------------


_KERNEL_INIT = nn.with_logical_partitioning(
    nn.initializers.lecun_normal(), (None, "conv_in", "conv_out")
)
_BIAS_INIT = nn.with_logical_partitioning(nn.initializers.zeros_init(), ("conv_out",))
# SnakeBeta(logscale=True) starts alpha = beta = 0 (exp: 1).
_SNAKE_INIT = nn.with_logical_partitioning(nn.initializers.zeros_init(), ("norm",))
# MelSTFT's bases start at zero in diffusers too (the checkpoint holds them).
_BUFFER_ZEROS = nn.with_logical_partitioning(nn.initializers.zeros_init(), (None, None))
_BUFFER_ZEROS_3D = nn.with_logical_partitioning(nn.initializers.zeros_init(), (None, None, None))


def _constant_init(value: np.ndarray):
    def init(key, shape, dtype=jnp.float32):
        del key
        return jnp.asarray(value, dtype).reshape(shape)

    return nn.with_logical_partitioning(init, (None,))


def _conv1d(x, kernel_kio, *, stride=1, dilation=1, padding=(0, 0), lhs_dilation=1, groups=1):
    return jax.lax.conv_general_dilated(
        x,
        kernel_kio,
        window_strides=(stride,),
        padding=(padding,),
        lhs_dilation=(lhs_dilation,),
        rhs_dilation=(dilation,),
        dimension_numbers=("NWC", "WIO", "NWC"),
        feature_group_count=groups,
    )


class Conv1d(nn.Module):
    """torch ``nn.Conv1d(k, dilation, padding)``; ``padding=None`` is torch's ``"same"``
    (``d (k - 1)`` split floor-left / rest-right)."""

    features: int
    kernel_size: int
    dilation: int = 1
    padding: int | None = None
    use_bias: bool = True
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        k = self.kernel_size
        kernel = self.param(
            "kernel", _KERNEL_INIT, (k, x.shape[-1], self.features), self.param_dtype
        )
        if self.padding is None:
            total = self.dilation * (k - 1)
            pads = (total // 2, total - total // 2)
        else:
            pads = (self.padding, self.padding)
        y = _conv1d(
            x.astype(self.dtype), kernel.astype(self.dtype), dilation=self.dilation, padding=pads
        )
        if self.use_bias:
            y = y + self.param("bias", _BIAS_INIT, (self.features,), self.param_dtype)
        return y


class ConvTranspose1d(nn.Module):
    """torch ``nn.ConvTranspose1d(k, stride, padding=(k - stride) // 2)``: output length
    ``(T - 1) stride - 2 padding + k``. ``kernel`` is ``[k, in, out]`` (torch ``[in, out, k]``),
    flipped here to run as a dilated-input convolution."""

    features: int
    kernel_size: int
    stride: int
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        k, s = self.kernel_size, self.stride
        kernel = self.param(
            "kernel", _KERNEL_INIT, (k, x.shape[-1], self.features), self.param_dtype
        )
        bias = self.param("bias", _BIAS_INIT, (self.features,), self.param_dtype)
        edge = k - 1 - (k - s) // 2
        y = _conv1d(
            x.astype(self.dtype),
            jnp.flip(kernel, 0).astype(self.dtype),
            padding=(edge, edge),
            lhs_dilation=s,
        )
        return y + bias.astype(self.dtype)


def snake(x: jax.Array, alpha: jax.Array, amplitude: jax.Array) -> jax.Array:
    """``x + sin^2(alpha x) / (amplitude + 1e-9)`` (SnakeBeta, log-scale parameters already
    exponentiated), per channel on the last axis."""
    return x + (1.0 / (amplitude + SNAKE_EPS)) * jnp.square(jnp.sin(x * alpha))


class SnakeBeta(nn.Module):
    """diffusers ``SnakeBeta(logscale=True)``: ``alpha`` (and ``beta`` when ``use_beta``),
    exponentiated; ``amplitude`` is ``beta`` or, for plain snake, ``alpha``."""

    use_beta: bool = True
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = x.shape[-1]
        alpha = jnp.exp(self.param("alpha", _SNAKE_INIT, (c,), self.param_dtype)).astype(x.dtype)
        if not self.use_beta:
            return snake(x, alpha, alpha)
        beta = jnp.exp(self.param("beta", _SNAKE_INIT, (c,), self.param_dtype)).astype(x.dtype)
        return snake(x, alpha, beta)


def _depthwise_filter(filter_k: jax.Array, channels: int, dtype) -> jax.Array:
    """One filter for every channel, as ``filter.expand(C, -1, -1)`` with ``groups=C``."""
    return jnp.broadcast_to(filter_k.astype(dtype)[:, None, None], (filter_k.shape[0], 1, channels))


class UpSample1d(nn.Module):
    """diffusers ``UpSample1d`` (kaiser): replicate pad ``K // r - 1``, depthwise transposed
    conv by ``r`` with the ``filter`` buffer, times ``r``, cropped to ``r T`` samples."""

    ratio: int
    kernel_size: int
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        r, k = self.ratio, self.kernel_size
        taps = self.param("filter", _constant_init(antialias_filter(r, k)), (k,), self.param_dtype)
        pad = k // r - 1
        crop_left = pad * r + (k - r) // 2
        crop_right = pad * r + (k - r + 1) // 2
        return upsample_by_filter(x, taps, r, pad, crop_left, crop_right)


def upsample_by_filter(x, taps, ratio, pad, crop_left, crop_right) -> jax.Array:
    """UpSample1d's forward for either window: replicate pad, depthwise ``conv_transpose1d``
    (stride ``ratio``) times ``ratio``, then ``[crop_left : -crop_right]``."""
    k = taps.shape[0]
    x = jnp.pad(x, ((0, 0), (pad, pad), (0, 0)), mode="edge")
    kernel = jnp.flip(_depthwise_filter(taps, x.shape[-1], x.dtype), 0)
    y = ratio * _conv1d(x, kernel, padding=(k - 1, k - 1), lhs_dilation=ratio, groups=x.shape[-1])
    return y[:, crop_left : y.shape[1] - crop_right]


class DownSample1d(nn.Module):
    """diffusers ``DownSample1d``: replicate pad (``K // 2 + K % 2 - 1``, ``K // 2``), then a
    depthwise stride-``r`` conv with the ``filter`` buffer."""

    ratio: int
    kernel_size: int
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        r, k = self.ratio, self.kernel_size
        taps = self.param("filter", _constant_init(antialias_filter(r, k)), (k,), self.param_dtype)
        x = jnp.pad(x, ((0, 0), (k // 2 + k % 2 - 1, k // 2), (0, 0)), mode="edge")
        kernel = _depthwise_filter(taps, x.shape[-1], x.dtype)
        return _conv1d(x, kernel, stride=r, groups=x.shape[-1])


class AntiAliasSnake(nn.Module):
    """diffusers ``AntiAliasAct1d(SnakeBeta)``: ``upsample``, ``act``, ``downsample``."""

    use_beta: bool
    ratio: int
    kernel_size: int
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        p = self.param_dtype
        x = UpSample1d(self.ratio, self.kernel_size, p, name="upsample")(x)
        x = SnakeBeta(self.use_beta, p, name="act")(x)
        return DownSample1d(self.ratio, self.kernel_size, p, name="downsample")(x)


def block_activation(cfg: LTX2VocoderConfig, name: str, param_dtype) -> nn.Module | None:
    """A ResBlock activation module as diffusers builds it (None: a leaky ReLU, no params)."""
    if cfg.act_fn == "leaky_relu":
        return None
    use_beta = cfg.act_fn == "snakebeta"
    if cfg.antialias:
        return AntiAliasSnake(
            use_beta, cfg.antialias_ratio, cfg.antialias_kernel_size, param_dtype, name=name
        )
    return SnakeBeta(use_beta, param_dtype, name=name)


class ResBlock(nn.Module):
    """diffusers ``ResBlock``: per dilation ``d``, ``x += conv2(act2(conv1_d(act1(x))))``
    (``same``-padded convs, the second undilated)."""

    config: LTX2VocoderConfig
    kernel_size: int
    dilations: tuple[int, ...]
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kw = {"dtype": self.dtype, "param_dtype": self.param_dtype}
        c, k = x.shape[-1], self.kernel_size
        for j, d in enumerate(self.dilations):
            xt = self._act(f"acts1_{j}", x)
            xt = Conv1d(c, k, d, name=f"convs1_{j}", **kw)(xt)
            xt = self._act(f"acts2_{j}", xt)
            xt = Conv1d(c, k, 1, name=f"convs2_{j}", **kw)(xt)
            x = x + xt
        return x

    def _act(self, name: str, x: jax.Array) -> jax.Array:
        act = block_activation(self.config, name, self.param_dtype)
        if act is None:
            return jax.nn.leaky_relu(x, self.config.leaky_relu_negative_slope)
        return act(x)


def mel_to_frames(mel_bctm: jax.Array) -> jax.Array:
    """``[B, C, T, M] -> [B, T, C * M]`` (diffusers' ``transpose(2, 3).flatten(1, 2)``)."""
    b, c, t, m = mel_bctm.shape
    return jnp.transpose(mel_bctm, (0, 2, 1, 3)).reshape(b, t, c * m)


class Generator(nn.Module):
    """diffusers ``LTX2Vocoder.forward`` on ``[B, T, in_channels]`` -> ``[B, samples, out]``."""

    config: LTX2VocoderConfig
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        kw = {"dtype": self.dtype, "param_dtype": self.param_dtype}
        blocks = len(cfg.resnet_kernel_sizes)
        x = Conv1d(cfg.hidden_channels, 7, padding=3, name="conv_in", **kw)(x.astype(self.dtype))
        stages = zip(
            cfg.upsample_factors, cfg.upsample_kernel_sizes, cfg.stage_widths(), strict=True
        )
        for i, (stride, kernel, width) in enumerate(stages):
            if cfg.act_fn == "leaky_relu":  # the snake variants have no activation here
                x = jax.nn.leaky_relu(x, cfg.leaky_relu_negative_slope)
            x = ConvTranspose1d(width, kernel, stride, name=f"upsamplers_{i}", **kw)(x)
            outs = [
                ResBlock(cfg, k, d, name=f"resnets_{i * blocks + j}", **kw)(x)
                for j, (k, d) in enumerate(
                    zip(cfg.resnet_kernel_sizes, cfg.resnet_dilations, strict=True)
                )
            ]
            x = jnp.mean(jnp.stack(outs), axis=0)
        x = self._act_out(x)
        x = Conv1d(cfg.out_channels, 7, padding=3, use_bias=cfg.final_bias, name="conv_out", **kw)(
            x
        )
        if cfg.final_act_fn == "tanh":
            return jnp.tanh(x)
        if cfg.final_act_fn == "clamp":
            return jnp.clip(x, -1.0, 1.0)
        return x

    def _act_out(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        if cfg.act_fn == "leaky_relu":
            return jax.nn.leaky_relu(x, ACT_OUT_SLOPE)
        # Both snake variants: always an anti-aliased SnakeBeta with beta.
        act = AntiAliasSnake(
            True, cfg.antialias_ratio, cfg.antialias_kernel_size, self.param_dtype, name="act_out"
        )
        return act(x)


class LTX2Vocoder(nn.Module):
    """diffusers ``LTX2Vocoder``: mel ``[B, C, T, M]`` (``C * M = in_channels``) -> waveform
    ``[B, out_channels, T * prod(upsample_factors)]``; parameters named as diffusers'."""

    config: LTX2VocoderConfig
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    mesh: jax.sharding.Mesh | None = None

    @nn.compact
    def __call__(self, mel_bctm: jax.Array) -> jax.Array:
        check_mel(self.config.in_channels, mel_bctm.shape)
        kw = {"dtype": self.dtype, "param_dtype": self.param_dtype}
        wave = Generator(self.config, name="generator", **kw)(mel_to_frames(mel_bctm))
        return jnp.transpose(wave, (0, 2, 1))


class MelSTFT(nn.Module):
    """diffusers ``MelSTFT``: causal STFT (left zero pad ``window - hop``, a stride-``hop``
    conv with ``stft_fn.forward_basis``), magnitude, ``mel_basis`` projection,
    ``log(max(mel, 1e-5))``. ``[N, samples, 1] -> [N, frames, num_mel_channels]``."""

    config: LTX2VocoderWithBWEConfig
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, wave: jax.Array) -> jax.Array:
        cfg = self.config
        bins = 2 * cfg.num_freqs
        basis = self.param(
            "forward_basis", _BUFFER_ZEROS_3D, (cfg.filter_length, 1, bins), self.param_dtype
        )
        mel_basis = self.param(
            "mel_basis", _BUFFER_ZEROS, (cfg.num_mel_channels, cfg.num_freqs), self.param_dtype
        )
        wave = jnp.pad(wave, ((0, 0), (max(0, cfg.window_length - cfg.hop_length), 0), (0, 0)))
        spec = _conv1d(wave, basis.astype(wave.dtype), stride=cfg.hop_length)
        real, imag = spec[..., : cfg.num_freqs], spec[..., cfg.num_freqs :]
        magnitude = jnp.sqrt(jnp.square(real) + jnp.square(imag))
        mel = jnp.einsum("ntf,mf->ntm", magnitude, mel_basis.astype(wave.dtype))
        return jnp.log(jnp.maximum(mel, LOG_MEL_FLOOR))


class LTX2VocoderWithBWE(nn.Module):
    """diffusers ``LTX2VocoderWithBWE`` (LTX-2.3): stage-1 ``vocoder`` at
    ``input_sampling_rate``, zero-padded to a multiple of ``hop_length``; its per-channel
    log-mel (``mel_stft``) into ``bwe_generator``; plus the Hann-sinc resampled stage-1 wave;
    clamped to [-1, 1] and cut to ``samples * output / input`` rate."""

    config: LTX2VocoderWithBWEConfig
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    mesh: jax.sharding.Mesh | None = None

    @nn.compact
    def __call__(self, mel_bctm: jax.Array) -> jax.Array:
        cfg = self.config
        check_mel(cfg.in_channels, mel_bctm.shape)
        kw = {"dtype": self.dtype, "param_dtype": self.param_dtype}
        wave = Generator(cfg.vocoder, name="vocoder", **kw)(mel_to_frames(mel_bctm))
        b, samples, channels = wave.shape
        wave = jnp.pad(wave, ((0, 0), (0, -samples % cfg.hop_length), (0, 0)))
        per_channel = jnp.transpose(wave, (0, 2, 1)).reshape(b * channels, -1, 1)
        log_mel = MelSTFT(cfg, self.param_dtype, name="mel_stft")(per_channel)
        log_mel = log_mel.reshape(b, channels, *log_mel.shape[1:])  # [B, C, frames, mel]
        residual = Generator(cfg.bwe, name="bwe_generator", **kw)(mel_to_frames(log_mel))
        out = jnp.clip(residual + _hann_resample(wave, cfg.resample_ratio), -1.0, 1.0)
        out = out[:, : samples * cfg.output_sampling_rate // cfg.input_sampling_rate]
        return jnp.transpose(out, (0, 2, 1))


def _hann_resample(wave: jax.Array, ratio: int) -> jax.Array:
    """``UpSample1d(ratio, window_type="hann")`` (the BWE skip path)."""
    taps = jnp.asarray(hann_sinc_filter(ratio))
    width = math.ceil(HANN_LOWPASS_WIDTH / HANN_ROLLOFF)
    crop_left = 2 * width * ratio
    crop_right = taps.shape[0] - ratio
    return upsample_by_filter(wave, taps, ratio, width, crop_left, crop_right)


def check_mel(in_channels: int, shape) -> None:
    """The vocoder's input must be ``[B, C, T, M]`` with ``C * M == in_channels``."""
    if len(shape) != 4 or shape[1] * shape[3] != in_channels or shape[2] < 1:
        raise ValueError(
            f"vocoder input must be a mel [B, C, T, M] with C * M = in_channels = {in_channels}"
            f" and T >= 1, got shape {tuple(shape)}"
        )


def output_samples(config: LTX2VocoderConfig | LTX2VocoderWithBWEConfig, frames: int) -> int:
    """Waveform samples per channel from ``frames`` mel frames (no length change from the
    transposed convs when ``k - stride`` is even, as in every released config)."""
    if isinstance(config, LTX2VocoderWithBWEConfig):
        stage1 = output_samples(config.vocoder, frames)
        return stage1 * config.output_sampling_rate // config.input_sampling_rate
    n = frames
    for k, s in zip(config.upsample_kernel_sizes, config.upsample_factors, strict=True):
        n = (n - 1) * s - 2 * ((k - s) // 2) + k
    return n


# ----------------------------------------------------------------------------------------------
# Running and weights
# ----------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=16)
def _jitted(module: nn.Module):
    return jax.jit(lambda params, mel: module.apply({"params": params}, mel))


def vocode(module: LTX2Vocoder | LTX2VocoderWithBWE, params, mel_bctm: jax.Array) -> jax.Array:
    """The pipeline's ``vocoder(audio_vae.decode(z))``: mel ``[B, C, T, M]`` -> waveform
    ``[B, out_channels, samples]`` (:func:`output_samples`), jitted."""
    check_mel(module.config.in_channels, mel_bctm.shape)
    return _jitted(module)(params, jnp.asarray(mel_bctm))


_LIST_MODULE = re.compile(r"^(upsamplers|resnets|acts1|acts2|convs1|convs2)_(\d+)$")
# Flax module names that are not in diffusers' keys (our wrapper of LTX2Vocoder's layers).
_HIDDEN_MODULES = ("generator",)
# Checkpoint buffers kept as diffusers stores them (the anti-alias filters are [1, 1, K]).
_FILTER = weights.Invertible(lambda w: w.reshape(-1), lambda f: f.reshape(1, 1, -1))
# MelSTFT's bases: forward_basis [2F, 1, L] is a conv1d weight; mel_basis [M, F] as is.
BUFFER_LEAVES = ("filter", "forward_basis", "mel_basis")


def _source_entry(path: tuple[str, ...], ndim: int) -> tuple[str, weights.Transform]:
    """Flax param path -> (diffusers key, transform)."""
    *modules, leaf = path
    names = [_LIST_MODULE.sub(r"\1.\2", m) for m in modules if m not in _HIDDEN_MODULES]
    if modules and modules[-1] == "mel_stft" and leaf == "forward_basis":
        names.append("stft_fn")
    prefix = "".join(f"{n}." for n in names)
    if leaf == "kernel":
        if modules[-1].startswith("upsamplers_"):  # ConvTranspose1d [in, out, k] -> [k, in, out]
            return f"{prefix}weight", weights.Invertible(
                lambda w: w.transpose(2, 0, 1), lambda k: k.transpose(1, 2, 0)
            )
        return f"{prefix}weight", weights.conv1d
    if leaf == "filter":
        return f"{prefix}filter", _FILTER
    if leaf == "forward_basis":
        return f"{prefix}forward_basis", weights.conv1d
    if leaf in ("bias", "alpha", "beta", "mel_basis"):
        return f"{prefix}{leaf}", weights.identity
    raise ValueError(f"no diffusers name for parameter {'/'.join(path)}")


def _dummy_inputs(config):
    """One mel frame of ``in_channels`` bins (C = 1): what ``init`` traces."""
    return (jax.ShapeDtypeStruct((1, 1, 1, config.in_channels), jnp.float32),)


def _weight_map(config, boxed) -> dict:
    return weights.weight_map_by_path(boxed, _source_entry)


KIND = weights.ModelKind(LTX2Vocoder, LTX2VocoderConfig, _dummy_inputs, _weight_map)
# LTX2VocoderWithBWE's checkpoint also holds CausalSTFT.inverse_basis, which forward never reads.
BWE_KIND = weights.ModelKind(
    LTX2VocoderWithBWE,
    LTX2VocoderWithBWEConfig,
    _dummy_inputs,
    _weight_map,
    ignore_unused=lambda config: ("mel_stft.stft_fn.inverse_basis",),
)
_KINDS = {"LTX2Vocoder": KIND, "LTX2VocoderWithBWE": BWE_KIND}


def _kind(config) -> weights.ModelKind:
    return BWE_KIND if isinstance(config, LTX2VocoderWithBWEConfig) else KIND


def abstract_params(module: LTX2Vocoder | LTX2VocoderWithBWE) -> Mapping:
    return _kind(module.config).abstract_params(module)


def weight_map(config: LTX2VocoderConfig | LTX2VocoderWithBWEConfig) -> dict:
    """{flax param path: (diffusers key, transform)} for either vocoder class."""
    kind = _kind(config)
    return kind.weight_map(config, kind.abstract_params(kind.module(config)))


def count_params(
    config: LTX2VocoderConfig | LTX2VocoderWithBWEConfig, *, include_buffers: bool = False
) -> int:
    """Parameters from eval_shape; by default without the buffers we keep in ``params``
    (anti-alias filters, STFT / mel bases), i.e. diffusers' ``model.parameters()``."""
    kind = _kind(config)
    boxed = nn.meta.unbox(kind.abstract_params(kind.module(config)))
    leaves = jax.tree_util.tree_flatten_with_path(boxed)[0]
    return sum(
        math.prod(leaf.shape)
        for path, leaf in leaves
        if include_buffers or path[-1].key not in BUFFER_LEAVES
    )


def load_ltx2_vocoder(directory: str | os.PathLike, *, dtype: Dtype = jnp.float32, **options):
    """``(module, params)`` of a diffusers ``LTX2Vocoder`` or ``LTX2VocoderWithBWE`` directory
    (config.json ``_class_name`` picks it; safetensors, buffers included)."""
    class_name = weights.read_config(directory).get("_class_name", "LTX2Vocoder")
    if class_name not in _KINDS:
        raise weights.WeightsError(
            f"{directory}/config.json: _class_name {class_name!r} is not one of {sorted(_KINDS)}"
        )
    return _KINDS[class_name].load(directory, dtype=dtype, param_dtype=dtype, **options)


def init_ltx2_vocoder(
    config: LTX2VocoderConfig | LTX2VocoderWithBWEConfig,
    rng: jax.Array,
    *,
    dtype: Dtype = jnp.float32,
    **kw,
):
    """Random init by the layers' initialisers (kernels LeCun normal, snake parameters 0,
    anti-alias filters their Kaiser values, STFT bases zero as in diffusers)."""
    return _kind(config).init(config, rng, dtype=dtype, param_dtype=dtype, **kw)
