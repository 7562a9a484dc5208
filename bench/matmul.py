"""Benchmark 0, the machine's limits: the best n x n GEMM any library here reaches.

- fp32: XLA (``jnp.matmul``), torch, numpy, and MKL through difforge's custom call where it
  runs (``mkl``: :mod:`jaxcore.kernels.cpu_gemm`, the dense layers' products on CPU) on the
  same matrices (2 n^3 FLOPs per call).
  numpy runs in its own subprocess with ``OPENBLAS_CORETYPE`` / ``OPENBLAS_L2_SIZE`` removed
  from its environment, so OpenBLAS picks its own kernel for this CPU (those variables, when a
  container sets them, can hold it to a slower one). The **limit** is the fastest of the three.
- bf16 inputs with fp32 accumulation: XLA (``preferred_element_type=float32``) and torch
  (bf16 ``mm``, accumulated in fp32 inside); the **bf16 limit** is the faster.

:mod:`bench.run` divides every FLOP-counted figure by both limits (``frac_of_limit``,
``frac_of_bf16_limit``); ``role`` says which record set each limit.

The limit is a large square GEMM; the models multiply smaller, thinner matrices. The
``model-shapes`` rows time the products of the Wan bench size S's train step (1,024 video
tokens, width 512, FFN 2,048, head dim 64) as its dense layers and attention tiles issue them
(``NN`` x @ W, ``NT`` x @ W^T: a backward's input gradient or q k^T, ``TN`` x^T @ dy: a weight
gradient), difforge's side as the product the dense layers issue (``layers._dot``: MKL where it
runs, else XLA's dot), XLA's own ``lax.dot_general`` and torch on the same matrices, alternately
call by call (the attention shapes run inside the native attention kernels in the models; their
rows time the plain products). ``vs difforge`` is then how much of a
train step's or forward's gap to PyTorch is the GEMM library's own, shape by shape. They carry
``operands`` (not ``dtype``), so they never set a limit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import (
    BenchContext,
    interleaved_times,
    set_torch_threads,
    time_calls,
    timed_record,
)
from jaxcore.kernels import cpu_gemm
from jaxcore.models import layers

BENCH = "matmul"
SIZES = {"smoke": 256, "quick": 4096, "full": 4096}
ACCELERATOR_SIZE = 8192
FP32, BF16 = "fp32", "bf16"
# OpenBLAS settings a container may pin; numpy's run drops them so the library tunes itself
OPENBLAS_PINS = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")

_NUMPY_SCRIPT = """
import json, sys, time
import numpy as np
n, reps, warmup = (int(v) for v in sys.argv[1:4])
rng = np.random.default_rng(0)
a = rng.standard_normal((n, n), dtype=np.float32)
b = rng.standard_normal((n, n), dtype=np.float32)
for _ in range(warmup):
    a @ b
times = []
for _ in range(reps):
    started = time.perf_counter()
    a @ b
    times.append(time.perf_counter() - started)
print(json.dumps(times))
"""


def matmul_size(ctx: BenchContext) -> int:
    if ctx.on_accelerator and ctx.profile != "smoke":
        return ACCELERATOR_SIZE
    return SIZES[ctx.profile]


def numpy_times(n: int, reps: int, warmup: int) -> list[float]:
    """numpy's fp32 GEMM timed in a subprocess without the OpenBLAS pins."""
    env = {k: v for k, v in os.environ.items() if k not in OPENBLAS_PINS}
    out = subprocess.run(
        [sys.executable, "-c", _NUMPY_SCRIPT, str(n), str(reps), str(max(1, warmup))],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=900,
    )
    return [float(t) for t in json.loads(out.stdout.strip().splitlines()[-1])]


