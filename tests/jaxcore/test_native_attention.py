"""The native AMX attention kernel (jaxcore/kernels/native/amx_attention.cc) against XLA's path.

Reference: the same head-pair loop with the kernel switched off (XLA's forward, the code every
other attention test checks against dot_product), on the same bf16 inputs. Tolerances, stated:
- outputs: ``OUT_ATOL = 1.6e-2`` for values of magnitude <= ~4 (a bf16 ulp at 2-4 is 1.6e-2:
  the two round the same float32 sums, accumulated in a different order, to bf16), and a mean
  difference under ``OUT_MEAN = 1e-3``; reached: max 7.8e-3, mean ~1e-4;
- log-sum-exp: ``LSE_ATOL = 1e-5`` (reached ~2e-6);
- gradients (the kernel's backward against XLA's, each fed its own forward's output and lse):
  ``GRAD_RTOL = 2e-2`` of the gradients' largest magnitude and a mean difference under
  ``GRAD_MEAN = 2e-3`` of it (bf16 rounding of p and ds, summed in another order).
Skipped with the reason where the kernel cannot run (no AMX-BF16, no compiler); the switch and
the fallback are tested everywhere.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcore.attention import attention, dot_product_attention
from jaxcore.kernels import native
from jaxcore.kernels.blockwise import blockwise_attention
from jaxcore.sharding import MeshConfig, make_mesh

OUT_ATOL = 1.6e-2
OUT_MEAN = 1e-3
LSE_ATOL = 1e-5
GRAD_RTOL = 2e-2
GRAD_MEAN = 2e-3

needs_amx = pytest.mark.skipif(
    not native.amx_attention_available(),
    reason=f"native AMX attention unavailable here: {native.amx_attention_unavailable()}",
)


def inputs(batch, lq, lk, heads, dim, *, masked, seed=0):
    rng = np.random.default_rng(seed)
    q, k, v = (
        jnp.asarray(rng.normal(size=(batch, n, heads, dim)), jnp.bfloat16) for n in (lq, lk, lk)
    )
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
    ``args`` with the kernel switched off, i.e. XLA's forward."""
    with monkeypatch.context() as m:
        m.setattr(native, "amx_attention_supports", lambda q, k: False)
        fn = make()
        assert native.AMX_ATTENTION_TARGET not in fn.lower(*args).as_text()
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


@needs_amx
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c[:5])) + f"-m{c[5]}")
def test_kernel_matches_the_xla_pair_loop(monkeypatch, case):
    batch, lq, lk, heads, dim, masked, scale_scores = case
    q, k, v, mask = inputs(batch, lq, lk, heads, dim, masked=masked, seed=lq + lk)

    def make():
        return jax.jit(functools.partial(pair_loop, scale=dim**-0.5, scale_scores=scale_scores))

    expected = with_xla_path(monkeypatch, make, q, k, v, mask)
    fn = make()
    assert native.AMX_ATTENTION_TARGET in fn.lower(q, k, v, mask).as_text()  # the kernel ran
    got = fn(q, k, v, mask)
    assert got.dtype == jnp.bfloat16 and got.shape == expected.shape
    worst, mean = diffs(got, expected)
    assert worst < OUT_ATOL and mean < OUT_MEAN, (worst, mean)
    if masked and batch > 1:  # the fully masked row
        assert not np.asarray(got[-1]).any()


@needs_amx
def test_kernel_lse_and_fully_masked_pairs():
    """The kernel's own outputs: lse = max + log(sum) of the scaled scores, +inf (and a zero
    output) for a pair whose keys are all masked, as blockwise._forward defines them."""
    rng = np.random.default_rng(3)
    q, k, v = (jnp.asarray(rng.normal(size=(3, n, 64)), jnp.bfloat16) for n in (40, 70, 70))
    mask = jnp.asarray(rng.random((3, 70)) > 0.3).at[1].set(False)
    out, lse = jax.jit(native.amx_attention, static_argnums=4)(q, k, v, mask, 0.125)
    scores = jnp.einsum("pqd,pkd->pqk", q, k, preferred_element_type=jnp.float32) * 0.125
    scores = jnp.where(mask[:, None], scores, -jnp.inf)
    expected_lse = jax.nn.logsumexp(scores, axis=-1)
    for pair in (0, 2):
        assert float(jnp.max(jnp.abs(lse[pair] - expected_lse[pair]))) < LSE_ATOL
    assert bool(jnp.all(jnp.isposinf(lse[1]))) and not np.asarray(out[1]).any()
    probs = jax.nn.softmax(scores[0], axis=-1)
    exact = jnp.einsum("qk,kd->qd", probs, v[0].astype(jnp.float32))
    assert diffs(out[0], exact)[0] < OUT_ATOL


