"""LTX-2 video VAE in Flax linen, numerically equal to diffusers' ``AutoencoderKLLTX2Video``.

Reference: ``diffusers/models/autoencoders/autoencoder_kl_ltx2.py`` (diffusers 0.42) and the
decode / image-conditioning steps of ``pipelines/ltx2/pipeline_ltx2.py`` and
``pipeline_ltx2_image2video.py``. The released LTX-2 VAE is diffusers' class defaults with
``decoder_causal=False`` and compression ratios 32 / 8 stated in its config
(``scripts/convert_ltx2_to_diffusers.py``, ``get_ltx2_video_vae_config("2.0")``).

The computation is LTX-Video 0.9.5's (:mod:`jaxcore.models.ltx_vae`): causal 3-D convs that pad
time with copies of the edge frames, parameter-free RMS norms, space-to-depth downsamplers,
depth-to-space upsamplers, a decoder optionally conditioned on the decode timestep, and
per-channel latent statistics. What LTX-2 changes, and so what this file implements itself:
- every conv's H / W padding follows ``encoder_spatial_padding_mode`` /
  ``decoder_spatial_padding_mode`` (torch ``padding_mode``; the released decoder uses
  ``"reflect"``), where ltx_vae's convs always zero-pad;
- the encoder's ``conv_in`` maps to ``latent_channels``, and every down block is
  ``LTX2VideoDownBlock3D`` (resnets at its input width, then a ``downsample_type`` of
  ``"conv"`` / ``"spatial"`` / ``"temporal"`` / ``"spatiotemporal"``); the mid block runs at
  ``block_out_channels[-1]``;
- each decoder up block upsamples by its own ``upsample_type`` stride (ltx_vae: always
  (2, 2, 2)); the first ``stride_t - 1`` frames are dropped, so F latent frames decode to
  ``1 + stride_t (F - 1)`` per level;
- a resnet's width-changing shortcut is a plain ``nn.Conv3d`` (key ``conv_shortcut.weight``,
  not ``conv_shortcut.conv.weight``).
Reused from ltx_vae unchanged: the pixel norm, time padding, space-to-depth / depth-to-space,
patchify / unpatchify, the time embedder, the posterior split, the decode-timestep and noise
bookkeeping, the weight-name rule and the parameter fills. Packing into transformer tokens is
:mod:`jaxcore.models.ltx_transformer`'s (LTX-2's ``_pack_latents`` is LTX-Video's).

Layout: public tensors use the diffusers layout, video ``[B, C, F, H, W]`` (pixels in [-1, 1])
and latents ``[B, latent_channels, F', H', W']``; inside, activations are channel-last
``[B, T, H, W, C]``. The whole video goes through at once, as diffusers does by default
(tiling and framewise encode / decode are runtime switches there and are not implemented).
diffusers' runtime ``causal=`` argument is not exposed: it can only force causal convs
(``causal or self.is_causal``) and no pipeline passes it; the config's flags decide.

Pipeline steps (both LTX-2 pipelines): the transformer's latents are normalised per channel,
``(z - mean) * scaling_factor / std`` (:func:`normalize_latents`); the image-to-video pipeline
encodes its condition image as a one-frame video, takes the posterior's mode and normalises it
with scaling factor 1.0, not the config's (:func:`encode_condition_latents`). Before decoding
a timestep-conditioned VAE, the pipeline mixes noise into the *normalised* latents,
``(1 - s) z + s noise`` with ``s = decode_noise_scale`` (default: the decode timestep), then
denormalises and decodes at ``decode_timestep`` (:func:`decode_inputs`); without conditioning
it denormalises and decodes with no timestep. LTX-Video mixes after denormalising instead.

Calls a family makes (s = spatial_compression, t = temporal_compression; 32 / 8 released):
- ``encode(module, params, video [B, 3, 1 + t k, s h, s w]) -> DiagonalGaussian`` of
  ``[B, latent, 1 + k, h, w]`` (``.mode()`` / ``.mean``; ``.sample(key)``);
- ``decode(module, params, z [B, latent, F, h, w], temb=None | [B] | scalar, noise=/rng=)``
  -> ``[B, 3, 1 + t (F - 1), s h, s w]`` (:func:`video_shape`);
- ``decode_inputs(latents, params, config, decode_timestep=, decode_noise_scale=,
  noise_bcfhw=) -> (z, temb)`` before that ``decode``; ``encode_condition_latents(module,
  params, images [B, 3, s h, s w]) -> [B, latent, 1, h, w]`` for image-to-video.

Parity reached (tests/jaxcore/test_ltx2_vae.py, fp32 on CPU, every diffusers parameter and
buffer perturbed, ``jax_default_matmul_precision="highest"``): encoder mean / logvar <= 1.5e-6
and decoder <= 3.3e-6 relative to the largest output (<= 7.9e-6 max abs) on a released-like
tiny config and on one with timestep conditioning, injected noise, a "conv" downsampler and
reflect padding in the encoder; test bound 1e-5. Parameter count equals diffusers' for the
released config: 1,222,479,601 (1,246,913,522 with ``timestep_conditioning``; diffusers then
builds exactly the state-dict keys and shapes of LTX-Video 0.9.5's VAE: LTX-2 keeps that
architecture and changes padding, causality and the conditioning flag).

Public API: :class:`LTX2VideoVAEConfig`, :class:`LTX2VideoVAE`, :func:`encode`, :func:`decode`,
:func:`decode_inputs`, :func:`encode_condition_latents`, :func:`normalize_latents`,
:func:`denormalize_latents`, :func:`pack_latents`, :func:`unpack_latents`,
:func:`latent_shape`, :func:`video_shape`, :func:`check_video`, :func:`check_latents`,
:func:`decoder_noise_shapes`, :func:`sample_decoder_noise`, :func:`weight_map`,
:func:`abstract_params`, :func:`count_params`, :func:`load_ltx2_vae`, :func:`init_ltx2_vae`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import linen as nn

from jaxcore import weights
from jaxcore.config import config_json_kwargs
from jaxcore.models import ltx_vae
from jaxcore.models.layers import AffineLayerNorm, silu

# LTX-2's _pack_latents / _unpack_latents are LTX-Video's: re-exported for the family.
from jaxcore.models.ltx_transformer import pack_latents, unpack_latents  # noqa: F401
from jaxcore.models.ltx_vae import (
    TimeEmbedder,
    depth_to_space,
    mix_decode_noise,
    patchify,
    pixel_norm,
    replicate_pad_time,
    space_to_depth,
    unpatchify,
)
from jaxcore.models.wan_vae import DiagonalGaussian

Dtype = Any

DOWN_BLOCK = "LTX2VideoDownBlock3D"
# downsample_type / upsample_type -> stride (T, H, W). The encoder also knows "conv": a
# stride-2 causal conv that keeps the width.
SCALING_STRIDES = ltx_vae.DOWNSAMPLE_STRIDES
CONV_DOWNSAMPLE = "conv"
# torch Conv3d padding_mode -> jnp.pad mode.
PADDING_MODES = {"zeros": "constant", "reflect": "reflect", "replicate": "edge", "circular": "wrap"}


# ----------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------


class LTX2VideoVAEConfigError(ValueError):
    """A config.json / YAML section LTX2VideoVAEConfig cannot represent; names the key."""


class EncoderLevel(NamedTuple):
    """One ``LTX2VideoDownBlock3D``: ``num_layers`` resnets at ``in_channels``, then
    ``downsample`` (None, ``"conv"`` or a space-to-depth stride (T, H, W)) to ``out_channels``."""

    in_channels: int
    out_channels: int
    num_layers: int
    downsample: str | tuple[int, int, int] | None


class DecoderLevel(NamedTuple):
    """One ``LTX2VideoUpBlock3d`` as diffusers builds it: ``in_channels`` is its nominal
    ``previous out // factor``; a ``conv_in`` resnet exists where it differs from
    ``out_channels``; ``upsample`` is the upsampler's stride (T, H, W) or None."""

    in_channels: int
    out_channels: int
    num_layers: int
    upsample: tuple[int, int, int] | None
    residual: bool
    factor: int
    inject_noise: bool

    @property
    def conv_in(self) -> bool:
        return self.in_channels != self.out_channels


