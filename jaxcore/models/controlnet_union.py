"""The SDXL ControlNet++ "union" ControlNet in Flax linen (= diffusers ``ControlNetUnionModel``).

Reference (diffusers 0.42): ``models/controlnets/controlnet_union.py`` and
``models/controlnets/multicontrolnet_union.py``; checkpoints such as
xinsir/controlnet-union-sdxl-1.0 (``num_control_type`` 6) and its promax variant (8). It is a
:class:`~jaxcore.models.controlnet.ControlNetModel` (encoder half of the UNet + 1x1 residual
convs) whose single control image is replaced by K control images of K control types:

- each image goes through the shared ``controlnet_cond_embedding`` (``[B, C0, h, w]``);
- one token per image: the embedding's spatial mean plus ``task_embedding[control_type_idx]``
  (a bare ``[num_control_type, num_trans_channel]`` parameter), and one token for the spatial
  mean of ``conv_in``'s output: ``K + 1`` tokens through ``transformer_layes`` (sic: diffusers'
  spelling), CLIP-style ``ResidualAttentionBlock`` s (pre-LayerNorm torch ``MultiheadAttention``
  and a QuickGELU MLP);
- each image's token through ``spatial_ch_projs`` (a Linear) is added, per channel, to its
  embedding; the sum over the images is added to ``conv_in``'s output;
- ``control_type`` (``[B, num_control_type]``, 1 where a type is used) is embedded as SDXL's
  time ids are (``control_type_proj`` = sinusoids of width ``addition_time_embed_dim``, then
  the ``control_add_embedding`` MLP) and added to the time embedding.

Scaling (diffusers): with one image, or called from a MultiControlNetUnionModel
(``from_multi``), the residuals are scaled as ControlNetModel scales them by the first scale.
With several images each image's embedding, token and projected token are multiplied by its
own scale instead, and the residuals are not scaled (guess mode still applies its ramp).

Batch quirk kept for parity: diffusers builds ``nn.MultiheadAttention`` without
``batch_first``, so the ``[B, K + 1, C]`` tokens are read as sequence ``B``, batch ``K + 1``:
every token attends to the same-position tokens of the *other samples*, not to the sample's
own other tokens. The released weights were trained that way; the consequence is that a
sample's residuals depend on the rest of the batch (B = 1: attention is the identity on the
values). :class:`ControlNetUnionModel` reproduces it exactly.

Per-sample inputs here where diffusers takes one per call: ``conditioning_scale`` ``[B, K]``,
``guess_mode`` ``[B]``, ``control_type_idx`` ``[B, K]`` (or ``[K]``).

Not implemented (refused by name): what ControlNetModel refuses, plus
``controlnet_conditioning_channel_order="bgr"`` (diffusers raises on it in forward), and
``num_trans_channel`` / ``num_proj_channel`` other than ``block_out_channels[0]`` (diffusers
would fail on the shapes at the first forward).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

from jaxcore import weights
from jaxcore.config import config_json_kwargs
from jaxcore.models import controlnet
from jaxcore.models import unet_2d_condition as unet
from jaxcore.models.layers import AffineLayerNorm, dense

Dtype = Any

UNION_EXTRA_KEYS = (
    "num_control_type",
    "num_trans_channel",
    "num_trans_head",
    "num_trans_layer",
    "num_proj_channel",
)
# ControlNetUnionModel.__init__'s keys (ControlNetModel's without mid_block_type: the union
# model always has UNetMidBlock2DCrossAttn): a config.json key outside them is refused by name
UNION_KEYS = (
    tuple(k for k in controlnet.CONTROLNET_KEYS if k != "mid_block_type") + UNION_EXTRA_KEYS
)
TRANS_LAYER_NORM_EPS = 1e-5  # torch nn.LayerNorm's default, as ResidualAttentionBlock builds it
QUICK_GELU_ALPHA = 1.702  # CLIP's QuickGELU: x * sigmoid(1.702 x)
MLP_MULT = 4  # ResidualAttentionMlp: c_fc to 4 x width


class ControlNetUnionConfigError(controlnet.ControlNetConfigError):
    """A ControlNetUnionModel config.json the model cannot represent; names the key."""


@dataclasses.dataclass(frozen=True)
class ControlNetUnionConfig(controlnet.ControlNetConfig):
    """A ControlNetUnionModel's architecture: the ControlNet keys (checked as ControlNetConfig
    checks them) plus the control-fusion transformer's. Names and defaults are diffusers'."""

    conditioning_embedding_out_channels: tuple[int, ...] = (48, 96, 192, 384)
    num_control_type: int = 6
    num_trans_channel: int = 320
    num_trans_head: int = 8
    num_trans_layer: int = 1
    num_proj_channel: int = 320

    def _check_control(self) -> None:
        """ControlNetConfig's control-image checks, then the fusion transformer's keys."""
        super()._check_control()
        for key in UNION_EXTRA_KEYS:
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ControlNetUnionConfigError(f"{key} must be an int >= 1, got {value!r}")
        self._check_union_widths()

    def _check_union_widths(self) -> None:
        """The fusion adds tokens to C0-channel maps, so its widths must be C0 (diffusers'
        shapes fail otherwise); the type embedding needs ``addition_time_embed_dim``."""
        if self.controlnet_conditioning_channel_order != "rgb":
            raise ControlNetUnionConfigError(
                "controlnet_conditioning_channel_order="
                f"{self.controlnet_conditioning_channel_order!r}: ControlNetUnionModel only "
                "takes 'rgb'"
            )
        c0 = self.block_out_channels[0]
        for key in ("num_trans_channel", "num_proj_channel"):
            if getattr(self, key) != c0:
                raise ControlNetUnionConfigError(
                    f"{key}={getattr(self, key)} must equal block_out_channels[0]={c0}"
                )
        if self.num_trans_channel % self.num_trans_head:
            raise ControlNetUnionConfigError(
                f"num_trans_head={self.num_trans_head} does not divide "
                f"num_trans_channel={self.num_trans_channel}"
            )
        dim = self.addition_time_embed_dim
        if not isinstance(dim, int) or isinstance(dim, bool) or dim < 1:
            raise ControlNetUnionConfigError(
                f"addition_time_embed_dim must be an int >= 1 (the control-type embedding "
                f"width), got {dim!r}"
            )

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ControlNetUnionConfig:
        """From a diffusers ControlNetUnionModel config.json (``_``-prefixed keys ignored)."""
        unknown = sorted(k for k in d if not k.startswith("_") and k not in UNION_KEYS)
        if unknown:
            raise ControlNetUnionConfigError(
                f"unknown ControlNetUnionModel keys {unknown}; known keys: {sorted(UNION_KEYS)}"
            )
        return cls(**config_json_kwargs(cls, d, ControlNetUnionConfigError))

    def to_dict(self) -> dict[str, Any]:
        """The config.json diffusers' ControlNetUnionModel takes."""
        full = unet.UNet2DConditionConfig.to_dict(self)
        return {k: full[k] for k in UNION_KEYS}


