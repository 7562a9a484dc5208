"""The image VAE of Flux.2 / Flux.2 [klein] in Flax linen (= diffusers ``AutoencoderKLFlux2``),
and the latent handling of diffusers' ``Flux2KleinPipeline`` around it.

Reference: ``diffusers/models/autoencoders/autoencoder_kl_flux2.py`` and
``pipelines/flux2/pipeline_flux2_klein.py`` (``_patchify_latents``, ``_unpatchify_latents``,
``_pack_latents``, ``_encode_vae_image`` and the lines before ``vae.decode`` in ``__call__``),
diffusers 0.42.

The network is diffusers' plain ``vae.Encoder`` / ``vae.Decoder`` (the blocks of
:mod:`jaxcore.models.autoencoder_kl`, imported, not rewritten). What differs from
``AutoencoderKL``:
- 32 latent channels by default, and an optional ``decoder_block_out_channels`` (the decoder's
  widths may differ from the encoder's);
- no ``scaling_factor`` / ``shift_factor``: the latents are normalised by a ``BatchNorm2d``
  (``bn``, affine=False) over the *patchified* latents (4 x latent_channels features). Only its
  running statistics are used, and only by the pipeline, never inside ``encode`` / ``decode``.
  They are buffers in diffusers (not parameters), so here they are not flax parameters either
  (an optimizer's weight decay would move them): :func:`load_latent_bn` reads them into a
  :class:`LatentBatchNorm`, which :func:`normalize_latents` / :func:`denormalize_latents` use.

Pipeline latent path (encode side, ``_encode_vae_image``): ``vae.encode(x)`` mean ("argmax")
-> :func:`patchify` (2x2, channel ``c * 4 + dy * 2 + dx``) -> :func:`normalize_latents`
``(z - running_mean) / sqrt(running_var + batch_norm_eps)`` -> :func:`pack_latents`
``[B, h * w, 4 c]``. Decode side: unpack -> :func:`denormalize_latents` -> :func:`unpatchify`
-> ``vae.decode``. :func:`to_model_latents` / :func:`from_model_latents` chain the first two
steps of each (still ``[B, 4c, h, w]``).

Public API: :class:`AutoencoderKLFlux2Config`, :class:`AutoencoderKLFlux2`,
:class:`LatentBatchNorm`, :func:`encode`, :func:`decode`, :func:`patchify`,
:func:`unpatchify`, :func:`pack_latents`, :func:`unpack_latents`, :func:`normalize_latents`,
:func:`denormalize_latents`, :func:`to_model_latents`, :func:`from_model_latents`,
:func:`weight_map`, :func:`abstract_params`, :func:`load_autoencoder_kl_flux2`,
:func:`load_latent_bn`, :func:`init_autoencoder_kl_flux2`, :func:`count_params`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxcore import weights
from jaxcore.config import config_json_kwargs
from jaxcore.models import autoencoder_kl as akl

__all__ = [
    "AutoencoderKLFlux2",
    "AutoencoderKLFlux2Config",
    "AutoencoderKLFlux2ConfigError",
    "LatentBatchNorm",
    "abstract_params",
    "count_params",
    "decode",
    "denormalize_latents",
    "encode",
    "from_model_latents",
    "init_autoencoder_kl_flux2",
    "load_autoencoder_kl_flux2",
    "load_latent_bn",
    "normalize_latents",
    "pack_latents",
    "patchify",
    "to_model_latents",
    "unpack_latents",
    "unpatchify",
    "weight_map",
]

# The pipeline's _patchify_latents hardcodes 2x2 patches (the bn's width assumes the config's).
PATCH = 2
# Checkpoint keys of the BatchNorm buffers: not parameters of the flax model.
BN_PREFIX = "bn."
BN_MEAN_KEY, BN_VAR_KEY = "bn.running_mean", "bn.running_var"


# ----------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------


class AutoencoderKLFlux2ConfigError(akl.AutoencoderKLConfigError):
    """A config.json key or value AutoencoderKLFlux2Config cannot represent; names the key."""


@dataclasses.dataclass(frozen=True)
class AutoencoderKLFlux2Config:
    """diffusers ``AutoencoderKLFlux2`` config; names and defaults are its ``__init__``'s.

    ``sample_size`` is tiling metadata and ``batch_norm_momentum`` matters to training the bn
    statistics only; both are kept so a config.json round-trips.
    """

    in_channels: int = 3
    out_channels: int = 3
    down_block_types: tuple[str, ...] = (akl.DOWN_BLOCK_TYPE,) * 4
    up_block_types: tuple[str, ...] = (akl.UP_BLOCK_TYPE,) * 4
    block_out_channels: tuple[int, ...] = (128, 256, 512, 512)
    decoder_block_out_channels: tuple[int, ...] | None = None
    layers_per_block: int = 2
    act_fn: str = "silu"
    latent_channels: int = 32
    norm_num_groups: int = 32
    sample_size: int | tuple[int, ...] = 1024
    use_quant_conv: bool = True
    use_post_quant_conv: bool = True
    mid_block_add_attention: bool = True
    batch_norm_eps: float = 1e-4
    batch_norm_momentum: float = 0.1
    patch_size: tuple[int, int] = (PATCH, PATCH)

    def __post_init__(self):
        """Normalise lists to tuples and refuse what the pipeline cannot run."""
        for key in ("down_block_types", "up_block_types", "block_out_channels", "patch_size"):
            object.__setattr__(self, key, tuple(getattr(self, key)))
        if self.decoder_block_out_channels is not None:
            decoder = tuple(self.decoder_block_out_channels)
            object.__setattr__(self, "decoder_block_out_channels", decoder)
        if isinstance(self.sample_size, list | tuple):
            object.__setattr__(self, "sample_size", tuple(self.sample_size))
        if self.patch_size != (PATCH, PATCH):
            # The pipeline patchifies 2x2 whatever the config says; another size cannot run.
            raise AutoencoderKLFlux2ConfigError(
                f"patch_size={list(self.patch_size)} is not supported; Flux2KleinPipeline "
                "patchifies latents 2x2"
            )
        if not self.batch_norm_eps > 0:
            raise AutoencoderKLFlux2ConfigError(
                f"batch_norm_eps must be > 0, got {self.batch_norm_eps}"
            )
        # The shared checks (block types, sizes, groups) name the key; re-raise as ours.
        try:
            self.encoder_config()
            self.decoder_config()
        except akl.AutoencoderKLConfigError as err:
            raise AutoencoderKLFlux2ConfigError(str(err)) from None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> AutoencoderKLFlux2Config:
        """Build from a diffusers config.json dict (``_``-prefixed keys ignored, others refused
        by name when unknown)."""
        return cls(**config_json_kwargs(cls, d, AutoencoderKLFlux2ConfigError))

    def to_dict(self) -> dict[str, Any]:
        """The config.json dict (lists, not tuples)."""
        d = dataclasses.asdict(self)
        return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}

    def encoder_config(self) -> akl.AutoencoderKLConfig:
        """The AutoencoderKL config whose Encoder (and quant convs) is this VAE's."""
        return akl.AutoencoderKLConfig(
            in_channels=self.in_channels,
            out_channels=self.out_channels,
            down_block_types=self.down_block_types,
            up_block_types=self.up_block_types,
            block_out_channels=self.block_out_channels,
            layers_per_block=self.layers_per_block,
            act_fn=self.act_fn,
            latent_channels=self.latent_channels,
            norm_num_groups=self.norm_num_groups,
            sample_size=self.sample_size,
            use_quant_conv=self.use_quant_conv,
            use_post_quant_conv=self.use_post_quant_conv,
            mid_block_add_attention=self.mid_block_add_attention,
        )

    def decoder_config(self) -> akl.AutoencoderKLConfig:
        """The AutoencoderKL config whose Decoder is this VAE's (``decoder_block_out_channels``
        or, when null, ``block_out_channels``, as diffusers builds it)."""
        widths = self.decoder_block_out_channels or self.block_out_channels
        return dataclasses.replace(self.encoder_config(), block_out_channels=widths)

    @property
    def spatial_compression(self) -> int:
        """Pixels per (unpatchified) latent along H and W."""
        return 2 ** (len(self.block_out_channels) - 1)

    @property
    def bn_channels(self) -> int:
        """Features of the BatchNorm: the patchified latent's channels."""
        return PATCH * PATCH * self.latent_channels