def _reversed(values) -> tuple:
    return tuple(reversed(tuple(values)))


@dataclasses.dataclass(frozen=True)
class LTX2VideoVAEConfig:
    """Architecture of the LTX-2 video VAE; field names and defaults are diffusers'
    ``AutoencoderKLLTX2Video`` arguments (``from_dict(config.json)`` is direct).

    As in diffusers, a bool ``spatio_temporal_scaling`` / ``decoder_spatio_temporal_scaling``
    / ``decoder_inject_noise`` / ``upsample_residual`` stands for one value per block, and the
    decoder reads ``decoder_*``, ``upsample_residual`` and ``upsample_factor`` reversed (their
    last entry is the innermost level) but ``upsample_type`` in order (its first entry is the
    innermost level). ``spatial_compression_ratio`` / ``temporal_compression_ratio`` are
    metadata the pipelines read; :attr:`spatial_compression` / :attr:`temporal_compression`
    are the factors the encoder really has (diffusers' fallback formula counts every scaling
    level as 2x in space and time, wrong for LTX-2's layout, hence the released config states
    32 / 8).

    Refused, naming the key, where diffusers cannot build or run the model either:
    ``patch_size_t`` != 1, unknown block / scaling / padding types, widths the blocks cannot
    chain, and a decoder ``conv_in`` resnet with timestep conditioning or noise injection.
    """

    in_channels: int = 3
    out_channels: int = 3
    latent_channels: int = 128
    block_out_channels: tuple[int, ...] = (256, 512, 1024, 2048)
    down_block_types: tuple[str, ...] = (DOWN_BLOCK,) * 4
    decoder_block_out_channels: tuple[int, ...] = (256, 512, 1024)
    layers_per_block: tuple[int, ...] = (4, 6, 6, 2, 2)
    decoder_layers_per_block: tuple[int, ...] = (5, 5, 5, 5)
    spatio_temporal_scaling: bool | tuple[bool, ...] = (True, True, True, True)
    decoder_spatio_temporal_scaling: bool | tuple[bool, ...] = (True, True, True)
    decoder_inject_noise: bool | tuple[bool, ...] = (False, False, False, False)
    downsample_type: tuple[str, ...] = ("spatial", "temporal", "spatiotemporal", "spatiotemporal")
    upsample_type: tuple[str, ...] = ("spatiotemporal",) * 3
    upsample_residual: bool | tuple[bool, ...] = (True, True, True)
    upsample_factor: tuple[int, ...] = (2, 2, 2)
    timestep_conditioning: bool = False
    patch_size: int = 4
    patch_size_t: int = 1
    resnet_norm_eps: float = 1e-6
    scaling_factor: float = 1.0
    encoder_causal: bool = True
    decoder_causal: bool = True
    encoder_spatial_padding_mode: str = "zeros"
    decoder_spatial_padding_mode: str = "reflect"
    spatial_compression_ratio: int | None = None
    temporal_compression_ratio: int | None = None

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if isinstance(getattr(self, f.name), list):
                object.__setattr__(self, f.name, tuple(getattr(self, f.name)))
        self._expand_bools()
        for key in ("in_channels", "out_channels", "latent_channels", "patch_size"):
            if int(getattr(self, key)) < 1:
                raise LTX2VideoVAEConfigError(f"{key} must be >= 1, got {getattr(self, key)!r}")
        if self.patch_size_t != 1:
            raise LTX2VideoVAEConfigError(
                f"patch_size_t={self.patch_size_t} is not supported: diffusers sizes the "
                "encoder's conv_in and the decoder's conv_out for patch_size**2 only"
            )
        for key in ("encoder_spatial_padding_mode", "decoder_spatial_padding_mode"):
            if getattr(self, key) not in PADDING_MODES:
                raise LTX2VideoVAEConfigError(
                    f"{key} = {getattr(self, key)!r}; known: {list(PADDING_MODES)}"
                )
        self._check_encoder()
        self._check_decoder()

    def _expand_bools(self) -> None:
        """diffusers' bool shorthands, expanded to one value per block as its __init__ does."""
        n_enc, n_dec = len(self.layers_per_block), len(self.decoder_layers_per_block)
        counts = {
            "spatio_temporal_scaling": n_enc - 1,
            "decoder_spatio_temporal_scaling": n_dec - 1,
            "decoder_inject_noise": n_dec,
            "upsample_residual": n_dec - 1,
        }
        for key, count in counts.items():
            if isinstance(getattr(self, key), bool):
                object.__setattr__(self, key, (getattr(self, key),) * count)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LTX2VideoVAEConfig:
        """Build from a diffusers config.json dict (``_``-prefixed keys ignored; any other
        unknown key is an error naming it)."""
        return cls(**config_json_kwargs(cls, d, LTX2VideoVAEConfigError))

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}

    # --- encoder ---------------------------------------------------------------------------

    @property
    def encoder_levels(self) -> tuple[EncoderLevel, ...]:
        """The down blocks, mirroring ``LTX2VideoEncoder3d.__init__``: block i maps the
        previous width (``latent_channels`` after conv_in) to ``block_out_channels[i]``."""
        channels = self.latent_channels
        levels = []
        for i, out in enumerate(self.block_out_channels):
            down = None
            if self.spatio_temporal_scaling[i]:
                kind = self.downsample_type[i]
                down = kind if kind == CONV_DOWNSAMPLE else SCALING_STRIDES[kind]
            levels.append(EncoderLevel(channels, out, self.layers_per_block[i], down))
            channels = out
        return tuple(levels)

    def _check_encoder(self) -> None:
        boc = self.block_out_channels
        if not boc or min(boc) < 1:
            raise LTX2VideoVAEConfigError(f"block_out_channels must be positive ints, got {boc}")
        n = len(boc)
        # layers_per_block first: the bool shorthand of spatio_temporal_scaling follows its length.
        for key in ("layers_per_block", "down_block_types", "spatio_temporal_scaling"):
            if len(getattr(self, key)) < n:
                raise LTX2VideoVAEConfigError(
                    f"{key} has {len(getattr(self, key))} entries; block_out_channels asks for "
                    f"{n} encoder blocks"
                )
        for i in range(n):
            if self.down_block_types[i] != DOWN_BLOCK:
                raise LTX2VideoVAEConfigError(
                    f"down_block_types[{i}] = {self.down_block_types[i]!r}; known: {[DOWN_BLOCK]}"
                )
            if self.spatio_temporal_scaling[i]:
                if len(self.downsample_type) <= i:
                    raise LTX2VideoVAEConfigError(f"downsample_type has no entry for block {i}")
                kind = self.downsample_type[i]
                if kind != CONV_DOWNSAMPLE and kind not in SCALING_STRIDES:
                    raise LTX2VideoVAEConfigError(
                        f"downsample_type[{i}] = {kind!r}; known: "
                        f"{[CONV_DOWNSAMPLE, *SCALING_STRIDES]}"
                    )
        for i, level in enumerate(self.encoder_levels):
            _check_encoder_level(i, level)

    # --- decoder ---------------------------------------------------------------------------

    @property
    def decoder_width(self) -> int:
        """Channels of the decoder's conv_in and mid block (innermost decoder width)."""
        return self.decoder_block_out_channels[-1]

    @property
    def decoder_mid(self) -> tuple[int, bool]:
        """(num_layers, inject_noise) of the decoder's mid block."""
        return self.decoder_layers_per_block[-1], bool(self.decoder_inject_noise[-1])

    @property
    def decoder_levels(self) -> tuple[DecoderLevel, ...]:
        """The up blocks, mirroring ``LTX2VideoDecoder3d.__init__`` (tuples reversed but
        upsample_type, then ``in = previous out // factor``, ``out = channels // factor``)."""
        boc = _reversed(self.decoder_block_out_channels)
        scaling = _reversed(self.decoder_spatio_temporal_scaling)
        layers = _reversed(self.decoder_layers_per_block)
        inject = _reversed(self.decoder_inject_noise)
        residual = _reversed(self.upsample_residual)
        factor = _reversed(self.upsample_factor)
        out = boc[0]
        levels = []
        for i in range(len(boc)):
            c_in, out = out // factor[i], boc[i] // factor[i]
            stride = SCALING_STRIDES[self.upsample_type[i]] if scaling[i] else None
            levels.append(
                DecoderLevel(
                    c_in,
                    out,
                    layers[i + 1],
                    stride,
                    bool(residual[i]),
                    int(factor[i]),
                    bool(inject[i + 1]),
                )
            )
        return tuple(levels)

    def _check_decoder(self) -> None:
        boc = self.decoder_block_out_channels
        if not boc or min(boc) < 1:
            raise LTX2VideoVAEConfigError(
                f"decoder_block_out_channels must be positive ints, got {boc}"
            )
        n = len(boc)
        needed = {
            "decoder_spatio_temporal_scaling": n,
            "upsample_type": n,
            "upsample_residual": n,
            "upsample_factor": n,
            "decoder_layers_per_block": n + 1,
            "decoder_inject_noise": n + 1,
        }
        for key, count in needed.items():
            if len(getattr(self, key)) < count:
                raise LTX2VideoVAEConfigError(
                    f"{key} has {len(getattr(self, key))} entries; the decoder's {n} up blocks "
                    f"(decoder_block_out_channels) need {count}"
                )
        if any(int(f) < 1 for f in self.upsample_factor):
            raise LTX2VideoVAEConfigError(
                f"upsample_factor must be >= 1, got {self.upsample_factor}"
            )
        scaling = _reversed(self.decoder_spatio_temporal_scaling)
        for i in range(n):
            if scaling[i] and self.upsample_type[i] not in SCALING_STRIDES:
                raise LTX2VideoVAEConfigError(
                    f"upsample_type[{i}] = {self.upsample_type[i]!r}; known: {list(SCALING_STRIDES)}"
                )
        channels = self.decoder_width
        for i, level in enumerate(self.decoder_levels):
            channels = self._check_decoder_level(i, level, channels)

    def _check_decoder_level(self, i: int, level: DecoderLevel, channels: int) -> int:
        """Follow the channels through up block ``i`` as diffusers would run it; a width its
        layers would reject is an error here. Returns the block's output width."""
        where = f"up block {i} (decoder_block_out_channels / upsample_factor, read reversed)"
        if level.conv_in:
            if self.timestep_conditioning or level.inject_noise:
                raise LTX2VideoVAEConfigError(
                    f"{where} changes width {level.in_channels} -> {level.out_channels} through a "
                    "conv_in resnet, which diffusers cannot run with timestep_conditioning or "
                    "decoder_inject_noise (it passes that resnet the raw timestep, and sizes its "
                    "noise scales and time embedder for the input width)"
                )
            if channels != level.in_channels:
                raise LTX2VideoVAEConfigError(
                    f"{where}: gets {channels} channels but its conv_in expects {level.in_channels}"
                )
            channels = level.out_channels
        if level.upsample is None:
            if channels != level.out_channels:
                raise LTX2VideoVAEConfigError(
                    f"{where} has no upsampler (decoder_spatio_temporal_scaling) but gets "
                    f"{channels} channels for {level.out_channels}"
                )
            return channels
        prod = math.prod(level.upsample)
        if channels != level.out_channels * level.factor:
            raise LTX2VideoVAEConfigError(
                f"{where}: its upsampler gets {channels} channels but expects "
                f"{level.out_channels} x upsample_factor {level.factor}"
            )
        if level.residual and (channels % prod or prod % level.factor):
            raise LTX2VideoVAEConfigError(
                f"{where}: upsample_residual folds {channels} channels by the stride's {prod} "
                f"and tiles them {prod} / upsample_factor {level.factor} times: both must divide"
            )
        return level.out_channels

    # --- shapes ----------------------------------------------------------------------------

    @property
    def spatial_compression(self) -> int:
        """Pixels per latent along H and W: patch_size times the encoder's spatial strides."""
        s = self.patch_size
        for level in self.encoder_levels:
            if level.downsample is not None:
                s *= 2 if level.downsample == CONV_DOWNSAMPLE else level.downsample[1]
        return s

    @property
    def temporal_compression(self) -> int:
        """Frames per latent frame after the first: 1 + t k frames <-> 1 + k latent frames."""
        t = self.patch_size_t
        for level in self.encoder_levels:
            if level.downsample is not None:
                t *= 2 if level.downsample == CONV_DOWNSAMPLE else level.downsample[0]
        return t

    @property
    def injects_noise(self) -> bool:
        """Whether decoding draws noise (any block with decoder_inject_noise)."""
        return self.decoder_mid[1] or any(level.inject_noise for level in self.decoder_levels)


