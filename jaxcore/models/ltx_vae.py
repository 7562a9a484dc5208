"""LTX-Video causal video VAE in Flax linen, numerically equal to diffusers' ``AutoencoderKLLTXVideo``.

Reference: ``diffusers/models/autoencoders/autoencoder_kl_ltx.py`` (diffusers 0.42), all three
generations its config describes:
- 0.9.0: ``LTXVideoDownBlock3D`` encoder levels (resnets, a stride-2 causal conv, a
  channel-changing ``conv_out`` resnet), a plain decoder;
- 0.9.1: the same encoder; a decoder with ``timestep_conditioning`` (a sinusoidal time
  embedder per block and an adaLN-style ``scale_shift_table`` per resnet and at the head),
  ``decoder_inject_noise`` (per-channel scaled spatial noise after each resnet conv) and
  residual depth-to-space upsamplers that divide the channels by ``upsample_factor``;
- 0.9.5 / 0.9.7: ``LTXVideo095DownBlock3D`` encoder levels whose downsampler is a
  space-to-depth conv with an averaged space-to-depth shortcut, per level ``spatial`` (1,2,2),
  ``temporal`` (2,1,1) or ``spatiotemporal`` (2,2,2) (``downsample_type``).

Layout: public tensors use the diffusers layout, video ``[B, C, F, H, W]`` (pixels in [-1, 1])
and latents ``[B, latent_channels, F', H', W']``. Inside, every activation is channel-last
``[B, T, H, W, C]``. The whole video goes through the encoder / decoder at once, as diffusers
does by default: diffusers' tiling and framewise encoding / decoding (``enable_tiling``,
``use_framewise_*``: runtime switches, not config keys) are not implemented, so there is no
switch to refuse; their results differ from the whole-video ones this module matches.

What makes it equal to diffusers:
- ``LTXVideoCausalConv3d``: time padded by replicating frames, never with zeros: causal =
  ``k - 1`` copies of the first frame on the left; non-causal = ``(k - 1) // 2`` copies of
  the first frame on the left and of the last frame on the right. H / W are zero padded by
  ``k // 2``. ``encoder_causal`` / ``decoder_causal`` pick the mode per half.
- The norms are ``RMSNorm(eps=1e-8)`` without affine parameters (statistics in float32), and
  the resnet shortcut's ``norm3`` is a ``LayerNorm(eps=resnet_norm_eps)`` with its affine.
- The encoder's ``conv_out`` emits ``latent_channels + 1`` channels; the last one is the
  log-variance shared by every latent channel (diffusers repeats it), clamped to [-30, 20].
- The space-to-depth / depth-to-space channel orders are diffusers' (patchify puts the W
  offset before the H offset); the upsamplers drop the first ``stride_t - 1`` frames, so F
  latent frames decode to ``2 F - 1`` per temporal level.
- The decoder output is not clamped (diffusers' ``AutoencoderKLLTXVideo.decode`` does not).

Parity reached (tests/jaxcore/test_ltx_vae.py, fp32 on CPU, every diffusers parameter and
buffer perturbed, ``jax_default_matmul_precision="highest"``): encoder mean / logvar
<= 1.6e-6, decoder <= 3.6e-6 max abs on outputs up to 2-3.5 (0.9.0-, 0.9.1- (timestep
conditioning, with and without injected noise) and 0.9.5-style tiny configs; test bound 1e-5).
Parameter counts equal diffusers' for the real 0.9.0 (419,193,649), 0.9.1 (934,976,434) and
0.9.5 / 0.9.7 (1,246,913,522) configs. The convs are plain XLA 3-D convolutions (no per-tap
or chunked scheme as in :mod:`jaxcore.models.wan_vae`): correct everywhere, not tuned for
XLA:CPU.

Timestep conditioning (0.9.1+): ``decode(z, temb)`` takes the decode timestep per sample
(``[B]`` or a scalar, typically 0.05 as LTXPipeline's ``decode_timestep``); the decoder
multiplies it by its ``timestep_scale_multiplier`` parameter (1000 in diffusers' init)
before every time embedder. :func:`mix_decode_noise` is the pipeline's
``(1 - decode_noise_scale) * latents + decode_noise_scale * noise`` step, with the noise
given by the caller.

Noise injection (``decoder_inject_noise``): diffusers draws ``torch.randn(H, W)`` twice per
resnet of a noisy block (shared across batch, frames and channels, scaled per channel by
``per_channel_scale1`` / ``per_channel_scale2``). Here that noise is an explicit input: a
tuple of ``[H, W]`` arrays in diffusers' draw order (:func:`decoder_noise_shapes`), or a PRNG
key from which :func:`sample_decoder_noise` draws it.

Shared with LTX-2 (:mod:`jaxcore.models.ltx2_vae` builds its encoder and decoder from these
layers): the convs and blocks take ``padding_mode`` (torch's H / W ``padding_mode``; LTX-Video
always ``"zeros"``), :class:`Upsampler3d` a ``stride`` (LTX-Video always (2, 2, 2), carried by
:class:`DecoderLevel`), :class:`ResnetBlock3d` / :class:`UpBlock3d` ``plain_shortcut`` (a
plain 1x1x1 ``conv_shortcut`` instead of a causal one); every default is LTX-Video's. So are
the helpers that read only a :class:`CausalVAELayout`: the noise and decode-timestep
bookkeeping, :func:`downsampled_size`, and the weight-name rule :func:`source_entry` /
:func:`fill`.

Public API: :class:`LTXVideoVAEConfig`, :class:`LTXVideoVAE` (and its layers
:class:`Conv3d`, :class:`CausalConv3d`, :class:`ResnetBlock3d`, :class:`Downsampler3d`,
:class:`Upsampler3d`, :class:`DownBlock3D`, :class:`MidBlock3d`, :class:`UpBlock3d`,
:class:`Encoder3d`, :class:`Decoder3d`), :class:`DiagonalGaussian` (shared with
:mod:`jaxcore.models.wan_vae`), :func:`encode`, :func:`decode`, :func:`decoder_noise_shapes`,
:func:`sample_decoder_noise`, :func:`mix_decode_noise`, :func:`normalize_latents`,
:func:`denormalize_latents`, :func:`latent_shape`, :func:`check_video`, :func:`check_latents`,
:func:`weight_map`, :func:`abstract_params`, :func:`count_params`, :func:`load_ltx_vae`,
:func:`init_ltx_vae`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
from flax import linen as nn

from jaxcore import sharding, weights
from jaxcore.config import config_json_kwargs
from jaxcore.models.layers import MLP2, AffineLayerNorm, rms_norm, silu, timestep_embedding
from jaxcore.models.wan_vae import LOGVAR_RANGE, DiagonalGaussian

Dtype = Any

# diffusers' RMSNorm(eps=1e-8, elementwise_affine=False) in every resnet and both heads.
RMS_EPS = 1e-8
# Sinusoidal channels of PixArtAlphaCombinedTimestepSizeEmbeddings' time projection.
TIME_PROJ_DIM = 256
# diffusers' init of the decoder's timestep_scale_multiplier (the checkpoint holds its value).
TIMESTEP_SCALE = 1000.0
DOWN_BLOCK = "LTXVideoDownBlock3D"
DOWN_BLOCK_095 = "LTXVideo095DownBlock3D"
# LTXVideo095DownBlock3D's downsample_type -> LTXVideoDownsampler3d stride (T, H, W); "conv"
# is the 0.9.0 stride-2 causal conv, which keeps the channel count.
DOWNSAMPLE_STRIDES = {"spatial": (1, 2, 2), "temporal": (2, 1, 1), "spatiotemporal": (2, 2, 2)}
# Every decoder upsampler is LTXVideoUpsampler3d(stride=(2, 2, 2)).
UPSAMPLE_STRIDE = (2, 2, 2)
# torch Conv3d padding_mode -> jnp.pad mode of the H / W padding (LTX-2 picks one per half;
# "zeros" is the conv's own padding).
PADDING_MODES = {"zeros": "constant", "reflect": "reflect", "replicate": "edge", "circular": "wrap"}


# ----------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------


class LTXVideoVAEConfigError(ValueError):
    """A config.json / YAML section LTXVideoVAEConfig cannot represent; names the key."""


class EncoderLevel(NamedTuple):
    """One encoder down block as diffusers builds it. ``downsample``: None, ``"conv"`` (stride-2
    causal conv) or an ``LTXVideoDownsampler3d`` stride (T, H, W); ``conv_out``: the 0.9.0
    block's channel-changing resnet after the downsampler."""

    block_type: str
    in_channels: int
    out_channels: int
    num_layers: int
    downsample: str | tuple[int, int, int] | None
    conv_out: bool


