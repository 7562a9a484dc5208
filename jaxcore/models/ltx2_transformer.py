"""LTX-2 audio-video diffusion transformer in Flax linen.

Reference: diffusers ``LTX2VideoTransformer3DModel`` (diffusers/models/transformers/
transformer_ltx2.py, diffusers 0.42) and how ``LTX2Pipeline`` / ``LTX2ImageToVideoPipeline``
(pipelines/ltx2/) call it. Same function, same parameters (loaded from a diffusers checkpoint
through :func:`weight_map`), written as JAX code. Two token streams run side by side:

- video tokens [B, Lv, in_channels] (``LTX2Pipeline._pack_latents``, the LTX-Video packing:
  :func:`jaxcore.models.ltx_transformer.pack_latents`) and audio tokens [B, La,
  audio_in_channels] (:func:`pack_audio_latents`: a latent frame's C x mel bins), each embedded
  by its ``proj_in`` to its own width (video D = heads x head dim, audio Da likewise),
- four timestep embeddings per modality (``LTX2AdaLayerNormSingle``: 256-channel sinusoid -> SiLU
  MLP -> n-way projection): the blocks' 6 (9 with ``cross_attn_mod``) modulations, the
  cross-modal attentions' 4 scales/shifts and 1 gate (from the cross-modal timestep: the other
  modality's ``sigma`` with ``use_cross_timestep``), and with ``cross_attn_mod`` (LTX-2.3) the
  prompt's 2 (from ``sigma``),
- captions: per modality a GELU-tanh MLP from caption_channels (``use_prompt_embeddings``), or
  given at the attention's width (LTX-2.3, whose connectors project them),
- blocks: per modality, modulated RMSNorm -> self-attention (RoPE) -> gated residual; RMSNorm ->
  text cross-attention (LTX-2.3: q modulated and the output gated, the captions modulated) ->
  residual; then audio->video attention (q video, k/v audio) and video->audio attention (q
  audio, k/v video), both from the block's pre-cross-modal norms, modulated per side, with the
  temporal RoPE of each side, gated residuals (``isolate_modalities`` skips both); modulated
  RMSNorm -> GELU FFN (4x) -> gated residual,
- outputs: LayerNorm (eps 1e-6, no affine) modulated by ``scale_shift_table`` + embedded
  timestep, ``proj_out``, per modality.

Attention (``LTX2Attention``): q/k RMSNorm across all heads (eps 1e-6, with weight), RoPE on the
whole width before the heads split, optional per-head output gates ``2 sigmoid(to_gate_logits(x))``
(``gated_attn``), and with ``perturbed_attn`` the spatio-temporal guidance (STG) switch: in the
blocks named by ``spatio_temporal_guidance_blocks`` both self-attentions return their value
projection where ``perturbation_mask`` is 0 (``torch.lerp(v, attention, mask)``; all of the batch
without a mask). diffusers ignores STG blocks on a model without ``perturbed_attn`` (its default
processor takes no mask); so does this model, which the tests prove.

RoPE (``LTX2AudioVideoRotaryPosEmbed``): per token coordinates, [B, n, L, 2] patch bounds (their
midpoint is the position) or [B, n, L] positions, divided by a base (20 frames, 2048 x 2048
pixels; audio 20), ``dim // (2 n)`` frequencies ``theta ** linspace(0, 1) * pi / 2`` computed in
float64 (``rope_double_precision``) and rounded to float32, angles ``freq * (2 g - 1)`` in
float32, pairs laid out frequency-major (pair ``pad + n f + axis``), the first
``pad = dim / 2 mod n`` pairs not rotated. ``rope_type="interleaved"`` rotates channels
(2i, 2i + 1) of the whole width; ``"split"`` (the released LTX-2 checkpoints) cuts the width into
``H`` chunks (the RoPE module's head count) and rotates (j, j + r) within each, r = D / 2H. The
cross-modal attentions rotate by the frame coordinate alone, at ``audio_cross_attention_dim``
(:func:`rope_tables`).

Coordinates: the pipeline builds them once from static sizes (``prepare_video_coords`` /
``prepare_audio_coords``: :func:`video_coords` / :func:`audio_coords` here, float32 operations
in torch's order, equal to diffusers' exactly); the model takes them as ``video_coords`` /
``audio_coords`` or builds them from ``num_frames`` / ``height`` / ``width`` / ``fps`` and
``audio_num_frames``. Concrete (numpy) coordinates give host-computed tables: per axis the
cos/sin of each distinct position (float64 of the float32 angle, rounded once), gathered per
token in the graph, so no [L, D/2] constant is embedded; traced coordinates are computed in the
graph (their division by the base corrected to torch's rounding: :func:`divide_exactly`).
Either way the float32 angle is formed exactly as torch forms it.

Not built: ``video_self_attention_mask`` (the IC-LoRA pipeline's soft [B, Lv, Lv] mask: the
attention backends take key masks only), diffusers' ``attention_kwargs`` (LoRA scale) and
``return_dict``; 3-D (bias) encoder masks are refused, as in
:mod:`jaxcore.models.ltx_transformer`.

Public tensors use diffusers' layout: tokens [B, L, C] in, [B, L, out_channels] out.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Any, ClassVar, NamedTuple

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
    Dense,
    RMSNorm,
    dense,
    gated_add,
    gelu_tanh,
    layer_norm,
    rms_norm,
    scale_shift,
    timestep_embedding,
)
from jaxcore.models.ltx_transformer import (
    ACTIVATIONS,
    SUPPORTED_QK_NORM,
    encoder_kv_mask,
    rotate_across_heads,
)

Dtype = Any

ROPE_TYPES = ("interleaved", "split")
TIMESTEP_CHANNELS = 256  # PixArtAlphaCombinedTimestepSizeEmbeddings' Timesteps(256)
MLP_RATIO = 4  # FeedForward(dim) hidden = 4 * dim
QK_NORM_EPS = 1e-6  # LTX2Attention's torch.nn.RMSNorm default, whatever the config's norm_eps
OUT_NORM_EPS = 1e-6  # norm_out / audio_norm_out = LayerNorm(eps=1e-6, elementwise_affine=False)
BLOCK_MODULATIONS = 6  # shift/scale/gate of self-attention and of the FFN
PROMPT_MODULATIONS = 3  # cross_attn_mod: shift/scale/gate of the text cross-attention's query
CROSS_MODAL_SCALE_SHIFTS = 4  # a2v scale, a2v shift, v2a scale, v2a shift
NO_PERTURBATION, PERTURB_ALL, PERTURB_BY_MASK = "none", "all", "mask"

# ----------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------


class LTX2ConfigError(ValueError):
    """A config.json / YAML section LTX2VideoTransformerConfig cannot represent; names the key."""


@dataclasses.dataclass(frozen=True)
class Stream:
    """One modality's widths and switches, derived from the config (not a config section)."""

    name: str  # "video" or "audio": diffusers' parameter-name prefix is "" or "audio_"
    in_channels: int
    out_channels: int
    heads: int
    head_dim: int
    context_dim: int  # the text cross-attention's key/value width
    gated_attn: bool
    cross_attn_mod: bool
    ff_bias: bool

    @property
    def dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def prefix(self) -> str:
        return "" if self.name == "video" else "audio_"

    @property
    def modulations(self) -> int:
        return BLOCK_MODULATIONS + (PROMPT_MODULATIONS if self.cross_attn_mod else 0)


