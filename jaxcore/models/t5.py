"""T5-family text encoder (T5 / T5 v1.1 and UMT5) in Flax linen, one implementation.

References: transformers ``T5EncoderModel`` (``transformers/models/t5/modeling_t5.py``; Flux's
``text_encoder_2`` is T5 v1.1 XXL) and ``UMT5EncoderModel`` (``models/umt5/modeling_umt5.py``;
Wan 2.1's prompt encoder). The two differ only in data, which :class:`T5Config` carries:

- ``model_type`` ``"t5"``: the first block owns the relative-position bias table and every
  block adds that same bias; ``"umt5"``: every block owns its own table;
- ``feed_forward_proj``: ``"<act>"`` (original T5: ``"relu"``, one input projection ``wi``) or
  ``"gated-<act>"`` (T5 v1.1 / UMT5: ``"gated-gelu"``, act(wi_0 x) * wi_1 x).

Numerics that differ from a "textbook" transformer and that this file reproduces:

- pre-norm blocks with T5's RMS layer norm (no mean, no bias), variance taken in float32;
- attention scores are *not* scaled by 1/sqrt(d_kv) (T5 folds the scale into the init);
- the learned relative-position bias is added to the scores, bucketed as in Mesh TensorFlow;
- ``gated-gelu`` uses the tanh approximation (``gelu_new``), a plain ``gelu`` the exact one;
- a final RMS norm after the last block.

Not reproduced: transformers' float16-only clamping of infinities inside each block (it is a
no-op in float32 and bfloat16, the dtypes used here).

Parameters use the logical axis names of :mod:`jaxcore.sharding`; :func:`weight_map` maps them
from the transformers state-dict keys (``shared.weight`` or its tied twin
``encoder.embed_tokens.weight``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from jaxcore import sharding, weights
from jaxcore.models.layers import HeadsEinsum, gelu_erf, silu

# --- config ------------------------------------------------------------------------------------

# config.json keys that describe training, generation, the decoder or bookkeeping; the encoder
# forward pass does not depend on them. Anything else not a T5Config field is an error.
IGNORED_CONFIG_KEYS = frozenset(
    {
        "architectures",
        "torch_dtype",
        "dtype",
        "transformers_version",
        "dropout_rate",
        "classifier_dropout",
        "initializer_factor",
        "is_encoder_decoder",
        "use_cache",
        "output_past",
        "pad_token_id",
        "eos_token_id",
        "bos_token_id",
        "decoder_start_token_id",
        "num_decoder_layers",
        "tie_word_embeddings",
        "scale_decoder_outputs",
        "scalable_attention",
        "tokenizer_class",
        "gradient_checkpointing",
        "n_positions",
        "task_specific_params",
    }
)
# Keys derived from feed_forward_proj by transformers; checked for agreement, not stored.
DERIVED_CONFIG_KEYS = ("dense_act_fn", "is_gated_act", "is_decoder")

# model_type -> True when every block owns a relative-position bias table.
MODEL_TYPES = {"t5": False, "umt5": True}

# transformers' config defaults per model_type (T5Config: t5-small; UMT5Config: umt5-small).
# from_dict fills keys missing from a config.json with the defaults of *its* model_type.
T5_DEFAULTS = {
    "vocab_size": 32128,
    "d_model": 512,
    "d_kv": 64,
    "d_ff": 2048,
    "num_layers": 6,
    "num_heads": 8,
    "relative_attention_num_buckets": 32,
    "relative_attention_max_distance": 128,
    "feed_forward_proj": "relu",
    "layer_norm_epsilon": 1e-6,
}
UMT5_DEFAULTS = {
    **T5_DEFAULTS,
    "vocab_size": 250112,
    "d_ff": 1024,
    "num_layers": 8,
    "num_heads": 6,
    "feed_forward_proj": "gated-gelu",
}
DEFAULTS = {"t5": T5_DEFAULTS, "umt5": UMT5_DEFAULTS}

# feed_forward_proj activation name -> (transformers ACT2FN name, jax function).
_ACTIVATIONS = {
    "relu": jax.nn.relu,
    "gelu": gelu_erf,
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "silu": silu,
}


class T5ConfigError(ValueError):
    """A config.json that T5Config cannot represent; the message names the key."""


@dataclasses.dataclass(frozen=True)
class T5Config:
    """T5-family encoder architecture; field names follow transformers' ``config.json``.

    Defaults are transformers' ``T5Config`` defaults (t5-small). Flux uses T5 v1.1 XXL
    (d_model=4096, d_ff=10240, num_layers=24, num_heads=64, vocab_size=32128, gated-gelu);
    Wan 2.1 uses umt5-xxl (``model_type="umt5"``, the same sizes with vocab_size=256384).
    """

    vocab_size: int = T5_DEFAULTS["vocab_size"]
    d_model: int = T5_DEFAULTS["d_model"]
    d_kv: int = T5_DEFAULTS["d_kv"]
    d_ff: int = T5_DEFAULTS["d_ff"]
    num_layers: int = T5_DEFAULTS["num_layers"]
    num_heads: int = T5_DEFAULTS["num_heads"]
    relative_attention_num_buckets: int = T5_DEFAULTS["relative_attention_num_buckets"]
    relative_attention_max_distance: int = T5_DEFAULTS["relative_attention_max_distance"]
    feed_forward_proj: str = T5_DEFAULTS["feed_forward_proj"]
    layer_norm_epsilon: float = T5_DEFAULTS["layer_norm_epsilon"]
    model_type: str = "t5"

    def __post_init__(self):
        name = type(self).__name__
        for field in ("vocab_size", "d_model", "d_kv", "d_ff", "num_layers", "num_heads"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise T5ConfigError(f"{name}.{field} must be a positive int, got {value!r}")
        if self.model_type not in MODEL_TYPES:
            raise T5ConfigError(
                f"{name}.model_type {self.model_type!r} is not supported; "
                f"choose one of {sorted(MODEL_TYPES)}"
            )
        if self.relative_attention_num_buckets < 4:
            raise T5ConfigError(
                f"{name}.relative_attention_num_buckets must be >= 4 (half go to each "
                f"direction, half of those are exact), got {self.relative_attention_num_buckets}"
            )
        max_exact = self.relative_attention_num_buckets // 4
        if self.relative_attention_max_distance <= max_exact:
            raise T5ConfigError(
                f"{name}.relative_attention_max_distance must exceed num_buckets // 4 = "
                f"{max_exact} (the exact range), got {self.relative_attention_max_distance}"
            )
        self.activation_name  # noqa: B018 - validates feed_forward_proj early

    @property
    def per_layer_position_bias(self) -> bool:
        """UMT5: one bias table per block; T5: the first block's table serves every block."""
        return MODEL_TYPES[self.model_type]

    @property
    def is_gated(self) -> bool:
        """``gated-<act>``: two input projections, act(wi_0 x) * (wi_1 x)."""
        return self.feed_forward_proj.startswith("gated-")

    @property
    def activation_name(self) -> str:
        """transformers' ``dense_act_fn`` for this ``feed_forward_proj``."""
        parts = self.feed_forward_proj.split("-")
        if len(parts) > 2 or (len(parts) == 2 and parts[0] != "gated"):
            raise T5ConfigError(
                f"feed_forward_proj {self.feed_forward_proj!r} is not '<act>' or 'gated-<act>'"
            )
        # transformers maps exactly "gated-gelu" to the tanh approximation; plain "gelu" is exact.
        name = "gelu_new" if self.feed_forward_proj == "gated-gelu" else parts[-1]
        if name not in _ACTIVATIONS:
            raise T5ConfigError(
                f"feed_forward_proj {self.feed_forward_proj!r}: activation {name!r} is not "
                f"supported; choose one of {sorted(_ACTIVATIONS)}"
            )
        return name

    @classmethod
    def from_dict(cls, raw: Mapping[str, object]) -> T5Config:
        """Build from a transformers ``config.json`` dict.

        ``model_type`` (default: this class's) picks the variant and the defaults for absent
        keys. Keys starting with ``_`` and those in ``IGNORED_CONFIG_KEYS`` are skipped; any
        other unknown key is an error naming it. Derived keys (``dense_act_fn``,
        ``is_gated_act``) must agree with ``feed_forward_proj``; ``is_decoder`` must be false.
        """
        fields = {f.name: f for f in dataclasses.fields(cls)}
        model_type = raw.get("model_type", fields["model_type"].default)
        if model_type not in DEFAULTS:
            raise T5ConfigError(
                f"config key 'model_type' is {model_type!r}; {cls.__name__} supports "
                f"{sorted(DEFAULTS)}"
            )
        kwargs = dict(DEFAULTS[model_type], model_type=model_type)
        for key, value in raw.items():
            if key in fields:
                kwargs[key] = value
            elif key.startswith("_") or key in IGNORED_CONFIG_KEYS:
                continue
            elif key not in DERIVED_CONFIG_KEYS:
                raise T5ConfigError(
                    f"unknown {cls.__name__} config key {key!r}; known: {sorted(fields)} "
                    f"(ignored: {sorted(IGNORED_CONFIG_KEYS)})"
                )
        config = cls(**kwargs)
        if raw.get("is_decoder"):
            raise T5ConfigError("config key 'is_decoder' is true; only the encoder is supported")
        if "dense_act_fn" in raw and raw["dense_act_fn"] != config.activation_name:
            raise T5ConfigError(
                f"config key 'dense_act_fn' is {raw['dense_act_fn']!r} but feed_forward_proj "
                f"{config.feed_forward_proj!r} implies {config.activation_name!r}"
            )
        if "is_gated_act" in raw and bool(raw["is_gated_act"]) != config.is_gated:
            raise T5ConfigError(
                f"config key 'is_gated_act' is {raw['is_gated_act']!r} but feed_forward_proj "
                f"{config.feed_forward_proj!r} implies {config.is_gated}"
            )
        return config

    def to_dict(self) -> dict[str, object]:
        """The transformers ``config.json`` fields of this config."""
        return dataclasses.asdict(self)


