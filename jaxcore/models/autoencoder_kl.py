"""The image VAE of Stable Diffusion / SDXL / Flux.1 in Flax linen (= diffusers ``AutoencoderKL``).

Reference: ``diffusers/models/autoencoders/autoencoder_kl.py`` and ``vae.py`` (Encoder,
Decoder, DiagonalGaussianDistribution), ``unets/unet_2d_blocks.py`` (DownEncoderBlock2D,
UpDecoderBlock2D, UNetMidBlock2D), ``resnet.py`` (ResnetBlock2D), ``downsampling.py`` /
``upsampling.py`` (Downsample2D, Upsample2D) and ``attention_processor.py`` (Attention with
group norm and a residual, as the mid block builds it), diffusers 0.42. Inference only
(dropout is identity); no tiling or slicing (diffusers' defaults are off too).

Layout: public tensors use the diffusers layout, images ``[B, C, H, W]`` with pixel values in
[-1, 1] and latents ``[B, latent_channels, H / s, W / s]`` (s = :attr:`spatial_compression`).
Inside, every activation is channel-last ``[B, H, W, C]``.

What makes it equal to diffusers:
- GroupNorm (eps 1e-6 everywhere in this VAE) is computed in float32 and cast back, as
  torch's GroupNorm does in its float accumulator; statistics are biased (divide by N).
- ResnetBlock2D: norm1, act, conv1, norm2, act, conv2, plus a 1x1 ``conv_shortcut`` when the
  channel count changes. ``act_fn`` is used inside resnets only; the Encoder/Decoder heads
  (``conv_act``) are always SiLU, whatever ``act_fn`` says.
- Downsample2D with ``padding=0`` (what the Encoder passes): zero pad one row at the bottom and
  one column at the right, then a 3x3 stride-2 conv without padding.
- Upsample2D: nearest-neighbour x2 (each pixel repeated 2x2), then a 3x3 conv.
- Mid-block attention: a single head over the H*W pixels of width C (``attention_head_dim``
  is the channel count), group-normed input, q/k/v/out linear layers (``to_out.0``), the input
  added back (``residual_connection=True``), softmax in float32 (``upcast_softmax``). It runs
  through :func:`jaxcore.attention.attention` (``[B, L, H, D]`` with H = 1; the backend is
  the module's ``attention`` field).
- The posterior's log-variance is clamped to [-30, 20]; :meth:`AutoencoderKL.decode` does not
  clamp its output (diffusers' ``AutoencoderKL.decode`` does not either; pipelines do).

Parity reached (tests/jaxcore/test_autoencoder_kl.py, fp32 on CPU, every diffusers parameter
perturbed, ``jax_default_matmul_precision="highest"``): encode mean <= 2.9e-6, logvar
<= 2.2e-6, decode <= 2.7e-6 max abs on outputs of magnitude 1.3-3.2 (Flux-like, SD-like and a
3-level non-square batch-2 config; test bound 1e-5). On a 4-level 128-channel model (slow
test) the difference is 1.0e-5 / 1.1e-5 / 1.3e-5 on outputs ~7: there diffusers' own fp32 run
is already 7e-6 from float64, and we are as close to float64 as it is. bf16 (weights and
activations) is as far from fp32 as diffusers' bf16 run: 0.018 / 0.072 vs its 0.017 / 0.058.

Latent scaling: the diffusion models never see raw VAE latents; see :func:`normalize_latents`
and :func:`denormalize_latents` for the three conventions (SD, SDXL, Flux). ``force_upcast`` is
kept as diffusers' metadata ("run this VAE in float32"); :func:`load_autoencoder_kl` uses the
``dtype`` it is given, so a caller honouring it passes ``dtype=jnp.float32``.

Public API: :class:`AutoencoderKLConfig`, :class:`AutoencoderKL`, :class:`DiagonalGaussian`
(shared with :mod:`jaxcore.models.wan_vae`), :func:`encode`, :func:`decode`,
:func:`normalize_latents`, :func:`denormalize_latents`, :func:`check_images`,
:func:`check_latents`, :func:`weight_map`, :func:`abstract_params`,
:func:`load_autoencoder_kl`, :func:`init_autoencoder_kl`, :func:`count_params`.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

from jaxcore import quantization, sharding, weights
from jaxcore.attention import attention as attention_fn
from jaxcore.config import config_json_kwargs
from jaxcore.models import layers
from jaxcore.models.layers import gelu_erf, silu
from jaxcore.models.wan_vae import LOGVAR_RANGE, DiagonalGaussian

Dtype = Any

# Every GroupNorm of diffusers' Encoder/Decoder/mid block uses this epsilon.
NORM_EPS = 1e-6
DOWN_BLOCK_TYPE = "DownEncoderBlock2D"
UP_BLOCK_TYPE = "UpDecoderBlock2D"

# diffusers.models.activations.ACT2CLS (torch's GELU is the exact erf form); torch's kernels
# compute in float32 and round once (jaxcore.models.layers.in_float32).
ACTIVATIONS = {
    "silu": silu,
    "swish": silu,
    "mish": jax.nn.mish,
    "gelu": gelu_erf,
    "relu": jax.nn.relu,
}

__all__ = [
    "AutoencoderKL",
    "AutoencoderKLConfig",
    "AutoencoderKLConfigError",
    "DiagonalGaussian",
    "abstract_params",
    "check_images",
    "check_latents",
    "count_params",
    "decode",
    "denormalize_latents",
    "encode",
    "init_autoencoder_kl",
    "load_autoencoder_kl",
    "normalize_latents",
    "weight_map",
]


# ----------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------


class AutoencoderKLConfigError(ValueError):
    """A config.json / YAML section AutoencoderKLConfig cannot represent; names the key."""


@dataclasses.dataclass(frozen=True)
class AutoencoderKLConfig:
    """Architecture and latent statistics of an AutoencoderKL; names follow diffusers' config.json.

    Defaults are diffusers' ``AutoencoderKL.__init__`` defaults. ``sample_size`` and
    ``force_upcast`` are metadata (diffusers uses them for tiling and pipeline dtype only).
    ``scaling_factor``, ``shift_factor``, ``latents_mean`` and ``latents_std`` do not change the
    network; :func:`normalize_latents` / :func:`denormalize_latents` use them.
    """

    in_channels: int = 3
    out_channels: int = 3
    down_block_types: tuple[str, ...] = (DOWN_BLOCK_TYPE,)
    up_block_types: tuple[str, ...] = (UP_BLOCK_TYPE,)
    block_out_channels: tuple[int, ...] = (64,)
    layers_per_block: int = 1
    act_fn: str = "silu"
    latent_channels: int = 4
    norm_num_groups: int = 32
    sample_size: int | tuple[int, ...] = 32
    scaling_factor: float = 0.18215
    shift_factor: float | None = None
    latents_mean: tuple[float, ...] | None = None
    latents_std: tuple[float, ...] | None = None
    force_upcast: bool = True
    use_quant_conv: bool = True
    use_post_quant_conv: bool = True
    mid_block_add_attention: bool = True

    def __post_init__(self):
        for key in ("down_block_types", "up_block_types", "block_out_channels"):
            object.__setattr__(self, key, tuple(getattr(self, key)))
        for key in ("latents_mean", "latents_std"):
            if getattr(self, key) is not None:
                object.__setattr__(self, key, tuple(float(v) for v in getattr(self, key)))
        if isinstance(self.sample_size, list | tuple):
            object.__setattr__(self, "sample_size", tuple(self.sample_size))
        self._check_blocks()
        self._check_sizes()
        self._check_latent_statistics()

    def _check_blocks(self) -> None:
        """Only the plain VAE blocks exist here; anything else is refused by name."""
        levels = len(self.block_out_channels)
        for key, supported in (
            ("down_block_types", DOWN_BLOCK_TYPE),
            ("up_block_types", UP_BLOCK_TYPE),
        ):
            types = getattr(self, key)
            for i, name in enumerate(types):
                if name != supported:
                    raise AutoencoderKLConfigError(
                        f"{key}[{i}]={name!r} is not implemented; only {supported!r} blocks "
                        "(the AutoencoderKL of SD / SDXL / Flux) are supported"
                    )
            if len(types) != levels:
                raise AutoencoderKLConfigError(
                    f"{key} has {len(types)} entries but block_out_channels has {levels}; "
                    "the VAE needs one block per level"
                )
        if self.act_fn not in ACTIVATIONS:
            raise AutoencoderKLConfigError(
                f"act_fn={self.act_fn!r} is not one of {sorted(ACTIVATIONS)}"
            )

    def _check_sizes(self) -> None:
        for key in (
            "in_channels",
            "out_channels",
            "layers_per_block",
            "latent_channels",
            "norm_num_groups",
        ):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise AutoencoderKLConfigError(f"{key} must be an int >= 1, got {value!r}")
        if not self.block_out_channels or min(self.block_out_channels) < 1:
            raise AutoencoderKLConfigError(
                f"block_out_channels must be positive ints, got {list(self.block_out_channels)}"
            )
        for channels in self.block_out_channels:
            if channels % self.norm_num_groups:
                raise AutoencoderKLConfigError(
                    f"block_out_channels entry {channels} is not divisible by "
                    f"norm_num_groups={self.norm_num_groups} (GroupNorm needs whole groups)"
                )
        if not self.scaling_factor > 0:
            raise AutoencoderKLConfigError(f"scaling_factor must be > 0, got {self.scaling_factor}")

    def _check_latent_statistics(self) -> None:
        has_mean, has_std = self.latents_mean is not None, self.latents_std is not None
        if has_mean != has_std:
            # The SDXL pipelines use the statistics only when both are set; one alone would be
            # silently ignored there, so it is refused here.
            raise AutoencoderKLConfigError(
                "latents_mean and latents_std must be set together (or both null); got only "
                + ("latents_mean" if has_mean else "latents_std")
            )
        for key in ("latents_mean", "latents_std"):
            values = getattr(self, key)
            if values is not None and len(values) != self.latent_channels:
                raise AutoencoderKLConfigError(
                    f"{key} has {len(values)} entries but latent_channels is {self.latent_channels}"
                )
        if has_std and min(self.latents_std) <= 0:
            raise AutoencoderKLConfigError(
                f"latents_std must be positive, got {list(self.latents_std)}"
            )

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> AutoencoderKLConfig:
        """Build from a diffusers config.json dict (``_``-prefixed keys ignored)."""
        return cls(**config_json_kwargs(cls, d, AutoencoderKLConfigError))

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}

    @property
    def spatial_compression(self) -> int:
        """Pixels per latent along H and W (one 2x downsample per level but the last)."""
        return 2 ** (len(self.block_out_channels) - 1)


# ----------------------------------------------------------------------------------------------
# Layers (channel-last)
# ----------------------------------------------------------------------------------------------

# Parameters are annotated with logical names only; under the default rules the whole VAE is
# replicated (conv_in / conv_out / norm map to no mesh axis). The 1x1 attention projections
# are per-pixel channel mixes, so they carry the conv channel names too.
_KERNEL_INIT_4D = nn.with_logical_partitioning(
    nn.initializers.lecun_normal(), (None, None, "conv_in", "conv_out")
)
_KERNEL_INIT_2D = nn.with_logical_partitioning(
    nn.initializers.lecun_normal(), ("conv_in", "conv_out")
)
_BIAS_INIT = nn.with_logical_partitioning(nn.initializers.zeros_init(), ("conv_out",))
_SCALE_INIT = nn.with_logical_partitioning(nn.initializers.ones_init(), ("norm",))
_SHIFT_INIT = nn.with_logical_partitioning(nn.initializers.zeros_init(), ("norm",))


def _constrain_image(x_bhwc: jax.Array) -> jax.Array:
    """Sharding hint: batch over (data, fsdp); H, W, C by their (default: replicated) rules."""
    return sharding.constrain(
        x_bhwc,
        ("activation_batch", "activation_height", "activation_width", "activation_channels"),
    )


class Conv2d(nn.Module):
    """torch ``nn.Conv2d`` on ``[B, H, W, C]`` with explicit (low, high) zero padding per axis."""

    features: int
    kernel_size: tuple[int, int] = (3, 3)
    strides: tuple[int, int] = (1, 1)
    padding: tuple[tuple[int, int], tuple[int, int]] = ((1, 1), (1, 1))
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x_bhwc: jax.Array) -> jax.Array:
        kernel = self.param(
            "kernel",
            _KERNEL_INIT_4D,
            (*self.kernel_size, x_bhwc.shape[-1], self.features),
            self.param_dtype,
        )
        bias = self.param("bias", _BIAS_INIT, (self.features,), self.param_dtype)

        x, kernel = x_bhwc.astype(self.dtype), quantization.as_dtype(kernel, self.dtype)
        y = layers.conv2d(x, kernel, self.strides, self.padding)
        return y + bias.astype(self.dtype)


class GroupNorm(nn.Module):
    """torch ``nn.GroupNorm(num_groups, C, eps, affine=True)`` on ``[B, H, W, C]``, in float32.

    Groups are contiguous channel ranges, as in torch; params ``scale`` / ``bias`` are
    diffusers' ``weight`` / ``bias``.
    """

    num_groups: int
    eps: float = NORM_EPS
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x_bhwc: jax.Array) -> jax.Array:
        b, h, w, c = x_bhwc.shape
        scale = self.param("scale", _SCALE_INIT, (c,), self.param_dtype)
        shift = self.param("bias", _SHIFT_INIT, (c,), self.param_dtype)
        x = x_bhwc.astype(jnp.float32).reshape(b, h * w, self.num_groups, c // self.num_groups)
        mean = jnp.mean(x, axis=(1, 3), keepdims=True)
        var = jnp.mean(jnp.square(x - mean), axis=(1, 3), keepdims=True)
        x = ((x - mean) * jax.lax.rsqrt(var + self.eps)).reshape(b, h, w, c)
        y = x * scale.astype(jnp.float32) + shift.astype(jnp.float32)
        return y.astype(self.dtype)


class ResnetBlock(nn.Module):
    """diffusers ``ResnetBlock2D`` without time embedding (temb_channels=None)."""

    out_channels: int
    num_groups: int
    act_fn: str = "silu"
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kw = {"dtype": self.dtype, "param_dtype": self.param_dtype}
        act = ACTIVATIONS[self.act_fn]
        h = act(GroupNorm(self.num_groups, name="norm1", **kw)(x))
        h = Conv2d(self.out_channels, name="conv1", **kw)(h)
        h = act(GroupNorm(self.num_groups, name="norm2", **kw)(h))
        h = Conv2d(self.out_channels, name="conv2", **kw)(h)
        shortcut = x.astype(self.dtype)
        if x.shape[-1] != self.out_channels:
            shortcut = Conv2d(
                self.out_channels, (1, 1), padding=((0, 0), (0, 0)), name="conv_shortcut", **kw
            )(x)
        return shortcut + h


class MidAttention(nn.Module):
    """diffusers ``Attention`` as ``UNetMidBlock2D`` builds it for the VAE: one head of width C
    over the H*W pixels, group-normed input, linear q/k/v/out, input added back."""

    num_groups: int
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    attention: str = "dot_product"
    mesh: jax.sharding.Mesh | None = None

    @nn.compact
    def __call__(self, x_bhwc: jax.Array) -> jax.Array:
        b, h, w, c = x_bhwc.shape
        kw = {"dtype": self.dtype, "param_dtype": self.param_dtype}

        def dense(name):
            return nn.Dense(c, kernel_init=_KERNEL_INIT_2D, bias_init=_BIAS_INIT, name=name, **kw)

        x_blc = GroupNorm(self.num_groups, name="group_norm", **kw)(x_bhwc).reshape(b, h * w, c)
        # One head: [B, L, 1, C] in the shared attention layout [B, L, H, D]; scale 1/sqrt(C).
        q, k, v = (dense(name)(x_blc)[:, :, None, :] for name in ("to_q", "to_k", "to_v"))
        out = attention_fn(q, k, v, backend=self.attention, mesh=self.mesh)[:, :, 0, :]
        out = dense("to_out_0")(out).reshape(b, h, w, c)
        return out + x_bhwc.astype(self.dtype)


class MidBlock(nn.Module):
    """diffusers ``UNetMidBlock2D`` (num_layers=1): resnet, [attention], resnet at constant C."""

    num_groups: int
    act_fn: str
    add_attention: bool
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    attention: str = "dot_product"
    mesh: jax.sharding.Mesh | None = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kw = {"dtype": self.dtype, "param_dtype": self.param_dtype}
        c = x.shape[-1]
        x = ResnetBlock(c, self.num_groups, self.act_fn, name="resnets_0", **kw)(x)
        if self.add_attention:
            x = MidAttention(
                self.num_groups,
                attention=self.attention,
                mesh=self.mesh,
                name="attentions_0",
                **kw,
            )(x)
        return ResnetBlock(c, self.num_groups, self.act_fn, name="resnets_1", **kw)(x)


class Downsample(nn.Module):
    """diffusers ``Downsample2D(use_conv=True, padding=0)``; its conv is named ``conv``."""

    channels: int
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kw = {"dtype": self.dtype, "param_dtype": self.param_dtype}
        pads = ((0, 1), (0, 1))  # torch F.pad(x, (0, 1, 0, 1)): right and bottom only
        return Conv2d(self.channels, strides=(2, 2), padding=pads, name="conv", **kw)(x)


class Upsample(nn.Module):
    """diffusers ``Upsample2D(use_conv=True)``: nearest x2 (F.interpolate mode="nearest" at
    scale 2 = each pixel repeated 2x2), then a 3x3 conv named ``conv``."""

    channels: int
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kw = {"dtype": self.dtype, "param_dtype": self.param_dtype}
        x = jnp.repeat(jnp.repeat(x, 2, axis=1), 2, axis=2)
        return Conv2d(self.channels, name="conv", **kw)(x)


# ResnetLevel's resample -> (the resampler, its diffusers attribute name)
_RESAMPLERS = {"down": (Downsample, "downsamplers_0"), "up": (Upsample, "upsamplers_0")}


class ResnetLevel(nn.Module):
    """One level of resnets, then (but on the last level) a resampler: diffusers
    ``DownEncoderBlock2D`` with ``resample="down"`` (a Downsample2D), ``UpDecoderBlock2D`` with
    ``"up"`` (an Upsample2D); ``None`` on the last level."""

    out_channels: int
    num_layers: int
    resample: str | None
    num_groups: int
    act_fn: str
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kw = {"dtype": self.dtype, "param_dtype": self.param_dtype}
        for j in range(self.num_layers):
            x = ResnetBlock(
                self.out_channels, self.num_groups, self.act_fn, name=f"resnets_{j}", **kw
            )(x)
        if self.resample is not None:
            resampler, name = _RESAMPLERS[self.resample]
            x = resampler(self.out_channels, name=name, **kw)(x)
        return x


class _EncoderOrDecoder(nn.Module):
    """What diffusers' ``vae.Encoder`` and ``vae.Decoder`` share: their fields, the mid block
    and the head (GroupNorm, SiLU whatever ``act_fn`` says, conv_out)."""

    config: AutoencoderKLConfig
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    attention: str = "dot_product"
    mesh: jax.sharding.Mesh | None = None

    @property
    def _kw(self) -> dict:
        return {"dtype": self.dtype, "param_dtype": self.param_dtype}

    @property
    def _resnet_kw(self) -> dict:
        return {"num_groups": self.config.norm_num_groups, "act_fn": self.config.act_fn, **self._kw}

    def _mid_block(self, x: jax.Array) -> jax.Array:
        return MidBlock(
            add_attention=self.config.mid_block_add_attention,
            attention=self.attention,
            mesh=self.mesh,
            name="mid_block",
            **self._resnet_kw,
        )(x)

    def _head(self, x: jax.Array, out_channels: int) -> jax.Array:
        x = silu(GroupNorm(self.config.norm_num_groups, name="conv_norm_out", **self._kw)(x))
        return Conv2d(out_channels, name="conv_out", **self._kw)(x)


class Encoder(_EncoderOrDecoder):
    """diffusers ``vae.Encoder`` (double_z): conv_in, down blocks, mid block, head -> 2 x latent."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        x = Conv2d(cfg.block_out_channels[0], name="conv_in", **self._kw)(x)
        last = len(cfg.block_out_channels) - 1
        for i, channels in enumerate(cfg.block_out_channels):
            resample = "down" if i != last else None
            block = ResnetLevel(
                channels, cfg.layers_per_block, resample, name=f"down_blocks_{i}", **self._resnet_kw
            )
            x = _constrain_image(block(x))
        x = self._mid_block(x)
        return self._head(x, 2 * cfg.latent_channels)


