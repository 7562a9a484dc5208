"""The SD 1.x / 2.x and SDXL ControlNet in Flax linen (= diffusers ``ControlNetModel``).

Reference (diffusers 0.42): ``models/controlnets/controlnet.py`` (``ControlNetModel``,
``ControlNetConditioningEmbedding``, ``ControlNetModel.from_unet``) and
``models/controlnets/multicontrolnet.py``. A ControlNet is the UNet's encoder half (conv_in,
the time embedding incl. SDXL's ``text_time``, the down blocks, the mid block), plus:

- ``controlnet_cond_embedding``: the control image ``[B, conditioning_channels, H*8, W*8]`` in
  [0, 1] (``controlnet_conditioning_channel_order="bgr"`` flips the channels first) through a
  3x3 conv and SiLU, then per ``conditioning_embedding_out_channels`` step a 3x3 conv + SiLU
  and a 3x3 stride-2 conv + SiLU, then a 3x3 ``conv_out`` to ``block_out_channels[0]``; added
  to ``conv_in``'s output.
- a 1x1 ``controlnet_down_blocks`` conv on every skip the down path leaves (the UNet's skip
  order) and a 1x1 ``controlnet_mid_block`` on the mid block's output: the residuals.
- scaling: every residual times ``conditioning_scale``; in guess mode (and not
  ``global_pool_conditions``) the k-th of n down residuals by ``10 ** (-1 + k / n)`` (torch's
  ``logspace(-1, 0, n + 1)``) and the mid one by 1, times the scale; with
  ``global_pool_conditions`` every residual is averaged over H, W afterwards.

The scale and the guess-mode flag are per sample here (``[B]``), where diffusers takes one
number per call: bulk rendering batches prompts with different settings. The residuals come out
in diffusers' layout ``[B, C, H, W]``; :class:`~jaxcore.models.unet_2d_condition.
UNet2DConditionModel` adds them (``down_block_additional_residuals``,
``mid_block_additional_residual``).

Not implemented (refused by name): the UNet keys refused there (class / encoder-hidden
embeddings, ...), ``mid_block_type`` other than ``UNetMidBlock2DCrossAttn``, attention masks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from jaxcore import weights
from jaxcore.config import config_json_kwargs
from jaxcore.models import unet_2d_condition as unet
from jaxcore.models.autoencoder_kl import Conv2d

Dtype = Any

# ControlNetModel.__init__'s keys: a config.json key outside them is refused by name
CONTROLNET_KEYS = (
    "in_channels",
    "conditioning_channels",
    "flip_sin_to_cos",
    "freq_shift",
    "down_block_types",
    "mid_block_type",
    "only_cross_attention",
    "block_out_channels",
    "layers_per_block",
    "downsample_padding",
    "mid_block_scale_factor",
    "act_fn",
    "norm_num_groups",
    "norm_eps",
    "cross_attention_dim",
    "transformer_layers_per_block",
    "encoder_hid_dim",
    "encoder_hid_dim_type",
    "attention_head_dim",
    "num_attention_heads",
    "use_linear_projection",
    "class_embed_type",
    "addition_embed_type",
    "addition_time_embed_dim",
    "num_class_embeds",
    "upcast_attention",
    "resnet_time_scale_shift",
    "projection_class_embeddings_input_dim",
    "controlnet_conditioning_channel_order",
    "conditioning_embedding_out_channels",
    "global_pool_conditions",
    "addition_embed_type_num_heads",
)
CHANNEL_ORDERS = ("rgb", "bgr")


class ControlNetConfigError(unet.UNet2DConditionConfigError):
    """A ControlNet config.json the model cannot represent; names the key."""


def _mirrored_up_types(down_types) -> tuple[str, ...]:
    """The up blocks a UNet with these down blocks has (a ControlNet has none; the UNet config
    checks want them to match the levels)."""
    return tuple(unet.CROSS_UP if t == unet.CROSS_DOWN else unet.UP for t in reversed(down_types))


@dataclasses.dataclass(frozen=True)
class ControlNetConfig(unet.UNet2DConditionConfig):
    """A ControlNetModel's architecture: the UNet's encoder-half keys (checked as the UNet
    checks them) plus the control-image embedding's. Names and defaults are diffusers'."""

    conditioning_channels: int = 3
    controlnet_conditioning_channel_order: str = "rgb"
    conditioning_embedding_out_channels: tuple[int, ...] = (16, 32, 96, 256)
    global_pool_conditions: bool = False

    def __post_init__(self):
        object.__setattr__(self, "down_block_types", tuple(self.down_block_types))
        object.__setattr__(self, "up_block_types", _mirrored_up_types(self.down_block_types))
        if len(self.down_block_types) != len(tuple(self.block_out_channels)):
            raise ControlNetConfigError(
                f"down_block_types has {len(self.down_block_types)} entries but "
                f"block_out_channels has {len(tuple(self.block_out_channels))}"
            )
        super().__post_init__()
        self._check_control()

    def _check_control(self) -> None:
        channels = self.conditioning_embedding_out_channels
        if not isinstance(channels, list | tuple) or not channels:
            raise ControlNetConfigError(
                f"conditioning_embedding_out_channels must be a non-empty list, got {channels!r}"
            )
        object.__setattr__(self, "conditioning_embedding_out_channels", tuple(channels))
        if self.controlnet_conditioning_channel_order not in CHANNEL_ORDERS:
            raise ControlNetConfigError(
                "controlnet_conditioning_channel_order="
                f"{self.controlnet_conditioning_channel_order!r} is not one of {CHANNEL_ORDERS}"
            )
        if not isinstance(self.conditioning_channels, int) or self.conditioning_channels < 1:
            raise ControlNetConfigError(
                f"conditioning_channels must be an int >= 1, got {self.conditioning_channels!r}"
            )

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ControlNetConfig:
        """From a diffusers ControlNetModel config.json (``_``-prefixed keys ignored)."""
        unknown = sorted(k for k in d if not k.startswith("_") and k not in CONTROLNET_KEYS)
        if unknown:
            raise ControlNetConfigError(
                f"unknown ControlNetModel keys {unknown}; known keys: {sorted(CONTROLNET_KEYS)}"
            )
        return cls(**config_json_kwargs(cls, d, ControlNetConfigError))

    def to_dict(self) -> dict[str, Any]:
        """The config.json diffusers' ControlNetModel takes."""
        full = super().to_dict()
        return {k: full[k] for k in CONTROLNET_KEYS}

    @property
    def num_down_residuals(self) -> int:
        """Skips of the down path: conv_in's, one per resnet, one per downsampler."""
        return 1 + sum(self.resnets_per_level) + self.num_levels - 1


