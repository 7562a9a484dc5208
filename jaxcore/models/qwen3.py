"""The Qwen3 text encoder of Flux.2 [klein] in Flax linen (= transformers ``Qwen3ForCausalLM``,
its decoder stack only), and the prompt embedding of diffusers' ``Flux2KleinPipeline``.

References: ``transformers/models/qwen3/modeling_qwen3.py`` (transformers 5.x) and
``diffusers/pipelines/flux2/pipeline_flux2_klein.py`` (``_get_qwen3_prompt_embeds``).

The network: token embedding, then per layer (pre-norm) ``x + attn(rms(x))`` and
``x + mlp(rms(x))``. Attention: q/k/v projections (bias if ``attention_bias``), an RMSNorm over
each head's ``head_dim`` on q and k (Qwen3's q/k norms, before RoPE), rotate-half RoPE with
``rope_theta`` at positions ``0..L-1`` (transformers' default ``position_ids``, whatever the
padding), grouped-query attention (``num_key_value_heads`` shared by the q heads in order),
scale ``head_dim ** -0.5``, causal mask AND the padding mask on keys. SwiGLU MLP
``down(silu(gate x) * up x)``. RMSNorm statistics in float32, weight applied in the
activation dtype, as ``Qwen3RMSNorm``.

``hidden_states`` are numbered as transformers' ``output_hidden_states``: index 0 is the
embedding, index k < N the output of layer k (1-based), and index N (the last layer) has the
final ``model.norm`` applied (= ``last_hidden_state``), as transformers returns it. A query
with no visible key (a left pad before any real token) gets a zero attention output, as torch's
SDPA (transformers' default attention) gives for a fully masked row.

Only what the encoder needs is supported: ``rope_type`` "default" (Qwen3-4B / 8B use no
scaling) and no sliding window; anything else is refused by its config key. The LM head is
never loaded (its ``lm_head.weight`` is ignored).

Public API: :class:`Qwen3Config`, :class:`Qwen3Model`, :func:`hidden_states`,
:func:`stacked_hidden_states`, :func:`tokenize_prompts`, :func:`prompt_embeds`,
:func:`weight_map`, :func:`load_qwen3`, :func:`init_qwen3`, :func:`count_params`.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Mapping, Sequence
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
    "Qwen3Config",
    "Qwen3ConfigError",
    "Qwen3Model",
    "count_params",
    "hidden_states",
    "init_qwen3",
    "load_qwen3",
    "prompt_embeds",
    "stacked_hidden_states",
    "tokenize_prompts",
    "weight_map",
]

# Flux2KleinPipeline's defaults (``text_encoder_out_layers``, ``max_sequence_length``).
KLEIN_LAYERS = (9, 18, 27)
KLEIN_MAX_SEQUENCE_LENGTH = 512

# config.json keys about training, generation or bookkeeping; the hidden states do not depend
# on them. Any other key that is no Qwen3Config field is an error naming it.
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


class Qwen3ConfigError(ValueError):
    """A config.json key or value Qwen3Config cannot represent; names the key."""


@dataclasses.dataclass(frozen=True)
class Qwen3Config:
    """transformers ``Qwen3Config`` fields the encoder uses; defaults are transformers'.

    ``rope_theta`` / ``rope_scaling`` are the transformers 4.x keys; a 5.x ``rope_parameters``
    dict is read into them by :meth:`from_dict`. ``max_position_embeddings`` and
    ``tie_word_embeddings`` (the unused LM head's) are kept for round trips.
    """

    vocab_size: int = 151936
    hidden_size: int = 4096
    intermediate_size: int = 22016
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    head_dim: int = 128
    hidden_act: str = "silu"
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Mapping | None = None
    attention_bias: bool = False
    use_sliding_window: bool = False
    sliding_window: int | None = None
    max_window_layers: int = 28
    layer_types: tuple[str, ...] | None = None
    tie_word_embeddings: bool = False
    model_type: str = "qwen3"

    def __post_init__(self):
        """Tuples for lists; refuse unsupported variants and bad sizes by key."""
        if self.layer_types is not None:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        self._check_supported()
        # Only the default RoPE passes the check, and it has no parameters: drop the dict
        # (modules holding this config must hash).
        object.__setattr__(self, "rope_scaling", None)
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers"):
            if getattr(self, key) < 1:
                raise Qwen3ConfigError(f"{key} must be >= 1, got {getattr(self, key)}")
        if self.num_key_value_heads < 1 or self.num_attention_heads % self.num_key_value_heads:
            raise Qwen3ConfigError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise Qwen3ConfigError(f"head_dim={self.head_dim} must be even for RoPE")

    def _check_supported(self) -> None:
        """Variants the encoder does not implement are refused by the key that asks for them."""
        if self.model_type != "qwen3":
            raise Qwen3ConfigError(f"model_type={self.model_type!r} is not 'qwen3'")
        if self.hidden_act != "silu":
            raise Qwen3ConfigError(f"hidden_act={self.hidden_act!r} is not supported (silu only)")
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type != "default":
            raise Qwen3ConfigError(f"rope_scaling rope_type={rope_type!r} is not supported")
        if self.use_sliding_window:
            raise Qwen3ConfigError("use_sliding_window=true is not supported")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_hidden_layers:
                raise Qwen3ConfigError("layer_types must have num_hidden_layers entries")
            if set(self.layer_types) != {"full_attention"}:
                raise Qwen3ConfigError(f"layer_types {sorted(set(self.layer_types))} unsupported")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Qwen3Config:
        """Build from a transformers config.json dict (4.x or 5.x keys)."""
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
            raise Qwen3ConfigError(f"unknown Qwen3Config keys {unknown}; known: {sorted(known)}")
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        """The fields as a dict (lists, not tuples)."""
        d = dataclasses.asdict(self)
        return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}


# --- layers --------------------------------------------------------------------------------------


def rope_cos_sin(length: int, head_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin ``[L, head_dim]`` float32 for positions 0..L-1: transformers' default RoPE
    (inv_freq = theta ** (-2i / d), the frequencies repeated twice for rotate-half)."""
    inv_freq = np.float32(1.0) / layers.rope_theta_powers(head_dim, theta)
    # float32 as torch computes it: positions (float) x inv_freq, then cos / sin.
    freqs = np.arange(length, dtype=np.float32)[:, None] * inv_freq.astype(np.float32)[None]
    emb = np.concatenate([freqs, freqs], axis=-1)
    return np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)


