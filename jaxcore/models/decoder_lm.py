"""The Llama-style decoder the Qwen3 and Mistral text encoders share, in Flax linen, named and
numbered as transformers' ``LlamaModel`` family; also the pieces of it Gemma-3 reuses.

References: ``transformers/models/llama/modeling_llama.py`` (the pattern), ``qwen3`` and
``mistral`` (the variants :class:`DecoderOptions` switches on), transformers 5.x.

The network: token embedding, then per layer (pre-norm) ``x + attn(rms(x))`` and
``x + mlp(rms(x))``, then a final norm. Attention: q/k/v/o projections (biases if
``attention_bias``), with ``qk_norm`` an RMSNorm over each head's ``head_dim`` on q and k
(Qwen3's, before RoPE), rotate-half RoPE at positions ``0..L-1`` (transformers' default
``position_ids``, whatever the padding) with the frequencies the model's config chose,
grouped-query attention (``num_key_value_heads`` shared by the q heads in order), scale
``head_dim ** -0.5``, the causal mask (a band of ``sliding_window`` keys when set, as
``create_sliding_window_causal_mask``) AND the padding mask on keys. SwiGLU MLP
``down(silu(gate x) * up x)``. RMSNorm statistics in float32, weight applied in the activation
dtype. A query with no visible key (a left pad before any real token) gets a zero attention
output, as torch's SDPA (transformers' default attention) gives for a fully masked row.

Hidden states are numbered as transformers' ``output_hidden_states``: 0 is the embedding, k < N
the output of layer k (1-based), N the last layer's output through the final norm
(= ``last_hidden_state``). Only the layers up to the highest requested state run.

A model file (``qwen3.py``, ``mistral3.py``) keeps its transformers config, which builds
:class:`DecoderOptions` (``config.decoder_options()``: sizes, switches, RoPE frequencies), a
:class:`DecoderLM` subclass naming its model, its prompt embedding and its checkpoints' key
prefixes. ``gemma3.py`` (sandwich norms, ``(1 + w)`` norms, local/global layers) has its own
layers and uses the functions here that compute the same thing: RoPE, masks, grouped attention,
projections, the gated MLP, weight layouts and loading.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
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
    "Attention",
    "DecoderLM",
    "DecoderLayer",
    "DecoderOptions",
    "GatedMLP",
    "abstract_params",
    "apply_rope",
    "attention_weight_map",
    "bias_heads",
    "count_params",
    "default_inv_freq",
    "find_prefix",
    "grouped_attention",
    "heads_in",
    "heads_out",
    "hidden_states",
    "init_params",
    "load_params",
    "mlp_weight_map",
    "normal_init",
    "project_in",
    "project_out",
    "rope_cos_sin",
    "stacked_hidden_states",
    "token_embedding",
    "visibility_mask",
    "weight_map",
]

# The sizes every Llama-style transformers config names alike; DecoderOptions.of copies them.
SIZE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
)


@dataclasses.dataclass(frozen=True)
class DecoderOptions:
    """What the decoder computes, in transformers' names; a model config builds it.

    ``rope_inv_freq`` (``head_dim / 2`` float32 values, a tuple so modules holding it hash) and
    ``rope_attention_factor`` (the cos/sin scale) are the config's RoPE choice; ``qk_norm``
    turns on Qwen3's q/k norms; ``sliding_window`` None means the full causal mask.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_inv_freq: tuple[float, ...]
    rope_attention_factor: float = 1.0
    attention_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None

    @classmethod
    def of(cls, config: Any, inv_freq: np.ndarray, **switches) -> DecoderOptions:
        """The sizes (:data:`SIZE_FIELDS`) read from ``config`` by name, the RoPE frequencies
        ``inv_freq`` and the other fields from ``switches``."""
        sizes = {name: getattr(config, name) for name in SIZE_FIELDS}
        return cls(**sizes, rope_inv_freq=tuple(float(f) for f in inv_freq), **switches)


# --- RoPE and masks -----------------------------------------------------------------------------


def default_inv_freq(head_dim: int, theta: float) -> np.ndarray:
    """transformers' default RoPE frequencies ``theta ** (-2i / d)``, ``[head_dim / 2]``
    float32."""
    return (np.float32(1.0) / layers.rope_theta_powers(head_dim, theta)).astype(np.float32)