# --- relative position buckets -----------------------------------------------------------------


def relative_position_buckets(length: int, num_buckets: int, max_distance: int) -> np.ndarray:
    """Bidirectional T5 bucket index [query, key] for a sequence of ``length`` tokens.

    Mesh TensorFlow's scheme as in transformers ``T5Attention._relative_position_bucket``
    (encoder, bidirectional; UMT5's is the same arithmetic): half the buckets per direction;
    within a direction, distances below half of those are exact, larger ones share logarithmic
    bins up to ``max_distance``. Computed with numpy in float32, the same arithmetic as the
    reference, at trace time: the result depends only on static sizes, so it is a constant and
    identical on every backend.
    """
    position = np.arange(length, dtype=np.int64)
    relative = position[None, :] - position[:, None]  # memory - query
    half = num_buckets // 2
    buckets = (relative > 0).astype(np.int64) * half
    distance = np.abs(relative)
    max_exact = half // 2
    # log of 0 is never selected (is_small covers it); clamp so numpy does not warn.
    ratio = np.log(np.maximum(distance, 1).astype(np.float32) / np.float32(max_exact))
    ratio = ratio / np.float32(math.log(max_distance / max_exact))
    ratio = ratio * np.float32(half - max_exact)
    large = np.minimum(max_exact + ratio.astype(np.int64), half - 1)
    buckets += np.where(distance < max_exact, distance, large)
    return buckets.astype(np.int32)