def apply_rope(x_blhd: jax.Array, cos_ld: jax.Array, sin_ld: jax.Array) -> jax.Array:
    """``x * cos + rotate_half(x) * sin`` with rotate_half(x) = [-x2, x1] (halves of D)."""
    half = x_blhd.shape[-1] // 2
    rotated = jnp.concatenate([-x_blhd[..., half:], x_blhd[..., :half]], axis=-1)
    cos, sin = cos_ld[None, :, None, :], sin_ld[None, :, None, :]
    return x_blhd * cos.astype(x_blhd.dtype) + rotated * sin.astype(x_blhd.dtype)


def visibility_mask(mask_bl: jax.Array) -> jax.Array:
    """``[B, Lq, Lk]`` bool: key k visible to query q when k <= q and key k is a real token."""
    length = mask_bl.shape[1]
    causal_qk = jnp.tril(jnp.ones((length, length), bool))
    return causal_qk[None] & (mask_bl[:, None, :] > 0)


def _normal(stddev: float = 0.02):
    """transformers' init: normal(0, initializer_range)."""
    return nn.initializers.normal(stddev=stddev)


class Attention(nn.Module):
    """Qwen3 self-attention: q/k norms, RoPE, GQA, causal + padding mask."""

    config: Qwen3Config
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    def _proj(self, heads: int, name: str) -> HeadsEinsum:
        """A q/k/v projection ``[B, L, E] -> [B, L, heads, head_dim]``."""
        c = self.config
        return HeadsEinsum(
            (c.hidden_size, heads, c.head_dim),
            ("embed", "heads", "kv"),
            "bld,dhk->blhk",
            _normal(),
            bias_axes=("heads", "kv") if c.attention_bias else None,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            name=name,
        )

    @nn.compact
    def __call__(self, x_bld, visible_bqk, cos_ld, sin_ld):
        """Attention output ``[B, L, E]`` of the normed ``x_bld``; ``visible_bqk``: see
        :func:`visibility_mask`; ``cos_ld`` / ``sin_ld``: :func:`rope_cos_sin`."""
        c = self.config
        kw = {"dtype": self.dtype, "param_dtype": self.param_dtype}
        q_blhd = RMSNorm(c.rms_norm_eps, name="q_norm", **kw)(
            self._proj(c.num_attention_heads, "q_proj")(x_bld)
        )
        k_blgd = RMSNorm(c.rms_norm_eps, name="k_norm", **kw)(
            self._proj(c.num_key_value_heads, "k_proj")(x_bld)
        )
        v_blgd = self._proj(c.num_key_value_heads, "v_proj")(x_bld)
        q_blhd, k_blgd = apply_rope(q_blhd, cos_ld, sin_ld), apply_rope(k_blgd, cos_ld, sin_ld)
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
            bias_axes=("embed",) if c.attention_bias else None,
            name="o_proj",
            **kw,
        )(out_blhd)


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate x) * up x)``, no biases."""

    config: Qwen3Config
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
    """transformers ``Qwen3DecoderLayer`` (pre-norm attention and MLP, residuals)."""

    config: Qwen3Config
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


class Qwen3Model(nn.Module):
    """transformers ``Qwen3Model``; ``__call__(ids, mask, upto)`` -> the hidden states
    ``[upto + 1, B, L, D]`` numbered as transformers' (0: the embedding, k: the output of
    layer k, the last layer's through ``model.norm``), running only the first ``upto`` layers
    (default all). ``final_norm`` is ``model.norm``."""

    config: Qwen3Config
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    def setup(self):
        """Embedding, layers and the final norm, named as transformers' ``model.*``."""
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

    def __call__(self, ids_bl: jax.Array, mask_bl: jax.Array, upto: int | None = None):
        """Hidden states ``[upto + 1, B, L, E]`` of ``ids_bl`` / ``mask_bl [B, L]``."""
        c = self.config
        upto = c.num_hidden_layers if upto is None else upto
        cos, sin = (jnp.asarray(t) for t in rope_cos_sin(ids_bl.shape[1], c.head_dim, c.rope_theta))
        visible_bqk = visibility_mask(mask_bl)
        x_bld = self.embed_tokens(ids_bl).astype(self.dtype)
        states = [x_bld]
        for layer in self.layers[:upto]:
            x_bld = layer(x_bld, visible_bqk, cos, sin)
            states.append(x_bld)
        if upto == c.num_hidden_layers:  # transformers' last hidden state is normed
            states[-1] = self.norm(x_bld)
        elif self.is_initializing():  # still create model.norm's weight
            self.norm(x_bld)
        return jnp.stack(states)

    def final_norm(self, x_bld: jax.Array) -> jax.Array:
        """``model.norm`` (transformers' last_hidden_state = it of the last layer)."""
        return self.norm(x_bld)


