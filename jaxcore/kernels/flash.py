"""Memory-efficient ("flash") attention, plus the online-softmax pieces ring/ulysses reuse.

The algorithm is the online softmax of Milakov & Gimelshein (2018) as used by FlashAttention
(Dao et al., 2022): keys are visited block by block while a running maximum ``m``, a running
denominator ``l`` and an unnormalised accumulator ``acc`` are kept per query, so the full
``[Lq, Lk]`` score matrix never exists.

Per platform:
- GPU: ``jax.nn.dot_product_attention(implementation="cudnn")`` when cuDNN accepts the shapes and
  dtypes (bf16/fp16, head dim a multiple of 8); otherwise the chunked XLA path below.
- TPU: the Pallas splash kernel (``jax.experimental.pallas.ops.tpu.splash_attention``).
- CPU and every fallback: a chunked online softmax, ``lax.map`` over query blocks and
  ``lax.scan`` over key blocks (the block step is rematerialised in the backward pass).

With a ``mesh`` the computation runs in ``jax.shard_map``: batch over the batch axes, heads over
``tensor``, queries over ``context`` (keys/values gathered whole on every context shard).

Layout: q ``[B, Lq, H, D]``, k/v ``[B, Lk, H, D]``, ``kv_mask`` ``[B, Lk]`` (True = attend).
Rows whose keys are all masked return zeros (``dot_product`` returns the mean of v there).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax import lax
from jax.sharding import Mesh, PartitionSpec

from jaxcore import sharding
from jaxcore.attention import register

CONTEXT_AXIS = "context"
TENSOR_AXIS = "tensor"


# --- configuration ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes of the chunked / splash kernels (MaxDiffusion's ``flash_block_sizes``).

    ``block_q`` queries are processed against ``block_kv`` keys at a time. Blocks larger than
    a sequence shrink to it; sequences are padded up to a block multiple (padding is masked).
    """

    block_q: int = 512
    block_kv: int = 512

    def __post_init__(self):
        for name in ("block_q", "block_kv"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"flash_block_sizes.{name} must be a positive int, got {value!r}")

    @classmethod
    def from_dict(cls, values: Mapping[str, int] | None) -> BlockSizes:
        """Build from a config dict; an unknown key is an error naming it."""
        values = dict(values or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown flash_block_sizes key(s) {unknown}; known: {sorted(known)}")
        return cls(**values)


DEFAULT_BLOCK_SIZES = BlockSizes()


# --- input checks and padding ---------------------------------------------------------------


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


# --- online softmax -------------------------------------------------------------------------


class SoftmaxState(NamedTuple):
    """Running statistics of the online softmax for one block of queries (all float32).

    ``m``: running max of the scores ``[B, H, Lq]``; ``l``: running sum of ``exp(s - m)``
    ``[B, H, Lq]``; ``acc``: running ``sum exp(s - m) v`` ``[B, H, Lq, D]``.
    """

    m: jax.Array
    l: jax.Array  # noqa: E741 - the standard name of the softmax denominator
    acc: jax.Array


def init_state(q: jax.Array) -> SoftmaxState:
    """Empty statistics for queries q ``[B, Lq, H, D]``: max -inf, sum 0, accumulator 0."""
    b, lq, h, d = q.shape
    return SoftmaxState(
        m=jnp.full((b, h, lq), -jnp.inf, jnp.float32),
        l=jnp.zeros((b, h, lq), jnp.float32),
        acc=jnp.zeros((b, h, lq, d), jnp.float32),
    )


def update_state(state: SoftmaxState, q, k, v, kv_mask, scale: float) -> SoftmaxState:
    """Fold one block of keys/values into the statistics.

    Masked scores are -inf so they add exactly zero; the max used for stabilisation is a
    constant as far as gradients go (the result does not depend on it), hence stop_gradient.
    """
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * scale
    if kv_mask is not None:
        scores = jnp.where(kv_mask[:, None, None, :], scores, -jnp.inf)
    m_new = lax.stop_gradient(jnp.maximum(state.m, scores.max(axis=-1)))
    # A row with nothing seen yet has m_new = -inf; shift by 0 there to avoid inf - inf.
    m_shift = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    probs = jnp.exp(scores - m_shift[..., None])
    correction = jnp.exp(state.m - m_shift)
    pv = jnp.einsum("bhqk,bkhd->bhqd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return SoftmaxState(
        m=m_new,
        l=state.l * correction + probs.sum(axis=-1),
        acc=state.acc * correction[..., None] + pv,
    )


def finalize(state: SoftmaxState, dtype) -> jax.Array:
    """acc / l as ``[B, Lq, H, D]`` in ``dtype``; fully masked rows (l == 0) give zeros."""
    denom = jnp.where(state.l > 0, state.l, 1.0)
    out = state.acc / denom[..., None]
    return out.transpose(0, 2, 1, 3).astype(dtype)


def attend_kv_blocks(state: SoftmaxState, q, k, v, kv_mask, scale: float, block_kv: int):
    """Fold all of k/v (length a multiple of ``block_kv``) into ``state``, block by block.

    ``lax.scan`` over key blocks keeps one ``[Lq, block_kv]`` score tile live at a time; the
    step is rematerialised so the backward pass stores only the small carries per block.
    """
    b, lk, h, d = k.shape
    if lk % block_kv:
        raise ValueError(f"key length {lk} is not a multiple of block_kv {block_kv}")
    num_blocks = lk // block_kv
    if num_blocks == 1:
        return update_state(state, q, k, v, kv_mask, scale)

    def to_blocks(x):
        return (
            None
            if x is None
            else jnp.moveaxis(x.reshape(b, num_blocks, block_kv, *x.shape[2:]), 1, 0)
        )

    @functools.partial(jax.checkpoint, prevent_cse=False)
    def step(carry, kv_block):
        k_blk, v_blk, mask_blk = kv_block
        return update_state(carry, q, k_blk, v_blk, mask_blk, scale), None

    state, _ = lax.scan(step, state, (to_blocks(k), to_blocks(v), to_blocks(kv_mask)))
    return state


def chunked_attention(q, k, v, kv_mask=None, *, scale: float, block_sizes: BlockSizes):
    """Blockwise exact attention on one device; never builds the ``[Lq, Lk]`` scores.

    Queries are split in ``block_q`` blocks (``lax.map``), keys in ``block_kv`` blocks
    (``lax.scan``); both are padded to a block multiple, padded keys are masked.
    """
    b, lq, h, d = q.shape
    block_q = min(block_sizes.block_q, lq)
    block_kv = min(block_sizes.block_kv, k.shape[1])
    k, v, kv_mask = pad_keys(k, v, kv_mask, block_kv)
    q_padded = pad_axis(q, block_q)
    num_q_blocks = q_padded.shape[1] // block_q

    def one_query_block(q_blk):
        state = attend_kv_blocks(init_state(q_blk), q_blk, k, v, kv_mask, scale, block_kv)
        return finalize(state, q.dtype)

    if num_q_blocks == 1:
        out = one_query_block(q_padded)
    else:
        q_blocks = jnp.moveaxis(q_padded.reshape(b, num_q_blocks, block_q, h, d), 1, 0)
        out = lax.map(one_query_block, q_blocks)
        out = jnp.moveaxis(out, 0, 1).reshape(b, num_q_blocks * block_q, h, d)
    return out[:, :lq]


# --- platform kernels -----------------------------------------------------------------------


def _cudnn_attention(q, k, v, kv_mask, *, scale: float):
    """cuDNN fused attention; raises NotImplementedError/ValueError for unsupported inputs."""
    mask = None if kv_mask is None else kv_mask[:, None, None, :]
    return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, implementation="cudnn")