# ----------------------------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------------------------


class AutoencoderKLFlux2(akl.AutoencoderKL):
    """diffusers ``AutoencoderKLFlux2`` without its ``bn`` (see :class:`LatentBatchNorm`).

    ``config`` is an :class:`AutoencoderKLFlux2Config`. ``encode`` / ``decode`` / ``__call__``
    are AutoencoderKL's: raw (unpatchified, unnormalised) latents ``[B, c, H / s, W / s]``.
    """

    def setup(self):
        """AutoencoderKL's parts, with the decoder built at its own widths."""
        cfg = self.config
        kw = {"dtype": self.dtype, "param_dtype": self.param_dtype}
        shared = {"attention": self.attention, "mesh": self.mesh, **kw}
        one_by_one = {"kernel_size": (1, 1), "padding": ((0, 0), (0, 0)), **kw}
        self.encoder = akl.Encoder(cfg.encoder_config(), **shared)
        self.decoder = akl.Decoder(cfg.decoder_config(), **shared)
        if cfg.use_quant_conv:
            self.quant_conv = akl.Conv2d(2 * cfg.latent_channels, **one_by_one)
        if cfg.use_post_quant_conv:
            self.post_quant_conv = akl.Conv2d(cfg.latent_channels, **one_by_one)


def encode(module: AutoencoderKLFlux2, params, images_bchw: jax.Array) -> akl.DiagonalGaussian:
    """Images ``[B, C, H, W]`` in [-1, 1] -> posterior over raw latents (jitted); the pipeline
    takes ``.mean`` ("argmax") and then :func:`to_model_latents`."""
    return akl.encode(module, params, images_bchw)


