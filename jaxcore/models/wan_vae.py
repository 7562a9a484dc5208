"""Wan 2.1 / 2.2 causal 3D VAE in Flax linen, numerically equal to diffusers' ``AutoencoderKLWan``.

Reference: ``diffusers/models/autoencoders/autoencoder_kl_wan.py`` (diffusers 0.42), both
branches: Wan 2.1 (``is_residual=False``, no ``patch_size``) and the Wan 2.2 VAE of
Wan2.2-TI2V-5B (``is_residual=True``, ``patch_size=2``, z_dim 48). Wan 2.2 differs in three
places: (1) the pixels are patchified (2x2 pixels -> 12 channels) before the encoder and
unpatchified after the decoder, so the spatial factor is 2 x 8 = 16; (2) each encoder level is
one :class:`ResidualDownBlock` whose output gets a parameter-free ``AvgDown3D`` shortcut of
its input; (3) each decoder level is a :class:`ResidualUpBlock` with a ``DupUp3D`` shortcut,
whose upsampler keeps the channel count (Wan 2.1's halves it). The reshapes of (1)-(3) live in
:mod:`jaxcore.models.wan_vae_residual`.

Layout: public tensors use the diffusers layout, video ``[B, C, F, H, W]`` with pixel values in
[-1, 1] and latents ``[B, z_dim, F', H', W']``. Inside, every activation is channel-last
``[B, T, H, W, C]``.

Frame chunking and the causal cache (why outputs match diffusers exactly):
diffusers never runs the VAE on a whole video. It encodes the first frame alone and then
chunks of 4 frames, and decodes one latent frame at a time. Each 3-tap causal conv keeps the
last 2 input frames of the previous chunk as left context (zeros before the first chunk).
The temporal resamplers have their own first-chunk rule: ``downsample3d`` skips its time conv
on the first chunk (so the first frame maps to one latent frame) and ``upsample3d`` skips
its frame-doubling time conv on the first chunk (so the first latent frame maps to one frame).
Here the cache is a Flax variable collection ``"cache"``: each per-chunk method runs with
``mutable=["cache"]``, taking the previous chunk's cache pytree in and handing the updated
one out. The plain functions :func:`encode` / :func:`decode` drive that loop with one jitted
step per chunk shape.

How the convs are computed (same numbers as diffusers up to summation order; measured on
XLA:CPU, where these choices matter): a causal 3-D conv is one 2-D conv per time tap over
the frames, summed, or for few input channels one 2-D conv on the taps stacked on channels
(:func:`_time_valid_conv`; XLA:CPU's 3-D conv is 2-4x slower); on the first chunk the taps that would read only the zero context are left out (a third of the first
chunk's conv work for diffusers' 1-frame first chunk); the upsamplers' nearest 2x + 3x3 conv
is a 2x2 sub-pixel conv on the source pixels (:func:`_nearest_up2_conv`, 2.25x fewer FLOPs);
on CPU the jitted chunk steps compile their convs with XLA's Eigen path rather than YNNPACK
(:data:`CPU_COMPILER_OPTIONS`).

Public API: :class:`WanVAEConfig`, :class:`WanVAE`, :class:`DiagonalGaussian`,
:func:`encode`, :func:`decode`, :func:`normalize_latents`, :func:`denormalize_latents`,
:func:`weight_map`, :func:`load_wan_vae`, :func:`init_wan_vae`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from jaxcore import sharding, weights
from jaxcore.attention import attention as attention_fn
from jaxcore.compute import cpu_compiler_options
from jaxcore.config import config_json_kwargs
from jaxcore.models import wan_vae_residual as residual
from jaxcore.models.layers import silu

Dtype = Any

# Frames of left context a 3-tap causal conv keeps between chunks (diffusers' CACHE_T).
CACHE_FRAMES = 2
# Frames per encoder chunk after the first frame (diffusers' ``_encode`` loop).
ENCODE_CHUNK_FRAMES = 4
# diffusers' DiagonalGaussianDistribution clamps the log-variance to this range.
LOGVAR_RANGE = (-30.0, 20.0)
# F.normalize's epsilon.
NORM_EPS = 1e-12
# Causal convs with at most this many input channels (the pixels: 3, or 12 after Wan 2.2's
# patchify; the latents) stack their time taps on channels: one 2-D conv, 2-5x faster there.
STACK_TAPS_MAX_CHANNELS = 32

# Wan 2.1 latent statistics (AutoencoderKLWan's defaults, used when config.json omits them).
WAN21_LATENTS_MEAN = (
    -0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
    0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921,
)  # fmt: skip
WAN21_LATENTS_STD = (
    2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
    3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160,
)  # fmt: skip
# config.json keys that diffusers itself drops: Wan2.2-TI2V-5B-Diffusers' vae/config.json has
# "clip_output": false, which is no AutoencoderKLWan argument (ConfigMixin ignores it and
# diffusers 0.42 clamps decoded pixels to [-1, 1] regardless), so it changes nothing here either.
IGNORED_CONFIG_KEYS = ("clip_output",)


# ----------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------


class WanVAEConfigError(ValueError):
    """A config.json / YAML section that WanVAEConfig cannot represent; names the key."""


@dataclasses.dataclass(frozen=True)
class WanVAEConfig:
    """Architecture of the Wan 2.1 / 2.2 VAE; field names follow diffusers' config.json.

    ``scale_factor_temporal`` / ``scale_factor_spatial`` are stored as diffusers stores them
    (metadata: diffusers reads the spatial one only to size its tiles and the pipelines read
    both, but nothing checks them against the architecture; the real Wan 2.1 and Wan2.2-TI2V-5B
    configs are consistent, 8/4 and 16/4); use :attr:`temporal_compression` and
    :attr:`spatial_compression` for the factors the architecture really has.
    ``in_channels`` / ``out_channels`` count the encoder's / decoder's channels, i.e. after
    patchify (12 = 3 x 2 x 2 for Wan 2.2); :attr:`video_channels` is the pixel count.
    ``dropout`` is accepted but unused: this port is inference-only (dropout is identity).
    """

    base_dim: int = 96
    decoder_base_dim: int | None = None
    z_dim: int = 16
    dim_mult: tuple[int, ...] = (1, 2, 4, 4)
    num_res_blocks: int = 2
    attn_scales: tuple[float, ...] = ()
    temperal_downsample: tuple[bool, ...] = (False, True, True)
    dropout: float = 0.0
    latents_mean: tuple[float, ...] = WAN21_LATENTS_MEAN
    latents_std: tuple[float, ...] = WAN21_LATENTS_STD
    is_residual: bool = False
    in_channels: int = 3
    out_channels: int = 3
    patch_size: int | None = None
    scale_factor_temporal: int | None = 4
    scale_factor_spatial: int | None = 8

    def __post_init__(self):
        for key in (
            "dim_mult",
            "attn_scales",
            "temperal_downsample",
            "latents_mean",
            "latents_std",
        ):
            object.__setattr__(self, key, tuple(getattr(self, key)))
        object.__setattr__(self, "temperal_downsample", tuple(map(bool, self.temperal_downsample)))
        self._check_attn_scales()
        for key in ("base_dim", "z_dim", "num_res_blocks", "in_channels", "out_channels"):
            if int(getattr(self, key)) < 1:
                raise WanVAEConfigError(f"{key} must be >= 1, got {getattr(self, key)!r}")
        if self.decoder_base_dim is not None and self.decoder_base_dim < 1:
            raise WanVAEConfigError(f"decoder_base_dim must be >= 1, got {self.decoder_base_dim}")
        if not self.dim_mult or min(self.dim_mult) < 1:
            raise WanVAEConfigError(f"dim_mult must be positive ints, got {list(self.dim_mult)}")
        if len(self.temperal_downsample) != len(self.dim_mult) - 1:
            raise WanVAEConfigError(
                f"temperal_downsample has {len(self.temperal_downsample)} entries but needs "
                f"len(dim_mult) - 1 = {len(self.dim_mult) - 1} (one per downsampling level)"
            )
        for key in ("latents_mean", "latents_std"):
            if len(getattr(self, key)) != self.z_dim:
                raise WanVAEConfigError(
                    f"{key} has {len(getattr(self, key))} entries but z_dim is {self.z_dim}"
                )
        if min(self.latents_std) <= 0:
            raise WanVAEConfigError(f"latents_std must be positive, got {list(self.latents_std)}")
        if not 0.0 <= self.dropout < 1.0:
            raise WanVAEConfigError(f"dropout must be in [0, 1), got {self.dropout}")
        self._check_patch_size()
        if self.is_residual:
            self._check_residual_widths()

    def _check_attn_scales(self) -> None:
        """Encoder attention scales are refused where diffusers has no working reference."""
        if self.attn_scales and not self.is_residual:
            # diffusers builds WanAttentionBlocks into the encoder's down_blocks for these scales
            # but calls them with feat_cache=..., which WanAttentionBlock.forward does not take
            # (TypeError), and its decoder ignores attn_scales: there is no reference to match.
            raise WanVAEConfigError(
                f"attn_scales={list(self.attn_scales)} is not supported: diffusers' "
                "AutoencoderKLWan cannot run encoder attention at these scales, so only "
                "attn_scales=[] (Wan 2.1) has a reference (the mid blocks always have attention)"
            )
        # With is_residual=True diffusers builds no attention outside the mid blocks whatever
        # attn_scales says (WanResidualDownBlock / WanResidualUpBlock take no attn_scales), so
        # they are accepted and, as there, change nothing.

    def _check_patch_size(self) -> None:
        """patchify folds p x p pixels into channels: in/out_channels must be whole multiples."""
        if self.patch_size is None:
            return
        if int(self.patch_size) < 1:
            raise WanVAEConfigError(f"patch_size must be >= 1 or null, got {self.patch_size!r}")
        area = self.patch_size**2
        for key in ("in_channels", "out_channels"):
            if getattr(self, key) % area:
                raise WanVAEConfigError(
                    f"patch_size={self.patch_size} folds {area} pixels into channels, so {key} "
                    f"(the channels after patchify) must be a multiple of {area}, got "
                    f"{getattr(self, key)}"
                )

    def _check_residual_widths(self) -> None:
        """The residual shortcuts regroup channels: diffusers refuses (AvgDown3D raises,
        DupUp3D asserts) widths that do not divide evenly; so do we, naming the level."""
        for level, (c_in, c_out, f_t, f_s) in enumerate(self.residual_down_levels):
            if (c_in * f_t * f_s * f_s) % c_out:
                raise WanVAEConfigError(
                    f"is_residual=True: encoder level {level} maps {c_in} -> {c_out} channels "
                    f"(base_dim x dim_mult) with a x{f_t * f_s * f_s} AvgDown3D shortcut; "
                    f"{c_in} x {f_t * f_s * f_s} must be divisible by {c_out}"
                )
        for level, (c_in, c_out, f_t, up) in enumerate(self.residual_up_levels):
            if up and (c_out * f_t * 4) % c_in:
                raise WanVAEConfigError(
                    f"is_residual=True: decoder level {level} maps {c_in} -> {c_out} channels "
                    f"(decoder_base_dim x dim_mult) with a x{f_t * 4} DupUp3D shortcut; "
                    f"{c_out} x {f_t * 4} must be divisible by {c_in}"
                )

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> WanVAEConfig:
        """Build from a diffusers config.json dict (``_``-prefixed keys ignored)."""
        kwargs = config_json_kwargs(cls, d, WanVAEConfigError, ignored=IGNORED_CONFIG_KEYS)
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}

    @property
    def decoder_dim(self) -> int:
        """Decoder base width (diffusers: ``decoder_base_dim or base_dim``)."""
        return self.decoder_base_dim if self.decoder_base_dim is not None else self.base_dim

    @property
    def temperal_upsample(self) -> tuple[bool, ...]:
        """Decoder temporal upsampling per level (diffusers reverses ``temperal_downsample``)."""
        return self.temperal_downsample[::-1]

    @property
    def patch(self) -> int:
        """Pixels per side folded into channels before the encoder (1: no patchify)."""
        return 1 if self.patch_size is None else int(self.patch_size)

    @property
    def video_channels(self) -> int:
        """Channels of the pixel video the VAE takes (in_channels before patchify)."""
        return self.in_channels // self.patch**2

    @property
    def output_video_channels(self) -> int:
        """Channels of the decoded pixel video (out_channels after unpatchify)."""
        return self.out_channels // self.patch**2

    @property
    def spatial_compression(self) -> int:
        """Pixels per latent along H and W: patch_size, then one 2x downsample per level but
        the last (8 for Wan 2.1, 2 x 8 = 16 for Wan 2.2)."""
        return self.patch * 2 ** (len(self.dim_mult) - 1)

    @property
    def residual_down_levels(self) -> tuple[tuple[int, int, int, int], ...]:
        """(in, out, time factor, space factor) per encoder level (diffusers' residual branch:
        every level but the last downsamples in space, the last never in time)."""
        dims = [self.base_dim * m for m in (1, *self.dim_mult)]
        levels = []
        for i in range(len(self.dim_mult)):
            down = i != len(self.dim_mult) - 1
            factor_t = 2 if down and self.temperal_downsample[i] else 1
            levels.append((dims[i], dims[i + 1], factor_t, 2 if down else 1))
        return tuple(levels)

    @property
    def residual_up_levels(self) -> tuple[tuple[int, int, int, bool], ...]:
        """(in, out, time factor, upsamples) per decoder level of the residual branch; unlike
        Wan 2.1 the input width is not halved, as the residual upsampler keeps channels."""
        dims = [self.decoder_dim * m for m in (self.dim_mult[-1], *self.dim_mult[::-1])]
        levels = []
        for i in range(len(self.dim_mult)):
            up = i != len(self.dim_mult) - 1
            factor_t = 2 if up and self.temperal_upsample[i] else 1
            levels.append((dims[i], dims[i + 1], factor_t, up))
        return tuple(levels)

    @property
    def temporal_compression(self) -> int:
        """Frames per latent frame after the first: 1 + 4k frames <-> 1 + 4k / this latents."""
        return 2 ** sum(self.temperal_downsample)


# ----------------------------------------------------------------------------------------------
# Layers (channel-last)
# ----------------------------------------------------------------------------------------------


# Initializer per parameter leaf name; the layers and init_wan_vae both use this table.
PARAM_INITIALIZERS = {
    "kernel": nn.initializers.lecun_normal(),
    "bias": nn.initializers.zeros_init(),
    "gamma": nn.initializers.ones_init(),
}


def _kernel_init(ndim: int):
    """lecun_normal over [*window, in, out], annotated with logical axes (VAE: replicated).

    The window axes are unnamed (never sharded): flax forbids one logical name on several
    axes of an array, so ``conv_spatial`` cannot cover T, H and W together.
    """
    names = (None,) * (ndim - 2) + ("conv_in", "conv_out")
    return nn.with_logical_partitioning(PARAM_INITIALIZERS["kernel"], names)


_BIAS_INIT = nn.with_logical_partitioning(PARAM_INITIALIZERS["bias"], ("conv_out",))


def _conv(x, kernel, bias, strides, padding, dtype):
    """N-d cross-correlation, channel-last, like torch ConvNd (same weights after transpose)."""
    spatial = "DHW"[-(x.ndim - 2) :]
    dims = (f"N{spatial}C", f"{spatial}IO", f"N{spatial}C")
    y = jax.lax.conv_general_dilated(
        x.astype(dtype),
        kernel.astype(dtype),
        window_strides=strides,
        padding=padding,
        dimension_numbers=dims,
    )
    return y + bias.astype(dtype)


def _frame_conv(x_bthwc, kernel_hwio, strides_hw, pad_hw, dtype):
    """The same 2-D conv on every frame, frames folded into the batch: [B, T, H, W, I] -> O.

    A 1x1 kernel without padding is a plain matmul over channels (XLA runs it as one GEMM).
    """
    b, t = x_bthwc.shape[:2]
    x, kernel = x_bthwc.astype(dtype), kernel_hwio.astype(dtype)
    if kernel.shape[:2] == (1, 1) and tuple(strides_hw) == (1, 1) and not any(map(any, pad_hw)):
        return jax.lax.dot_general(x, kernel[0, 0], (((4,), (0,)), ((), ())))
    frames = x.reshape(b * t, *x.shape[2:])
    y = jax.lax.conv_general_dilated(
        frames, kernel, strides_hw, pad_hw, dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    return y.reshape(b, t, *y.shape[1:])


def _time_valid_conv(x_bthwc, kernel, bias, strides, pad_hw, zero_frames, dtype):
    """3-D cross-correlation, valid in time and ``pad_hw`` in space, as one 2-D conv per time
    tap summed: XLA:CPU runs a 3x3x3 conv 2-4x slower than three 3x3 convs over frames.

    ``x`` starts with its left context; a tap that would read only the first ``zero_frames``
    frames (known zeros: a fresh cache) is skipped, which is exact (it adds only zeros). With
    at most STACK_TAPS_MAX_CHANNELS input channels the taps' frames are stacked on channels
    instead and run as one 2-D conv (a conv on 3 channels makes a poor GEMM).
    """
    stride_t = strides[0]
    t_out = (x_bthwc.shape[1] - kernel.shape[0]) // stride_t + 1
    span = stride_t * (t_out - 1) + 1
    taps = [tap for tap in range(kernel.shape[0]) if tap + span > zero_frames]
    frames = [x_bthwc[:, tap : tap + span : stride_t] for tap in taps]
    if len(taps) > 1 and x_bthwc.shape[-1] <= STACK_TAPS_MAX_CHANNELS:
        stacked = jnp.concatenate([kernel[tap] for tap in taps], axis=2)  # [kh, kw, taps I, O]
        y = _frame_conv(jnp.concatenate(frames, axis=-1), stacked, strides[1:], pad_hw, dtype)
    else:
        parts = [
            _frame_conv(f, kernel[tap], strides[1:], pad_hw, dtype)
            for tap, f in zip(taps, frames, strict=True)
        ]
        y = functools.reduce(jnp.add, parts)
    return y + bias.astype(dtype)


def _frame_cache(module: nn.Module, name: str, x: jax.Array, frames: int) -> nn.Variable:
    """The ``cache`` variable holding ``frames`` past frames shaped like ``x`` (zeros at start).

    Zeros are exactly diffusers' zero time padding before the first chunk. A cache from a
    different batch/resolution is an error rather than a silent broadcast.
    """
    if not module.is_mutable_collection("cache"):
        raise ValueError(
            f"{module.name}: the Wan VAE carries a causal cache between frame chunks; apply "
            "per-chunk methods with mutable=['cache'] (or use wan_vae.encode / wan_vae.decode)"
        )
    shape = (x.shape[0], frames, *x.shape[2:])
    var = module.variable("cache", name, jnp.zeros, shape, x.dtype)
    if var.value.shape != shape:
        raise ValueError(
            f"{module.name}: cached frames have shape {var.value.shape} but this chunk needs "
            f"{shape}; start a new cache for a new batch size or resolution"
        )
    return var


class CausalConv3d(nn.Module):
    """diffusers ``WanCausalConv3d``: Conv3d whose time padding (2 x pad_t) is all on the left.

    With ``padding[0] > 0`` the left context is the last ``2 * padding[0]`` input frames of the
    previous chunk (the ``cache`` collection), zeros before the first chunk. H/W padding is
    symmetric zero padding as in torch.
    """

    features: int
    kernel_size: tuple[int, int, int] = (3, 3, 3)
    strides: tuple[int, int, int] = (1, 1, 1)
    padding: tuple[int, int, int] = (1, 1, 1)
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x_bthwc: jax.Array) -> jax.Array:
        in_features = x_bthwc.shape[-1]
        kernel = self.param(
            "kernel",
            _kernel_init(5),
            (*self.kernel_size, in_features, self.features),
            self.param_dtype,
        )
        bias = self.param("bias", _BIAS_INIT, (self.features,), self.param_dtype)
        x = x_bthwc.astype(self.dtype)
        context = 2 * self.padding[0]
        zero_frames = 0
        if context:
            # No cache variable yet: this is the first chunk and its left context is zeros.
            zero_frames = 0 if self.has_variable("cache", "frames") else context
            cache = _frame_cache(self, "frames", x, context)
            x = jnp.concatenate([cache.value, x], axis=1)
            cache.value = x[:, -context:]
        pad_h, pad_w = self.padding[1], self.padding[2]
        pad_hw = ((pad_h, pad_h), (pad_w, pad_w))
        return _time_valid_conv(x, kernel, bias, self.strides, pad_hw, zero_frames, self.dtype)


# A 3-tap conv (padding 1) after nearest 2x upsampling, along one axis: output phase a (pixel
# 2i + a) reads source pixels (i - 1, i) for a = 0 and (i, i + 1) for a = 1, with these sums of
# the 3 taps: [phase, source tap, kernel tap].
_UP2_TAPS = np.array([[[1, 0, 0], [0, 1, 1]], [[1, 1, 0], [0, 0, 1]]], np.float32)


def _nearest_up2_conv(x_nhwc, kernel_hwio, bias, dtype):
    """Nearest 2x upsampling then a 3x3 conv with padding 1, without the upsampled image.

    Each of the 4 output phases is a 2x2 conv on the source pixels whose taps are sums of the
    3x3 taps (2.25x fewer FLOPs); the 4 phases run as one 2x2 conv with 4 x O output channels
    over the source padded by 1, phase (a, b) at offset (a, b) of its (H + 1) x (W + 1) output.
    """
    n, h, w, c = x_nhwc.shape
    out = kernel_hwio.shape[-1]
    taps = jnp.asarray(_UP2_TAPS)
    kernel = jnp.einsum(
        "ary,bsx,yxio->rsiabo",
        taps,
        taps,
        kernel_hwio.astype(jnp.float32),
        precision=jax.lax.Precision.HIGHEST,
    ).reshape(2, 2, c, 4 * out)
    y = jax.lax.conv_general_dilated(
        x_nhwc.astype(dtype),
        kernel.astype(dtype),
        (1, 1),
        ((1, 1), (1, 1)),
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
    ).reshape(n, h + 1, w + 1, 2, 2, out)
    rows = [
        jnp.stack([y[:, a : a + h, b : b + w, a, b] for b in range(2)], axis=3) for a in range(2)
    ]
    # [N, H, 2 (a), W, 2 (b), O] -> pixel (2i + a, 2j + b)
    return jnp.stack(rows, axis=2).reshape(n, 2 * h, 2 * w, out) + bias.astype(dtype)


class Conv2d(nn.Module):
    """torch ``nn.Conv2d`` on channel-last frames ``[N, H, W, C]`` with explicit (lo, hi) pads.

    ``nearest_up2``: upsample the input 2x (nearest) first, as diffusers' ``WanResample`` does
    before its 3x3 conv (computed by :func:`_nearest_up2_conv`; needs padding 1, stride 1).
    """

    features: int
    kernel_size: tuple[int, int] = (3, 3)
    strides: tuple[int, int] = (1, 1)
    padding: tuple[tuple[int, int], tuple[int, int]] = ((1, 1), (1, 1))
    nearest_up2: bool = False
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x_nhwc: jax.Array) -> jax.Array:
        kernel = self.param(
            "kernel",
            _kernel_init(4),
            (*self.kernel_size, x_nhwc.shape[-1], self.features),
            self.param_dtype,
        )
        bias = self.param("bias", _BIAS_INIT, (self.features,), self.param_dtype)
        if self.nearest_up2:
            if (
                self.kernel_size != (3, 3)
                or self.strides != (1, 1)
                or self.padding != ((1, 1),) * 2
            ):
                raise ValueError("nearest_up2 needs a 3x3 kernel, stride 1 and padding 1")
            return _nearest_up2_conv(x_nhwc, kernel, bias, self.dtype)
        return _conv(x_nhwc, kernel, bias, self.strides, list(self.padding), self.dtype)


class RMSNorm(nn.Module):
    """diffusers ``WanRMS_norm`` (bias=False): L2-normalise over channels, x sqrt(C) x gamma.

    ``F.normalize`` divides by ``max(||x||, 1e-12)``; low-precision inputs are normalised in
    fp32 as diffusers does. The ``images`` flag only changes torch's gamma shape
    ([C,1,1] vs [C,1,1,1]); here gamma is [C] and :func:`weight_map` flattens it.
    """

    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        channels = x.shape[-1]
        gamma = self.param(
            "gamma",
            nn.with_logical_partitioning(PARAM_INITIALIZERS["gamma"], ("norm",)),
            (channels,),
            self.param_dtype,
        )
        x32 = x.astype(jnp.float32)
        norm = jnp.sqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True))
        normalized = (x32 / jnp.maximum(norm, NORM_EPS)).astype(self.dtype)
        return normalized * math.sqrt(channels) * gamma.astype(self.dtype)


class ResidualBlock(nn.Module):
    """diffusers ``WanResidualBlock``: (RMSNorm, SiLU, causal conv) x 2 plus a shortcut."""

    out_dim: int
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kw = {"dtype": self.dtype, "param_dtype": self.param_dtype}
        shortcut = x
        if x.shape[-1] != self.out_dim:
            shortcut = CausalConv3d(
                self.out_dim, (1, 1, 1), padding=(0, 0, 0), name="conv_shortcut", **kw
            )(x)
        h = silu(RMSNorm(name="norm1", **kw)(x))
        h = CausalConv3d(self.out_dim, name="conv1", **kw)(h)
        h = silu(RMSNorm(name="norm2", **kw)(h))
        h = CausalConv3d(self.out_dim, name="conv2", **kw)(h)
        return h + shortcut


class AttentionBlock(nn.Module):
    """diffusers ``WanAttentionBlock``: single-head self-attention over the pixels of each frame.

    The torch 1x1 Conv2d projections are Dense layers here (same math on channel-last pixels).
    """

    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    attention: str = "dot_product"
    mesh: jax.sharding.Mesh | None = None

    @nn.compact
    def __call__(self, x_bthwc: jax.Array) -> jax.Array:
        b, t, h, w, c = x_bthwc.shape
        kw = {"dtype": self.dtype, "param_dtype": self.param_dtype}
        dense_kernel = _kernel_init(2)
        x_nlc = RMSNorm(name="norm", **kw)(x_bthwc).reshape(b * t, h * w, c)
        qkv = nn.Dense(3 * c, kernel_init=dense_kernel, bias_init=_BIAS_INIT, name="to_qkv", **kw)(
            x_nlc
        )
        # One head of width C: [N, L, 1, C] in the shared attention layout [B, L, H, D].
        q, k, v = (part[:, :, None, :] for part in jnp.split(qkv, 3, axis=-1))
        out = attention_fn(q, k, v, backend=self.attention, mesh=self.mesh)[:, :, 0, :]
        out = nn.Dense(c, kernel_init=dense_kernel, bias_init=_BIAS_INIT, name="proj", **kw)(out)
        return out.reshape(b, t, h, w, c) + x_bthwc


def _interleave_time_halves(x_bthw2c: jax.Array) -> jax.Array:
    """[B, T, H, W, 2C] -> [B, 2T, H, W, C]: channel half j becomes frame 2t + j (diffusers)."""
    b, t, h, w, c2 = x_bthw2c.shape
    x = x_bthw2c.reshape(b, t, h, w, 2, c2 // 2)
    return jnp.moveaxis(x, 4, 2).reshape(b, 2 * t, h, w, c2 // 2)


class Resample(nn.Module):
    """diffusers ``WanResample`` for mode upsample2d / upsample3d / downsample2d / downsample3d.

    Spatial part (per frame): nearest 2x upsample + 3x3 conv to ``out_dim`` channels, or
    bottom/right zero pad + 3x3 stride-2 conv. Temporal part with its first-chunk rules:
    ``upsample3d`` maps C -> 2C channels with a causal (3,1,1) conv and interleaves the halves
    into 2x frames, skipped on the first chunk; ``downsample3d`` runs a (3,1,1) stride-2 conv
    over [last frame of the previous chunk, this chunk], skipped on the first chunk.
    """

    mode: str
    out_dim: int | None = None
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, first_chunk: bool) -> jax.Array:
        kw = {"dtype": self.dtype, "param_dtype": self.param_dtype}
        channels = x.shape[-1]
        if self.mode == "upsample3d":
            x = self._time_upsample(x, first_chunk, kw)
        b, t, h, w, c = x.shape
        frames = x.reshape(b * t, h, w, c)
        if self.mode in ("upsample2d", "upsample3d"):
            # nearest-exact at scale 2 picks source pixel i // 2: a plain repeat, folded into
            # the conv (see _nearest_up2_conv).
            out_dim = self.out_dim if self.out_dim is not None else channels // 2
            frames = Conv2d(out_dim, nearest_up2=True, name="resample_1", **kw)(frames)
        elif self.mode in ("downsample2d", "downsample3d"):
            frames = Conv2d(
                channels, strides=(2, 2), padding=((0, 1), (0, 1)), name="resample_1", **kw
            )(frames)
        else:
            raise ValueError(f"unknown Resample mode {self.mode!r}")
        x = frames.reshape(b, t, *frames.shape[1:])
        if self.mode == "downsample3d":
            x = self._time_downsample(x, first_chunk, kw)
        return x

    def _time_upsample(self, x, first_chunk, kw):
        # The cache is created (zeros) on the first chunk too, so every later chunk sees the
        # same cache pytree; zeros are what diffusers' "Rep" marker pads with.
        cache = _frame_cache(self, "time_conv_frames", x, CACHE_FRAMES)
        if first_chunk:
            return x
        x = jnp.concatenate([cache.value, x], axis=1)
        cache.value = x[:, -CACHE_FRAMES:]
        conv = CausalConv3d(2 * x.shape[-1], (3, 1, 1), padding=(0, 0, 0), name="time_conv", **kw)
        return _interleave_time_halves(conv(x))

    def _time_downsample(self, x, first_chunk, kw):
        cache = _frame_cache(self, "time_conv_frames", x, 1)
        last = x[:, -1:]
        if not first_chunk:
            conv = CausalConv3d(
                x.shape[-1], (3, 1, 1), strides=(2, 1, 1), padding=(0, 0, 0), name="time_conv", **kw
            )
            x = conv(jnp.concatenate([cache.value, x], axis=1))
        cache.value = last
        return x


class MidBlock(nn.Module):
    """diffusers ``WanMidBlock`` (num_layers=1): residual, attention, residual."""

    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    attention: str = "dot_product"
    mesh: jax.sharding.Mesh | None = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kw = {"dtype": self.dtype, "param_dtype": self.param_dtype}
        dim = x.shape[-1]
        x = ResidualBlock(dim, name="resnets_0", **kw)(x)
        x = AttentionBlock(attention=self.attention, mesh=self.mesh, name="attentions_0", **kw)(x)
        return ResidualBlock(dim, name="resnets_1", **kw)(x)


class ResidualDownBlock(nn.Module):
    """diffusers ``WanResidualDownBlock`` (Wan 2.2): one encoder level as one block.

    Residual blocks then the level's resampler (``downsampler``, same ``WanResample`` as
    Wan 2.1), plus an ``AvgDown3D`` shortcut from the block input to its output. The shortcut
    has no cache: on the first chunk (1 frame) it averages that frame with a zero frame, just
    as the resampler there skips its time conv; see :func:`wan_vae_residual.avg_down_3d`.
    """

    out_dim: int
    num_res_blocks: int
    factor_t: int
    factor_s: int
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, first_chunk: bool) -> jax.Array:
        kw = {"dtype": self.dtype, "param_dtype": self.param_dtype}
        shortcut = residual.avg_down_3d(x, self.out_dim, self.factor_t, self.factor_s)
        for i in range(self.num_res_blocks):
            x = ResidualBlock(self.out_dim, name=f"resnets_{i}", **kw)(x)
        if self.factor_s > 1:
            mode = "downsample3d" if self.factor_t > 1 else "downsample2d"
            x = Resample(mode, name="downsampler", **kw)(x, first_chunk)
        return x + shortcut


class Encoder(nn.Module):
    """diffusers ``WanEncoder3d``: conv_in, down_blocks, mid_block, head -> 2 z_dim.

    Wan 2.1 (``is_residual=False``): ``down_blocks`` is a flat list of residual blocks and
    resamplers. Wan 2.2: one :class:`ResidualDownBlock` per level; ``attn_scales`` are unused
    in both (see :class:`WanVAEConfig`).
    """

    config: WanVAEConfig
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    attention: str = "dot_product"
    mesh: jax.sharding.Mesh | None = None

    @nn.compact
    def __call__(self, x: jax.Array, first_chunk: bool) -> jax.Array:
        cfg = self.config
        kw = {"dtype": self.dtype, "param_dtype": self.param_dtype}
        dims = [cfg.base_dim * m for m in (1, *cfg.dim_mult)]
        x = CausalConv3d(dims[0], name="conv_in", **kw)(x)
        if cfg.is_residual:
            x = self._residual_levels(x, first_chunk, kw)
        else:
            x = self._levels(x, first_chunk, dims, kw)
        x = MidBlock(attention=self.attention, mesh=self.mesh, name="mid_block", **kw)(x)
        x = silu(RMSNorm(name="norm_out", **kw)(x))
        return CausalConv3d(2 * cfg.z_dim, name="conv_out", **kw)(x)

    def _levels(self, x, first_chunk, dims, kw):
        """Wan 2.1: down_blocks is one flat list, res blocks then the level's resampler."""
        cfg = self.config
        index = 0
        for level, out_dim in enumerate(dims[1:]):
            for _ in range(cfg.num_res_blocks):
                x = ResidualBlock(out_dim, name=f"down_blocks_{index}", **kw)(x)
                index += 1
            if level != len(cfg.dim_mult) - 1:
                mode = "downsample3d" if cfg.temperal_downsample[level] else "downsample2d"
                x = Resample(mode, name=f"down_blocks_{index}", **kw)(x, first_chunk)
                index += 1
        return x

    def _residual_levels(self, x, first_chunk, kw):
        """Wan 2.2: one ResidualDownBlock per level."""
        cfg = self.config
        for level, (_, out_dim, factor_t, factor_s) in enumerate(cfg.residual_down_levels):
            block = ResidualDownBlock(
                out_dim, cfg.num_res_blocks, factor_t, factor_s, name=f"down_blocks_{level}", **kw
            )
            x = block(x, first_chunk)
        return x


