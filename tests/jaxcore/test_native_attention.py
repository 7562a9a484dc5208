"""The native attention kernels (jaxcore/kernels/native/) against XLA's path: bf16 on AMX
(amx_attention.cc), float32 with AVX-512 (avx512_attention.cc).

Reference: the same head-pair loop with the kernels switched off (XLA's forward, the code every
other attention test checks against dot_product), on the same inputs. Tolerances, stated per
dtype (``TOLERANCES``):
- bf16 outputs: 1.6e-2 for values of magnitude <= ~4 (a bf16 ulp at 2-4 is 1.6e-2: the two
  round the same float32 sums, accumulated in a different order, to bf16), and a mean
  difference under 1e-3; reached: max 7.8e-3, mean ~1e-4. float32 outputs: 1e-5 and a mean
  under 1e-6 (reached ~1e-6 and ~1e-7: exp as 2^x and another summation order);
- log-sum-exp: 1e-5 (reached ~2e-6);
- gradients (each backward fed its own forward's output and lse): bf16 2e-2 of the gradients'
  largest magnitude and a mean under 2e-3 of it (bf16 rounding of p and ds, summed in another
  order); float32 2e-5 and 2e-6 of it (reached ~1e-6).
Skipped with the reason where a kernel cannot run (no AMX-BF16 / AVX-512, no compiler); the
switch and the fallback are tested everywhere.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcore.attention import attention, dot_product_attention
from jaxcore.kernels import native
from jaxcore.kernels.blockwise import blockwise_attention
from jaxcore.sharding import MeshConfig, make_mesh


class Tolerance(NamedTuple):
    out_atol: float
    out_mean: float
    lse_atol: float
    grad_rtol: float
    grad_mean: float


TOLERANCES = {
    "bfloat16": Tolerance(1.6e-2, 1e-3, 1e-5, 2e-2, 2e-3),
    "float32": Tolerance(1e-5, 1e-6, 1e-5, 2e-5, 2e-6),
}
KERNELS = {"bfloat16": native.AMX_ATTENTION, "float32": native.AVX512_ATTENTION}


def needs_kernel(dtype: str):
    """The dtype as a test parameter, skipped with the reason where its kernel cannot run."""
    reason = native.unavailable(KERNELS[dtype])
    return pytest.param(
        dtype,
        marks=pytest.mark.skipif(
            reason is not None, reason=f"native {KERNELS[dtype].name} unavailable: {reason}"
        ),
    )


DTYPES = [needs_kernel("bfloat16"), needs_kernel("float32")]


def inputs(batch, lq, lk, heads, dim, *, masked, seed=0, dtype="bfloat16"):
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.normal(size=(batch, n, heads, dim)), dtype) for n in (lq, lk, lk))
    mask = None
    if masked:
        keep = rng.random((batch, lk)) > 0.4
        keep[:, 0] = True
        if batch > 1:
            keep[-1] = False  # a whole row with every key masked: zeros out, zero gradients
        mask = jnp.asarray(keep)
    return q, k, v, mask


def pair_loop(q, k, v, mask, *, scale, scale_scores=None, block=1024):
    return blockwise_attention(
        q,
        k,
        v,
        mask,
        scale=scale,
        block_q=block,
        block_kv=block,
        head_by_head=True,
        scale_scores=scale_scores,
    )


def with_xla_path(monkeypatch, make, *args):
    """``make()`` (a fresh jitted function: jit caches traces per function) called on
    ``args`` with the kernels switched off, i.e. XLA's forward."""
    with monkeypatch.context() as m:
        m.setattr(native, "kernel_for", lambda dtype, head_dim: None)
        fn = make()
        hlo = fn.lower(*args).as_text()
        assert not any(kernel.target in hlo for kernel in native.KERNELS)
        return fn(*args)


def diffs(a, b) -> tuple[float, float]:
    d = jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))
    return float(d.max()), float(d.mean())


CASES = [
    # batch, lq, lk, heads, dim, masked, scale_scores (None: the default rule)
    (1, 256, 256, 4, 64, False, None),
    (2, 77, 45, 3, 64, True, None),  # lengths off the 16-query / 32-key tiles, masked keys
    (1, 100, 513, 2, 128, True, True),  # head dim 128, the scale on the scores
    (2, 33, 17, 2, 32, True, False),  # head dim 32, the scale folded into q
    (1, 5, 7, 1, 96, False, None),  # fewer queries than a tile's rows, keys than its depth
]
CASE_IDS = ["x".join(map(str, c[:5])) + f"-m{c[5]}" for c in CASES]