# --- running it ----------------------------------------------------------------------------------


@functools.lru_cache(maxsize=16)
def _jitted_states(module: Qwen3Model, layers: tuple[int, ...]):
    """jit(params, ids, mask) -> hidden states ``layers`` stacked ``[B, K, L, D]``."""

    def run(params, ids_bl, mask_bl):
        """Run the first max(layers) layers; pick the hidden states."""
        states = module.apply({"params": params}, ids_bl, mask_bl, upto=max(layers))
        return jnp.stack([states[k] for k in layers], axis=1)

    return jax.jit(run)


def _check_layers(config: Qwen3Config, layers: Sequence[int]) -> tuple[int, ...]:
    """The indices as ints; ValueError naming the valid range otherwise."""
    layers = tuple(int(k) for k in layers)
    if not layers or min(layers) < 0 or max(layers) > config.num_hidden_layers:
        raise ValueError(
            f"hidden state indices {list(layers)} must be in 0..{config.num_hidden_layers} "
            "(0: the embedding, k: the output of layer k)"
        )
    return layers


def hidden_states(module: Qwen3Model, params, ids_bl, mask_bl, layers: Sequence[int]):
    """transformers' ``output_hidden_states[k]`` for k in ``layers``, as ``[B, K, L, D]``
    (jitted; only layers up to ``max(layers)`` run)."""
    layers = _check_layers(module.config, layers)
    ids_bl, mask_bl = jnp.asarray(ids_bl, jnp.int32), jnp.asarray(mask_bl, jnp.int32)
    return _jitted_states(module, layers)(params, ids_bl, mask_bl)