class UpBlock(nn.Module):
    """diffusers ``WanUpBlock``: num_res_blocks + 1 residual blocks, then an optional resampler.

    Its upsampler halves the channels (``upsample_out_dim = dim // 2``), which is why the next
    level's input width is half of diffusers' ``dims[i]``.
    """

    out_dim: int
    num_res_blocks: int
    upsample_mode: str | None
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, first_chunk: bool) -> jax.Array:
        kw = {"dtype": self.dtype, "param_dtype": self.param_dtype}
        for i in range(self.num_res_blocks + 1):
            x = ResidualBlock(self.out_dim, name=f"resnets_{i}", **kw)(x)
        if self.upsample_mode is not None:
            x = Resample(self.upsample_mode, name="upsamplers_0", **kw)(x, first_chunk)
        return x


class ResidualUpBlock(nn.Module):
    """diffusers ``WanResidualUpBlock`` (Wan 2.2): num_res_blocks + 1 residual blocks, then
    an optional resampler (``upsampler``) that keeps ``out_dim`` channels (diffusers'
    ``upsample_out_dim=out_dim``), plus a ``DupUp3D`` shortcut from the block input.

    ``first_chunk`` matters here, unlike in Wan 2.1's up block: on the decoder's first latent
    frame the temporal upsampler skips its frame doubling, and the shortcut drops its extra
    frame to stay aligned (see :func:`wan_vae_residual.dup_up_3d`).
    """

    out_dim: int
    num_res_blocks: int
    factor_t: int
    upsample: bool
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, first_chunk: bool) -> jax.Array:
        kw = {"dtype": self.dtype, "param_dtype": self.param_dtype}
        shortcut = None
        if self.upsample:
            shortcut = residual.dup_up_3d(x, self.out_dim, self.factor_t, 2, first_chunk)
        for i in range(self.num_res_blocks + 1):
            x = ResidualBlock(self.out_dim, name=f"resnets_{i}", **kw)(x)
        if self.upsample:
            mode = "upsample3d" if self.factor_t > 1 else "upsample2d"
            x = Resample(mode, self.out_dim, name="upsampler", **kw)(x, first_chunk)
            x = x + shortcut
        return x