class ConditioningEmbedding(nn.Module):
    """diffusers ``ControlNetConditioningEmbedding`` on ``[B, H, W, C]``: the control image
    down to the latent resolution (one stride-2 conv per step of ``channels``)."""

    out_features: int
    channels: tuple[int, ...]
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, image_bhwc: jax.Array) -> jax.Array:
        kw = {"dtype": self.dtype, "param_dtype": self.param_dtype}
        x = nn.silu(Conv2d(self.channels[0], name="conv_in", **kw)(image_bhwc))
        for i, (c_in, c_out) in enumerate(zip(self.channels[:-1], self.channels[1:], strict=True)):
            x = nn.silu(Conv2d(c_in, name=f"blocks_{2 * i}", **kw)(x))
            x = nn.silu(Conv2d(c_out, strides=(2, 2), name=f"blocks_{2 * i + 1}", **kw)(x))
        return Conv2d(self.out_features, name="conv_out", **kw)(x)


def guess_mode_ramp(count: int) -> np.ndarray:
    """``logspace(-1, 0, count)`` in float32 (diffusers' torch call): guess mode's factors."""
    return (10.0 ** np.linspace(-1.0, 0.0, count)).astype(np.float32)


class ControlNetModel(unet.UNet2DConditionModel):
    """diffusers ``ControlNetModel.forward``, parameters named as in diffusers.

    ``__call__(sample [B, C, H, W], timestep [B] or scalar, encoder_hidden_states [B, T, D],
    controlnet_cond [B, conditioning_channels, 8H, 8W] in [0, 1], conditioning_scale [B] or
    scalar, text_embeds=None, time_ids=None, guess_mode [B] bool or scalar = False) ->
    (down residuals: tuple of [B, C_k, H_k, W_k], mid residual [B, C, H', W'])``.
    """

    config: ControlNetConfig

    def _residuals(self, x, skips):
        """The 1x1 zero-initialised (in diffusers) convs on every skip and on the mid output."""
        kw = {"dtype": self.dtype, "param_dtype": self.param_dtype}
        down = []
        for k, skip in enumerate(skips):
            conv = Conv2d(
                skip.shape[-1],
                (1, 1),
                padding=((0, 0), (0, 0)),
                **kw,
                name=f"controlnet_down_blocks_{k}",
            )
            down.append(conv(skip))
        mid = Conv2d(
            x.shape[-1], (1, 1), padding=((0, 0), (0, 0)), **kw, name="controlnet_mid_block"
        )(x)
        return down, mid

    def _scaled(self, down, mid, scale_b, guess_b):
        """Residuals times the per-sample scale (guess mode: times the logspace ramp too)."""
        batch = mid.shape[0]
        scale = jnp.broadcast_to(jnp.asarray(scale_b, jnp.float32).reshape(-1), (batch,))
        if self.config.global_pool_conditions:
            factors = [scale] * (len(down) + 1)
        else:
            guess = jnp.broadcast_to(jnp.asarray(guess_b, bool).reshape(-1), (batch,))
            ramp = guess_mode_ramp(len(down) + 1)
            factors = [jnp.where(guess, r, 1.0) * scale for r in ramp]
        out = [
            r * f.reshape(-1, 1, 1, 1).astype(r.dtype)
            for r, f in zip(down + [mid], factors, strict=True)
        ]
        if self.config.global_pool_conditions:
            out = [jnp.mean(r, axis=(1, 2), keepdims=True) for r in out]
        return out[:-1], out[-1]

    @nn.compact
    def __call__(
        self,
        sample,
        timestep,
        encoder_hidden_states,
        controlnet_cond,
        conditioning_scale=1.0,
        text_embeds=None,
        time_ids=None,
        guess_mode=False,
    ):
        cfg = self.config
        x, temb, context = self._prepare(
            sample, timestep, encoder_hidden_states, text_embeds, time_ids
        )
        image = jnp.transpose(controlnet_cond, (0, 2, 3, 1)).astype(self.dtype)
        if cfg.controlnet_conditioning_channel_order == "bgr":
            image = image[..., ::-1]
        x = self._same_conv(cfg.block_out_channels[0], cfg.conv_in_kernel, "conv_in")(x)
        embedding = ConditioningEmbedding(
            cfg.block_out_channels[0],
            cfg.conditioning_embedding_out_channels,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            name="controlnet_cond_embedding",
        )(image)
        x, skips = self._down_path(x + embedding, temb, context)
        down, mid = self._scaled(*self._residuals(x, skips), conditioning_scale, guess_mode)
        to_nchw = lambda r: jnp.transpose(r, (0, 3, 1, 2))  # noqa: E731
        return tuple(to_nchw(r) for r in down), to_nchw(mid)


