"""The SD 1.x / 2.x and SDXL denoiser in Flax linen (= diffusers ``UNet2DConditionModel``).

Reference (diffusers 0.42): ``models/unets/unet_2d_condition.py`` (the model, its config checks
and forward), ``unets/unet_2d_blocks.py`` (CrossAttnDownBlock2D, DownBlock2D,
UNetMidBlock2DCrossAttn, CrossAttnUpBlock2D, UpBlock2D), ``transformers/transformer_2d.py``
(Transformer2DModel on continuous input), ``attention.py`` (BasicTransformerBlock,
FeedForward), ``activations.py`` (GEGLU), ``attention_processor.py`` (Attention),
``resnet.py`` (ResnetBlock2D with a time embedding), ``downsampling.py`` / ``upsampling.py``
(Downsample2D, Upsample2D) and ``embeddings.py`` (Timesteps, TimestepEmbedding).
Inference math (dropout is identity); gradients flow everywhere, so it trains.

Layout: public tensors use the diffusers layout, ``sample [B, C, H, W]``, ``timestep [B]``
(float per sample, or a scalar for the whole batch), ``encoder_hidden_states [B, T,
cross_attention_dim]``, output ``[B, out_channels, H, W]``. Inside, images are channel-last
``[B, H, W, C]`` and the transformer tokens ``[B, H*W, C]``.

What makes it equal to diffusers:
- Time: ``Timesteps(block_out_channels[0], flip_sin_to_cos, freq_shift)`` (float32 frequency
  table rounded as torch rounds it, see :func:`timestep_frequencies`) -> ``TimestepEmbedding``
  (linear, ``act_fn``, linear) to ``4 * block_out_channels[0]``. SDXL's ``text_time``: every
  ``time_ids`` entry gets ``Timesteps(addition_time_embed_dim)``, flattened per sample,
  concatenated after ``text_embeds`` and mapped by a SiLU ``TimestepEmbedding`` (diffusers builds
  ``add_embedding`` without ``act_fn``), added to the time embedding. The time path runs in
  float32.
- ResnetBlock2D (``resnet_time_scale_shift="default"``): norm1, act, conv1, plus
  ``time_emb_proj(act(temb))`` per channel, norm2, act, conv2, a 1x1 ``conv_shortcut`` when the
  channel count changes, ``(shortcut + h) / output_scale_factor`` (``mid_block_scale_factor`` in
  the mid block, 1 elsewhere). GroupNorms (``norm_eps`` in resnets, 1e-6 in the transformers) are
  float32 (:class:`jaxcore.models.autoencoder_kl.GroupNorm`).
- Transformer2DModel: GroupNorm, ``proj_in`` (1x1 conv, or linear on tokens with
  ``use_linear_projection``), ``transformer_layers_per_block`` BasicTransformerBlocks (LayerNorm
  eps 1e-5 before self-attention, cross-attention to ``encoder_hidden_states`` and a GEGLU
  feed-forward of width 4x, each added back), ``proj_out``, the input added back.
- Heads: diffusers' naming quirk is kept. With ``num_attention_heads`` null (every released
  config), ``attention_head_dim`` is the number of heads per level and the head width is
  ``channels // heads``; the up path reads the per-level lists reversed. diffusers 0.42 refuses a
  non-null ``num_attention_heads`` in its constructor; here it is accepted as the head count and
  moved into ``attention_head_dim`` at construction, so :meth:`UNet2DConditionConfig.to_dict`
  writes a config diffusers loads.
- Attention runs through :func:`jaxcore.attention.attention` (``[B, L, H, D]``, scale
  ``D ** -0.5``; q/k/v without bias, ``to_out.0`` with bias). ``upcast_attention`` casts q and k
  to float32 before the scores (what diffusers' ``AttnProcessor`` does with the flag; its default
  SDPA processor ignores it). The ``dot_product`` backend accumulates scores in float32 anyway,
  so the flag changes nothing in float32 and little in bf16.
- Down/upsampling: Downsample2D is a 3x3 stride-2 conv with ``downsample_padding`` on every side
  (0: one zero row/column at the bottom/right, as diffusers pads). Upsample2D is nearest
  neighbour to the size of the skip it is concatenated with (x2 when H and W divide by
  2 ** (levels - 1); otherwise torch's ``F.interpolate(size=...)`` indices, as diffusers forwards
  ``upsample_size``), then a 3x3 conv. Skips are concatenated after the hidden state.

GEGLU layout: diffusers' ``ff.net.0.proj`` maps D to 2F and chunks the result into (hidden,
gate). Here its kernel is ``[D, 2, F]`` (bias ``[2, F]``), so the tensor axis splits hidden and
gate the same way; :func:`weight_map` reshapes on load and export.

Sharding: parameters carry logical names only. Attention and feed-forward kernels use
``embed`` / ``heads`` / ``mlp`` as in the Flux transformer; the time MLPs use ``embed``; the
convolutions reuse :class:`~jaxcore.models.autoencoder_kl.Conv2d` (``conv_in`` / ``conv_out``:
replicated under the default rules). ``time_emb_proj`` is ``("embed", "conv_out")``: its output
is added per conv channel.

Not implemented (refused by name in the config): other block types, ``only_cross_attention``,
dual cross-attention, class / encoder-hidden / image embeddings, ``time_cond_proj_dim``,
``resnet_time_scale_shift="scale_shift"``, GLIGEN, ``dropout > 0``; ``cross_attention_dim`` as a
per-block list. Not in the call: attention masks, T2I-adapter residuals, FreeU. ControlNet
residuals (``down_block_additional_residuals``, ``mid_block_additional_residual``, diffusers
layout) are added as diffusers adds them (:mod:`jaxcore.models.controlnet`).

Parity reached (tests/jaxcore/test_unet_2d_condition.py, fp32 on CPU, every diffusers
parameter perturbed, ``jax_default_matmul_precision="highest"``, the reference with a correctly
rounded float32 ``exp`` for the timestep frequencies as in the Flux tests): max abs difference
5.4e-6 / 6.0e-6 / 6.7e-6 / 7.6e-6 on outputs of magnitude 3.9 / 3.8 / 3.4 / 6.9 for an SD
1.x-like, an SD 2.x-like, an SDXL-like (text_time) and an odd config (3 levels, 18x24, batch 2
with two timesteps, heads via ``num_attention_heads``, upcast, centred input, sin-first shifted
frequencies, mish, 1x1 / 5x5 in / out convs, padding-0 downsampling, a non-x2 upsampling, mid
scale 1.5); test bound 1e-5. That is fp32 rounding on both sides: we are 3.7e-6 to 5.4e-6 from a
float64 run of diffusers, diffusers' own fp32 run 5.1e-6 to 5.6e-6. Exported parameters load
strictly into diffusers and reproduce its output to the same bound; a 2 x 2 x 2 (data, fsdp,
tensor) sharded forward equals the unsharded one within 1e-5. bf16 (weights and activations) is
0.081 from fp32 where diffusers' bf16 run is 0.076 (|outputs| 3.1).

Public API: :class:`UNet2DConditionConfig`, :class:`UNet2DConditionConfigError`,
:class:`UNet2DConditionModel`, :func:`timestep_frequencies`, :func:`sinusoidal_embedding`,
:func:`weight_map`, :func:`abstract_params`, :func:`load_unet_2d_condition`,
:func:`init_unet_2d_condition`, :func:`count_params`, and the published configs
:data:`SD15_CONFIG`, :data:`SD2_BASE_CONFIG`, :data:`SD21_CONFIG`, :data:`SDXL_BASE_CONFIG`.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from jaxcore import sharding, weights
from jaxcore.attention import attention as attention_fn
from jaxcore.compute import remat_block
from jaxcore.config import config_json_kwargs
from jaxcore.models.autoencoder_kl import ACTIVATIONS, Conv2d, GroupNorm
from jaxcore.models.layers import (
    MLP2,
    AffineLayerNorm,
    Dense,
    dense,
    dense_general,
    gelu_erf,
)
from jaxcore.quantization import as_dtype

Dtype = Any

CROSS_DOWN, DOWN = "CrossAttnDownBlock2D", "DownBlock2D"
CROSS_UP, UP = "CrossAttnUpBlock2D", "UpBlock2D"
MID = "UNetMidBlock2DCrossAttn"
TEXT_TIME = "text_time"

TRANSFORMER_GROUP_NORM_EPS = 1e-6  # Transformer2DModel's GroupNorm (hard-coded in diffusers)
LAYER_NORM_EPS = 1e-5  # BasicTransformerBlock's norm1/2/3 as Transformer2DModel builds them
FF_MULT = 4  # FeedForward inner width = 4 x the block width
MAX_PERIOD = 10000.0
TIME_EMBED_MULT = 4  # time_embed_dim = 4 x block_out_channels[0] ("positional" embedding)

__all__ = [
    "SD15_CONFIG",
    "SD21_CONFIG",
    "SD2_BASE_CONFIG",
    "SDXL_BASE_CONFIG",
    "UNet2DConditionConfig",
    "UNet2DConditionConfigError",
    "UNet2DConditionModel",
    "abstract_params",
    "count_params",
    "init_unet_2d_condition",
    "load_unet_2d_condition",
    "sinusoidal_embedding",
    "timestep_frequencies",
    "weight_map",
]

# ----------------------------------------------------------------------------------------------
# Published configs (unet/config.json of the Hub repositories, ``_``-keys dropped)
# ----------------------------------------------------------------------------------------------

_SD_DOWN = (CROSS_DOWN, CROSS_DOWN, CROSS_DOWN, DOWN)
_SD_UP = (UP, CROSS_UP, CROSS_UP, CROSS_UP)
_SD_COMMON = {
    "act_fn": "silu",
    "block_out_channels": [320, 640, 1280, 1280],
    "center_input_sample": False,
    "down_block_types": list(_SD_DOWN),
    "downsample_padding": 1,
    "flip_sin_to_cos": True,
    "freq_shift": 0,
    "in_channels": 4,
    "layers_per_block": 2,
    "mid_block_scale_factor": 1,
    "norm_eps": 1e-05,
    "norm_num_groups": 32,
    "out_channels": 4,
    "up_block_types": list(_SD_UP),
}
# runwayml/stable-diffusion-v1-5 (diffusers 0.6.0 era: no use_linear_projection key = False)
SD15_CONFIG: dict[str, Any] = {
    **_SD_COMMON,
    "attention_head_dim": 8,
    "cross_attention_dim": 768,
    "sample_size": 64,
}
# stabilityai/stable-diffusion-2-base
SD2_BASE_CONFIG: dict[str, Any] = {
    **_SD_COMMON,
    "attention_head_dim": [5, 10, 20, 20],
    "cross_attention_dim": 1024,
    "dual_cross_attention": False,
    "sample_size": 64,
    "use_linear_projection": True,
}
# stabilityai/stable-diffusion-2-1 (768 v-prediction); its config sets upcast_attention true
SD21_CONFIG: dict[str, Any] = {
    **SD2_BASE_CONFIG,
    "num_class_embeds": None,
    "only_cross_attention": False,
    "sample_size": 96,
    "upcast_attention": True,
}
# stabilityai/stable-diffusion-xl-base-1.0 (upcast_attention is null there: no upcast)
SDXL_BASE_CONFIG: dict[str, Any] = {
    "act_fn": "silu",
    "addition_embed_type": TEXT_TIME,
    "addition_embed_type_num_heads": 64,
    "addition_time_embed_dim": 256,
    "attention_head_dim": [5, 10, 20],
    "block_out_channels": [320, 640, 1280],
    "center_input_sample": False,
    "class_embed_type": None,
    "class_embeddings_concat": False,
    "conv_in_kernel": 3,
    "conv_out_kernel": 3,
    "cross_attention_dim": 2048,
    "cross_attention_norm": None,
    "down_block_types": [DOWN, CROSS_DOWN, CROSS_DOWN],
    "downsample_padding": 1,
    "dual_cross_attention": False,
    "encoder_hid_dim": None,
    "encoder_hid_dim_type": None,
    "flip_sin_to_cos": True,
    "freq_shift": 0,
    "in_channels": 4,
    "layers_per_block": 2,
    "mid_block_only_cross_attention": None,
    "mid_block_scale_factor": 1,
    "mid_block_type": MID,
    "norm_eps": 1e-05,
    "norm_num_groups": 32,
    "num_attention_heads": None,
    "num_class_embeds": None,
    "only_cross_attention": False,
    "out_channels": 4,
    "projection_class_embeddings_input_dim": 2816,
    "resnet_out_scale_factor": 1.0,
    "resnet_skip_time_act": False,
    "resnet_time_scale_shift": "default",
    "sample_size": 128,
    "time_cond_proj_dim": None,
    "time_embedding_act_fn": None,
    "time_embedding_dim": None,
    "time_embedding_type": "positional",
    "timestep_post_act": None,
    "transformer_layers_per_block": [1, 2, 10],
    "up_block_types": [CROSS_UP, CROSS_UP, UP],
    "upcast_attention": None,
    "use_linear_projection": True,
}

# ----------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------


class UNet2DConditionConfigError(ValueError):
    """A config.json / YAML section UNet2DConditionConfig cannot represent; names the key."""


# Keys whose only implemented value is diffusers' default; anything else is refused by name.
_ONLY_DEFAULT: dict[str, Any] = {
    "dropout": 0.0,
    "dual_cross_attention": False,
    "reverse_transformer_layers_per_block": None,
    "encoder_hid_dim": None,
    "encoder_hid_dim_type": None,
    "class_embed_type": None,
    "num_class_embeds": None,
    "resnet_time_scale_shift": "default",
    "time_embedding_type": "positional",
    "time_embedding_dim": None,
    "time_embedding_act_fn": None,
    "timestep_post_act": None,
    "time_cond_proj_dim": None,
    "attention_type": "default",
    "class_embeddings_concat": False,
    "mid_block_type": MID,
}

IntOrList = int | tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class UNet2DConditionConfig:
    """Architecture of a UNet2DConditionModel; names and defaults are diffusers' ``__init__``.

    ``attention_head_dim`` (int or one per level) is the number of heads (see the module
    docstring); ``layers_per_block`` and ``transformer_layers_per_block`` are an int or one per
    level. ``sample_size`` is metadata (the default latent size).

    Accepted and inert, as in diffusers for the blocks implemented here: ``resnet_skip_time_act``,
    ``resnet_out_scale_factor``, ``cross_attention_norm``, ``mid_block_only_cross_attention`` and
    ``addition_embed_type_num_heads`` (only other block / embedding types read them).
    """

    sample_size: int | tuple[int, ...] | None = None
    in_channels: int = 4
    out_channels: int = 4
    center_input_sample: bool = False
    flip_sin_to_cos: bool = True
    freq_shift: float = 0
    down_block_types: tuple[str, ...] = _SD_DOWN
    mid_block_type: str | None = MID
    up_block_types: tuple[str, ...] = _SD_UP
    only_cross_attention: bool | tuple[bool, ...] = False
    block_out_channels: tuple[int, ...] = (320, 640, 1280, 1280)
    layers_per_block: IntOrList = 2
    downsample_padding: int = 1
    mid_block_scale_factor: float = 1
    dropout: float = 0.0
    act_fn: str = "silu"
    norm_num_groups: int | None = 32
    norm_eps: float = 1e-5
    cross_attention_dim: int = 1280
    transformer_layers_per_block: IntOrList = 1
    reverse_transformer_layers_per_block: Any = None
    encoder_hid_dim: int | None = None
    encoder_hid_dim_type: str | None = None
    attention_head_dim: IntOrList = 8
    num_attention_heads: IntOrList | None = None
    dual_cross_attention: bool = False
    use_linear_projection: bool = False
    class_embed_type: str | None = None
    addition_embed_type: str | None = None
    addition_time_embed_dim: int | None = None
    num_class_embeds: int | None = None
    upcast_attention: bool | None = False
    resnet_time_scale_shift: str = "default"
    resnet_skip_time_act: bool = False
    resnet_out_scale_factor: float = 1.0
    time_embedding_type: str = "positional"
    time_embedding_dim: int | None = None
    time_embedding_act_fn: str | None = None
    timestep_post_act: str | None = None
    time_cond_proj_dim: int | None = None
    conv_in_kernel: int = 3
    conv_out_kernel: int = 3
    projection_class_embeddings_input_dim: int | None = None
    attention_type: str = "default"
    class_embeddings_concat: bool = False
    mid_block_only_cross_attention: bool | None = None
    cross_attention_norm: str | None = None
    addition_embed_type_num_heads: int = 64

    def __post_init__(self):
        for key in ("down_block_types", "up_block_types", "block_out_channels"):
            object.__setattr__(self, key, tuple(getattr(self, key)))
        for key in (
            "sample_size",
            "only_cross_attention",
            "layers_per_block",
            "transformer_layers_per_block",
            "attention_head_dim",
            "num_attention_heads",
        ):
            value = getattr(self, key)
            if isinstance(value, list | tuple):
                object.__setattr__(self, key, tuple(value))
        self._check_unsupported()
        self._check_blocks()
        self._resolve_heads()
        self._check_per_level()
        self._check_sizes()
        self._check_addition_embedding()

    # --- checks -----------------------------------------------------------------------------

    def _check_unsupported(self) -> None:
        for key, default in _ONLY_DEFAULT.items():
            value = getattr(self, key)
            if value != default:
                raise UNet2DConditionConfigError(
                    f"{key}={value!r} is not implemented; only {default!r} (the SD 1.x / 2.x / "
                    "SDXL UNets) is supported"
                )
        flags = self.only_cross_attention
        if any(flags if isinstance(flags, tuple) else (flags,)):
            raise UNet2DConditionConfigError(
                f"only_cross_attention={_listed(flags)!r} is not implemented; only false"
            )
        if not isinstance(self.cross_attention_dim, int) or isinstance(
            self.cross_attention_dim, bool
        ):
            raise UNet2DConditionConfigError(
                f"cross_attention_dim={_listed(self.cross_attention_dim)!r}: only one int is "
                "supported (a per-block list needs per-block encoder states)"
            )
        if self.act_fn not in ACTIVATIONS:
            raise UNet2DConditionConfigError(
                f"act_fn={self.act_fn!r} is not one of {sorted(ACTIVATIONS)}"
            )
        if self.norm_num_groups is None:
            raise UNet2DConditionConfigError(
                "norm_num_groups=None (no output norm) is not implemented"
            )

    def _check_blocks(self) -> None:
        levels = len(self.block_out_channels)
        for key, allowed in (
            ("down_block_types", (CROSS_DOWN, DOWN)),
            ("up_block_types", (CROSS_UP, UP)),
        ):
            types = getattr(self, key)
            for i, name in enumerate(types):
                if name not in allowed:
                    raise UNet2DConditionConfigError(
                        f"{key}[{i}]={name!r} is not implemented; only {list(allowed)}"
                    )
            if len(types) != levels:
                raise UNet2DConditionConfigError(
                    f"{key} has {len(types)} entries but block_out_channels has {levels}"
                )

    def _resolve_heads(self) -> None:
        """diffusers: ``num_attention_heads or attention_head_dim`` is the head count."""
        if self.num_attention_heads is not None:
            object.__setattr__(self, "attention_head_dim", self.num_attention_heads)
            object.__setattr__(self, "num_attention_heads", None)

    def _check_per_level(self) -> None:
        levels = len(self.block_out_channels)
        for key in (
            "layers_per_block",
            "transformer_layers_per_block",
            "attention_head_dim",
        ):
            value = getattr(self, key)
            values = value if isinstance(value, tuple) else (value,)
            if isinstance(value, tuple) and len(value) != levels:
                raise UNet2DConditionConfigError(
                    f"{key} has {len(value)} entries but there are {levels} blocks"
                )
            if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in values):
                raise UNet2DConditionConfigError(
                    f"{key}={_listed(value)!r} must be an int >= 1 or one such int per block"
                )
        for level, (channels, heads) in enumerate(
            zip(self.block_out_channels, self.heads_per_level, strict=True)
        ):
            if heads > channels:
                raise UNet2DConditionConfigError(
                    f"attention_head_dim (the head count) {heads} at block {level} exceeds its "
                    f"{channels} channels"
                )

    def _check_sizes(self) -> None:
        for key in ("in_channels", "out_channels", "norm_num_groups", "cross_attention_dim"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise UNet2DConditionConfigError(f"{key} must be an int >= 1, got {value!r}")
        if not self.block_out_channels or min(self.block_out_channels) < 1:
            raise UNet2DConditionConfigError(
                f"block_out_channels must be positive ints, got {list(self.block_out_channels)}"
            )
        for channels in self.block_out_channels:
            if channels % self.norm_num_groups:
                raise UNet2DConditionConfigError(
                    f"block_out_channels entry {channels} is not divisible by "
                    f"norm_num_groups={self.norm_num_groups} (GroupNorm needs whole groups)"
                )
        for key in ("conv_in_kernel", "conv_out_kernel"):
            k = getattr(self, key)
            if not isinstance(k, int) or k < 1 or k % 2 == 0:
                # an even kernel with padding (k-1)//2 would change H and W
                raise UNet2DConditionConfigError(f"{key} must be an odd int >= 1, got {k!r}")
        if not isinstance(self.downsample_padding, int) or self.downsample_padding < 0:
            raise UNet2DConditionConfigError(
                f"downsample_padding must be an int >= 0, got {self.downsample_padding!r}"
            )
        if not self.mid_block_scale_factor:
            raise UNet2DConditionConfigError("mid_block_scale_factor must be non-zero")

    def _check_addition_embedding(self) -> None:
        kind = self.addition_embed_type
        if kind not in (None, TEXT_TIME):
            raise UNet2DConditionConfigError(
                f"addition_embed_type={kind!r} is not implemented; only null or {TEXT_TIME!r}"
            )
        if kind != TEXT_TIME:
            return
        for key in ("addition_time_embed_dim", "projection_class_embeddings_input_dim"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise UNet2DConditionConfigError(
                    f"{key} must be an int >= 1 with addition_embed_type={TEXT_TIME!r}, "
                    f"got {value!r}"
                )
        if self.projection_class_embeddings_input_dim < self.addition_time_embed_dim:
            raise UNet2DConditionConfigError(
                "projection_class_embeddings_input_dim="
                f"{self.projection_class_embeddings_input_dim} is below addition_time_embed_dim="
                f"{self.addition_time_embed_dim}: it must hold the pooled text width plus one "
                "embedding per time id"
            )

    # --- (de)serialisation ------------------------------------------------------------------

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> UNet2DConditionConfig:
        """Build from a diffusers config.json dict (``_``-prefixed keys ignored)."""
        return cls(**config_json_kwargs(cls, d, UNet2DConditionConfigError))

    def to_dict(self) -> dict[str, Any]:
        return {k: _listed(v) for k, v in dataclasses.asdict(self).items()}

    # --- derived ----------------------------------------------------------------------------

    @property
    def num_levels(self) -> int:
        return len(self.block_out_channels)

    def _per_level(self, value) -> tuple[int, ...]:
        return value if isinstance(value, tuple) else (value,) * self.num_levels

    @property
    def heads_per_level(self) -> tuple[int, ...]:
        """Heads of each level (diffusers: ``num_attention_heads or attention_head_dim``)."""
        return self._per_level(self.attention_head_dim)

    @property
    def resnets_per_level(self) -> tuple[int, ...]:
        """Resnets of each down block (each up block has one more)."""
        return self._per_level(self.layers_per_block)

    @property
    def transformer_depth_per_level(self) -> tuple[int, ...]:
        return self._per_level(self.transformer_layers_per_block)

    @property
    def time_embed_dim(self) -> int:
        return TIME_EMBED_MULT * self.block_out_channels[0]

    @property
    def upcast(self) -> bool:
        return bool(self.upcast_attention)


def _listed(value):
    """Tuples back to lists (config.json form)."""
    return list(value) if isinstance(value, tuple) else value


# ----------------------------------------------------------------------------------------------
# Time embedding
# ----------------------------------------------------------------------------------------------


def timestep_frequencies(dim: int, freq_shift: float = 0.0) -> np.ndarray:
    """The float32 frequencies ``[dim // 2]`` of diffusers' ``get_timestep_embedding``.

    torch computes the exponent ``-ln(10000) * i / (dim // 2 - freq_shift)`` in float32; the
    same rounding here, then a correctly rounded exp (float64, rounded). With ``freq_shift=0``
    this is :func:`jaxcore.models.layers.timestep_frequencies` (see there for torch's exp).
    """
    half = dim // 2
    exponent = np.float32(-math.log(MAX_PERIOD)) * np.arange(half, dtype=np.float32)
    exponent = exponent / np.float32(half - freq_shift)
    return np.exp(exponent.astype(np.float64)).astype(np.float32)


def sinusoidal_embedding(
    t_n: jax.Array, dim: int, flip_sin_to_cos: bool, freq_shift: float
) -> jax.Array:
    """diffusers ``Timesteps(dim, flip_sin_to_cos, freq_shift)``: ``[N] -> [N, dim]`` float32.

    sin half first (cos first with ``flip_sin_to_cos``), zero-padded to an odd ``dim``.
    """
    freqs = jnp.asarray(timestep_frequencies(dim, freq_shift))
    args = t_n.astype(jnp.float32)[:, None] * freqs[None, :]
    halves = [jnp.sin(args), jnp.cos(args)]
    emb = jnp.concatenate(halves[::-1] if flip_sin_to_cos else halves, axis=-1)
    if dim % 2:
        emb = jnp.pad(emb, ((0, 0), (0, 1)))
    return emb


def _time_mlp(config: UNet2DConditionConfig, name: str, act_fn: str, param_dtype: Dtype) -> MLP2:
    """diffusers ``TimestepEmbedding(in, 4 C0, act_fn)``: linear_1, act, linear_2, in float32."""
    dim = config.time_embed_dim
    return MLP2(
        dim,
        dim,
        ACTIVATIONS[act_fn],
        (None, "embed"),
        ("embed", None),
        dtype=jnp.float32,
        param_dtype=param_dtype,
        name=name,
    )


# ----------------------------------------------------------------------------------------------
# Layers (channel-last)
# ----------------------------------------------------------------------------------------------

_IMAGE = ("activation_batch", "activation_height", "activation_width", "activation_channels")
_TOKENS = ("activation_batch", "activation_length", "activation_embed")
_TOKEN_HEADS = ("activation_batch", "activation_length", "activation_heads", "activation_kv")
_TEXT_HEADS = ("activation_batch", "activation_kv_length", "activation_heads", "activation_kv")
_FF_HIDDEN = ("activation_batch", "activation_length", "activation_mlp")


def _constrain_image(x_bhwc: jax.Array) -> jax.Array:
    """Sharding hint: batch over (data, fsdp); H, W, C by their (default: replicated) rules."""
    return sharding.constrain(x_bhwc, _IMAGE)


def _conv1x1(features: int, name: str, kw: dict) -> Conv2d:
    return Conv2d(features, (1, 1), padding=((0, 0), (0, 0)), name=name, **kw)


def LayerNorm(**kw) -> AffineLayerNorm:  # noqa: N802 - torch's name for the module
    """torch ``nn.LayerNorm(D, eps)`` with affine, over the last axis, computed in float32."""
    return AffineLayerNorm(eps=LAYER_NORM_EPS, **kw)


class ResnetBlock2D(nn.Module):
    """diffusers ``ResnetBlock2D`` with a time embedding (``time_embedding_norm="default"``)."""

    out_channels: int
    num_groups: int
    eps: float
    act_fn: str = "silu"
    output_scale_factor: float = 1.0
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x_bhwc: jax.Array, temb_bd: jax.Array) -> jax.Array:
        kw = {"dtype": self.dtype, "param_dtype": self.param_dtype}
        norm = {"num_groups": self.num_groups, "eps": self.eps, **kw}
        act = ACTIVATIONS[self.act_fn]
        h = act(GroupNorm(name="norm1", **norm)(x_bhwc))
        h = Conv2d(self.out_channels, name="conv1", **kw)(h)
        proj = dense(self.out_channels, ("embed", "conv_out"), "time_emb_proj", **kw)
        h = h + proj(act(temb_bd))[:, None, None, :]
        h = act(GroupNorm(name="norm2", **norm)(h))
        h = Conv2d(self.out_channels, name="conv2", **kw)(h)
        shortcut = x_bhwc.astype(self.dtype)
        if x_bhwc.shape[-1] != self.out_channels:
            shortcut = _conv1x1(self.out_channels, "conv_shortcut", kw)(shortcut)
        out = shortcut + h
        if self.output_scale_factor != 1:
            out = out / self.output_scale_factor
        return _constrain_image(out)


class Downsample(nn.Module):
    """diffusers ``Downsample2D(use_conv=True, padding=p)``: 3x3 stride-2 conv named ``conv``.

    ``p > 0`` pads every side by p; ``p == 0`` pads one zero row at the bottom and one column at
    the right (diffusers' ``F.pad(x, (0, 1, 0, 1))``).
    """

    channels: int
    padding: int = 1
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x_bhwc: jax.Array) -> jax.Array:
        p = self.padding
        pads = ((p, p), (p, p)) if p else ((0, 1), (0, 1))
        conv = Conv2d(
            self.channels,
            strides=(2, 2),
            padding=pads,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            name="conv",
        )
        return conv(x_bhwc)


def _nearest_indices(in_size: int, out_size: int) -> np.ndarray:
    """Source rows of torch ``F.interpolate(size=out, mode="nearest")`` along one axis:
    ``min(floor(i * (in / out)), in - 1)`` in float32, as ATen's ``nearest_idx`` computes it."""
    scale = np.float32(in_size) / np.float32(out_size)
    src = np.floor(np.arange(out_size, dtype=np.float32) * scale).astype(np.int64)
    return np.minimum(src, in_size - 1)


def _resize_nearest(x_bhwc: jax.Array, height: int, width: int) -> jax.Array:
    """Nearest-neighbour resize to ``height x width`` with torch's indices (x2 = repeat)."""
    for axis, out_size in ((1, height), (2, width)):
        in_size = x_bhwc.shape[axis]
        if out_size == 2 * in_size:
            x_bhwc = jnp.repeat(x_bhwc, 2, axis=axis)
        elif out_size != in_size:
            x_bhwc = jnp.take(x_bhwc, _nearest_indices(in_size, out_size), axis=axis)
    return x_bhwc


class Upsample(nn.Module):
    """diffusers ``Upsample2D(use_conv=True)``: nearest to ``size`` (the next skip's H, W; x2
    when sizes divide), then a 3x3 conv named ``conv``."""

    channels: int
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x_bhwc: jax.Array, size: tuple[int, int]) -> jax.Array:
        x = _resize_nearest(x_bhwc, *size)
        conv = Conv2d(self.channels, dtype=self.dtype, param_dtype=self.param_dtype, name="conv")
        return conv(x)


class Attention(nn.Module):
    """diffusers ``Attention`` as BasicTransformerBlock builds it: q/k/v without bias,
    ``to_out.0`` with bias; self-attention, or cross-attention to ``context_btc``."""

    heads: int
    head_dim: int
    upcast: bool = False
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    attention: str = "dot_product"
    mesh: jax.sharding.Mesh | None = None

    def _project(self, name: str, x, axes):
        inner = self.heads * self.head_dim
        # torch Linear(bias=False)
        y = Dense(
            inner, ("embed", "heads"), self.dtype, self.param_dtype, use_bias=False, name=name
        )(x)
        return sharding.constrain(y.reshape(*y.shape[:2], self.heads, self.head_dim), axes)

    @nn.compact
    def __call__(self, x_bld: jax.Array, context_btc: jax.Array | None = None) -> jax.Array:
        source, kv_axes = (
            (x_bld, _TOKEN_HEADS) if context_btc is None else (context_btc, _TEXT_HEADS)
        )
        q = self._project("to_q", x_bld, _TOKEN_HEADS)
        k = self._project("to_k", source, kv_axes)
        v = self._project("to_v", source, kv_axes)
        if self.upcast:
            q, k = q.astype(jnp.float32), k.astype(jnp.float32)
        out = attention_fn(q, k, v, backend=self.attention, mesh=self.mesh).astype(self.dtype)
        out = sharding.constrain(out, _TOKEN_HEADS).reshape(*x_bld.shape[:2], -1)
        out = dense(x_bld.shape[-1], ("heads", "embed"), "to_out_0", self.dtype, self.param_dtype)(
            out
        )
        return sharding.constrain(out, _TOKENS)


class GatedProjection(nn.Module):
    """GEGLU's ``proj``: ``[B, L, D] -> [B, L, 2, F]`` (index 0 = hidden, 1 = gate).

    Kernel ``[D, 2, F]``, bias ``[2, F]``: diffusers' ``[2F, D]`` Linear split into its two
    chunks, so ``mlp`` shards hidden and gate alike (see the module docstring).
    """

    features: int
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x_bld: jax.Array) -> jax.Array:
        init = nn.initializers.xavier_uniform(in_axis=0, out_axis=(1, 2))
        kernel = self.param(
            "kernel",
            nn.with_logical_partitioning(init, ("embed", None, "mlp")),
            (x_bld.shape[-1], 2, self.features),
            self.param_dtype,
        )
        bias = self.param(
            "bias",
            nn.with_logical_partitioning(nn.initializers.zeros_init(), (None, "mlp")),
            (2, self.features),
            self.param_dtype,
        )
        x, kernel, bias = (as_dtype(a, self.dtype) for a in (x_bld, kernel, bias))
        return dense_general(x, kernel, bias)  # [B, L, 2, F]


class GEGLU(nn.Module):
    """diffusers ``GEGLU``: ``hidden * gelu(gate)`` (exact erf GELU, torch's default)."""

    features: int
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x_bld: jax.Array) -> jax.Array:
        h = GatedProjection(self.features, self.dtype, self.param_dtype, name="proj")(x_bld)
        out = h[:, :, 0] * gelu_erf(h[:, :, 1])
        return sharding.constrain(out, _FF_HIDDEN)


class FeedForward(nn.Module):
    """diffusers ``FeedForward(activation_fn="geglu")``: ``net.0`` GEGLU to 4D, ``net.2`` back."""

    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x_bld: jax.Array) -> jax.Array:
        dim = x_bld.shape[-1]
        h = GEGLU(FF_MULT * dim, self.dtype, self.param_dtype, name="net_0")(x_bld)
        out = dense(dim, ("mlp", "embed"), "net_2", self.dtype, self.param_dtype)(h)
        return sharding.constrain(out, _TOKENS)


