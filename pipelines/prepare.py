"""``difforge prepare``: build the native CPU kernels ahead of any run.

The C++ kernels (:mod:`jaxcore.kernels.native`: attention on AMX / AVX-512; :mod:`jaxcore.kernels.
cpu_gemm`: dense products in MKL) are compiled here, never while JAX traces a program; a run
whose kernel is not built takes XLA's path and one log line says so. ``make install`` and
``make test`` run this; it prints each kernel's library or why it is not built, and takes a
fraction of a second when everything is built already.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class PrepareConfig:
    """No settings: what is built depends on this machine (its CPU, compiler and MKL)."""


def run(cfg: PrepareConfig, *, force: bool = False) -> None:
    del cfg, force
    from jaxcore.kernels import cpu_gemm, native

    built = {**native.prepare(), cpu_gemm.KERNEL: cpu_gemm.prepare()}
    for name, result in built.items():
        print(f"{name}: {result}")
