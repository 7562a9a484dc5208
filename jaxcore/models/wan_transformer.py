"""Wan 2.1 / 2.2 diffusion transformer (DiT) in Flax linen.

Reference: diffusers ``WanTransformer3DModel`` (diffusers/models/transformers/transformer_wan.py,
diffusers 0.42). Same function, same parameters (loaded from a diffusers checkpoint through
:func:`weight_map`), written as JAX code:

- 3D patch embedding (a Conv3d whose stride equals its kernel, done as a reshape + contraction),
- 3D rotary embedding with the head dim split over frames / height / width as
  ``WanRotaryPosEmbed`` does,
- sinusoidal time embedding (cos first) -> MLP -> a 6-way modulation per block,
- a GELU-tanh text projection,
- blocks: modulated LayerNorm -> self-attention (RMS-norm on q and k across all heads, RoPE)
  -> gated residual; LayerNorm (affine) -> cross-attention to the text -> residual;
  modulated LayerNorm -> GELU-tanh FFN -> gated residual,
- output LayerNorm modulated by the model's ``scale_shift_table``, ``proj_out``, unpatchify.

Variants, all chosen by the config (diffusers' config.json names):

- Wan 2.1 T2V, Wan 2.2 T2V/I2V A14B (one expert each): the above. Image-to-video models without
  CLIP conditioning (Wan 2.2 I2V) only differ in ``in_channels`` (latents + mask + image latents).
- Wan 2.1 I2V / FLF2V (``image_dim`` and ``added_kv_proj_dim``, both or neither): CLIP image
  states ``encoder_hidden_states_image`` [B, 257, image_dim] go through ``WanImageEmbedding``
  (FP32 LayerNorm -> Linear -> GELU (erf) -> Linear -> FP32 LayerNorm, eps 1e-5) and every
  block's cross-attention attends to them with its own ``add_k_proj`` / ``add_v_proj`` /
  ``norm_added_k`` and the text query; the two attention outputs are summed before ``to_out``.
  FLF2V (``pos_embed_seq_len`` = 2 x 257) takes first- and last-frame states stacked along the
  batch, [2B, 257, image_dim] (sample b's frames at rows 2b, 2b + 1, as diffusers' pipeline
  repeats them), regroups them into [B, 514, image_dim] and adds a learnt position embedding;
  the regrouped layout [B, 514, image_dim] (first frame's tokens, then the last frame's) is
  accepted as input too (diffusers' forward rejects it).
- Wan 2.2 TI2V 5B (``expand_timesteps``): ``timestep`` may be [B, L], one per patch token; the
  time embedding, every block's modulation and the output modulation are then per token.

Where this differs from diffusers: diffusers concatenates the image tokens before the text and
``WanAttnProcessor`` splits them again assuming exactly 512 text tokens (the UMT5 length Wan's
pipelines always pad to); here the two are kept apart, so the result equals diffusers' when the
text has 512 tokens and stays the intended one (image tokens to the image projections, text to
the text projections) for other lengths, where diffusers mixes them up.

Public tensors use the diffusers layout (video ``[B, C, F, H, W]``); inside, tokens are
``[B, L, D]`` with L = F' * H' * W' in (frame, height, width) order.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from jax.ad_checkpoint import checkpoint_name

from jaxcore import compute, sharding, weights
from jaxcore.attention import attention as attention_fn
from jaxcore.compute import BLOCK_INPUT, remat_block
from jaxcore.config import config_json_kwargs
from jaxcore.models.layers import (
    MLP2,
    AffineLayerNorm,
    RMSNorm,
    apply_rope,
    dense,
    gated_add,
    gelu_erf,
    gelu_tanh,
    layer_norm,
    projection,
    scale_shift,
    timestep_embedding,
)
from jaxcore.quantization import as_dtype, reshape_kernel

Dtype = Any

# ----------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------

SUPPORTED_QK_NORM = "rms_norm_across_heads"


class WanConfigError(ValueError):
    """A config.json / YAML section that WanTransformerConfig cannot represent; names the key."""


@dataclasses.dataclass(frozen=True)
class WanTransformerConfig:
    """Architecture of a Wan 2.1 / 2.2 transformer; field names follow diffusers' config.json."""

    patch_size: tuple[int, int, int] = (1, 2, 2)
    num_attention_heads: int = 40
    attention_head_dim: int = 128
    in_channels: int = 16
    out_channels: int = 16
    text_dim: int = 4096
    freq_dim: int = 256
    ffn_dim: int = 13824
    num_layers: int = 40
    cross_attn_norm: bool = True
    qk_norm: str | None = SUPPORTED_QK_NORM
    eps: float = 1e-6
    image_dim: int | None = None
    added_kv_proj_dim: int | None = None
    rope_max_seq_len: int = 1024
    pos_embed_seq_len: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "patch_size", tuple(int(p) for p in self.patch_size))
        if len(self.patch_size) != 3 or min(self.patch_size) < 1:
            raise WanConfigError(f"patch_size must be 3 positive ints, got {self.patch_size}")
        if self.qk_norm != SUPPORTED_QK_NORM:
            raise WanConfigError(
                f"qk_norm={self.qk_norm!r} is not supported; only {SUPPORTED_QK_NORM!r}"
            )
        if self.attention_head_dim % 2:
            raise WanConfigError(
                f"attention_head_dim={self.attention_head_dim} must be even for rotary embedding"
            )
        for key in (
            "num_attention_heads",
            "attention_head_dim",
            "in_channels",
            "out_channels",
            "text_dim",
            "freq_dim",
            "ffn_dim",
            "num_layers",
            "rope_max_seq_len",
        ):
            if int(getattr(self, key)) < 1:
                raise WanConfigError(f"{key} must be >= 1, got {getattr(self, key)!r}")
        self._check_image_conditioning()

    def _check_image_conditioning(self) -> None:
        """image_dim and added_kv_proj_dim come together (Wan 2.1 I2V / FLF2V), as in every
        released checkpoint. diffusers builds a model with one of them, but then the image tokens
        go through the text projections (image_dim alone) or the added projections get no
        tokens (added_kv_proj_dim alone, 512 text tokens): refused here rather than copied."""
        image, added = self.image_dim, self.added_kv_proj_dim
        if (image is None) != (added is None):
            given, missing = ("image_dim", "added_kv_proj_dim")
            if image is None:
                given, missing = missing, given
            raise WanConfigError(
                f"{given}={getattr(self, given)!r} needs {missing} too: image conditioning "
                "(Wan 2.1 I2V / FLF2V) sets both image_dim and added_kv_proj_dim, "
                "text-to-video neither"
            )
        if self.pos_embed_seq_len is not None:
            if image is None:
                raise WanConfigError(
                    f"pos_embed_seq_len={self.pos_embed_seq_len!r} needs image conditioning "
                    "(image_dim and added_kv_proj_dim): it is the FLF2V image position embedding"
                )
            if self.pos_embed_seq_len < 2 or self.pos_embed_seq_len % 2:
                raise WanConfigError(
                    f"pos_embed_seq_len={self.pos_embed_seq_len!r} must be a positive even "
                    "number: the tokens of two images (first and last frame), 2 x 257 in Wan FLF2V"
                )
        if image is None:
            return
        if int(image) < 1:
            raise WanConfigError(f"image_dim must be >= 1, got {image!r}")
        if added != self.hidden_dim:
            raise WanConfigError(
                f"added_kv_proj_dim={added!r} must equal the model width num_attention_heads x "
                f"attention_head_dim = {self.hidden_dim}: add_k_proj / add_v_proj read the "
                "image embedder's output, which has the model width"
            )

    @property
    def image_conditioning(self) -> bool:
        """Wan 2.1 I2V / FLF2V: the model takes CLIP image states (``image_dim`` set)."""
        return self.image_dim is not None

    @property
    def hidden_dim(self) -> int:
        """Model width D = heads x head dim (diffusers' ``inner_dim``)."""
        return self.num_attention_heads * self.attention_head_dim

    @property
    def patch_volume(self) -> int:
        return math.prod(self.patch_size)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> WanTransformerConfig:
        """Build from a diffusers config.json dict (``_``-prefixed keys ignored)."""
        kwargs = config_json_kwargs(cls, d, WanConfigError)
        if kwargs.get("out_channels") is None and "in_channels" in kwargs:
            # diffusers: ``out_channels = out_channels or in_channels``
            kwargs["out_channels"] = kwargs["in_channels"]
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["patch_size"] = list(self.patch_size)
        return d