class Decoder(nn.Module):
    """diffusers ``WanDecoder3d``: conv_in, mid_block, up_blocks, head -> pixels (or patches).

    Wan 2.1: :class:`UpBlock` levels. Wan 2.2 (``is_residual``): :class:`ResidualUpBlock` levels.
    """

    config: WanVAEConfig
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    attention: str = "dot_product"
    mesh: jax.sharding.Mesh | None = None

    @nn.compact
    def __call__(self, z: jax.Array, first_chunk: bool) -> jax.Array:
        cfg = self.config
        kw = {"dtype": self.dtype, "param_dtype": self.param_dtype}
        dims = [cfg.decoder_dim * m for m in (cfg.dim_mult[-1], *cfg.dim_mult[::-1])]
        x = CausalConv3d(dims[0], name="conv_in", **kw)(z)
        x = MidBlock(attention=self.attention, mesh=self.mesh, name="mid_block", **kw)(x)
        if cfg.is_residual:
            x = self._residual_levels(x, first_chunk, kw)
        else:
            x = self._levels(x, first_chunk, dims, kw)
        x = silu(RMSNorm(name="norm_out", **kw)(x))
        return CausalConv3d(cfg.out_channels, name="conv_out", **kw)(x)

    def _levels(self, x, first_chunk, dims, kw):
        """Wan 2.1: UpBlocks whose upsamplers halve the channels."""
        cfg = self.config
        last = len(cfg.dim_mult) - 1
        for level, out_dim in enumerate(dims[1:]):
            mode = None
            if level != last:
                mode = "upsample3d" if cfg.temperal_upsample[level] else "upsample2d"
            x = UpBlock(out_dim, cfg.num_res_blocks, mode, name=f"up_blocks_{level}", **kw)(
                x, first_chunk
            )
        return x

    def _residual_levels(self, x, first_chunk, kw):
        """Wan 2.2: one ResidualUpBlock per level."""
        cfg = self.config
        for level, (_, out_dim, factor_t, up) in enumerate(cfg.residual_up_levels):
            block = ResidualUpBlock(
                out_dim, cfg.num_res_blocks, factor_t, up, name=f"up_blocks_{level}", **kw
            )
            x = block(x, first_chunk)
        return x