def _cudnn_accepts(q) -> bool:
    """cuDNN flash attention takes bf16/fp16 with a head dim <= 256 that is a multiple of 8."""
    return q.dtype in (jnp.bfloat16, jnp.float16) and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256


def splash_attention(
    q, k, v, kv_mask=None, *, scale: float, block_sizes: BlockSizes, interpret: bool = False
):
    """TPU Pallas splash attention (``make_splash_mha``) on one device's shard.

    Splash wants ``[H, L, D]`` per example, unscaled logits and sequence lengths that are a
    multiple of its 128-aligned blocks: q is pre-scaled, sequences are padded, and padded or
    masked keys get segment id 0 while every query has segment id 1 (so they never match).
    """
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as splash,
    )
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_mask as splash_masks,
    )

    b, lq, h, d = q.shape
    block_q = min(round_up(block_sizes.block_q, 128), round_up(lq, 128))
    block_kv = min(round_up(block_sizes.block_kv, 128), round_up(k.shape[1], 128))
    if kv_mask is None:
        kv_mask = jnp.ones(k.shape[:2], dtype=bool)
    k, v, kv_mask = pad_keys(k, v, kv_mask, block_kv)
    q_padded = pad_axis(q * jnp.asarray(scale, q.dtype), block_q)
    lq_pad, lk_pad = q_padded.shape[1], k.shape[1]

    kernel = splash.make_splash_mha(
        mask=splash_masks.MultiHeadMask([splash_masks.FullMask((lq_pad, lk_pad))] * h),
        block_sizes=splash.BlockSizes(
            block_q=block_q,
            block_kv=block_kv,
            block_kv_compute=block_kv,
            block_q_dkv=block_q,
            block_kv_dkv=block_kv,
            block_kv_dkv_compute=block_kv,
            block_q_dq=block_q,
            block_kv_dq=block_kv,
        ),
        head_shards=1,
        q_seq_shards=1,
        interpret=interpret,
    )
    segment_ids = splash.SegmentIds(
        q=jnp.ones((b, lq_pad), jnp.int32), kv=kv_mask.astype(jnp.int32)
    )

    def heads_first(x):
        return x.transpose(0, 2, 1, 3)

    out = jax.vmap(kernel)(heads_first(q_padded), heads_first(k), heads_first(v), segment_ids)
    return heads_first(out)[:, :lq].astype(q.dtype)


