"""Ulysses context parallelism (Jacobs et al., 2023, "DeepSpeed Ulysses").

Inputs arrive sharded on the sequence over the mesh axis ``context``. One ``all_to_all`` per
tensor turns "a slice of the sequence, all heads" into "the whole sequence, a slice of the
heads"; each device then runs ordinary (flash) attention on its heads, and a second
``all_to_all`` restores the sequence sharding. Batch stays on the batch axes and heads on
``tensor`` throughout, so the heads left after the tensor split must divide by the context
size.
"""

from __future__ import annotations

import functools
import math

import jax
from jax import lax
from jax.sharding import Mesh

from jaxcore.kernels import flash
from jaxcore.kernels.sharded import (
    CONTEXT_AXIS,
    axis_size,
    batch_and_heads_spec,
    check_attention_inputs,
    platform_of,
    resolve_scale,
    run_sharded,
)
from jaxcore.sharding import ShardingError


def _check_heads_split(mesh: Mesh, heads: int, heads_axes, context: int) -> None:
    """Ulysses hands each context shard ``heads / (tensor * context)`` whole heads."""
    names = (heads_axes,) if isinstance(heads_axes, str) else tuple(heads_axes or ())
    tensor = math.prod(axis_size(mesh, a) for a in names)
    local_heads = heads // tensor
    if local_heads % context:
        raise ShardingError(
            f"ulysses attention needs num_attention_heads per tensor shard ({heads} / "
            f"ici_tensor_parallelism {tensor} = {local_heads}) divisible by "
            f"ici_context_parallelism {context}"
        )


def _seq_to_heads(x):
    """[b, L/c, h, D] sequence shard -> [b, L, h/c, D] head shard."""
    return lax.all_to_all(x, CONTEXT_AXIS, split_axis=2, concat_axis=1, tiled=True)


def _heads_to_seq(x):
    """[b, L, h/c, D] head shard -> [b, L/c, h, D] sequence shard."""
    return lax.all_to_all(x, CONTEXT_AXIS, split_axis=1, concat_axis=2, tiled=True)


def ulysses_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    kv_mask: jax.Array | None = None,
    scale: float | None = None,
    mesh: Mesh | None = None,
    block_sizes: flash.BlockSizes | None = None,
) -> jax.Array:
    """Attention with the sequence split over ``context`` via two all_to_alls per tensor.

    Without a mesh, or with a context axis of size 1, this is ``flash_attention`` (which
    still shards batch/heads over the mesh). Sequences are padded to a multiple of the
    context size (padded keys masked) and the output is sliced back.
    """
    context = axis_size(mesh, CONTEXT_AXIS)
    if context == 1:
        return flash.flash_attention(
            q, k, v, kv_mask=kv_mask, scale=scale, mesh=mesh, block_sizes=block_sizes
        )
    check_attention_inputs(q, k, v, kv_mask)
    _, heads_axes = batch_and_heads_spec(mesh, batch=q.shape[0], heads=q.shape[2])
    _check_heads_split(mesh, q.shape[2], heads_axes, context)
    local_attention = functools.partial(
        flash.local_flash_attention,
        scale=resolve_scale(q, scale),
        block_sizes=block_sizes,
        platform=platform_of(mesh),
    )

    def per_device(q_, k_, v_, mask_):
        # After the all_to_all every device holds the whole key sequence: the mask is not split.
        out = local_attention(_seq_to_heads(q_), _seq_to_heads(k_), _seq_to_heads(v_), mask_)
        return _heads_to_seq(out)

    return run_sharded(
        per_device,
        q,
        k,
        v,
        kv_mask,
        mesh=mesh,
        q_multiple=context,
        kv_multiple=context,
        kv_over_context=True,
        mask_over_context=False,
    )
