"""One attention interface; the backend is chosen by name (``attention=`` in config).

Layout everywhere: q [B, Lq, H, D], k/v [B, Lk, H, D] -> out [B, Lq, H, D].
``kv_mask`` (optional) is [B, Lk] booleans, True = attend.

The backends are a static table of import paths (:data:`BACKENDS`), so a config can be checked
against the names without importing any kernel, and no kernel module imports this one:

- ``dot_product``: plain XLA, the reference every other backend is tested against.
- ``flash``: memory-efficient exact attention (cuDNN on GPU, splash on TPU, chunked online
  softmax elsewhere), :mod:`jaxcore.kernels.flash`.
- ``ulysses``: sequence parallelism over ``context`` by all_to_all, :mod:`jaxcore.kernels.ulysses`.
- ``ring``: sequence parallelism over ``context`` by rotating k/v, :mod:`jaxcore.kernels.ring`.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable

import jax
import jax.numpy as jnp

AttentionFn = Callable[..., jax.Array]

# name -> "module:function"; every function takes (q, k, v, *, kv_mask, scale, mesh).
BACKENDS: dict[str, str] = {
    "dot_product": "jaxcore.attention:dot_product_attention",
    "flash": "jaxcore.kernels.flash:flash_attention",
    "ulysses": "jaxcore.kernels.ulysses:ulysses_attention",
    "ring": "jaxcore.kernels.ring:ring_attention",
}
BACKEND_NAMES: tuple[str, ...] = tuple(BACKENDS)


def check_backend(name: str, key: str = "attention") -> None:
    """Raise ValueError naming ``key`` when ``name`` is not a backend of the table."""
    if name not in BACKENDS:
        raise ValueError(
            f"{key}: unknown attention backend {name!r}; choose one of {BACKEND_NAMES}"
        )


@functools.cache
def get_backend(name: str) -> AttentionFn:
    """The attention function registered under ``name`` in :data:`BACKENDS`."""
    check_backend(name)
    module, _, function = BACKENDS[name].partition(":")
    return getattr(importlib.import_module(module), function)


def dot_product_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    kv_mask: jax.Array | None = None,
    scale: float | None = None,
    mesh=None,
) -> jax.Array:
    """softmax(q k^T * scale) v, computed in float32 and cast back to q's dtype."""
    del mesh
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * scale
    if kv_mask is not None:
        scores = jnp.where(kv_mask[:, None, None, :], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum(
        "bhqk,bkhd->bqhd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32
    )
    return out.astype(q.dtype)


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    backend: str = "dot_product",
    kv_mask: jax.Array | None = None,
    scale: float | None = None,
    mesh=None,
) -> jax.Array:
    """Dispatch to a named backend. Unknown names are an error listing the known ones."""
    fn = get_backend(backend)
    return fn(q, k, v, kv_mask=kv_mask, scale=scale, mesh=mesh)