def rope_cos_sin(
    length: int, inv_freq: Sequence[float], attention_factor: float = 1.0
) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin ``[L, head_dim]`` float32 for positions 0..L-1 (the frequencies repeated twice
    for rotate-half), scaled by ``attention_factor``, as transformers' rotary embeddings."""
    # float32 as torch computes it: positions (float) x inv_freq, then cos / sin.
    freqs = np.arange(length, dtype=np.float32)[:, None] * np.asarray(inv_freq, np.float32)[None]
    angles = np.concatenate([freqs, freqs], axis=-1)
    scale = np.float32(attention_factor)
    return (np.cos(angles) * scale).astype(np.float32), (np.sin(angles) * scale).astype(np.float32)


def apply_rope(x_blhd: jax.Array, cos_ld: jax.Array, sin_ld: jax.Array) -> jax.Array:
    """``x * cos + rotate_half(x) * sin`` with rotate_half(x) = [-x2, x1] (halves of D)."""
    half = x_blhd.shape[-1] // 2
    rotated = jnp.concatenate([-x_blhd[..., half:], x_blhd[..., :half]], axis=-1)
    cos, sin = cos_ld[None, :, None, :], sin_ld[None, :, None, :]
    return x_blhd * cos.astype(x_blhd.dtype) + rotated * sin.astype(x_blhd.dtype)


def visibility_mask(mask_bl: jax.Array, sliding_window: int | None = None) -> jax.Array:
    """``[B, Lq, Lk]`` bool: key k visible to query q when k <= q, key k is a real token and,
    with a ``sliding_window`` W, k > q - W (transformers' ``sliding_window_overlay``)."""
    length = mask_bl.shape[1]
    q_idx = jnp.arange(length)[:, None]
    k_idx = jnp.arange(length)[None, :]
    visible_qk = k_idx <= q_idx
    if sliding_window is not None:
        visible_qk &= k_idx > q_idx - sliding_window
    return visible_qk[None] & (mask_bl[:, None, :] > 0)


# --- layers --------------------------------------------------------------------------------------


def normal_init(stddev: float = 0.02):
    """transformers' init: normal(0, initializer_range)."""
    return nn.initializers.normal(stddev=stddev)


def project_in(hidden, heads, head_dim, *, bias: bool, name: str, **dtypes) -> HeadsEinsum:
    """A q/k/v projection ``[B, L, E] -> [B, L, heads, head_dim]`` (torch ``Linear``)."""
    return HeadsEinsum(
        (hidden, heads, head_dim),
        ("embed", "heads", "kv"),
        "bld,dhk->blhk",
        normal_init(),
        bias_axes=("heads", "kv") if bias else None,
        name=name,
        **dtypes,
    )


def project_out(heads, head_dim, hidden, *, bias: bool, name: str, **dtypes) -> HeadsEinsum:
    """The output projection ``[B, L, heads, head_dim] -> [B, L, E]`` (torch ``Linear``)."""
    return HeadsEinsum(
        (heads, head_dim, hidden),
        ("heads", "kv", "embed"),
        "blhk,hkd->bld",
        normal_init(),
        bias_axes=("embed",) if bias else None,
        name=name,
        **dtypes,
    )


def grouped_attention(q_blhd, k_blgd, v_blgd, visible_bqk, scale: float) -> jax.Array:
    """softmax(q k^T * scale) v over the visible keys, in float32 ``[B, L, H, D]``; q head h
    reads kv head h // (H / G) (transformers' ``repeat_kv`` order). A row with no visible key
    gives zeros, as torch's SDPA (not NaN from -inf everywhere)."""
    b, length, h, d = q_blhd.shape
    groups = k_blgd.shape[2]
    q_blgrd = q_blhd.reshape(b, length, groups, h // groups, d)
    scores = jnp.einsum("bqgrd,bkgd->bgrqk", q_blgrd, k_blgd, preferred_element_type=jnp.float32)
    scores = scores * scale
    visible = visible_bqk[:, None, None]
    probs = jax.nn.softmax(jnp.where(visible, scores, -jnp.inf), axis=-1)
    probs = jnp.where(visible.any(axis=-1, keepdims=True), probs, 0.0).astype(v_blgd.dtype)
    out = jnp.einsum("bgrqk,bkgd->bqgrd", probs, v_blgd, preferred_element_type=jnp.float32)
    return out.reshape(b, length, h, d)


class Attention(nn.Module):
    """Self-attention: (q/k norms,) RoPE, GQA, causal (or sliding-window) + padding mask."""

    options: DecoderOptions
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x_bld, visible_bqk, cos_ld, sin_ld):
        """Attention output ``[B, L, E]`` of the normed ``x_bld``; ``visible_bqk``: see
        :func:`visibility_mask`; ``cos_ld`` / ``sin_ld``: :func:`rope_cos_sin`."""
        o = self.options
        kw = {"dtype": self.dtype, "param_dtype": self.param_dtype}

        def project(heads, name):
            return project_in(
                o.hidden_size, heads, o.head_dim, bias=o.attention_bias, name=name, **kw
            )

        q_blhd = project(o.num_attention_heads, "q_proj")(x_bld)
        k_blgd = project(o.num_key_value_heads, "k_proj")(x_bld)
        if o.qk_norm:  # Qwen3: an RMSNorm over each head's head_dim, before RoPE
            q_blhd = RMSNorm(o.rms_norm_eps, name="q_norm", **kw)(q_blhd)
            k_blgd = RMSNorm(o.rms_norm_eps, name="k_norm", **kw)(k_blgd)
        v_blgd = project(o.num_key_value_heads, "v_proj")(x_bld)
        q_blhd, k_blgd = apply_rope(q_blhd, cos_ld, sin_ld), apply_rope(k_blgd, cos_ld, sin_ld)
        out_blhd = grouped_attention(q_blhd, k_blgd, v_blgd, visible_bqk, o.head_dim**-0.5)
        heads = o.num_attention_heads
        out_proj = project_out(
            heads, o.head_dim, o.hidden_size, bias=o.attention_bias, name="o_proj", **kw
        )
        return out_proj(out_blhd.astype(self.dtype))