def ran_the_kernel(fn, args, dtype: str, backward: bool = False) -> bool:
    hlo = fn.lower(*args).as_text()
    kernel = KERNELS[dtype]
    return kernel.target in hlo and (not backward or kernel.backward_target in hlo)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_kernel_matches_the_xla_pair_loop(monkeypatch, case, dtype):
    batch, lq, lk, heads, dim, masked, scale_scores = case
    q, k, v, mask = inputs(batch, lq, lk, heads, dim, masked=masked, seed=lq + lk, dtype=dtype)
    tol = TOLERANCES[dtype]

    def make():
        return jax.jit(functools.partial(pair_loop, scale=dim**-0.5, scale_scores=scale_scores))

    expected = with_xla_path(monkeypatch, make, q, k, v, mask)
    fn = make()
    assert ran_the_kernel(fn, (q, k, v, mask), dtype)
    got = fn(q, k, v, mask)
    assert got.dtype == q.dtype and got.shape == expected.shape
    worst, mean = diffs(got, expected)
    assert worst < tol.out_atol and mean < tol.out_mean, (worst, mean)
    if masked and batch > 1:  # the fully masked row
        assert not np.asarray(got[-1]).any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_lse_and_fully_masked_rows(dtype):
    """The kernel's own outputs on ``[B, L, H, D]``: lse ``[B, H, Lq]`` = max + log(sum) of the
    scaled scores, +inf (and a zero output) for a batch row whose keys are all masked, as
    blockwise._forward defines them."""
    rng = np.random.default_rng(3)
    q, k, v = (jnp.asarray(rng.normal(size=(3, n, 2, 64)), dtype) for n in (40, 70, 70))
    mask = jnp.asarray(rng.random((3, 70)) > 0.3).at[1].set(False)
    kernel = KERNELS[dtype]
    call = jax.jit(functools.partial(native.attention, kernel), static_argnums=4)
    out, lse = call(q, k, v, mask, 0.125)
    assert out.shape == q.shape and lse.shape == (3, 2, 40)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * 0.125
    scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
    expected_lse = jax.nn.logsumexp(scores, axis=-1)
    tol = TOLERANCES[dtype]
    for row in (0, 2):
        assert float(jnp.max(jnp.abs(lse[row] - expected_lse[row]))) < tol.lse_atol
    assert bool(jnp.all(jnp.isposinf(lse[1]))) and not np.asarray(out[1]).any()
    probs = jax.nn.softmax(scores[0], axis=-1)  # [H, Lq, Lk]
    exact = jnp.einsum("hqk,khd->qhd", probs, v[0].astype(jnp.float32))
    assert diffs(out[0], exact)[0] < tol.out_atol


def host_softmax(q, k, keep, scale):
    """(probabilities [B, H, Lq, Lk], lse [B, H, Lq]) in float64 on the host: masked keys 0,
    a row with every key masked all zeros and lse +inf."""
    scores = np.einsum("bqhd,bkhd->bhqk", np.asarray(q, np.float64), np.asarray(k, np.float64))
    scores = np.where(keep[:, None, None], scores * scale, -np.inf)
    top = np.max(scores, axis=-1, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)
    weights = np.where(keep[:, None, None], np.exp(scores - top), 0.0)
    totals = weights.sum(-1, keepdims=True)
    probs = np.divide(weights, totals, out=np.zeros_like(weights), where=totals > 0)
    with np.errstate(divide="ignore"):
        lse = (top + np.log(totals))[..., 0]
    return probs, np.where(totals[..., 0] > 0, lse, np.inf)