# --- layers --------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """T5 layer norm: x / rms(x) * scale, statistics in float32, no mean and no bias."""

    eps: float
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param(
            "scale",
            nn.with_logical_partitioning(nn.initializers.ones, ("norm",)),
            (x.shape[-1],),
            self.param_dtype,
        )
        x32 = x.astype(jnp.float32)
        variance = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
        normed = (x32 * jax.lax.rsqrt(variance + self.eps)).astype(self.dtype)
        return scale.astype(self.dtype) * normed


def _dense_init(fan_in: int):
    return nn.initializers.normal(stddev=fan_in**-0.5)


class SelfAttention(nn.Module):
    """T5 self-attention: unscaled scores plus a relative-position bias.

    ``has_relative_attention_bias``: this layer owns a bias table (every UMT5 layer; only the
    first T5 layer) and computes the bias from it; otherwise it adds the ``bias_hqk`` passed in.
    Returns ``(output, bias_hqk)`` so a T5 encoder can hand the first layer's bias on.
    """

    config: T5Config
    has_relative_attention_bias: bool = True
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    def _projection(self, name: str) -> HeadsEinsum:
        c = self.config
        return HeadsEinsum(
            (c.d_model, c.num_heads, c.d_kv),
            ("embed", "heads", "kv"),
            "bld,dhk->blhk",
            _dense_init(c.d_model),
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            name=name,
        )

    def _position_bias(self, buckets_qk: np.ndarray) -> jax.Array:
        """[H, Lq, Lk] float32 bias looked up from this layer's table."""
        c = self.config
        table = self.param(
            "relative_attention_bias",
            nn.with_logical_partitioning(
                nn.initializers.normal(stddev=1.0), ("relpos_buckets", "heads")
            ),
            (c.relative_attention_num_buckets, c.num_heads),
            self.param_dtype,
        )
        return jnp.transpose(table[buckets_qk], (2, 0, 1)).astype(jnp.float32)

    @nn.compact
    def __call__(
        self,
        x_bld: jax.Array,
        kv_mask_bl: jax.Array,
        buckets_qk: np.ndarray,
        bias_hqk: jax.Array | None = None,
    ) -> tuple[jax.Array, jax.Array]:
        c = self.config
        if self.has_relative_attention_bias:
            bias_hqk = self._position_bias(buckets_qk)
        elif bias_hqk is None:
            raise ValueError("a layer without its own bias table needs the shared bias_hqk")
        q_blhd = self._projection("q")(x_bld)
        k_blhd = self._projection("k")(x_bld)
        v_blhd = self._projection("v")(x_bld)
        heads = ("activation_batch", "activation_length", "activation_heads", "activation_kv")
        q_blhd, k_blhd, v_blhd = (sharding.constrain(t, heads) for t in (q_blhd, k_blhd, v_blhd))

        # T5 attention: no 1/sqrt(d_kv) scaling; scores and softmax in float32.
        scores_bhqk = jnp.einsum(
            "bqhd,bkhd->bhqk", q_blhd, k_blhd, preferred_element_type=jnp.float32
        )
        scores_bhqk = scores_bhqk + bias_hqk[None]
        scores_bhqk = jnp.where(
            kv_mask_bl[:, None, None, :], scores_bhqk, jnp.finfo(jnp.float32).min
        )
        probs_bhqk = jax.nn.softmax(scores_bhqk, axis=-1).astype(self.dtype)
        out_blhd = jnp.einsum(
            "bhqk,bkhd->bqhd", probs_bhqk, v_blhd, preferred_element_type=jnp.float32
        ).astype(self.dtype)
        out_bld = HeadsEinsum(
            (c.num_heads, c.d_kv, c.d_model),
            ("heads", "kv", "embed"),
            "blhk,hkd->bld",
            _dense_init(c.num_heads * c.d_kv),
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            name="o",
        )(out_blhd)
        return out_bld, bias_hqk