def quick_gelu(x: jax.Array) -> jax.Array:
    """CLIP's QuickGELU (diffusers ``controlnet_union.QuickGELU``)."""
    return x * jax.nn.sigmoid(QUICK_GELU_ALPHA * x)


class MultiheadSelfAttention(nn.Module):
    """torch ``nn.MultiheadAttention(E, heads)`` self-attention on ``[N, L, E]`` (batch first
    here; the caller chooses which axis is the sequence). ``in_proj`` packs q, k, v."""

    heads: int
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x_nle: jax.Array) -> jax.Array:
        """Softmax attention of every position to every position, per row ``n``."""
        n, length, width = x_nle.shape
        head_dim = width // self.heads
        qkv = dense(3 * width, ("embed", "heads"), "in_proj", self.dtype, self.param_dtype)(x_nle)
        q, k, v = jnp.split(qkv.reshape(n, length, 3, self.heads, head_dim), 3, axis=2)
        q, k, v = (a[:, :, 0].astype(jnp.float32) for a in (q, k, v))
        logits_nhqk = jnp.einsum("nqhd,nkhd->nhqk", q / math.sqrt(head_dim), k)
        out_nqhd = jnp.einsum("nhqk,nkhd->nqhd", jax.nn.softmax(logits_nhqk, axis=-1), v)
        out = out_nqhd.reshape(n, length, width).astype(self.dtype)
        return dense(width, ("heads", "embed"), "out_proj", self.dtype, self.param_dtype)(out)


class ResidualAttentionMlp(nn.Module):
    """``c_fc`` (4x width), QuickGELU, ``c_proj``."""

    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x_nle: jax.Array) -> jax.Array:
        """``[N, L, E] -> [N, L, E]``."""
        width = x_nle.shape[-1]
        kw = {"dtype": self.dtype, "param_dtype": self.param_dtype}
        hidden = dense(MLP_MULT * width, ("embed", "mlp"), "c_fc", **kw)(x_nle)
        return dense(width, ("mlp", "embed"), "c_proj", **kw)(quick_gelu(hidden))


