"""Memory-efficient ("flash") attention, plus the online-softmax pieces ring/ulysses reuse.

The algorithm is the online softmax of Milakov & Gimelshein (2018) as used by FlashAttention
(Dao et al., 2022): keys are visited block by block while a running maximum ``m``, a running
denominator ``l`` and an unnormalised accumulator ``acc`` are kept per query, so the full
``[Lq, Lk]`` score matrix never exists.

Per platform:
- GPU: ``jax.nn.dot_product_attention(implementation="cudnn")`` when cuDNN accepts the shapes and
  dtypes (bf16/fp16, head dim a multiple of 8); otherwise the chunked XLA path below.
- TPU: jax's Pallas splash kernel (``jax.experimental.pallas.ops.tpu.splash_attention``),
  chosen over tokamax's on jax 0.12 by what the TPU compiler reports (``python -m
  bench.tpu_splash``, docs/benchmarks.md "Platform"): both compile for v5p and v6e, ours needs less HBM
  (one Wan 14B 720p chip's forward + backward: 0.77 against 1.08 GiB of temporaries with
  tokamax's three-step dq reduction, 54 GiB with its default, which does not fit a v6e chip),
  libtpu's cost model sees inside neither (tokamax's time is the FLOPs it declares, at ~85-96%
  of peak), and tokamax would add qwix, xprof and their dependencies.
- CPU and every fallback: blockwise online softmax over query and key blocks with
  FlashAttention-2's backward written out (:mod:`jaxcore.kernels.blockwise`). The
  online-softmax pieces below (:func:`update_state`, :func:`attend_kv_blocks`) serve ring
  attention, whose backward is autodiff's.

With a ``mesh`` the computation runs in ``jax.shard_map``: batch over the batch axes, heads over
``tensor``, queries over ``context`` (keys/values gathered whole on every context shard).

Layout: q ``[B, Lq, H, D]``, k/v ``[B, Lk, H, D]``, ``kv_mask`` ``[B, Lk]`` (True = attend).
Rows whose keys are all masked return zeros (``dot_product`` returns the mean of v there).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh

from jaxcore.dtypes import is_half_precision
from jaxcore.kernels import native
from jaxcore.kernels.blockwise import balanced_block, blockwise_attention
from jaxcore.kernels.sharded import (
    CONTEXT_AXIS,
    axis_size,
    check_attention_inputs,
    pad_axis,
    pad_keys,
    platform_of,
    resolve_scale,
    round_up,
    run_sharded,
)

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
# CPU: tiles of up to 1024 x 1024, one head's at a time for long sequences (see below).
# Against all heads' 512 x 512 tiles at once, Wan S self-attention (L=1024, 8 x 64) fwd+bwd
# 134 -> 83 ms and at L=4096 1485 -> 1222 ms (microbenchmarks on a 2-core VM, one process).
CPU_BLOCK_SIZES = BlockSizes(block_q=1024, block_kv=1024)
# CPU: one (batch row, head) pair's tiles at a time when such a tile is large enough for the loop
# to pay (CPU_PAIR_MIN_TILE_BYTES) and all heads' tiles together no longer stay in cache
# (over CPU_ALL_HEADS_MAX_TILE_BYTES); all heads at once otherwise. Forward + backward, float32,
# alternated in one process on the 2-core AMX VM (2026-12-04), all heads against pairs:
#   demo DiT, 32 x 64 tokens x 4 heads (pair tile 16 KiB, all 2 MiB): 5.0 vs 6.6 ms
#   16 x 256 tokens x 8 heads (256 KiB, 32 MiB): 105 vs 121 ms;  1 x 512 (1 MiB, 8 MiB): 15 vs 18
#   Wan S cross-attention, 1024 x 512 keys x 8 heads (2 MiB, 16 MiB): 40 vs 31 ms
#   Flux S, 1536 tokens in blocks of 768 (2.25 MiB, 18 MiB): 162 vs 134 ms
#   Wan S self-attention, 1024 tokens (4 MiB, 32 MiB): 91 vs 55 ms
#   4 x 512 tokens x 8 heads (1 MiB, 32 MiB): 103 vs 79 ms
# (the Wan S train step 2.01 -> 1.90 s once its cross-attention loops too). The loop over heads
# cost the demo DiT's train step 17% (186 -> 154 ms) when it ran for every sequence.
CPU_PAIR_MIN_TILE_BYTES = 2**20
CPU_ALL_HEADS_MAX_TILE_BYTES = 12 * 2**20


def cpu_head_by_head(q, k, block_sizes: BlockSizes) -> bool:
    """Whether the CPU kernel loops over (batch row, head) pairs for q ``[B, Lq, H, D]`` against
    k ``[B, Lk, H, D]``: for bf16/fp16 inputs always (XLA CPU computes a batched low-precision
    matrix product in float32; one pair's is a plain product it runs on AMX / AVX512-BF16), and
    wherever a native fused kernel takes the inputs (:mod:`jaxcore.kernels.native`: all pairs in
    one call); else when one pair's float32 score tile (the balanced blocks blockwise.py will
    use) is at least :data:`CPU_PAIR_MIN_TILE_BYTES` and all pairs' together over
    :data:`CPU_ALL_HEADS_MAX_TILE_BYTES`."""
    if is_half_precision(q.dtype) or native.kernel_for(q.dtype, q.shape[-1]) is not None:
        return True
    batch, lq, heads, _ = q.shape
    tile_q = balanced_block(lq, block_sizes.block_q)
    tile_kv = balanced_block(k.shape[1], block_sizes.block_kv)
    pair_tile = tile_q * tile_kv * 4
    return pair_tile >= CPU_PAIR_MIN_TILE_BYTES and batch * heads * pair_tile > (
        CPU_ALL_HEADS_MAX_TILE_BYTES
    )


def default_block_sizes(platform: str) -> BlockSizes:
    """The tiles a platform's flash kernel uses when the caller names none."""
    return CPU_BLOCK_SIZES if platform == "cpu" else DEFAULT_BLOCK_SIZES


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


