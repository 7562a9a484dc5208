"""Blockwise exact attention with its backward written out (FlashAttention-2 on XLA).

Forward (Dao, 2023, "FlashAttention-2", Algorithm 1): per block of ``block_q`` queries, keys
are visited ``block_kv`` at a time with the online softmax of Milakov & Gimelshein (2018): a
running maximum, denominator and unnormalised output in float32. It keeps the output and the
per-query log-sum-exp ``lse`` and nothing of size ``[Lq, Lk]``.

Backward (Algorithm 2): for each key block and each query block the probabilities are
recomputed from ``lse`` (``p = exp(s - lse)``), then ``dv += p^T do``, ``dp = do v^T``,
``ds = p (dp - delta)`` with ``delta = rowsum(do * o)``, ``dq += ds k``, ``dk += ds^T q``.

Why not autodiff of the forward loops: XLA differentiated the online softmax through its
scans with a transposed copy of every probability tile and the rescaling chain kept per block.
Written out, the backward is five matrix products per tile and two elementwise passes: Wan
bench size S self-attention (L = 1024, 8 x 64) fwd+bwd 135 -> 100 ms, the S train step
3.37 -> 3.05 s (2-core CPU, alternately in one process).

Layout: heads-major ``[B, H, L, D]`` inside (one transpose per call, not per tile), or one
head at a time (``head_by_head``, what CPUs use for long sequences and for bf16, where the
backward computes dq transposed from a transposed copy of k so that XLA CPU runs that product
in bf16: :mod:`jaxcore.kernels.products`; the loop over pairs carries 16-bit arrays as their
bits, see "the head-pair loop" below; in bf16 on a CPU with AMX, and in float32 on one with
AVX-512, the pairs' forward and backward are each one call of a native fused kernel instead,
:mod:`jaxcore.kernels.native`); the public
:func:`blockwise_attention` takes and returns ``[B, L, H, D]``. Sequences are padded to block
multiples (blocks balanced by :func:`balanced_block`); padded keys are masked; a row whose keys
are all masked returns zeros and gets zero gradients.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxcore.dtypes import is_half_precision
from jaxcore.kernels import native
from jaxcore.kernels.products import transposed_copy, transposed_shape
from jaxcore.kernels.sharded import pad_axis, pad_keys, round_up


class _Blocks(NamedTuple):
    """Static tiling of one call: block sizes and counts along queries and keys, and the
    softmax scale still to apply to the float32 scores (1.0 where q carries it)."""

    block_q: int
    block_kv: int
    num_q: int
    num_kv: int
    score_scale: float = 1.0
    # the head-pair loop's tiles: the backward's keys-major (_tile_grads), and in bf16 dq
    # computed transposed (_dq_transposed)
    head_by_head: bool = False


def _slice(x, index: jax.Array, size: int, axis: int = 2):
    """Block ``index`` (``size`` long) of ``x`` along ``axis``."""
    return lax.dynamic_slice_in_dim(x, index * size, size, axis)


def _tile_product(q_side, k_side, keys_major: bool = False):
    """The float32 tile of a query-side and a key-side array (``[B, H, bq, D]``, ``[B, H, bk,
    D]``) contracted over D: ``[B, H, bq, bk]``, or ``[B, H, bk, bq]`` when ``keys_major``."""
    if keys_major:
        return jnp.einsum("bhkd,bhqd->bhkq", k_side, q_side, preferred_element_type=jnp.float32)
    return jnp.einsum("bhqd,bhkd->bhqk", q_side, k_side, preferred_element_type=jnp.float32)


def _masked_scores(q_i, k_j, mask_j, scale: float, keys_major: bool = False):
    """``scale * q k^T`` in float32 (a :func:`_tile_product`), -inf where the key is masked
    (``scale`` 1.0: q is pre-scaled; the multiply fuses into the passes that read the scores)."""
    scores = _tile_product(q_i, k_j, keys_major)
    if scale != 1.0:
        scores = scores * scale
    if mask_j is None:
        return scores
    key_mask = mask_j[:, None, :, None] if keys_major else mask_j[:, None, None, :]
    return jnp.where(key_mask, scores, -jnp.inf)


# --- forward ---------------------------------------------------------------------------------


def _fold_keys(state, q_i, k_j, v_j, mask_j, scale: float):
    """One online-softmax step: fold keys ``k_j``/``v_j`` into ``(m, l, acc)`` (float32)."""
    m, l, acc = state  # noqa: E741 - the softmax denominator's usual name
    scores = _masked_scores(q_i, k_j, mask_j, scale)
    m_new = jnp.maximum(m, scores.max(axis=-1))
    # rows that have seen only masked keys keep m = -inf: shift by 0 there (no inf - inf)
    m_shift = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    probs = jnp.exp(scores - m_shift[..., None])
    correction = jnp.exp(m - m_shift)
    pv = jnp.einsum(
        "bhqk,bhkd->bhqd", probs.astype(v_j.dtype), v_j, preferred_element_type=jnp.float32
    )
    return m_new, l * correction + probs.sum(axis=-1), acc * correction[..., None] + pv


def _forward_query_block(q_i, k, v, mask, blocks: _Blocks):
    """Output ``[B, H, bq, D]`` (float32) and ``lse`` ``[B, H, bq]`` of one query block."""
    b, h, bq, d = q_i.shape
    state = (
        jnp.full((b, h, bq), -jnp.inf, jnp.float32),
        jnp.zeros((b, h, bq), jnp.float32),
        jnp.zeros((b, h, bq, d), jnp.float32),
    )
    if blocks.num_kv == 1:
        m, l, acc = _fold_keys(state, q_i, k, v, mask, blocks.score_scale)  # noqa: E741
    else:

        def step(j, state):
            k_j, v_j = _slice(k, j, blocks.block_kv), _slice(v, j, blocks.block_kv)
            mask_j = None if mask is None else _slice(mask, j, blocks.block_kv, axis=1)
            return _fold_keys(state, q_i, k_j, v_j, mask_j, blocks.score_scale)

        m, l, acc = lax.fori_loop(0, blocks.num_kv, step, state)  # noqa: E741
    seen = l > 0
    out = acc / jnp.where(seen, l, 1.0)[..., None]
    # lse = +inf for rows with no key: their recomputed probabilities are exp(-inf) = 0
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), jnp.inf)
    return out, lse


def _forward(q, k, v, mask, blocks: _Blocks):
    """(out ``[B, H, Lq, D]`` in q's dtype, lse ``[B, H, Lq]`` float32), heads-major."""
    if blocks.num_q == 1:
        out, lse = _forward_query_block(q, k, v, mask, blocks)
        return out.astype(q.dtype), lse

    def step(i, carry):
        out, lse = carry
        out_i, lse_i = _forward_query_block(_slice(q, i, blocks.block_q), k, v, mask, blocks)
        start = i * blocks.block_q
        out = lax.dynamic_update_slice_in_dim(out, out_i.astype(out.dtype), start, 2)
        return out, lax.dynamic_update_slice_in_dim(lse, lse_i, start, 2)

    init = (jnp.zeros(q.shape, q.dtype), jnp.zeros(q.shape[:3], jnp.float32))
    return lax.fori_loop(0, blocks.num_q, step, init)


# --- backward --------------------------------------------------------------------------------


def _tile_grads(
    q_i, k_j, v_j, mask_j, do_i, lse_i, delta_i, scale: float, keys_major: bool, k_t_j=None
):
    """(dq_i, dk_j, dv_j) of one query block against one key block, all float32.

    ``k_t_j`` (keys-major only): ``k_j`` also as a transposed copy ``[B, H, D, bk]``; dq is then
    the row-major product dq^T = k^T ds and comes back as such, ``[B, H, D, bq]``. In bf16 XLA
    CPU runs ``ds^T k`` (its left operand contracted over its first axis) in Eigen after
    upcasting both operands to float32; the Wan S mixed-precision train step 1032 -> 906 ms.

    ``keys_major``: the tile transposed, ``[keys, queries]``. dv = p^T do and dk = ds^T q are
    then products of row-major operands as stored (NN), and only dq = ds k contracts both
    operands' leading axis (TN), where the query-major tile has two such (dv, dk). On XLA CPU a
    TN product runs at half the rate (Eigen, not XNNPACK: ~95 against ~185 GFLOP/s at 1024 x
    1024 x 64, ``bench.matmul``'s model-shapes rows): the Wan S train step 1.92 -> 1.89 s and
    1.91 -> 1.85 s (two runs, alternated), with the head-pair loop (plain products). All heads
    at once (batched products), the demo DiT's step read 156 -> 161 ms, so that path keeps the
    query-major tile."""
    tile = "bhkq" if keys_major else "bhqk"

    def per_query(x):  # [B, H, bq] along the tile's query axis
        return x[..., None, :] if keys_major else x[..., None]

    probs = jnp.exp(_masked_scores(q_i, k_j, mask_j, scale, keys_major) - per_query(lse_i))
    dv = jnp.einsum(
        f"{tile},bhqd->bhkd", probs.astype(do_i.dtype), do_i, preferred_element_type=jnp.float32
    )
    dprobs = _tile_product(do_i, v_j, keys_major)
    # the gradient of the scaled scores, times the scale: that of the unscaled products
    dscores = probs * (dprobs - per_query(delta_i))
    dscores = (dscores * scale if scale != 1.0 else dscores).astype(q_i.dtype)
    if k_t_j is not None:
        dq = jnp.einsum("bhdk,bhkq->bhdq", k_t_j, dscores, preferred_element_type=jnp.float32)
    else:
        dq = jnp.einsum(f"{tile},bhkd->bhqd", dscores, k_j, preferred_element_type=jnp.float32)
    dk = jnp.einsum(f"{tile},bhqd->bhkd", dscores, q_i, preferred_element_type=jnp.float32)
    return dq, dk, dv


def _key_block_grads(q, k_j, v_j, mask_j, do, lse, delta, blocks: _Blocks, k_t_j=None):
    """(dq [B, H, Lq, D], dk_j, dv_j) of every query against one key block; with ``k_t_j``
    (:func:`_tile_grads`) dq comes back transposed, ``[B, H, D, Lq]``."""
    tile_grads = functools.partial(
        _tile_grads, scale=blocks.score_scale, keys_major=blocks.head_by_head, k_t_j=k_t_j
    )
    if blocks.num_q == 1:
        return tile_grads(q, k_j, v_j, mask_j, do, lse, delta)
    query_axis = 2 if k_t_j is None else 3

    def step(i, carry):
        dq, dk_j, dv_j = carry
        rows = functools.partial(_slice, index=i, size=blocks.block_q)
        dq_i, dk_ij, dv_ij = tile_grads(rows(q), k_j, v_j, mask_j, rows(do), rows(lse), rows(delta))
        dq = lax.dynamic_update_slice_in_dim(dq, dq_i, i * blocks.block_q, query_axis)
        return dq, dk_j + dk_ij, dv_j + dv_ij

    init = (
        jnp.zeros(q.shape if k_t_j is None else transposed_shape(q.shape), jnp.float32),
        jnp.zeros(k_j.shape, jnp.float32),
        jnp.zeros(v_j.shape, jnp.float32),
    )
    return lax.fori_loop(0, blocks.num_q, step, init)


def _dq_transposed(blocks: _Blocks, q) -> bool:
    """Whether the backward computes dq transposed (:func:`_tile_grads`' ``k_t_j``): in the
    head-pair loop, for bf16 inputs. In float32 XLA CPU runs ``ds^T k`` in Eigen without
    upcasting, and the copies did not pay (the Wan S step 1657 vs 1650 ms); fp16 products are
    upcast whatever their form (YNNPACK has no fp16 kernel)."""
    return blocks.head_by_head and q.dtype == jnp.bfloat16


def _backward(q, k, v, mask, out, lse, d_out, blocks: _Blocks):
    """(dq, dk, dv) in float32, heads-major."""
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    k_t = transposed_copy(k) if _dq_transposed(blocks, q) else None

    def key_block(k_j, v_j, mask_j, k_t_j):
        return _key_block_grads(q, k_j, v_j, mask_j, d_out, lse, delta, blocks, k_t_j)

    if blocks.num_kv == 1:
        dq, dk, dv = key_block(k, v, mask, k_t)
    else:

        def step(j, carry):
            dq, dk, dv = carry
            k_j, v_j = _slice(k, j, blocks.block_kv), _slice(v, j, blocks.block_kv)
            mask_j = None if mask is None else _slice(mask, j, blocks.block_kv, axis=1)
            k_t_j = None if k_t is None else _slice(k_t, j, blocks.block_kv, axis=3)
            dq_j, dk_j, dv_j = key_block(k_j, v_j, mask_j, k_t_j)
            start = j * blocks.block_kv
            dk = lax.dynamic_update_slice_in_dim(dk, dk_j, start, 2)
            return dq + dq_j, dk, lax.dynamic_update_slice_in_dim(dv, dv_j, start, 2)

        dq_shape = q.shape if k_t is None else transposed_shape(q.shape)
        init = (
            jnp.zeros(dq_shape, jnp.float32),
            *(jnp.zeros(x.shape, jnp.float32) for x in (k, v)),
        )
        dq, dk, dv = lax.fori_loop(0, blocks.num_kv, step, init)
    if k_t is not None:
        # back to [B, H, Lq, D] through a copy too: a plain transpose of the last product's
        # result would fold into it (products.py: in bf16 a run-time failure)
        dq = transposed_copy(dq)
    return dq, dk, dv


# --- the differentiable kernel -----------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention(q, k, v, mask, blocks: _Blocks):
    return _forward(q, k, v, mask, blocks)[0]


def _attention_forward(q, k, v, mask, blocks: _Blocks):
    out, lse = _forward(q, k, v, mask, blocks)
    return out, (q, k, v, mask, out, lse)


def _attention_backward(blocks: _Blocks, residuals, d_out):
    q, k, v, mask, out, lse = residuals
    dq, dk, dv = _backward(q, k, v, mask, out, lse, d_out, blocks)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_attention.defvjp(_attention_forward, _attention_backward)


def balanced_block(length: int, max_block: int, multiple: int = 8) -> int:
    """The block for a sequence of ``length``: as many blocks as ``max_block`` needs, each as
    long as that count needs (rounded up to ``multiple``), so padding stays under ``multiple``
    per block: Flux's 4096 + 512 tokens take 5 blocks of 928 instead of 5 of 1024 (11% more
    rows and keys each, 23% more attention work); a sequence shorter than ``max_block`` is one
    block of its own length."""
    if length <= max_block:
        return length
    blocks = -(-length // max_block)
    return min(max_block, round_up(-(-length // blocks), multiple))


def blockwise_attention(
    q,
    k,
    v,
    kv_mask=None,
    *,
    scale: float,
    block_q: int,
    block_kv: int,
    head_by_head: bool = False,
    scale_scores: bool | None = None,
):
    """Exact attention of q ``[B, Lq, H, D]`` over k/v ``[B, Lk, H, D]`` (``kv_mask`` ``[B, Lk]``,
    True = attend) in tiles of ``block_q`` x ``block_kv``; see the module docstring.

    ``scale_scores`` (default: for bf16/fp16 inputs whose scale is not a power of two): the
    softmax scale multiplies the float32 scores, as torch's kernels do, instead of q once before
    the products. In bf16, ``q * scale`` is one more rounding of q unless the scale is a power of
    two (head dim 64); at head dim 128 (Wan 1.3B/14B, Flux) it made the output's error 2.3x
    torch's. Elsewhere the fold into q is exact or as exact, and saves the multiply on every
    tile (4% of the Wan S forward in bf16).

    ``head_by_head``: one head of one batch row at a time (a loop over the B x H pairs) instead
    of all heads' tiles at once; on CPU a tile then stays in the core's cache between its
    matrix product, softmax and second product, and the tiles' products are plain matrix
    products (XLA CPU runs a batched bf16 product in float32, an unbatched one on AMX). Where a
    native kernel takes the inputs (:func:`jaxcore.kernels.native.kernel_for`) the pairs are
    its instead, on the ``[B, L, H, D]`` arrays as they are (no padding, no transposes), with
    the scale on the scores unless ``scale_scores`` is False."""
    kernel = _native_kernel(q, k, v, head_by_head)
    if kernel is not None and scale > 0:
        if scale_scores is False:  # as asked: q rounded once with the scale folded in
            q, scale = q * jnp.asarray(scale, q.dtype), 1.0
        mask = jnp.ones((q.shape[0], k.shape[1]), bool) if kv_mask is None else kv_mask
        return _native_attention(q, k, v, mask, kernel, float(scale))
    lq, lk = q.shape[1], k.shape[1]
    block_q, block_kv = balanced_block(lq, block_q), balanced_block(lk, block_kv)
    k, v, kv_mask = pad_keys(k, v, kv_mask, block_kv)
    q = pad_axis(q, block_q)
    if scale_scores is None:
        power_of_two = math.frexp(scale)[0] == 0.5
        scale_scores = is_half_precision(q.dtype) and not power_of_two
    score_scale = float(scale) if scale_scores else 1.0
    blocks = _Blocks(
        block_q,
        block_kv,
        q.shape[1] // block_q,
        k.shape[1] // block_kv,
        score_scale,
        head_by_head=head_by_head,
    )
    if not scale_scores:
        q = q * jnp.asarray(scale, q.dtype)  # once: no multiply on the [Lq, Lk] tiles
    if not head_by_head:

        def heads_major(x):
            return x.transpose(0, 2, 1, 3)

        out = _attention(heads_major(q), heads_major(k), heads_major(v), kv_mask, blocks)
        return heads_major(out)[:, :lq]

    batch, heads = q.shape[0], q.shape[2]

    def pairs_first(x):  # [B, L, H, D] -> [H * B, 1, 1, L, D]
        return x.transpose(2, 0, 1, 3).reshape(heads * batch, 1, 1, x.shape[1], x.shape[3])

    masks = None if kv_mask is None else jnp.tile(kv_mask[:, None], (heads, 1, 1))
    out = _pairwise(pairs_first(q), pairs_first(k), pairs_first(v), masks, blocks)
    out = out.reshape(heads, batch, *out.shape[-2:])  # [H, B, Lq, D]
    return out.transpose(1, 2, 0, 3)[:, :lq]


# --- the native kernels ----------------------------------------------------------------------
#
# bf16 on AMX, float32 with AVX-512 (jaxcore/kernels/native.py): every pair's forward in one
# call, its backward in another, reading and writing [B, L, H, D] in place. Wan S in float32:
# self-attention forward 13.7 -> 9.5 ms, backward ~36 -> 23 ms; in bf16 the forward 220 ->
# 149 ms, the mixed-precision train step 728 -> 504 ms.


def _native_kernel(q, k, v, head_by_head: bool):
    """The native kernel for these inputs where the pairs loop (``head_by_head``), else None."""
    if not head_by_head or not q.dtype == k.dtype == v.dtype:
        return None
    return native.kernel_for(q.dtype, q.shape[-1])


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _native_attention(q, k, v, kv_mask, kernel, scale: float):
    return native.attention(kernel, q, k, v, kv_mask, scale)[0]


def _native_forward(q, k, v, kv_mask, kernel, scale: float):
    out, lse = native.attention(kernel, q, k, v, kv_mask, scale)
    return out, (q, k, v, kv_mask, out, lse)


def _native_backward(kernel, scale: float, residuals, d_out):
    q, k, v, kv_mask, out, lse = residuals
    grads = native.attention_backward(kernel, q, k, v, kv_mask, out, lse, d_out, scale)
    return (*grads, None)


_native_attention.defvjp(_native_forward, _native_backward)


# --- the head-pair loop ----------------------------------------------------------------------
#
# One (head, batch row) pair per iteration of a loop over arrays stacked pairs-first, [P, 1, 1,
# L, D]. Its own custom VJP, so that the loops carry 16-bit arrays as their bits: XLA CPU slices
# a bf16 array in float32 (it converts the whole stacked array before the loop, fused with the
# transpose that stacks it, then slices and converts back per pair), so every bf16 operand
# crossed memory twice, at twice the width, and was copied once more for its layout; as uint16
# the arrays stay 2 bytes wide and a pair's slice is its bits (the Wan S forward in bf16 266 ->
# 256 ms, alternated; the train steps unchanged). The values are the same bit for bit.


def _as_loop_operand(x):
    """``x`` as the pair loop carries it: a 16-bit float as its bits (see above)."""
    if is_half_precision(x.dtype):
        return lax.bitcast_convert_type(x, jnp.uint16)
    return x


def _from_loop_operands(carried, like) -> tuple:
    """Each carried array back as the dtype of its counterpart in ``like``."""
    return tuple(
        lax.bitcast_convert_type(x, y.dtype) if x.dtype != y.dtype else x
        for x, y in zip(carried, like, strict=True)
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _pairwise(q, k, v, masks, blocks: _Blocks):
    return _pairwise_forward(q, k, v, masks, blocks)[0]


def _pairwise_forward(q, k, v, masks, blocks: _Blocks):
    def one_pair(operands):
        *qkv_p, mask_p = operands
        out_p, lse_p = _forward(*_from_loop_operands(qkv_p, (q, k, v)), mask_p, blocks)
        return _as_loop_operand(out_p), lse_p

    out, lse = lax.map(one_pair, (*map(_as_loop_operand, (q, k, v)), masks))
    (out,) = _from_loop_operands((out,), (q,))
    return out, (q, k, v, masks, out, lse)


def _pairwise_backward(blocks: _Blocks, residuals, d_out):
    q, k, v, masks, out, lse = residuals

    def one_pair(operands):
        q_p, k_p, v_p, mask_p, out_p, lse_p, do_p = operands
        q_p, k_p, v_p, out_p, do_p = _from_loop_operands(
            (q_p, k_p, v_p, out_p, do_p), (q, k, v, out, d_out)
        )
        dq, dk, dv = _backward(q_p, k_p, v_p, mask_p, out_p, lse_p, do_p, blocks)
        grads = dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)
        return tuple(map(_as_loop_operand, grads))

    operands = (*map(_as_loop_operand, (q, k, v)), masks, _as_loop_operand(out), lse)
    grads = lax.map(one_pair, (*operands, _as_loop_operand(d_out)))
    return (*_from_loop_operands(grads, (q, k, v)), None)


_pairwise.defvjp(_pairwise_forward, _pairwise_backward)