class BasicTransformerBlock(nn.Module):
    """diffusers ``BasicTransformerBlock`` (norm_type="layer_norm"): pre-norm self-attention,
    cross-attention and GEGLU feed-forward, each added back to the tokens."""

    heads: int
    head_dim: int
    upcast: bool = False
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    attention: str = "dot_product"
    mesh: jax.sharding.Mesh | None = None

    @nn.compact
    def __call__(self, x_bld: jax.Array, context_btc: jax.Array) -> jax.Array:
        kw = {"dtype": self.dtype, "param_dtype": self.param_dtype}
        attn = {
            "heads": self.heads,
            "head_dim": self.head_dim,
            "upcast": self.upcast,
            "attention": self.attention,
            "mesh": self.mesh,
            **kw,
        }
        x = x_bld + Attention(name="attn1", **attn)(LayerNorm(name="norm1", **kw)(x_bld))
        x = x + Attention(name="attn2", **attn)(LayerNorm(name="norm2", **kw)(x), context_btc)
        x = x + FeedForward(name="ff", **kw)(LayerNorm(name="norm3", **kw)(x))
        return sharding.constrain(x, _TOKENS)


class Transformer2D(nn.Module):
    """diffusers ``Transformer2DModel`` on an image: GroupNorm, ``proj_in`` (1x1 conv or linear),
    BasicTransformerBlocks over the H*W tokens, ``proj_out``, the input added back."""

    heads: int
    num_layers: int
    num_groups: int
    use_linear_projection: bool
    upcast: bool = False
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    attention: str = "dot_product"
    mesh: jax.sharding.Mesh | None = None
    remat_policy: str = "none"

    @nn.compact
    def __call__(self, x_bhwc: jax.Array, context_btc: jax.Array) -> jax.Array:
        b, h, w, c = x_bhwc.shape
        kw = {"dtype": self.dtype, "param_dtype": self.param_dtype}
        head_dim = c // self.heads  # diffusers: out_channels // num_attention_heads
        inner = self.heads * head_dim
        y = GroupNorm(self.num_groups, TRANSFORMER_GROUP_NORM_EPS, name="norm", **kw)(x_bhwc)
        if self.use_linear_projection:
            proj_in = dense(inner, ("conv_in", "embed"), "proj_in", **kw)
            tokens = proj_in(y.reshape(b, h * w, c))
        else:
            tokens = _conv1x1(inner, "proj_in", kw)(y).reshape(b, h * w, inner)
        tokens = sharding.constrain(tokens, _TOKENS)
        block_cls = remat_block(BasicTransformerBlock, self.remat_policy)
        for i in range(self.num_layers):
            block = block_cls(
                self.heads,
                head_dim,
                self.upcast,
                attention=self.attention,
                mesh=self.mesh,
                name=f"transformer_blocks_{i}",
                **kw,
            )
            tokens = block(tokens, context_btc)
        if self.use_linear_projection:
            out = dense(c, ("embed", "conv_out"), "proj_out", **kw)(tokens).reshape(b, h, w, c)
        else:
            out = _conv1x1(c, "proj_out", kw)(tokens.reshape(b, h, w, inner))
        return _constrain_image(out + x_bhwc.astype(self.dtype))