def stacked_hidden_states(module, params, ids_bl, mask_bl, layers=KLEIN_LAYERS) -> jax.Array:
    """The pipeline's prompt embedding from token ids: ``[B, L, K * D]``, channel
    ``k * D + d`` = hidden state ``layers[k]`` (its ``stack(dim=1).permute(0, 2, 1, 3)``)."""
    states_bkld = hidden_states(module, params, ids_bl, mask_bl, layers)
    b, k, length, d = states_bkld.shape
    return jnp.transpose(states_bkld, (0, 2, 1, 3)).reshape(b, length, k * d)


def tokenize_prompts(tokenizer, prompts, max_sequence_length: int = KLEIN_MAX_SEQUENCE_LENGTH):
    """ids and attention mask int32 ``[B, max_sequence_length]`` as ``_get_qwen3_prompt_embeds``
    makes them: each prompt as one user message through the chat template (generation prompt
    added, thinking disabled), then padded to ``max_sequence_length`` (the tokenizer's own
    padding side) and truncated."""
    from jaxcore.text import call_tokenizer

    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    ids, masks = [], []
    for prompt in prompts:  # one call per prompt, as the pipeline (same padding per row)
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}],
            tokenize=False,
            add_generation_prompt=True,
            enable_thinking=False,
        )
        encoded = call_tokenizer(
            tokenizer,
            text,
            padding="max_length",
            truncation=True,
            max_length=max_sequence_length,
            return_tensors="np",
        )
        ids.append(np.asarray(encoded["input_ids"], np.int32))
        masks.append(np.asarray(encoded["attention_mask"], np.int32))
    return np.concatenate(ids), np.concatenate(masks)


def prompt_embeds(
    tokenizer,
    module: Qwen3Model,
    params,
    prompts,
    max_sequence_length: int = KLEIN_MAX_SEQUENCE_LENGTH,
    layers: Sequence[int] = KLEIN_LAYERS,
) -> np.ndarray:
    """``Flux2KleinPipeline._get_qwen3_prompt_embeds``: ``[B, max_sequence_length, K * D]``
    float32 on the host; padding rows are kept (the pipeline keeps them too)."""
    ids_bl, mask_bl = tokenize_prompts(tokenizer, prompts, max_sequence_length)
    embeds = stacked_hidden_states(module, params, ids_bl, mask_bl, layers)
    return np.asarray(embeds.astype(jnp.float32))


# --- weights -------------------------------------------------------------------------------------

# Qwen3ForCausalLM's LM head (or a tied copy) is not part of the encoder.
UNUSED_PREFIXES = ("lm_head.",)


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


def _bias_heads(heads: int, head_dim: int):
    """torch bias [H*D] -> [H, D]."""
    return weights.Invertible(lambda b: b.reshape(heads, head_dim), lambda b: b.reshape(-1))