# ----------------------------------------------------------------------------------------------
# Pure helpers: time embedding, rotary embedding, patchify
# ----------------------------------------------------------------------------------------------


def rope_axis_dims(head_dim: int) -> tuple[int, int, int]:
    """How WanRotaryPosEmbed splits the head dim: (frames, height, width)."""
    hw = 2 * (head_dim // 6)
    return head_dim - 2 * hw, hw, hw


def _rope_angles_1d(dim: int, positions: int, theta: float) -> np.ndarray:
    """Angles [positions, dim/2] = pos * theta^(-2i/dim), in float64 like diffusers."""
    inv_freq = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    return np.outer(np.arange(positions, dtype=np.float64), inv_freq)


def rope_cos_sin(
    grid: tuple[int, int, int], head_dim: int, max_seq_len: int, theta: float = 10000.0
) -> tuple[jax.Array, jax.Array]:
    """cos/sin tables [L, head_dim/2] (float32) for a (frames, height, width) token grid.

    Each pair (2i, 2i+1) of the head dim rotates by one angle; the pairs are split into a
    frame part, a height part and a width part (diffusers WanRotaryPosEmbed). The small
    per-axis tables are computed on the host in float64 and rounded to float32, as diffusers
    does; only their broadcast to the token grid happens in the graph, so a 75k-token video
    does not embed a large constant.
    """
    for axis, n in zip(("frames", "height", "width"), grid, strict=True):
        if n > max_seq_len:
            raise ValueError(
                f"{n} latent {axis} after patching exceed rope_max_seq_len={max_seq_len}"
            )
    f, h, w = grid
    axis_angles = [
        _rope_angles_1d(dim, n, theta)
        for dim, n in zip(rope_axis_dims(head_dim), grid, strict=True)
    ]
    expand = (
        lambda t: t[:, None, None, :],
        lambda t: t[None, :, None, :],
        lambda t: t[None, None, :, :],
    )

    def table(fn: Callable[[np.ndarray], np.ndarray]) -> jax.Array:
        parts = [
            jnp.broadcast_to(put(jnp.asarray(fn(a).astype(np.float32))), (f, h, w, a.shape[-1]))
            for put, a in zip(expand, axis_angles, strict=True)
        ]
        return jnp.concatenate(parts, axis=-1).reshape(f * h * w, head_dim // 2)

    return table(np.cos), table(np.sin)


def patch_grid(video_shape: tuple[int, ...], patch_size: tuple[int, int, int]) -> tuple[int, ...]:
    """(F', H', W') token grid of a [B, C, F, H, W] video; errors if a side does not divide."""
    if len(video_shape) != 5:
        raise ValueError(f"hidden_states must be [B, C, F, H, W], got shape {tuple(video_shape)}")
    grid = []
    for axis, n, p in zip(("frames", "height", "width"), video_shape[2:], patch_size, strict=True):
        if n % p:
            raise ValueError(f"hidden_states {axis}={n} is not divisible by patch size {p}")
        grid.append(n // p)
    return tuple(grid)


def patchify(video_bcfhw: jax.Array, patch_size: tuple[int, int, int]) -> jax.Array:
    """[B, C, F, H, W] -> [B, F', H', W', pt, ph, pw, C] (patch contents channel-last)."""
    b, c = video_bcfhw.shape[:2]
    (f, h, w), (pt, ph, pw) = patch_grid(video_bcfhw.shape, patch_size), patch_size
    x = video_bcfhw.reshape(b, c, f, pt, h, ph, w, pw)
    return x.transpose(0, 2, 4, 6, 3, 5, 7, 1)


def unpatchify(
    tokens_blp: jax.Array, grid: tuple[int, int, int], patch_size: tuple[int, int, int]
) -> jax.Array:
    """[B, L, pt*ph*pw*C] (patch-major, channel-last) -> [B, C, F, H, W], as diffusers."""
    b = tokens_blp.shape[0]
    (f, h, w), (pt, ph, pw) = grid, patch_size
    x = tokens_blp.reshape(b, f, h, w, pt, ph, pw, -1)
    x = x.transpose(0, 7, 1, 4, 2, 5, 3, 6)
    return x.reshape(b, x.shape[1], f * pt, h * ph, w * pw)


# ----------------------------------------------------------------------------------------------
# Layers
# ----------------------------------------------------------------------------------------------

_BATCH_LENGTH_EMBED = ("activation_batch", "activation_length", "activation_embed")
_TEXT_EMBED = ("activation_batch", "activation_kv_length", "activation_embed")
_BATCH_LENGTH_HEADS = ("activation_batch", "activation_length", "activation_heads", "activation_kv")
_TEXT_HEADS = ("activation_batch", "activation_kv_length", "activation_heads", "activation_kv")
# per-token modulation (Wan 2.2 TI2V): [B, L, 6, D]
_BATCH_LENGTH_MOD_EMBED = ("activation_batch", "activation_length", None, "activation_embed")

# diffusers' FP32LayerNorm default, used by WanImageEmbedding whatever the config's eps
IMAGE_NORM_EPS = 1e-5


def _modulation_table(module: nn.Module, rows: int, dim: int, param_dtype: Dtype) -> jax.Array:
    """The learnt ``scale_shift_table`` [1, rows, D] added to the time projection."""
    init = nn.initializers.normal(stddev=dim**-0.5)
    return module.param(
        "scale_shift_table",
        nn.with_logical_partitioning(init, (None, "modulation", "embed")),
        (1, rows, dim),
        param_dtype,
    )


def _affine_layer_norm(name: str, eps: float, param_dtype: Dtype) -> AffineLayerNorm:
    """LayerNorm with weight and bias, computed in float32 (diffusers' FP32LayerNorm)."""
    return AffineLayerNorm(eps=eps, dtype=jnp.float32, param_dtype=param_dtype, name=name)


class ImageEmbedder(nn.Module):
    """CLIP image states -> image tokens [B, S', D] (diffusers ``WanImageEmbedding``).

    FP32 LayerNorm -> Linear(image_dim, image_dim) -> GELU (erf) -> Linear(image_dim, D) ->
    FP32 LayerNorm, both norms with eps 1e-5. With ``pos_embed_seq_len`` P (FLF2V) the input is
    [2B, P/2, image_dim], consecutive rows (first frame, last frame) regrouped into
    [B, P, image_dim] (diffusers' ``view(-1, 2 * seq_len, dim)``), or already [B, P, image_dim];
    the learnt ``pos_embed`` is added first.
    """

    config: WanTransformerConfig
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, image_bse: jax.Array) -> jax.Array:
        cfg = self.config
        x = image_bse.astype(jnp.float32)
        if cfg.pos_embed_seq_len is not None:
            pos = self.param(
                "pos_embed",
                nn.with_logical_partitioning(nn.initializers.zeros_init(), (None, None, None)),
                (1, cfg.pos_embed_seq_len, cfg.image_dim),
                self.param_dtype,
            )
            x = x.reshape(-1, cfg.pos_embed_seq_len, x.shape[2]) + pos.astype(jnp.float32)
        x = _affine_layer_norm("norm1", IMAGE_NORM_EPS, self.param_dtype)(x).astype(self.dtype)
        x = MLP2(
            cfg.image_dim,
            cfg.hidden_dim,
            gelu_erf,
            (None, "mlp"),
            ("mlp", "embed"),
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            name="ff",
        )(x)
        x = _affine_layer_norm("norm2", IMAGE_NORM_EPS, self.param_dtype)(x.astype(jnp.float32))
        return sharding.constrain(x.astype(self.dtype), _TEXT_EMBED)


class ConditionEmbedder(nn.Module):
    """Timestep -> (temb, 6-way projection); text -> [B, L, D]; image -> [B, S', D] or None.

    diffusers ``WanTimeTextImageEmbedding``. A timestep [B] gives temb [B, D] and the projection
    [B, 6, D]; a per-token timestep [B, L] (Wan 2.2 TI2V) gives [B, L, D] and [B, L, 6, D]. The
    time path runs in float32 (diffusers keeps ``time_embedder`` in fp32; we keep ``time_proj``
    there too since it feeds every modulation).
    """

    config: WanTransformerConfig
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, timestep: jax.Array, text_blt: jax.Array, image_bse=None):
        cfg = self.config
        dim = cfg.hidden_dim
        per_token = timestep.ndim == 2
        if per_token:  # diffusers: flatten, embed, unflatten to [B, L, freq_dim]
            t_freq = timestep_embedding(timestep.reshape(-1), cfg.freq_dim)
            t_freq = t_freq.reshape(*timestep.shape, cfg.freq_dim)
        else:
            t_freq = timestep_embedding(timestep, cfg.freq_dim)
        temb = MLP2(
            dim,
            dim,
            nn.silu,
            (None, "embed"),
            ("embed", None),
            dtype=jnp.float32,
            param_dtype=self.param_dtype,
            name="time_embedder",
        )(t_freq)
        proj = dense(6 * dim, ("embed", "modulation"), "time_proj", jnp.float32, self.param_dtype)
        temb_6d = proj(nn.silu(temb)).reshape(*temb.shape[:-1], 6, dim)
        if per_token:
            temb = sharding.constrain(temb, _BATCH_LENGTH_EMBED)
            temb_6d = sharding.constrain(temb_6d, _BATCH_LENGTH_MOD_EMBED)
        text = MLP2(
            dim,
            dim,
            gelu_tanh,
            (None, "embed"),
            ("embed", None),
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            name="text_embedder",
        )(text_blt.astype(self.dtype))
        image = None
        if image_bse is not None:
            image = ImageEmbedder(cfg, self.dtype, self.param_dtype, name="image_embedder")(
                image_bse
            )
        return temb, temb_6d, sharding.constrain(text, _TEXT_EMBED), image


class WanAttention(nn.Module):
    """Multi-head attention with RMS-norm on q and k over all heads (diffusers WanAttention).

    Self-attention when ``context`` is None (RoPE applied to q and k), else cross-attention
    to ``context`` (no RoPE, no mask: diffusers passes none; Wan pads prompts with zeros).
    With ``image`` (Wan 2.1 I2V / FLF2V cross-attention) the same query also attends to the
    image tokens through ``add_k_proj`` / ``norm_added_k`` / ``add_v_proj``, and the two
    attention outputs are summed before ``to_out`` (diffusers ``WanAttnProcessor``).
    """

    config: WanTransformerConfig
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    attention: str = "dot_product"
    mesh: Any = None

    def _rms_norm(self, name: str) -> RMSNorm:
        return RMSNorm(self.config.eps, self.dtype, self.param_dtype, name=name)

    @nn.compact
    def __call__(self, x_bld, context_bmd=None, rope=None, image_bsd=None):
        cfg = self.config
        dim, heads, head_dim = cfg.hidden_dim, cfg.num_attention_heads, cfg.attention_head_dim
        kv_source = x_bld if context_bmd is None else context_bmd
        kv_axes = _BATCH_LENGTH_HEADS if context_bmd is None else _TEXT_HEADS

        def project(name, source):
            return dense(dim, ("embed", "heads"), name, self.dtype, self.param_dtype)(source)

        def split_heads(t, axes):
            return sharding.constrain(t.reshape(*t.shape[:2], heads, head_dim), axes)

        q = self._rms_norm("norm_q")(project("to_q", x_bld))
        k = self._rms_norm("norm_k")(project("to_k", kv_source))
        v = project("to_v", kv_source)
        q = split_heads(q, _BATCH_LENGTH_HEADS)
        k, v = split_heads(k, kv_axes), split_heads(v, kv_axes)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        out = attention_fn(q, k, v, backend=self.attention, mesh=self.mesh)
        if image_bsd is not None:
            k_img = self._rms_norm("norm_added_k")(project("add_k_proj", image_bsd))
            v_img = project("add_v_proj", image_bsd)
            k_img, v_img = split_heads(k_img, _TEXT_HEADS), split_heads(v_img, _TEXT_HEADS)
            out_img = attention_fn(q, k_img, v_img, backend=self.attention, mesh=self.mesh)
            out = out + sharding.constrain(out_img, _BATCH_LENGTH_HEADS)
        out = sharding.constrain(out, _BATCH_LENGTH_HEADS).reshape(*out.shape[:2], dim)
        out = dense(dim, ("heads", "embed"), "to_out", self.dtype, self.param_dtype)(out)
        return sharding.constrain(out, _BATCH_LENGTH_EMBED)


class FeedForward(nn.Module):
    """Linear -> GELU(tanh) -> Linear (diffusers FeedForward, activation "gelu-approximate")."""

    config: WanTransformerConfig
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x_bld):
        cfg = self.config
        h = dense(cfg.ffn_dim, ("embed", "mlp"), "proj_in", self.dtype, self.param_dtype)(x_bld)
        h = sharding.constrain(
            gelu_tanh(h), ("activation_batch", "activation_length", "activation_mlp")
        )
        out = dense(cfg.hidden_dim, ("mlp", "embed"), "proj_out", self.dtype, self.param_dtype)(h)
        return sharding.constrain(out, _BATCH_LENGTH_EMBED)