class ResidualAttentionBlock(nn.Module):
    """diffusers' (CLIP's) ``ResidualAttentionBlock`` on ``[N, L, E]``: pre-LayerNorm
    attention and QuickGELU MLP, each added back."""

    heads: int
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x_nle: jax.Array) -> jax.Array:
        """``[N, L, E] -> [N, L, E]``."""
        kw = {"dtype": self.dtype, "param_dtype": self.param_dtype}
        norm_1 = AffineLayerNorm(eps=TRANS_LAYER_NORM_EPS, name="ln_1", **kw)
        x_nle = x_nle + MultiheadSelfAttention(self.heads, name="attn", **kw)(norm_1(x_nle))
        norm_2 = AffineLayerNorm(eps=TRANS_LAYER_NORM_EPS, name="ln_2", **kw)
        return x_nle + ResidualAttentionMlp(name="mlp", **kw)(norm_2(x_nle))


def _stacked_images(controlnet_cond) -> jax.Array:
    """A list/tuple of K ``[B, C, 8h, 8w]`` images, or ``[B, K, C, 8h, 8w]``, as the latter."""
    if isinstance(controlnet_cond, list | tuple):
        return jnp.stack([jnp.asarray(c) for c in controlnet_cond], axis=1)
    images = jnp.asarray(controlnet_cond)
    if images.ndim != 5:
        raise ValueError(
            "controlnet_cond must be a list of [B, C, 8H, 8W] images or one [B, K, C, 8H, 8W] "
            f"array, got shape {images.shape}"
        )
    return images


def _per_control_scale(scale, batch: int, count: int) -> jax.Array:
    """``conditioning_scale`` as ``[B, K]`` float32: a scalar, a list / ``[K]`` (diffusers'
    per-image list) or ``[B, K]``."""
    scale = jnp.asarray(scale, jnp.float32)
    if scale.ndim == 1 and scale.shape[0] != count:
        raise ValueError(
            f"a 1-d conditioning_scale is one scale per control image: [K]=[{count}], got "
            f"{scale.shape}; pass [B, K] for per-sample scales"
        )
    if scale.ndim > 2 or (scale.ndim == 2 and scale.shape not in ((batch, count), (1, count))):
        raise ValueError(f"conditioning_scale must be scalar, [K] or [B, K], got {scale.shape}")
    return jnp.broadcast_to(scale, (batch, count))