def decode(module: AutoencoderKLFlux2, params, z_bchw: jax.Array) -> jax.Array:
    """Raw latents ``[B, c, h, w]`` -> images ``[B, C_out, s h, s w]`` (jitted, unclamped)."""
    return akl.decode(module, params, z_bchw)


# ----------------------------------------------------------------------------------------------
# Latents as Flux2KleinPipeline prepares them
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LatentBatchNorm:
    """The running statistics of diffusers' ``vae.bn`` (float32 ``[4 c]``) and its eps."""

    running_mean: np.ndarray
    running_var: np.ndarray
    eps: float

    @classmethod
    def initial(cls, config: AutoencoderKLFlux2Config) -> LatentBatchNorm:
        """torch ``BatchNorm2d``'s initial statistics (mean 0, var 1): a fresh model's."""
        n = config.bn_channels
        return cls(np.zeros(n, np.float32), np.ones(n, np.float32), config.batch_norm_eps)

    def mean_std(self, dtype) -> tuple[jax.Array, jax.Array]:
        """(mean, std) shaped ``[1, 4c, 1, 1]``: std = sqrt(var + eps) in float32, then both
        cast to ``dtype``, the order of the pipeline's ``torch.sqrt(...).to(dtype)``."""
        shape = (1, -1, 1, 1)
        mean = jnp.asarray(self.running_mean, jnp.float32).reshape(shape)
        std = jnp.sqrt(jnp.asarray(self.running_var, jnp.float32) + self.eps).reshape(shape)
        return mean.astype(dtype), std.astype(dtype)


