"""Flux.1 ControlNet in Flax linen: the residuals a FluxTransformer adds after its blocks.

Reference: diffusers ``FluxControlNetModel`` and ``FluxMultiControlNetModel``
(diffusers/models/controlnets/controlnet_flux.py, diffusers 0.42). Same function, same
parameters (loaded from a diffusers checkpoint through :func:`weight_map`):

- a shallow copy of the transformer (embedders, ``num_layers`` double and ``num_single_layers``
  single blocks: :mod:`jaxcore.models.flux_transformer`'s own modules, under the same names),
  without the output head,
- the control image enters as tokens: ``controlnet_x_embedder(controlnet_cond)`` is added to
  the embedded latents. ``controlnet_cond`` is the control image's VAE latents packed like the
  latents (``pack_latents``), or, with ``conditioning_embedding_channels`` set, a pixel image
  [B, 3, H, W] that a small convolutional encoder (``input_hint_block``, diffusers'
  ``ControlNetConditioningEmbedding``) downsamples 8x, one token per output pixel,
- union ControlNets (``num_mode`` set, e.g. InstantX's Union) embed the control mode as one
  extra text token prepended to the prompt; its position id repeats the first text token's,
- after every block the image stream goes through its own zero-initialised linear layer
  (``controlnet_blocks`` / ``controlnet_single_blocks``) and is scaled by
  ``conditioning_scale``: those are the outputs, one [B, L_img, D] per block.

The outputs feed :class:`~jaxcore.models.flux_transformer.FluxTransformer` as
``controlnet_block_samples`` / ``controlnet_single_block_samples``. :class:`MultiFluxControlNet`
sums several ControlNets (or one union ControlNet under several conditions).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

from jaxcore import sharding, weights
from jaxcore.compute import remat_block
from jaxcore.config import config_json_kwargs
from jaxcore.models import flux_transformer as ft
from jaxcore.models.autoencoder_kl import Conv2d
from jaxcore.models.layers import dense

Dtype = Any

# diffusers builds input_hint_block with these widths: conv_in, then (same-width conv, stride-2
# conv) pairs, i.e. 3 downsamplings (8x), then conv_out to conditioning_embedding_channels
HINT_CHANNELS = (16, 16, 16, 16)
HINT_INPUT_CHANNELS = 3  # ControlNetConditioningEmbedding's default: an RGB image

_IMAGE_EMBED = ("activation_batch", "activation_length", "activation_embed")
_TEXT_EMBED = ("activation_batch", "activation_kv_length", "activation_embed")

# ----------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FluxControlNetConfig:
    """Architecture of a Flux.1 ControlNet; field names follow diffusers' config.json.

    ``num_mode``: number of control modes of a union ControlNet (None: not a union one).
    ``conditioning_embedding_channels``: None means no ``input_hint_block`` (the control image
    arrives as packed VAE latents); else the pixel encoder's output channels, which become the
    token channels and must equal ``in_channels`` (diffusers' ``patch_size`` is 1).
    """

    patch_size: int = 1
    in_channels: int = 64
    num_layers: int = 19
    num_single_layers: int = 38
    attention_head_dim: int = 128
    num_attention_heads: int = 24
    joint_attention_dim: int = 4096
    pooled_projection_dim: int = 768
    guidance_embeds: bool = False
    axes_dims_rope: tuple[int, ...] = (16, 56, 56)
    num_mode: int | None = None
    conditioning_embedding_channels: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "axes_dims_rope", tuple(int(d) for d in self.axes_dims_rope))
        ft.FluxTransformerConfig(**self._shared_fields())  # validated as the transformer's
        if self.num_mode is not None and int(self.num_mode) < 1:
            raise ft.FluxConfigError(f"num_mode must be None or >= 1, got {self.num_mode!r}")
        channels = self.conditioning_embedding_channels
        if channels is not None and channels != self.in_channels:
            raise ft.FluxConfigError(
                f"conditioning_embedding_channels={channels!r} must be None or equal "
                f"in_channels={self.in_channels}: controlnet_x_embedder takes in_channels per "
                "token and the hint encoder's output channels are the token channels"
            )

    def _shared_fields(self) -> dict[str, Any]:
        fields = {f.name for f in dataclasses.fields(ft.FluxTransformerConfig)}
        return {k: v for k, v in dataclasses.asdict(self).items() if k in fields}

    @property
    def transformer(self) -> ft.FluxTransformerConfig:
        """The transformer config of the shared parts (embedders and blocks)."""
        return ft.FluxTransformerConfig(**self._shared_fields())

    @property
    def hidden_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def union(self) -> bool:
        return self.num_mode is not None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> FluxControlNetConfig:
        """Build from a diffusers config.json dict (``_``-prefixed keys ignored)."""
        return cls(**config_json_kwargs(cls, d, ft.FluxConfigError))

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["axes_dims_rope"] = list(self.axes_dims_rope)
        return d


# ----------------------------------------------------------------------------------------------
# Modules
# ----------------------------------------------------------------------------------------------


class ConditioningEmbedding(nn.Module):
    """diffusers ControlNetConditioningEmbedding: image [B, H, W, 3] -> [B, H/8, W/8, C].

    3x3 convolutions, each followed by SiLU but the last: ``conv_in``, then ``blocks_{2i}``
    (same width) and ``blocks_{2i+1}`` (stride 2) per width step, then ``conv_out``.
    """

    out_channels: int
    widths: tuple[int, ...] = HINT_CHANNELS
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    def _conv(self, features: int, name: str, stride: int = 1) -> Conv2d:
        """A 3x3 convolution padded by 1 (torch's ``padding=1``)."""
        return Conv2d(
            features,
            strides=(stride, stride),
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            name=name,
        )

    @nn.compact
    def __call__(self, x_bhwc: jax.Array) -> jax.Array:
        x = nn.silu(self._conv(self.widths[0], "conv_in")(x_bhwc))
        for i, (width_in, width_out) in enumerate(
            zip(self.widths[:-1], self.widths[1:], strict=True)
        ):
            x = nn.silu(self._conv(width_in, f"blocks_{2 * i}")(x))
            x = nn.silu(self._conv(width_out, f"blocks_{2 * i + 1}", stride=2)(x))
        return self._conv(self.out_channels, "conv_out")(x)


def _hint_tokens(image_bchw: jax.Array, hint: ConditioningEmbedding) -> jax.Array:
    """Pixel control image [B, C, H, W] -> tokens [B, (H/8)*(W/8), C_out], row-major: the
    encoder's output with each pixel one token (diffusers' patchify at patch_size=1)."""
    out_bhwc = hint(jnp.transpose(image_bchw, (0, 2, 3, 1)))
    b, h, w, c = out_bhwc.shape
    return out_bhwc.reshape(b, h * w, c)


class FluxControlNetModel(nn.Module):
    """Flux.1 ControlNet (= diffusers FluxControlNetModel.forward).

    ``(hidden_states [B, L_img, in_channels], controlnet_cond, controlnet_mode [B] or [B, 1]
    int | None, conditioning_scale, encoder_hidden_states [B, L_txt, joint_attention_dim],
    pooled_projections [B, P], timestep [B], img_ids [L_img, 3], txt_ids [L_txt, 3], guidance
    [B] | None) -> (controlnet_block_samples, controlnet_single_block_samples)``: tuples of
    [B, L_img, D], one per double / single block (None where a stack has no block, as diffusers).

    ``controlnet_cond``: [B, L_img, in_channels] packed control latents, or [B, 3, H, W] pixels
    with H/8 * W/8 = L_img when ``conditioning_embedding_channels`` is set.
    ``controlnet_mode`` is required iff the config is a union one (``num_mode``); a
    non-union ControlNet ignores it, as diffusers does. The blocks run unrolled: each one's
    output is a result (``remat_policy`` still applies per block).
    """

    config: FluxControlNetConfig
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    attention: str = "dot_product"
    mesh: Any = None
    remat_policy: str = "none"

    def _dense(self, features: int, axes, name: str) -> nn.Module:
        """A ``dense`` layer in this module's dtypes."""
        return dense(features, axes, name, self.dtype, self.param_dtype)

    def _check_inputs(self, hidden, cond, mode, text, pooled, timestep, img_ids, txt_ids, guidance):
        """The transformer's input checks, plus the control image's and the mode's shapes."""
        cfg = self.config
        ft.check_inputs(cfg.transformer, hidden, text, pooled, timestep, img_ids, txt_ids, guidance)
        batch, image_len = hidden.shape[:2]
        if cfg.conditioning_embedding_channels is None:
            want = f"[{batch}, {image_len}, in_channels={cfg.in_channels}] (packed latents)"
            ok = tuple(cond.shape) == (batch, image_len, cfg.in_channels)
        else:
            want = f"[{batch}, {HINT_INPUT_CHANNELS}, H, W] pixels with H/8 * W/8 = {image_len}"
            ok = cond.ndim == 4 and cond.shape[:2] == (batch, HINT_INPUT_CHANNELS)
            ok = ok and (cond.shape[2] // 8) * (cond.shape[3] // 8) == image_len
        if not ok:
            raise ValueError(f"controlnet_cond must be {want}, got shape {tuple(cond.shape)}")
        if cfg.union and mode is None:
            raise ValueError("controlnet_mode is required: this is a union ControlNet (num_mode)")
        if cfg.union and mode.size != batch:
            raise ValueError(f"controlnet_mode must be [B] or [B, 1], B={batch}; got {mode.shape}")

    @nn.compact
    def __call__(
        self,
        hidden_states,
        controlnet_cond,
        controlnet_mode=None,
        conditioning_scale=1.0,
        encoder_hidden_states=None,
        pooled_projections=None,
        timestep=None,
        img_ids=None,
        txt_ids=None,
        guidance=None,
    ):
        """(controlnet_block_samples, controlnet_single_block_samples); see the class."""
        cfg = self.config
        timestep = jnp.asarray(timestep)
        guidance = None if guidance is None else jnp.asarray(guidance)
        mode = None if controlnet_mode is None or not cfg.union else jnp.asarray(controlnet_mode)
        self._check_inputs(
            hidden_states,
            controlnet_cond,
            mode,
            encoder_hidden_states,
            pooled_projections,
            timestep,
            img_ids,
            txt_ids,
            guidance,
        )
        if self.mesh is not None:
            batch = hidden_states.shape[0]
            sharding.check_divisible(self.mesh, batch=batch, heads=cfg.num_attention_heads)
        x = self._embed_image(hidden_states, controlnet_cond)
        temb = ft.ConditionEmbedder(cfg.transformer, self.param_dtype, name="time_text_embed")(
            timestep, guidance, pooled_projections
        )
        context, txt_ids = self._embed_text(encoder_hidden_states, mode, txt_ids)
        rope = ft.joint_rope(txt_ids, img_ids, cfg.axes_dims_rope)
        double_bld, single_bld = self._run_blocks(x, context, temb, rope)
        return (
            self._project("controlnet_blocks", double_bld, conditioning_scale),
            self._project("controlnet_single_blocks", single_bld, conditioning_scale),
        )

    def _embed_image(self, hidden_states, controlnet_cond):
        """x_embedder(latents) + controlnet_x_embedder(control tokens): [B, L_img, D]."""
        cfg, dim = self.config, self.config.hidden_dim
        x = self._dense(dim, ("conv_in", "embed"), "x_embedder")(hidden_states.astype(self.dtype))
        if cfg.conditioning_embedding_channels is not None:
            hint = ConditioningEmbedding(
                cfg.conditioning_embedding_channels,
                dtype=self.dtype,
                param_dtype=self.param_dtype,
                name="input_hint_block",
            )
            controlnet_cond = _hint_tokens(controlnet_cond.astype(self.dtype), hint)
        control = self._dense(dim, ("conv_in", "embed"), "controlnet_x_embedder")(
            controlnet_cond.astype(self.dtype)
        )
        return sharding.constrain(x + control, _IMAGE_EMBED)

    def _embed_text(self, encoder_hidden_states, mode, txt_ids):
        """(text stream [B, L_txt(+1), D], txt_ids): a union ControlNet prepends its mode
        embedding as one more text token, whose id repeats the first text token's."""
        cfg, dim = self.config, self.config.hidden_dim
        context = self._dense(dim, (None, "embed"), "context_embedder")(
            encoder_hidden_states.astype(self.dtype)
        )
        if cfg.union:
            init = nn.with_logical_partitioning(nn.initializers.normal(1.0), (None, "embed"))
            embed = nn.Embed(
                cfg.num_mode,
                dim,
                dtype=self.dtype,
                param_dtype=self.param_dtype,
                embedding_init=init,
                name="controlnet_mode_embedder",
            )
            mode_b1d = embed(mode.reshape(-1, 1).astype(jnp.int32))
            context = jnp.concatenate([mode_b1d.astype(context.dtype), context], axis=1)
            cat = jnp.concatenate if isinstance(txt_ids, jax.core.Tracer) else _host_concat
            txt_ids = cat([txt_ids[:1], txt_ids], axis=0)
        return sharding.constrain(context, _TEXT_EMBED), txt_ids

    def _blocks(self, block_cls: type[nn.Module], prefix: str, count: int) -> list:
        """``count`` transformer blocks named ``prefix_i`` (the checkpoint's names), remat'd."""
        block_cls = remat_block(block_cls, self.remat_policy)
        return [
            block_cls(
                config=self.config.transformer,
                dtype=self.dtype,
                param_dtype=self.param_dtype,
                attention=self.attention,
                mesh=self.mesh,
                name=f"{prefix}_{i}",
            )
            for i in range(count)
        ]

    def _run_blocks(self, x_bld, context_btd, temb_bd, rope):
        """The image stream after every double block and after every single block."""
        cfg = self.config
        double_outs, single_outs = [], []
        for block in self._blocks(ft.DoubleStreamBlock, "transformer_blocks", cfg.num_layers):
            x_bld, context_btd = block(x_bld, context_btd, temb_bd, *rope)
            double_outs.append(x_bld)
        text_len = context_btd.shape[1]
        # diffusers concatenates and splits in every single block; once is the same (exact ops)
        joint_bnd = sharding.constrain(jnp.concatenate([context_btd, x_bld], axis=1), _IMAGE_EMBED)
        singles = self._blocks(
            ft.SingleStreamBlock, "single_transformer_blocks", cfg.num_single_layers
        )
        for block in singles:
            joint_bnd = block(joint_bnd, temb_bd, *rope)
            single_outs.append(sharding.constrain(joint_bnd[:, text_len:], _IMAGE_EMBED))
        return double_outs, single_outs

    def _project(self, prefix: str, samples_bld: Sequence[jax.Array], scale):
        """Each sample through its own linear layer, times ``conditioning_scale`` (in float32);
        None for no samples, as diffusers returns."""
        if not samples_bld:
            return None
        dim = self.config.hidden_dim
        outs = []
        for i, sample in enumerate(samples_bld):
            out = self._dense(dim, ("embed", "conv_out"), f"{prefix}_{i}")(sample)
            out = out.astype(jnp.float32) * jnp.asarray(scale, jnp.float32)
            outs.append(sharding.constrain(out.astype(self.dtype), _IMAGE_EMBED))
        return tuple(outs)


def _host_concat(parts, axis):
    """numpy concatenation keeps concrete ids on the host (exact RoPE tables)."""
    import numpy as np

    return np.concatenate([np.asarray(p, np.float32) for p in parts], axis=axis)


# ----------------------------------------------------------------------------------------------
# Several ControlNets
# ----------------------------------------------------------------------------------------------


def _sum_samples(total, new):
    """diffusers' merge: element-wise sum, unless either side is None (then the first kept).
    Nets of different depths sum to the shallower one's length, as diffusers' zip does."""
    if total is None or new is None:
        return total
    return tuple(a + b for a, b in zip(total, new, strict=False))


@dataclasses.dataclass(frozen=True)
class MultiFluxControlNet:
    """Sum of several ControlNets' residuals (= diffusers FluxMultiControlNetModel.forward).

    ``nets``: the ControlNet modules; their params are passed per call (a list, same order), so
    the call can be jitted with the params as arguments. One net with several conditions is a
    union ControlNet run once per (condition, mode, scale); with several nets, net i takes
    condition i (diffusers zips, so the shortest list decides how many run).
    """

    nets: tuple[FluxControlNetModel, ...]

    def __call__(
        self,
        params: Sequence[Mapping],
        hidden_states,
        controlnet_cond: Sequence,
        controlnet_mode: Sequence,
        conditioning_scale: Sequence,
        encoder_hidden_states,
        pooled_projections,
        timestep,
        img_ids,
        txt_ids,
        guidance=None,
    ):
        """(controlnet_block_samples, controlnet_single_block_samples), summed over the runs."""
        if len(params) != len(self.nets):
            raise ValueError(f"{len(self.nets)} ControlNets but {len(params)} sets of params")
        # not strict: diffusers zips, so the shortest list decides how many runs there are
        runs = zip(controlnet_cond, controlnet_mode, conditioning_scale, strict=False)
        if len(self.nets) == 1:
            nets = [(self.nets[0], params[0], *run) for run in runs]
        else:
            nets = [
                (*net, *run)
                for net, run in zip(zip(self.nets, params, strict=True), runs, strict=False)
            ]
        total = None
        for i, (net, net_params, cond, mode, scale) in enumerate(nets):
            out = net.apply(
                {"params": net_params},
                hidden_states,
                cond,
                mode,
                scale,
                encoder_hidden_states,
                pooled_projections,
                timestep,
                img_ids,
                txt_ids,
                guidance,
            )
            total = out if i == 0 else tuple(map(_sum_samples, total, out))
        return total


# ----------------------------------------------------------------------------------------------
# Weights: diffusers checkpoint <-> flax params
# ----------------------------------------------------------------------------------------------


def _hint_entries(widths: Sequence[int]) -> dict:
    """input_hint_block's convolutions: conv_in, blocks.0 .. blocks.{2n-1}, conv_out."""
    names = ["conv_in", *(f"blocks_{i}" for i in range(2 * (len(widths) - 1))), "conv_out"]
    entries = {}
    for name in names:
        torch_name = name.replace("blocks_", "blocks.")
        prefix = ("input_hint_block", name)
        entries[(*prefix, "kernel")] = (f"input_hint_block.{torch_name}.weight", weights.conv2d)
        entries[(*prefix, "bias")] = (f"input_hint_block.{torch_name}.bias", weights.identity)
    return entries


def weight_map(config: FluxControlNetConfig) -> dict:
    """{flax param path: (diffusers key, transform)} for every parameter of the ControlNet."""
    entries = ft.backbone_weight_entries(config.transformer)
    entries |= ft.dense_entries(("controlnet_x_embedder",), "controlnet_x_embedder")
    for prefix, count in (
        ("controlnet_blocks", config.num_layers),
        ("controlnet_single_blocks", config.num_single_layers),
    ):
        for i in range(count):
            entries |= ft.dense_entries((f"{prefix}_{i}",), f"{prefix}.{i}")
    if config.union:
        entries[("controlnet_mode_embedder", "embedding")] = (
            "controlnet_mode_embedder.weight",
            weights.identity,
        )
    if config.conditioning_embedding_channels is not None:
        entries |= _hint_entries(HINT_CHANNELS)
    return entries


def _dummy_inputs(config: FluxControlNetConfig, batch: int = 1) -> tuple:
    """Smallest valid inputs (one image token, one text token) for init / eval_shape."""
    f32 = jnp.float32
    hidden, text, pooled, timestep, img_ids, txt_ids, guidance = ft._dummy_inputs(
        config.transformer, batch
    )
    if config.conditioning_embedding_channels is None:
        cond = hidden
    else:
        cond = jax.ShapeDtypeStruct((batch, HINT_INPUT_CHANNELS, 8, 8), f32)  # one token
    mode = jax.ShapeDtypeStruct((batch, 1), jnp.int32) if config.union else None
    scale = jax.ShapeDtypeStruct((), f32)
    return (hidden, cond, mode, scale, text, pooled, timestep, img_ids, txt_ids, guidance)


# build / load / init / shape / count: one definition for every model (jaxcore.weights.ModelKind)
KIND = weights.ModelKind(
    FluxControlNetModel,
    FluxControlNetConfig,
    _dummy_inputs,
    lambda config, boxed: weight_map(config),
)
abstract_params = KIND.abstract_params
load_flux_controlnet = KIND.load  # a diffusers FluxControlNetModel directory
init_flux_controlnet = KIND.init
count_params = KIND.count_params
