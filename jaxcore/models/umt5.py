"""UMT5 encoder (Wan 2.1's prompt encoder): a compatibility layer over :mod:`jaxcore.models.t5`.

The implementation lives in :mod:`jaxcore.models.t5` (one encoder for T5 and UMT5, the variant
chosen by ``T5Config.model_type``). This module keeps the old names working with UMT5 defaults
until callers import from ``t5`` directly; it adds no behaviour of its own except that
``UMT5Config`` insists on ``model_type="umt5"``.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp

from jaxcore import weights
from jaxcore.models import t5
from jaxcore.models.t5 import (  # noqa: F401 - re-exported
    EMBEDDING_KEYS,
    IGNORED_CONFIG_KEYS,
    UNUSED_PREFIXES,
    FeedForward,
    RMSNorm,
    SelfAttention,
    abstract_variables,
    relative_position_buckets,
    weight_map,
)
from jaxcore.models.t5 import T5Block as UMT5Block  # noqa: F401 - re-exported
from jaxcore.models.t5 import T5ConfigError as UMT5ConfigError
from jaxcore.models.t5 import T5Encoder as UMT5Encoder

_D = t5.UMT5_DEFAULTS


@dataclasses.dataclass(frozen=True)
class UMT5Config(t5.T5Config):
    """``T5Config`` with transformers' ``UMT5Config`` defaults (umt5-small), model_type "umt5".

    Wan 2.1 uses umt5-xxl (d_model=4096, d_ff=10240, num_layers=24, num_heads=64,
    vocab_size=256384).
    """

    vocab_size: int = _D["vocab_size"]
    d_model: int = _D["d_model"]
    d_kv: int = _D["d_kv"]
    d_ff: int = _D["d_ff"]
    num_layers: int = _D["num_layers"]
    num_heads: int = _D["num_heads"]
    relative_attention_num_buckets: int = _D["relative_attention_num_buckets"]
    relative_attention_max_distance: int = _D["relative_attention_max_distance"]
    feed_forward_proj: str = _D["feed_forward_proj"]
    layer_norm_epsilon: float = _D["layer_norm_epsilon"]
    model_type: str = "umt5"

    def __post_init__(self):
        if self.model_type != "umt5":
            raise UMT5ConfigError(
                f"UMT5Config.model_type must be 'umt5', got {self.model_type!r} "
                "(use jaxcore.models.t5.T5Config for T5 checkpoints)"
            )
        super().__post_init__()


def init_umt5(
    config: UMT5Config,
    rng: jax.Array,
    *,
    dtype=jnp.float32,
    param_dtype=None,
    mesh: jax.sharding.Mesh | None = None,
) -> tuple[UMT5Encoder, dict]:
    """Random-init encoder -> (module, params); see :func:`jaxcore.models.t5.init_t5_encoder`."""
    return t5.init_t5_encoder(config, rng, dtype=dtype, param_dtype=param_dtype, mesh=mesh)


def load_umt5(
    directory: str | os.PathLike,
    *,
    dtype=jnp.float32,
    param_dtype=None,
    mesh: jax.sharding.Mesh | None = None,
) -> tuple[UMT5Encoder, dict]:
    """Load a transformers UMT5 encoder directory; see :func:`~jaxcore.models.t5.load_t5_encoder`.

    ``config.json`` is read as a :class:`UMT5Config` (absent keys take UMT5 defaults).
    """
    config = UMT5Config.from_dict(weights.read_config(directory))
    return t5.load_t5_encoder(
        directory, dtype=dtype, param_dtype=param_dtype, mesh=mesh, config=config
    )