class GatedMLP(nn.Module):
    """``down(activation(gate x) * up x)`` with bias-free Linears (SwiGLU with ``silu``)."""

    hidden_size: int
    intermediate_size: int
    activation: Callable[[jax.Array], jax.Array] = silu
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x_bld: jax.Array) -> jax.Array:
        """``[B, L, E] -> [B, L, E]``."""
        kw = {"dtype": self.dtype, "param_dtype": self.param_dtype, "use_bias": False}

        def dense(features, axes, name):
            """A bias-free torch-initialised Linear."""
            init = nn.with_logical_partitioning(normal_init(), axes)
            return nn.Dense(features, kernel_init=init, name=name, **kw)

        gate = dense(self.intermediate_size, ("embed", "mlp"), "gate_proj")(x_bld)
        up = dense(self.intermediate_size, ("embed", "mlp"), "up_proj")(x_bld)
        return dense(self.hidden_size, ("mlp", "embed"), "down_proj")(self.activation(gate) * up)


class DecoderLayer(nn.Module):
    """transformers' Llama-style decoder layer (pre-norm attention and MLP, residuals)."""

    options: DecoderOptions
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x_bld, visible_bqk, cos_ld, sin_ld):
        """One layer on ``x_bld [B, L, E]``."""
        o = self.options
        kw = {"dtype": self.dtype, "param_dtype": self.param_dtype}
        h = RMSNorm(o.rms_norm_eps, name="input_layernorm", **kw)(x_bld)
        x_bld = x_bld + Attention(o, name="self_attn", **kw)(h, visible_bqk, cos_ld, sin_ld)
        h = RMSNorm(o.rms_norm_eps, name="post_attention_layernorm", **kw)(x_bld)
        mlp = GatedMLP(o.hidden_size, o.intermediate_size, name="mlp", **kw)
        return x_bld + mlp(h)


def token_embedding(vocab_size: int, hidden_size: int, dtype, param_dtype) -> nn.Embed:
    """The token embedding (``embed_tokens``), torch-initialised."""
    return nn.Embed(
        vocab_size,
        hidden_size,
        embedding_init=nn.with_logical_partitioning(normal_init(), ("vocab", "embed")),
        param_dtype=param_dtype,
        dtype=dtype,
    )