def _fp32_records(ctx: BenchContext, n: int, a_np, b_np) -> list[dict]:
    flops = 2.0 * n**3
    reps = max(ctx.reps, 3)
    a, b = jnp.asarray(a_np), jnp.asarray(b_np)
    matmul = jax.jit(jnp.matmul)
    times, _ = time_calls(lambda: matmul(a, b).block_until_ready(), reps=reps, warmup=ctx.warmup)
    records = [timed_record(BENCH, str(n), "xla", times, flops=flops, dtype=FP32)]
    records += _mkl_records(ctx, str(n), a, b, flops, FP32)

    import torch

    threads = set_torch_threads()
    a_t, b_t = torch.from_numpy(a_np), torch.from_numpy(b_np)
    times, _ = time_calls(lambda: torch.mm(a_t, b_t), reps=reps, warmup=ctx.warmup)
    records.append(
        timed_record(BENCH, str(n), "torch", times, flops=flops, threads=threads, dtype=FP32)
    )
    if not ctx.on_accelerator:
        times = numpy_times(n, reps, ctx.warmup)
        records.append(
            timed_record(
                BENCH, str(n), "numpy", times, flops=flops, dtype=FP32, env="OpenBLAS unpinned"
            )
        )
    return records


def _bf16_records(ctx: BenchContext, n: int, a_np, b_np) -> list[dict]:
    flops = 2.0 * n**3
    reps = max(ctx.reps, 3)
    case = f"{n}-bf16"
    a, b = jnp.asarray(a_np, jnp.bfloat16), jnp.asarray(b_np, jnp.bfloat16)
    matmul = jax.jit(lambda x, y: jnp.matmul(x, y, preferred_element_type=jnp.float32))
    times, _ = time_calls(lambda: matmul(a, b).block_until_ready(), reps=reps, warmup=ctx.warmup)
    records = [timed_record(BENCH, case, "xla", times, flops=flops, dtype=BF16)]

    import torch

    a_t = torch.from_numpy(a_np).to(torch.bfloat16)
    b_t = torch.from_numpy(b_np).to(torch.bfloat16)
    times, _ = time_calls(lambda: torch.mm(a_t, b_t), reps=reps, warmup=ctx.warmup)
    records.append(timed_record(BENCH, case, "torch", times, flops=flops, dtype=BF16))
    return records


def _mkl_records(ctx: BenchContext, case: str, a, b, flops: float, dtype: str) -> list[dict]:
    """MKL's GEMM through difforge's custom call on ``a @ b``, where it runs here."""
    if ctx.on_accelerator or cpu_gemm.unavailable() is not None:
        return []
    product = jax.jit(lambda x, y: cpu_gemm.gemm(x, y, False, False))
    times, _ = time_calls(
        lambda: product(a, b).block_until_ready(), reps=max(ctx.reps, 3), warmup=ctx.warmup
    )
    return [timed_record(BENCH, case, "mkl", times, flops=flops, dtype=dtype)]


# (name, m, k, n, layout) of the Wan S train step's products; layout of (lhs, rhs) as stored
MODEL_SHAPES = (
    ("proj", 1024, 512, 512, "NN"),
    ("proj-dgrad", 1024, 512, 512, "NT"),
    ("proj-wgrad", 512, 1024, 512, "TN"),
    ("ffn-up", 1024, 512, 2048, "NN"),
    ("ffn-down-dgrad", 1024, 512, 2048, "NT"),
    ("attn-scores", 1024, 64, 1024, "NT"),
    ("attn-values", 1024, 1024, 64, "NN"),
    ("attn-dkv", 1024, 1024, 64, "TN"),
)
# the bf16 forward's (inputs bf16, accumulated in float32 as the model's attention does)
MODEL_SHAPES_BF16 = ("proj", "attn-scores", "attn-values")
# Each sample times this many calls of one library in a row, the two alternating sample by
# sample. Call by call, torch's OpenMP threads, still spinning after its product, took the cores
# from XLA's next one: XLA's 1024x512x512 product read 87 GFLOP/s alternated call by call, 227
# in runs of 10, 259 in runs of 50, 275 alone (2-core VM). The smoke profile runs 2.
CALLS_PER_SAMPLE = 50


def _operands(m: int, k: int, n: int, layout: str, rng) -> tuple[np.ndarray, np.ndarray]:
    lhs = (m, k) if layout[0] == "N" else (k, m)
    rhs = (k, n) if layout[1] == "N" else (n, k)
    return rng.standard_normal(lhs, dtype=np.float32), rng.standard_normal(rhs, dtype=np.float32)