class Decoder(_EncoderOrDecoder):
    """diffusers ``vae.Decoder`` (norm_type="group"): conv_in, mid block, up blocks, head."""

    @nn.compact
    def __call__(self, z: jax.Array) -> jax.Array:
        cfg = self.config
        x = Conv2d(cfg.block_out_channels[-1], name="conv_in", **self._kw)(z)
        x = self._mid_block(x)
        last = len(cfg.block_out_channels) - 1
        for i, channels in enumerate(reversed(cfg.block_out_channels)):
            resample = "up" if i != last else None
            # diffusers gives every decoder level one resnet more than the encoder's.
            block = ResnetLevel(
                channels,
                cfg.layers_per_block + 1,
                resample,
                name=f"up_blocks_{i}",
                **self._resnet_kw,
            )
            x = _constrain_image(block(x))
        return self._head(x, cfg.out_channels)


# ----------------------------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------------------------


def check_images(config: AutoencoderKLConfig, images_shape: Sequence[int]) -> None:
    """Raise ValueError naming the dimension when images cannot be encoded and decoded back."""
    if len(images_shape) != 4:
        raise ValueError(f"images must be [B, C, H, W], got shape {tuple(images_shape)}")
    _, channels, height, width = images_shape
    if channels != config.in_channels:
        raise ValueError(f"images have {channels} channels but in_channels is {config.in_channels}")
    s = config.spatial_compression
    for name, size in (("height", height), ("width", width)):
        # diffusers would encode it, but decoding would not give the input size back.
        if size < 1 or size % s:
            raise ValueError(f"image {name} {size} is not divisible by the spatial compression {s}")