def load_latent_bn(directory: str | os.PathLike, config=None) -> LatentBatchNorm:
    """``bn.running_mean`` / ``bn.running_var`` of a diffusers AutoencoderKLFlux2 directory,
    with the config's ``batch_norm_eps``; raises WeightsError naming a missing or misshapen key."""
    if config is None:
        config = AutoencoderKLFlux2Config.from_dict(weights.read_config(directory))
    reader = weights.SafetensorsReader(directory)
    stats = []
    for key in (BN_MEAN_KEY, BN_VAR_KEY):
        if key not in reader:
            raise weights.WeightsError(f"{directory}: missing {key!r} (the VAE's latent bn)")
        value = np.asarray(reader.get(key), np.float32)
        if value.shape != (config.bn_channels,):
            raise weights.WeightsError(
                f"{directory}: {key} has shape {value.shape}, expected ({config.bn_channels},) "
                f"(4 x latent_channels={config.latent_channels})"
            )
        stats.append(value.copy())  # off the memory map
    return LatentBatchNorm(*stats, eps=float(config.batch_norm_eps))


def _check_bchw(x: jax.Array, what: str) -> None:
    """Raise ValueError unless ``x`` is 4-d."""
    if x.ndim != 4:
        raise ValueError(f"{what} must be [B, C, H, W], got shape {tuple(x.shape)}")