@pytest.mark.parametrize("dtype", [needs_kernel("float32")])
def test_float32_forward_streams_keys_in_blocks(dtype):
    """The float32 forward takes the keys 512 at a time past 256 queries at a time (online
    softmax): 300 queries (a partial second group), 1,100 keys (three blocks, the last partial),
    scores large enough that each row's max moves between blocks, a batch row whose first block
    is all masked (its running max starts at -inf) and one whose live keys are all in the last
    block. Output and lse against float64 softmax on the host."""
    rng = np.random.default_rng(11)
    q, k, v = (rng.normal(size=(3, n, 2, 64)) for n in (300, 1100, 1100))
    q *= 3.0  # scores of magnitude ~10: the running max moves, and the sums are rescaled
    keep = rng.random((3, 1100)) > 0.3
    keep[1, :512] = False
    keep[2, :1024] = False
    kernel = KERNELS[dtype]
    call = jax.jit(functools.partial(native.attention, kernel), static_argnums=4)
    args = [jnp.asarray(x, jnp.float32) for x in (q, k, v)]
    out, lse = call(*args, jnp.asarray(keep), 0.125)
    probs, expected_lse = host_softmax(args[0], args[1], keep, 0.125)
    exact = np.einsum("bhqk,bkhd->bqhd", probs, v)
    tol = TOLERANCES[dtype]
    assert np.abs(np.asarray(lse) - expected_lse).max() < tol.lse_atol
    worst = np.abs(np.asarray(out) - exact).max()
    assert worst < tol.out_atol, worst


@pytest.mark.parametrize("dtype", [needs_kernel("float32")])
def test_float32_backward_takes_keys_in_blocks(dtype):
    """The float32 backward goes key block by key block (512 keys), 64 queries at a time: 300
    queries (a partial last group), 1,100 keys (three blocks, the last partial), dq summed over
    the blocks, a batch row whose first block is all masked and one whose live keys are all in
    the last block, one row with every key masked (zero gradients). Fed its own forward's out
    and lse; dq, dk, dv against float64 gradients on the host, relative to their scale."""
    rng = np.random.default_rng(12)
    q, k, v = (rng.normal(size=(4, n, 2, 64)) for n in (300, 1100, 1100))
    q *= 3.0  # peaked probabilities: gradients differ a lot between keys
    d_out = rng.normal(size=q.shape)
    keep = rng.random((4, 1100)) > 0.3
    keep[1, :512] = False
    keep[2, :1024] = False
    keep[3] = False
    kernel, scale = KERNELS[dtype], 0.125
    args = [jnp.asarray(x, jnp.float32) for x in (q, k, v)]
    mask = jnp.asarray(keep)
    forward = jax.jit(functools.partial(native.attention, kernel), static_argnums=4)
    backward = jax.jit(functools.partial(native.attention_backward, kernel), static_argnums=7)
    out, lse = forward(*args, mask, scale)
    grads = backward(*args, mask, out, lse, jnp.asarray(d_out, jnp.float32), scale)

    probs, _ = host_softmax(q, k, keep, scale)
    d_probs = np.einsum("bqhd,bkhd->bhqk", d_out, v)
    d_scores = probs * (d_probs - (probs * d_probs).sum(-1, keepdims=True))
    expected = (
        np.einsum("bhqk,bkhd->bqhd", d_scores, k) * scale,
        np.einsum("bhqk,bqhd->bkhd", d_scores, q) * scale,
        np.einsum("bhqk,bqhd->bkhd", probs, d_out),
    )
    tol = TOLERANCES[dtype]
    for name, got, want in zip(("dq", "dk", "dv"), grads, expected, strict=True):
        got = np.asarray(got, np.float64)
        bound = np.abs(want).max()
        assert np.abs(got - want).max() < tol.grad_rtol * bound, name
        assert np.abs(got - want).mean() < tol.grad_mean * bound, name
        assert not got[3].any(), name  # every key masked: no gradient


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_gradients_match_the_xla_pair_loop(monkeypatch, case, dtype):
    """The kernel's backward (fed its forward's out and lse) against XLA's forward and
    backward: relative to the gradients' scale, and on average."""
    batch, lq, lk, heads, dim, masked, scale_scores = case
    q, k, v, mask = inputs(batch, lq, lk, heads, dim, masked=masked, seed=lq * lk, dtype=dtype)
    cotangent = jnp.asarray(np.random.default_rng(6).normal(size=q.shape), dtype)
    tol = TOLERANCES[dtype]

    def loss(q, k, v):
        out = pair_loop(q, k, v, mask, scale=dim**-0.5, scale_scores=scale_scores)
        return jnp.sum(out.astype(jnp.float32) * cotangent.astype(jnp.float32))

    def make():
        return jax.jit(jax.grad(loss, (0, 1, 2)))

    expected = with_xla_path(monkeypatch, make, q, k, v)
    grad = make()
    assert ran_the_kernel(grad, (q, k, v), dtype, backward=True)
    for g, e in zip(grad(q, k, v), expected, strict=True):
        assert g.dtype == q.dtype and g.shape == e.shape
        scale = float(jnp.max(jnp.abs(e.astype(jnp.float32)))) or 1.0
        worst, mean = diffs(g, e)
        assert worst < tol.grad_rtol * scale and mean < tol.grad_mean * scale, (worst, mean)
    if masked and batch > 1:  # the fully masked row: zero gradients
        assert not np.asarray(grad(q, k, v)[0][-1]).any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_inside_shard_map_and_vmap(dtype):
    """Sharded flash attention runs the kernel per device inside shard_map; vmap of it loops."""
    mesh = make_mesh(
        MeshConfig(ici_data_parallelism=2, ici_context_parallelism=2, ici_tensor_parallelism=2)
    )
    q, k, v, mask = inputs(2, 40, 24, 4, 32, masked=True, seed=9, dtype=dtype)
    sharded = jax.jit(lambda q, k, v, m: attention(q, k, v, backend="flash", kv_mask=m, mesh=mesh))
    assert ran_the_kernel(sharded, (q, k, v, mask), dtype)
    got = sharded(q, k, v, mask)
    assert diffs(got, attention(q, k, v, backend="flash", kv_mask=mask))[0] == 0.0
    # row 0 has keys (row 1 none: dot_product's convention differs there, see test_attention)
    expected = dot_product_attention(q[:1], k[:1], v[:1], kv_mask=mask[:1])
    assert diffs(got[:1], expected)[0] < TOLERANCES[dtype].out_atol
    batched = jax.vmap(lambda q, k, v: pair_loop(q, k, v, None, scale=0.25))
    stacked = [jnp.stack([x, x * 0.5]) for x in (q, k, v)]
    got = jax.jit(batched)(*stacked)
    for i in range(2):
        single = pair_loop(*(x[i] for x in stacked), None, scale=0.25)
        assert diffs(got[i], single)[0] == 0.0