def _contracting(layout: str) -> tuple[int, int]:
    return (1 if layout[0] == "N" else 0), (0 if layout[1] == "N" else 1)


def _model_shape_records(ctx: BenchContext) -> list[dict]:
    """XLA (difforge) vs torch on each of :data:`MODEL_SHAPES`, fp32 and (some) bf16."""
    rng = np.random.default_rng(1)
    cases = [(shape, FP32) for shape in MODEL_SHAPES] + [
        (shape, BF16) for shape in MODEL_SHAPES if shape[0] in MODEL_SHAPES_BF16
    ]
    records = []
    for shape, operands in cases:
        records += _model_shape_case(ctx, *shape, operands=operands, rng=rng)
    return records


def _model_shape_case(ctx, name, m, k, n, layout, *, operands: str, rng) -> list[dict]:
    import torch

    threads = set_torch_threads()
    a_np, b_np = _operands(m, k, n, layout, rng)
    lhs_c, rhs_c = _contracting(layout)
    jax_dtype, torch_dtype = (
        (jnp.float32, torch.float32) if operands == FP32 else (jnp.bfloat16, torch.bfloat16)
    )
    dimensions = (((lhs_c,), (rhs_c,)), ((), ()))
    product = jax.jit(lambda x, y: layers._dot(x, y, dimensions))
    xla_product = jax.jit(
        lambda x, y: jax.lax.dot_general(x, y, dimensions, preferred_element_type=jnp.float32)
    )
    a, b = jnp.asarray(a_np, jax_dtype), jnp.asarray(b_np, jax_dtype)
    a_t = torch.from_numpy(a_np).to(torch_dtype)
    b_t = torch.from_numpy(b_np).to(torch_dtype)
    a_t = a_t if layout[0] == "N" else a_t.T  # views: torch reads the stored layout too
    b_t = b_t if layout[1] == "N" else b_t.T

    per_sample = 2 if ctx.profile == "smoke" else CALLS_PER_SAMPLE

    def repeated(call):
        def calls():
            for _ in range(per_sample):
                call()

        return calls

    samples = interleaved_times(
        {
            "difforge": repeated(lambda: product(a, b).block_until_ready()),
            "xla": repeated(lambda: xla_product(a, b).block_until_ready()),
            "torch": repeated(lambda: torch.mm(a_t, b_t)),
        },
        reps=max(ctx.reps, 5),
        warmup=max(ctx.warmup, 1),
    )
    times = {impl: [t / per_sample for t in ts] for impl, ts in samples.items()}
    case = f"model-shapes {name} {m}x{k}x{n} {layout} {operands}"
    extra = {"difforge": {}, "xla": {}, "torch": {"threads": threads}}
    return [
        timed_record(BENCH, case, impl, t, flops=2.0 * m * k * n, operands=operands, **extra[impl])
        for impl, t in times.items()
    ]


def mark_limits(records: list[dict]) -> None:
    """Set ``role`` on the fastest fp32 record ("limit") and bf16 record ("limit_bf16")."""
    for dtype, role in ((FP32, "limit"), (BF16, "limit_bf16")):
        candidates = [r for r in records if r.get("dtype") == dtype and "gflop_per_s" in r]
        if candidates:
            max(candidates, key=lambda r: r["gflop_per_s"])["role"] = role


def run(ctx: BenchContext) -> list[dict]:
    """fp32: XLA, torch, numpy, MKL; bf16 x bf16 -> fp32: XLA, torch; the best of each marked; on CPU the model-shape products (difforge's dense-layer product, XLA's dot, torch)."""
    n = matmul_size(ctx)
    rng = np.random.default_rng(0)
    a_np = rng.standard_normal((n, n), dtype=np.float32)
    b_np = rng.standard_normal((n, n), dtype=np.float32)
    records = _fp32_records(ctx, n, a_np, b_np) + _bf16_records(ctx, n, a_np, b_np)
    mark_limits(records)
    if not ctx.on_accelerator:  # the CPU's shapes; an accelerator's model sizes differ
        records += _model_shape_records(ctx)
    return records