class DecoderLM(nn.Module):
    """The decoder stack (transformers' ``LlamaModel`` pattern); ``__call__(ids, mask, layers)``
    -> the hidden states ``layers`` (default all) stacked ``[K, B, L, E]``, running only the
    first ``max(layers)`` layers. ``config``: a model config with ``decoder_options()``;
    subclasses name the model and narrow the config's type."""

    config: Any
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @property
    def options(self) -> DecoderOptions:
        """The config's :class:`DecoderOptions`."""
        return self.config.decoder_options()

    def setup(self):
        """Embedding, layers and the final norm, named as transformers' ``model.*``."""
        o = self.options
        kw = {"dtype": self.dtype, "param_dtype": self.param_dtype}
        self.embed_tokens = token_embedding(o.vocab_size, o.hidden_size, **kw)
        self.layers = [DecoderLayer(o, **kw) for _ in range(o.num_hidden_layers)]
        self.norm = RMSNorm(o.rms_norm_eps, **kw)

    def __call__(self, ids_bl: jax.Array, mask_bl: jax.Array, layers: Sequence[int] | None = None):
        """Hidden states ``layers`` of ``ids_bl`` / ``mask_bl [B, L]`` as ``[K, B, L, E]``."""
        o = self.options
        layers = tuple(range(o.num_hidden_layers + 1)) if layers is None else tuple(layers)
        upto = max(layers)
        cos_sin = rope_cos_sin(ids_bl.shape[1], o.rope_inv_freq, o.rope_attention_factor)
        cos_ld, sin_ld = (jnp.asarray(t) for t in cos_sin)
        visible_bqk = visibility_mask(mask_bl, o.sliding_window)
        x_bld = self.embed_tokens(ids_bl).astype(self.dtype)
        kept = {0: x_bld}
        for index, layer in enumerate(self.layers[:upto], start=1):
            x_bld = layer(x_bld, visible_bqk, cos_ld, sin_ld)
            kept[index] = x_bld
        if upto == o.num_hidden_layers:  # transformers' last hidden state is normed
            kept[upto] = self.norm(x_bld)
        elif self.is_initializing():  # still create the final norm's weight
            self.norm(x_bld)
        return jnp.stack([kept[k] for k in layers])


# --- running it ----------------------------------------------------------------------------------


@functools.lru_cache(maxsize=16)
def _jitted_states(module: DecoderLM, layers: tuple[int, ...]):
    """jit(params, ids, mask) -> hidden states ``layers`` stacked ``[B, K, L, E]``."""

    def run(params, ids_bl, mask_bl):
        """Run the first max(layers) layers; batch first."""
        states_kble = module.apply({"params": params}, ids_bl, mask_bl, layers)
        return jnp.swapaxes(states_kble, 0, 1)

    return jax.jit(run)


def _check_layers(num_layers: int, layers: Sequence[int]) -> tuple[int, ...]:
    """The indices as ints; ValueError naming the valid range otherwise."""
    layers = tuple(int(k) for k in layers)
    if not layers or min(layers) < 0 or max(layers) > num_layers:
        raise ValueError(
            f"hidden state indices {list(layers)} must be in 0..{num_layers} "
            "(0: the embedding, k: the output of layer k)"
        )
    return layers


def hidden_states(module: DecoderLM, params, ids_bl, mask_bl, layers: Sequence[int]):
    """transformers' ``output_hidden_states[k]`` for k in ``layers``, as ``[B, K, L, E]``
    (jitted; only layers up to ``max(layers)`` run)."""
    layers = _check_layers(module.options.num_hidden_layers, layers)
    ids_bl, mask_bl = jnp.asarray(ids_bl, jnp.int32), jnp.asarray(mask_bl, jnp.int32)
    return _jitted_states(module, layers)(params, ids_bl, mask_bl)


def stacked_hidden_states(module: DecoderLM, params, ids_bl, mask_bl, layers) -> jax.Array:
    """The FLUX.2 pipelines' prompt embedding from token ids: ``[B, L, K * E]``, channel
    ``k * E + e`` = hidden state ``layers[k]`` (their ``stack(dim=1).permute(0, 2, 1, 3)``)."""
    states_bkle = hidden_states(module, params, ids_bl, mask_bl, layers)
    b, k, length, e = states_bkle.shape
    return jnp.transpose(states_bkle, (0, 2, 1, 3)).reshape(b, length, k * e)


# --- weights -------------------------------------------------------------------------------------


def heads_in(heads: int, head_dim: int) -> weights.Invertible:
    """torch Linear [H*D, E] -> kernel [E, H, D] (invertible for export)."""
    return weights.Invertible(
        lambda w: w.T.reshape(w.shape[1], heads, head_dim),
        lambda k: k.reshape(k.shape[0], -1).T,
    )


def heads_out(heads: int, head_dim: int) -> weights.Invertible:
    """torch Linear [E, H*D] -> kernel [H, D, E]."""
    return weights.Invertible(
        lambda w: w.T.reshape(heads, head_dim, w.shape[0]),
        lambda k: k.reshape(-1, k.shape[-1]).T,
    )


def bias_heads(heads: int, head_dim: int) -> weights.Invertible:
    """torch bias [H*D] -> [H, D]."""
    return weights.Invertible(lambda b: b.reshape(heads, head_dim), lambda b: b.reshape(-1))