@pytest.mark.parametrize("kernel", native.KERNELS, ids=lambda k: k.name)
def test_kernel_builds_wherever_it_could_run(monkeypatch, tmp_path, kernel):
    """A CPU with the kernel's instructions and a compiler must get the kernel: a source that
    stopped compiling would otherwise only turn the kernel's tests into skips. Built from
    scratch (an empty cache), then found in the cache."""
    if kernel.cpu_flags - native.cpu_flags() or native._compiler() is None:
        pytest.skip(f"no CPU with {kernel.name}'s instructions or no C++ compiler here")
    monkeypatch.setenv("DIFFORGE_CACHE", str(tmp_path))
    built = native.build(kernel.name, kernel.flags)  # NativeBuildError names the errors
    assert built.parent == tmp_path / "native" and built.stat().st_size > 0
    assert [p.name for p in built.parent.iterdir()] == [built.name]  # no temp files left
    assert native.build(kernel.name, kernel.flags) == built


@pytest.mark.parametrize("kernel", native.KERNELS, ids=lambda k: k.name)
def test_switch_off_and_build_failures_name_the_reason(monkeypatch, tmp_path, kernel):
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    assert native._unavailable_reason(kernel) == f"{native.ENV_SWITCH}=0"
    monkeypatch.delenv(native.ENV_SWITCH)
    monkeypatch.setenv("DIFFORGE_CACHE", str(tmp_path))
    monkeypatch.setattr(native, "_compiler", lambda: None)
    with pytest.raises(native.NativeBuildError, match="no C..? compiler"):
        native.build(kernel.name, kernel.flags)
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset({"sse2"}))
    assert "lacks" in native._unavailable_reason(kernel)
    assert "avx512f" in native._unavailable_reason(kernel)


def test_unsupported_inputs_take_the_xla_path():
    """float16, and head dims off a kernel's multiple (bf16 32, float32 16), never reach a
    kernel."""
    assert native.kernel_for(jnp.float16, 64) is None
    assert native.kernel_for(jnp.bfloat16, 48) is None
    assert native.kernel_for(jnp.float32, 40) is None
    for dtype, dim in (("bfloat16", 40), ("float32", 40), ("float16", 64)):
        q, k, v, _ = inputs(1, 24, 24, 2, dim, masked=False, dtype=dtype)
        hlo = jax.jit(functools.partial(pair_loop, scale=0.2)).lower(q, k, v, None).as_text()
        assert not any(kernel.target in hlo for kernel in native.KERNELS), (dtype, dim)