@dataclasses.dataclass(frozen=True)
class LTX2VideoTransformerConfig:
    """Architecture of an LTX-2 transformer; field names and defaults follow diffusers'
    ``LTX2VideoTransformer3DModel`` config.json (the defaults are LTX-2.0's 19B, whose released
    checkpoint sets ``rope_type="split"``). ``out_channels`` / ``audio_out_channels`` 0 / None
    mean the input's channel count; resolved at construction."""

    in_channels: int = 128
    out_channels: int | None = 128
    patch_size: int = 1
    patch_size_t: int = 1
    num_attention_heads: int = 32
    attention_head_dim: int = 128
    cross_attention_dim: int = 4096
    vae_scale_factors: tuple[int, int, int] = (8, 32, 32)
    pos_embed_max_pos: int = 20
    base_height: int = 2048
    base_width: int = 2048
    gated_attn: bool = False
    cross_attn_mod: bool = False
    audio_in_channels: int = 128
    audio_out_channels: int | None = 128
    audio_patch_size: int = 1
    audio_patch_size_t: int = 1
    audio_num_attention_heads: int = 32
    audio_attention_head_dim: int = 64
    audio_cross_attention_dim: int = 2048
    audio_scale_factor: int = 4
    audio_pos_embed_max_pos: int = 20
    audio_sampling_rate: int = 16000
    audio_hop_length: int = 160
    audio_gated_attn: bool = False
    audio_cross_attn_mod: bool = False
    num_layers: int = 48
    activation_fn: str = "gelu-approximate"
    qk_norm: str = SUPPORTED_QK_NORM
    norm_elementwise_affine: bool = False
    norm_eps: float = 1e-6
    caption_channels: int = 3840
    attention_bias: bool = True
    attention_out_bias: bool = True
    rope_theta: float = 10000.0
    rope_double_precision: bool = True
    causal_offset: int = 1
    timestep_scale_multiplier: int = 1000
    cross_attn_timestep_scale_multiplier: int = 1000
    rope_type: str = "interleaved"
    use_prompt_embeddings: bool = True
    perturbed_attn: bool = False
    ff_bias: bool = True
    audio_ff_bias: bool = True
    use_prompt_adaln_single: bool = True
    use_keyframes_abs_pos_embedding: bool = False

    def __post_init__(self):
        if not self.out_channels:
            object.__setattr__(self, "out_channels", self.in_channels)
        if not self.audio_out_channels:
            object.__setattr__(self, "audio_out_channels", self.audio_in_channels)
        object.__setattr__(self, "vae_scale_factors", tuple(self.vae_scale_factors))
        self._check_choices()
        self._check_sizes()
        self._check_widths()

    def _check_choices(self) -> None:
        if self.qk_norm != SUPPORTED_QK_NORM:
            raise LTX2ConfigError(
                f"qk_norm={self.qk_norm!r} is not supported; only {SUPPORTED_QK_NORM!r} "
                "(diffusers' LTX2Attention refuses the others too)"
            )
        if self.activation_fn not in ACTIVATIONS:
            raise LTX2ConfigError(
                f"activation_fn={self.activation_fn!r} is not supported; "
                f"choose one of {sorted(ACTIVATIONS)}"
            )
        if self.rope_type not in ROPE_TYPES:
            raise LTX2ConfigError(f"rope_type={self.rope_type!r}; choose one of {ROPE_TYPES}")
        if len(self.vae_scale_factors) != 3:
            raise LTX2ConfigError(
                f"vae_scale_factors must be 3 numbers (t, h, w), got {self.vae_scale_factors!r}"
            )

    def _check_sizes(self) -> None:
        positive = (
            "in_channels out_channels patch_size patch_size_t num_attention_heads "
            "attention_head_dim cross_attention_dim pos_embed_max_pos base_height base_width "
            "audio_in_channels audio_out_channels audio_patch_size audio_patch_size_t "
            "audio_num_attention_heads audio_attention_head_dim audio_cross_attention_dim "
            "audio_scale_factor audio_pos_embed_max_pos audio_sampling_rate audio_hop_length "
            "caption_channels timestep_scale_multiplier"
        )
        for key in positive.split():
            if int(getattr(self, key)) < 1:
                raise LTX2ConfigError(f"{key} must be >= 1, got {getattr(self, key)!r}")
        if int(self.num_layers) < 0:
            raise LTX2ConfigError(f"num_layers must be >= 0, got {self.num_layers!r}")
        if not self.norm_eps > 0:
            raise LTX2ConfigError(f"norm_eps must be > 0, got {self.norm_eps!r}")

    def _check_widths(self) -> None:
        """Widths diffusers builds but whose forward cannot run (a shape mismatch there)."""
        for key, width in (
            ("num_attention_heads x attention_head_dim", self.hidden_dim),
            ("audio_num_attention_heads x audio_attention_head_dim", self.audio_hidden_dim),
        ):
            if width % 2:
                raise LTX2ConfigError(f"{key} = {width} must be even: RoPE rotates channel pairs")
        if self.audio_cross_attention_dim != self.audio_hidden_dim:
            raise LTX2ConfigError(
                f"audio_cross_attention_dim={self.audio_cross_attention_dim} must equal "
                f"audio_num_attention_heads x audio_attention_head_dim = {self.audio_hidden_dim}: "
                "it is the width of the audio captions and of the cross-modal RoPE, which rotates "
                "the audio-width queries and keys of the audio<->video attentions"
            )
        needs_model_width = self.use_prompt_embeddings or self.prompt_modulation
        if needs_model_width and self.cross_attention_dim != self.hidden_dim:
            raise LTX2ConfigError(
                f"cross_attention_dim={self.cross_attention_dim} must equal num_attention_heads x "
                f"attention_head_dim = {self.hidden_dim}: the captions reach the text attention "
                "at the model width (caption projection or prompt modulation)"
            )

    @property
    def hidden_dim(self) -> int:
        """Video width D (diffusers' ``inner_dim``)."""
        return self.num_attention_heads * self.attention_head_dim

    @property
    def audio_hidden_dim(self) -> int:
        return self.audio_num_attention_heads * self.audio_attention_head_dim

    @property
    def prompt_modulation(self) -> bool:
        """Prompt (caption) scale/shift tables in every block (LTX-2.3, ``cross_attn_mod``)."""
        return self.cross_attn_mod or self.audio_cross_attn_mod

    @property
    def prompt_adaln(self) -> bool:
        """Whether the prompt modulation depends on ``sigma`` (``prompt_adaln`` modules)."""
        return self.prompt_modulation and self.use_prompt_adaln_single

    @property
    def video(self) -> Stream:
        return Stream(
            "video",
            self.in_channels,
            self.out_channels,
            self.num_attention_heads,
            self.attention_head_dim,
            self.cross_attention_dim,
            self.gated_attn,
            self.cross_attn_mod,
            self.ff_bias,
        )

    @property
    def audio(self) -> Stream:
        return Stream(
            "audio",
            self.audio_in_channels,
            self.audio_out_channels,
            self.audio_num_attention_heads,
            self.audio_attention_head_dim,
            self.audio_cross_attention_dim,
            self.audio_gated_attn,
            self.audio_cross_attn_mod,
            self.audio_ff_bias,
        )

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LTX2VideoTransformerConfig:
        """Build from a diffusers config.json dict (``_``-prefixed keys ignored)."""
        return cls(**config_json_kwargs(cls, d, LTX2ConfigError))

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["vae_scale_factors"] = list(self.vae_scale_factors)
        return d


# ----------------------------------------------------------------------------------------------
# Pure helpers: packing and coordinates (the pipeline's side)
# ----------------------------------------------------------------------------------------------


def pack_audio_latents(latents_bclm) -> jax.Array:
    """[B, C, L, M] -> tokens [B, L, C * M] (``LTX2Pipeline._pack_audio_latents`` without patch
    sizes, as the pipelines call it: a latent frame's channels x mel bins are one token)."""
    if latents_bclm.ndim != 4:
        raise ValueError(f"audio latents must be [B, C, L, M], got shape {latents_bclm.shape}")
    b, c, length, mels = latents_bclm.shape
    return jnp.transpose(latents_bclm, (0, 2, 1, 3)).reshape(b, length, c * mels)


def unpack_audio_latents(tokens_bld, num_mel_bins: int) -> jax.Array:
    """Inverse of :func:`pack_audio_latents`: [B, L, C * M] -> [B, C, L, M]."""
    b, length, width = tokens_bld.shape
    if width % num_mel_bins:
        raise ValueError(f"audio tokens of width {width} do not hold {num_mel_bins} mel bins")
    return jnp.transpose(tokens_bld.reshape(b, length, -1, num_mel_bins), (0, 2, 1, 3))


def audio_num_frames(
    num_frames: int,
    frame_rate: float,
    sampling_rate: int = 16000,
    hop_length: int = 160,
    temporal_compression: int = 4,
) -> int:
    """Latent audio frames for a ``num_frames`` video at ``frame_rate`` (LTX2Pipeline:
    ``round(num_frames / frame_rate * sampling_rate / hop_length / compression)``)."""
    per_second = sampling_rate / hop_length / float(temporal_compression)
    return round(num_frames / frame_rate * per_second)


def video_coords(
    batch: int,
    num_frames: int,
    height: int,
    width: int,
    fps: float = 24.0,
    *,
    patch_size: int = 1,
    patch_size_t: int = 1,
    scale_factors: Sequence[int] = (8, 32, 32),
    causal_offset: int = 1,
) -> np.ndarray:
    """[B, 3, L, 2] float32 pixel-space [start, end) bounds of each token of a (num_frames,
    height, width) latent grid (``LTX2AudioVideoRotaryPosEmbed.prepare_video_coords``): latent
    bounds x the VAE scale factors, the frame axis shifted by ``causal_offset - t`` (clamped at
    0: the first latent frame is one pixel frame) and divided by ``fps`` (seconds). float32
    operations in torch's order, so equal to diffusers' exactly."""
    axes = [
        np.arange(0, n, step, dtype=np.float32)
        for n, step in ((num_frames, patch_size_t), (height, patch_size), (width, patch_size))
    ]
    starts = np.stack(np.meshgrid(*axes, indexing="ij")).reshape(3, -1)
    patch = np.array([patch_size_t, patch_size, patch_size], np.float32)[:, None]
    bounds = np.stack([starts, starts + patch], axis=-1)  # [3, L, 2]
    pixels = bounds * np.asarray(scale_factors, np.float32)[:, None, None]
    frames = pixels[0] + np.float32(causal_offset)
    pixels[0] = np.maximum(frames - np.float32(scale_factors[0]), np.float32(0))
    pixels[0] = pixels[0] / np.float32(fps)
    return np.broadcast_to(pixels, (batch, *pixels.shape)).copy()


def audio_coords(
    batch: int,
    num_frames: int,
    *,
    patch_size_t: int = 1,
    scale_factor: int = 4,
    sampling_rate: int = 16000,
    hop_length: int = 160,
    causal_offset: int = 1,
    shift: int = 0,
) -> np.ndarray:
    """[B, 1, L, 2] float32 [start, end) times in seconds of each latent audio frame
    (``prepare_audio_coords``): latent index x ``scale_factor`` mel frames, shifted by
    ``causal_offset - scale_factor`` and clamped at 0, x hop / sampling rate; float32 operations
    in torch's order."""
    grid = np.arange(shift, num_frames + shift, patch_size_t, dtype=np.float32)

    def seconds(index: np.ndarray) -> np.ndarray:
        mel = index * np.float32(scale_factor)
        mel = np.maximum(mel + np.float32(causal_offset) - np.float32(scale_factor), 0)
        return (mel * np.float32(hop_length)) / np.float32(sampling_rate)

    bounds = np.stack([seconds(grid), seconds(grid + np.float32(patch_size_t))], axis=-1)
    return np.broadcast_to(bounds[None, None], (batch, 1, *bounds.shape)).copy()