# ----------------------------------------------------------------------------------------------
# Blocks
# ----------------------------------------------------------------------------------------------


class _LevelBlock(nn.Module):
    """Shared fields of the down / mid / up blocks: the config and the level they build."""

    config: UNet2DConditionConfig
    level: int
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    attention: str = "dot_product"
    mesh: jax.sharding.Mesh | None = None
    remat_policy: str = "none"

    def _kw(self) -> dict:
        return {"dtype": self.dtype, "param_dtype": self.param_dtype}

    def _resnet(self, name: str, scale: float = 1.0) -> nn.Module:
        cfg = self.config
        return remat_block(ResnetBlock2D, self.remat_policy)(
            cfg.block_out_channels[self.level],
            cfg.norm_num_groups,
            cfg.norm_eps,
            cfg.act_fn,
            scale,
            name=name,
            **self._kw(),
        )

    def _transformer(self, name: str) -> Transformer2D:
        cfg = self.config
        return Transformer2D(
            cfg.heads_per_level[self.level],
            cfg.transformer_depth_per_level[self.level],
            cfg.norm_num_groups,
            cfg.use_linear_projection,
            cfg.upcast,
            attention=self.attention,
            mesh=self.mesh,
            remat_policy=self.remat_policy,
            name=name,
            **self._kw(),
        )


