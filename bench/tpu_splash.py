"""Which TPU splash kernel attention runs: jax's Pallas splash or tokamax's, by the TPU compiler.

``python -m bench.tpu_splash [--json]`` compiles one chip's attention forward + backward (bf16,
``jax.grad`` of the summed output, as a training step needs it) ahead of time with libtpu (no
TPU needed, :mod:`jaxcore.aot`) for each kernel and each case below, and reports what the
compiled program says: whether it compiles, per-chip HBM (arguments, temporaries, outputs),
FLOPs, bytes accessed and libtpu's cost-model time (``optimal_seconds``).

Why it cannot decide by speed alone: both kernels are Mosaic custom calls, whose inside the cost
model does not see; a kernel that attaches a ``pl.CostEstimate`` to its ``pallas_call``
(tokamax's does, jax's does not) reports the FLOPs and bytes it declares, not a measured time.
So the choice rests on what does show (compiles on each generation, memory) and on dependencies;
the numbers and the choice are in docs/benchmarks.md (Platform).

The cases are one chip's share of MaxDiffusion's Wan runs: Wan 2.1 1.3B at 480x832 x 81 frames
(32,760 tokens, 12 heads of 128) and 14B at 720x1280 x 81 frames (75,600 tokens) with its 40
heads over a 4-way tensor/context split (10 heads a chip). tokamax is optional (``pip install
tokamax``; it is not a dependency of difforge); without it only jax's kernel is compiled.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxcore import aot
from jaxcore.kernels import flash

CASES = {  # name: (tokens, heads per chip, head dim)
    "wan1.3b-480p-81f": (32_760, 12, 128),
    "wan14b-720p-81f-quarter-heads": (75_600, 10, 128),
}
SLICES = ("v5p-8", "v6e-8")
BLOCK = 512  # MaxDiffusion's flash_block_sizes for Wan on TPU: 512 queries x 512 keys a block


def jax_splash(q, k, v):
    """difforge's TPU path (:func:`jaxcore.kernels.flash.splash_attention`), q ``[B, L, H, D]``."""
    sizes = flash.BlockSizes(BLOCK, BLOCK)
    return flash.splash_attention(q, k, v, scale=q.shape[-1] ** -0.5, block_sizes=sizes)


def tokamax_splash(q, k, v, dq_reduction_steps=None):
    """tokamax's splash kernel as MaxDiffusion's ``tokamax_flash`` calls it (fused backward,
    full mask, heads-first layout), q ``[B, L, H, D]``. Its fused backward keeps a float32 dq
    partial per key block and sums them after (``dq_reduction_steps=None``), or cycles through
    three (``3``)."""
    from tokamax._src.ops.experimental.tpu.splash_attention import (
        splash_attention_kernel as splash,
    )
    from tokamax._src.ops.experimental.tpu.splash_attention import (
        splash_attention_mask as masks,
    )

    length = q.shape[1]
    config = splash.SplashConfig(
        block_q=BLOCK,
        block_kv=BLOCK,
        block_kv_compute=BLOCK,
        block_q_dkv=BLOCK,
        block_kv_dkv=BLOCK,
        block_kv_dkv_compute=BLOCK,
        use_fused_bwd_kernel=True,
        dq_reduction_steps=dq_reduction_steps,
    )
    kernel = splash.make_splash_mha(
        mask=masks.FullMask(_shape=(length, length)), config=config, q_seq_shards=1
    )
    scaled = q * jnp.asarray(q.shape[-1] ** -0.5, q.dtype)

    def heads_first(x):
        return x.transpose(0, 2, 1, 3)

    out = jax.vmap(kernel)(heads_first(scaled), heads_first(k), heads_first(v))
    return heads_first(out)


KERNELS = {
    "jax_splash": jax_splash,
    "tokamax_splash": tokamax_splash,
    "tokamax_splash_dq3": lambda q, k, v: tokamax_splash(q, k, v, dq_reduction_steps=3),
}


def tokamax_available() -> bool:
    try:
        import tokamax  # noqa: F401
    except ImportError:
        return False
    return True


def compile_case(kernel, slice_name: str, case: str) -> dict:
    tokens, heads, head_dim = CASES[case]
    # pad to the block, as the kernels' callers do (jax_splash pads itself; tokamax's does not)
    length = math.ceil(tokens / BLOCK) * BLOCK
    device = aot.topology(slice_name).devices()[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    shape = jax.ShapeDtypeStruct((1, length, heads, head_dim), jnp.bfloat16, sharding=sharding)

    def loss(q, k, v):
        return jnp.sum(KERNELS[kernel](q, k, v).astype(jnp.float32))

    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    started = time.perf_counter()
    record = {"kernel": kernel, "slice": slice_name, "case": case, "tokens": length}
    # a Pallas TPU kernel reads the chip it is for from the mesh in context (no TPU attached)
    chip = jax.sharding.Mesh(np.array([device]), ("chip",)).abstract_mesh
    try:
        with jax.sharding.use_abstract_mesh(chip):
            lowered = step.lower(shape, shape, shape)
        compiled = lowered.compile()
    except Exception as error:  # noqa: BLE001 - a kernel that does not compile is a finding
        return {**record, "compiles": False, "error": str(error).splitlines()[0][:300]}
    memory = compiled.memory_analysis()
    cost = compiled.cost_analysis() or {}
    cost = cost[0] if isinstance(cost, list | tuple) else cost
    attention_flops = 4 * length * length * heads * head_dim * 3.5  # fwd 2 products + bwd 5
    return {
        **record,
        "compiles": True,
        "compile_s": round(time.perf_counter() - started, 1),
        "argument_gib": memory.argument_size_in_bytes / aot.GIB,
        "temp_gib": memory.temp_size_in_bytes / aot.GIB,
        "output_gib": memory.output_size_in_bytes / aot.GIB,
        "xla_flops": float(cost.get("flops", 0.0)),
        "attention_flops": float(attention_flops),
        "bytes_accessed": float(cost.get("bytes accessed", 0.0)),
        "optimal_seconds": float(cost.get("optimal_seconds", float("nan"))),
    }


def run(slices=SLICES, cases=tuple(CASES)) -> list[dict]:
    kernels = list(KERNELS) if tokamax_available() else ["jax_splash"]
    return [
        compile_case(kernel, slice_name, case)
        for slice_name in slices
        for case in cases
        for kernel in kernels
    ]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tpu_splash", description=__doc__)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--slice", action="append", dest="slices")
    args = parser.parse_args(argv)
    records = run(tuple(args.slices or SLICES))
    if args.json:
        print(json.dumps(records, indent=1))
        return 0
    print("| slice | case | kernel | compiles | temp GiB | XLA GFLOP | cost-model ms |")
    print("|---|---|---|---|---|---|---|")
    for r in records:
        if not r["compiles"]:
            print(f"| {r['slice']} | {r['case']} | {r['kernel']} | no: {r['error']} | | | |")
            continue
        print(
            f"| {r['slice']} | {r['case']} | {r['kernel']} | yes | {r['temp_gib']:.2f} | "
            f"{r['xla_flops'] / 1e9:.0f} | {1e3 * r['optimal_seconds']:.2f} |"
        )
    return 0


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    raise SystemExit(main())