class DecoderLevel(NamedTuple):
    """One decoder up block as diffusers builds it (``in_channels`` is diffusers' nominal
    ``output_channel // upsample_factor``; a ``conv_in`` resnet exists where it differs from
    ``out_channels``; ``upsample`` is the upsampler's stride (T, H, W), or None without one)."""

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


class CausalVAELayout(Protocol):
    """What the shape, noise and decode-timestep helpers below read of a config: both
    :class:`LTXVideoVAEConfig` and LTX-2's ``LTX2VideoVAEConfig`` provide it."""

    @property
    def in_channels(self) -> int: ...
    @property
    def latent_channels(self) -> int: ...
    @property
    def patch_size(self) -> int: ...
    @property
    def timestep_conditioning(self) -> bool: ...
    @property
    def encoder_levels(self) -> tuple[EncoderLevel, ...]: ...
    @property
    def spatial_compression(self) -> int: ...
    @property
    def temporal_compression(self) -> int: ...
    @property
    def decoder_mid(self) -> tuple[int, bool]: ...
    @property
    def decoder_levels(self) -> tuple[DecoderLevel, ...]: ...
    @property
    def injects_noise(self) -> bool: ...


@dataclasses.dataclass(frozen=True)
class LTXVideoVAEConfig:
    """Architecture of the LTX-Video VAE; field names and defaults are diffusers'
    ``AutoencoderKLLTXVideo`` arguments (so ``from_dict(config.json)`` is direct).

    diffusers indexes the per-level tuples as written for the encoder and *reversed* for the
    decoder (``decoder_*``, ``upsample_residual``, ``upsample_factor``: their last entry is
    the innermost level); this config mirrors that indexing in :attr:`encoder_levels` and
    :attr:`decoder_levels`. ``spatial_compression_ratio`` / ``temporal_compression_ratio``
    and ``scaling_factor`` are metadata (diffusers' pipelines read them); use
    :attr:`spatial_compression` / :attr:`temporal_compression` for the factors the encoder
    really has (diffusers' default formula is wrong for 0.9.5's space-only / time-only levels,
    which is why its configs state them).

    Refused, naming the key, where diffusers cannot run the model either: ``patch_size_t`` != 1
    (its encoder's ``conv_in`` width ignores it), an unknown block or downsample type, widths
    its blocks cannot chain, and a decoder ``conv_in`` resnet (an up block changing width other
    than by ``upsample_factor``) combined with timestep conditioning or noise injection.
    """

    in_channels: int = 3
    out_channels: int = 3
    latent_channels: int = 128
    block_out_channels: tuple[int, ...] = (128, 256, 512, 512)
    down_block_types: tuple[str, ...] = (DOWN_BLOCK,) * 4
    decoder_block_out_channels: tuple[int, ...] = (128, 256, 512, 512)
    layers_per_block: tuple[int, ...] = (4, 3, 3, 3, 4)
    decoder_layers_per_block: tuple[int, ...] = (4, 3, 3, 3, 4)
    spatio_temporal_scaling: tuple[bool, ...] = (True, True, True, False)
    decoder_spatio_temporal_scaling: tuple[bool, ...] = (True, True, True, False)
    decoder_inject_noise: tuple[bool, ...] = (False,) * 5
    downsample_type: tuple[str, ...] = ("conv",) * 4
    upsample_residual: tuple[bool, ...] = (False,) * 4
    upsample_factor: tuple[int, ...] = (1,) * 4
    timestep_conditioning: bool = False
    patch_size: int = 4
    patch_size_t: int = 1
    resnet_norm_eps: float = 1e-6
    scaling_factor: float = 1.0
    encoder_causal: bool = True
    decoder_causal: bool = False
    spatial_compression_ratio: int | None = None
    temporal_compression_ratio: int | None = None

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, list):
                object.__setattr__(self, f.name, tuple(value))
        for key in ("in_channels", "out_channels", "latent_channels", "patch_size"):
            if int(getattr(self, key)) < 1:
                raise LTXVideoVAEConfigError(f"{key} must be >= 1, got {getattr(self, key)!r}")
        if self.patch_size_t != 1:
            raise LTXVideoVAEConfigError(
                f"patch_size_t={self.patch_size_t} is not supported: diffusers' encoder sizes "
                "its conv_in for in_channels * patch_size**2 only, so only patch_size_t=1 runs"
            )
        self._check_encoder()
        self._check_decoder()

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LTXVideoVAEConfig:
        """Build from a diffusers config.json dict (``_``-prefixed keys ignored; any other
        unknown key is an error naming it)."""
        return cls(**config_json_kwargs(cls, d, LTXVideoVAEConfigError))

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}

    # --- encoder ---------------------------------------------------------------------------

    @property
    def is_095(self) -> bool:
        """diffusers decides the encoder's layout by the LAST down block type alone."""
        return self.down_block_types[-1] == DOWN_BLOCK_095

    @property
    def num_encoder_levels(self) -> int:
        return len(self.block_out_channels) - (1 if self.is_095 else 0)

    @property
    def encoder_levels(self) -> tuple[EncoderLevel, ...]:
        """The down blocks, mirroring ``LTXVideoEncoder3d.__init__``'s width rule: 0.9.5 maps
        ``block_out_channels[i] -> [i + 1]``; 0.9.0 does too except that the last level keeps
        its width (its list has one entry per level, not per boundary)."""
        n = self.num_encoder_levels
        boc = self.block_out_channels
        out = boc[0]
        levels = []
        for i in range(n):
            c_in = out
            out = boc[i + 1] if (self.is_095 or i + 1 < n) else boc[i]
            block_type = self.down_block_types[i]
            down = None
            if self.spatio_temporal_scaling[i]:
                kind = "conv" if block_type == DOWN_BLOCK else self.downsample_type[i]
                down = "conv" if kind == "conv" else DOWNSAMPLE_STRIDES[kind]
            conv_out = block_type == DOWN_BLOCK and c_in != out
            levels.append(
                EncoderLevel(block_type, c_in, out, self.layers_per_block[i], down, conv_out)
            )
        return tuple(levels)

    @property
    def encoder_width(self) -> int:
        """Channels of the encoder's mid block."""
        return self.encoder_levels[-1].out_channels if self.num_encoder_levels else 0

    def _check_encoder(self) -> None:
        boc = self.block_out_channels
        if not boc or min(boc) < 1:
            raise LTXVideoVAEConfigError(f"block_out_channels must be positive ints, got {boc}")
        if not self.down_block_types:
            raise LTXVideoVAEConfigError("down_block_types is empty")
        for i, t in enumerate(self.down_block_types):
            if t not in (DOWN_BLOCK, DOWN_BLOCK_095):
                raise LTXVideoVAEConfigError(
                    f"down_block_types[{i}] = {t!r}; known: {[DOWN_BLOCK, DOWN_BLOCK_095]}"
                )
        n = self.num_encoder_levels
        if n < 1:
            raise LTXVideoVAEConfigError(
                f"block_out_channels {list(boc)} gives no encoder level (0.9.5 down blocks need "
                "one entry per level plus the input width)"
            )
        needed = {"down_block_types": n, "spatio_temporal_scaling": n, "layers_per_block": n + 1}
        if any(t == DOWN_BLOCK_095 for t in self.down_block_types[:n]):
            needed["downsample_type"] = n
        for key, count in needed.items():
            if len(getattr(self, key)) < count:
                raise LTXVideoVAEConfigError(
                    f"{key} has {len(getattr(self, key))} entries; the encoder's "
                    f"{n} levels (from block_out_channels / down_block_types) need {count}"
                )
        for i in range(n):
            if self.down_block_types[i] == DOWN_BLOCK_095 and self.spatio_temporal_scaling[i]:
                kind = self.downsample_type[i]
                if kind != "conv" and kind not in DOWNSAMPLE_STRIDES:
                    raise LTXVideoVAEConfigError(
                        f"downsample_type[{i}] = {kind!r}; known: {['conv', *DOWNSAMPLE_STRIDES]}"
                    )
        for i, level in enumerate(self.encoder_levels):
            self._check_encoder_level(i, level)

    def _check_encoder_level(self, i: int, level: EncoderLevel) -> None:
        if level.num_layers < 0:
            raise LTXVideoVAEConfigError(f"layers_per_block[{i}] must be >= 0")
        if level.block_type == DOWN_BLOCK:
            return  # its conv_out resnet makes any width change
        if not isinstance(level.downsample, tuple):
            if level.in_channels != level.out_channels:
                raise LTXVideoVAEConfigError(
                    f"down block {i} ({DOWN_BLOCK_095}) without a downsampler that changes "
                    f"width (spatio_temporal_scaling / downsample_type) keeps "
                    f"{level.in_channels} channels, but block_out_channels asks for "
                    f"{level.out_channels}"
                )
            return
        prod = math.prod(level.downsample)
        c_in, c_out = level.in_channels, level.out_channels
        if c_out % prod or (c_in * prod) % c_out:
            raise LTXVideoVAEConfigError(
                f"down block {i}: downsample_type[{i}] folds {prod} pixels into channels, so "
                f"block_out_channels {c_in} -> {c_out} needs {c_out} divisible by {prod} and "
                f"{c_in} x {prod} divisible by {c_out}"
            )

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
        """The up blocks, mirroring ``LTXVideoDecoder3d.__init__`` (tuples reversed, then
        ``in = previous out // factor``, ``out = block_out_channels[i] // factor``)."""
        rev = lambda t: tuple(reversed(t))  # noqa: E731
        boc = rev(self.decoder_block_out_channels)
        scaling = rev(self.decoder_spatio_temporal_scaling)
        layers = rev(self.decoder_layers_per_block)
        inject = rev(self.decoder_inject_noise)
        residual = rev(self.upsample_residual)
        factor = rev(self.upsample_factor)
        out = boc[0]
        levels = []
        for i in range(len(boc)):
            c_in = out // factor[i]
            out = boc[i] // factor[i]
            levels.append(
                DecoderLevel(
                    c_in,
                    out,
                    layers[i + 1],
                    UPSAMPLE_STRIDE if scaling[i] else None,
                    bool(residual[i]),
                    int(factor[i]),
                    bool(inject[i + 1]),
                )
            )
        return tuple(levels)

    @property
    def decoder_head_width(self) -> int:
        """Channels before the decoder's conv_out (the last up block's width)."""
        return self.decoder_levels[-1].out_channels

    def _check_decoder(self) -> None:
        boc = self.decoder_block_out_channels
        if not boc or min(boc) < 1:
            raise LTXVideoVAEConfigError(
                f"decoder_block_out_channels must be positive ints, got {boc}"
            )
        n = len(boc)
        needed = {
            "decoder_spatio_temporal_scaling": n,
            "upsample_residual": n,
            "upsample_factor": n,
            "decoder_layers_per_block": n + 1,
            "decoder_inject_noise": n + 1,
        }
        for key, count in needed.items():
            if len(getattr(self, key)) < count:
                raise LTXVideoVAEConfigError(
                    f"{key} has {len(getattr(self, key))} entries; the decoder's {n} up blocks "
                    f"(decoder_block_out_channels) need {count} (read in reverse, as diffusers)"
                )
        if any(int(f) < 1 for f in self.upsample_factor):
            raise LTXVideoVAEConfigError(
                f"upsample_factor must be >= 1, got {self.upsample_factor}"
            )
        channels = self.decoder_width
        for i, level in enumerate(self.decoder_levels):
            channels = self._check_decoder_level(i, level, channels)

    def _check_decoder_level(self, i: int, level: DecoderLevel, channels: int) -> int:
        """Follow the channels through up block ``i`` as diffusers would run it; a width
        diffusers' layers would reject is an error here. Returns the block's output width."""
        where = f"up block {i} (decoder_block_out_channels / upsample_factor, read reversed)"
        if level.conv_in:
            if channels != level.in_channels:
                raise LTXVideoVAEConfigError(
                    f"{where}: gets {channels} channels but its conv_in expects {level.in_channels}"
                )
            if self.timestep_conditioning or level.inject_noise:
                raise LTXVideoVAEConfigError(
                    f"{where} changes width {level.in_channels} -> {level.out_channels} through a "
                    "conv_in resnet, which diffusers cannot run with timestep_conditioning or "
                    "decoder_inject_noise (it passes that resnet the raw timestep, and sizes its "
                    "noise scales for the input width)"
                )
            channels = level.out_channels
        if level.upsample is not None:
            if channels != level.out_channels * level.factor or (8 * channels) % level.factor:
                raise LTXVideoVAEConfigError(
                    f"{where}: its upsampler gets {channels} channels but expects "
                    f"{level.out_channels} x upsample_factor {level.factor}"
                )
            if level.residual and channels % math.prod(UPSAMPLE_STRIDE):
                raise LTXVideoVAEConfigError(
                    f"{where}: upsample_residual needs the upsampler's {channels} input channels "
                    f"to be divisible by {math.prod(UPSAMPLE_STRIDE)}"
                )
        elif channels != level.out_channels:
            raise LTXVideoVAEConfigError(
                f"{where} has no upsampler (decoder_spatio_temporal_scaling) but gets {channels} "
                f"channels for {level.out_channels} (upsample_factor {level.factor})"
            )
        return level.out_channels

    # --- shapes ----------------------------------------------------------------------------

    @property
    def spatial_compression(self) -> int:
        """Pixels per latent along H and W: patch_size times the encoder's spatial strides."""
        s = self.patch_size
        for level in self.encoder_levels:
            if level.downsample is not None:
                s *= 2 if level.downsample == "conv" else level.downsample[1]
        return s

    @property
    def temporal_compression(self) -> int:
        """Frames per latent frame after the first: 1 + t k frames <-> 1 + k latent frames."""
        t = self.patch_size_t
        for level in self.encoder_levels:
            if level.downsample is not None:
                t *= 2 if level.downsample == "conv" else level.downsample[0]
        return t

    @property
    def injects_noise(self) -> bool:
        """Whether decoding draws noise (any block with decoder_inject_noise)."""
        return self.decoder_mid[1] or any(level.inject_noise for level in self.decoder_levels)