def _attention_map(config: Qwen3Config, src: str, dst: tuple) -> dict:
    """Weight map entries of one layer's ``self_attn``."""
    c, ident = config, weights.identity
    heads = {"q_proj": c.num_attention_heads, "k_proj": c.num_key_value_heads}
    heads["v_proj"] = c.num_key_value_heads
    mapping = {}
    for name, n in heads.items():
        mapping[(*dst, name, "kernel")] = (f"{src}.{name}.weight", _heads_in(n, c.head_dim))
        if c.attention_bias:
            mapping[(*dst, name, "bias")] = (f"{src}.{name}.bias", _bias_heads(n, c.head_dim))
    mapping[(*dst, "o_proj", "kernel")] = (
        f"{src}.o_proj.weight",
        _heads_out(c.num_attention_heads, c.head_dim),
    )
    if c.attention_bias:
        mapping[(*dst, "o_proj", "bias")] = (f"{src}.o_proj.bias", ident)
    for name in ("q_norm", "k_norm"):
        mapping[(*dst, name, "scale")] = (f"{src}.{name}.weight", ident)
    return mapping


def weight_map(config: Qwen3Config) -> dict:
    """Flax param path -> (transformers ``Qwen3ForCausalLM`` key, transform)."""
    ident = weights.identity
    mapping = {
        ("embed_tokens", "embedding"): ("model.embed_tokens.weight", ident),
        ("norm", "scale"): ("model.norm.weight", ident),
    }
    for i in range(config.num_hidden_layers):
        src, dst = f"model.layers.{i}", f"layers_{i}"
        mapping.update(_attention_map(config, f"{src}.self_attn", (dst, "self_attn")))
        for name in ("gate_proj", "up_proj", "down_proj"):
            mapping[(dst, "mlp", name, "kernel")] = (f"{src}.mlp.{name}.weight", weights.linear)
        for name in ("input_layernorm", "post_attention_layernorm"):
            mapping[(dst, name, "scale")] = (f"{src}.{name}.weight", ident)
    return mapping


def _abstract_params(module: Qwen3Model):
    """The ``params`` collection as boxed ShapeDtypeStructs (nothing allocated)."""
    ids = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    return weights.shapes_of_init(module.init, ids, ids)["params"]


def count_params(config: Qwen3Config, *, with_lm_head: bool = False) -> int:
    """Parameters of the encoder (``Qwen3Model``); ``with_lm_head`` adds the untied LM head,
    giving ``Qwen3ForCausalLM``'s count."""
    n = weights.count_elements(_abstract_params(Qwen3Model(config)))
    if with_lm_head and not config.tie_word_embeddings:
        n += config.vocab_size * config.hidden_size
    return n


def init_qwen3(config: Qwen3Config, rng, *, dtype=jnp.float32, param_dtype=None):
    """Random-init ``(module, params)`` (unboxed, on the default device)."""
    module = Qwen3Model(config, dtype=dtype, param_dtype=param_dtype or dtype)
    ids = jnp.zeros((1, 1), jnp.int32)
    return module, nn.meta.unbox(jax.jit(module.init)(rng, ids, ids)["params"])


def load_qwen3(
    directory: str | os.PathLike,
    *,
    dtype=jnp.float32,
    param_dtype=None,
    mesh: jax.sharding.Mesh | None = None,
    rules=None,
) -> tuple[Qwen3Model, dict]:
    """A transformers Qwen3 (``Qwen3ForCausalLM`` / ``Qwen3Model`` saved with a ``model.``
    prefix) directory -> ``(module, params)``; ``lm_head.*`` is not read."""
    config = Qwen3Config.from_dict(weights.read_config(directory))
    module = Qwen3Model(config, dtype=dtype, param_dtype=param_dtype or dtype)
    params = weights.load_placed(
        weights.SafetensorsReader(directory),
        weight_map(config),
        _abstract_params(module),
        mesh=mesh,
        rules=rules,
        dtype=param_dtype or dtype,
        ignore_unused=UNUSED_PREFIXES,
    )
    return module, params