def check_latents(config: AutoencoderKLConfig, z_shape: Sequence[int]) -> None:
    """Raise ValueError naming the dimension when latents do not fit this VAE."""
    if len(z_shape) != 4:
        raise ValueError(f"latents must be [B, C, h, w], got shape {tuple(z_shape)}")
    if z_shape[1] != config.latent_channels:
        raise ValueError(
            f"latents have {z_shape[1]} channels but latent_channels is {config.latent_channels}"
        )


class AutoencoderKL(nn.Module):
    """diffusers ``AutoencoderKL``, parameters named as in diffusers (``name_3`` = ``name.3``).

    ``encode(images [B, C, H, W]) -> DiagonalGaussian`` (mean, clamped logvar, ``[B, c, h, w]``),
    ``decode(z [B, c, h, w]) -> [B, C_out, H, W]`` (unclamped), ``__call__(images)`` =
    decode(encode(images).mean) as diffusers' forward with ``sample_posterior=False`` (also what
    ``init`` runs). For inference prefer the jitted module-level :func:`encode` / :func:`decode`.
    """

    config: AutoencoderKLConfig
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    attention: str = "dot_product"
    mesh: jax.sharding.Mesh | None = None

    def setup(self):
        cfg = self.config
        kw = {"dtype": self.dtype, "param_dtype": self.param_dtype}
        shared = {"attention": self.attention, "mesh": self.mesh, **kw}
        one_by_one = {"kernel_size": (1, 1), "padding": ((0, 0), (0, 0)), **kw}
        self.encoder = Encoder(cfg, **shared)
        self.decoder = Decoder(cfg, **shared)
        if cfg.use_quant_conv:
            self.quant_conv = Conv2d(2 * cfg.latent_channels, **one_by_one)
        if cfg.use_post_quant_conv:
            self.post_quant_conv = Conv2d(cfg.latent_channels, **one_by_one)

    def encode(self, images_bchw: jax.Array) -> DiagonalGaussian:
        check_images(self.config, images_bchw.shape)
        x = _constrain_image(jnp.transpose(images_bchw, (0, 2, 3, 1)).astype(self.dtype))
        moments = self.encoder(x)
        if self.config.use_quant_conv:
            moments = self.quant_conv(moments)
        moments = jnp.transpose(moments, (0, 3, 1, 2))
        mean, logvar = jnp.split(moments, 2, axis=1)
        return DiagonalGaussian(mean, jnp.clip(logvar, *LOGVAR_RANGE))

    def decode(self, z_bchw: jax.Array) -> jax.Array:
        check_latents(self.config, z_bchw.shape)
        z = _constrain_image(jnp.transpose(z_bchw, (0, 2, 3, 1)).astype(self.dtype))
        if self.config.use_post_quant_conv:
            z = self.post_quant_conv(z)
        return jnp.transpose(self.decoder(z), (0, 3, 1, 2))

    def __call__(self, images_bchw: jax.Array) -> jax.Array:
        return self.decode(self.encode(images_bchw).mean)