# ----------------------------------------------------------------------------------------------
# Parameter-free pieces (channel-last)
# ----------------------------------------------------------------------------------------------


def pixel_norm(x: jax.Array) -> jax.Array:
    """diffusers ``RMSNorm(C, eps=1e-8, elementwise_affine=False)`` over channels (float32
    statistics, result in x's dtype): :func:`layers.rms_norm` with a unit scale."""
    return rms_norm(x, jnp.ones((x.shape[-1],), jnp.float32), RMS_EPS)


def replicate_pad_time(x_bthwc: jax.Array, kernel_t: int, is_causal: bool) -> jax.Array:
    """``LTXVideoCausalConv3d``'s time padding: copies of the edge frames, not zeros."""
    if is_causal:
        left, right = kernel_t - 1, 0
    else:
        left = right = (kernel_t - 1) // 2
    if not left and not right:
        return x_bthwc
    return jnp.pad(x_bthwc, ((0, 0), (left, right), (0, 0), (0, 0), (0, 0)), mode="edge")


def space_to_depth(x_bthwc: jax.Array, stride: Sequence[int]) -> jax.Array:
    """[B, T, H, W, C] -> [B, T/s0, H/s1, W/s2, C s0 s1 s2], channel ``((c s0 + i) s1 + j) s2 + k``
    for offsets (i, j, k): diffusers' ``unflatten`` x3 + ``permute(0, 1, 3, 5, 7, 2, 4, 6)``."""
    b, t, h, w, c = x_bthwc.shape
    s0, s1, s2 = stride
    x = x_bthwc.reshape(b, t // s0, s0, h // s1, s1, w // s2, s2, c)
    x = jnp.transpose(x, (0, 1, 3, 5, 7, 2, 4, 6))
    return x.reshape(b, t // s0, h // s1, w // s2, c * s0 * s1 * s2)


def depth_to_space(x_bthwc: jax.Array, stride: Sequence[int]) -> jax.Array:
    """Inverse of :func:`space_to_depth` (the upsamplers' ``reshape`` + ``permute(0, 1, 5, 2, 6,
    3, 7, 4)``): [B, T, H, W, C s0 s1 s2] -> [B, T s0, H s1, W s2, C]."""
    b, t, h, w, cs = x_bthwc.shape
    s0, s1, s2 = stride
    c = cs // (s0 * s1 * s2)
    x = x_bthwc.reshape(b, t, h, w, c, s0, s1, s2)
    x = jnp.transpose(x, (0, 1, 5, 2, 6, 3, 7, 4))
    return x.reshape(b, t * s0, h * s1, w * s2, c)


def patchify(x_bthwc: jax.Array, p: int) -> jax.Array:
    """The encoder's input patchify (patch_size_t = 1): p x p pixels -> channels, channel
    ``(c p + w offset) p + h offset`` (diffusers' ``permute(0, 1, 3, 7, 5, 2, 4, 6)``: the W
    offset before the H offset)."""
    if p == 1:
        return x_bthwc
    b, t, h, w, c = x_bthwc.shape
    x = x_bthwc.reshape(b, t, h // p, p, w // p, p, c)
    x = jnp.transpose(x, (0, 1, 2, 4, 6, 5, 3))  # [B, T, H', W', C, pw, ph]
    return x.reshape(b, t, h // p, w // p, c * p * p)


def unpatchify(x_bthwc: jax.Array, p: int) -> jax.Array:
    """The decoder's output unpatchify, inverse of :func:`patchify`."""
    if p == 1:
        return x_bthwc
    b, t, h, w, cpp = x_bthwc.shape
    c = cpp // (p * p)
    x = x_bthwc.reshape(b, t, h, w, c, p, p)  # [.., C, pw, ph]
    x = jnp.transpose(x, (0, 1, 2, 6, 3, 5, 4))  # [B, T, H, ph, W, pw, C]
    return x.reshape(b, t, h * p, w * p, c)


def _per_sample(v_bc: jax.Array) -> jax.Array:
    """[B, C] -> [B, 1, 1, 1, C], broadcasting over a channel-last video."""
    return v_bc[:, None, None, None, :]


# ----------------------------------------------------------------------------------------------
# Layers (channel-last)
# ----------------------------------------------------------------------------------------------


# Initializer per parameter leaf name (module init); init_ltx_vae uses fill() instead.
_KERNEL_INIT = nn.with_logical_partitioning(
    nn.initializers.lecun_normal(), (None, None, None, "conv_in", "conv_out")
)
_BIAS_INIT = nn.with_logical_partitioning(nn.initializers.zeros_init(), ("conv_out",))
CHANNEL_ZEROS = nn.with_logical_partitioning(nn.initializers.zeros_init(), ("norm",))
CHANNEL_ONES = nn.with_logical_partitioning(nn.initializers.ones_init(), ("norm",))
# Time embedder Dense layers: replicated like the rest of the VAE.
_TIME_AXES = (None, "modulation")


def _table_init(key, shape, dtype=jnp.float32):
    """diffusers: ``torch.randn(n, C) / C ** 0.5``."""
    return jax.random.normal(key, shape, dtype) / math.sqrt(shape[-1])


_TABLE_INIT = nn.with_logical_partitioning(_table_init, (None, "norm"))


class Conv3d(nn.Module):
    """torch ``nn.Conv3d(k, stride, padding=(0, k // 2, k // 2), padding_mode=...)`` on
    ``[B, T, H, W, C]``: time unpadded (:class:`CausalConv3d` pads it), H / W padded by
    ``padding_mode`` (torch's names, :data:`PADDING_MODES`; LTX-Video always uses zeros)."""

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
        kernel = self.param("kernel", _KERNEL_INIT, shape, self.param_dtype)
        bias = self.param("bias", _BIAS_INIT, (self.features,), self.param_dtype)
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
    """diffusers ``LTXVideoCausalConv3d`` / ``LTX2VideoCausalConv3d``: :func:`replicate_pad_time`,
    then the :class:`Conv3d` (parameters under ``conv``, as diffusers' ``self.conv``)."""

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


class TimeEmbedder(nn.Module):
    """diffusers ``PixArtAlphaCombinedTimestepSizeEmbeddings(features, 0)``: a 256-channel
    sinusoidal projection (cos first) then ``timestep_embedder`` (Linear, SiLU, Linear)."""

    features: int
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, t_b: jax.Array) -> jax.Array:
        proj = timestep_embedding(t_b, TIME_PROJ_DIM).astype(self.dtype)
        mlp = MLP2(
            self.features,
            self.features,
            silu,
            _TIME_AXES,
            _TIME_AXES,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            name="timestep_embedder",
        )
        return mlp(proj)


class ResnetBlock3d(nn.Module):
    """diffusers ``LTXVideoResnetBlock3d`` / ``LTX2VideoResnetBlock3d``: (RMS norm, [timestep
    scale/shift], SiLU, causal conv, [noise]) x 2, plus the input, through ``norm3``
    (LayerNorm) + a 1x1x1 ``conv_shortcut`` when the width changes: a causal conv in
    LTX-Video (key ``conv_shortcut.conv.weight``), a plain conv with ``plain_shortcut``
    (LTX-2, key ``conv_shortcut.weight``).

    ``temb``: ``[B, 4 C]`` (already embedded by the block) with ``timestep_conditioning``;
    ``noise``: two ``[H, W]`` arrays with ``inject_noise`` (diffusers' two ``torch.randn``
    draws), added as ``noise[h, w] * per_channel_scale[c]`` to every sample and frame.
    """

    out_channels: int
    eps: float = 1e-6
    is_causal: bool = True
    inject_noise: bool = False
    timestep_conditioning: bool = False
    padding_mode: str = "zeros"
    plain_shortcut: bool = False
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, temb=None, noise: Sequence[jax.Array] = ()) -> jax.Array:
        c_in = x.shape[-1]
        h = pixel_norm(x.astype(self.dtype))
        if self.timestep_conditioning:
            table = self.param("scale_shift_table", _TABLE_INIT, (4, c_in), self.param_dtype)
            mod = temb.reshape(temb.shape[0], 4, c_in) + table.astype(self.dtype)[None]
            shift_1, scale_1, shift_2, scale_2 = (_per_sample(mod[:, i]) for i in range(4))
            h = h * (1 + scale_1) + shift_1
        h = self._conv("conv1")(silu(h))
        if self.inject_noise:
            h = self._add_noise(h, noise[0], "per_channel_scale1", c_in)
        h = pixel_norm(h)
        if self.timestep_conditioning:
            h = h * (1 + scale_2) + shift_2
        h = self._conv("conv2")(silu(h))
        if self.inject_noise:
            h = self._add_noise(h, noise[1], "per_channel_scale2", c_in)
        return h + self._shortcut(x).astype(self.dtype)

    def _conv(self, name: str, kernel_size: int = 3) -> CausalConv3d:
        return CausalConv3d(
            self.out_channels,
            kernel_size,
            is_causal=self.is_causal,
            padding_mode=self.padding_mode,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            name=name,
        )

    def _shortcut(self, x: jax.Array) -> jax.Array:
        if x.shape[-1] == self.out_channels:
            return x
        kw = {"dtype": self.dtype, "param_dtype": self.param_dtype}
        x = AffineLayerNorm(eps=self.eps, name="norm3", **kw)(x)
        if self.plain_shortcut:
            return Conv3d(self.out_channels, kernel_size=1, name="conv_shortcut", **kw)(x)
        return self._conv("conv_shortcut", kernel_size=1)(x)

    def _add_noise(self, h, noise_hw, name, channels):
        # diffusers sizes the scale by the block's INPUT width (equal to its output wherever
        # diffusers can run it; the configs refuse the rest).
        scale = self.param(name, CHANNEL_ZEROS, (channels,), self.param_dtype)
        if tuple(noise_hw.shape) != tuple(h.shape[2:4]):
            raise ValueError(
                f"{self.name}: noise has shape {tuple(noise_hw.shape)} but this resnet runs at "
                f"{tuple(h.shape[2:4])} (see decoder_noise_shapes)"
            )
        spatial = noise_hw.astype(self.dtype)[:, :, None] * scale.astype(self.dtype)
        return h + spatial[None, None]


class Downsampler3d(nn.Module):
    """diffusers ``LTXVideoDownsampler3d`` (0.9.5, and LTX-2's): prepend ``s_t - 1`` copies of
    the first frame, then a stride-1 causal conv to ``out / (s_t s_h s_w)`` channels folded to
    ``out`` by :func:`space_to_depth`, plus the input folded the same way and averaged over
    groups of ``in s_t s_h s_w / out`` channels."""

    out_channels: int
    stride: tuple[int, int, int]
    is_causal: bool = True
    padding_mode: str = "zeros"
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
            is_causal=self.is_causal,
            padding_mode=self.padding_mode,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            name="conv",
        )(x)
        return space_to_depth(h, self.stride) + shortcut


class Upsampler3d(nn.Module):
    """diffusers ``LTXVideoUpsampler3d`` / ``LTX2VideoUpsampler3d``: a causal conv to
    ``prod(stride) C / factor`` channels unfolded by :func:`depth_to_space` to ``C / factor``
    channels, the first ``s_t - 1`` frames dropped (F -> s_t F - s_t + 1). ``residual``: plus
    the input unfolded the same way (``C / prod(stride)`` channels) and tiled
    ``prod(stride) / factor`` times over channels. LTX-Video's stride is always (2, 2, 2)."""

    residual: bool = False
    upscale_factor: int = 1
    is_causal: bool = True
    stride: tuple[int, int, int] = UPSAMPLE_STRIDE
    padding_mode: str = "zeros"
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        prod = math.prod(self.stride)
        conv = CausalConv3d(
            x.shape[-1] * prod // self.upscale_factor,
            is_causal=self.is_causal,
            padding_mode=self.padding_mode,
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
    """diffusers ``LTXVideoDownBlock3D`` (0.9.0), ``LTXVideo095DownBlock3D`` and
    ``LTX2VideoDownBlock3D``: resnets at the input width, then the level's downsampler
    (``downsamplers_0``: a stride-2 causal conv for ``"conv"``, else a :class:`Downsampler3d`
    with that stride), then for 0.9.0 a channel-changing ``conv_out`` resnet."""

    level: EncoderLevel
    eps: float = 1e-6
    is_causal: bool = True
    padding_mode: str = "zeros"
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kw = {"dtype": self.dtype, "param_dtype": self.param_dtype}
        conv_kw = {"is_causal": self.is_causal, "padding_mode": self.padding_mode, **kw}
        lv = self.level
        for i in range(lv.num_layers):
            x = ResnetBlock3d(lv.in_channels, self.eps, name=f"resnets_{i}", **conv_kw)(x)
        if lv.downsample == "conv":
            conv = CausalConv3d(lv.in_channels, strides=(2, 2, 2), name="downsamplers_0", **conv_kw)
            x = conv(x)
        elif lv.downsample is not None:
            down = Downsampler3d(lv.out_channels, lv.downsample, name="downsamplers_0", **conv_kw)
            x = down(x)
        if lv.conv_out:
            x = ResnetBlock3d(lv.out_channels, self.eps, name="conv_out", **conv_kw)(x)
        return x


def split_noise(noise: Sequence[jax.Array], counts: Sequence[int]) -> list[tuple]:
    """Consecutive runs of ``counts[i]`` arrays (diffusers' draw order, block by block)."""
    runs, start = [], 0
    for n in counts:
        runs.append(tuple(noise[start : start + n]))
        start += n
    return runs


class MidBlock3d(nn.Module):
    """diffusers ``LTXVideoMidBlock3d`` / ``LTX2VideoMidBlock3d``: ``num_layers`` resnets at the
    input width; with timestep conditioning its ``time_embedder`` turns the (scaled) timestep
    into their ``[B, 4 C]`` modulation."""

    num_layers: int
    eps: float = 1e-6
    is_causal: bool = True
    inject_noise: bool = False
    timestep_conditioning: bool = False
    padding_mode: str = "zeros"
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, temb=None, noise: Sequence[jax.Array] = ()) -> jax.Array:
        kw = {"dtype": self.dtype, "param_dtype": self.param_dtype}
        channels = x.shape[-1]
        emb = None
        if self.timestep_conditioning:
            emb = TimeEmbedder(4 * channels, name="time_embedder", **kw)(temb)
        per_resnet = 2 if self.inject_noise else 0
        runs = split_noise(noise, [per_resnet] * self.num_layers)
        for i in range(self.num_layers):
            x = ResnetBlock3d(
                channels,
                self.eps,
                self.is_causal,
                self.inject_noise,
                self.timestep_conditioning,
                self.padding_mode,
                name=f"resnets_{i}",
                **kw,
            )(x, emb, runs[i])
        return x


class UpBlock3d(nn.Module):
    """diffusers ``LTXVideoUpBlock3d`` / ``LTX2VideoUpBlock3d``: [``conv_in`` resnet changing
    width, its shortcut plain with ``plain_shortcut``], [time embedder], the
    :class:`Upsampler3d` (``upsamplers_0``, the level's stride), then ``num_layers`` resnets."""

    level: DecoderLevel
    eps: float = 1e-6
    is_causal: bool = True
    timestep_conditioning: bool = False
    padding_mode: str = "zeros"
    plain_shortcut: bool = False
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, temb=None, noise: Sequence[jax.Array] = ()) -> jax.Array:
        kw = {"dtype": self.dtype, "param_dtype": self.param_dtype}
        conv_kw = {"is_causal": self.is_causal, "padding_mode": self.padding_mode, **kw}
        lv = self.level
        if lv.conv_in:  # never with conditioning or noise (both configs refuse those)
            conv_in = ResnetBlock3d(
                lv.out_channels,
                self.eps,
                plain_shortcut=self.plain_shortcut,
                name="conv_in",
                **conv_kw,
            )
            x = conv_in(x)
        emb = None
        if self.timestep_conditioning:
            emb = TimeEmbedder(4 * lv.in_channels, name="time_embedder", **kw)(temb)
        if lv.upsample is not None:
            up = Upsampler3d(
                lv.residual, lv.factor, stride=lv.upsample, name="upsamplers_0", **conv_kw
            )
            x = up(x)
        per_resnet = 2 if lv.inject_noise else 0
        runs = split_noise(noise, [per_resnet] * lv.num_layers)
        for i in range(lv.num_layers):
            x = ResnetBlock3d(
                lv.out_channels,
                self.eps,
                inject_noise=lv.inject_noise,
                timestep_conditioning=self.timestep_conditioning,
                name=f"resnets_{i}",
                **conv_kw,
            )(x, emb, runs[i])
        return x