def _modulate(x_bld: jax.Array, eps: float, shift_b1d, scale_b1d, dtype: Dtype) -> jax.Array:
    """LayerNorm(x) * (1 + scale) + shift, in float32, cast to the activation dtype.

    shift/scale are [B, 1, D] (one timestep per sample) or [B, L, D] (one per token)."""
    return scale_shift(layer_norm(x_bld, eps), scale_b1d, shift_b1d).astype(dtype)


def _split_modulation(table_1nd: jax.Array, temb: jax.Array, n: int) -> list[jax.Array]:
    """``scale_shift_table + temb`` in float32, split into n parts of [B, 1, D] or [B, L, D].

    temb is [B, n, D] (timestep per sample) or [B, L, n, D] (per token, Wan 2.2 TI2V)."""
    table = table_1nd.astype(jnp.float32)
    if temb.ndim == 4:
        mod = table[:, None] + temb.astype(jnp.float32)  # [B, L, n, D]
        return [part[:, :, 0] for part in jnp.split(mod, n, axis=2)]
    return jnp.split(table + temb.astype(jnp.float32), n, axis=1)


class WanBlock(nn.Module):
    """One transformer block (diffusers WanTransformerBlock)."""

    config: WanTransformerConfig
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    attention: str = "dot_product"
    mesh: Any = None

    @nn.compact
    def __call__(self, x_bld, context_bmd, temb_6d, rope_cos, rope_sin, image_bsd=None):
        cfg = self.config
        x_bld = checkpoint_name(x_bld, BLOCK_INPUT)  # what an offloading remat policy keeps
        table = _modulation_table(self, 6, cfg.hidden_dim, self.param_dtype)
        shift_sa, scale_sa, gate_sa, shift_ff, scale_ff, gate_ff = _split_modulation(
            table, temb_6d, 6
        )
        attn_kw = dict(
            config=cfg,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            attention=self.attention,
            mesh=self.mesh,
        )

        # 1. self-attention, modulated and gated; the residual add happens in float32
        h = _modulate(x_bld, cfg.eps, shift_sa, scale_sa, self.dtype)
        h = WanAttention(**attn_kw, name="attn1")(h, rope=(rope_cos, rope_sin))
        x_bld = gated_add(x_bld, h, gate_sa).astype(self.dtype)
        x_bld = sharding.constrain(x_bld, _BATCH_LENGTH_EMBED)

        # 2. cross-attention to the text (and the image tokens of I2V), ungated
        if cfg.cross_attn_norm:
            norm2 = _affine_layer_norm("norm2", cfg.eps, self.param_dtype)
            h = norm2(x_bld.astype(jnp.float32)).astype(self.dtype)
        else:
            h = x_bld
        x_bld = x_bld + WanAttention(**attn_kw, name="attn2")(h, context_bmd, image_bsd=image_bsd)

        # 3. feed-forward, modulated and gated
        h = _modulate(x_bld, cfg.eps, shift_ff, scale_ff, self.dtype)
        h = FeedForward(cfg, self.dtype, self.param_dtype, name="ffn")(h)
        x_bld = gated_add(x_bld, h, gate_ff).astype(self.dtype)
        return sharding.constrain(x_bld, _BATCH_LENGTH_EMBED)