def patchify(z_bchw: jax.Array) -> jax.Array:
    """``[B, c, h, w] -> [B, 4c, h/2, w/2]``, channel ``c * 4 + dy * 2 + dx`` (the pipeline's
    ``_patchify_latents``); h and w must be even."""
    _check_bchw(z_bchw, "latents")
    b, c, h, w = z_bchw.shape
    if h % PATCH or w % PATCH:
        raise ValueError(f"latent height {h} and width {w} must be even to patchify 2x2")
    x = z_bchw.reshape(b, c, h // PATCH, PATCH, w // PATCH, PATCH)
    x = jnp.transpose(x, (0, 1, 3, 5, 2, 4))  # [B, c, dy, dx, h/2, w/2]
    return x.reshape(b, c * PATCH * PATCH, h // PATCH, w // PATCH)


def unpatchify(x_bchw: jax.Array) -> jax.Array:
    """Inverse of :func:`patchify`: ``[B, 4c, h, w] -> [B, c, 2h, 2w]`` (the pipeline's
    ``_unpatchify_latents``)."""
    _check_bchw(x_bchw, "patchified latents")
    b, c4, h, w = x_bchw.shape
    if c4 % (PATCH * PATCH):
        raise ValueError(f"patchified latents have {c4} channels, not a multiple of 4")
    x = x_bchw.reshape(b, c4 // (PATCH * PATCH), PATCH, PATCH, h, w)
    x = jnp.transpose(x, (0, 1, 4, 2, 5, 3))  # [B, c, h, dy, w, dx]
    return x.reshape(b, c4 // (PATCH * PATCH), h * PATCH, w * PATCH)


def pack_latents(x_bchw: jax.Array) -> jax.Array:
    """``[B, C, h, w] -> [B, h * w, C]``, row-major tokens (the pipeline's ``_pack_latents``)."""
    _check_bchw(x_bchw, "latents")
    b, c, h, w = x_bchw.shape
    return jnp.transpose(x_bchw.reshape(b, c, h * w), (0, 2, 1))


def unpack_latents(x_bnc: jax.Array, height: int, width: int) -> jax.Array:
    """``[B, h * w, C] -> [B, C, h, w]``: ``_unpack_latents_with_ids`` for the row-major ids of
    ``_prepare_latent_ids`` (token n at row n // w, column n % w)."""
    b, n, c = x_bnc.shape
    if n != height * width:
        raise ValueError(f"{n} tokens do not fill a {height} x {width} latent grid")
    return jnp.transpose(x_bnc, (0, 2, 1)).reshape(b, c, height, width)


def _check_bn(x_bchw: jax.Array, bn: LatentBatchNorm) -> None:
    """Raise ValueError unless ``x`` has the bn's channel count."""
    _check_bchw(x_bchw, "patchified latents")
    if x_bchw.shape[1] != bn.running_mean.shape[0]:
        raise ValueError(
            f"patchified latents have {x_bchw.shape[1]} channels but the bn has "
            f"{bn.running_mean.shape[0]} (patchify raw latents first)"
        )


def normalize_latents(x_bchw: jax.Array, bn: LatentBatchNorm) -> jax.Array:
    """Patchified raw latents -> the transformer's space: ``(x - mean) / sqrt(var + eps)`` in
    ``x``'s dtype (``Flux2KleinPipeline._encode_vae_image``)."""
    _check_bn(x_bchw, bn)
    mean, std = bn.mean_std(x_bchw.dtype)
    return (x_bchw - mean) / std


def denormalize_latents(x_bchw: jax.Array, bn: LatentBatchNorm) -> jax.Array:
    """Inverse of :func:`normalize_latents`: ``x * sqrt(var + eps) + mean`` (the pipeline's
    ``__call__`` before unpatchify and ``vae.decode``)."""
    _check_bn(x_bchw, bn)
    mean, std = bn.mean_std(x_bchw.dtype)
    return x_bchw * std + mean


def to_model_latents(z_bchw: jax.Array, bn: LatentBatchNorm) -> jax.Array:
    """Raw VAE latents ``[B, c, h, w]`` -> normalised patches ``[B, 4c, h/2, w/2]``."""
    return normalize_latents(patchify(z_bchw), bn)


def from_model_latents(x_bchw: jax.Array, bn: LatentBatchNorm) -> jax.Array:
    """Normalised patches ``[B, 4c, h, w]`` -> raw VAE latents ``[B, c, 2h, 2w]``."""
    return unpatchify(denormalize_latents(x_bchw, bn))


# ----------------------------------------------------------------------------------------------
# Weights
# ----------------------------------------------------------------------------------------------


def _ignored_keys(config: AutoencoderKLFlux2Config) -> tuple[str, ...]:
    """The bn buffers are in the checkpoint but are no flax parameter (see the module doc)."""
    return (BN_PREFIX,)


@dataclasses.dataclass(frozen=True)
class _Flux2VAEKind(weights.VAEKind):
    """VAEKind whose encoder-only load also leaves the bn buffers unread."""

    def encoder_part(self) -> weights.ModelKind:
        """The encoder-only kind, ignoring decoder and bn keys."""
        prefixes = (*weights.VAE_DECODER_PREFIXES, BN_PREFIX)
        return dataclasses.replace(super().encoder_part(), ignore_unused=lambda config: prefixes)


KIND = _Flux2VAEKind(
    AutoencoderKLFlux2,
    AutoencoderKLFlux2Config,
    akl._dummy_inputs,
    lambda config, boxed: weights.weight_map_by_path(boxed, akl._source_entry),
    ignore_unused=_ignored_keys,
    encoder_method="encode",
    fill=akl._fill,
)
abstract_params = KIND.abstract_params
# a diffusers AutoencoderKLFlux2 directory -> (module, params); the bn: load_latent_bn
load_autoencoder_kl_flux2 = KIND.load
init_autoencoder_kl_flux2 = KIND.init
count_params = KIND.count_params


def weight_map(config: AutoencoderKLFlux2Config) -> dict:
    """{flax param path: (diffusers AutoencoderKLFlux2 key, transform)} for every parameter
    (the ``bn.*`` buffers excepted: :func:`load_latent_bn`)."""
    return KIND.weight_map(config, abstract_params(AutoencoderKLFlux2(config)))