class ControlNetUnionModel(controlnet.ControlNetModel):
    """diffusers ``ControlNetUnionModel.forward``, parameters named as in diffusers.

    ``__call__(sample [B, C, H, W], timestep [B] or scalar, encoder_hidden_states [B, T, D],
    controlnet_cond (list of K [B, 3, 8H, 8W] in [0, 1], or [B, K, 3, 8H, 8W]),
    control_type [B, num_control_type] (or [num_control_type]) 0/1,
    control_type_idx [K] or [B, K] ints (the type of each image; a Python list works),
    conditioning_scale scalar, [K] or [B, K] = 1.0, text_embeds=None, time_ids=None,
    guess_mode [B] bool or scalar = False, from_multi: Python bool = False) ->
    (down residuals: tuple of [B, C_k, H_k, W_k], mid residual [B, C, H', W'])``.

    ``from_multi`` is diffusers' flag (set by :func:`multi_controlnet_union`): the residuals
    are scaled by ``conditioning_scale[:, 0]`` whatever K, instead of per image. It selects the
    graph, so it must be a Python bool, not a traced value.
    """

    config: ControlNetUnionConfig
    # diffusers' batch quirk (the module docstring): the fusion tokens attend across the batch.
    # False: each sample's tokens alone (a batch of one in diffusers), so a render does not
    # depend on the prompts batched beside it; equal to diffusers' one-prompt call, with or
    # without CFG (the two CFG rows of a prompt hold the same tokens)
    attend_across_batch: bool = True

    def _control_embedding(self, control_type, batch: int) -> jax.Array:
        """``control_type [B, num_control_type]`` -> its time-embedding term ``[B, 4 C0]``."""
        cfg = self.config
        types = jnp.broadcast_to(
            jnp.asarray(control_type, jnp.float32), (batch, cfg.num_control_type)
        )
        sinus = unet.sinusoidal_embedding(
            types.reshape(-1), cfg.addition_time_embed_dim, cfg.flip_sin_to_cos, cfg.freq_shift
        ).reshape(batch, -1)
        # TimestepEmbedding built with its default act_fn: SiLU
        mlp = unet._time_mlp(cfg, "control_add_embedding", "silu", self.param_dtype)
        return mlp(sinus)

    def _embed_images(self, images_bkchw) -> jax.Array:
        """The shared ``controlnet_cond_embedding`` of every image: ``[B, K, h, w, C0]``."""
        cfg = self.config
        batch, count = images_bkchw.shape[:2]
        flat = images_bkchw.reshape(batch * count, *images_bkchw.shape[2:])
        embedding = controlnet.ConditioningEmbedding(
            cfg.block_out_channels[0],
            cfg.conditioning_embedding_out_channels,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            name="controlnet_cond_embedding",
        )(jnp.transpose(flat, (0, 2, 3, 1)).astype(self.dtype))
        return embedding.reshape(batch, count, *embedding.shape[1:])

    def _task_tokens(self, control_type_idx, batch: int, count: int) -> jax.Array:
        """``task_embedding`` rows of each image's control type: ``[B, K, C]``."""
        cfg = self.config
        scale = math.sqrt(cfg.num_trans_channel)  # diffusers' init: sqrt(C) * randn
        table = self.param(
            "task_embedding",
            nn.with_logical_partitioning(
                lambda key, shape, dtype: scale * jax.random.normal(key, shape, dtype),
                (None, "embed"),
            ),
            (cfg.num_control_type, cfg.num_trans_channel),
            self.param_dtype,
        )
        idx = jnp.asarray(control_type_idx, jnp.int32)
        if idx.shape not in ((count,), (batch, count), (1, count)):
            raise ValueError(
                f"control_type_idx must be [K]=[{count}] or [B, K] ints, got {idx.shape}"
            )
        return jnp.broadcast_to(jnp.take(table, idx, axis=0), (batch, count, table.shape[-1]))

    def _fuse(self, x_bhwc, cond_bkhwc, task_bkc, scale_bk, per_image: bool) -> jax.Array:
        """conv_in's output plus the fused control embeddings (see the module docstring)."""
        kw = {"dtype": self.dtype, "param_dtype": self.param_dtype}
        feat_bkc = jnp.mean(cond_bkhwc, axis=(2, 3)) + task_bkc.astype(cond_bkhwc.dtype)
        if per_image:
            feat_bkc = feat_bkc * scale_bk[..., None].astype(feat_bkc.dtype)
            cond_bkhwc = cond_bkhwc * scale_bk[..., None, None, None].astype(cond_bkhwc.dtype)
        tokens_bkc = jnp.concatenate([feat_bkc, jnp.mean(x_bhwc, axis=(1, 2))[:, None]], axis=1)
        c = tokens_bkc.shape[-1]
        # torch MultiheadAttention without batch_first: the sample axis is the sequence
        tokens_kbc = jnp.swapaxes(tokens_bkc, 0, 1)
        sequences = tokens_kbc if self.attend_across_batch else tokens_kbc.reshape(-1, 1, c)
        for n in range(self.config.num_trans_layer):
            block = ResidualAttentionBlock(
                self.config.num_trans_head, name=f"transformer_layes_{n}", **kw
            )
            sequences = block(sequences)
        tokens_kbc = sequences.reshape(tokens_kbc.shape)
        proj = dense(self.config.num_proj_channel, ("embed", None), "spatial_ch_projs", **kw)
        fused = jnp.zeros_like(x_bhwc)
        for k in range(cond_bkhwc.shape[1]):
            alpha_bc = proj(tokens_kbc[k])
            if per_image:
                alpha_bc = alpha_bc * scale_bk[:, k, None].astype(alpha_bc.dtype)
            fused = fused + (cond_bkhwc[:, k] + alpha_bc[:, None, None, :])
        return x_bhwc + fused

    @nn.compact
    def __call__(
        self,
        sample,
        timestep,
        encoder_hidden_states,
        controlnet_cond,
        control_type,
        control_type_idx,
        conditioning_scale=1.0,
        text_embeds=None,
        time_ids=None,
        guess_mode=False,
        from_multi: bool = False,
    ):
        """The residuals; see the class docstring for the inputs."""
        cfg = self.config
        x, temb, context = self._prepare(
            sample, timestep, encoder_hidden_states, text_embeds, time_ids
        )
        batch = x.shape[0]
        images = _stacked_images(controlnet_cond)
        count = images.shape[1]
        if images.shape[0] != batch or images.shape[2] != cfg.conditioning_channels:
            raise ValueError(
                f"control images must be [B={batch}, conditioning_channels="
                f"{cfg.conditioning_channels}, 8H, 8W], got {images.shape} (stacked)"
            )
        scale_bk = _per_control_scale(conditioning_scale, batch, count)
        temb = temb + self._control_embedding(control_type, batch)
        x = self._same_conv(cfg.block_out_channels[0], cfg.conv_in_kernel, "conv_in")(x)
        per_image = count > 1 and not from_multi
        task_bkc = self._task_tokens(control_type_idx, batch, count)
        x = self._fuse(x, self._embed_images(images), task_bkc, scale_bk, per_image)
        x, skips = self._down_path(x, temb, context)
        out_scale = jnp.ones((batch,), jnp.float32) if per_image else scale_bk[:, 0]
        down, mid = self._scaled(*self._residuals(x, skips), out_scale, guess_mode)
        to_nchw = lambda r: jnp.transpose(r, (0, 3, 1, 2))  # noqa: E731
        return tuple(to_nchw(r) for r in down), to_nchw(mid)