def _check_encoder_level(i: int, level: EncoderLevel) -> None:
    """The widths down block ``i`` can produce: resnets and the "conv" downsampler keep the
    width, a space-to-depth downsampler folds it to ``out``; diffusers builds the next block
    (or the mid block) for ``block_out_channels[i]`` whatever the block produced."""
    if level.num_layers < 0:
        raise LTX2VideoVAEConfigError(f"layers_per_block[{i}] must be >= 0")
    c_in, c_out = level.in_channels, level.out_channels
    if not isinstance(level.downsample, tuple):
        if c_in != c_out:
            raise LTX2VideoVAEConfigError(
                f"down block {i} keeps its {c_in} channels (no space-to-depth downsampler: "
                f"spatio_temporal_scaling / downsample_type[{i}]) but block_out_channels[{i}] "
                f"is {c_out} (block 0 starts at latent_channels)"
            )
        return
    prod = math.prod(level.downsample)
    if c_out % prod or (c_in * prod) % c_out:
        raise LTX2VideoVAEConfigError(
            f"down block {i}: downsample_type[{i}] folds {prod} pixels into channels, so "
            f"{c_in} -> block_out_channels[{i}] = {c_out} needs {c_out} divisible by {prod} and "
            f"{c_in} x {prod} divisible by {c_out}"
        )