class DownBlock(_LevelBlock):
    """diffusers ``CrossAttnDownBlock2D`` / ``DownBlock2D``: (resnet [, transformer]) x n, then
    a Downsample2D on every level but the last. Returns the output and every state it leaves as
    a skip (after each layer, and after the downsampler)."""

    @nn.compact
    def __call__(self, x, temb, context):
        cfg = self.config
        with_attention = cfg.down_block_types[self.level] == CROSS_DOWN
        skips = []
        for j in range(cfg.resnets_per_level[self.level]):
            x = self._resnet(f"resnets_{j}")(x, temb)
            if with_attention:
                x = self._transformer(f"attentions_{j}")(x, context)
            skips.append(x)
        if self.level < cfg.num_levels - 1:
            channels = cfg.block_out_channels[self.level]
            down = Downsample(channels, cfg.downsample_padding, name="downsamplers_0", **self._kw())
            x = _constrain_image(down(x))
            skips.append(x)
        return x, skips


class MidBlock(_LevelBlock):
    """diffusers ``UNetMidBlock2DCrossAttn`` (num_layers=1): resnet, transformer, resnet, the
    resnets dividing by ``mid_block_scale_factor``."""

    @nn.compact
    def __call__(self, x, temb, context):
        scale = self.config.mid_block_scale_factor
        x = self._resnet("resnets_0", scale)(x, temb)
        x = self._transformer("attentions_0")(x, context)
        return self._resnet("resnets_1", scale)(x, temb)


