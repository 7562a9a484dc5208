"""Ring attention (Liu et al., 2023, "Ring Attention with Blockwise Transformers").

Queries, keys, values and the key mask are sharded on the sequence over the mesh axis
``context``. Each device keeps its query shard; the key/value/mask shards travel around the
ring with ``lax.ppermute`` while every device folds each visiting shard into float32
online-softmax statistics (running max and sum, see :mod:`jaxcore.kernels.flash`). After
``context`` steps every query has seen every key; no device ever holds the whole sequence.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh

from jaxcore.kernels import flash
from jaxcore.kernels.sharded import (
    CONTEXT_AXIS,
    axis_size,
    check_attention_inputs,
    resolve_scale,
    run_sharded,
)


def _fold_shard(states, q_blocks, k, v, kv_mask, *, scale: float, block_kv: int):
    """Fold one key/value shard into the statistics of every query block."""

    def one_block(args):
        state, q_blk = args
        return flash.attend_kv_blocks(state, q_blk, k, v, kv_mask, scale, block_kv)

    return lax.map(one_block, (states, q_blocks))


def _ring_per_device(q, k, v, kv_mask, *, context: int, scale: float, block_q: int, block_kv: int):
    """The body run on each device: ``context`` folds, rotating k/v/mask in between."""
    b, lq, h, d = q.shape
    num_q_blocks = lq // block_q
    q_blocks = jnp.moveaxis(q.reshape(b, num_q_blocks, block_q, h, d), 1, 0)
    states = jax.vmap(flash.init_state)(q_blocks)
    ring = [(i, (i + 1) % context) for i in range(context)]

    def rotate(x):
        return None if x is None else lax.ppermute(x, CONTEXT_AXIS, perm=ring)

    def fold(states, k_, v_, mask_):
        return _fold_shard(states, q_blocks, k_, v_, mask_, scale=scale, block_kv=block_kv)

    def step(carry, _):
        states, k_, v_, mask_ = carry
        k_, v_, mask_ = rotate(k_), rotate(v_), rotate(mask_)
        return (fold(states, k_, v_, mask_), k_, v_, mask_), None

    states = fold(states, k, v, kv_mask)
    (states, *_), _ = lax.scan(step, (states, k, v, kv_mask), None, length=context - 1)
    out = jax.vmap(flash.finalize, in_axes=(0, None))(states, q.dtype)
    return jnp.moveaxis(out, 0, 1).reshape(b, lq, h, d)


def ring_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    kv_mask: jax.Array | None = None,
    scale: float | None = None,
    mesh: Mesh | None = None,
    block_sizes: flash.BlockSizes | None = None,
) -> jax.Array:
    """Attention with q/k/v sharded on the sequence over ``context``, k/v passed round a ring.

    Without a mesh, or with a context axis of size 1, this is ``flash_attention``. Each
    shard is processed in blocks of at most ``block_q`` x ``block_kv``; both sequences are
    padded so every shard is a whole number of blocks (padded keys masked), and the output is
    sliced back.
    """
    context = axis_size(mesh, CONTEXT_AXIS)
    if context == 1:
        return flash.flash_attention(
            q, k, v, kv_mask=kv_mask, scale=scale, mesh=mesh, block_sizes=block_sizes
        )
    check_attention_inputs(q, k, v, kv_mask)
    block_sizes = block_sizes or flash.DEFAULT_BLOCK_SIZES
    block_q = min(block_sizes.block_q, -(-q.shape[1] // context))
    block_kv = min(block_sizes.block_kv, -(-k.shape[1] // context))
    scale = resolve_scale(q, scale)

    def per_device(q_, k_, v_, mask_):
        return _ring_per_device(
            q_, k_, v_, mask_, context=context, scale=scale, block_q=block_q, block_kv=block_kv
        )

    return run_sharded(
        per_device,
        q,
        k,
        v,
        kv_mask,
        mesh=mesh,
        q_multiple=context * block_q,
        kv_multiple=context * block_kv,
        kv_over_context=True,
        mask_over_context=True,
    )