# ----------------------------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------------------------


class DiagonalGaussian(NamedTuple):
    """Posterior over latents (diffusers' DiagonalGaussianDistribution), ``[B, z, F, H, W]``."""

    mean: jax.Array
    logvar: jax.Array

    def mode(self) -> jax.Array:
        return self.mean

    def sample(self, rng: jax.Array) -> jax.Array:
        noise = jax.random.normal(rng, self.mean.shape, self.mean.dtype)
        return self.mean + jnp.exp(0.5 * self.logvar) * noise


def _to_channel_last(x_bcfhw: jax.Array) -> jax.Array:
    return jnp.transpose(x_bcfhw, (0, 2, 3, 4, 1))


def _to_channel_first(x_bfhwc: jax.Array) -> jax.Array:
    return jnp.transpose(x_bfhwc, (0, 4, 1, 2, 3))


def _constrain_video(x_bthwc: jax.Array) -> jax.Array:
    return sharding.constrain(
        x_bthwc,
        (
            "activation_batch",
            "activation_frames",
            "activation_height",
            "activation_width",
            "activation_channels",
        ),
    )


def _moments_to_posterior(moments_bthwc: jax.Array, z_dim: int) -> DiagonalGaussian:
    """Split 2 z_dim channels into (mean, clamped logvar), back to [B, z, F, H, W]."""
    moments = _to_channel_first(moments_bthwc)
    mean, logvar = moments[:, :z_dim], moments[:, z_dim:]
    return DiagonalGaussian(mean, jnp.clip(logvar, *LOGVAR_RANGE))