# ----------------------------------------------------------------------------------------------
# Layers (channel-last)
# ----------------------------------------------------------------------------------------------


class Conv3d(nn.Module):
    """torch ``nn.Conv3d(k, stride, padding=(0, k // 2, k // 2), padding_mode=...)`` on
    ``[B, T, H, W, C]``: time unpadded (:class:`CausalConv3d` pads it), H / W padded by
    ``padding_mode`` (torch's names: zeros, reflect, replicate, circular)."""

    features: int
    kernel_size: int = 3
    strides: tuple[int, int, int] = (1, 1, 1)
    padding_mode: str = "zeros"
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x_bthwc: jax.Array) -> jax.Array:
        k = self.kernel_size
        shape = (k, k, k, x_bthwc.shape[-1], self.features)
        kernel = self.param("kernel", ltx_vae._KERNEL_INIT, shape, self.param_dtype)
        bias = self.param("bias", ltx_vae._BIAS_INIT, (self.features,), self.param_dtype)
        x = x_bthwc.astype(self.dtype)
        pad = k // 2
        spatial = ((0, 0), (pad, pad), (pad, pad))
        if pad and self.padding_mode != "zeros":
            # torch pads first (F.pad) and convolves unpadded for every mode but zeros.
            mode = PADDING_MODES[self.padding_mode]
            x = jnp.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad), (0, 0)), mode=mode)
            spatial = ((0, 0), (0, 0), (0, 0))
        y = jax.lax.conv_general_dilated(
            x,
            kernel.astype(self.dtype),
            window_strides=self.strides,
            padding=spatial,
            dimension_numbers=("NDHWC", "DHWIO", "NDHWC"),
        )
        return y + bias.astype(self.dtype)


class CausalConv3d(nn.Module):
    """diffusers ``LTX2VideoCausalConv3d``: time padded with copies of the edge frames
    (:func:`ltx_vae.replicate_pad_time`), then the :class:`Conv3d` (parameters under
    ``conv``, as diffusers' ``self.conv``)."""

    features: int
    kernel_size: int = 3
    strides: tuple[int, int, int] = (1, 1, 1)
    is_causal: bool = True
    padding_mode: str = "zeros"
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x_bthwc: jax.Array) -> jax.Array:
        x = replicate_pad_time(x_bthwc, self.kernel_size, self.is_causal)
        conv = Conv3d(
            self.features,
            self.kernel_size,
            self.strides,
            self.padding_mode,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            name="conv",
        )
        return conv(x)


class ConvOptions(NamedTuple):
    """What every conv of one half of the VAE shares (encoder or decoder)."""

    is_causal: bool
    padding_mode: str
    eps: float


class ResnetBlock3d(nn.Module):
    """diffusers ``LTX2VideoResnetBlock3d``: (RMS norm, [timestep scale/shift], SiLU, causal
    conv, [noise]) x 2, plus the input, through ``norm3`` (LayerNorm) and a plain 1x1x1
    ``conv_shortcut`` when the width changes.

    ``temb``: ``[B, 4 C]`` (embedded by the block) with ``timestep_conditioning``; ``noise``:
    two ``[H, W]`` arrays with ``inject_noise`` (diffusers' two ``torch.randn`` draws), added
    as ``noise[h, w] * per_channel_scale[c]`` to every sample and frame.
    """

    out_channels: int
    options: ConvOptions
    inject_noise: bool = False
    timestep_conditioning: bool = False
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, temb=None, noise: Sequence[jax.Array] = ()) -> jax.Array:
        kw = {"dtype": self.dtype, "param_dtype": self.param_dtype}
        conv_kw = {"is_causal": self.options.is_causal, "padding_mode": self.options.padding_mode}
        c_in = x.shape[-1]
        h = pixel_norm(x.astype(self.dtype))
        if self.timestep_conditioning:
            table = self.param(
                "scale_shift_table", ltx_vae._TABLE_INIT, (4, c_in), self.param_dtype
            )
            mod = temb.reshape(temb.shape[0], 4, c_in) + table.astype(self.dtype)[None]
            shift_1, scale_1, shift_2, scale_2 = (ltx_vae._per_sample(mod[:, i]) for i in range(4))
            h = h * (1 + scale_1) + shift_1
        h = CausalConv3d(self.out_channels, name="conv1", **conv_kw, **kw)(silu(h))
        if self.inject_noise:
            h = self._add_noise(h, noise[0], "per_channel_scale1", c_in)
        h = pixel_norm(h)
        if self.timestep_conditioning:
            h = h * (1 + scale_2) + shift_2
        h = CausalConv3d(self.out_channels, name="conv2", **conv_kw, **kw)(silu(h))
        if self.inject_noise:
            h = self._add_noise(h, noise[1], "per_channel_scale2", c_in)
        shortcut = x
        if c_in != self.out_channels:
            shortcut = AffineLayerNorm(eps=self.options.eps, name="norm3", **kw)(x)
            shortcut = Conv3d(self.out_channels, kernel_size=1, name="conv_shortcut", **kw)(
                shortcut
            )
        return h + shortcut.astype(self.dtype)

    def _add_noise(self, h, noise_hw, name, channels):
        # diffusers sizes the scale by the block's INPUT width (equal to its output wherever
        # diffusers can run it; LTX2VideoVAEConfig refuses the rest).
        scale = self.param(name, ltx_vae._CHANNEL_ZEROS, (channels,), self.param_dtype)
        if tuple(noise_hw.shape) != tuple(h.shape[2:4]):
            raise ValueError(
                f"{self.name}: noise has shape {tuple(noise_hw.shape)} but this resnet runs at "
                f"{tuple(h.shape[2:4])} (see decoder_noise_shapes)"
            )
        spatial = noise_hw.astype(self.dtype)[:, :, None] * scale.astype(self.dtype)
        return h + spatial[None, None]


