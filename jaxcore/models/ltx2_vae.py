"""LTX-2 video VAE in Flax linen, numerically equal to diffusers' ``AutoencoderKLLTX2Video``.

Reference: ``diffusers/models/autoencoders/autoencoder_kl_ltx2.py`` (diffusers 0.42) and the
decode / image-conditioning steps of ``pipelines/ltx2/pipeline_ltx2.py`` and
``pipeline_ltx2_image2video.py``. The released LTX-2 VAE is diffusers' class defaults with
``decoder_causal=False`` and compression ratios 32 / 8 stated in its config
(``scripts/convert_ltx2_to_diffusers.py``, ``get_ltx2_video_vae_config("2.0")``).

The computation is LTX-Video 0.9.5's and so are the layers: this file holds LTX-2's config,
the encoder / decoder wiring and the pipelines' latent steps, built from
:mod:`jaxcore.models.ltx_vae`'s causal 3-D convs (time padded with copies of the edge frames),
resnets, space-to-depth downsamplers, depth-to-space upsamplers, down / mid / up blocks,
time embedder, noise and decode-timestep bookkeeping, posterior split, weight-name rule and
parameter fills. What LTX-2 changes, each an option of those layers:
- every conv's H / W padding follows ``encoder_spatial_padding_mode`` /
  ``decoder_spatial_padding_mode`` (torch ``padding_mode``, the layers' ``padding_mode``; the
  released decoder uses ``"reflect"``; LTX-Video always zero-pads);
- the encoder's ``conv_in`` maps to ``latent_channels``, and every down block is
  ``LTX2VideoDownBlock3D`` (resnets at its input width, then a ``downsample_type`` of
  ``"conv"`` / ``"spatial"`` / ``"temporal"`` / ``"spatiotemporal"``, no ``conv_out``
  resnet); the mid block runs at ``block_out_channels[-1]``;
- each decoder up block upsamples by its own ``upsample_type`` stride (the upsampler's
  ``stride``; LTX-Video: always (2, 2, 2)); the first ``stride_t - 1`` frames are dropped, so
  F latent frames decode to ``1 + stride_t (F - 1)`` per level;
- a resnet's width-changing shortcut is a plain ``nn.Conv3d`` (``plain_shortcut``; key
  ``conv_shortcut.weight``, not ``conv_shortcut.conv.weight``).
Packing into transformer tokens is :mod:`jaxcore.models.ltx_transformer`'s (LTX-2's
``_pack_latents`` is LTX-Video's).

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
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

from jaxcore import weights
from jaxcore.config import config_json_kwargs
from jaxcore.models import ltx_vae
from jaxcore.models.layers import silu

# LTX-2's _pack_latents / _unpack_latents are LTX-Video's: re-exported for the family.
from jaxcore.models.ltx_transformer import pack_latents, unpack_latents  # noqa: F401

# The layers, and the decoder's noise bookkeeping (it reads only decoder_mid /
# decoder_levels), are LTX-Video's; CausalConv3d and the noise functions are re-exported.
from jaxcore.models.ltx_vae import (
    PADDING_MODES,
    CausalConv3d,
    DecoderLevel,
    DownBlock3D,
    EncoderLevel,
    MidBlock3d,
    UpBlock3d,
    check_noise,
    decoder_noise_shapes,  # noqa: F401
    mix_decode_noise,
    patchify,
    pixel_norm,
    sample_decoder_noise,  # noqa: F401
    unpatchify,
)
from jaxcore.models.wan_vae import DiagonalGaussian

Dtype = Any

DOWN_BLOCK = "LTX2VideoDownBlock3D"
# downsample_type / upsample_type -> stride (T, H, W). The encoder also knows "conv": a
# stride-2 causal conv that keeps the width.
SCALING_STRIDES = ltx_vae.DOWNSAMPLE_STRIDES
CONV_DOWNSAMPLE = "conv"


# ----------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------


class LTX2VideoVAEConfigError(ValueError):
    """A config.json / YAML section LTX2VideoVAEConfig cannot represent; names the key."""


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
        previous width (``latent_channels`` after conv_in) to ``block_out_channels[i]``
        (resnets at its input width, then the downsampler; no ``conv_out`` resnet)."""
        channels = self.latent_channels
        levels = []
        for i, out in enumerate(self.block_out_channels):
            down = None
            if self.spatio_temporal_scaling[i]:
                kind = self.downsample_type[i]
                down = kind if kind == CONV_DOWNSAMPLE else SCALING_STRIDES[kind]
            layers = self.layers_per_block[i]
            levels.append(EncoderLevel(DOWN_BLOCK, channels, out, layers, down, conv_out=False))
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
# Encoder and decoder (channel-last), wired from ltx_vae's layers
# ----------------------------------------------------------------------------------------------


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
        eps, kw = cfg.resnet_norm_eps, {"dtype": self.dtype, "param_dtype": self.param_dtype}
        # every conv and block of the encoder shares its causality and H / W padding
        kw.update(is_causal=cfg.encoder_causal, padding_mode=cfg.encoder_spatial_padding_mode)
        x = patchify(x_bthwc, cfg.patch_size)
        x = CausalConv3d(cfg.latent_channels, name="conv_in", **kw)(x)
        for i, level in enumerate(cfg.encoder_levels):
            x = DownBlock3D(level, eps, name=f"down_blocks_{i}", **kw)(x)
        x = MidBlock3d(cfg.layers_per_block[-1], eps, name="mid_block", **kw)(x)
        x = silu(pixel_norm(x))
        return CausalConv3d(cfg.latent_channels + 1, name="conv_out", **kw)(x)