def check_video(config: WanVAEConfig, video_shape: Sequence[int]) -> None:
    """Raise ValueError naming the dimension when a video cannot be encoded like diffusers."""
    if len(video_shape) != 5:
        raise ValueError(f"video must be [B, C, F, H, W], got shape {tuple(video_shape)}")
    _, channels, frames, height, width = video_shape
    if channels != config.video_channels:
        expected = f"in_channels is {config.in_channels}"
        if config.patch > 1:
            expected = f"the VAE takes {config.video_channels} ({expected}, after patchify)"
        raise ValueError(f"video has {channels} channels but {expected}")
    if frames < 1 or (frames - 1) % ENCODE_CHUNK_FRAMES:
        # diffusers would silently drop the trailing frames; we refuse instead.
        raise ValueError(
            f"video has {frames} frames; the Wan VAE encodes 1 + {ENCODE_CHUNK_FRAMES}k frames "
            "(the first frame alone, then chunks of 4)"
        )
    s = config.spatial_compression
    for name, size in (("height", height), ("width", width)):
        if size % s:
            raise ValueError(f"video {name} {size} is not divisible by the spatial compression {s}")


def check_latents(config: WanVAEConfig, z_shape: Sequence[int]) -> None:
    """Raise ValueError naming the dimension when latents do not fit this VAE."""
    if len(z_shape) != 5:
        raise ValueError(f"latents must be [B, z_dim, F, H, W], got shape {tuple(z_shape)}")
    if z_shape[1] != config.z_dim:
        raise ValueError(f"latents have {z_shape[1]} channels but z_dim is {config.z_dim}")
    if z_shape[2] < 1:
        raise ValueError("latents have 0 frames")