class Downsampler3d(nn.Module):
    """diffusers ``LTX2VideoDownsampler3d``: prepend ``s_t - 1`` copies of the first frame,
    then a stride-1 causal conv to ``out / (s_t s_h s_w)`` channels folded to ``out`` by
    :func:`space_to_depth`, plus the input folded the same way and averaged over groups of
    ``in s_t s_h s_w / out`` channels (LTX-Video 0.9.5's downsampler)."""

    out_channels: int
    stride: tuple[int, int, int]
    options: ConvOptions
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        prod = math.prod(self.stride)
        group = x.shape[-1] * prod // self.out_channels
        x = jnp.concatenate([x[:, : self.stride[0] - 1], x], axis=1)
        shortcut = space_to_depth(x, self.stride)
        shortcut = shortcut.reshape(*shortcut.shape[:-1], -1, group).mean(axis=-1)
        h = CausalConv3d(
            self.out_channels // prod,
            is_causal=self.options.is_causal,
            padding_mode=self.options.padding_mode,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            name="conv",
        )(x)
        return space_to_depth(h, self.stride) + shortcut


class Upsampler3d(nn.Module):
    """diffusers ``LTX2VideoUpsampler3d``: a causal conv to ``prod(stride) C / factor``
    channels unfolded by :func:`depth_to_space` to ``C / factor`` channels, the first
    ``s_t - 1`` frames dropped (F -> s_t F - s_t + 1). ``residual``: plus the input unfolded
    the same way (``C / prod(stride)`` channels) and tiled ``prod(stride) / factor`` times."""

    stride: tuple[int, int, int]
    options: ConvOptions
    residual: bool = False
    upscale_factor: int = 1
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        prod = math.prod(self.stride)
        conv = CausalConv3d(
            x.shape[-1] * prod // self.upscale_factor,
            is_causal=self.options.is_causal,
            padding_mode=self.options.padding_mode,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            name="conv",
        )
        drop = self.stride[0] - 1
        h = depth_to_space(conv(x), self.stride)[:, drop:]
        if self.residual:
            shortcut = depth_to_space(x, self.stride)[:, drop:]
            h = h + jnp.tile(shortcut, (1, 1, 1, 1, prod // self.upscale_factor))
        return h


class DownBlock3D(nn.Module):
    """diffusers ``LTX2VideoDownBlock3D``: resnets at the input width, then the level's
    downsampler (``downsamplers_0``: a stride-2 causal conv for ``"conv"``, else a
    :class:`Downsampler3d` with that stride)."""

    level: EncoderLevel
    options: ConvOptions
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kw = {"dtype": self.dtype, "param_dtype": self.param_dtype}
        lv, opt = self.level, self.options
        for i in range(lv.num_layers):
            x = ResnetBlock3d(lv.in_channels, opt, name=f"resnets_{i}", **kw)(x)
        if lv.downsample == CONV_DOWNSAMPLE:
            down = CausalConv3d(
                lv.in_channels,
                strides=(2, 2, 2),
                is_causal=opt.is_causal,
                padding_mode=opt.padding_mode,
                name="downsamplers_0",
                **kw,
            )
            x = down(x)
        elif lv.downsample is not None:
            x = Downsampler3d(lv.out_channels, lv.downsample, opt, name="downsamplers_0", **kw)(x)
        return x


class MidBlock3d(nn.Module):
    """diffusers ``LTX2VideoMidBlock3d``: ``num_layers`` resnets at the input width; with
    timestep conditioning its ``time_embedder`` turns the (scaled) timestep into their
    ``[B, 4 C]`` modulation."""

    num_layers: int
    options: ConvOptions
    inject_noise: bool = False
    timestep_conditioning: bool = False
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, temb=None, noise: Sequence[jax.Array] = ()) -> jax.Array:
        kw = {"dtype": self.dtype, "param_dtype": self.param_dtype}
        channels = x.shape[-1]
        emb = None
        if self.timestep_conditioning:
            emb = TimeEmbedder(4 * channels, name="time_embedder", **kw)(temb)
        runs = ltx_vae._split_noise(noise, [2 if self.inject_noise else 0] * self.num_layers)
        for i in range(self.num_layers):
            x = ResnetBlock3d(
                channels,
                self.options,
                self.inject_noise,
                self.timestep_conditioning,
                name=f"resnets_{i}",
                **kw,
            )(x, emb, runs[i])
        return x


class UpBlock3d(nn.Module):
    """diffusers ``LTX2VideoUpBlock3d``: [``conv_in`` resnet changing width], [time embedder],
    the :class:`Upsampler3d` (``upsamplers_0``), then ``num_layers`` resnets."""

    level: DecoderLevel
    options: ConvOptions
    timestep_conditioning: bool = False
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, temb=None, noise: Sequence[jax.Array] = ()) -> jax.Array:
        kw = {"dtype": self.dtype, "param_dtype": self.param_dtype}
        lv, opt = self.level, self.options
        if lv.conv_in:  # never with conditioning or noise (LTX2VideoVAEConfig refuses those)
            x = ResnetBlock3d(lv.out_channels, opt, name="conv_in", **kw)(x)
        emb = None
        if self.timestep_conditioning:
            emb = TimeEmbedder(4 * lv.in_channels, name="time_embedder", **kw)(temb)
        if lv.upsample is not None:
            up = Upsampler3d(lv.upsample, opt, lv.residual, lv.factor, name="upsamplers_0", **kw)
            x = up(x)
        runs = ltx_vae._split_noise(noise, [2 if lv.inject_noise else 0] * lv.num_layers)
        for i in range(lv.num_layers):
            x = ResnetBlock3d(
                lv.out_channels,
                opt,
                lv.inject_noise,
                self.timestep_conditioning,
                name=f"resnets_{i}",
                **kw,
            )(x, emb, runs[i])
        return x


def _encoder_options(cfg: LTX2VideoVAEConfig) -> ConvOptions:
    return ConvOptions(cfg.encoder_causal, cfg.encoder_spatial_padding_mode, cfg.resnet_norm_eps)


def _decoder_options(cfg: LTX2VideoVAEConfig) -> ConvOptions:
    return ConvOptions(cfg.decoder_causal, cfg.decoder_spatial_padding_mode, cfg.resnet_norm_eps)


class Encoder3d(nn.Module):
    """diffusers ``LTX2VideoEncoder3d``: patchify, conv_in (to ``latent_channels``), down
    blocks, mid block, RMS norm, SiLU, conv_out -> ``latent_channels + 1`` channels (means,
    then the log-variance every channel shares)."""

    config: LTX2VideoVAEConfig
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x_bthwc: jax.Array) -> jax.Array:
        cfg = self.config
        kw = {"dtype": self.dtype, "param_dtype": self.param_dtype}
        opt = _encoder_options(cfg)
        conv_kw = {"is_causal": opt.is_causal, "padding_mode": opt.padding_mode, **kw}
        x = patchify(x_bthwc, cfg.patch_size)
        x = CausalConv3d(cfg.latent_channels, name="conv_in", **conv_kw)(x)
        for i, level in enumerate(cfg.encoder_levels):
            x = DownBlock3D(level, opt, name=f"down_blocks_{i}", **kw)(x)
        x = MidBlock3d(cfg.layers_per_block[-1], opt, name="mid_block", **kw)(x)
        x = silu(pixel_norm(x))
        return CausalConv3d(cfg.latent_channels + 1, name="conv_out", **conv_kw)(x)