class PatchEmbedding(nn.Module):
    """diffusers' Conv3d(in, D, kernel=stride=patch) as a contraction over patch contents.

    The kernel keeps the flax Conv3d layout [pt, ph, pw, C, D] so ``weights.conv3d`` loads it.
    """

    config: WanTransformerConfig
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, patches):
        cfg = self.config
        kernel = self.param(
            "kernel",
            nn.with_logical_partitioning(
                nn.initializers.xavier_uniform(in_axis=(0, 1, 2, 3), out_axis=4),
                (None, None, None, "conv_in", "embed"),
            ),
            (*cfg.patch_size, cfg.in_channels, cfg.hidden_dim),
            self.param_dtype,
        )
        bias = self.param(
            "bias",
            nn.with_logical_partitioning(nn.initializers.zeros_init(), ("embed",)),
            (cfg.hidden_dim,),
            self.param_dtype,
        )
        # one matrix product over the flattened patch contents, with linear's backward
        patch_inputs = patches.reshape(*patches.shape[:4], -1).astype(self.dtype)
        kernel_2d = as_dtype(reshape_kernel(kernel, (-1, cfg.hidden_dim)), self.dtype)
        return projection(patch_inputs, kernel_2d, bias.astype(self.dtype))


class WanTransformer(nn.Module):
    """Wan 2.1 / 2.2 transformer (= diffusers WanTransformer3DModel.forward)::

        (hidden_states [B, C, F, H, W], timestep [B] or [B, L], encoder_hidden_states
         [B, L_text, text_dim], encoder_hidden_states_image [B, S, image_dim] (FLF2V:
         [2B, P/2, image_dim] or [B, P, image_dim], P = pos_embed_seq_len) or None)
        -> prediction [B, out_channels, F, H, W]

    ``encoder_hidden_states_image`` is required exactly when the config has image
    conditioning (``image_dim``); L is the number of patch tokens F' * H' * W'.
    """

    config: WanTransformerConfig
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    attention: str = "dot_product"
    mesh: Any = None
    remat_policy: str = "none"
    scan_layers: bool = False  # the blocks as one lax.scan (jaxcore.compute.run_blocks)
    # the block groups scan_layers scans (their stacked layout: jaxcore.layer_stack)
    scanned_blocks: ClassVar[tuple[str, ...]] = ("blocks",)

    def _check_inputs(self, video_shape, timestep_shape, text_shape, image_shape) -> None:
        """Raise ValueError naming the argument whose shape does not fit the config."""
        cfg = self.config
        if len(video_shape) != 5 or video_shape[1] != cfg.in_channels:
            raise ValueError(
                f"hidden_states must be [B, {cfg.in_channels}, F, H, W], got {tuple(video_shape)}"
            )
        batch, tokens = video_shape[0], math.prod(patch_grid(video_shape, cfg.patch_size))
        if tuple(timestep_shape) not in ((batch,), (batch, tokens)):
            raise ValueError(
                f"timestep must be [B]=[{batch}] (one per sample) or [B, L]=[{batch}, {tokens}] "
                f"(one per patch token, Wan 2.2 TI2V), got shape {tuple(timestep_shape)}"
            )
        if len(text_shape) != 3 or (text_shape[0], text_shape[2]) != (batch, cfg.text_dim):
            raise ValueError(
                f"encoder_hidden_states must be [{batch}, L, text_dim={cfg.text_dim}], "
                f"got {tuple(text_shape)}"
            )
        if not cfg.image_conditioning:
            if image_shape is not None:
                raise ValueError(
                    f"encoder_hidden_states_image was given (shape {tuple(image_shape)}) but this "
                    "config has no image conditioning (image_dim=None): pass None"
                )
            return
        e, p = cfg.image_dim, cfg.pos_embed_seq_len
        if p is None:
            want = f"[{batch}, S, image_dim={e}]"
            ok = image_shape is not None and len(image_shape) == 3 and image_shape[1] >= 1
            ok = ok and (image_shape[0], image_shape[2]) == (batch, e)
        else:
            want = (
                f"[2B={2 * batch}, pos_embed_seq_len/2={p // 2}, image_dim={e}] (each sample's "
                f"first- and last-frame CLIP states in consecutive rows) or [{batch}, {p}, {e}]"
            )
            ok = image_shape is not None and tuple(image_shape) in (
                (2 * batch, p // 2, e),
                (batch, p, e),
            )
        if image_shape is None:
            raise ValueError(
                "encoder_hidden_states_image is required: this config has image conditioning "
                f"(image_dim={e}); pass the CLIP image states, {want}"
            )
        if not ok:
            raise ValueError(
                f"encoder_hidden_states_image must be {want}, got {tuple(image_shape)}"
            )

    @nn.compact
    def __call__(
        self,
        hidden_states,
        timestep,
        encoder_hidden_states,
        encoder_hidden_states_image=None,
        run_stack=None,
    ):
        """The prediction; with ``run_stack`` (step caching, :mod:`jaxcore.step_cache`),
        ``(prediction, extra)`` where the block stack ran as
        ``run_stack((x,), run_blocks, num_blocks) -> ((x,), extra)`` and
        ``run_blocks(streams, start, stop)`` runs blocks ``start..stop-1``."""
        cfg = self.config
        timestep = jnp.asarray(timestep)
        image = encoder_hidden_states_image
        self._check_inputs(
            hidden_states.shape,
            timestep.shape,
            encoder_hidden_states.shape,
            None if image is None else image.shape,
        )
        grid = patch_grid(hidden_states.shape, cfg.patch_size)
        batch, dim = hidden_states.shape[0], cfg.hidden_dim
        if self.mesh is not None:
            sharding.check_divisible(self.mesh, batch=batch, heads=cfg.num_attention_heads)

        # patch embedding: a stride=kernel Conv3d is a contraction over each patch
        patches = patchify(hidden_states.astype(self.dtype), cfg.patch_size)
        x = PatchEmbedding(cfg, self.dtype, self.param_dtype, name="patch_embedding")(patches)
        x = sharding.constrain(x.reshape(batch, -1, dim), _BATCH_LENGTH_EMBED)

        rope = tuple(
            sharding.constrain(t, ("activation_length", "activation_kv"))
            for t in rope_cos_sin(grid, cfg.attention_head_dim, cfg.rope_max_seq_len)
        )
        temb, temb_6d, context, image = ConditionEmbedder(
            cfg, self.dtype, self.param_dtype, name="condition_embedder"
        )(timestep, encoder_hidden_states, image)

        def one_block(block, h):
            return block(h, context, temb_6d, *rope, image)

        block_cls = remat_block(WanBlock, self.remat_policy)
        block_args = (cfg, self.dtype, self.param_dtype, self.attention, self.mesh)
        x, extra = compute.block_stack(
            self,
            block_cls,
            block_args,
            "blocks_",
            cfg.num_layers,
            one_block,
            x,
            run_stack,
            self.scan_layers,
        )

        table = _modulation_table(self, 2, dim, self.param_dtype)
        if temb.ndim == 3:  # per-token timesteps: shift/scale [B, L, D]
            shift, scale = _split_modulation(table, temb[:, :, None, :], 2)
        else:
            shift, scale = jnp.split(table.astype(jnp.float32) + temb[:, None, :], 2, axis=1)
        x = _modulate(x, cfg.eps, shift, scale, self.dtype)
        x = dense(
            cfg.out_channels * cfg.patch_volume,
            ("embed", "conv_out"),
            "proj_out",
            self.dtype,
            self.param_dtype,
        )(x)
        out = unpatchify(x, grid, cfg.patch_size)
        return out if run_stack is None else (out, extra)


# ----------------------------------------------------------------------------------------------
# Weights: diffusers checkpoint <-> flax params
# ----------------------------------------------------------------------------------------------


def _dense_entries(flax_prefix: tuple[str, ...], torch_prefix: str) -> dict:
    return {
        (*flax_prefix, "kernel"): (f"{torch_prefix}.weight", weights.linear),
        (*flax_prefix, "bias"): (f"{torch_prefix}.bias", weights.identity),
    }


def _norm_entries(flax_prefix: tuple[str, ...], torch_prefix: str, bias: bool = True) -> dict:
    entries = {(*flax_prefix, "scale"): (f"{torch_prefix}.weight", weights.identity)}
    if bias:
        entries[(*flax_prefix, "bias")] = (f"{torch_prefix}.bias", weights.identity)
    return entries


def _attention_entries(
    flax_prefix: tuple[str, ...], torch_prefix: str, image: bool = False
) -> dict:
    entries: dict = {}
    projections = ("to_q", "to_k", "to_v") + (("add_k_proj", "add_v_proj") if image else ())
    for proj in projections:
        entries |= _dense_entries((*flax_prefix, proj), f"{torch_prefix}.{proj}")
    entries |= _dense_entries((*flax_prefix, "to_out"), f"{torch_prefix}.to_out.0")
    for norm in ("norm_q", "norm_k") + (("norm_added_k",) if image else ()):
        entries |= _norm_entries((*flax_prefix, norm), f"{torch_prefix}.{norm}", bias=False)
    return entries


def _block_entries(i: int, config: WanTransformerConfig) -> dict:
    flax, torch = (f"blocks_{i}",), f"blocks.{i}"
    entries = {(*flax, "scale_shift_table"): (f"{torch}.scale_shift_table", weights.identity)}
    entries |= _attention_entries((*flax, "attn1"), f"{torch}.attn1")
    entries |= _attention_entries((*flax, "attn2"), f"{torch}.attn2", config.image_conditioning)
    if config.cross_attn_norm:
        entries |= _norm_entries((*flax, "norm2"), f"{torch}.norm2")
    entries |= _dense_entries((*flax, "ffn", "proj_in"), f"{torch}.ffn.net.0.proj")
    entries |= _dense_entries((*flax, "ffn", "proj_out"), f"{torch}.ffn.net.2")
    return entries


def weight_map(config: WanTransformerConfig) -> dict:
    """{flax param path: (diffusers key, transform)} for every parameter of the model."""
    entries = {
        ("patch_embedding", "kernel"): ("patch_embedding.weight", weights.conv3d),
        ("patch_embedding", "bias"): ("patch_embedding.bias", weights.identity),
        ("scale_shift_table",): ("scale_shift_table", weights.identity),
    }
    cond = ("condition_embedder",)
    for sub in ("time_embedder", "text_embedder"):
        for lin in ("linear_1", "linear_2"):
            entries |= _dense_entries((*cond, sub, lin), f"condition_embedder.{sub}.{lin}")
    entries |= _dense_entries((*cond, "time_proj"), "condition_embedder.time_proj")
    if config.image_conditioning:
        flax, torch = (*cond, "image_embedder"), "condition_embedder.image_embedder"
        entries |= _norm_entries((*flax, "norm1"), f"{torch}.norm1")
        entries |= _dense_entries((*flax, "ff", "linear_1"), f"{torch}.ff.net.0.proj")
        entries |= _dense_entries((*flax, "ff", "linear_2"), f"{torch}.ff.net.2")
        entries |= _norm_entries((*flax, "norm2"), f"{torch}.norm2")
        if config.pos_embed_seq_len is not None:
            entries[(*flax, "pos_embed")] = (f"{torch}.pos_embed", weights.identity)
    for i in range(config.num_layers):
        entries |= _block_entries(i, config)
    entries |= _dense_entries(("proj_out",), "proj_out")
    return entries


def _ignored_checkpoint_keys(config: WanTransformerConfig) -> tuple[str, ...]:
    """Keys diffusers skips on load (``_keys_to_ignore_on_load_unexpected = ["norm_added_q"]``:
    older diffusers' Attention built a q norm for the added projections that Wan never used)."""
    return tuple(
        f"blocks.{i}.{attn}.norm_added_q."
        for i in range(config.num_layers)
        for attn in ("attn1", "attn2")
    )


def _dummy_inputs(config: WanTransformerConfig, batch: int = 1):
    """Smallest valid input shapes (one patch, one text token, one image token or the FLF2V
    pair) for init / eval_shape."""
    video = jax.ShapeDtypeStruct((batch, config.in_channels, *config.patch_size), jnp.float32)
    timestep = jax.ShapeDtypeStruct((batch,), jnp.float32)
    text = jax.ShapeDtypeStruct((batch, 1, config.text_dim), jnp.float32)
    image = None
    if config.image_conditioning:
        if config.pos_embed_seq_len is None:
            image_shape = (batch, 1, config.image_dim)
        else:
            image_shape = (2 * batch, config.pos_embed_seq_len // 2, config.image_dim)
        image = jax.ShapeDtypeStruct(image_shape, jnp.float32)
    return video, timestep, text, image


# build / load / init / shape / count: one definition for every model (jaxcore.weights.ModelKind)
KIND = weights.ModelKind(
    WanTransformer,
    WanTransformerConfig,
    _dummy_inputs,
    lambda config, boxed: weight_map(config),
    _ignored_checkpoint_keys,
)
abstract_params = KIND.abstract_params
load_wan_transformer = KIND.load  # a diffusers WanTransformer3DModel directory
init_wan_transformer = KIND.init
count_params = KIND.count_params


def flops_per_forward(
    config: WanTransformerConfig,
    batch: int,
    video_tokens: int,
    text_tokens: int,
    image_tokens: int = 0,
) -> int:
    """Matmul FLOPs of one forward pass of the blocks (MaxDiffusion's Wan formula, for MFU).

    Per block, with D = hidden dim, F = ffn dim, s video tokens, L text tokens, I image tokens:
    self-attn QKV 3*2*s*D^2, scores+values 2*2*s^2*D, cross-attn K/V 2*2*L*D^2, Q 2*s*D^2,
    scores+values 2*2*s*L*D, both output projections 2*2*s*D^2, FFN 2*2*s*D*F; with image
    conditioning (Wan 2.1 I2V / FLF2V) the image K/V 2*2*I*D^2 and scores+values 2*2*s*I*D
    (I counts image tokens after the image embedder: 257 for I2V, 514 for FLF2V; the query is
    shared). Embeddings (per-token timesteps included: ~14*s*D^2 once) and the output head are
    left out. (MaxDiffusion counts 3*2*L*D^2 for the cross K/V projections, one projection too
    many; we count two.) Training = 3x this.
    """
    d, f, s, t, i = config.hidden_dim, config.ffn_dim, video_tokens, text_tokens, image_tokens
    self_attn = 3 * 2 * s * d * d + 2 * 2 * s * s * d
    cross_attn = 2 * 2 * t * d * d + 2 * s * d * d + 2 * 2 * s * t * d
    image_attn = 2 * 2 * i * d * d + 2 * 2 * s * i * d
    out_proj = 2 * 2 * s * d * d
    ffn = 2 * 2 * s * d * f
    return batch * config.num_layers * (self_attn + cross_attn + image_attn + out_proj + ffn)


def self_attention_flops(config: WanTransformerConfig, batch: int, video_tokens: int) -> int:
    """The self-attention's scores and values of :func:`flops_per_forward` (2*2*s^2*D a
    block): the part the splash kernel runs on TPU."""
    return batch * config.num_layers * 2 * 2 * video_tokens**2 * config.hidden_dim