def scale_decode_timestep(decoder: nn.Module, temb_b: jax.Array) -> jax.Array:
    """The decode timesteps times the decoder's ``timestep_scale_multiplier`` parameter (created
    in ``decoder``'s scope; call from its compact ``__call__``), as diffusers scales them
    before every time embedder."""
    # diffusers' 0-d parameter, kept as [1] here: weights.load_params places a 0-d tensor as
    # shape (1,) (np.ascontiguousarray of a 0-d array is 1-d).
    init = nn.with_logical_partitioning(nn.initializers.constant(TIMESTEP_SCALE), (None,))
    multiplier = decoder.param("timestep_scale_multiplier", init, (1,), decoder.param_dtype)
    return temb_b.astype(decoder.dtype) * multiplier.astype(decoder.dtype)[0]


def modulate_decoder_output(decoder: nn.Module, x_bthwc: jax.Array, temb_b: jax.Array):
    """The decoder head's timestep scale / shift after its last norm: ``time_embedder`` and
    ``scale_shift_table`` in ``decoder``'s scope (call from its compact ``__call__``)."""
    channels = x_bthwc.shape[-1]
    kw = {"dtype": decoder.dtype, "param_dtype": decoder.param_dtype}
    emb = TimeEmbedder(2 * channels, name="time_embedder", **kw)(temb_b)
    table = decoder.param("scale_shift_table", _TABLE_INIT, (2, channels), decoder.param_dtype)
    mod = emb.reshape(emb.shape[0], 2, channels) + table.astype(decoder.dtype)[None]
    return x_bthwc * (1 + _per_sample(mod[:, 1])) + _per_sample(mod[:, 0])


