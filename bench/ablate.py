"""``make bench`` with one CPU-only mechanism switched off, to judge whether it still pays.

    python -m bench.ablate MECHANISM [bench.run arguments]   # e.g. attention --only transformer

MECHANISM is one of :data:`SWITCHES`, or ``none`` (everything on, for an A/B pair run close in
time). Results go to ``bench/results/latest.{json,md}`` as for ``make bench``; compare two runs
with ``python -m bench.compare``, whose ``vs reference`` columns (difforge against the PyTorch
reference timed in the same process) do not drift with the machine between runs. The verdicts
of 2026-12-06 (jax 0.12.0.1) and their numbers are in docs/benchmarks.md (Platform).

The mechanisms with a switch of their own are switched by it, in the environment this process
re-executes itself with (tcmalloc); the others are replaced here, before any model is traced.
"""

from __future__ import annotations

import os
import sys

# mechanism -> (environment it needs, what it is)
SWITCHES = {
    "none": ({}, "everything on"),
    "attention": ({}, "the native fused attention kernels (AVX-512 float32, AMX bf16)"),
    "mkl": ({"DIFFORGE_MKL": "0"}, "dense products and 2-D convolutions in MKL"),
    "tcmalloc": ({"DIFFORGE_TCMALLOC": "0"}, "tcmalloc (the glibc keep-freed policy instead)"),
    "allocators": (
        {"DIFFORGE_TCMALLOC": "0", "DIFFORGE_KEEP_HOST_MEMORY": "0"},
        "tcmalloc and the glibc keep-freed policy (plain glibc)",
    ),
    "transposed_copies": ({}, "the written-out transposes feeding bf16 products on CPU"),
}


def switch_off(mechanism: str) -> None:
    """Replace what ``mechanism`` adds by the path that runs without it (in this process)."""
    if mechanism == "attention":
        from jaxcore.kernels import native

        native.kernel_for = lambda dtype, head_dim: None
    elif mechanism == "transposed_copies":
        from jaxcore.kernels import products

        products.materialised_transpose = products._swap_last_axes


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in SWITCHES:
        listed = "\n".join(f"  {name}: {what}" for name, (_, what) in SWITCHES.items())
        print(f"usage: python -m bench.ablate MECHANISM [bench.run args]\n{listed}")
        return 2
    mechanism, rest = argv[0], argv[1:]
    os.environ.update(SWITCHES[mechanism][0])
    switch_off(mechanism)
    from bench import run

    sys.argv = [sys.argv[0], *rest]
    return run.main()


if __name__ == "__main__":
    raise SystemExit(main())