class Decoder3d(nn.Module):
    """diffusers ``LTX2VideoDecoder3d``: conv_in, mid block, up blocks (plain conv_in
    shortcuts, per-level upsampling strides), RMS norm, [timestep scale/shift], SiLU,
    conv_out, unpatchify.

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
        eps, cond = cfg.resnet_norm_eps, cfg.timestep_conditioning
        kw = {"dtype": self.dtype, "param_dtype": self.param_dtype}
        # every conv and block of the decoder shares its causality and H / W padding
        kw.update(is_causal=cfg.decoder_causal, padding_mode=cfg.decoder_spatial_padding_mode)
        x = CausalConv3d(cfg.decoder_width, name="conv_in", **kw)(z_bthwc)
        if cond:
            temb = ltx_vae.scale_decode_timestep(self, temb)
        mid_layers, mid_noise = cfg.decoder_mid
        runs = ltx_vae.split_noise(noise, ltx_vae.noise_counts(cfg))
        mid = MidBlock3d(
            mid_layers,
            eps,
            inject_noise=mid_noise,
            timestep_conditioning=cond,
            name="mid_block",
            **kw,
        )
        x = mid(x, temb, runs[0])
        for i, level in enumerate(cfg.decoder_levels):
            up = UpBlock3d(
                level,
                eps,
                timestep_conditioning=cond,
                plain_shortcut=True,
                name=f"up_blocks_{i}",
                **kw,
            )
            x = up(x, temb, runs[i + 1])
        x = pixel_norm(x)
        if cond:
            x = ltx_vae.modulate_decoder_output(self, x, temb)
        out = cfg.out_channels * cfg.patch_size**2
        x = CausalConv3d(out, name="conv_out", **kw)(silu(x))
        return unpatchify(x, cfg.patch_size)


# ----------------------------------------------------------------------------------------------
# Shapes
# ----------------------------------------------------------------------------------------------


def latent_shape(config: LTX2VideoVAEConfig, video_shape: Sequence[int]) -> tuple[int, ...]:
    """The latent shape of a ``[B, C, F, H, W]`` video; ValueError naming the dimension where
    diffusers' reshapes (:func:`ltx_vae.latent_shape`, the same encoder levels) or reflect
    padding would fail."""
    shape = ltx_vae.latent_shape(config, video_shape)
    _check_reflect_size(config.encoder_spatial_padding_mode, "encoder", shape[3:5])
    return shape


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
    """Raise ValueError naming the dimension when latents do not fit this VAE's decoder
    (:func:`ltx_vae.check_latents`, then the decoder's reflect padding)."""
    ltx_vae.check_latents(config, z_shape)
    _check_reflect_size(config.decoder_spatial_padding_mode, "decoder", z_shape[3:5])


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
        zeros, ones = ltx_vae.CHANNEL_ZEROS, ltx_vae.CHANNEL_ONES
        self.latents_mean = self.param("latents_mean", zeros, shape, self.param_dtype)
        self.latents_std = self.param("latents_std", ones, shape, self.param_dtype)

    def encode(self, video_bcfhw: jax.Array) -> DiagonalGaussian:
        check_video(self.config, video_bcfhw.shape)
        x = ltx_vae.constrain_video(ltx_vae.to_channel_last(video_bcfhw).astype(self.dtype))
        return ltx_vae.moments_to_posterior(self.encoder(x), self.config.latent_channels)

    def decode(self, z_bcfhw: jax.Array, temb=None, noise: Sequence[jax.Array] = ()):
        check_latents(self.config, z_bcfhw.shape)
        t = ltx_vae.decode_timesteps(self.config, temb, z_bcfhw.shape[0])
        noise = check_noise(self.config, z_bcfhw.shape, noise)
        z = ltx_vae.constrain_video(ltx_vae.to_channel_last(z_bcfhw).astype(self.dtype))
        return ltx_vae.to_channel_first(self.decoder(z, t, noise))

    def __call__(self, video_bcfhw: jax.Array, temb=None, noise: Sequence[jax.Array] = ()):
        return self.decode(self.encode(video_bcfhw).mode(), temb, noise)


def encode(module: LTX2VideoVAE, params, video_bcfhw: jax.Array) -> DiagonalGaussian:
    """Encode ``[B, C, F, H, W]`` pixels in [-1, 1] -> posterior ``[B, latent, F', H', W']``
    (mean, logvar clamped to [-30, 20]) in one jitted call; ``1 + t k`` frames give
    ``1 + k`` latent frames (t = :attr:`~LTX2VideoVAEConfig.temporal_compression`), H / W
    shrink by :attr:`~LTX2VideoVAEConfig.spatial_compression`."""
    check_video(module.config, video_bcfhw.shape)
    return ltx_vae.jitted(module, "encode")(params, jnp.asarray(video_bcfhw))


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
    check_latents(module.config, z_bcfhw.shape)
    t, noise = ltx_vae.decode_arguments(module.config, z_bcfhw.shape, temb, noise, rng)
    return ltx_vae.jitted(module, "decode")(params, jnp.asarray(z_bcfhw), t, noise)


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


# build / load / init / shape / count, as the other VAEs (jaxcore.weights.VAEKind). The
# diffusers key of every parameter follows from its path exactly as in LTX-Video
# (ltx_vae.source_entry: conv kernels, norm3's scale, scale tables, noise scales, the 0-d
# timestep multiplier); the plain conv_shortcut (plain_shortcut) is a bare Conv3d, so its key
# has no ".conv".
KIND = weights.VAEKind(
    LTX2VideoVAE,
    LTX2VideoVAEConfig,
    _dummy_inputs,
    lambda config, boxed: weights.weight_map_by_path(boxed, ltx_vae.source_entry),
    trace_method=ltx_vae.create_parameters,
    encoder_method=ltx_vae.create_encoder_parameters,
    fill=ltx_vae.fill,
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