class Encoder3d(nn.Module):
    """diffusers ``LTXVideoEncoder3d``: patchify, conv_in, down blocks, mid block, RMS norm,
    SiLU, conv_out -> ``latent_channels + 1`` channels (means, then the shared log-variance)."""

    config: LTXVideoVAEConfig
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x_bthwc: jax.Array) -> jax.Array:
        cfg = self.config
        kw = {"dtype": self.dtype, "param_dtype": self.param_dtype}
        causal, eps = cfg.encoder_causal, cfg.resnet_norm_eps
        x = patchify(x_bthwc, cfg.patch_size)
        x = CausalConv3d(cfg.block_out_channels[0], is_causal=causal, name="conv_in", **kw)(x)
        for i, level in enumerate(cfg.encoder_levels):
            x = DownBlock3D(level, eps, causal, name=f"down_blocks_{i}", **kw)(x)
        x = MidBlock3d(cfg.layers_per_block[-1], eps, causal, name="mid_block", **kw)(x)
        x = silu(pixel_norm(x))
        return CausalConv3d(cfg.latent_channels + 1, is_causal=causal, name="conv_out", **kw)(x)


class Decoder3d(nn.Module):
    """diffusers ``LTXVideoDecoder3d``: conv_in, mid block, up blocks, RMS norm, [timestep
    scale/shift], SiLU, conv_out, unpatchify.

    ``temb``: ``[B]`` decode timesteps (timestep conditioning only), multiplied by the
    ``timestep_scale_multiplier`` parameter before every time embedder; ``noise``: the
    ``[H, W]`` arrays of :func:`decoder_noise_shapes`, in that order.
    """

    config: LTXVideoVAEConfig
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, z_bthwc: jax.Array, temb=None, noise: Sequence[jax.Array] = ()):
        cfg = self.config
        kw = {"dtype": self.dtype, "param_dtype": self.param_dtype}
        causal, eps, cond = cfg.decoder_causal, cfg.resnet_norm_eps, cfg.timestep_conditioning
        x = CausalConv3d(cfg.decoder_width, is_causal=causal, name="conv_in", **kw)(z_bthwc)
        if cond:
            temb = scale_decode_timestep(self, temb)
        mid_layers, mid_noise = cfg.decoder_mid
        runs = split_noise(noise, noise_counts(cfg))
        mid = MidBlock3d(mid_layers, eps, causal, mid_noise, cond, name="mid_block", **kw)
        x = mid(x, temb, runs[0])
        for i, level in enumerate(cfg.decoder_levels):
            block = UpBlock3d(level, eps, causal, cond, name=f"up_blocks_{i}", **kw)
            x = block(x, temb, runs[i + 1])
        x = pixel_norm(x)
        if cond:
            x = modulate_decoder_output(self, x, temb)
        out = cfg.out_channels * cfg.patch_size**2
        x = CausalConv3d(out, is_causal=causal, name="conv_out", **kw)(silu(x))
        return unpatchify(x, cfg.patch_size)