class Decoder3d(nn.Module):
    """diffusers ``LTX2VideoDecoder3d``: conv_in, mid block, up blocks, RMS norm, [timestep
    scale/shift], SiLU, conv_out, unpatchify.

    ``temb``: ``[B]`` decode timesteps (timestep conditioning only), multiplied by the
    ``timestep_scale_multiplier`` parameter before every time embedder; ``noise``: the
    ``[H, W]`` arrays of :func:`decoder_noise_shapes`, in that order.
    """

    config: LTX2VideoVAEConfig
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, z_bthwc: jax.Array, temb=None, noise: Sequence[jax.Array] = ()):
        cfg = self.config
        kw = {"dtype": self.dtype, "param_dtype": self.param_dtype}
        opt, cond = _decoder_options(cfg), cfg.timestep_conditioning
        conv_kw = {"is_causal": opt.is_causal, "padding_mode": opt.padding_mode, **kw}
        x = CausalConv3d(cfg.decoder_width, name="conv_in", **conv_kw)(z_bthwc)
        if cond:
            temb = temb.astype(self.dtype) * self._timestep_scale()
        mid_layers, mid_noise = cfg.decoder_mid
        runs = ltx_vae._split_noise(noise, ltx_vae._noise_counts(cfg))
        x = MidBlock3d(mid_layers, opt, mid_noise, cond, name="mid_block", **kw)(x, temb, runs[0])
        for i, level in enumerate(cfg.decoder_levels):
            x = UpBlock3d(level, opt, cond, name=f"up_blocks_{i}", **kw)(x, temb, runs[i + 1])
        x = pixel_norm(x)
        if cond:
            channels = x.shape[-1]
            emb = TimeEmbedder(2 * channels, name="time_embedder", **kw)(temb)
            table = self.param(
                "scale_shift_table", ltx_vae._TABLE_INIT, (2, channels), self.param_dtype
            )
            mod = emb.reshape(emb.shape[0], 2, channels) + table.astype(self.dtype)[None]
            x = x * (1 + ltx_vae._per_sample(mod[:, 1])) + ltx_vae._per_sample(mod[:, 0])
        out = cfg.out_channels * cfg.patch_size**2
        x = CausalConv3d(out, name="conv_out", **conv_kw)(silu(x))
        return unpatchify(x, cfg.patch_size)

    def _timestep_scale(self) -> jax.Array:
        # diffusers' 0-d parameter, kept as [1] (weights.load_params places a 0-d tensor so).
        init = nn.with_logical_partitioning(
            nn.initializers.constant(ltx_vae.TIMESTEP_SCALE), (None,)
        )
        multiplier = self.param("timestep_scale_multiplier", init, (1,), self.param_dtype)
        return multiplier.astype(self.dtype)[0]


# ----------------------------------------------------------------------------------------------
# Shapes and noise
# ----------------------------------------------------------------------------------------------


def latent_shape(config: LTX2VideoVAEConfig, video_shape: Sequence[int]) -> tuple[int, ...]:
    """The latent shape of a ``[B, C, F, H, W]`` video; ValueError naming the dimension where
    diffusers' reshapes or paddings would fail."""
    if len(video_shape) != 5:
        raise ValueError(f"video must be [B, C, F, H, W], got shape {tuple(video_shape)}")
    b, c, f, h, w = (int(s) for s in video_shape)
    if c != config.in_channels:
        raise ValueError(f"video has {c} channels but in_channels is {config.in_channels}")
    if f < 1:
        raise ValueError("video has 0 frames")
    p = config.patch_size
    for name, size in (("height", h), ("width", w)):
        if size % p:
            raise ValueError(f"video {name} {size} is not divisible by patch_size {p}")
    h, w = h // p, w // p
    for i, level in enumerate(config.encoder_levels):
        f, h, w = _downsampled(config, i, level.downsample, (f, h, w))
    _check_reflect_size(config.encoder_spatial_padding_mode, "encoder", (h, w))
    return (b, config.latent_channels, f, h, w)


def _downsampled(config, i: int, downsample, fhw: tuple[int, int, int]) -> tuple[int, int, int]:
    """(F, H, W) after down block ``i``'s downsampler (``"conv"``: stride 2 after padding 2
    frames / 1 pixel a side; a stride: folded after prepending ``s_t - 1`` frames)."""
    f, h, w = fhw
    if downsample is None:
        return fhw
    if downsample == CONV_DOWNSAMPLE:
        return (f - 1) // 2 + 1, (h - 1) // 2 + 1, (w - 1) // 2 + 1
    s_t, s_h, s_w = downsample
    if (f + s_t - 1) % s_t:
        raise ValueError(
            f"down block {i} folds {s_t} frames after prepending {s_t - 1}: it gets {f} "
            f"frames (use 1 + {config.temporal_compression}k frames)"
        )
    for name, size, s in (("height", h, s_h), ("width", w, s_w)):
        if size % s:
            raise ValueError(
                f"down block {i} folds {s} pixels but the {name} there is {size} "
                f"(use a video {name} divisible by {config.spatial_compression})"
            )
    return (f + s_t - 1) // s_t, h // s_h, w // s_w


def _check_reflect_size(mode: str, half: str, latent_hw: Sequence[int]) -> None:
    """torch's reflect padding needs more pixels than it pads (1): latents of height or width
    1 cannot go through a reflect-padded half (the smallest feature map is the latent's)."""
    if mode == "reflect" and min(latent_hw) < 2:
        raise ValueError(
            f"{half}_spatial_padding_mode is 'reflect', which needs latents of height and "
            f"width >= 2; these are {tuple(latent_hw)}"
        )


def video_shape(config: LTX2VideoVAEConfig, z_shape: Sequence[int]) -> tuple[int, ...]:
    """The decoded video's ``[B, out_channels, F, H, W]`` for latents ``z_shape``: every
    upsampling level multiplies (H, W) by its stride and F by ``s_t`` less ``s_t - 1``."""
    b, _, f, h, w = (int(s) for s in z_shape)
    for level in config.decoder_levels:
        if level.upsample is not None:
            s_t, s_h, s_w = level.upsample
            f, h, w = s_t * f - (s_t - 1), h * s_h, w * s_w
    p = config.patch_size
    return (b, config.out_channels, f, h * p, w * p)


def check_video(config: LTX2VideoVAEConfig, video_shape_: Sequence[int]) -> None:
    """Raise ValueError naming the dimension when a video cannot be encoded like diffusers."""
    latent_shape(config, video_shape_)


def check_latents(config: LTX2VideoVAEConfig, z_shape: Sequence[int]) -> None:
    """Raise ValueError naming the dimension when latents do not fit this VAE's decoder."""
    if len(z_shape) != 5:
        raise ValueError(f"latents must be [B, C, F, H, W], got shape {tuple(z_shape)}")
    if z_shape[1] != config.latent_channels:
        raise ValueError(
            f"latents have {z_shape[1]} channels but latent_channels is {config.latent_channels}"
        )
    if min(z_shape[2:]) < 1:
        raise ValueError(f"latents have an empty dimension: shape {tuple(z_shape)}")
    _check_reflect_size(config.decoder_spatial_padding_mode, "decoder", z_shape[3:5])