def encoder_chunks(frames: int) -> list[slice]:
    """Frame slices diffusers' ``_encode`` feeds the encoder: [0:1], [1:5], [5:9], ..."""
    starts = range(1, frames, ENCODE_CHUNK_FRAMES)
    return [slice(0, 1)] + [slice(s, s + ENCODE_CHUNK_FRAMES) for s in starts]


class WanVAE(nn.Module):
    """Wan 2.1 / 2.2 VAE (= diffusers ``AutoencoderKLWan``), parameters named as in diffusers.

    Per-chunk methods (channel-last ``[B, T, H, W, C]``, need ``mutable=["cache"]``):
    ``encode_chunk(x, first_chunk) -> moments`` (patchify + encoder + quant_conv) and
    ``decode_chunk(z, first_chunk) -> pixels`` (post_quant_conv + decoder + unpatchify,
    unclamped). patchify works frame by frame, so doing it per chunk equals diffusers doing
    it once on the whole video.
    Whole-video methods in the diffusers layout (Python loop over chunks inside one apply,
    also need ``mutable=["cache"]`` and a fresh cache): ``encode(video) -> DiagonalGaussian``,
    ``decode(z) -> video`` and ``__call__(video)`` = decode(encode(video).mode());
    :func:`abstract_params` initialises through one later chunk each way instead. For inference
    prefer the jitted module-level :func:`encode` / :func:`decode`.
    """

    config: WanVAEConfig
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    attention: str = "dot_product"
    mesh: jax.sharding.Mesh | None = None

    def setup(self):
        cfg = self.config
        kw = {"dtype": self.dtype, "param_dtype": self.param_dtype}
        shared = {"attention": self.attention, "mesh": self.mesh, **kw}
        self.encoder = Encoder(cfg, **shared)
        self.quant_conv = CausalConv3d(2 * cfg.z_dim, (1, 1, 1), padding=(0, 0, 0), **kw)
        self.post_quant_conv = CausalConv3d(cfg.z_dim, (1, 1, 1), padding=(0, 0, 0), **kw)
        self.decoder = Decoder(cfg, **shared)

    def encode_chunk(self, x_bthwc: jax.Array, first_chunk: bool) -> jax.Array:
        """One encoder chunk (1 frame first, then 4) -> 2 z_dim moment channels."""
        x = _constrain_video(x_bthwc.astype(self.dtype))
        x = residual.patchify(x, self.config.patch)
        return self.quant_conv(self.encoder(x, first_chunk))

    def decode_chunk(self, z_bthwc: jax.Array, first_chunk: bool) -> jax.Array:
        """One latent frame -> 1 frame (first chunk) or temporal_compression frames."""
        z = _constrain_video(z_bthwc.astype(self.dtype))
        patches = self.decoder(self.post_quant_conv(z), first_chunk)
        return residual.unpatchify(patches, self.config.patch)

    def encode(self, video_bcfhw: jax.Array) -> DiagonalGaussian:
        check_video(self.config, video_bcfhw.shape)
        x = _to_channel_last(video_bcfhw)
        chunks = encoder_chunks(x.shape[1])
        moments = [self.encode_chunk(x[:, s], i == 0) for i, s in enumerate(chunks)]
        return _moments_to_posterior(jnp.concatenate(moments, axis=1), self.config.z_dim)

    def decode(self, z_bcfhw: jax.Array) -> jax.Array:
        check_latents(self.config, z_bcfhw.shape)
        z = _to_channel_last(z_bcfhw)
        frames = [self.decode_chunk(z[:, i : i + 1], i == 0) for i in range(z.shape[1])]
        return _to_channel_first(jnp.clip(jnp.concatenate(frames, axis=1), -1.0, 1.0))

    def __call__(self, video_bcfhw: jax.Array) -> jax.Array:
        return self.decode(self.encode(video_bcfhw).mode())