def _dummy_inputs(config: ControlNetConfig, batch: int = 1) -> tuple:
    """The UNet's smallest inputs plus a control image of 8x the latent size."""
    sample, timestep, context, text_embeds, time_ids = unet._dummy_inputs(config, batch)
    factor = 2 ** (len(config.conditioning_embedding_out_channels) - 1)
    size = sample.shape[2] * factor
    image = jax.ShapeDtypeStruct((batch, config.conditioning_channels, size, size), jnp.float32)
    scale = jax.ShapeDtypeStruct((batch,), jnp.float32)
    return sample, timestep, context, image, scale, text_embeds, time_ids


KIND = weights.ModelKind(
    ControlNetModel,
    ControlNetConfig,
    _dummy_inputs,
    # every name is the UNet's rule (controlnet_down_blocks_N -> controlnet_down_blocks.N)
    lambda config, boxed: weights.weight_map_by_path(boxed, unet._source_entry),
)
abstract_params = KIND.abstract_params
load_controlnet = KIND.load  # a diffusers ControlNetModel directory
init_controlnet = KIND.init
count_params = KIND.count_params


def weight_map(config: ControlNetConfig) -> dict:
    """{flax param path: (diffusers ControlNetModel key, transform)} for every parameter."""
    return KIND.weight_map(config, abstract_params(ControlNetModel(config)))