# ----------------------------------------------------------------------------------------------
# Rotary tables
# ----------------------------------------------------------------------------------------------


class RopeSpec(NamedTuple):
    """One ``LTX2AudioVideoRotaryPosEmbed``: its width, the base of each coordinate axis, the
    head count its split layout chunks the width by, and the rotation layout."""

    dim: int
    bases: tuple[int, ...]
    heads: int
    rope_type: str
    theta: float
    double_precision: bool


def _linspace_0_1(n: int, double: bool) -> np.ndarray:
    """``torch.linspace(0, 1, n)`` as torch's CPU kernel forms it: ``step * i`` for the first
    half, ``1 - step * (n - 1 - i)`` (one fused multiply-add) for the rest; float64 or float32."""
    if n < 2:
        return np.zeros(n, np.float64 if double else np.float32)
    dtype = np.float64 if double else np.float32
    step = Fraction(float(dtype(1.0) / dtype(n - 1)))
    values = [step * i if i < n // 2 else 1 - step * (n - 1 - i) for i in range(n)]
    return np.array([float(v) for v in values]).astype(dtype)  # each rounded once


def rope_frequencies(count: int, theta: float, double_precision: bool = True) -> np.ndarray:
    """float32 [count]: ``theta ** linspace(0, 1, count) * pi / 2``, in float64 then rounded
    (``rope_double_precision``, equal to torch's), or in float32 (torch's pow there is not
    correctly rounded: a few entries may differ by one ulp)."""
    if double_precision:
        freqs = np.power(np.float64(theta), _linspace_0_1(count, True)) * np.pi / 2.0
        return freqs.astype(np.float32)
    powers = np.power(np.float64(theta), _linspace_0_1(count, False).astype(np.float64))
    return (powers.astype(np.float32) * np.float32(math.pi)) / np.float32(2.0)


def _split_float32(a: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Veltkamp's split of float32 ``a`` into 12-bit halves whose products are exact."""
    c = a * jnp.float32(4097.0)
    hi = c - (c - a)
    return hi, a - hi


def divide_exactly(x: jax.Array, divisor) -> jax.Array:
    """``x / divisor`` correctly rounded in the graph, as torch and numpy divide. XLA CPU's
    float32 division is not (a third of the coordinates over 24 or 1536 moved by an ulp, which
    moves the highest RoPE frequencies' angles by ~1e-3 rad): the quotient is corrected once by
    its exact residual (Dekker's product; XLA keeps the order of these float operations)."""
    d = jnp.asarray(divisor, jnp.float32)
    q = x / d
    (q_hi, q_lo), (d_hi, d_lo) = _split_float32(q), _split_float32(d)
    product = q * d
    error = ((q_hi * d_hi - product) + q_hi * d_lo + q_lo * d_hi) + q_lo * d_lo  # q d = p + e
    return q + ((x - product) - error) / d


def _positions(coords, axis: int, base: int, on_host: bool):
    """Axis ``axis`` of [B, n, L] positions or [B, n, L, 2] bounds (midpoint), over ``base``:
    [B, L] float32, as torch forms them."""
    xp = np if on_host else jnp
    c = coords[:, axis].astype(xp.float32)
    if c.ndim == 3:
        c = (c[..., 0] + c[..., 1]) / xp.float32(2.0)  # a power of 2: exact in XLA too
    return c / np.float32(base) if on_host else divide_exactly(c, base)


def _axis_tables(g, freqs: np.ndarray, on_host: bool):
    """cos / sin [B, L, F] of the float32 angles ``freqs * (2 g - 1)``. On the host: the
    distinct positions' tables (correctly rounded cos/sin), gathered per token in the graph."""
    if not on_host:
        angles = (g[..., None] * 2.0 - 1.0) * jnp.asarray(freqs)
        return jnp.cos(angles), jnp.sin(angles)
    values, index = np.unique(g, return_inverse=True)
    angles = ((values[:, None] * np.float32(2) - np.float32(1)) * freqs).astype(np.float64)
    index = jnp.asarray(index.reshape(g.shape).astype(np.int32))
    cos, sin = (jnp.asarray(f(angles).astype(np.float32)) for f in (np.cos, np.sin))
    return jnp.take(cos, index, axis=0), jnp.take(sin, index, axis=0)


def rope_tables(coords, spec: RopeSpec):
    """(cos, sin) per channel pair of tokens at ``coords`` ([B, n, L, 2] bounds or [B, n, L]
    positions, n = len(spec.bases)): [B, L, dim/2] for the interleaved layout, [B, L, heads,
    dim/2heads] for the split one. Concrete (numpy) coords are done on the host, traced ones in
    the graph."""
    on_host = not isinstance(coords, jax.core.Tracer)
    if on_host:
        coords = np.asarray(coords)
    n = len(spec.bases)
    if coords.shape[1] != n:
        raise ValueError(f"RoPE coordinates need {n} axes on dim 1, got shape {coords.shape}")
    freqs = rope_frequencies(spec.dim // (2 * n), spec.theta, spec.double_precision)
    tables = [
        _axis_tables(_positions(coords, i, base, on_host), freqs, on_host)
        for i, base in enumerate(spec.bases)
    ]

    def layout(parts, fill):
        table = jnp.stack(parts, axis=-1)  # [B, L, F, n]: pair n f + axis
        table = table.reshape(*table.shape[:2], -1)
        pad = spec.dim // 2 - table.shape[-1]
        if pad:
            padding = jnp.full((*table.shape[:2], pad), fill, table.dtype)
            table = jnp.concatenate([padding, table], axis=-1)
        if spec.rope_type == "split":
            if (spec.dim // 2) % spec.heads:
                raise ValueError(
                    f"split RoPE: dim/2 = {spec.dim // 2} pairs do not chunk into {spec.heads} heads"
                )
            table = table.reshape(*table.shape[:2], spec.heads, -1)
        return table

    cos = layout([t[0] for t in tables], 1.0)
    sin = layout([t[1] for t in tables], 0.0)
    return cos, sin


def _rope_specs(config: LTX2VideoTransformerConfig) -> dict[str, RopeSpec]:
    """The model's four rotary embeddings, as diffusers builds them (the cross-modal pair at
    ``audio_cross_attention_dim`` with base ``max(pos_embed_max_pos, audio_pos_embed_max_pos)``,
    chunked by the video and the audio head count respectively)."""
    cross_base = max(config.pos_embed_max_pos, config.audio_pos_embed_max_pos)
    common = (config.rope_type, config.rope_theta, config.rope_double_precision)
    video_bases = (config.pos_embed_max_pos, config.base_height, config.base_width)
    return {
        "video": RopeSpec(config.hidden_dim, video_bases, config.num_attention_heads, *common),
        "audio": RopeSpec(
            config.audio_hidden_dim,
            (config.audio_pos_embed_max_pos,),
            config.audio_num_attention_heads,
            *common,
        ),
        "video_cross": RopeSpec(
            config.audio_cross_attention_dim, (cross_base,), config.num_attention_heads, *common
        ),
        "audio_cross": RopeSpec(
            config.audio_cross_attention_dim,
            (cross_base,),
            config.audio_num_attention_heads,
            *common,
        ),
    }


def rotate(x_bld: jax.Array, rope) -> jax.Array:
    """RoPE on the whole width of ``x`` [B, L, D] (before the heads split): interleaved pairs
    for [B, L, D/2] tables, split halves per head chunk for [B, L, H, r] tables; float32."""
    cos, sin = rope
    if cos.ndim == 3:
        return rotate_across_heads(x_bld, cos, sin)
    b, length, d = x_bld.shape
    halves = x_bld.astype(jnp.float32).reshape(b, length, cos.shape[2], 2, -1)
    first, second = halves[..., 0, :], halves[..., 1, :]
    out = jnp.stack([first * cos - sin * second, second * cos + sin * first], axis=-2)
    return out.reshape(b, length, d).astype(x_bld.dtype)


def lerp(start: jax.Array, end: jax.Array, weight: jax.Array) -> jax.Array:
    """``torch.lerp`` (its two-sided formula: exactly ``start`` at weight 0, ``end`` at 1)."""
    diff = end - start
    return jnp.where(weight < 0.5, start + weight * diff, end - diff * (1.0 - weight))


# ----------------------------------------------------------------------------------------------
# Layers
# ----------------------------------------------------------------------------------------------

_BATCH_LENGTH_EMBED = ("activation_batch", "activation_length", "activation_embed")
_KV_EMBED = ("activation_batch", "activation_kv_length", "activation_embed")
_BATCH_LENGTH_HEADS = ("activation_batch", "activation_length", "activation_heads", "activation_kv")
_KV_HEADS = ("activation_batch", "activation_kv_length", "activation_heads", "activation_kv")


def _table(module: nn.Module, name: str, rows: int, dim: int, param_dtype, stddev: float):
    """A learnt modulation table [rows, D] (diffusers: ``randn(rows, D)``, some over sqrt(D))."""
    init = nn.with_logical_partitioning(
        nn.initializers.normal(stddev=stddev), ("modulation", "embed")
    )
    return module.param(name, init, (rows, dim), param_dtype)


def _split_modulation(table_nd: jax.Array, temb_btnd: jax.Array) -> list[jax.Array]:
    """``table + temb`` in float32 (``get_mod_params``), [B, T, n, D] split into n x [B, T, D]."""
    mod = table_nd.astype(jnp.float32) + temb_btnd.astype(jnp.float32)
    return [mod[:, :, i] for i in range(table_nd.shape[0])]


class AdaLayerNormSingle(nn.Module):
    """diffusers ``LTX2AdaLayerNormSingle`` in float32: timesteps [B, T] -> (``modulations``-way
    projection [B, T, n, D], embedded timestep [B, T, D])."""

    dim: int
    modulations: int
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, timestep_bt: jax.Array):
        b, t = timestep_bt.shape
        t_freq = timestep_embedding(timestep_bt.reshape(-1), TIMESTEP_CHANNELS)
        emb = MLP2(
            self.dim,
            self.dim,
            nn.silu,
            (None, "embed"),
            ("embed", None),
            dtype=jnp.float32,
            param_dtype=self.param_dtype,
            name="timestep_embedder",
        )(t_freq)
        axes = ("embed", "modulation")
        proj = dense(self.modulations * self.dim, axes, "linear", jnp.float32, self.param_dtype)
        return proj(nn.silu(emb)).reshape(b, t, self.modulations, self.dim), emb.reshape(b, t, -1)


class LTX2Attention(nn.Module):
    """diffusers ``LTX2Attention``: q [B, Lq, query width] attends to ``context`` (itself when
    None) with ``heads`` x ``head_dim``; q/k RMSNorm across heads; ``q_rope`` / ``k_rope`` tables
    (``k_rope`` defaults to ``q_rope``); per-head gates with ``gated``; output at ``out_dim``.

    ``perturb`` (STG, ``LTX2PerturbedAttnProcessor``): ``PERTURB_ALL`` returns the value
    projection instead of the attention, ``PERTURB_BY_MASK`` ``lerp(v, attention, weight)`` with
    ``weight`` [B, 1, 1]."""

    heads: int
    head_dim: int
    out_dim: int
    bias: bool = True
    out_bias: bool = True
    gated: bool = False
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    attention: str = "dot_product"
    mesh: Any = None
    perturb: str = NO_PERTURBATION

    def _project(self, name: str, features: int, axes, use_bias: bool, source):
        layer = Dense(
            features,
            axes,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            use_bias=use_bias,
            name=name,
        )
        return layer(source)

    def _attend(self, x, source, q_rope, k_rope):
        """q and k: projected, RMS-normalised across heads, rotated."""
        inner = self.heads * self.head_dim
        q = self._project("to_q", inner, ("embed", "heads"), self.bias, x)
        k = self._project("to_k", inner, ("embed", "heads"), self.bias, source)
        q = RMSNorm(QK_NORM_EPS, self.dtype, self.param_dtype, name="norm_q")(q)
        k = RMSNorm(QK_NORM_EPS, self.dtype, self.param_dtype, name="norm_k")(k)
        if q_rope is not None:
            q, k = rotate(q, q_rope), rotate(k, q_rope if k_rope is None else k_rope)
        return q, k

    @nn.compact
    def __call__(self, x, context=None, q_rope=None, k_rope=None, kv_mask=None, weight=None):
        source = x if context is None else context
        kv_axes = _BATCH_LENGTH_HEADS if context is None else _KV_HEADS
        inner = self.heads * self.head_dim
        v = self._project("to_v", inner, ("embed", "heads"), self.bias, source)
        if self.perturb == PERTURB_ALL:
            out = v
        else:
            q, k = self._attend(x, source, q_rope, k_rope)

            def split_heads(t, axes):
                return sharding.constrain(t.reshape(*t.shape[:2], self.heads, -1), axes)

            out = attention_fn(
                split_heads(q, _BATCH_LENGTH_HEADS),
                split_heads(k, kv_axes),
                split_heads(v, kv_axes),
                backend=self.attention,
                kv_mask=kv_mask,
                mesh=self.mesh,
            )
            out = sharding.constrain(out, _BATCH_LENGTH_HEADS).reshape(*out.shape[:2], -1)
            if self.perturb == PERTURB_BY_MASK:
                out = lerp(v, out, weight.astype(out.dtype))
        if self.gated:
            logits = self._project("to_gate_logits", self.heads, ("embed", None), True, x)
            gates = 2.0 * jax.nn.sigmoid(logits.astype(jnp.float32))
            out = out.reshape(*out.shape[:2], self.heads, -1) * gates[..., None].astype(out.dtype)
            out = out.reshape(*out.shape[:2], -1)
        out = self._project("to_out", self.out_dim, ("heads", "embed"), self.out_bias, out)
        return sharding.constrain(out, _BATCH_LENGTH_EMBED)


class FeedForward(nn.Module):
    """Linear(D, 4D) -> GELU -> Linear(4D, D) (diffusers FeedForward, ``bias`` on both)."""

    dim: int
    activation_fn: str
    bias: bool = True
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x_bld):
        def layer(features, axes, name):
            kw = dict(dtype=self.dtype, param_dtype=self.param_dtype, use_bias=self.bias)
            return Dense(features, axes, name=name, **kw)

        h = layer(MLP_RATIO * self.dim, ("embed", "mlp"), "proj_in")(x_bld)
        h = ACTIVATIONS[self.activation_fn](h)
        h = sharding.constrain(h, ("activation_batch", "activation_length", "activation_mlp"))
        return sharding.constrain(
            layer(self.dim, ("mlp", "embed"), "proj_out")(h), _BATCH_LENGTH_EMBED
        )


class Conditioning(NamedTuple):
    """What one modality's stream needs in every block (arrays, or None where unused)."""

    temb: jax.Array  # [B, T, modulations, D]
    cross_scale_shift: jax.Array  # [B, T, 4, D]
    cross_gate: jax.Array  # [B, T, 1, D]
    prompt_temb: jax.Array | None  # [B, T, 2, D] (cross_attn_mod with prompt_adaln) or None
    context: jax.Array  # captions at the text attention's key width [B, S, C]
    kv_mask: jax.Array | None  # [B, S] booleans
    rope: tuple  # self-attention (cos, sin)
    cross_rope: tuple  # audio<->video attention (cos, sin), frame axis only


class LTX2Block(nn.Module):
    """One transformer block (diffusers ``LTX2VideoTransformerBlock``): both streams in, both
    out. ``perturb``: this block's STG mode (its self-attentions); ``cross_modal``: False runs
    no audio<->video attention (``isolate_modalities``)."""

    config: LTX2VideoTransformerConfig
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    attention: str = "dot_product"
    mesh: Any = None
    perturb: str = NO_PERTURBATION
    cross_modal: bool = True

    def _norm(self, name: str, x_bld: jax.Array) -> jax.Array:
        """diffusers' ``RMSNorm(D, norm_eps, norm_elementwise_affine)``, float32 out."""
        cfg = self.config
        x32 = x_bld.astype(jnp.float32)
        if cfg.norm_elementwise_affine:
            return RMSNorm(cfg.norm_eps, jnp.float32, self.param_dtype, name=name)(x32)
        return rms_norm(x32, jnp.ones((x32.shape[-1],), jnp.float32), cfg.norm_eps)

    def _attention(self, name: str, stream: Stream, heads: Stream, perturb=NO_PERTURBATION):
        """An LTX2Attention with ``heads``' head geometry writing ``stream``'s width."""
        cfg = self.config
        return LTX2Attention(
            heads.heads,
            heads.head_dim,
            stream.dim,
            cfg.attention_bias,
            cfg.attention_out_bias,
            stream.gated_attn,
            self.dtype,
            self.param_dtype,
            self.attention,
            self.mesh,
            perturb,
            name=name,
        )

    def _modulations(self, stream: Stream, temb) -> list[jax.Array]:
        table = _table(
            self,
            f"{stream.prefix}scale_shift_table",
            stream.modulations,
            stream.dim,
            self.param_dtype,
            stream.dim**-0.5,
        )
        return _split_modulation(table, temb)

    def _self_attention(self, stream: Stream, x, mod, cond: Conditioning, weight):
        shift, scale, gate = mod[0], mod[1], mod[2]
        h = scale_shift(self._norm(f"{stream.prefix}norm1", x), scale, shift).astype(self.dtype)
        attn = self._attention(f"{stream.prefix}attn1", stream, stream, self.perturb)
        h = attn(h, q_rope=cond.rope, weight=weight)
        return sharding.constrain(gated_add(x, h, gate).astype(self.dtype), _BATCH_LENGTH_EMBED)

    def _prompt(self, stream: Stream, cond: Conditioning):
        """The captions, modulated by the prompt table (+ sigma's embedding) with cross_attn_mod."""
        if not self.config.prompt_modulation:
            return cond.context
        table = _table(
            self, f"{stream.prefix}prompt_scale_shift_table", 2, stream.dim, self.param_dtype, 1.0
        )
        if cond.prompt_temb is None:  # use_prompt_adaln_single=False: the static table alone
            shift, scale = (row[None, None] for row in table.astype(jnp.float32))
        else:
            shift, scale = _split_modulation(table, cond.prompt_temb)
        context = cond.context.astype(jnp.float32) * (1.0 + scale) + shift
        return context.astype(self.dtype)

    def _text_attention(self, stream: Stream, x, mod, cond: Conditioning):
        h = self._norm(f"{stream.prefix}norm2", x)
        if stream.cross_attn_mod:
            h = scale_shift(h, mod[7], mod[6])
        attn = self._attention(f"{stream.prefix}attn2", stream, stream)
        h = attn(h.astype(self.dtype), self._prompt(stream, cond), kv_mask=cond.kv_mask)
        if stream.cross_attn_mod:
            return gated_add(x, h, mod[8]).astype(self.dtype)
        return (x.astype(jnp.float32) + h.astype(jnp.float32)).astype(self.dtype)

    def _cross_modal_tables(self, stream: Stream, cond: Conditioning):
        """(a2v scale, a2v shift, v2a scale, v2a shift, gate) of one side."""
        table = _table(
            self,
            f"{stream.name}_a2v_cross_attn_scale_shift_table",
            CROSS_MODAL_SCALE_SHIFTS + 1,
            stream.dim,
            self.param_dtype,
            1.0,
        )
        scale_shifts = _split_modulation(table[:CROSS_MODAL_SCALE_SHIFTS], cond.cross_scale_shift)
        (gate,) = _split_modulation(table[CROSS_MODAL_SCALE_SHIFTS:], cond.cross_gate)
        return (*scale_shifts, gate)

    def _cross_modal(self, video_x, audio_x, video: Conditioning, audio: Conditioning):
        """Audio->video then video->audio attention, both from the norms taken before either."""
        cfg = self.config
        norm_v = self._norm("audio_to_video_norm", video_x)
        norm_a = self._norm("video_to_audio_norm", audio_x)
        v_a2v_scale, v_a2v_shift, v_v2a_scale, v_v2a_shift, a2v_gate = self._cross_modal_tables(
            cfg.video, video
        )
        a_a2v_scale, a_a2v_shift, a_v2a_scale, a_v2a_shift, v2a_gate = self._cross_modal_tables(
            cfg.audio, audio
        )

        def modulated(norm, scale, shift):
            return scale_shift(norm, scale, shift).astype(self.dtype)

        a2v = self._attention("audio_to_video_attn", cfg.video, cfg.audio)
        h = a2v(
            modulated(norm_v, v_a2v_scale, v_a2v_shift),
            modulated(norm_a, a_a2v_scale, a_a2v_shift),
            q_rope=video.cross_rope,
            k_rope=audio.cross_rope,
        )
        new_video = gated_add(video_x, h, a2v_gate).astype(self.dtype)
        v2a = self._attention("video_to_audio_attn", cfg.audio, cfg.audio)
        h = v2a(
            modulated(norm_a, a_v2a_scale, a_v2a_shift),
            modulated(norm_v, v_v2a_scale, v_v2a_shift),
            q_rope=audio.cross_rope,
            k_rope=video.cross_rope,
        )
        new_audio = gated_add(audio_x, h, v2a_gate).astype(self.dtype)
        return new_video, new_audio

    def _feed_forward(self, stream: Stream, x, mod):
        cfg = self.config
        shift, scale, gate = mod[3], mod[4], mod[5]
        h = scale_shift(self._norm(f"{stream.prefix}norm3", x), scale, shift).astype(self.dtype)
        ff = FeedForward(
            stream.dim,
            cfg.activation_fn,
            stream.ff_bias,
            self.dtype,
            self.param_dtype,
            name=f"{stream.prefix}ff",
        )
        return sharding.constrain(gated_add(x, ff(h), gate).astype(self.dtype), _BATCH_LENGTH_EMBED)

    @nn.compact
    def __call__(self, video_x, audio_x, video: Conditioning, audio: Conditioning, weight=None):
        cfg = self.config
        video_x = checkpoint_name(video_x, BLOCK_INPUT)  # what an offloading remat policy keeps
        audio_x = checkpoint_name(audio_x, BLOCK_INPUT)
        video_mod = self._modulations(cfg.video, video.temb)
        audio_mod = self._modulations(cfg.audio, audio.temb)
        video_x = self._self_attention(cfg.video, video_x, video_mod, video, weight)
        audio_x = self._self_attention(cfg.audio, audio_x, audio_mod, audio, weight)
        video_x = self._text_attention(cfg.video, video_x, video_mod, video)
        audio_x = self._text_attention(cfg.audio, audio_x, audio_mod, audio)
        if self.cross_modal:
            video_x, audio_x = self._cross_modal(video_x, audio_x, video, audio)
        video_x = self._feed_forward(cfg.video, video_x, video_mod)
        audio_x = self._feed_forward(cfg.audio, audio_x, audio_mod)
        return video_x, audio_x


def _perturbation(config, blocks, perturbation_mask):
    """(STG mode of the listed blocks, weight [B, 1, 1] or None), as diffusers decides it: no
    mask means every sample perturbed; a concrete all-zero mask too (diffusers' ``all_perturbed``
    shortcut); otherwise ``lerp`` by the mask. A model without ``perturbed_attn`` perturbs
    nothing (diffusers' default processor takes no mask)."""
    if not blocks or not config.perturbed_attn:
        return NO_PERTURBATION, None
    if perturbation_mask is None:
        return PERTURB_ALL, None
    if not isinstance(perturbation_mask, jax.core.Tracer) and not np.any(
        np.asarray(perturbation_mask)
    ):
        return PERTURB_ALL, None
    weight = jnp.asarray(perturbation_mask, jnp.float32)
    return PERTURB_BY_MASK, weight.reshape(weight.shape[0], 1, 1)


def _segments(modes: Sequence[str]) -> list[tuple[int, int, str]]:
    """Maximal runs [start, stop) of consecutive blocks with the same STG mode."""
    runs: list[tuple[int, int, str]] = []
    for i, mode in enumerate(modes):
        if runs and runs[-1][2] == mode:
            runs[-1] = (runs[-1][0], i + 1, mode)
        else:
            runs.append((i, i + 1, mode))
    return runs


def _check_timestep(name: str, t, batch: int, tokens: int | None) -> None:
    allowed = [(batch,), (batch, 1)] + ([] if tokens is None else [(batch, tokens)])
    if tuple(t.shape) not in allowed:
        per_token = "" if tokens is None else f" or [B, L]=[{batch}, {tokens}] (one per token)"
        raise ValueError(
            f"{name} must be [B]=[{batch}] or [B, 1] (one per sample){per_token}, "
            f"got shape {tuple(t.shape)}"
        )


def _check_coords(name: str, coords, batch: int, axes: int, tokens: int) -> None:
    shape = tuple(coords.shape)
    if shape not in ((batch, axes, tokens, 2), (batch, axes, tokens)):
        raise ValueError(
            f"{name} must be [B, {axes}, L, 2] bounds or [B, {axes}, L] positions with "
            f"B={batch}, L={tokens}, got shape {shape}"
        )


def _is_int(n) -> bool:
    return isinstance(n, (int, np.integer))


class LTX2VideoTransformer(nn.Module):
    """LTX-2 transformer (= diffusers LTX2VideoTransformer3DModel.forward, return_dict=False)::

        (hidden_states [B, Lv, in_channels], audio_hidden_states [B, La, audio_in_channels],
         encoder_hidden_states [B, S, caption_channels] (cross_attention_dim without
         use_prompt_embeddings), audio_encoder_hidden_states [B, S', caption_channels] (or
         audio_cross_attention_dim), timestep [B] | [B, 1] | [B, Lv], audio_timestep (default
         timestep) [B] | [B, 1] | [B, La], sigma / audio_sigma [B] | [B, 1] (needed by
         cross_attn_mod models and use_cross_timestep), encoder_attention_mask /
         audio_encoder_attention_mask [B, S] (1 = attend), positions (below),
         isolate_modalities, spatio_temporal_guidance_blocks, perturbation_mask [B] | [B, 1, 1],
         use_cross_timestep, video_keyframes_mask [B, Lv, 1], layer_perturbation [B, layers])
        -> (video prediction [B, Lv, out_channels], audio prediction [B, La, audio_out_channels])

    Positions: ``video_coords`` [B, 3, Lv, 2] and ``audio_coords`` [B, 1, La, 2] as the
    pipelines pass them (:func:`video_coords`, :func:`audio_coords`), or else built here from
    ``num_frames`` / ``height`` / ``width`` / ``fps`` and ``audio_num_frames`` (Python values,
    static under jit). Numpy coordinates (close over them under jit) give host RoPE tables;
    traced ones are computed in the graph. Flags and block lists are Python values.

    ``layer_perturbation`` (not in diffusers; what a render's STG pass needs when its block list
    comes from data): per row and block the self-attentions' ``lerp`` weight, 0 = perturbed (the
    value projection), 1 = the attention, traced, so one compiled pass serves any block set
    (diffusers' ``spatio_temporal_guidance_blocks=S`` equals a row of 0 at S, 1 elsewhere: the
    two-sided lerp is exact at both ends). Ignored without ``perturbed_attn``, as diffusers.
    """

    config: LTX2VideoTransformerConfig
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    attention: str = "dot_product"
    mesh: Any = None
    remat_policy: str = "none"
    scan_layers: bool = False  # runs of like blocks as one lax.scan (jaxcore.compute.run_blocks)
    scanned_blocks: ClassVar[tuple[str, ...]] = ("transformer_blocks",)

    # -- inputs --------------------------------------------------------------------------------

    def _check_streams(self, video, audio, text, audio_text) -> None:
        cfg = self.config
        batch = video.shape[0]
        for name, x, channels in (
            ("hidden_states", video, cfg.in_channels),
            ("audio_hidden_states", audio, cfg.audio_in_channels),
        ):
            if x.ndim != 3 or (x.shape[0], x.shape[2]) != (batch, channels):
                raise ValueError(
                    f"{name} must be packed tokens [B={batch}, L, {channels}], got {tuple(x.shape)}"
                )
        widths = (
            (cfg.caption_channels, cfg.caption_channels)
            if cfg.use_prompt_embeddings
            else (cfg.cross_attention_dim, cfg.audio_cross_attention_dim)
        )
        for name, x, width in (
            ("encoder_hidden_states", text, widths[0]),
            ("audio_encoder_hidden_states", audio_text, widths[1]),
        ):
            if x.ndim != 3 or (x.shape[0], x.shape[2]) != (batch, width):
                raise ValueError(f"{name} must be [B={batch}, S, {width}], got {tuple(x.shape)}")

    def _check_conditioning(self, shapes, timesteps, masks, sigmas, use_cross_timestep) -> None:
        cfg = self.config
        batch, video_len, audio_len = shapes
        _check_timestep("timestep", timesteps[0], batch, video_len)
        _check_timestep("audio_timestep", timesteps[1], batch, audio_len)
        for name, mask, text_len in masks:
            if mask is not None and tuple(jnp.shape(mask)) != (batch, text_len):
                raise ValueError(
                    f"{name} must be [B, S]=[{batch}, {text_len}] (1 = attend), "
                    f"got shape {tuple(jnp.shape(mask))}"
                )
        for name, sigma in zip(("sigma", "audio_sigma"), sigmas, strict=True):
            if sigma is None and (cfg.prompt_adaln or use_cross_timestep):
                why = "use_cross_timestep" if use_cross_timestep else "cross_attn_mod"
                raise ValueError(f"{name} is required with {why} (diffusers reads it there)")
            if sigma is not None:
                _check_timestep(name, sigma, batch, None)

    def _check_positions(self, shapes, grid, fps, audio_frames, coords) -> None:
        cfg = self.config
        batch, video_len, audio_len = shapes
        if coords[0] is not None:
            _check_coords("video_coords", coords[0], batch, 3, video_len)
        else:
            if not all(_is_int(n) for n in grid):
                raise ValueError(
                    "num_frames, height and width (the latent grid, Python ints) are required "
                    f"without video_coords, got {grid}"
                )
            sizes = (cfg.patch_size_t, cfg.patch_size, cfg.patch_size)
            tokens = math.prod(-(-n // p) for n, p in zip(grid, sizes, strict=True))
            if tokens != video_len:
                raise ValueError(
                    f"num_frames x height x width = {grid} gives {tokens} tokens, "
                    f"hidden_states has {video_len}"
                )
            if isinstance(fps, jax.core.Tracer):
                raise ValueError("fps must be a Python number (static) without video_coords")
        if coords[1] is not None:
            _check_coords("audio_coords", coords[1], batch, 1, audio_len)
        elif not _is_int(audio_frames) or -(-audio_frames // cfg.audio_patch_size_t) != audio_len:
            raise ValueError(
                f"audio_num_frames (a Python int giving the {audio_len} audio tokens) is required "
                f"without audio_coords, got {audio_frames!r}"
            )

    def _check_guidance(self, batch, stg_blocks, perturbation_mask, keyframes, video_len):
        bad = [i for i in stg_blocks if not (_is_int(i) and 0 <= i < self.config.num_layers)]
        if bad:
            raise ValueError(
                f"spatio_temporal_guidance_blocks {bad} are not block indices "
                f"0..{self.config.num_layers - 1}"
            )
        if perturbation_mask is not None and tuple(jnp.shape(perturbation_mask)) not in (
            (batch,),
            (batch, 1, 1),
        ):
            raise ValueError(
                f"perturbation_mask must be [B]=[{batch}] or [B, 1, 1], "
                f"got shape {tuple(jnp.shape(perturbation_mask))}"
            )
        if keyframes is not None and tuple(jnp.shape(keyframes)) not in (
            (batch, video_len, 1),
            (batch, video_len),
        ):
            raise ValueError(
                f"video_keyframes_mask must be [B, Lv, 1]=[{batch}, {video_len}, 1], "
                f"got shape {tuple(jnp.shape(keyframes))}"
            )

    def _check_layer_perturbation(self, batch, stg_blocks, layer_perturbation) -> None:
        if layer_perturbation is None:
            return
        expected = (batch, self.config.num_layers)
        if tuple(jnp.shape(layer_perturbation)) != expected:
            raise ValueError(
                f"layer_perturbation must be [B, num_layers]={list(expected)}, "
                f"got shape {tuple(jnp.shape(layer_perturbation))}"
            )
        if stg_blocks:
            raise ValueError("give spatio_temporal_guidance_blocks or layer_perturbation, not both")

    def _positions(self, batch, grid, fps, audio_frames, coords):
        """(video coords, audio coords): the given ones, or built as the model's RoPE would."""
        cfg = self.config
        video, audio = coords
        if video is None:
            video = video_coords(
                batch,
                *grid,
                fps,
                patch_size=cfg.patch_size,
                patch_size_t=cfg.patch_size_t,
                scale_factors=cfg.vae_scale_factors,
                causal_offset=cfg.causal_offset,
            )
        if audio is None:
            audio = audio_coords(
                batch,
                audio_frames,
                patch_size_t=cfg.audio_patch_size_t,
                scale_factor=cfg.audio_scale_factor,
                sampling_rate=cfg.audio_sampling_rate,
                hop_length=cfg.audio_hop_length,
                causal_offset=cfg.causal_offset,
            )
        return video, audio

    def _ropes(self, video, audio) -> dict[str, tuple]:
        specs = _rope_specs(self.config)
        sources = {
            "video": video,
            "audio": audio,
            "video_cross": video[:, 0:1],
            "audio_cross": audio[:, 0:1],
        }
        return {name: rope_tables(sources[name], spec) for name, spec in specs.items()}

    # -- embeddings ----------------------------------------------------------------------------

    def _time_embeddings(self, timestep, audio_timestep, sigma, audio_sigma, use_cross_timestep):
        """Per modality: (block modulations, embedded timestep, cross-modal scale/shift,
        cross-modal gate, prompt modulation or None), each [B, T, n, D] / [B, T, D]."""
        cfg = self.config
        batch = timestep.shape[0]
        gate_factor = cfg.cross_attn_timestep_scale_multiplier / cfg.timestep_scale_multiplier

        def embed(name, dim, n, t):
            return AdaLayerNormSingle(dim, n, self.param_dtype, name=name)(
                jnp.asarray(t).reshape(batch, -1)
            )

        out = {}
        for stream, t, s, cross_t in (
            (cfg.video, timestep, sigma, audio_sigma if use_cross_timestep else timestep),
            (
                cfg.audio,
                audio_timestep,
                audio_sigma,
                sigma if use_cross_timestep else audio_timestep,
            ),
        ):
            p, d = stream.prefix, stream.dim
            temb, embedded = embed(f"{p}time_embed", d, stream.modulations, t)
            side = "video" if stream.name == "video" else "audio"
            gate_name = "video_a2v_gate" if side == "video" else "audio_v2a_gate"
            cross = embed(
                f"av_cross_attn_{side}_scale_shift", d, CROSS_MODAL_SCALE_SHIFTS, cross_t
            )[0]
            cross_t = jnp.asarray(cross_t).astype(jnp.float32) * gate_factor
            gate = embed(f"av_cross_attn_{gate_name}", d, 1, cross_t)[0]
            prompt = embed(f"{p}prompt_adaln", d, 2, s)[0] if cfg.prompt_adaln else None
            out[stream.name] = (temb, embedded, cross, gate, prompt)
        return out

    def _captions(self, stream: Stream, text):
        """Captions at the text attention's key width (``PixArtAlphaTextProjection``)."""
        if not self.config.use_prompt_embeddings:
            return sharding.constrain(text.astype(self.dtype), _KV_EMBED)
        context = MLP2(
            stream.dim,
            stream.dim,
            gelu_tanh,
            (None, "embed"),
            ("embed", None),
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            name=f"{stream.prefix}caption_projection",
        )(text.astype(self.dtype))
        return sharding.constrain(context, _KV_EMBED)

    def _embed_tokens(self, stream: Stream, tokens):
        axes = ("conv_in", "embed")
        proj = dense(stream.dim, axes, f"{stream.prefix}proj_in", self.dtype, self.param_dtype)
        return sharding.constrain(proj(tokens.astype(self.dtype)), _BATCH_LENGTH_EMBED)

    def _keyframes(self, x, keyframes_mask):
        """LTX-2.5's learnt embedding added to the tokens ``video_keyframes_mask`` marks."""
        if not self.config.use_keyframes_abs_pos_embedding:
            return x
        init = nn.with_logical_partitioning(nn.initializers.zeros_init(), (None, "embed"))
        embedding = self.param(
            "keyframes_abs_pos_embedding", init, (1, self.config.hidden_dim), self.param_dtype
        )
        if keyframes_mask is None:
            return x
        marker = (jnp.asarray(keyframes_mask) > 0).astype(x.dtype).reshape(*x.shape[:2], 1)
        return x + marker * embedding.astype(x.dtype)

    def _output(self, stream: Stream, x, embedded):
        table = _table(
            self,
            f"{stream.prefix}scale_shift_table",
            2,
            stream.dim,
            self.param_dtype,
            stream.dim**-0.5,
        )
        shift, scale = _split_modulation(table, embedded[:, :, None, :])
        x = scale_shift(layer_norm(x, OUT_NORM_EPS), scale, shift).astype(self.dtype)
        axes = ("embed", "conv_out")
        name = f"{stream.prefix}proj_out"
        return dense(stream.out_channels, axes, name, self.dtype, self.param_dtype)(x)

    # -- blocks --------------------------------------------------------------------------------

    def _run_blocks(self, streams, video, audio, modes, weight, cross_modal, layer_weights=None):
        """Both streams through the blocks: each run of blocks with the same STG mode as one
        :func:`jaxcore.compute.run_blocks` call (one scan with ``scan_layers``). With
        ``layer_weights`` [B, num_layers] (every block ``PERTURB_BY_MASK``) the blocks carry
        their index beside the streams and each takes its own column as its weight."""
        block_cls = remat_block(LTX2Block, self.remat_policy)
        common = (self.config, self.dtype, self.param_dtype, self.attention, self.mesh)
        blocks = [
            block_cls(*common, mode, cross_modal, name=f"transformer_blocks_{i}")
            for i, mode in enumerate(modes)
        ]

        def one_block(block, carry):
            if layer_weights is not None:
                *pair, index = carry
                column = jax.lax.dynamic_index_in_dim(layer_weights, index, 1, keepdims=False)
                return (*block(*pair, video, audio, column.reshape(-1, 1, 1)), index + 1)
            block_weight = weight if block.perturb == PERTURB_BY_MASK else None
            return block(*carry, video, audio, block_weight)

        if layer_weights is not None:
            streams = (*streams, jnp.zeros((), jnp.int32))

        for start, stop, mode in _segments(modes):
            template = (
                block_cls(*common, mode, cross_modal, parent=None) if self.scan_layers else None
            )
            streams = compute.run_blocks(self, blocks[start:stop], streams, one_block, template)
        return streams[:2]

    @nn.compact
    def __call__(
        self,
        hidden_states,
        audio_hidden_states,
        encoder_hidden_states,
        audio_encoder_hidden_states,
        timestep,
        audio_timestep=None,
        sigma=None,
        audio_sigma=None,
        encoder_attention_mask=None,
        audio_encoder_attention_mask=None,
        num_frames=None,
        height=None,
        width=None,
        fps=24.0,
        audio_num_frames=None,
        video_coords=None,
        audio_coords=None,
        isolate_modalities: bool = False,
        spatio_temporal_guidance_blocks: Sequence[int] | None = None,
        perturbation_mask=None,
        use_cross_timestep: bool = False,
        video_keyframes_mask=None,
        layer_perturbation=None,
    ):
        cfg = self.config
        timestep = jnp.asarray(timestep)
        audio_timestep = timestep if audio_timestep is None else jnp.asarray(audio_timestep)
        sigma = None if sigma is None else jnp.asarray(sigma)
        audio_sigma = sigma if audio_sigma is None else jnp.asarray(audio_sigma)
        stg_blocks = list(spatio_temporal_guidance_blocks or [])
        batch, video_len = hidden_states.shape[:2]
        shapes = (batch, video_len, audio_hidden_states.shape[1])
        grid, coords = (num_frames, height, width), (video_coords, audio_coords)
        self._check_streams(
            hidden_states, audio_hidden_states, encoder_hidden_states, audio_encoder_hidden_states
        )
        masks = (
            ("encoder_attention_mask", encoder_attention_mask, encoder_hidden_states.shape[1]),
            (
                "audio_encoder_attention_mask",
                audio_encoder_attention_mask,
                audio_encoder_hidden_states.shape[1],
            ),
        )
        self._check_conditioning(
            shapes, (timestep, audio_timestep), masks, (sigma, audio_sigma), use_cross_timestep
        )
        self._check_positions(shapes, grid, fps, audio_num_frames, coords)
        self._check_guidance(batch, stg_blocks, perturbation_mask, video_keyframes_mask, video_len)
        self._check_layer_perturbation(batch, stg_blocks, layer_perturbation)
        if self.mesh is not None:  # both streams' heads split over the tensor axis
            sharding.check_divisible(self.mesh, batch=batch, heads=cfg.num_attention_heads)
            sharding.check_divisible(self.mesh, heads=cfg.audio_num_attention_heads)

        ropes = self._ropes(*self._positions(batch, grid, fps, audio_num_frames, coords))
        times = self._time_embeddings(
            timestep, audio_timestep, sigma, audio_sigma, use_cross_timestep
        )
        conditioning = {}
        for stream, text, mask in (
            (cfg.video, encoder_hidden_states, encoder_attention_mask),
            (cfg.audio, audio_encoder_hidden_states, audio_encoder_attention_mask),
        ):
            temb, _, cross, gate, prompt = times[stream.name]
            conditioning[stream.name] = Conditioning(
                temb,
                cross,
                gate,
                prompt,
                self._captions(stream, text),
                encoder_kv_mask(mask),
                ropes[stream.name],
                ropes[f"{stream.name}_cross"],
            )

        x = self._keyframes(self._embed_tokens(cfg.video, hidden_states), video_keyframes_mask)
        a = self._embed_tokens(cfg.audio, audio_hidden_states)
        mode, weight = _perturbation(cfg, stg_blocks, perturbation_mask)
        modes = [mode if i in stg_blocks else NO_PERTURBATION for i in range(cfg.num_layers)]
        layer_weights = None
        if layer_perturbation is not None and cfg.perturbed_attn:  # diffusers: no STG without
            modes = [PERTURB_BY_MASK] * cfg.num_layers
            layer_weights = jnp.asarray(layer_perturbation, jnp.float32)
        x, a = self._run_blocks(
            (x, a),
            conditioning["video"],
            conditioning["audio"],
            modes,
            weight,
            not isolate_modalities,
            layer_weights,
        )
        video_out = self._output(cfg.video, x, times["video"][1])
        audio_out = self._output(cfg.audio, a, times["audio"][1])
        return video_out, audio_out


# ----------------------------------------------------------------------------------------------
# Weights: diffusers checkpoint <-> flax params
# ----------------------------------------------------------------------------------------------


def _dense_entries(flax_prefix: tuple[str, ...], torch_prefix: str, bias: bool = True) -> dict:
    entries = {(*flax_prefix, "kernel"): (f"{torch_prefix}.weight", weights.linear)}
    if bias:
        entries[(*flax_prefix, "bias")] = (f"{torch_prefix}.bias", weights.identity)
    return entries


def _same_name(*names: str) -> dict:
    """Parameters whose flax path is their diffusers key split at the dots (tables, norms)."""
    out = {}
    for name in names:
        path = tuple(name.split("."))
        out[path] = (name, weights.identity)
    return out


def _attention_entries(flax_block: str, torch_block: str, name: str, config, gated: bool) -> dict:
    flax, torch = (flax_block, name), f"{torch_block}.{name}"
    entries: dict = {}
    for proj in ("to_q", "to_k", "to_v"):
        entries |= _dense_entries((*flax, proj), f"{torch}.{proj}", config.attention_bias)
    entries |= _dense_entries((*flax, "to_out"), f"{torch}.to_out.0", config.attention_out_bias)
    if gated:
        entries |= _dense_entries((*flax, "to_gate_logits"), f"{torch}.to_gate_logits")
    for norm in ("norm_q", "norm_k"):
        entries[(*flax, norm, "scale")] = (f"{torch}.{norm}.weight", weights.identity)
    return entries


def _block_entries(i: int, config: LTX2VideoTransformerConfig) -> dict:
    flax, torch = f"transformer_blocks_{i}", f"transformer_blocks.{i}"
    video, audio = config.video, config.audio
    entries: dict = {}
    tables = [
        "scale_shift_table",
        "audio_scale_shift_table",
        "video_a2v_cross_attn_scale_shift_table",
        "audio_a2v_cross_attn_scale_shift_table",
    ]
    if config.prompt_modulation:
        tables += ["prompt_scale_shift_table", "audio_prompt_scale_shift_table"]
    for table in tables:
        entries[(flax, table)] = (f"{torch}.{table}", weights.identity)
    attentions = (
        ("attn1", video.gated_attn),
        ("attn2", video.gated_attn),
        ("audio_attn1", audio.gated_attn),
        ("audio_attn2", audio.gated_attn),
        ("audio_to_video_attn", video.gated_attn),
        ("video_to_audio_attn", audio.gated_attn),
    )
    for name, gated in attentions:
        entries |= _attention_entries(flax, torch, name, config, gated)
    if config.norm_elementwise_affine:
        for norm in (
            "norm1",
            "norm2",
            "norm3",
            "audio_to_video_norm",
            "video_to_audio_norm",
            "audio_norm1",
            "audio_norm2",
            "audio_norm3",
        ):
            entries[(flax, norm, "scale")] = (f"{torch}.{norm}.weight", weights.identity)
    for stream in (video, audio):
        ff = f"{stream.prefix}ff"
        entries |= _dense_entries((flax, ff, "proj_in"), f"{torch}.{ff}.net.0.proj", stream.ff_bias)
        entries |= _dense_entries((flax, ff, "proj_out"), f"{torch}.{ff}.net.2", stream.ff_bias)
    return entries


def _time_embed_entries(name: str) -> dict:
    entries: dict = {}
    for lin in ("linear_1", "linear_2"):
        entries |= _dense_entries(
            (name, "timestep_embedder", lin), f"{name}.emb.timestep_embedder.{lin}"
        )
    return entries | _dense_entries((name, "linear"), f"{name}.linear")


def weight_map(config: LTX2VideoTransformerConfig) -> dict:
    """{flax param path: (diffusers key, transform)} for every parameter of the model."""
    entries = _same_name("scale_shift_table", "audio_scale_shift_table")
    embeds = ["time_embed", "audio_time_embed"]
    embeds += [
        f"av_cross_attn_{side}"
        for side in ("video_scale_shift", "audio_scale_shift", "video_a2v_gate", "audio_v2a_gate")
    ]
    if config.prompt_adaln:
        embeds += ["prompt_adaln", "audio_prompt_adaln"]
    for name in embeds:
        entries |= _time_embed_entries(name)
    for prefix in ("", "audio_"):
        entries |= _dense_entries((f"{prefix}proj_in",), f"{prefix}proj_in")
        entries |= _dense_entries((f"{prefix}proj_out",), f"{prefix}proj_out")
        if config.use_prompt_embeddings:
            for lin in ("linear_1", "linear_2"):
                name = f"{prefix}caption_projection"
                entries |= _dense_entries((name, lin), f"{name}.{lin}")
    if config.use_keyframes_abs_pos_embedding:
        entries |= _same_name("keyframes_abs_pos_embedding")
    for i in range(config.num_layers):
        entries |= _block_entries(i, config)
    return entries


def _dummy_inputs(config: LTX2VideoTransformerConfig, batch: int = 1):
    """Smallest valid inputs (one token per stream, one caption token; positions as traced
    coordinates, since the loaders pass arrays only) for init / eval_shape, in
    :func:`_trace_forward`'s order."""
    f32 = jnp.float32
    widths = (
        (config.caption_channels, config.caption_channels)
        if config.use_prompt_embeddings
        else (config.cross_attention_dim, config.audio_cross_attention_dim)
    )
    return (
        jax.ShapeDtypeStruct((batch, 1, config.in_channels), f32),
        jax.ShapeDtypeStruct((batch, 1, config.audio_in_channels), f32),
        jax.ShapeDtypeStruct((batch, 1, widths[0]), f32),
        jax.ShapeDtypeStruct((batch, 1, widths[1]), f32),
        jax.ShapeDtypeStruct((batch,), f32),  # timestep
        jax.ShapeDtypeStruct((batch,), f32),  # sigma
        jax.ShapeDtypeStruct((batch, 3, 1, 2), f32),  # video_coords
        jax.ShapeDtypeStruct((batch, 1, 1, 2), f32),  # audio_coords
    )


def _trace_forward(module, video, audio, text, audio_text, timestep, sigma, vcoords, acoords):
    """The forward on :func:`_dummy_inputs` (keywords past the leading arrays)."""
    return module(
        video,
        audio,
        text,
        audio_text,
        timestep,
        sigma=sigma,
        video_coords=vcoords,
        audio_coords=acoords,
    )


# build / load / init / shape / count: one definition for every model (jaxcore.weights.ModelKind)
KIND = weights.ModelKind(
    LTX2VideoTransformer,
    LTX2VideoTransformerConfig,
    _dummy_inputs,
    lambda config, boxed: weight_map(config),
    trace_method=_trace_forward,
)
abstract_params = KIND.abstract_params
load_ltx2_transformer = KIND.load  # a diffusers LTX2VideoTransformer3DModel directory
init_ltx2_transformer = KIND.init
count_params = KIND.count_params


# ----------------------------------------------------------------------------------------------
# FLOPs (MFU, difforge fit)
# ----------------------------------------------------------------------------------------------


class AttentionMatmuls(NamedTuple):
    """One attention of a block as its matmuls see it: ``queries`` tokens at ``query_width``
    attend to ``keys`` tokens at ``key_width`` through ``inner`` = heads x head dim, written
    back at ``out_width``; ``gate_heads`` per-head gate logits from the queries (0: none)."""

    queries: int
    keys: int
    query_width: int
    key_width: int
    inner: int
    out_width: int
    gate_heads: int

    @property
    def projections(self) -> int:
        """q, k, v, the output projection and the gate logits: 2 x tokens x in x out each."""
        q = self.queries * self.query_width * self.inner
        kv = 2 * self.keys * self.key_width * self.inner
        out = self.queries * self.inner * self.out_width
        gates = self.queries * self.query_width * self.gate_heads
        return 2 * (q + kv + out + gates)

    @property
    def scores_and_values(self) -> int:
        """QK^T and PV: 2 x 2 x queries x keys x inner (what a fused kernel runs)."""
        return 2 * 2 * self.queries * self.keys * self.inner


def block_attentions(
    config: LTX2VideoTransformerConfig,
    video_tokens: int,
    audio_tokens: int,
    text_tokens: int,
    audio_text_tokens: int,
    cross_modal: bool = True,
) -> list[AttentionMatmuls]:
    """The attentions of one :class:`LTX2Block`, in its order: video and audio
    self-attention, video and audio text cross-attention (keys: the captions at the text
    attention's width, ``context_dim``, where the caption projection or LTX-2.3's connectors
    put them), then with ``cross_modal`` audio->video (video queries, audio keys, the audio's
    heads, written at the video width) and video->audio (audio queries, video keys). A
    stream's ``gated_attn`` gates every attention that writes into it, one logit per head of
    that attention."""
    video, audio = config.video, config.audio

    def gates(stream: Stream, heads: Stream) -> int:
        return heads.heads if stream.gated_attn else 0

    s, a = video_tokens, audio_tokens
    d, da = video.dim, audio.dim
    attentions = [
        AttentionMatmuls(s, s, d, d, d, d, gates(video, video)),
        AttentionMatmuls(a, a, da, da, da, da, gates(audio, audio)),
        AttentionMatmuls(s, text_tokens, d, video.context_dim, d, d, gates(video, video)),
        AttentionMatmuls(a, audio_text_tokens, da, audio.context_dim, da, da, gates(audio, audio)),
    ]
    if cross_modal:
        attentions += [
            AttentionMatmuls(s, a, d, da, da, d, gates(video, audio)),
            AttentionMatmuls(a, s, da, d, da, da, gates(audio, audio)),
        ]
    return attentions


def flops_per_forward(
    config: LTX2VideoTransformerConfig,
    batch: int,
    video_tokens: int,
    audio_tokens: int,
    text_tokens: int,
    audio_text_tokens: int | None = None,
    cross_modal: bool = True,
) -> int:
    """Matmul FLOPs of one forward pass of the blocks (one transformer call), for MFU.

    Per block (``num_layers`` of them), with s video and a audio tokens, L / L_a caption tokens
    (``audio_text_tokens`` default: ``text_tokens``, the pipeline gives both modalities one
    length), D / D_a the video / audio widths, each attention of :func:`block_attentions`:
    projections (q from its queries, k and v from its keys, the output, LTX-2.3's gate
    logits) 2 x tokens x in x out each, scores + values 2 x 2 x queries x keys x inner; and
    both FFNs 2 x 2 x tokens x D x 4D. ``cross_modal=False`` is ``isolate_modalities`` (no
    audio<->video attention). STG's perturbed blocks are not counted (no family runs them).

    Left out (each small beside the blocks at a render's size): ``proj_in`` / ``proj_out``,
    the caption projections (2 x L x (caption_channels x D + D^2) per stream), the timestep
    embeddings (per row, not per token), norms, RoPE and every other elementwise op; the
    Gemma-3 encoder and the text connectors run outside the denoiser. Guidance passes
    (CFG's negative rows, modality guidance's isolated pass) are further forwards: whoever
    counts forwards counts them. Training = 3x this.
    """
    text = text_tokens
    audio_text = text_tokens if audio_text_tokens is None else audio_text_tokens
    attentions = block_attentions(config, video_tokens, audio_tokens, text, audio_text, cross_modal)
    attention = sum(att.projections + att.scores_and_values for att in attentions)
    ffn = (
        2
        * 2
        * MLP_RATIO
        * (video_tokens * config.hidden_dim**2 + audio_tokens * config.audio_hidden_dim**2)
    )
    return batch * config.num_layers * (attention + ffn)


def attention_flops_per_forward(
    config: LTX2VideoTransformerConfig,
    batch: int,
    video_tokens: int,
    audio_tokens: int,
    text_tokens: int,
    audio_text_tokens: int | None = None,
    cross_modal: bool = True,
) -> int:
    """The scores and values of every attention of :func:`flops_per_forward` (self, text and
    cross-modal: all of them run through the attention backend, so the splash kernel on TPU,
    where the compiler's cost model does not see)."""
    audio_text = text_tokens if audio_text_tokens is None else audio_text_tokens
    attentions = block_attentions(
        config, video_tokens, audio_tokens, text_tokens, audio_text, cross_modal
    )
    return batch * config.num_layers * sum(att.scores_and_values for att in attentions)