# ----------------------------------------------------------------------------------------------
# Jitted chunk loops (the inference entry points)
# ----------------------------------------------------------------------------------------------


# XLA:CPU (jaxlib 0.10) hands 2-D convolutions, and elementwise ops around them, to YNNPACK
# fusions by default; for this VAE its Eigen convolutions are faster (5x64x64 / 9x128x128 on
# 2 cores: encode 1.2x / 1.1-1.2x, decode 1.2x / 1.3x). The chunk steps keep YNNPACK for
# dots only.
CPU_COMPILER_OPTIONS = {
    "xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"
}


@functools.lru_cache(maxsize=32)
def _chunk_step(module: WanVAE, method: str, top_level: bool = True):
    """jit(params, cache, x, first_chunk) -> (out, new cache); one compile per chunk shape.

    Compiler options only for a ``top_level`` step: jax refuses them on a jit traced inside
    another transformation (encode / decode called under jax.jit, eval_shape, ...).
    """

    def step(params, cache, x, first_chunk):
        variables = {"params": params, "cache": cache} if cache else {"params": params}
        out, updated = module.apply(variables, x, first_chunk, method=method, mutable=["cache"])
        return out, updated["cache"]

    options = cpu_compiler_options(**CPU_COMPILER_OPTIONS) if top_level else None
    return jax.jit(step, static_argnums=3, compiler_options=options)


def _run_chunks(module: WanVAE, params, method: str, chunks: Sequence[jax.Array]) -> list:
    """``method`` (encode_chunk / decode_chunk) on each chunk in order, carrying the cache."""
    leaves = jax.tree.leaves((params, chunks))
    traced = any(isinstance(leaf, jax.core.Tracer) for leaf in leaves)
    step = _chunk_step(module, method, not traced)
    cache: dict = {}
    outs = []
    for i, chunk in enumerate(chunks):
        out, cache = step(params, cache, chunk, i == 0)
        outs.append(out)
    return outs


def encode(module: WanVAE, params, video_bcfhw: jax.Array) -> DiagonalGaussian:
    """Encode ``[B, C, 1 + 4k, H, W]`` pixels in [-1, 1] -> posterior ``[B, z, 1 + k', H/s, W/s]``.

    Same chunking as diffusers' ``AutoencoderKLWan._encode`` (first frame, then 4 at a time),
    each chunk a jitted call carrying the causal cache. Returns (mean, logvar); logvar is
    clamped to [-30, 20] as in diffusers. Images are 1-frame videos. C is
    ``config.video_channels`` and s ``config.spatial_compression`` (patch_size included).
    """
    check_video(module.config, video_bcfhw.shape)
    x = _to_channel_last(jnp.asarray(video_bcfhw))
    chunks = [x[:, frames] for frames in encoder_chunks(x.shape[1])]
    moments = _run_chunks(module, params, "encode_chunk", chunks)
    return _moments_to_posterior(jnp.concatenate(moments, axis=1), module.config.z_dim)


