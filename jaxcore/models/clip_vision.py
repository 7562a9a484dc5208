"""CLIP vision encoder (Wan 2.1 image-to-video's image encoder, CLIP ViT-H/14) in Flax linen.

Reference: transformers ``CLIPVisionModel`` and ``CLIPVisionModelWithProjection``
(``transformers/models/clip/modeling_clip.py``). What this file reproduces:

- patch embedding: a bias-free Conv2d with kernel = stride = ``patch_size`` (pixels past the
  last whole patch are dropped, as the convolution drops them), tokens in row-major order;
- a learned class token prepended, then learned absolute position embeddings. Without
  ``interpolate_pos_encoding`` (transformers' default) the image must be exactly
  ``image_size`` square. With it, the patch position table is resized by torch's bicubic
  (A = -0.75, align_corners=False, border-clamped) to the image's patch grid, unless the grid
  already has the table's size and the image is square (transformers' shortcut);
- ``pre_layrnorm`` (transformers' spelling), then the text tower's pre-LayerNorm blocks
  (:class:`jaxcore.models.clip_text.CLIPBlock`) with no attention mask;
- ``hidden_states``: the pre-normed embeddings, then each block's output (transformers'
  ``output_hidden_states=True``); ``last_hidden_state`` is the last block's output, NOT normed;
- ``pooler_output``: ``post_layernorm`` of the class token of ``last_hidden_state``;
- ``image_embeds``: the bias-free ``visual_projection`` of the pooled output (with projection).

Wan 2.1 I2V (diffusers ``WanImageToVideoPipeline.encode_image``) uses ``hidden_states[-2]``,
the penultimate block's output: ``hidden_layer=-2`` (:data:`WAN_I2V_HIDDEN_LAYER`) runs only
the blocks that state needs and returns it alone.

Parameters use the logical axis names of :mod:`jaxcore.sharding`; :func:`weight_map` maps them
from the transformers state-dict keys (``vision_model.*`` as hub checkpoints and
``CLIPVisionModelWithProjection`` store them, or without the prefix as transformers 5 saves a
``CLIPVisionModel``; ``visual_projection.weight`` never has one).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from jaxcore import sharding, weights
from jaxcore.models import clip_text
from jaxcore.models.clip_text import (
    CLIPBlock,
    encoder_layer_map,
    layer_norm,
    norm_map,
    projection_layer,
)

# --- config ------------------------------------------------------------------------------------

MODEL_TYPE = "clip_vision_model"
# The text tower's bookkeeping keys, plus the token ids that transformers 4 dumped into every
# sub-config (the vision tower has no tokens).
IGNORED_CONFIG_KEYS = clip_text.IGNORED_CONFIG_KEYS | frozenset(
    ("bos_token_id", "eos_token_id", "pad_token_id")
)
# diffusers' WanImageToVideoPipeline.encode_image takes hidden_states[-2].
WAN_I2V_HIDDEN_LAYER = -2


class CLIPVisionConfigError(ValueError):
    """A config.json that CLIPVisionConfig cannot represent; the message names the key."""


@dataclasses.dataclass(frozen=True)
class CLIPVisionConfig:
    """CLIP vision-tower architecture; field names follow transformers' ``config.json``.

    Defaults are transformers' ``CLIPVisionConfig`` defaults (clip-vit-base-patch32). Wan 2.1
    I2V's image encoder (OpenCLIP ViT-H/14): hidden 1280, intermediate 5120, 32 layers,
    16 heads, image 224, patch 14, gelu, projection_dim 1024. ``projection_dim`` matters only
    with a projection (see ``CLIPVisionEncoder.with_projection``).
    """

    hidden_size: int = 768
    intermediate_size: int = 3072
    projection_dim: int | None = 512
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_channels: int = 3
    image_size: int = 224
    patch_size: int = 32
    hidden_act: str = "quick_gelu"
    layer_norm_eps: float = 1e-5

    def __post_init__(self):
        clip_text.check_encoder_config(
            self, CLIPVisionConfigError, extra_positive=("num_channels", "image_size", "patch_size")
        )
        if self.patch_size > self.image_size:
            raise CLIPVisionConfigError(
                f"CLIPVisionConfig.patch_size {self.patch_size} exceeds image_size "
                f"{self.image_size}"
            )
        clip_text.check_projection_dim(self, CLIPVisionConfigError)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def grid_size(self) -> int:
        """Patches per side of an ``image_size`` image (the position table's grid)."""
        return self.image_size // self.patch_size

    @property
    def num_positions(self) -> int:
        """Rows of the position table: the class token and ``grid_size ** 2`` patches."""
        return self.grid_size**2 + 1

    @classmethod
    def from_dict(cls, raw: Mapping[str, object]) -> CLIPVisionConfig:
        """Build from a transformers ``config.json`` dict (a ``CLIPVisionModel[WithProjection]``).

        ``model_type`` must be ``clip_vision_model`` when present (a full ``CLIPModel`` config
        is an error: pass its ``vision_config``). Keys starting with ``_`` and those in
        ``IGNORED_CONFIG_KEYS`` are skipped; any other unknown key is an error naming it.
        """
        kwargs = clip_text.config_kwargs(
            cls,
            raw,
            model_type=MODEL_TYPE,
            sub_config="vision_config",
            ignored=IGNORED_CONFIG_KEYS,
            error=CLIPVisionConfigError,
        )
        return cls(**kwargs)

    def to_dict(self) -> dict[str, object]:
        """The transformers ``config.json`` fields of this config (with its model_type)."""
        return {"model_type": MODEL_TYPE, **dataclasses.asdict(self)}


# architectures entry -> whether that class has a visual_projection.
ARCHITECTURES = {"CLIPVisionModel": False, "CLIPVisionModelWithProjection": True}


# --- output ------------------------------------------------------------------------------------


@flax.struct.dataclass
class CLIPVisionOutput:
    """``last_hidden_state`` [B, 1 + N, E] (last block, not normed); ``pooler_output`` [B, E]
    (post-normed class token); ``hidden_states``: tuple of num_hidden_layers + 1 arrays
    [B, 1 + N, E] (pre-normed embeddings, then each block); ``image_embeds``
    [B, projection_dim] or None. N = number of patches, token 0 = class token."""

    last_hidden_state: jax.Array
    pooler_output: jax.Array
    hidden_states: tuple[jax.Array, ...]
    image_embeds: jax.Array | None = None


# --- embeddings --------------------------------------------------------------------------------


def patch_grid(height: int, width: int, patch_size: int) -> tuple[int, int]:
    """Patches per column and per row (the convolution floors: partial patches are dropped)."""
    if height < patch_size or width < patch_size:
        raise ValueError(f"image {height}x{width} is smaller than one {patch_size}px patch")
    return height // patch_size, width // patch_size


def patchify(pixels_bchw: jax.Array, patch_size: int) -> jax.Array:
    """[B, C, H, W] -> [B, H', W', p, p, C]: each patch's contents, channel-last."""
    batch, channels, height, width = pixels_bchw.shape
    gh, gw = patch_grid(height, width, patch_size)
    x = pixels_bchw[:, :, : gh * patch_size, : gw * patch_size]
    x = x.reshape(batch, channels, gh, patch_size, gw, patch_size)
    return x.transpose(0, 2, 4, 3, 5, 1)


def _cubic_weights(t: float, a: float = -0.75) -> tuple[float, float, float, float]:
    """torch's ``get_cubic_upsample_coefficients`` (Keys' cubic convolution, A = -0.75)."""

    def near(x):  # |x| <= 1
        return ((a + 2) * x - (a + 3)) * x * x + 1

    def far(x):  # 1 < |x| < 2
        return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a

    return far(t + 1), near(t), near(1 - t), far(2 - t)


@functools.cache
def bicubic_matrix(in_size: int, out_size: int) -> np.ndarray:
    """[out, in] float32: torch ``interpolate(mode="bicubic", align_corners=False)`` along one
    axis as a matrix (source index ``(i + 0.5) * in/out - 0.5``, taps clamped to the border)."""
    matrix = np.zeros((out_size, in_size), np.float64)
    scale = in_size / out_size
    for i in range(out_size):
        source = scale * (i + 0.5) - 0.5
        base = math.floor(source)
        for k, w in enumerate(_cubic_weights(source - base)):
            matrix[i, min(max(base - 1 + k, 0), in_size - 1)] += w
    return matrix.astype(np.float32)


def interpolate_positions(
    position_table: jax.Array, grid: tuple[int, int], height: int, width: int
) -> jax.Array:
    """The [1 + N, E] position embeddings for an image of ``height`` x ``width`` pixels on a
    patch ``grid``, as transformers' ``CLIPVisionEmbeddings.interpolate_pos_encoding``."""
    num_positions = position_table.shape[0] - 1
    side = math.isqrt(num_positions)
    if side * side != num_positions:
        raise ValueError(f"position table of {num_positions} patches is not a square grid")
    if grid[0] * grid[1] == num_positions and height == width:
        return position_table  # transformers' shortcut: no resampling
    patch_pos = position_table[1:].reshape(side, side, -1)
    rows = jnp.asarray(bicubic_matrix(side, grid[0]))
    cols = jnp.asarray(bicubic_matrix(side, grid[1]))
    resized = jnp.einsum(
        "yh,hwe,xw->yxe", rows, patch_pos.astype(jnp.float32), cols, precision="highest"
    )
    resized = resized.reshape(grid[0] * grid[1], -1).astype(position_table.dtype)
    return jnp.concatenate([position_table[:1], resized], axis=0)


# --- model -------------------------------------------------------------------------------------


def _normal(stddev: float):
    return nn.initializers.normal(stddev=stddev)


def normalize_layer(hidden_layer: int, num_hidden_layers: int) -> int:
    """``hidden_layer`` as an index 0..num_hidden_layers into ``hidden_states`` (negative
    values count from the end, as Python indexing: -1 = last block, -2 = penultimate)."""
    count = num_hidden_layers + 1
    if not isinstance(hidden_layer, int) or not -count <= hidden_layer < count:
        raise ValueError(
            f"hidden_layer {hidden_layer!r} is not an index into {count} hidden states"
        )
    return hidden_layer % count


class CLIPVisionEncoder(nn.Module):
    """CLIP vision tower; ``__call__(pixel_values) -> CLIPVisionOutput``.

    ``with_projection``: ``CLIPVisionModelWithProjection`` (adds ``visual_projection`` and
    ``image_embeds``) instead of ``CLIPVisionModel``.
    """

    config: CLIPVisionConfig
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32
    with_projection: bool = False
    mesh: jax.sharding.Mesh | None = None

    @nn.compact
    def __call__(
        self,
        pixel_values: jax.Array,
        *,
        interpolate_pos_encoding: bool = False,
        hidden_layer: int | None = None,
    ) -> CLIPVisionOutput | jax.Array:
        """pixel_values [B, C, H, W] (normalized, as ``CLIPImageProcessor`` gives them).

        ``hidden_layer`` None: the full :class:`CLIPVisionOutput`. An int: only
        ``hidden_states[hidden_layer]`` [B, 1 + N, E], computing no block past it (Wan I2V:
        ``-2``). Both keywords are static: bind them (``functools.partial``) before ``jit``.
        """
        c = self.config
        self._check_pixels(pixel_values, interpolate_pos_encoding)
        stop = c.num_hidden_layers
        if hidden_layer is not None:
            stop = normalize_layer(hidden_layer, c.num_hidden_layers)
        x_ble = self._embed(pixel_values, interpolate_pos_encoding)
        hidden_states = [x_ble]
        for i in range(stop):
            x_ble = CLIPBlock(c, self.dtype, self.param_dtype, name=f"block_{i}")(x_ble, None)
            hidden_states.append(x_ble)
        if hidden_layer is not None:
            return x_ble
        pooled_be = layer_norm(c.layer_norm_eps, self.dtype, self.param_dtype, "post_norm")(
            x_ble[:, 0]
        )
        image_embeds = None
        if self.with_projection:
            projection = projection_layer(c, self.dtype, self.param_dtype, "visual_projection")
            image_embeds = projection(pooled_be)
        return CLIPVisionOutput(
            last_hidden_state=x_ble,
            pooler_output=pooled_be,
            hidden_states=tuple(hidden_states),
            image_embeds=image_embeds,
        )

    def _check_pixels(self, pixel_values: jax.Array, interpolate_pos_encoding: bool) -> None:
        """Raise naming what does not fit: the image's shape, or (without
        ``interpolate_pos_encoding``) its size."""
        c = self.config
        if self.with_projection and c.projection_dim is None:
            raise CLIPVisionConfigError("with_projection needs CLIPVisionConfig.projection_dim")
        if pixel_values.ndim != 4 or pixel_values.shape[1] != c.num_channels:
            raise ValueError(
                f"pixel_values must be [batch, {c.num_channels}, height, width], "
                f"got shape {pixel_values.shape}"
            )
        height, width = pixel_values.shape[2:]
        if not interpolate_pos_encoding and (height != c.image_size or width != c.image_size):
            raise ValueError(
                f"input image size ({height}*{width}) doesn't match the model "
                f"({c.image_size}*{c.image_size}); pass interpolate_pos_encoding=True to resize "
                "the position embeddings"
            )

    def _embed(self, pixel_values: jax.Array, interpolate_pos_encoding: bool) -> jax.Array:
        """[B, 1 + N, E]: the class token, then the patches, plus their positions, pre-normed
        (transformers' ``CLIPVisionEmbeddings`` and ``pre_layrnorm``)."""
        c = self.config
        kernel = self.param(
            "patch_embedding",
            nn.with_logical_partitioning(_normal(0.02), (None, None, "conv_in", "embed")),
            (c.patch_size, c.patch_size, c.num_channels, c.hidden_size),
            self.param_dtype,
        )
        class_embedding = self.param(
            "class_embedding",
            nn.with_logical_partitioning(_normal(c.hidden_size**-0.5), ("embed",)),
            (c.hidden_size,),
            self.param_dtype,
        )
        position_table = self.param(
            "position_embedding",
            nn.with_logical_partitioning(_normal(0.02), (None, "embed")),
            (c.num_positions, c.hidden_size),
            self.param_dtype,
        )
        height, width = pixel_values.shape[2:]
        grid = patch_grid(height, width, c.patch_size)
        patches = patchify(pixel_values.astype(self.dtype), c.patch_size)
        patch_bye = jnp.einsum("byxhwc,hwce->byxe", patches, kernel.astype(self.dtype))
        patch_ble = patch_bye.reshape(patch_bye.shape[0], grid[0] * grid[1], c.hidden_size)
        cls_b1e = jnp.broadcast_to(
            class_embedding.astype(self.dtype), (patch_ble.shape[0], 1, c.hidden_size)
        )
        if interpolate_pos_encoding:
            positions = interpolate_positions(position_table, grid, height, width)
        else:
            positions = position_table
        x_ble = jnp.concatenate([cls_b1e, patch_ble], axis=1) + positions.astype(self.dtype)
        x_ble = layer_norm(c.layer_norm_eps, self.dtype, self.param_dtype, "pre_norm")(x_ble)
        return sharding.constrain(
            x_ble, ("activation_batch", "activation_length", "activation_embed")
        )


def encode_fn(
    module: CLIPVisionEncoder,
    *,
    hidden_layer: int | None = WAN_I2V_HIDDEN_LAYER,
    interpolate_pos_encoding: bool = False,
):
    """A jitted ``(params, pixel_values) -> hidden_states[hidden_layer]`` (Wan I2V's image
    context with the default ``-2``), or ``-> CLIPVisionOutput`` with ``hidden_layer=None``."""

    def encode(params, pixel_values):
        return module.apply(
            {"params": params},
            pixel_values,
            interpolate_pos_encoding=interpolate_pos_encoding,
            hidden_layer=hidden_layer,
        )

    return jax.jit(encode)


# --- weights ---------------------------------------------------------------------------------

# Hub checkpoints (transformers 4, and CLIPVisionModelWithProjection) hold the tower under
# "vision_model."; transformers 5 saves a bare CLIPVisionModel without it.
PREFIXES = ("vision_model.", "")
PROJECTION_KEY = "visual_projection.weight"


def weight_map(
    config: CLIPVisionConfig, with_projection: bool = False, prefix: str = "vision_model."
) -> dict:
    """Flax param path -> (transformers key, transform) for ``weights.load_params``.

    ``prefix``: ``"vision_model."`` (hub layout) or ``""`` (a CLIPVisionModel saved by
    transformers 5); ``visual_projection.weight`` never has one.
    """
    if prefix not in PREFIXES:
        raise ValueError(f"prefix must be one of {PREFIXES}, got {prefix!r}")
    embeddings = f"{prefix}embeddings"
    mapping = {
        ("patch_embedding",): (f"{embeddings}.patch_embedding.weight", weights.conv2d),
        ("class_embedding",): (f"{embeddings}.class_embedding", weights.identity),
        ("position_embedding",): (f"{embeddings}.position_embedding.weight", weights.identity),
        **norm_map(("pre_norm",), f"{prefix}pre_layrnorm"),
        **norm_map(("post_norm",), f"{prefix}post_layernorm"),
    }
    for i in range(config.num_hidden_layers):
        mapping.update(encoder_layer_map(config, f"{prefix}encoder.layers.{i}", f"block_{i}"))
    if with_projection:
        mapping[("visual_projection", "kernel")] = (PROJECTION_KEY, weights.linear)
    return mapping


def _dummy_inputs(config: CLIPVisionConfig) -> tuple:
    size = config.image_size
    return (jax.ShapeDtypeStruct((1, config.num_channels, size, size), jnp.float32),)


# build / load / init / shape / count, as the text tower's (clip_text.TowerKind)
TOWER = clip_text.TowerKind(
    CLIPVisionEncoder,
    CLIPVisionConfig,
    _dummy_inputs,
    weight_map,
    PREFIXES,
    "post_layernorm.weight",
    PROJECTION_KEY,
    ARCHITECTURES,
    "CLIP vision",
)
abstract_variables = TOWER.abstract_variables
count_params = TOWER.count_params
init_clip_vision = TOWER.init
# A transformers CLIPVisionModel[WithProjection] directory, e.g. a Wan 2.1 I2V pipeline's
# ``image_encoder``; with_projection=False loads only the vision model of a checkpoint with
# projection (what diffusers' CLIPVisionModel does with Wan's). Call ``encode_fn(module)``.
load_clip_vision = TOWER.load