class UpBlock(_LevelBlock):
    """diffusers ``CrossAttnUpBlock2D`` / ``UpBlock2D`` of ``level`` (up block ``L - 1 - level``):
    n + 1 times (concatenate the last skip, resnet [, transformer]), then an Upsample2D to the
    next skip's size on every up block but the last."""

    @nn.compact
    def __call__(self, x, skips, temb, context, upsample_size=None):
        cfg = self.config
        up_index = cfg.num_levels - 1 - self.level
        with_attention = cfg.up_block_types[up_index] == CROSS_UP
        for j, skip in enumerate(reversed(skips)):
            x = jnp.concatenate([x, skip.astype(x.dtype)], axis=-1)
            x = self._resnet(f"resnets_{j}")(x, temb)
            if with_attention:
                x = self._transformer(f"attentions_{j}")(x, context)
        if upsample_size is not None:
            channels = cfg.block_out_channels[self.level]
            x = Upsample(channels, name="upsamplers_0", **self._kw())(x, upsample_size)
            x = _constrain_image(x)
        return x


# ----------------------------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------------------------


class UNet2DConditionModel(nn.Module):
    """diffusers ``UNet2DConditionModel.forward``, parameters named as in diffusers
    (``name_3`` = ``name.3``).

    ``__call__(sample [B, C_in, H, W], timestep [B] or scalar, encoder_hidden_states [B, T,
    cross_attention_dim], text_embeds [B, P] | None, time_ids [B, K] | None) -> [B, C_out, H, W]``.

    ``text_embeds`` (the pooled text embedding) and ``time_ids`` (SDXL: original size, crop
    top-left, target size = 6 numbers) are diffusers' ``added_cond_kwargs``; they are required
    iff ``addition_embed_type="text_time"``, with ``P + K * addition_time_embed_dim ==
    projection_class_embeddings_input_dim``. Any H, W work (diffusers forwards the skip sizes to
    the upsamplers when they do not divide by 2 ** (levels - 1)).
    """

    config: UNet2DConditionConfig
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    attention: str = "dot_product"
    mesh: jax.sharding.Mesh | None = None
    remat_policy: str = "none"

    def _check_inputs(self, sample, timestep, context, text_embeds, time_ids) -> None:
        cfg = self.config
        if sample.ndim != 4 or sample.shape[1] != cfg.in_channels:
            raise ValueError(
                f"sample must be [B, in_channels={cfg.in_channels}, H, W], got {sample.shape}"
            )
        batch = sample.shape[0]
        if context.ndim != 3 or (context.shape[0], context.shape[2]) != (
            batch,
            cfg.cross_attention_dim,
        ):
            raise ValueError(
                f"encoder_hidden_states must be [{batch}, T, cross_attention_dim="
                f"{cfg.cross_attention_dim}], got {context.shape}"
            )
        if timestep.shape not in ((), (1,), (batch,)):
            raise ValueError(f"timestep must be [B]=[{batch}] or a scalar, got {timestep.shape}")
        self._check_added_cond(batch, text_embeds, time_ids)

    def _check_added_cond(self, batch, text_embeds, time_ids) -> None:
        cfg = self.config
        if cfg.addition_embed_type != TEXT_TIME:
            if text_embeds is not None or time_ids is not None:
                raise ValueError(
                    "text_embeds / time_ids were given but this UNet has addition_embed_type="
                    f"{cfg.addition_embed_type!r} (no added conditioning); pass None"
                )
            return
        if text_embeds is None or time_ids is None:
            raise ValueError(
                "text_embeds and time_ids are required: this UNet has addition_embed_type="
                "'text_time' (SDXL-like); pass the pooled text embedding and the size/crop ids"
            )
        shapes_ok = text_embeds.ndim == time_ids.ndim == 2
        if not shapes_ok or text_embeds.shape[0] != batch or time_ids.shape[0] != batch:
            raise ValueError(
                f"text_embeds must be [{batch}, P] and time_ids [{batch}, K], got "
                f"{text_embeds.shape} and {time_ids.shape}"
            )
        width = text_embeds.shape[1] + time_ids.shape[1] * cfg.addition_time_embed_dim
        if width != cfg.projection_class_embeddings_input_dim:
            raise ValueError(
                f"text_embeds width {text_embeds.shape[1]} + {time_ids.shape[1]} time ids x "
                f"addition_time_embed_dim={cfg.addition_time_embed_dim} = {width}, but "
                "projection_class_embeddings_input_dim="
                f"{cfg.projection_class_embeddings_input_dim}"
            )

    def _check_mesh(self, batch: int) -> None:
        if self.mesh is None:
            return
        sharding.check_divisible(self.mesh, batch=batch)
        for heads in sorted(set(self.config.heads_per_level)):
            sharding.check_divisible(self.mesh, heads=heads)

    def _embed_time(self, t_b, text_embeds_bp, time_ids_bk) -> jax.Array:
        """``t [B]`` (+ SDXL ``text_embeds [B, P]``, ``time_ids [B, K]``) -> ``temb [B, 4 C0]``.

        ``time_embedding`` of the sinusoidal ``t``; with ``text_time``, plus ``add_embedding`` of
        ``[text_embeds, flattened time-id embeddings]`` (float32 throughout).
        """
        cfg = self.config
        t_emb = sinusoidal_embedding(
            t_b, cfg.block_out_channels[0], cfg.flip_sin_to_cos, cfg.freq_shift
        )
        temb = _time_mlp(cfg, "time_embedding", cfg.act_fn, self.param_dtype)(t_emb)
        if cfg.addition_embed_type != TEXT_TIME:
            return temb
        batch, count = time_ids_bk.shape
        dim = cfg.addition_time_embed_dim
        ids_emb = sinusoidal_embedding(
            time_ids_bk.reshape(-1), dim, cfg.flip_sin_to_cos, cfg.freq_shift
        ).reshape(batch, count * dim)
        add = jnp.concatenate([text_embeds_bp.astype(jnp.float32), ids_emb], axis=-1)
        # diffusers builds add_embedding as TimestepEmbedding(...) without act_fn: always SiLU
        return temb + _time_mlp(cfg, "add_embedding", "silu", self.param_dtype)(add)

    def _block_kw(self) -> dict:
        return {
            "config": self.config,
            "dtype": self.dtype,
            "param_dtype": self.param_dtype,
            "attention": self.attention,
            "mesh": self.mesh,
            "remat_policy": self.remat_policy,
        }

    def _same_conv(self, features: int, kernel: int, name: str) -> Conv2d:
        """conv_in / conv_out: ``kernel x kernel`` with padding ``(kernel - 1) // 2``."""
        pad = (kernel - 1) // 2
        return Conv2d(
            features,
            (kernel, kernel),
            padding=((pad, pad), (pad, pad)),
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            name=name,
        )

    def _down_path(self, x, temb, context):
        """conv_in output through the down blocks and the mid block; returns (x, skips)."""
        skips = [x]
        for level in range(self.config.num_levels):
            block = DownBlock(level=level, name=f"down_blocks_{level}", **self._block_kw())
            x, level_skips = block(x, temb, context)
            skips += level_skips
        mid = MidBlock(level=self.config.num_levels - 1, name="mid_block", **self._block_kw())
        return mid(x, temb, context), skips

    def _up_path(self, x, skips, temb, context):
        """Up block i takes the last ``layers + 1`` skips (deepest first) and upsamples to the
        size of the skip the next up block starts with."""
        levels = self.config.num_levels
        for i in range(levels):
            level = levels - 1 - i
            n = self.config.resnets_per_level[level] + 1
            skips, level_skips = skips[:-n], skips[-n:]
            size = skips[-1].shape[1:3] if i < levels - 1 else None
            block = UpBlock(level=level, name=f"up_blocks_{i}", **self._block_kw())
            x = block(x, level_skips, temb, context, size)
        return x

    def _prepare(self, sample, timestep, encoder_hidden_states, text_embeds, time_ids):
        """Checked inputs -> (channel-last sample, time embedding, context)."""
        timestep = jnp.asarray(timestep)
        self._check_inputs(sample, timestep, encoder_hidden_states, text_embeds, time_ids)
        batch = sample.shape[0]
        self._check_mesh(batch)
        x = _constrain_image(jnp.transpose(sample, (0, 2, 3, 1)).astype(self.dtype))
        if self.config.center_input_sample:
            x = 2 * x - 1.0
        t_b = jnp.broadcast_to(timestep.astype(jnp.float32).reshape(-1), (batch,))
        temb = self._embed_time(t_b, text_embeds, time_ids)
        return x, temb, encoder_hidden_states.astype(self.dtype)

    @nn.compact
    def __call__(
        self,
        sample,
        timestep,
        encoder_hidden_states,
        text_embeds=None,
        time_ids=None,
        down_block_additional_residuals=None,
        mid_block_additional_residual=None,
    ):
        cfg = self.config
        x, temb, context = self._prepare(
            sample, timestep, encoder_hidden_states, text_embeds, time_ids
        )
        x = self._same_conv(cfg.block_out_channels[0], cfg.conv_in_kernel, "conv_in")(x)
        x, skips = self._down_path(x, temb, context)
        if down_block_additional_residuals is not None:
            x, skips = _with_residuals(
                x, skips, down_block_additional_residuals, mid_block_additional_residual
            )
        x = self._up_path(x, skips, temb, context)

        norm = GroupNorm(
            cfg.norm_num_groups,
            cfg.norm_eps,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            name="conv_norm_out",
        )
        x = ACTIVATIONS[cfg.act_fn](norm(x))
        x = self._same_conv(cfg.out_channels, cfg.conv_out_kernel, "conv_out")(x)
        return jnp.transpose(_constrain_image(x), (0, 3, 1, 2))