# ----------------------------------------------------------------------------------------------
# Shapes, noise and latent statistics
# ----------------------------------------------------------------------------------------------


def noise_counts(config: CausalVAELayout) -> list[int]:
    """Noise draws per decoder block, mid block first: 2 per resnet of a noisy block."""
    mid_layers, mid_noise = config.decoder_mid
    counts = [2 * mid_layers if mid_noise else 0]
    counts += [2 * lv.num_layers if lv.inject_noise else 0 for lv in config.decoder_levels]
    return counts


def decoder_noise_shapes(
    config: CausalVAELayout, latent_hw: Sequence[int]
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
    config: CausalVAELayout, latent_hw: Sequence[int], rng: jax.Array, dtype=jnp.float32
) -> tuple[jax.Array, ...]:
    """Standard normal noise for every draw of :func:`decoder_noise_shapes` (our stand-in for
    diffusers' global-RNG ``torch.randn``; same distribution, not the same numbers)."""
    shapes = decoder_noise_shapes(config, latent_hw)
    keys = jax.random.split(rng, max(len(shapes), 1))
    return tuple(jax.random.normal(k, s, dtype) for k, s in zip(keys, shapes, strict=False))


def mix_decode_noise(
    latents_bcfhw: jax.Array, noise_bcfhw: jax.Array, decode_noise_scale
) -> jax.Array:
    """LTXPipeline's step before a timestep-conditioned decode:
    ``(1 - s) * latents + s * noise`` with ``s`` a scalar or one value per sample."""
    s = jnp.asarray(decode_noise_scale, latents_bcfhw.dtype).reshape(-1, 1, 1, 1, 1)
    return (1 - s) * latents_bcfhw + s * noise_bcfhw.astype(latents_bcfhw.dtype)


def _latent_stats(params: Mapping, z: jax.Array) -> tuple[jax.Array, jax.Array]:
    shape = (1, -1, 1, 1, 1)
    mean = jnp.asarray(params["latents_mean"], z.dtype).reshape(shape)
    std = jnp.asarray(params["latents_std"], z.dtype).reshape(shape)
    if z.ndim != 5 or z.shape[1] != mean.shape[1]:
        raise ValueError(f"latents must be [B, {mean.shape[1]}, F, H, W], got shape {z.shape}")
    return mean, std


