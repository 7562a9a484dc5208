"""Benchmark 0, the machine's limit: an n x n float32 matmul in JAX (2 n^3 FLOPs per call).

Every other figure is also reported as a fraction of this one (same process, same run). torch
and numpy are timed on the same matrices for context.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import BenchContext, set_torch_threads, time_calls, timed_record

BENCH = "matmul"
SIZES = {"smoke": 256, "quick": 4096, "full": 4096}
ACCELERATOR_SIZE = 8192


def matmul_size(ctx: BenchContext) -> int:
    if ctx.on_accelerator and ctx.profile != "smoke":
        return ACCELERATOR_SIZE
    return SIZES[ctx.profile]


def run(ctx: BenchContext) -> list[dict]:
    """XLA (the limit), torch and numpy on the same n x n fp32 matrices."""
    n = matmul_size(ctx)
    flops = 2.0 * n**3
    rng = np.random.default_rng(0)
    a_np = rng.standard_normal((n, n), dtype=np.float32)
    b_np = rng.standard_normal((n, n), dtype=np.float32)

    a, b = jnp.asarray(a_np), jnp.asarray(b_np)
    matmul = jax.jit(jnp.matmul)
    times, _ = time_calls(
        lambda: matmul(a, b).block_until_ready(), reps=max(ctx.reps, 3), warmup=ctx.warmup
    )
    records = [timed_record(BENCH, str(n), "xla", times, flops=flops, role="limit")]

    import torch

    threads = set_torch_threads()
    a_t, b_t = torch.from_numpy(a_np), torch.from_numpy(b_np)
    times, _ = time_calls(lambda: torch.mm(a_t, b_t), reps=ctx.reps, warmup=ctx.warmup)
    records.append(timed_record(BENCH, str(n), "torch", times, flops=flops, threads=threads))
    if not ctx.on_accelerator:
        times, _ = time_calls(lambda: a_np @ b_np, reps=ctx.reps, warmup=ctx.warmup)
        records.append(timed_record(BENCH, str(n), "numpy", times, flops=flops))
    return records