def multi_controlnet_union(nets: Sequence[tuple], *args, conditioning_scales, **kwargs):
    """diffusers ``MultiControlNetUnionModel.forward``: the residuals of several union
    ControlNets summed, each called with ``from_multi=True``.

    ``nets``: ``(module, params, controlnet_cond, control_type, control_type_idx)`` per net;
    ``conditioning_scales``: one scale (scalar, ``[K]`` or ``[B, K]``) per net; ``args`` /
    ``kwargs``: the shared ``sample, timestep, encoder_hidden_states`` and ``text_embeds``,
    ``time_ids``, ``guess_mode``. A net whose scale is the Python number 0 is skipped, as in
    diffusers (a zero array just contributes zeros).
    """
    down_sum = mid_sum = None
    for (module, params, cond, ctype, idx), scale in zip(nets, conditioning_scales, strict=True):
        if isinstance(scale, int | float) and scale == 0:
            continue
        sample, timestep, context = args
        down, mid = module.apply(
            {"params": params},
            sample,
            timestep,
            context,
            cond,
            ctype,
            idx,
            scale,
            from_multi=True,
            **kwargs,
        )
        if down_sum is None:
            down_sum, mid_sum = list(down), mid
        else:
            down_sum = [a + b for a, b in zip(down_sum, down, strict=True)]
            mid_sum = mid_sum + mid
    return down_sum, mid_sum


_TRANS_LAYER = re.compile(r"^transformer_layes_(\d+)$")


def _source_entry(path: tuple[str, ...], ndim: int) -> tuple[str, weights.Transform]:
    """Flax param path -> (diffusers key, transform); the union parts by hand, the rest as
    the UNet names them."""
    if path == ("task_embedding",):
        return "task_embedding", weights.identity
    match = _TRANS_LAYER.match(path[0])
    if match is None:
        return unet._source_entry(path, ndim)
    *modules, leaf = (f"transformer_layes.{match.group(1)}", *path[1:])
    if modules[-1] == "in_proj":  # torch MultiheadAttention's packed q/k/v: bare parameters
        prefix = ".".join(modules[:-1])
        if leaf == "kernel":
            return f"{prefix}.in_proj_weight", weights.linear
        return f"{prefix}.in_proj_bias", weights.identity
    key = ".".join(modules)
    if leaf == "kernel":
        return f"{key}.weight", weights.linear
    return f"{key}.{'weight' if leaf == 'scale' else 'bias'}", weights.identity


def _dummy_inputs(config: ControlNetUnionConfig, batch: int = 1) -> tuple:
    """The ControlNet's smallest inputs with one control image (K = 1) and its type."""
    sample, timestep, context, image, _, text_embeds, time_ids = controlnet._dummy_inputs(
        config, batch
    )
    images = jax.ShapeDtypeStruct((batch, 1, *image.shape[1:]), jnp.float32)
    control_type = jax.ShapeDtypeStruct((batch, config.num_control_type), jnp.float32)
    idx = jax.ShapeDtypeStruct((1,), jnp.int32)
    scale = jax.ShapeDtypeStruct((batch, 1), jnp.float32)
    return sample, timestep, context, images, control_type, idx, scale, text_embeds, time_ids


KIND = weights.ModelKind(
    ControlNetUnionModel,
    ControlNetUnionConfig,
    _dummy_inputs,
    lambda config, boxed: weights.weight_map_by_path(boxed, _source_entry),
)
abstract_params = KIND.abstract_params
load_controlnet_union = KIND.load  # a diffusers ControlNetUnionModel directory
init_controlnet_union = KIND.init
count_params = KIND.count_params


def weight_map(config: ControlNetUnionConfig) -> dict:
    """{flax param path: (diffusers ControlNetUnionModel key, transform)} for every parameter."""
    return KIND.weight_map(config, abstract_params(ControlNetUnionModel(config)))