def normalize_latents(z_bcfhw: jax.Array, params: Mapping, config: LTXVideoVAEConfig) -> jax.Array:
    """VAE latents -> the transformer's space, LTXPipeline's ``_normalize_latents``:
    ``(z - latents_mean) * scaling_factor / latents_std`` (the checkpoint's buffers, kept in
    ``params``)."""
    mean, std = _latent_stats(params, z_bcfhw)
    return (z_bcfhw - mean) * config.scaling_factor / std


def denormalize_latents(
    z_bcfhw: jax.Array, params: Mapping, config: LTXVideoVAEConfig
) -> jax.Array:
    """Inverse of :func:`normalize_latents` (``_denormalize_latents``), before decoding."""
    mean, std = _latent_stats(params, z_bcfhw)
    return z_bcfhw * std / config.scaling_factor + mean


def latent_shape(config: CausalVAELayout, video_shape: Sequence[int]) -> tuple[int, ...]:
    """The latent shape of a ``[B, C, F, H, W]`` video; ValueError naming the dimension where
    diffusers' reshapes would fail (H / W not divisible by patch_size, or by 2 before a
    space-to-depth level; an even frame count before a temporal space-to-depth level)."""
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
        f, h, w = downsampled_size(config, i, level.downsample, (f, h, w))
    return (b, config.latent_channels, f, h, w)


def downsampled_size(
    config: CausalVAELayout, i: int, downsample, fhw: tuple[int, int, int]
) -> tuple[int, int, int]:
    """(F, H, W) after down block ``i``'s downsampler (``"conv"``: stride 2 after padding 2
    frames / 1 pixel a side; a stride: folded after prepending ``s_t - 1`` frames); ValueError
    naming the dimension diffusers' reshapes would fail on."""
    f, h, w = fhw
    if downsample is None:
        return fhw
    if downsample == "conv":
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


def check_video(config: LTXVideoVAEConfig, video_shape: Sequence[int]) -> None:
    """Raise ValueError naming the dimension when a video cannot be encoded like diffusers."""
    latent_shape(config, video_shape)


def check_latents(config: CausalVAELayout, z_shape: Sequence[int]) -> None:
    """Raise ValueError naming the dimension when latents do not fit this VAE."""
    if len(z_shape) != 5:
        raise ValueError(f"latents must be [B, C, F, H, W], got shape {tuple(z_shape)}")
    if z_shape[1] != config.latent_channels:
        raise ValueError(
            f"latents have {z_shape[1]} channels but latent_channels is {config.latent_channels}"
        )
    if min(z_shape[2:]) < 1:
        raise ValueError(f"latents have an empty dimension: shape {tuple(z_shape)}")


def decode_timesteps(config: CausalVAELayout, temb, batch: int):
    """The decode timestep per sample ([B] float), or None without timestep conditioning."""
    if not config.timestep_conditioning:
        if temb is not None:
            raise ValueError(
                "temb given, but this VAE has timestep_conditioning=False (LTXPipeline passes "
                "no timestep to such a VAE; pass temb=None)"
            )
        return None
    if temb is None:
        raise ValueError("this VAE has timestep_conditioning=True: decode needs temb")
    t = jnp.asarray(temb, jnp.float32).reshape(-1)
    if t.shape[0] not in (1, batch):
        raise ValueError(f"temb has {t.shape[0]} values for a batch of {batch}")
    return jnp.broadcast_to(t, (batch,))


def check_noise(config: CausalVAELayout, z_shape, noise) -> tuple:
    """``noise`` as a tuple; ValueError unless it has the shapes of :func:`decoder_noise_shapes`."""
    expected = decoder_noise_shapes(config, z_shape[3:5])
    noise = tuple(noise or ())
    got = tuple(tuple(n.shape) for n in noise)
    if got != expected:
        raise ValueError(
            f"decoder noise has shapes {list(got)} but this VAE draws {list(expected)} for "
            "these latents (decoder_noise_shapes; pass rng= to draw it)"
        )
    return noise


def decode_arguments(config: CausalVAELayout, z_shape, temb, noise, rng) -> tuple:
    """(decode timesteps or None, noise): :func:`decode`'s checked inputs besides the latents;
    the noise drawn from ``rng`` when the VAE injects noise and none is given."""
    if config.injects_noise and noise is None:
        if rng is None:
            raise ValueError("this VAE injects noise while decoding: pass noise= or rng=")
        noise = sample_decoder_noise(config, z_shape[3:5], rng)
    noise = check_noise(config, z_shape, noise)
    return decode_timesteps(config, temb, z_shape[0]), noise


# ----------------------------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------------------------


def to_channel_last(x_bcfhw: jax.Array) -> jax.Array:
    return jnp.transpose(x_bcfhw, (0, 2, 3, 4, 1))


def to_channel_first(x_bfhwc: jax.Array) -> jax.Array:
    return jnp.transpose(x_bfhwc, (0, 4, 1, 2, 3))


def constrain_video(x_bthwc: jax.Array) -> jax.Array:
    names = ("frames", "height", "width", "channels")
    return sharding.constrain(x_bthwc, ("activation_batch", *(f"activation_{n}" for n in names)))


def moments_to_posterior(h_bthwc: jax.Array, latent_channels: int) -> DiagonalGaussian:
    """conv_out's ``latent + 1`` channels -> (mean, clamped logvar) in ``[B, C, F, H, W]``; the
    last channel is every latent channel's log-variance (diffusers repeats it)."""
    h = to_channel_first(h_bthwc)
    mean = h[:, :latent_channels]
    logvar = jnp.broadcast_to(h[:, latent_channels:], mean.shape)
    return DiagonalGaussian(mean, jnp.clip(logvar, *LOGVAR_RANGE))


class LTXVideoVAE(nn.Module):
    """LTX-Video VAE (= diffusers ``AutoencoderKLLTXVideo``), parameters named as in diffusers.

    ``encode(video [B, C, F, H, W]) -> DiagonalGaussian`` (``[B, latent, F', H', W']``);
    ``decode(z, temb=None, noise=()) -> video`` (unclamped; ``temb`` ``[B]`` or a scalar with
    timestep conditioning, ``noise`` the ``[H, W]`` arrays of :func:`decoder_noise_shapes`);
    ``__call__(video, temb, noise)`` = decode(encode(video).mode()). The checkpoint's
    ``latents_mean`` / ``latents_std`` buffers are top-level entries of ``params`` (not trained;
    :func:`normalize_latents` reads them). Prefer the jitted :func:`encode` / :func:`decode`.
    """

    config: LTXVideoVAEConfig
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    mesh: jax.sharding.Mesh | None = None

    def setup(self):
        cfg = self.config
        kw = {"dtype": self.dtype, "param_dtype": self.param_dtype}
        self.encoder = Encoder3d(cfg, **kw)
        self.decoder = Decoder3d(cfg, **kw)
        shape = (cfg.latent_channels,)
        self.latents_mean = self.param("latents_mean", CHANNEL_ZEROS, shape, self.param_dtype)
        self.latents_std = self.param("latents_std", CHANNEL_ONES, shape, self.param_dtype)

    def encode(self, video_bcfhw: jax.Array) -> DiagonalGaussian:
        check_video(self.config, video_bcfhw.shape)
        x = constrain_video(to_channel_last(video_bcfhw).astype(self.dtype))
        return moments_to_posterior(self.encoder(x), self.config.latent_channels)

    def decode(self, z_bcfhw: jax.Array, temb=None, noise: Sequence[jax.Array] = ()):
        check_latents(self.config, z_bcfhw.shape)
        t = decode_timesteps(self.config, temb, z_bcfhw.shape[0])
        noise = check_noise(self.config, z_bcfhw.shape, noise)
        z = constrain_video(to_channel_last(z_bcfhw).astype(self.dtype))
        return to_channel_first(self.decoder(z, t, noise))

    def __call__(self, video_bcfhw: jax.Array, temb=None, noise: Sequence[jax.Array] = ()):
        return self.decode(self.encode(video_bcfhw).mode(), temb, noise)


