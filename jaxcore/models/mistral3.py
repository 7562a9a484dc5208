"""The Mistral-3 text encoder of FLUX.2 [dev] in Flax linen (= the language model of transformers
``Mistral3ForConditionalGeneration``, a ``MistralModel``), and the prompt embedding of
diffusers' ``Flux2Pipeline``.

References: ``transformers/models/mistral/modeling_mistral.py``,
``transformers/models/mistral3/modeling_mistral3.py`` (transformers 5.x) and
``diffusers/pipelines/flux2/pipeline_flux2.py`` (``format_input`` and
``_get_mistral_3_small_prompt_embeds``; the system message from ``system_messages.py``).

The network: token embedding, then per layer (pre-norm) ``x + attn(rms(x))`` and
``x + mlp(rms(x))``. Attention: bias-free q/k/v/o projections, rotate-half RoPE with
``rope_theta`` at positions ``0..L-1`` (transformers' default ``position_ids``, whatever the
padding), grouped-query attention (``num_key_value_heads`` shared by the q heads in order),
scale ``head_dim ** -0.5``, the causal mask (a band of ``sliding_window`` keys when the config
sets one, as ``create_sliding_window_causal_mask``) AND the padding mask on keys. SwiGLU MLP
``down(silu(gate x) * up x)``. RMSNorm statistics in float32, weight applied in the activation
dtype, as ``MistralRMSNorm``. Unlike Qwen3 there are no q/k norms and ``head_dim`` may be
absent (``hidden_size // num_attention_heads``).

``hidden_states`` are numbered as transformers' ``output_hidden_states``: index 0 is the
embedding, index k < N the output of layer k (1-based), and index N (the last layer) has the
final ``norm`` applied (= ``last_hidden_state``). A query with no visible key (a left pad
before any real token) gets a zero attention output, as torch's SDPA gives for a fully masked
row.

RoPE: ``rope_type`` "default" (Mistral-Small-3.x, FLUX.2 [dev]'s encoder: ``rope_theta`` 1e9,
no scaling) and "yarn" (the scaling Mistral-3 text configs such as Ministral-3's carry:
transformers' ``_compute_yarn_parameters``, YaRN, Peng et al. 2023, arXiv:2309.00071, its
frequencies blended between interpolation and extrapolation and cos/sin scaled by the
attention factor); any other RoPE type or parameter is refused by its key. The vision tower, the projector and the LM head are never loaded (their weights
are ignored by name).

Public API: :class:`MistralTextConfig`, :class:`MistralTextModel`, :func:`hidden_states`,
:func:`stacked_hidden_states`, :func:`format_messages`, :func:`tokenize_prompts`,
:func:`prompt_embeds`, :func:`load_prompt_tokenizer`, :func:`weight_map`,
:func:`load_mistral3`, :func:`init_mistral3`, :func:`count_params`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from jaxcore import weights
from jaxcore.models import layers
from jaxcore.models.layers import HeadsEinsum, silu
from jaxcore.models.t5 import RMSNorm

__all__ = [
    "FLUX2_DEV_LAYERS",
    "FLUX2_DEV_MAX_SEQUENCE_LENGTH",
    "SYSTEM_MESSAGE",
    "MistralConfigError",
    "MistralTextConfig",
    "MistralTextModel",
    "count_params",
    "format_messages",
    "hidden_states",
    "init_mistral3",
    "load_mistral3",
    "load_prompt_tokenizer",
    "prompt_embeds",
    "stacked_hidden_states",
    "tokenize_prompts",
    "weight_map",
]

# Flux2Pipeline's defaults (``text_encoder_out_layers``, ``max_sequence_length``).
FLUX2_DEV_LAYERS = (10, 20, 30)
FLUX2_DEV_MAX_SEQUENCE_LENGTH = 512

# diffusers' flux2 ``SYSTEM_MESSAGE`` (from black-forest-labs/flux2 system_messages.py), the
# system turn of every prompt; tests/jaxcore/test_mistral3.py checks it is diffusers' string.
SYSTEM_MESSAGE = (
    "You are an AI that reasons about image descriptions. You give structured responses "
    "focusing on object relationships, object\nattribution and actions without speculation."
)

# YaRN's rope parameters (transformers' _validate_yarn_rope_parameters, plus the 4.x "type");
# ``llama_4_scaling_beta`` is read by Ministral-3's attention, not Mistral's, which ignores it.
YARN_KEYS = frozenset(
    {
        "rope_type",
        "type",
        "factor",
        "original_max_position_embeddings",
        "attention_factor",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "truncate",
        "llama_4_scaling_beta",
    }
)

# config.json keys about training, generation or bookkeeping; the hidden states do not depend
# on them. Any other key that is no MistralTextConfig field is an error naming it.
IGNORED_CONFIG_KEYS = frozenset(
    {
        "architectures",
        "attention_dropout",
        "bos_token_id",
        "dtype",
        "eos_token_id",
        "initializer_range",
        "pad_token_id",
        "torch_dtype",
        "transformers_version",
        "use_cache",
    }
)


class MistralConfigError(ValueError):
    """A config.json key or value MistralTextConfig cannot represent; names the key."""


@dataclasses.dataclass(frozen=True)
class MistralTextConfig:
    """transformers ``MistralConfig`` fields the encoder uses; defaults are transformers'
    (``sliding_window`` 4096 included: a config.json without the key gets the window).

    A ``Mistral3Config`` dict nests this under ``text_config`` (read by :meth:`from_dict`).
    ``rope_theta`` / ``rope_scaling`` are the transformers 4.x keys; a 5.x ``rope_parameters``
    dict is read into them. ``rope_scaling`` is None for the default RoPE and otherwise kept
    as sorted ``(key, value)`` pairs (modules holding this config must hash); see
    :meth:`rope_parameters`. ``head_dim`` None means ``hidden_size // num_attention_heads``.
    ``max_position_embeddings`` and ``tie_word_embeddings`` (the unused LM head's) are kept
    for round trips.
    """

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 14336
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 4096 * 32
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Mapping | tuple | None = None
    sliding_window: int | None = 4096
    tie_word_embeddings: bool = False
    model_type: str = "mistral"

    def __post_init__(self):
        """Resolve ``head_dim``; refuse unsupported variants and bad sizes by key."""
        if self.num_attention_heads < 1:
            raise MistralConfigError(
                f"num_attention_heads must be >= 1, got {self.num_attention_heads}"
            )
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        self._check_supported()
        object.__setattr__(self, "rope_scaling", self._normalised_rope_scaling())
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers"):
            if getattr(self, key) < 1:
                raise MistralConfigError(f"{key} must be >= 1, got {getattr(self, key)}")
        if self.num_key_value_heads < 1 or self.num_attention_heads % self.num_key_value_heads:
            raise MistralConfigError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim < 2 or self.head_dim % 2:
            raise MistralConfigError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise MistralConfigError(f"sliding_window={self.sliding_window} must be >= 1 or null")

    def _check_supported(self) -> None:
        """Variants the encoder does not implement are refused by the key that asks for them."""
        if self.model_type != "mistral":
            raise MistralConfigError(
                f"text_config model_type={self.model_type!r} is not 'mistral' (a Mistral-3 text "
                "config of another type, e.g. 'ministral3', is not supported)"
            )
        if self.hidden_act != "silu":
            raise MistralConfigError(f"hidden_act={self.hidden_act!r} is not supported (silu only)")

    def _normalised_rope_scaling(self) -> tuple | None:
        """None for the default RoPE; YaRN's parameters as sorted pairs, checked by key, with
        transformers' default ``original_max_position_embeddings``."""
        rope = dict(self.rope_scaling or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type == "default":
            extra = sorted(set(rope) - {"rope_type", "type"})
            if extra:
                raise MistralConfigError(f"rope_scaling keys {extra} are not supported")
            return None
        if rope_type != "yarn":
            raise MistralConfigError(f"rope_scaling rope_type={rope_type!r} is not supported")
        unknown = sorted(set(rope) - YARN_KEYS)
        if unknown:
            raise MistralConfigError(f"rope_scaling keys {unknown} are not supported for yarn")
        rope = {k: v for k, v in rope.items() if k != "type"} | {"rope_type": "yarn"}
        rope.setdefault("original_max_position_embeddings", self.max_position_embeddings)
        if "factor" not in rope:
            raise MistralConfigError("rope_scaling 'factor' is required for rope_type='yarn'")
        return tuple(sorted(rope.items()))

    def rope_parameters(self) -> dict[str, Any]:
        """transformers 5's ``rope_parameters``: ``rope_theta`` and ``rope_type`` (and YaRN's
        parameters)."""
        rope = dict(self.rope_scaling or {"rope_type": "default"})
        return {"rope_theta": self.rope_theta, **rope}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> MistralTextConfig:
        """Build from a transformers config.json dict: a ``Mistral3Config`` (``model_type``
        "mistral3"; its ``text_config`` is read, the vision keys ignored) or a plain
        ``MistralConfig``; 4.x or 5.x RoPE keys."""
        if d.get("model_type") == "mistral3":
            if not isinstance(d.get("text_config"), Mapping):
                raise MistralConfigError("a mistral3 config.json needs a text_config object")
            # transformers' Mistral3Config fills a missing text model_type with "mistral".
            d = {"model_type": "mistral", **d["text_config"]}
        kwargs = {k: v for k, v in d.items() if not k.startswith("_")}
        kwargs = {k: v for k, v in kwargs.items() if k not in IGNORED_CONFIG_KEYS}
        rope = kwargs.pop("rope_parameters", None)
        if rope is not None:  # transformers 5: {"rope_theta": ..., "rope_type": ...}
            rope = dict(rope)
            kwargs["rope_theta"] = rope.pop("rope_theta", cls.rope_theta)
            kwargs["rope_scaling"] = rope or None
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise MistralConfigError(
                f"unknown MistralTextConfig keys {unknown}; known: {sorted(known)}"
            )
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        """The fields as a dict (a plain ``MistralConfig`` config.json, 4.x RoPE keys)."""
        d = dataclasses.asdict(self)
        d["rope_scaling"] = dict(self.rope_scaling) if self.rope_scaling else None
        return d


# --- layers --------------------------------------------------------------------------------------


def _yarn_correction_range(rope: Mapping, head_dim: int, theta: float) -> tuple[float, float]:
    """The dimensions between which YaRN ramps from extrapolation to interpolation
    (``find_correction_range``: where a dimension turns ``beta_fast`` / ``beta_slow`` times
    over the original context), floored / ceiled unless ``truncate`` is false."""
    original = rope["original_max_position_embeddings"]

    def dimension(rotations: float) -> float:
        """The (fractional) dimension that turns ``rotations`` times over ``original``."""
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension(rope.get("beta_fast") or 32), dimension(rope.get("beta_slow") or 1)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, head_dim - 1)


def _yarn_attention_factor(rope: Mapping, factor: float) -> float:
    """cos/sin scale: ``attention_factor``, else YaRN's ``0.1 * mscale * ln(s) + 1`` ratio."""
    if rope.get("attention_factor") is not None:
        return float(rope["attention_factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        """YaRN's Eq. 21 (1 for no scaling)."""
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if rope.get("mscale") and rope.get("mscale_all_dim"):
        return float(mscale(factor, rope["mscale"]) / mscale(factor, rope["mscale_all_dim"]))
    return mscale(factor)


def rope_frequencies(config: MistralTextConfig) -> tuple[np.ndarray, float]:
    """``(inv_freq [head_dim / 2] float32, attention_factor)`` as transformers' RoPE init for
    the config's ``rope_type`` (default: ``theta ** (-2i / d)`` and 1)."""
    powers = layers.rope_theta_powers(config.head_dim, config.rope_theta)
    if config.rope_scaling is None:
        return (np.float32(1.0) / powers).astype(np.float32), 1.0
    rope = dict(config.rope_scaling)
    factor = rope["factor"]
    if factor is None:  # transformers: the ratio of the context lengths
        factor = config.max_position_embeddings / rope["original_max_position_embeddings"]
    low, high = _yarn_correction_range(rope, config.head_dim, config.rope_theta)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = np.arange(config.head_dim // 2, dtype=np.float32) - np.float32(low)
    ramp = np.clip(ramp / np.float32(high - low), 0, 1).astype(np.float32)
    extrapolated = 1 - ramp  # weight of the original frequency (fast-turning dimensions)
    inv_extrapolation = np.float32(1.0) / powers
    inv_interpolation = np.float32(1.0) / (np.float32(factor) * powers)
    inv_freq = inv_interpolation * (1 - extrapolated) + inv_extrapolation * extrapolated
    return inv_freq.astype(np.float32), _yarn_attention_factor(rope, factor)


def rope_cos_sin(length: int, config: MistralTextConfig) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin ``[L, head_dim]`` float32 for positions 0..L-1 (the frequencies repeated twice
    for rotate-half), scaled by the attention factor, as transformers' rotary embedding."""
    inv_freq, attention_factor = rope_frequencies(config)
    # float32 as torch computes it: positions (float) x inv_freq, then cos / sin.
    freqs = np.arange(length, dtype=np.float32)[:, None] * inv_freq[None]
    angles = np.concatenate([freqs, freqs], axis=-1)
    scale = np.float32(attention_factor)
    return (np.cos(angles) * scale).astype(np.float32), (np.sin(angles) * scale).astype(np.float32)


def apply_rope(x_blhd: jax.Array, cos_ld: jax.Array, sin_ld: jax.Array) -> jax.Array:
    """``x * cos + rotate_half(x) * sin`` with rotate_half(x) = [-x2, x1] (halves of D)."""
    half = x_blhd.shape[-1] // 2
    rotated = jnp.concatenate([-x_blhd[..., half:], x_blhd[..., :half]], axis=-1)
    cos, sin = cos_ld[None, :, None, :], sin_ld[None, :, None, :]
    return x_blhd * cos.astype(x_blhd.dtype) + rotated * sin.astype(x_blhd.dtype)


def visibility_mask(mask_bl: jax.Array, sliding_window: int | None) -> jax.Array:
    """``[B, Lq, Lk]`` bool: key k visible to query q when k <= q, key k is a real token and,
    with a ``sliding_window`` W, k > q - W (transformers' ``sliding_window_overlay``)."""
    length = mask_bl.shape[1]
    q_idx = jnp.arange(length)[:, None]
    k_idx = jnp.arange(length)[None, :]
    visible_qk = k_idx <= q_idx
    if sliding_window is not None:
        visible_qk &= k_idx > q_idx - sliding_window
    return visible_qk[None] & (mask_bl[:, None, :] > 0)


def _normal(stddev: float = 0.02):
    """transformers' init: normal(0, initializer_range)."""
    return nn.initializers.normal(stddev=stddev)


class Attention(nn.Module):
    """Mistral self-attention: RoPE, GQA, causal (or sliding-window) + padding mask."""

    config: MistralTextConfig
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    def _proj_in(self, heads: int, name: str) -> HeadsEinsum:
        """A bias-free q/k/v projection ``[B, L, E] -> [B, L, heads, head_dim]``."""
        c = self.config
        return HeadsEinsum(
            (c.hidden_size, heads, c.head_dim),
            ("embed", "heads", "kv"),
            "bld,dhk->blhk",
            _normal(),
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            name=name,
        )

    @nn.compact
    def __call__(self, x_bld, visible_bqk, cos_ld, sin_ld):
        """Attention output ``[B, L, E]`` of the normed ``x_bld``; ``visible_bqk``: see
        :func:`visibility_mask`; ``cos_ld`` / ``sin_ld``: :func:`rope_cos_sin`."""
        c = self.config
        q_blhd = apply_rope(self._proj_in(c.num_attention_heads, "q_proj")(x_bld), cos_ld, sin_ld)
        k_blgd = apply_rope(self._proj_in(c.num_key_value_heads, "k_proj")(x_bld), cos_ld, sin_ld)
        v_blgd = self._proj_in(c.num_key_value_heads, "v_proj")(x_bld)
        # GQA: q head h reads kv head h // (H / G) (transformers' repeat_kv order).
        b, length, h, d = q_blhd.shape
        groups = c.num_key_value_heads
        q_blgrd = q_blhd.reshape(b, length, groups, h // groups, d)
        scores = jnp.einsum(
            "bqgrd,bkgd->bgrqk", q_blgrd, k_blgd, preferred_element_type=jnp.float32
        ) * (d**-0.5)
        visible = visible_bqk[:, None, None]
        scores = jnp.where(visible, scores, -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1)
        # A row with no visible key: zeros, as torch's SDPA (not NaN from -inf everywhere).
        probs = jnp.where(visible.any(axis=-1, keepdims=True), probs, 0.0).astype(self.dtype)
        out = jnp.einsum("bgrqk,bkgd->bqgrd", probs, v_blgd, preferred_element_type=jnp.float32)
        out_blhd = out.reshape(b, length, h, d).astype(self.dtype)
        return HeadsEinsum(
            (h, d, c.hidden_size),
            ("heads", "kv", "embed"),
            "blhk,hkd->bld",
            _normal(),
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            name="o_proj",
        )(out_blhd)


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate x) * up x)``, no biases."""

    config: MistralTextConfig
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x_bld: jax.Array) -> jax.Array:
        """``[B, L, E] -> [B, L, E]``."""
        c = self.config
        kw = {"dtype": self.dtype, "param_dtype": self.param_dtype, "use_bias": False}

        def dense(features, axes, name):
            """A bias-free torch-initialised Linear."""
            init = nn.with_logical_partitioning(_normal(), axes)
            return nn.Dense(features, kernel_init=init, name=name, **kw)

        gate = dense(c.intermediate_size, ("embed", "mlp"), "gate_proj")(x_bld)
        up = dense(c.intermediate_size, ("embed", "mlp"), "up_proj")(x_bld)
        return dense(c.hidden_size, ("mlp", "embed"), "down_proj")(silu(gate) * up)


class DecoderLayer(nn.Module):
    """transformers ``MistralDecoderLayer`` (pre-norm attention and MLP, residuals)."""

    config: MistralTextConfig
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x_bld, visible_bqk, cos_ld, sin_ld):
        """One layer on ``x_bld [B, L, E]``."""
        c = self.config
        kw = {"dtype": self.dtype, "param_dtype": self.param_dtype}
        h = RMSNorm(c.rms_norm_eps, name="input_layernorm", **kw)(x_bld)
        x_bld = x_bld + Attention(c, name="self_attn", **kw)(h, visible_bqk, cos_ld, sin_ld)
        h = RMSNorm(c.rms_norm_eps, name="post_attention_layernorm", **kw)(x_bld)
        return x_bld + MLP(c, name="mlp", **kw)(h)


class MistralTextModel(nn.Module):
    """transformers ``MistralModel`` (Mistral3's ``language_model``);
    ``__call__(ids, mask, layers)`` -> the hidden states ``layers`` (numbered as
    transformers': 0 the embedding, k the output of layer k, the last layer's through
    ``norm``) stacked ``[K, B, L, E]``, running only the first ``max(layers)`` layers
    (default: all the hidden states)."""

    config: MistralTextConfig
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    def setup(self):
        """Embedding, layers and the final norm, named as transformers' ``MistralModel``."""
        c = self.config
        kw = {"dtype": self.dtype, "param_dtype": self.param_dtype}
        self.embed_tokens = nn.Embed(
            c.vocab_size,
            c.hidden_size,
            embedding_init=nn.with_logical_partitioning(_normal(), ("vocab", "embed")),
            param_dtype=self.param_dtype,
            dtype=self.dtype,
        )
        self.layers = [DecoderLayer(c, **kw) for _ in range(c.num_hidden_layers)]
        self.norm = RMSNorm(c.rms_norm_eps, **kw)

    def __call__(self, ids_bl: jax.Array, mask_bl: jax.Array, layers: Sequence[int] | None = None):
        """Hidden states ``layers`` of ``ids_bl`` / ``mask_bl [B, L]`` as ``[K, B, L, E]``."""
        c = self.config
        layers = tuple(range(c.num_hidden_layers + 1)) if layers is None else tuple(layers)
        upto = max(layers)
        cos, sin = (jnp.asarray(t) for t in rope_cos_sin(ids_bl.shape[1], c))
        visible_bqk = visibility_mask(mask_bl, c.sliding_window)
        x_bld = self.embed_tokens(ids_bl).astype(self.dtype)
        kept = {0: x_bld}
        for index, layer in enumerate(self.layers[:upto], start=1):
            x_bld = layer(x_bld, visible_bqk, cos, sin)
            kept[index] = x_bld
        if upto == c.num_hidden_layers:  # transformers' last hidden state is normed
            kept[upto] = self.norm(x_bld)
        elif self.is_initializing():  # still create norm's weight
            self.norm(x_bld)
        return jnp.stack([kept[k] for k in layers])


# --- running it ----------------------------------------------------------------------------------


@functools.lru_cache(maxsize=16)
def _jitted_states(module: MistralTextModel, layers: tuple[int, ...]):
    """jit(params, ids, mask) -> hidden states ``layers`` stacked ``[B, K, L, E]``."""

    def run(params, ids_bl, mask_bl):
        """Run the first max(layers) layers; batch first."""
        states_kble = module.apply({"params": params}, ids_bl, mask_bl, layers)
        return jnp.swapaxes(states_kble, 0, 1)

    return jax.jit(run)


def _check_layers(config: MistralTextConfig, layers: Sequence[int]) -> tuple[int, ...]:
    """The indices as ints; ValueError naming the valid range otherwise."""
    layers = tuple(int(k) for k in layers)
    if not layers or min(layers) < 0 or max(layers) > config.num_hidden_layers:
        raise ValueError(
            f"hidden state indices {list(layers)} must be in 0..{config.num_hidden_layers} "
            "(0: the embedding, k: the output of layer k)"
        )
    return layers


def hidden_states(module: MistralTextModel, params, ids_bl, mask_bl, layers: Sequence[int]):
    """transformers' ``output_hidden_states[k]`` for k in ``layers``, as ``[B, K, L, E]``
    (jitted; only layers up to ``max(layers)`` run)."""
    layers = _check_layers(module.config, layers)
    ids_bl, mask_bl = jnp.asarray(ids_bl, jnp.int32), jnp.asarray(mask_bl, jnp.int32)
    return _jitted_states(module, layers)(params, ids_bl, mask_bl)


def stacked_hidden_states(
    module: MistralTextModel, params, ids_bl, mask_bl, layers=FLUX2_DEV_LAYERS
) -> jax.Array:
    """The pipeline's prompt embedding from token ids: ``[B, L, K * E]``, channel
    ``k * E + e`` = hidden state ``layers[k]`` (its ``stack(dim=1).permute(0, 2, 1, 3)``)."""
    states_bkle = hidden_states(module, params, ids_bl, mask_bl, layers)
    b, k, length, e = states_bkle.shape
    return jnp.transpose(states_bkle, (0, 2, 1, 3)).reshape(b, length, k * e)


# --- prompts -------------------------------------------------------------------------------------


def format_messages(prompts: Sequence[str], system_message: str = SYSTEM_MESSAGE) -> list:
    """diffusers' flux2 ``format_input`` without images: per prompt a system turn and a user
    turn, each one text block; ``[IMG]`` is removed from the prompts (the processor would
    count image tokens against images)."""
    return [
        [
            {"role": "system", "content": [{"type": "text", "text": system_message}]},
            {"role": "user", "content": [{"type": "text", "text": prompt.replace("[IMG]", "")}]},
        ]
        for prompt in prompts
    ]


def tokenize_prompts(
    tokenizer,
    prompts,
    max_sequence_length: int = FLUX2_DEV_MAX_SEQUENCE_LENGTH,
    system_message: str = SYSTEM_MESSAGE,
) -> tuple[np.ndarray, np.ndarray]:
    """ids and attention mask int32 ``[B, max_sequence_length]`` as
    ``_get_mistral_3_small_prompt_embeds`` makes them: the whole batch through
    ``tokenizer.apply_chat_template`` (a ``PixtralProcessor`` or a tokenizer with the chat
    template; no generation prompt), padded to ``max_sequence_length`` (the tokenizer's own
    padding side) and truncated, the very call the pipeline makes."""
    from jaxcore.text import call_tokenizer

    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    # call_tokenizer serialises the call (a fast tokenizer's padding state is shared).
    encoded = call_tokenizer(
        tokenizer.apply_chat_template,
        format_messages(prompts, system_message),
        add_generation_prompt=False,
        tokenize=True,
        return_dict=True,
        return_tensors="np",
        padding="max_length",
        truncation=True,
        max_length=max_sequence_length,
    )
    ids = np.asarray(encoded["input_ids"], np.int32)
    mask = np.asarray(encoded["attention_mask"], np.int32)
    return ids.reshape(len(prompts), -1), mask.reshape(len(prompts), -1)


def prompt_embeds(
    tokenizer,
    module: MistralTextModel,
    params,
    prompts,
    max_sequence_length: int = FLUX2_DEV_MAX_SEQUENCE_LENGTH,
    layers: Sequence[int] = FLUX2_DEV_LAYERS,
    system_message: str = SYSTEM_MESSAGE,
    dtype=None,
) -> np.ndarray:
    """``Flux2Pipeline._get_mistral_3_small_prompt_embeds``: ``[B, max_sequence_length,
    K * E]`` on the host in ``dtype`` (default the module's activation dtype, as the pipeline
    defaults to the text encoder's); padding rows are kept (the pipeline keeps them too)."""
    ids_bl, mask_bl = tokenize_prompts(tokenizer, prompts, max_sequence_length, system_message)
    embeds = stacked_hidden_states(module, params, ids_bl, mask_bl, layers)
    return np.asarray(embeds.astype(module.dtype if dtype is None else dtype))


def load_prompt_tokenizer(directory: str | os.PathLike):
    """FLUX.2 [dev]'s ``tokenizer`` folder (saved by a ``PixtralProcessor``) as a tokenizer
    that renders the chat template: ``AutoTokenizer`` (local files only, no remote code),
    which reads ``chat_template.jinja``; a processor's legacy ``chat_template.json`` is read
    when the tokenizer found no template. The processor itself needs torchvision and only its
    tokenizer matters for text: both produce the same ids when the rendered text starts with
    the BOS token (the processor then turns ``add_special_tokens`` off, as the tokenizer's
    ``apply_chat_template`` always does), which Mistral's template does."""
    from jaxcore.text import load_tokenizer

    tokenizer = load_tokenizer(directory)
    legacy = Path(directory) / "chat_template.json"
    if tokenizer.chat_template is None and legacy.is_file():
        tokenizer.chat_template = json.loads(legacy.read_text())["chat_template"]
    if tokenizer.chat_template is None:
        raise weights.WeightsError(
            f"tokenizer at {directory} has no chat template (chat_template.jinja or "
            "chat_template.json); Flux2Pipeline formats every prompt with it"
        )
    return tokenizer


# --- weights -------------------------------------------------------------------------------------

# Where the language model's keys live: transformers' save layout for Mistral3 (also what
# 4.x wrote), its in-memory layout, and a plain MistralForCausalLM / MistralModel.
LANGUAGE_MODEL_PREFIXES = ("language_model.model.", "model.language_model.", "model.")

# Mistral3ForConditionalGeneration weights that are no part of the text encoder, by name.
UNUSED_PREFIXES = (
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
    "language_model.lm_head.",
    "lm_head.",
)


def _heads_in(heads: int, head_dim: int):
    """torch Linear [H*D, E] -> kernel [E, H, D] (invertible for export)."""
    return weights.Invertible(
        lambda w: w.T.reshape(w.shape[1], heads, head_dim),
        lambda k: k.reshape(k.shape[0], -1).T,
    )


def _heads_out(heads: int, head_dim: int):
    """torch Linear [E, H*D] -> kernel [H, D, E]."""
    return weights.Invertible(
        lambda w: w.T.reshape(heads, head_dim, w.shape[0]),
        lambda k: k.reshape(-1, k.shape[-1]).T,
    )


def weight_map(config: MistralTextConfig, prefix: str = LANGUAGE_MODEL_PREFIXES[0]) -> dict:
    """Flax param path -> (transformers key under ``prefix``, transform)."""
    c, ident = config, weights.identity
    mapping = {
        ("embed_tokens", "embedding"): (f"{prefix}embed_tokens.weight", ident),
        ("norm", "scale"): (f"{prefix}norm.weight", ident),
    }
    heads = {"q_proj": c.num_attention_heads, "k_proj": c.num_key_value_heads}
    heads["v_proj"] = c.num_key_value_heads
    for i in range(c.num_hidden_layers):
        src, dst = f"{prefix}layers.{i}", f"layers_{i}"
        for name, n in heads.items():
            mapping[(dst, "self_attn", name, "kernel")] = (
                f"{src}.self_attn.{name}.weight",
                _heads_in(n, c.head_dim),
            )
        mapping[(dst, "self_attn", "o_proj", "kernel")] = (
            f"{src}.self_attn.o_proj.weight",
            _heads_out(c.num_attention_heads, c.head_dim),
        )
        for name in ("gate_proj", "up_proj", "down_proj"):
            mapping[(dst, "mlp", name, "kernel")] = (f"{src}.mlp.{name}.weight", weights.linear)
        for name in ("input_layernorm", "post_attention_layernorm"):
            mapping[(dst, name, "scale")] = (f"{src}.{name}.weight", ident)
    return mapping


def language_model_prefix(reader: weights.SafetensorsReader) -> str:
    """The key prefix of the language model in a checkpoint (see LANGUAGE_MODEL_PREFIXES);
    WeightsError naming the directory when none holds ``embed_tokens.weight``."""
    for prefix in LANGUAGE_MODEL_PREFIXES:
        if f"{prefix}embed_tokens.weight" in reader:
            return prefix
    tried = [f"{p}embed_tokens.weight" for p in LANGUAGE_MODEL_PREFIXES]
    where = getattr(reader, "directory", "the checkpoint")
    raise weights.WeightsError(f"no Mistral language model in {where}: none of {tried} found")


def _abstract_params(module: MistralTextModel):
    """The ``params`` collection as boxed ShapeDtypeStructs (nothing allocated)."""
    ids = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    return weights.shapes_of_init(module.init, ids, ids)["params"]


@functools.lru_cache(maxsize=8)
def _language_model_size(config: MistralTextConfig) -> int:
    """Elements of the parameters (tracing a 40-layer init takes seconds: once per config)."""
    return weights.count_elements(_abstract_params(MistralTextModel(config)))


def count_params(config: MistralTextConfig, *, with_lm_head: bool = False) -> int:
    """Parameters of the language model (``MistralModel``); ``with_lm_head`` adds the untied
    LM head, giving ``MistralForCausalLM``'s count."""
    n = _language_model_size(config)
    if with_lm_head and not config.tie_word_embeddings:
        n += config.vocab_size * config.hidden_size
    return n


def init_mistral3(config: MistralTextConfig, rng, *, dtype=jnp.float32, param_dtype=None):
    """Random-init ``(module, params)`` (unboxed, on the default device)."""
    module = MistralTextModel(config, dtype=dtype, param_dtype=param_dtype or dtype)
    ids = jnp.zeros((1, 1), jnp.int32)
    return module, nn.meta.unbox(jax.jit(module.init)(rng, ids, ids)["params"])


def load_mistral3(
    directory: str | os.PathLike,
    *,
    dtype=jnp.float32,
    param_dtype=None,
    mesh: jax.sharding.Mesh | None = None,
    rules=None,
) -> tuple[MistralTextModel, dict]:
    """A transformers ``Mistral3ForConditionalGeneration`` directory (FLUX.2 [dev]'s
    ``text_encoder``; a plain Mistral one reads too) -> ``(module, params)`` of its language
    model; the vision tower, projector and LM head are not read."""
    config = MistralTextConfig.from_dict(weights.read_config(directory))
    module = MistralTextModel(config, dtype=dtype, param_dtype=param_dtype or dtype)
    reader = weights.SafetensorsReader(directory)
    params = weights.load_placed(
        reader,
        weight_map(config, language_model_prefix(reader)),
        _abstract_params(module),
        mesh=mesh,
        rules=rules,
        dtype=param_dtype or dtype,
        ignore_unused=UNUSED_PREFIXES,
    )
    return module, params