@functools.lru_cache(maxsize=32)
def _jitted(module: AutoencoderKL, method: str):
    """jit(params, x) -> module.<method>(x); one cache entry per module and method."""

    def run(params, x):
        return module.apply({"params": params}, x, method=method)

    return jax.jit(run)


def encode(module: AutoencoderKL, params, images_bchw: jax.Array) -> DiagonalGaussian:
    """Encode images ``[B, C, H, W]`` in [-1, 1] -> posterior ``[B, c, H / s, W / s]`` (jitted).

    Returns (mean, logvar) with logvar clamped to [-30, 20] as diffusers'
    ``DiagonalGaussianDistribution``; ``.mode()`` is the mean, ``.sample(rng)`` draws.
    These are raw VAE latents: apply :func:`normalize_latents` before the diffusion model.
    """
    check_images(module.config, images_bchw.shape)
    return _jitted(module, "encode")(params, jnp.asarray(images_bchw))


def decode(module: AutoencoderKL, params, z_bchw: jax.Array) -> jax.Array:
    """Decode raw latents ``[B, c, h, w]`` -> images ``[B, C_out, s h, s w]`` (jitted, unclamped).

    Latents from a diffusion model go through :func:`denormalize_latents` first.
    """
    check_latents(module.config, z_bchw.shape)
    return _jitted(module, "decode")(params, jnp.asarray(z_bchw))