def local_flash_attention(
    q, k, v, kv_mask=None, *, scale: float, block_sizes: BlockSizes, platform: str
):
    """Flash attention on one device's arrays, picking the kernel for ``platform``."""
    if platform == "tpu":
        return splash_attention(q, k, v, kv_mask, scale=scale, block_sizes=block_sizes)
    if platform in ("gpu", "cuda", "rocm") and _cudnn_accepts(q):
        try:
            return _cudnn_attention(q, k, v, kv_mask, scale=scale)
        except (NotImplementedError, ValueError):
            # cuDNN refuses some shapes at trace time (e.g. odd lengths with a mask in
            # training); the chunked path is exact for all of them.
            pass
    return chunked_attention(q, k, v, kv_mask, scale=scale, block_sizes=block_sizes)


def platform_of(mesh: Mesh | None) -> str:
    """The platform the attention runs on: the mesh's devices, else the default backend."""
    if mesh is not None:
        return mesh.devices.flat[0].platform
    return jax.default_backend()


# --- mesh helpers shared by the sharded backends ---------------------------------------------


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


# --- the registered backend ---------------------------------------------------------------


def _resolve_scale(q, scale):
    return q.shape[-1] ** -0.5 if scale is None else scale


@register("flash")
def flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    kv_mask: jax.Array | None = None,
    scale: float | None = None,
    mesh: Mesh | None = None,
    block_sizes: BlockSizes | None = None,
) -> jax.Array:
    """Exact attention without the full score matrix; see the module docstring.

    With a mesh of more than one device: ``shard_map`` with batch over the batch axes, heads
    over ``tensor`` and queries over ``context`` (q padded to a multiple of the context size).
    """
    check_attention_inputs(q, k, v, kv_mask)
    scale = _resolve_scale(q, scale)
    block_sizes = block_sizes or DEFAULT_BLOCK_SIZES
    platform = platform_of(mesh)
    local = functools.partial(
        local_flash_attention, scale=scale, block_sizes=block_sizes, platform=platform
    )
    if mesh is None or mesh.size == 1:
        return local(q, k, v, kv_mask)

    batch_axes, heads_axes = batch_and_heads_spec(mesh, batch=q.shape[0], heads=q.shape[2])
    context = axis_size(mesh, CONTEXT_AXIS)
    context_axis = CONTEXT_AXIS if context > 1 else None
    lq = q.shape[1]
    q = pad_axis(q, context)
    q_spec = PartitionSpec(batch_axes, context_axis, heads_axes, None)
    kv_spec = PartitionSpec(batch_axes, None, heads_axes, None)
    if kv_mask is None:
        fn = shard_map(
            lambda q_, k_, v_: local(q_, k_, v_, None), mesh, (q_spec, kv_spec, kv_spec), q_spec
        )
        out = fn(q, k, v)
    else:
        mask_spec = PartitionSpec(batch_axes, None)
        fn = shard_map(local, mesh, (q_spec, kv_spec, kv_spec, mask_spec), q_spec)
        out = fn(q, k, v, kv_mask)
    return out[:, :lq]