def decoder_noise_shapes(
    config: LTX2VideoVAEConfig, latent_hw: Sequence[int]
) -> tuple[tuple[int, int], ...]:
    """``(H, W)`` of every noise draw decoding latents of height/width ``latent_hw``, in
    diffusers' ``torch.randn`` order (mid block, then up blocks; per resnet conv1 then
    conv2); empty without ``decoder_inject_noise``."""
    h, w = (int(s) for s in latent_hw)
    mid_layers, mid_noise = config.decoder_mid
    shapes = [(h, w)] * (2 * mid_layers if mid_noise else 0)
    for level in config.decoder_levels:
        if level.upsample is not None:
            h, w = h * level.upsample[1], w * level.upsample[2]
        if level.inject_noise:
            shapes += [(h, w)] * (2 * level.num_layers)
    return tuple(shapes)


def sample_decoder_noise(
    config: LTX2VideoVAEConfig, latent_hw: Sequence[int], rng: jax.Array, dtype=jnp.float32
) -> tuple[jax.Array, ...]:
    """Standard normal noise for every draw of :func:`decoder_noise_shapes` (a stand-in for
    diffusers' global-RNG ``torch.randn``: same distribution, not the same numbers)."""
    shapes = decoder_noise_shapes(config, latent_hw)
    keys = jax.random.split(rng, max(len(shapes), 1))
    return tuple(jax.random.normal(k, s, dtype) for k, s in zip(keys, shapes, strict=False))


def _check_noise(config: LTX2VideoVAEConfig, z_shape, noise) -> tuple:
    expected = decoder_noise_shapes(config, z_shape[3:5])
    noise = tuple(noise or ())
    got = tuple(tuple(n.shape) for n in noise)
    if got != expected:
        raise ValueError(
            f"decoder noise has shapes {list(got)} but this VAE draws {list(expected)} for "
            "these latents (decoder_noise_shapes; pass rng= to draw it)"
        )
    return noise


# ----------------------------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------------------------


class LTX2VideoVAE(nn.Module):
    """LTX-2 video VAE (= diffusers ``AutoencoderKLLTX2Video``), parameters named as there.

    ``encode(video [B, C, F, H, W]) -> DiagonalGaussian`` (``[B, latent, F', H', W']``);
    ``decode(z, temb=None, noise=()) -> video`` (unclamped; ``temb`` ``[B]`` or a scalar with
    timestep conditioning, ``noise`` the ``[H, W]`` arrays of :func:`decoder_noise_shapes`);
    ``__call__(video, temb, noise)`` = decode(encode(video).mode()). The checkpoint's
    ``latents_mean`` / ``latents_std`` buffers are top-level entries of ``params``. Prefer the
    jitted :func:`encode` / :func:`decode`.
    """

    config: LTX2VideoVAEConfig
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    mesh: jax.sharding.Mesh | None = None

    def setup(self):
        cfg = self.config
        kw = {"dtype": self.dtype, "param_dtype": self.param_dtype}
        self.encoder = Encoder3d(cfg, **kw)
        self.decoder = Decoder3d(cfg, **kw)
        shape = (cfg.latent_channels,)
        zeros, ones = ltx_vae._CHANNEL_ZEROS, ltx_vae._CHANNEL_ONES
        self.latents_mean = self.param("latents_mean", zeros, shape, self.param_dtype)
        self.latents_std = self.param("latents_std", ones, shape, self.param_dtype)

    def encode(self, video_bcfhw: jax.Array) -> DiagonalGaussian:
        check_video(self.config, video_bcfhw.shape)
        x = ltx_vae._constrain_video(ltx_vae._to_channel_last(video_bcfhw).astype(self.dtype))
        return ltx_vae._moments_to_posterior(self.encoder(x), self.config.latent_channels)

    def decode(self, z_bcfhw: jax.Array, temb=None, noise: Sequence[jax.Array] = ()):
        check_latents(self.config, z_bcfhw.shape)
        t = ltx_vae._timesteps(self.config, temb, z_bcfhw.shape[0])
        noise = _check_noise(self.config, z_bcfhw.shape, noise)
        z = ltx_vae._constrain_video(ltx_vae._to_channel_last(z_bcfhw).astype(self.dtype))
        return ltx_vae._to_channel_first(self.decoder(z, t, noise))

    def __call__(self, video_bcfhw: jax.Array, temb=None, noise: Sequence[jax.Array] = ()):
        return self.decode(self.encode(video_bcfhw).mode(), temb, noise)


@functools.lru_cache(maxsize=32)
def _jitted(module: LTX2VideoVAE, method: str):
    def run(params, *args):
        return module.apply({"params": params}, *args, method=method)

    return jax.jit(run)


def encode(module: LTX2VideoVAE, params, video_bcfhw: jax.Array) -> DiagonalGaussian:
    """Encode ``[B, C, F, H, W]`` pixels in [-1, 1] -> posterior ``[B, latent, F', H', W']``
    (mean, logvar clamped to [-30, 20]) in one jitted call; ``1 + t k`` frames give
    ``1 + k`` latent frames (t = :attr:`~LTX2VideoVAEConfig.temporal_compression`), H / W
    shrink by :attr:`~LTX2VideoVAEConfig.spatial_compression`."""
    check_video(module.config, video_bcfhw.shape)
    return _jitted(module, "encode")(params, jnp.asarray(video_bcfhw))


def decode(
    module: LTX2VideoVAE,
    params,
    z_bcfhw: jax.Array,
    temb=None,
    *,
    noise: Sequence[jax.Array] | None = None,
    rng: jax.Array | None = None,
) -> jax.Array:
    """Decode latents ``[B, latent, F, H, W]`` -> video of :func:`video_shape` (unclamped), in
    one jitted call, as ``AutoencoderKLLTX2Video.decode(z, temb)``.

    ``temb``: the decode timestep(s) of a timestep-conditioned VAE (``[B]`` or a scalar; None
    otherwise). With ``decoder_inject_noise``: ``noise`` (the arrays of
    :func:`decoder_noise_shapes`, diffusers' draw order) or ``rng`` to draw it.
    """
    config = module.config
    check_latents(config, z_bcfhw.shape)
    if config.injects_noise and noise is None:
        if rng is None:
            raise ValueError("this VAE injects noise while decoding: pass noise= or rng=")
        noise = sample_decoder_noise(config, z_bcfhw.shape[3:5], rng)
    noise = _check_noise(config, z_bcfhw.shape, noise)
    t = ltx_vae._timesteps(config, temb, z_bcfhw.shape[0])
    return _jitted(module, "decode")(params, jnp.asarray(z_bcfhw), t, noise)


# ----------------------------------------------------------------------------------------------
# The pipelines' latent steps
# ----------------------------------------------------------------------------------------------