@functools.lru_cache(maxsize=32)
def jitted(module: nn.Module, method: str):
    """``module.apply`` of ``method`` under jit, cached per (module, method)."""

    def run(params, *args):
        return module.apply({"params": params}, *args, method=method)

    return jax.jit(run)


def encode(module: LTXVideoVAE, params, video_bcfhw: jax.Array) -> DiagonalGaussian:
    """Encode ``[B, C, F, H, W]`` pixels in [-1, 1] -> posterior ``[B, latent, F', H', W']``
    (mean, logvar clamped to [-30, 20]), the whole video in one jitted call. With LTX's usual
    compression (s = :attr:`~LTXVideoVAEConfig.spatial_compression`, t =
    :attr:`~LTXVideoVAEConfig.temporal_compression`) ``1 + t k`` frames give ``1 + k``."""
    check_video(module.config, video_bcfhw.shape)
    return jitted(module, "encode")(params, jnp.asarray(video_bcfhw))


def decode(
    module: LTXVideoVAE,
    params,
    z_bcfhw: jax.Array,
    temb=None,
    *,
    noise: Sequence[jax.Array] | None = None,
    rng: jax.Array | None = None,
) -> jax.Array:
    """Decode latents ``[B, latent, F, H, W]`` -> video ``[B, C, 1 + 2^u (F - 1), ...]``
    (u: the decoder's upsampling levels), unclamped, in one jitted call.

    ``temb``: the decode timestep(s) of a timestep-conditioned VAE (``[B]`` or a scalar; None
    otherwise). With ``decoder_inject_noise``: ``noise`` (the arrays of
    :func:`decoder_noise_shapes`, diffusers' draw order) or ``rng`` to draw it.
    """
    check_latents(module.config, z_bcfhw.shape)
    t, noise = decode_arguments(module.config, z_bcfhw.shape, temb, noise, rng)
    return jitted(module, "decode")(params, jnp.asarray(z_bcfhw), t, noise)


# ----------------------------------------------------------------------------------------------
# Weights
# ----------------------------------------------------------------------------------------------


def _dummy_inputs(config: LTXVideoVAEConfig):
    """(the smallest video every encoder level accepts, one latent pixel, a timestep or None):
    what ``init`` traces to create every parameter."""
    s = config.spatial_compression
    video = jax.ShapeDtypeStruct((1, config.in_channels, 1, s, s), jnp.float32)
    latents = jax.ShapeDtypeStruct((1, config.latent_channels, 1, 1, 1), jnp.float32)
    temb = jax.ShapeDtypeStruct((1,), jnp.float32) if config.timestep_conditioning else None
    return video, latents, temb


def create_parameters(module: nn.Module, video, latents, temb):
    """``init``'s method: the encoder, and the decoder with zero noise."""
    module.encode(video)
    shapes = decoder_noise_shapes(module.config, latents.shape[3:5])
    return module.decode(latents, temb, tuple(jnp.zeros(s, latents.dtype) for s in shapes))


def create_encoder_parameters(module: nn.Module, video, latents, temb):
    """``init``'s method for an encoder-only load: the encoder and the latent statistics."""
    return module.encode(video)


_LIST_MODULE = re.compile(r"^(resnets|down_blocks|up_blocks|downsamplers|upsamplers)_(\d+)$")
_PER_CHANNEL_SCALE = weights.Invertible(lambda w: w.reshape(-1), lambda s: s.reshape(-1, 1, 1))
_SCALAR_AS_VECTOR = weights.Invertible(lambda w: w.reshape(1), lambda v: v.reshape(()))
# Leaves stored as diffusers stores them.
_AS_IS = ("scale_shift_table", "latents_mean", "latents_std")


def source_entry(path: tuple[str, ...], ndim: int) -> tuple[str, weights.Transform]:
    """Flax param path -> (diffusers key, transform). Module names mirror diffusers attribute
    names; list entries are written ``resnets_3`` for diffusers' ``resnets.3``."""
    *modules, leaf = path
    key = ".".join(_LIST_MODULE.sub(r"\1.\2", m) for m in modules)
    prefix = f"{key}." if key else ""
    if leaf == "kernel":
        return f"{prefix}weight", {5: weights.conv3d, 2: weights.linear}[ndim]
    if leaf == "scale":  # norm3 (LayerNorm)
        return f"{prefix}weight", weights.identity
    if leaf == "bias" or leaf in _AS_IS:
        return f"{prefix}{leaf}", weights.identity
    if leaf in ("per_channel_scale1", "per_channel_scale2"):  # torch [C, 1, 1]
        return f"{prefix}{leaf}", _PER_CHANNEL_SCALE
    if leaf == "timestep_scale_multiplier":  # torch 0-d
        return f"{prefix}{leaf}", _SCALAR_AS_VECTOR
    raise ValueError(f"no diffusers name for parameter {'/'.join(path)}")


_FILL = {
    "bias": 0.0,
    "scale": 1.0,
    "per_channel_scale1": 0.0,
    "per_channel_scale2": 0.0,
    # diffusers draws randn / sqrt(C); fill has no key, and zeros start as "no modulation".
    "scale_shift_table": 0.0,
    "timestep_scale_multiplier": TIMESTEP_SCALE,
    "latents_mean": 0.0,
    "latents_std": 1.0,
}


def fill(name: str, shape: tuple[int, ...], dtype: Dtype) -> jax.Array:
    """init_ltx_vae's value of every parameter but the kernels."""
    return jnp.full(shape, _FILL[name], dtype)


# build / load / init / shape / count, as the other VAEs (jaxcore.weights.VAEKind)
KIND = weights.VAEKind(
    LTXVideoVAE,
    LTXVideoVAEConfig,
    _dummy_inputs,
    lambda config, boxed: weights.weight_map_by_path(boxed, source_entry),
    trace_method=create_parameters,
    encoder_method=create_encoder_parameters,
    fill=fill,
)
abstract_params = KIND.abstract_params
# Entries of params that are diffusers buffers, not parameters (AutoencoderKLLTXVideo's
# register_buffer); count_params leaves them out, as torch's parameters() does.
BUFFERS = ("latents_mean", "latents_std")


def count_params(config: LTXVideoVAEConfig, *, include_buffers: bool = False) -> int:
    """Parameters from eval_shape (nothing allocated); by default without the two latent
    statistics buffers, i.e. diffusers' ``sum(p.numel() for p in model.parameters())``."""
    total = KIND.count_params(config)
    return total if include_buffers else total - len(BUFFERS) * config.latent_channels


def weight_map(config: LTXVideoVAEConfig) -> dict:
    """{flax param path: (diffusers AutoencoderKLLTXVideo key, transform)}."""
    return KIND.weight_map(config, abstract_params(LTXVideoVAE(config)))


def load_ltx_vae(directory: str | os.PathLike, *, dtype: Dtype = jnp.float32, **options):
    """:meth:`jaxcore.weights.VAEKind.load` of a diffusers ``AutoencoderKLLTXVideo`` directory
    (config.json + safetensors), activations and parameters in ``dtype`` (``mesh``, ``rules``,
    ``encoder_only`` as there): ``(module, params)``."""
    return KIND.load(directory, dtype=dtype, param_dtype=dtype, **options)


def init_ltx_vae(config: LTXVideoVAEConfig, rng: jax.Array, *, dtype: Dtype = jnp.float32, **kw):
    """:meth:`jaxcore.weights.VAEKind.init`: kernels LeCun normal, the rest :func:`fill`."""
    return KIND.init(config, rng, dtype=dtype, param_dtype=dtype, **kw)