# subtrees diffusers' ``ControlNetModel.from_unet`` copies from the UNet (``add_embedding``:
# SDXL's text_time); the rest of a ControlNet is fresh
FROM_UNET_COPIED = ("conv_in", "time_embedding", "add_embedding", "mid_block")


def config_from_unet(unet_config: unet.UNet2DConditionConfig, **control) -> ControlNetConfig:
    """The ControlNetConfig ``from_unet`` builds: the UNet's encoder-half keys plus the
    control-image keys in ``control`` (``conditioning_channels``,
    ``conditioning_embedding_out_channels``, ...; diffusers' defaults where not given)."""
    keys = {k: v for k, v in unet_config.to_dict().items() if k in CONTROLNET_KEYS}
    return ControlNetConfig.from_dict({**keys, **control})


def _zero_control_outputs(params: dict) -> dict:
    """diffusers' ``zero_module`` on every residual conv and on the control embedding's
    ``conv_out``: a fresh ControlNet adds exactly nothing to the UNet until trained."""
    out = dict(params)
    for name in params:
        if name.startswith("controlnet_down_blocks_") or name == "controlnet_mid_block":
            out[name] = jax.tree.map(jnp.zeros_like, params[name])
    embedding = dict(params["controlnet_cond_embedding"])
    embedding["conv_out"] = jax.tree.map(jnp.zeros_like, embedding["conv_out"])
    out["controlnet_cond_embedding"] = embedding
    return out


def from_unet(
    unet_config, unet_params, rng, *, options=None, **control
) -> tuple[ControlNetModel, dict]:
    """``(module, params)`` of diffusers' ``ControlNetModel.from_unet(unet)``: conv_in, the
    time (and SDXL added) embedding, the down blocks and the mid block copied from the UNet;
    the control embedding freshly initialised (our initialisers, not torch's) with a zero
    ``conv_out``; the residual convs zero. ``control``: the ControlNet's own config keys;
    ``options``: the module's keywords (dtype, attention, ...)."""
    config = config_from_unet(unet_config, **control)
    module, fresh = init_controlnet(config, rng, **(options or {}))
    params = dict(fresh)
    for name in unet_params:
        if name in FROM_UNET_COPIED or name.startswith("down_blocks_"):
            if name not in params:  # a UNet part a ControlNet has no place for
                raise ControlNetConfigError(f"from_unet: the ControlNet has no {name!r}")
            # copies: a training step donates the ControlNet's buffers, not the UNet's
            params[name] = jax.tree.map(jnp.array, unet_params[name])
    missing = sorted(n for n in params if n not in unet_params and not n.startswith("controlnet_"))
    if missing:
        raise ControlNetConfigError(f"from_unet: the UNet has no {missing} to copy")
    return module, _zero_control_outputs(params)