class FeedForward(nn.Module):
    """T5 MLP: wo(act(wi x)) or, gated, wo(act(wi_0 x) * wi_1 x); no biases."""

    config: T5Config
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    def _dense(self, features: int, fan_in: int, axes: tuple[str, str], name: str) -> nn.Dense:
        return nn.Dense(
            features,
            use_bias=False,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            kernel_init=nn.with_logical_partitioning(_dense_init(fan_in), axes),
            name=name,
        )

    @nn.compact
    def __call__(self, x_bld: jax.Array) -> jax.Array:
        c = self.config
        act = _ACTIVATIONS[c.activation_name]
        if c.is_gated:
            hidden = act(self._dense(c.d_ff, c.d_model, ("embed", "mlp"), "wi_0")(x_bld))
            hidden = hidden * self._dense(c.d_ff, c.d_model, ("embed", "mlp"), "wi_1")(x_bld)
        else:
            hidden = act(self._dense(c.d_ff, c.d_model, ("embed", "mlp"), "wi")(x_bld))
        hidden = sharding.constrain(
            hidden, ("activation_batch", "activation_length", "activation_mlp")
        )
        return self._dense(c.d_model, c.d_ff, ("mlp", "embed"), "wo")(hidden)


class T5Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + ffn(norm(x)).

    Returns ``(x, bias_hqk)``: the position bias this block used (see :class:`SelfAttention`).
    """

    config: T5Config
    has_relative_attention_bias: bool = True
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(
        self,
        x_bld: jax.Array,
        kv_mask_bl: jax.Array,
        buckets_qk: np.ndarray,
        bias_hqk: jax.Array | None = None,
    ) -> tuple[jax.Array, jax.Array]:
        eps = self.config.layer_norm_epsilon
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        normed = RMSNorm(eps, **kw, name="attention_norm")(x_bld)
        attended, bias_hqk = SelfAttention(
            self.config, self.has_relative_attention_bias, **kw, name="attention"
        )(normed, kv_mask_bl, buckets_qk, bias_hqk)
        x_bld = x_bld + attended
        normed = RMSNorm(eps, **kw, name="mlp_norm")(x_bld)
        x_bld = x_bld + FeedForward(self.config, **kw, name="mlp")(normed)
        x_bld = sharding.constrain(
            x_bld, ("activation_batch", "activation_length", "activation_embed")
        )
        return x_bld, bias_hqk


class T5Encoder(nn.Module):
    """T5 / UMT5 encoder stack; ``__call__(input_ids, attention_mask) -> last_hidden_state``.

    ``attention`` names the attention backend. Only ``"dot_product"`` is implemented: T5
    needs an additive per-head position bias, which the backends of :mod:`jaxcore.attention`
    do not take, so this file computes its own biased dot-product attention.
    """

    config: T5Config
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32
    attention: str = "dot_product"
    mesh: jax.sharding.Mesh | None = None

    @nn.compact
    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array | None = None) -> jax.Array:
        """input_ids [B, L] int, attention_mask [B, L] (1/True = real token) -> [B, L, d_model]."""
        c = self.config
        if self.attention != "dot_product":
            raise ValueError(
                f"{type(self).__name__}.attention={self.attention!r} is not supported: T5 adds a "
                "relative-position bias to the scores, only 'dot_product' implements it"
            )
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be [batch, length], got shape {input_ids.shape}")
        if attention_mask is None:
            kv_mask_bl = jnp.ones(input_ids.shape, bool)
        elif attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"attention_mask shape {attention_mask.shape} != input_ids shape {input_ids.shape}"
            )
        else:
            kv_mask_bl = attention_mask > 0

        embedding = self.param(
            "embedding",
            nn.with_logical_partitioning(nn.initializers.normal(stddev=1.0), ("vocab", "embed")),
            (c.vocab_size, c.d_model),
            self.param_dtype,
        )
        x_bld = jnp.take(embedding, input_ids, axis=0).astype(self.dtype)
        x_bld = sharding.constrain(
            x_bld, ("activation_batch", "activation_length", "activation_embed")
        )
        buckets_qk = relative_position_buckets(
            input_ids.shape[1], c.relative_attention_num_buckets, c.relative_attention_max_distance
        )
        bias_hqk = None  # T5: block_0 computes it, the others reuse it
        for i in range(c.num_layers):
            owns_table = c.per_layer_position_bias or i == 0
            x_bld, bias_hqk = T5Block(
                c, owns_table, self.dtype, self.param_dtype, name=f"block_{i}"
            )(x_bld, kv_mask_bl, buckets_qk, None if owns_table else bias_hqk)
        return RMSNorm(c.layer_norm_epsilon, self.dtype, self.param_dtype, name="final_norm")(x_bld)


# --- weights ---------------------------------------------------------------------------------

EMBEDDING_KEYS = ("shared.weight", "encoder.embed_tokens.weight")
# A full (encoder-decoder) checkpoint may be loaded; its decoder and LM head are unused.
UNUSED_PREFIXES = ("decoder.", "lm_head.")


def _heads_in(num_heads: int, d_kv: int):
    """torch Linear [H*D, E] -> DenseGeneral kernel [E, H, D]."""

    def transform(w: np.ndarray) -> np.ndarray:
        return w.T.reshape(w.shape[1], num_heads, d_kv)

    return weights.Invertible(transform, lambda k: k.reshape(k.shape[0], -1).T)


def _heads_out(num_heads: int, d_kv: int):
    """torch Linear [E, H*D] -> DenseGeneral kernel [H, D, E]."""

    def transform(w: np.ndarray) -> np.ndarray:
        return w.T.reshape(num_heads, d_kv, w.shape[0])

    return weights.Invertible(transform, lambda k: k.reshape(-1, k.shape[-1]).T)


def weight_map(config: T5Config, embedding_key: str = "shared.weight") -> dict:
    """Flax param path -> (transformers key, transform) for ``weights.load_params``.

    ``embedding_key``: ``shared.weight`` or ``encoder.embed_tokens.weight`` (tied copies).
    """
    if embedding_key not in EMBEDDING_KEYS:
        raise ValueError(f"embedding_key must be one of {EMBEDDING_KEYS}, got {embedding_key!r}")
    heads_in = _heads_in(config.num_heads, config.d_kv)
    heads_out = _heads_out(config.num_heads, config.d_kv)
    mapping = {
        ("embedding",): (embedding_key, weights.identity),
        ("final_norm", "scale"): ("encoder.final_layer_norm.weight", weights.identity),
    }
    for i in range(config.num_layers):
        src = f"encoder.block.{i}.layer"
        dst = f"block_{i}"
        attn = f"{src}.0.SelfAttention"
        for name in ("q", "k", "v"):
            mapping[(dst, "attention", name, "kernel")] = (f"{attn}.{name}.weight", heads_in)
        mapping[(dst, "attention", "o", "kernel")] = (f"{attn}.o.weight", heads_out)
        if config.per_layer_position_bias or i == 0:
            mapping[(dst, "attention", "relative_attention_bias")] = (
                f"{attn}.relative_attention_bias.weight",
                weights.identity,
            )
        mapping[(dst, "attention_norm", "scale")] = (f"{src}.0.layer_norm.weight", weights.identity)
        mapping[(dst, "mlp_norm", "scale")] = (f"{src}.1.layer_norm.weight", weights.identity)
        mlp_names = ("wi_0", "wi_1", "wo") if config.is_gated else ("wi", "wo")
        for name in mlp_names:
            mapping[(dst, "mlp", name, "kernel")] = (
                f"{src}.1.DenseReluDense.{name}.weight",
                weights.linear,
            )
    return mapping


def _dummy_inputs(config: T5Config) -> tuple:
    ids = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    return ids, ids  # input ids, attention mask


def abstract_variables(module: T5Encoder):
    return weights.shapes_of_init(module.init, *_dummy_inputs(module.config))


def count_params(config: T5Config) -> int:
    """Number of encoder parameters (the tied embedding once), from shapes only."""
    return weights.count_elements(abstract_variables(T5Encoder(config))["params"])


def init_t5_encoder(
    config: T5Config,
    rng: jax.Array,
    *,
    dtype=jnp.float32,
    param_dtype=None,
    mesh: jax.sharding.Mesh | None = None,
) -> tuple[T5Encoder, dict]:
    """Random-init encoder -> (module, params); params is the unboxed ``params`` collection,
    on the default device (``mesh`` is only kept on the module)."""
    module = T5Encoder(config, dtype=dtype, param_dtype=param_dtype or dtype, mesh=mesh)
    return module, weights.init_placed(module, _dummy_inputs(config), rng)


def _embedding_key(reader: weights.SafetensorsReader) -> str:
    for key in EMBEDDING_KEYS:
        if key in reader:
            return key
    raise weights.WeightsError(
        f"{reader.directory}: no token embedding; expected one of {list(EMBEDDING_KEYS)}"
    )


def load_t5_encoder(
    directory: str | os.PathLike,
    *,
    dtype=jnp.float32,
    param_dtype=None,
    mesh: jax.sharding.Mesh | None = None,
    rules=None,
    config: T5Config | None = None,
) -> tuple[T5Encoder, dict]:
    """Load a transformers T5 / UMT5 encoder directory (config.json + safetensors).

    Returns ``(module, params)``; call ``module.apply({"params": params}, ids, mask)``.
    ``dtype`` is the activation dtype and, unless ``param_dtype`` is given, the weight dtype.
    With a ``mesh`` every parameter is placed on its logical sharding directly (``rules``:
    logical axis rules, default :data:`jaxcore.sharding.LOGICAL_AXIS_RULES`). ``config``:
    an already validated config to use instead of reading ``config.json``.
    """
    if config is None:
        config = T5Config.from_dict(weights.read_config(directory))
    module = T5Encoder(config, dtype=dtype, param_dtype=param_dtype or dtype, mesh=mesh)
    reader = weights.SafetensorsReader(directory)
    embedding_key = _embedding_key(reader)
    tied_twins = tuple(k for k in EMBEDDING_KEYS if k != embedding_key)
    params = weights.load_placed(
        reader,
        weight_map(config, embedding_key),
        abstract_variables(module)["params"],
        mesh=mesh,
        rules=rules,
        dtype=param_dtype or dtype,
        ignore_unused=(*tied_twins, *UNUSED_PREFIXES),
    )
    return module, params


@functools.lru_cache(maxsize=8)
def _jitted_encoder(module: T5Encoder):
    return jax.jit(lambda params, ids: module.apply({"params": params}, ids))


def encode_prompts(tokenizer, module: T5Encoder, params, prompts, max_length: int) -> np.ndarray:
    """Prompt embeddings as FluxPipeline's ``_get_t5_prompt_embeds`` makes them: ids padded to
    ``max_length``, the encoder run without an attention mask, the last hidden state
    ``[B, max_length, d_model]`` float32 on the host. Every T5 family encodes here."""
    from jaxcore.text import padded_token_ids

    ids = padded_token_ids(tokenizer, prompts, max_length)
    return np.asarray(_jitted_encoder(module)(params, ids), np.float32)