def _with_residuals(x_bhwc, skips, down_residuals, mid_residual):
    """ControlNet residuals (diffusers' ``down_block_additional_residuals`` /
    ``mid_block_additional_residual``, ``[B, C, H, W]`` each) added to the skips and to the
    mid block's output, as diffusers' forward adds them."""
    if mid_residual is None or len(down_residuals) != len(skips):
        raise ValueError(
            f"ControlNet residuals: {len(skips)} down residuals and a mid residual are needed, "
            f"got {len(down_residuals)} and {'one' if mid_residual is not None else 'none'}"
        )

    def channel_last(r):
        return jnp.transpose(r, (0, 2, 3, 1)).astype(x_bhwc.dtype)

    skips = [s + channel_last(r) for s, r in zip(skips, down_residuals, strict=True)]
    return x_bhwc + channel_last(mid_residual), skips


# ----------------------------------------------------------------------------------------------
# Weights: diffusers checkpoint <-> flax params
# ----------------------------------------------------------------------------------------------

# Module names that are list entries in diffusers (``resnets_0`` is ``resnets.0``); every other
# name (``linear_1``, ``norm1``, ``time_emb_proj``) is an attribute name as it stands.
_LIST_NAME = re.compile(
    r"^(down_blocks|up_blocks|resnets|attentions|transformer_blocks|downsamplers|upsamplers"
    r"|to_out|net|controlnet_down_blocks|blocks)_(\d+)$"
)


