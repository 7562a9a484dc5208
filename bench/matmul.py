"""Benchmark 0, the machine's limits: the best n x n GEMM any library here reaches.

- fp32: XLA (``jnp.matmul``), torch and numpy on the same matrices (2 n^3 FLOPs per call).
  numpy runs in its own subprocess with ``OPENBLAS_CORETYPE`` / ``OPENBLAS_L2_SIZE`` removed
  from its environment, so OpenBLAS picks its own kernel for this CPU (those variables, when a
  container sets them, can hold it to a slower one). The **limit** is the fastest of the three.
- bf16 inputs with fp32 accumulation: XLA (``preferred_element_type=float32``) and torch
  (bf16 ``mm``, accumulated in fp32 inside); the **bf16 limit** is the faster.

:mod:`bench.run` divides every FLOP-counted figure by both limits (``frac_of_limit``,
``frac_of_bf16_limit``); ``role`` says which record set each limit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import BenchContext, set_torch_threads, time_calls, timed_record

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


def mark_limits(records: list[dict]) -> None:
    """Set ``role`` on the fastest fp32 record ("limit") and bf16 record ("limit_bf16")."""
    for dtype, role in ((FP32, "limit"), (BF16, "limit_bf16")):
        candidates = [r for r in records if r.get("dtype") == dtype and "gflop_per_s" in r]
        if candidates:
            max(candidates, key=lambda r: r["gflop_per_s"])["role"] = role


def run(ctx: BenchContext) -> list[dict]:
    """fp32: XLA, torch, numpy; bf16 x bf16 -> fp32: XLA, torch; the best of each marked."""
    n = matmul_size(ctx)
    rng = np.random.default_rng(0)
    a_np = rng.standard_normal((n, n), dtype=np.float32)
    b_np = rng.standard_normal((n, n), dtype=np.float32)
    records = _fp32_records(ctx, n, a_np, b_np) + _bf16_records(ctx, n, a_np, b_np)
    mark_limits(records)
    return records