def decode(module: WanVAE, params, z_bcfhw: jax.Array) -> jax.Array:
    """Decode latents ``[B, z, F, H, W]`` -> video ``[B, C, 1 + t(F - 1), s H, s W]`` in [-1, 1].

    One latent frame per jitted call, like diffusers' ``AutoencoderKLWan._decode`` (t, s: the
    temporal and spatial compression); output clamped to [-1, 1].
    """
    check_latents(module.config, z_bcfhw.shape)
    z = _to_channel_last(jnp.asarray(z_bcfhw))
    chunks = [z[:, i : i + 1] for i in range(z.shape[1])]
    frames = _run_chunks(module, params, "decode_chunk", chunks)
    return _to_channel_first(jnp.clip(jnp.concatenate(frames, axis=1), -1.0, 1.0))


def _latent_stats(z: jax.Array, config: WanVAEConfig) -> tuple[jax.Array, jax.Array]:
    if z.ndim != 5 or z.shape[1] != config.z_dim:
        raise ValueError(f"latents must be [B, {config.z_dim}, F, H, W], got shape {z.shape}")
    shape = (1, config.z_dim, 1, 1, 1)
    mean = jnp.asarray(config.latents_mean, z.dtype).reshape(shape)
    std = jnp.asarray(config.latents_std, z.dtype).reshape(shape)
    return mean, std


def normalize_latents(z: jax.Array, config: WanVAEConfig) -> jax.Array:
    """VAE latents -> the diffusion model's space: (z - latents_mean) / latents_std (WanPipeline)."""
    mean, std = _latent_stats(z, config)
    return (z - mean) / std


def denormalize_latents(z: jax.Array, config: WanVAEConfig) -> jax.Array:
    """Inverse of :func:`normalize_latents`: z * latents_std + latents_mean, before decoding."""
    mean, std = _latent_stats(z, config)
    return z * std + mean


# ----------------------------------------------------------------------------------------------
# Weights
# ----------------------------------------------------------------------------------------------


def _later_chunks(config: WanVAEConfig) -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
    """(a later encoder chunk: 4 frames at one latent pixel, channel-last; a later latent
    frame): the smallest inputs on which the chunk methods create every parameter. A later
    chunk runs every layer the first one does, plus the temporal resamplers' time convs."""
    s = config.spatial_compression
    video = (1, ENCODE_CHUNK_FRAMES, s, s, config.video_channels)
    return (
        jax.ShapeDtypeStruct(video, jnp.float32),
        jax.ShapeDtypeStruct((1, 1, 1, 1, config.z_dim), jnp.float32),
    )


def _create_parameters(module: WanVAE, video_chunk: jax.Array, latent_frame: jax.Array):
    """``init``'s method: one later chunk through the encoder and one through the decoder.
    Tracing the whole-video ``__call__`` (two chunks each way) doubled the tracing time, the
    largest part of loading the Wan 2.1 VAE before its weights are read."""
    module.encode_chunk(video_chunk, False)
    return module.decode_chunk(latent_frame, False)


def _create_encoder_parameters(module: WanVAE, video_chunk: jax.Array, latent_frame: jax.Array):
    """``init``'s method for an encoder-only load: the encoder and quant_conv."""
    return module.encode_chunk(video_chunk, False)


def _conv1x1_to_dense(w: np.ndarray) -> np.ndarray:
    """torch 1x1 Conv2d weight [O, I, 1, 1] -> flax Dense kernel [I, O]."""
    return w.reshape(w.shape[0], w.shape[1]).T


_CONV1X1_AS_DENSE = weights.Invertible(
    _conv1x1_to_dense, lambda k: k.T.reshape(k.shape[1], k.shape[0], 1, 1)
)


def _flatten_gamma(w: np.ndarray) -> np.ndarray:
    """WanRMS_norm gamma [C, 1, 1(, 1)] -> [C]."""
    return w.reshape(-1)


def _source_entry(path: tuple[str, ...], ndim: int) -> tuple[str, weights.Transform]:
    """Flax param path -> (diffusers key, transform). Module names mirror diffusers attribute
    names, with list indices written ``name_3`` for diffusers' ``name.3``."""
    *modules, leaf = path
    key = ".".join(re.sub(r"_(\d+)$", r".\1", m) for m in modules)
    if leaf == "gamma":
        # diffusers WanRMS_norm keeps gamma as [C, 1, 1] (images=True, attention) or [C, 1, 1, 1]
        ones = (1, 1) if ".attentions." in f".{key}." else (1, 1, 1)
        return f"{key}.gamma", weights.Invertible(
            _flatten_gamma, lambda g: g.reshape(g.shape[0], *ones)
        )
    if leaf == "bias":
        return f"{key}.bias", weights.identity
    if leaf != "kernel":
        raise ValueError(f"no diffusers name for parameter {'/'.join(path)}")
    transform = {5: weights.conv3d, 4: weights.conv2d, 2: _CONV1X1_AS_DENSE}[ndim]
    return f"{key}.weight", transform


def _fill(name: str, shape: tuple[int, ...], dtype: Dtype) -> jax.Array:
    """Random init of every parameter but the kernels: biases zero, gammas one."""
    return PARAM_INITIALIZERS[name](None, shape, dtype)


# build / load / init / shape / count, as AutoencoderKL's (jaxcore.weights.VAEKind)
KIND = weights.VAEKind(
    WanVAE,
    WanVAEConfig,
    _later_chunks,
    lambda config, boxed: weights.weight_map_by_path(boxed, _source_entry),
    trace_method=_create_parameters,
    encoder_method=_create_encoder_parameters,
    fill=_fill,
)
abstract_params = KIND.abstract_params


def weight_map(config: WanVAEConfig) -> dict:
    """{flax param path: (diffusers AutoencoderKLWan key, transform)} for weights.load_params."""
    return KIND.weight_map(config, abstract_params(WanVAE(config)))


def load_wan_vae(directory: str | os.PathLike, *, dtype: Dtype = jnp.float32, **options):
    """:meth:`jaxcore.weights.VAEKind.load` of a diffusers ``AutoencoderKLWan`` directory, with
    activations and parameters both in ``dtype`` (``attention``, ``mesh``, ``rules`` and
    ``encoder_only`` as there): ``(module, params)``."""
    return KIND.load(directory, dtype=dtype, param_dtype=dtype, **options)


def init_wan_vae(config: WanVAEConfig, rng: jax.Array, *, dtype: Dtype = jnp.float32, **options):
    """:meth:`jaxcore.weights.VAEKind.init` with activations and parameters both in ``dtype``."""
    return KIND.init(config, rng, dtype=dtype, param_dtype=dtype, **options)
