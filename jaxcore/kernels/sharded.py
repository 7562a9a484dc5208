"""What the sharded attention backends (flash, ulysses, ring) share, written once.

- input checks (:func:`check_attention_inputs`) and the softmax scale (:func:`resolve_scale`);
- padding of queries and keys to a multiple (:func:`pad_axis`, :func:`pad_keys`; padded keys
  are masked out);
- the mesh axes of batch and heads under the active logical rules (:func:`batch_and_heads_spec`)
  and axis sizes (:func:`axis_size`);
- :func:`run_sharded`: pad, build the partition specs, ``shard_map`` the per-device body (with or
  without a key mask) and slice the queries back to their length.

Layout: q ``[B, Lq, H, D]``, k/v ``[B, Lk, H, D]``, ``kv_mask`` ``[B, Lk]`` (True = attend).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.sharding import Mesh, PartitionSpec

from jaxcore import sharding

CONTEXT_AXIS = "context"
TENSOR_AXIS = "tensor"


def check_attention_inputs(q, k, v, kv_mask) -> None:
    """Raise a ValueError naming the tensor when q/k/v/kv_mask shapes do not fit together."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(f"attention {name} must be [B, L, H, D], got shape {x.shape}")
    if k.shape != v.shape:
        raise ValueError(f"attention k {k.shape} and v {v.shape} must have the same shape")
    if q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ValueError(
            f"attention q {q.shape} and k {k.shape} must agree on batch, heads and head dim"
        )
    if kv_mask is not None and kv_mask.shape != k.shape[:2]:
        raise ValueError(f"attention kv_mask must be [B, Lk] = {k.shape[:2]}, got {kv_mask.shape}")


def resolve_scale(q: jax.Array, scale: float | None) -> float:
    """The softmax scale: ``1 / sqrt(head dim)`` unless given."""
    return q.shape[-1] ** -0.5 if scale is None else scale


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def pad_axis(x: jax.Array, multiple: int, axis: int = 1, value=0) -> jax.Array:
    """Pad ``axis`` of x at the end up to a multiple (no-op when it already is one)."""
    extra = round_up(x.shape[axis], multiple) - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def pad_keys(k, v, kv_mask, multiple: int):
    """Pad k/v along the sequence to a multiple; the padding is masked out in the mask.

    Returns ``(k, v, mask)``; ``mask`` stays None when there was neither a mask nor padding.
    """
    padded_len = round_up(k.shape[1], multiple)
    if padded_len == k.shape[1]:
        return k, v, kv_mask
    if kv_mask is None:
        kv_mask = jnp.ones(k.shape[:2], dtype=bool)
    return pad_axis(k, multiple), pad_axis(v, multiple), pad_axis(kv_mask, multiple, value=False)


def platform_of(mesh: Mesh | None) -> str:
    """The platform the attention runs on: the mesh's devices, else the default backend."""
    if mesh is not None:
        return mesh.devices.flat[0].platform
    return jax.default_backend()


def axis_size(mesh: Mesh | None, axis: str) -> int:
    """Size of a mesh axis; 1 without a mesh or when the mesh lacks the axis."""
    if mesh is None:
        return 1
    return dict(mesh.shape).get(axis, 1)


def batch_and_heads_spec(mesh: Mesh, *, batch: int, heads: int):
    """Mesh axes for the batch and heads dimensions under the active logical axis rules.

    A size that does not divide its axes is left replicated over them (correct, as GSPMD does
    for ``dot_product``, but redundant): a model's ``init`` traces with a batch of one, so an
    error here would break it. Models call ``sharding.check_divisible`` to make it an error.
    """
    rules = nn.get_logical_axis_rules() or sharding.LOGICAL_AXIS_RULES
    batch_axes, heads_axes = sharding.logical_to_spec(
        ("activation_batch", "activation_heads"), rules
    )
    return _if_divisible(mesh, batch, batch_axes), _if_divisible(mesh, heads, heads_axes)


def _if_divisible(mesh: Mesh, size: int, axes):
    names = (axes,) if isinstance(axes, str) else tuple(axes or ())
    return axes if size % math.prod(axis_size(mesh, a) for a in names) == 0 else None


def shard_map(fn, mesh: Mesh, in_specs, out_specs):
    """``jax.shard_map`` with check_vma off: the online-softmax carries start replicated
    (zeros) and become device-varying, which the checker would reject in ``lax.scan``."""
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def run_sharded(
    per_device: Callable,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    kv_mask: jax.Array | None,
    *,
    mesh: Mesh,
    q_multiple: int,
    kv_multiple: int,
    kv_over_context: bool,
    mask_over_context: bool,
) -> jax.Array:
    """Pad, shard and run ``per_device(q, k, v, kv_mask_or_None)`` on every device.

    Batch goes over the batch axes and heads over ``tensor`` (when they divide); queries over
    ``context`` when it has more than one device, keys/values too when ``kv_over_context`` and
    the key mask when ``mask_over_context``. Queries are padded to ``q_multiple`` and keys to
    ``kv_multiple`` (padded keys masked); the output is sliced back to the query length.
    """
    batch_axes, heads_axes = batch_and_heads_spec(mesh, batch=q.shape[0], heads=q.shape[2])
    context = CONTEXT_AXIS if axis_size(mesh, CONTEXT_AXIS) > 1 else None
    lq = q.shape[1]
    q = pad_axis(q, q_multiple)
    k, v, kv_mask = pad_keys(k, v, kv_mask, kv_multiple)
    q_spec = PartitionSpec(batch_axes, context, heads_axes, None)
    kv_spec = PartitionSpec(batch_axes, context if kv_over_context else None, heads_axes, None)
    if kv_mask is None:
        fn = shard_map(
            lambda q_, k_, v_: per_device(q_, k_, v_, None),
            mesh,
            (q_spec, kv_spec, kv_spec),
            q_spec,
        )
        return fn(q, k, v)[:, :lq]
    mask_spec = PartitionSpec(batch_axes, context if mask_over_context else None)
    fn = shard_map(per_device, mesh, (q_spec, kv_spec, kv_spec, mask_spec), q_spec)
    return fn(q, k, v, kv_mask)[:, :lq]