def _latent_stats(params: Mapping, z: jax.Array) -> tuple[jax.Array, jax.Array]:
    mean, std = (jnp.asarray(params[k], z.dtype) for k in ("latents_mean", "latents_std"))
    if z.ndim != 5 or z.shape[1] != mean.shape[0]:
        raise ValueError(f"latents must be [B, {mean.shape[0]}, F, H, W], got shape {z.shape}")
    return mean.reshape(1, -1, 1, 1, 1), std.reshape(1, -1, 1, 1, 1)


def normalize_latents(z_bcfhw: jax.Array, params: Mapping, scaling_factor: float = 1.0):
    """VAE latents -> the transformer's space, the pipelines' ``_normalize_latents``:
    ``(z - latents_mean) * scaling_factor / latents_std`` (the checkpoint's buffers, kept in
    ``params``). The default 1.0 is the static method's, which image-to-video relies on."""
    mean, std = _latent_stats(params, z_bcfhw)
    return (z_bcfhw - mean) * scaling_factor / std


def denormalize_latents(z_bcfhw: jax.Array, params: Mapping, scaling_factor: float = 1.0):
    """Inverse of :func:`normalize_latents` (``_denormalize_latents``)."""
    mean, std = _latent_stats(params, z_bcfhw)
    return z_bcfhw * std / scaling_factor + mean


def _per_sample_values(value, batch: int, name: str) -> jax.Array:
    """A scalar or one value per sample -> ``[B]`` float32 (the pipeline's list rule)."""
    v = jnp.asarray(value, jnp.float32).reshape(-1)
    if v.shape[0] not in (1, batch):
        raise ValueError(f"{name} has {v.shape[0]} values for a batch of {batch}")
    return jnp.broadcast_to(v, (batch,))


def decode_inputs(
    latents_bcfhw: jax.Array,
    params: Mapping,
    config: LTX2VideoVAEConfig,
    *,
    decode_timestep=0.0,
    decode_noise_scale=None,
    noise_bcfhw: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """The LTX-2 pipelines' step between the denoised (unpacked, normalised) latents and
    ``vae.decode``: ``(latents for the VAE, timestep [B] or None)``.

    Without timestep conditioning: denormalised latents and no timestep. With it: the
    pipeline's ``decode_timestep`` (default 0.0) per sample, and ``noise_bcfhw`` (the
    pipeline's ``randn_tensor`` draw, given by the caller) mixed in by
    ``decode_noise_scale`` (default: the decode timestep) BEFORE denormalising.
    """
    batch = latents_bcfhw.shape[0]
    timestep = None
    if config.timestep_conditioning:
        if noise_bcfhw is None:
            raise ValueError("this VAE is timestep-conditioned: pass noise_bcfhw (latents' shape)")
        timestep = _per_sample_values(decode_timestep, batch, "decode_timestep")
        if decode_noise_scale is None:
            scale = timestep
        else:
            scale = _per_sample_values(decode_noise_scale, batch, "decode_noise_scale")
        latents_bcfhw = mix_decode_noise(latents_bcfhw, noise_bcfhw, scale)
    return denormalize_latents(latents_bcfhw, params, config.scaling_factor), timestep


def encode_condition_latents(module: LTX2VideoVAE, params, images_bchw: jax.Array) -> jax.Array:
    """LTX2ImageToVideoPipeline's condition latents: each ``[C, H, W]`` image in [-1, 1]
    encoded as a one-frame video, the posterior's mode (``sample_mode="argmax"``), normalised
    with scaling factor 1.0 (the pipeline omits the config's): ``[B, latent, 1, h, w]``."""
    posterior = encode(module, params, jnp.asarray(images_bchw)[:, :, None])
    return normalize_latents(posterior.mode(), params)


# ----------------------------------------------------------------------------------------------
# Weights
# ----------------------------------------------------------------------------------------------


def _dummy_inputs(config: LTX2VideoVAEConfig):
    """(a video every encoder level accepts, latents reflect padding accepts (2 x 2), a
    timestep or None): what ``init`` traces to create every parameter."""
    s = 2 * config.spatial_compression
    video = jax.ShapeDtypeStruct((1, config.in_channels, 1, s, s), jnp.float32)
    latents = jax.ShapeDtypeStruct((1, config.latent_channels, 1, 2, 2), jnp.float32)
    temb = jax.ShapeDtypeStruct((1,), jnp.float32) if config.timestep_conditioning else None
    return video, latents, temb


def _create_parameters(module: LTX2VideoVAE, video, latents, temb):
    """``init``'s method: the encoder, and the decoder with zero noise."""
    module.encode(video)
    shapes = decoder_noise_shapes(module.config, latents.shape[3:5])
    return module.decode(latents, temb, tuple(jnp.zeros(s, latents.dtype) for s in shapes))


def _create_encoder_parameters(module: LTX2VideoVAE, video, latents, temb):
    """``init``'s method for an encoder-only load: the encoder and the latent statistics."""
    return module.encode(video)


# build / load / init / shape / count, as the other VAEs (jaxcore.weights.VAEKind). The
# diffusers key of every parameter follows from its path exactly as in LTX-Video
# (ltx_vae._source_entry: conv kernels, norm3's scale, scale tables, noise scales, the 0-d
# timestep multiplier); the plain conv_shortcut is a bare Conv3d, so its key has no ".conv".
KIND = weights.VAEKind(
    LTX2VideoVAE,
    LTX2VideoVAEConfig,
    _dummy_inputs,
    lambda config, boxed: weights.weight_map_by_path(boxed, ltx_vae._source_entry),
    trace_method=_create_parameters,
    encoder_method=_create_encoder_parameters,
    fill=ltx_vae._fill,
)
abstract_params = KIND.abstract_params
# Entries of params that are diffusers buffers (register_buffer), not parameters.
BUFFERS = ltx_vae.BUFFERS


def count_params(config: LTX2VideoVAEConfig, *, include_buffers: bool = False) -> int:
    """Parameters from eval_shape (nothing allocated); by default without the two latent
    statistics buffers, i.e. diffusers' ``sum(p.numel() for p in model.parameters())``."""
    total = KIND.count_params(config)
    return total if include_buffers else total - len(BUFFERS) * config.latent_channels


def weight_map(config: LTX2VideoVAEConfig) -> dict:
    """{flax param path: (diffusers AutoencoderKLLTX2Video key, transform)}."""
    return KIND.weight_map(config, abstract_params(LTX2VideoVAE(config)))


def load_ltx2_vae(directory: str | os.PathLike, *, dtype: Dtype = jnp.float32, **options):
    """:meth:`jaxcore.weights.VAEKind.load` of a diffusers ``AutoencoderKLLTX2Video``
    ``save_pretrained`` folder (config.json + safetensors, the latent statistics buffers
    included), activations and parameters in ``dtype`` (``mesh``, ``rules``,
    ``encoder_only`` as there): ``(module, params)``."""
    return KIND.load(directory, dtype=dtype, param_dtype=dtype, **options)


def init_ltx2_vae(config: LTX2VideoVAEConfig, rng: jax.Array, *, dtype: Dtype = jnp.float32, **kw):
    """:meth:`jaxcore.weights.VAEKind.init`: kernels LeCun normal, the rest ltx_vae's fills."""
    return KIND.init(config, rng, dtype=dtype, param_dtype=dtype, **kw)
