"""One attention interface; the backend is chosen by name (``attention=`` in config).

Layout everywhere: q [B, Lq, H, D], k/v [B, Lk, H, D] -> out [B, Lq, H, D].
``kv_mask`` (optional) is [B, Lk] booleans, True = attend.

Backends:
- ``dot_product``: plain XLA, the reference every other backend is tested against.
- ``flash``, ``ulysses``, ``ring``: see ``jaxcore/kernels`` (registered into ``BACKENDS``).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

AttentionFn = Callable[..., jax.Array]

BACKENDS: dict[str, AttentionFn] = {}


def register(name: str) -> Callable[[AttentionFn], AttentionFn]:
    def wrap(fn: AttentionFn) -> AttentionFn:
        BACKENDS[name] = fn
        return fn

    return wrap


@register("dot_product")
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


def _load_optional_backends() -> None:
    # Importing the kernels module registers flash/ulysses/ring; absent during bring-up.
    try:
        from jaxcore import kernels  # noqa: F401
    except ModuleNotFoundError as err:
        if err.name != "jaxcore.kernels":
            raise


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
    if backend not in BACKENDS:
        _load_optional_backends()
    try:
        fn = BACKENDS[backend]
    except KeyError:
        raise ValueError(
            f"unknown attention backend {backend!r}; choose one of {sorted(BACKENDS)}"
        ) from None
    return fn(q, k, v, kv_mask=kv_mask, scale=scale, mesh=mesh)