def _latent_stats(z: jax.Array, config: AutoencoderKLConfig):
    """(mean, std) shaped [1, c, 1, 1] in z's dtype, or None when the config has no statistics."""
    check_latents(config, z.shape)
    if config.latents_mean is None:
        return None
    if config.shift_factor is not None:
        # No diffusers pipeline combines the two; guessing an order would be silent.
        raise ValueError(
            "the VAE config sets both shift_factor and latents_mean/latents_std; no diffusers "
            "pipeline defines how to combine them"
        )
    shape = (1, config.latent_channels, 1, 1)
    mean = jnp.asarray(config.latents_mean, z.dtype).reshape(shape)
    std = jnp.asarray(config.latents_std, z.dtype).reshape(shape)
    return mean, std


def normalize_latents(z: jax.Array, config: AutoencoderKLConfig) -> jax.Array:
    """Raw VAE latents ``[B, c, h, w]`` -> the diffusion model's latent space.

    Exactly what the diffusers pipelines do after ``vae.encode`` (img2img / training):
    - latents_mean/std set (SDXL-style, ``StableDiffusionXLImg2ImgPipeline.prepare_latents``):
      ``(z - latents_mean) * scaling_factor / latents_std``;
    - shift_factor set (Flux, SD3: ``FluxImg2ImgPipeline._encode_vae_image``):
      ``(z - shift_factor) * scaling_factor``;
    - otherwise (SD 1.x/2.x, SDXL base: ``StableDiffusionImg2ImgPipeline.prepare_latents``):
      ``scaling_factor * z``.
    Flux packs latents into 2x2 patches only after this (and unpacks before the inverse).
    """
    stats = _latent_stats(z, config)
    if stats is not None:
        mean, std = stats
        return (z - mean) * config.scaling_factor / std
    if config.shift_factor is not None:
        return (z - config.shift_factor) * config.scaling_factor
    return config.scaling_factor * z