def chunked_attention(
    q, k, v, kv_mask=None, *, scale: float, block_sizes: BlockSizes, head_by_head: bool = False
):
    """Blockwise exact attention on one device; never builds the ``[Lq, Lk]`` scores.

    FlashAttention-2's forward and its written-out backward in XLA
    (:mod:`jaxcore.kernels.blockwise`): ``block_q`` x ``block_kv`` tiles, sequences padded to
    block multiples, padded keys masked; ``head_by_head`` loops over heads (CPU).
    """
    return blockwise_attention(
        q,
        k,
        v,
        kv_mask,
        scale=scale,
        block_q=block_sizes.block_q,
        block_kv=block_sizes.block_kv,
        head_by_head=head_by_head,
    )


# --- platform kernels -----------------------------------------------------------------------


def _cudnn_attention(q, k, v, kv_mask, *, scale: float):
    """cuDNN fused attention; raises NotImplementedError/ValueError for unsupported inputs."""
    mask = None if kv_mask is None else kv_mask[:, None, None, :]
    return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, implementation="cudnn")


def _cudnn_accepts(q) -> bool:
    """cuDNN flash attention takes bf16/fp16 with a head dim <= 256 that is a multiple of 8."""
    return is_half_precision(q.dtype) and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256


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

    # bf16 products accumulate in float32 exactly at the default precision, and Mosaic refuses
    # the fp32 contract precision a "highest" jax_default_matmul_precision would ask for on
    # bf16 operands ("Bad lhs type"); float32 inputs keep the caller's precision
    precision = "default" if q.dtype == jnp.bfloat16 else jax.config.jax_default_matmul_precision
    with jax.default_matmul_precision(precision):
        out = jax.vmap(kernel)(heads_first(q_padded), heads_first(k), heads_first(v), segment_ids)
    return heads_first(out)[:, :lq].astype(q.dtype)


def local_flash_attention(
    q, k, v, kv_mask=None, *, scale: float, block_sizes: BlockSizes | None, platform: str
):
    """Flash attention on one device's arrays, picking the kernel for ``platform`` (and its
    :func:`default_block_sizes` when ``block_sizes`` is None)."""
    block_sizes = block_sizes or default_block_sizes(platform)
    if platform == "tpu":
        return splash_attention(q, k, v, kv_mask, scale=scale, block_sizes=block_sizes)
    if platform in ("gpu", "cuda", "rocm") and _cudnn_accepts(q):
        try:
            return _cudnn_attention(q, k, v, kv_mask, scale=scale)
        except (NotImplementedError, ValueError):
            # cuDNN refuses some shapes at trace time (e.g. odd lengths with a mask in
            # training); the chunked path is exact for all of them.
            pass
    head_by_head = platform == "cpu" and cpu_head_by_head(q, k, block_sizes)
    return chunked_attention(
        q, k, v, kv_mask, scale=scale, block_sizes=block_sizes, head_by_head=head_by_head
    )


# --- the backend ----------------------------------------------------------------------------


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
    local = functools.partial(
        local_flash_attention,
        scale=resolve_scale(q, scale),
        block_sizes=block_sizes,
        platform=platform_of(mesh),
    )
    if mesh is None or mesh.size == 1:
        return local(q, k, v, kv_mask)
    return run_sharded(
        local,
        q,
        k,
        v,
        kv_mask,
        mesh=mesh,
        q_multiple=axis_size(mesh, CONTEXT_AXIS),
        kv_multiple=1,
        kv_over_context=False,
        mask_over_context=False,
    )