@needs_amx
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c[:5])) + f"-m{c[5]}")
def test_gradients_match_the_xla_pair_loop(monkeypatch, case):
    """The kernel's backward (fed its forward's out and lse) against XLA's forward and
    backward: relative to the gradients' scale, and on average."""
    batch, lq, lk, heads, dim, masked, scale_scores = case
    q, k, v, mask = inputs(batch, lq, lk, heads, dim, masked=masked, seed=lq * lk)
    cotangent = jnp.asarray(np.random.default_rng(6).normal(size=q.shape), jnp.bfloat16)

    def loss(q, k, v):
        out = pair_loop(q, k, v, mask, scale=dim**-0.5, scale_scores=scale_scores)
        return jnp.sum(out.astype(jnp.float32) * cotangent.astype(jnp.float32))

    def make():
        return jax.jit(jax.grad(loss, (0, 1, 2)))

    expected = with_xla_path(monkeypatch, make, q, k, v)
    grad = make()
    hlo = grad.lower(q, k, v).as_text()
    assert native.AMX_ATTENTION_TARGET in hlo and native.AMX_ATTENTION_BACKWARD_TARGET in hlo
    for g, e in zip(grad(q, k, v), expected, strict=True):
        assert g.dtype == jnp.bfloat16 and g.shape == e.shape
        scale = float(jnp.max(jnp.abs(e.astype(jnp.float32)))) or 1.0
        worst, mean = diffs(g, e)
        assert worst < GRAD_RTOL * scale and mean < GRAD_MEAN * scale, (worst, mean, scale)
    if masked and batch > 1:  # the fully masked row: zero gradients
        assert not np.asarray(grad(q, k, v)[0][-1]).any()


@needs_amx
def test_kernel_inside_shard_map_and_vmap():
    """Sharded flash attention runs the kernel per device inside shard_map; vmap of it loops."""
    mesh = make_mesh(
        MeshConfig(ici_data_parallelism=2, ici_context_parallelism=2, ici_tensor_parallelism=2)
    )
    q, k, v, mask = inputs(2, 40, 24, 4, 32, masked=True, seed=9)
    sharded = jax.jit(lambda q, k, v, m: attention(q, k, v, backend="flash", kv_mask=m, mesh=mesh))
    assert native.AMX_ATTENTION_TARGET in sharded.lower(q, k, v, mask).as_text()
    got = sharded(q, k, v, mask)
    assert diffs(got, attention(q, k, v, backend="flash", kv_mask=mask))[0] == 0.0
    # row 0 has keys (row 1 none: dot_product's convention differs there, see test_attention)
    expected = dot_product_attention(q[:1], k[:1], v[:1], kv_mask=mask[:1])
    assert diffs(got[:1], expected)[0] < OUT_ATOL
    batched = jax.vmap(lambda q, k, v: pair_loop(q, k, v, None, scale=0.25))
    stacked = [jnp.stack([x, x * 0.5]) for x in (q, k, v)]
    got = jax.jit(batched)(*stacked)
    for i in range(2):
        single = pair_loop(*(x[i] for x in stacked), None, scale=0.25)
        assert diffs(got[i], single)[0] == 0.0


def test_kernel_builds_wherever_it_could_run(monkeypatch, tmp_path):
    """A CPU with AMX-BF16 and a compiler must get the kernel: a source that stopped compiling
    would otherwise only turn the kernel's tests into skips. Built from scratch (an empty cache),
    then found in the cache."""
    if native.AMX_CPU_FLAGS - native.cpu_flags() or native._compiler() is None:
        pytest.skip("no AMX-BF16 CPU or no C++ compiler here: nothing to build")
    monkeypatch.setenv("DIFFORGE_CACHE", str(tmp_path))
    built = native.build("amx_attention", native.AMX_FLAGS)  # NativeBuildError names the errors
    assert built.parent == tmp_path / "native" and built.stat().st_size > 0
    assert [p.name for p in built.parent.iterdir()] == [built.name]  # no temp files left
    assert native.build("amx_attention", native.AMX_FLAGS) == built


def test_switch_off_and_build_failures_name_the_reason(monkeypatch, tmp_path):
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    assert native._amx_unavailable_reason() == f"{native.ENV_SWITCH}=0"
    monkeypatch.delenv(native.ENV_SWITCH)
    monkeypatch.setenv("DIFFORGE_CACHE", str(tmp_path))
    monkeypatch.setattr(native, "_compiler", lambda: None)
    with pytest.raises(native.NativeBuildError, match="no C..? compiler"):
        native.build("amx_attention", native.AMX_FLAGS)
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset({"avx512f"}))
    assert "lacks" in native._amx_unavailable_reason()
    assert "amx_bf16" in native._amx_unavailable_reason()


def test_unsupported_inputs_take_the_xla_path():
    """float32, float16 and head dims off the tile's 32 never reach the kernel."""
    f32 = jnp.zeros((2, 16, 64), jnp.float32)
    assert not native.amx_attention_supports(f32, f32)
    assert not native.amx_attention_supports(f32.astype(jnp.float16), f32.astype(jnp.float16))
    odd = jnp.zeros((2, 16, 40), jnp.bfloat16)
    assert not native.amx_attention_supports(odd, odd)
    q, k, v, _ = inputs(1, 24, 24, 2, 40, masked=False)
    hlo = jax.jit(functools.partial(pair_loop, scale=0.2)).lower(q, k, v, None).as_text()
    assert native.AMX_ATTENTION_TARGET not in hlo