def denormalize_latents(z: jax.Array, config: AutoencoderKLConfig) -> jax.Array:
    """Inverse of :func:`normalize_latents`: what the pipelines do before ``vae.decode``.

    - SDXL-style (``StableDiffusionXLPipeline.__call__``):
      ``z * latents_std / scaling_factor + latents_mean``;
    - Flux (``FluxPipeline.__call__``): ``z / scaling_factor + shift_factor``;
    - SD (``StableDiffusionPipeline.__call__``): ``z / scaling_factor``.
    """
    stats = _latent_stats(z, config)
    if stats is not None:
        mean, std = stats
        return z * std / config.scaling_factor + mean
    if config.shift_factor is not None:
        return z / config.scaling_factor + config.shift_factor
    return z / config.scaling_factor


# ----------------------------------------------------------------------------------------------
# Weights
# ----------------------------------------------------------------------------------------------


def _source_entry(path: tuple[str, ...], ndim: int) -> tuple[str, weights.Transform]:
    """Flax param path -> (diffusers key, transform). Module names mirror diffusers attribute
    names, with list indices written ``name_3`` for diffusers' ``name.3``."""
    *modules, leaf = path
    key = ".".join(re.sub(r"_(\d+)$", r".\1", m) for m in modules)
    if leaf == "bias":
        return f"{key}.bias", weights.identity
    if leaf == "scale":  # GroupNorm weight
        return f"{key}.weight", weights.identity
    if leaf == "kernel" and ndim in (2, 4):
        # 4-d: Conv2d [O, I, kh, kw]; 2-d: the attention's nn.Linear [O, I].
        return f"{key}.weight", weights.conv2d if ndim == 4 else weights.linear
    raise ValueError(f"no diffusers name for parameter {'/'.join(path)} ({ndim}-d)")