def attention_weight_map(
    src: str,
    dst: tuple,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    bias: bool,
    qk_norm_param: str | None = None,
) -> dict:
    """Weight map entries of one layer's ``self_attn`` (torch keys under ``src``, Flax paths
    under ``dst``); ``qk_norm_param``: the q/k norms' Flax parameter name, None without them."""
    ident = weights.identity
    heads = {"q_proj": num_heads, "k_proj": num_kv_heads, "v_proj": num_kv_heads}
    mapping = {}
    for name, n in heads.items():
        mapping[(*dst, name, "kernel")] = (f"{src}.{name}.weight", heads_in(n, head_dim))
        if bias:
            mapping[(*dst, name, "bias")] = (f"{src}.{name}.bias", bias_heads(n, head_dim))
    mapping[(*dst, "o_proj", "kernel")] = (f"{src}.o_proj.weight", heads_out(num_heads, head_dim))
    if bias:
        mapping[(*dst, "o_proj", "bias")] = (f"{src}.o_proj.bias", ident)
    if qk_norm_param is not None:
        for name in ("q_norm", "k_norm"):
            mapping[(*dst, name, qk_norm_param)] = (f"{src}.{name}.weight", ident)
    return mapping


def mlp_weight_map(src: str, dst: tuple) -> dict:
    """Weight map entries of a :class:`GatedMLP` (torch ``gate_proj`` / ``up_proj`` /
    ``down_proj`` under ``src``)."""
    return {
        (*dst, name, "kernel"): (f"{src}.{name}.weight", weights.linear)
        for name in ("gate_proj", "up_proj", "down_proj")
    }


def weight_map(options: DecoderOptions, prefix: str) -> dict:
    """Flax param path of a :class:`DecoderLM` -> (transformers key under ``prefix``,
    transform)."""
    o, ident = options, weights.identity
    mapping = {
        ("embed_tokens", "embedding"): (f"{prefix}embed_tokens.weight", ident),
        ("norm", "scale"): (f"{prefix}norm.weight", ident),
    }
    for i in range(o.num_hidden_layers):
        src, dst = f"{prefix}layers.{i}", f"layers_{i}"
        mapping |= attention_weight_map(
            f"{src}.self_attn",
            (dst, "self_attn"),
            num_heads=o.num_attention_heads,
            num_kv_heads=o.num_key_value_heads,
            head_dim=o.head_dim,
            bias=o.attention_bias,
            qk_norm_param="scale" if o.qk_norm else None,
        )
        mapping |= mlp_weight_map(f"{src}.mlp", (dst, "mlp"))
        for name in ("input_layernorm", "post_attention_layernorm"):
            mapping[(dst, name, "scale")] = (f"{src}.{name}.weight", ident)
    return mapping


def find_prefix(reader: weights.SafetensorsReader, prefixes: Sequence[str], what: str) -> str:
    """The first of ``prefixes`` under which the checkpoint holds ``embed_tokens.weight``;
    WeightsError naming ``what``, the directory and the keys tried when none does."""
    for prefix in prefixes:
        if f"{prefix}embed_tokens.weight" in reader:
            return prefix
    tried = [f"{p}embed_tokens.weight" for p in prefixes]
    where = getattr(reader, "directory", "the checkpoint")
    raise weights.WeightsError(f"no {what} in {where}: none of {tried} found")


def abstract_params(module: nn.Module):
    """The ``params`` collection of a module called ``(ids, mask)`` as boxed
    ShapeDtypeStructs (nothing allocated)."""
    ids = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    return weights.shapes_of_init(module.init, ids, ids)["params"]


@functools.lru_cache(maxsize=8)
def count_params(module: nn.Module) -> int:
    """Elements of the module's parameters (tracing a 40-layer init takes seconds: once per
    module)."""
    return weights.count_elements(abstract_params(module))


def init_params(module: nn.Module, rng) -> dict:
    """Random-init params of a module called ``(ids, mask)`` (unboxed, on the default
    device)."""
    ids = jnp.zeros((1, 1), jnp.int32)
    return nn.meta.unbox(jax.jit(module.init)(rng, ids, ids)["params"])


def load_params(
    module: nn.Module,
    reader: weights.SafetensorsReader,
    mapping: Mapping,
    *,
    mesh: jax.sharding.Mesh | None,
    rules,
    ignore_unused: Sequence[str],
) -> dict:
    """The module's params read from ``reader`` through ``mapping`` (a weight map), in the
    module's ``param_dtype`` and placed on ``mesh`` by ``rules``; keys under ``ignore_unused``
    are skipped, any other unmapped key is an error."""
    return weights.load_placed(
        reader,
        mapping,
        abstract_params(module),
        mesh=mesh,
        rules=rules,
        dtype=module.param_dtype,
        ignore_unused=tuple(ignore_unused),
    )