def _split_gated(w: np.ndarray) -> np.ndarray:
    """[..., 2F] -> [..., 2, F]; an indivisible tensor passes unchanged so the loader's shape
    check names the parameter."""
    if w.ndim == 0 or w.shape[-1] % 2:
        return w
    return w.reshape(*w.shape[:-1], 2, w.shape[-1] // 2)


def _merge_gated(w: np.ndarray) -> np.ndarray:
    return w.reshape(*w.shape[:-2], w.shape[-2] * w.shape[-1])


# ff.net.0.proj.weight [2F, D] -> kernel [D, 2, F]; .bias [2F] -> [2, F]
_GATED_KERNEL = weights.Invertible(lambda w: _split_gated(w.T), lambda k: _merge_gated(k).T)
_GATED_BIAS = weights.Invertible(_split_gated, _merge_gated)


def _diffusers_prefix(modules: Sequence[str]) -> str:
    return ".".join(_LIST_NAME.sub(r"\1.\2", m) for m in modules)


def _source_entry(path: tuple[str, ...], ndim: int) -> tuple[str, weights.Transform]:
    """Flax param path -> (diffusers key, transform)."""
    *modules, leaf = path
    key = _diffusers_prefix(modules)
    gated = modules[-1] == "proj" and modules[-2:-1] == ["net_0"]
    if leaf == "bias":
        return f"{key}.bias", _GATED_BIAS if gated else weights.identity
    if leaf == "scale":  # GroupNorm / LayerNorm weight
        return f"{key}.weight", weights.identity
    if leaf == "kernel" and gated and ndim == 3:
        return f"{key}.weight", _GATED_KERNEL
    if leaf == "kernel" and ndim in (2, 4):
        # 4-d: Conv2d [O, I, kh, kw]; 2-d: nn.Linear [O, I].
        return f"{key}.weight", weights.conv2d if ndim == 4 else weights.linear
    raise ValueError(f"no diffusers name for parameter {'/'.join(path)} ({ndim}-d)")


def _dummy_inputs(config: UNet2DConditionConfig, batch: int = 1) -> tuple:
    """Smallest valid inputs (one latent pixel per level, one text token) for init/eval_shape."""
    f32 = jnp.float32
    s = 2 ** (config.num_levels - 1)
    text_embeds = time_ids = None
    if config.addition_embed_type == TEXT_TIME:
        # one time id; the pooled width takes the rest of the projection input
        width = config.projection_class_embeddings_input_dim - config.addition_time_embed_dim
        text_embeds = jax.ShapeDtypeStruct((batch, width), f32)
        time_ids = jax.ShapeDtypeStruct((batch, 1), f32)
    return (
        jax.ShapeDtypeStruct((batch, config.in_channels, s, s), f32),
        jax.ShapeDtypeStruct((batch,), f32),
        jax.ShapeDtypeStruct((batch, 1, config.cross_attention_dim), f32),
        text_embeds,
        time_ids,
    )


# build / load / init / shape / count: one definition for every model (jaxcore.weights.ModelKind)
KIND = weights.ModelKind(
    UNet2DConditionModel,
    UNet2DConditionConfig,
    _dummy_inputs,
    lambda config, boxed: weights.weight_map_by_path(boxed, _source_entry),
)
abstract_params = KIND.abstract_params
load_unet_2d_condition = KIND.load  # a diffusers UNet2DConditionModel directory
init_unet_2d_condition = KIND.init
count_params = KIND.count_params


def weight_map(config: UNet2DConditionConfig) -> dict:
    """{flax param path: (diffusers UNet2DConditionModel key, transform)} for every parameter."""
    return KIND.weight_map(config, abstract_params(UNet2DConditionModel(config)))