def _dummy_inputs(config: AutoencoderKLConfig) -> tuple:
    """One image of one latent pixel (``s x s``): it creates every layer (through ``encode``,
    the encoder's and quant_conv's alone)."""
    s = config.spatial_compression
    return (jax.ShapeDtypeStruct((1, config.in_channels, s, s), jnp.float32),)


def _fill(name: str, shape: tuple[int, ...], dtype: Dtype) -> jax.Array:
    """Random init of every parameter but the kernels: norm scales one, biases zero."""
    return jnp.full(shape, 1.0 if name == "scale" else 0.0, dtype)


# build / load / init / shape / count, as the Wan VAE's (jaxcore.weights.VAEKind)
KIND = weights.VAEKind(
    AutoencoderKL,
    AutoencoderKLConfig,
    _dummy_inputs,
    lambda config, boxed: weights.weight_map_by_path(boxed, _source_entry),
    encoder_method="encode",
    fill=_fill,
)
abstract_params = KIND.abstract_params
# a diffusers AutoencoderKL directory; activations in ``dtype``, parameters in ``param_dtype``
load_autoencoder_kl = KIND.load
init_autoencoder_kl = KIND.init
count_params = KIND.count_params


def weight_map(config: AutoencoderKLConfig) -> dict:
    """{flax param path: (diffusers AutoencoderKL key, transform)} for every parameter."""
    return KIND.weight_map(config, abstract_params(AutoencoderKL(config)))
