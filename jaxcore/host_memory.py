"""Host allocator policy for XLA on CPU: memory freed by one step is kept for the next.

XLA's CPU runtime allocates each execution's temporaries as one block and frees it when the
execution ends (214 MB for the demo DiT's train step). glibc serves a block that large with a
fresh ``mmap`` and returns it with ``munmap``, so every step page-faults all of it in again:
54k minor faults per step, and the step ran 1.33x slower than with the memory kept (the demo
DiT's fwd+bwd+AdamW at batch 32, 278 vs 209 ms, measured alternately in one process;
``bench/train_step.py`` reports the step under this policy).

:func:`keep_freed_host_memory` tells glibc (``mallopt``) to serve every size from its heap
(no ``mmap``), with one arena so the runtime's worker threads share it, and not to give freed
memory back to the kernel below 2 GiB of free space at the heap's top. The cost: the process
keeps its peak host memory. Applied by the ``difforge`` command when the host has no
accelerator (JAX then runs on the CPU); ``DIFFORGE_KEEP_HOST_MEMORY=0`` turns it off, ``=1``
applies it whatever the host. A no-op where the C library is not glibc.

The arena limit only reaches threads that have not allocated yet, so this must run before JAX
starts its runtime: first thing in a process.
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys

ENV = "DIFFORGE_KEEP_HOST_MEMORY"

# glibc <malloc.h>
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8

# mallopt takes an int: the largest trim threshold it accepts
TRIM_THRESHOLD_BYTES = 2**31 - 1

_ACCELERATOR_DEVICES = ("/dev/accel*", "/dev/vfio/[0-9]*", "/dev/nvidia[0-9]*")


def accelerator_present() -> bool:
    """Whether JAX will run on something other than the CPU, judged without starting JAX:
    ``JAX_PLATFORMS`` when set, else TPU (``/dev/accel*``, ``/dev/vfio``) or NVIDIA devices."""
    platforms = os.environ.get("JAX_PLATFORMS", "").strip()
    if platforms:
        return platforms.split(",")[0].strip() != "cpu"
    return any(glob.glob(pattern) for pattern in _ACCELERATOR_DEVICES)


def keep_freed_host_memory() -> bool:
    """Apply the policy (see the module docstring) if wanted here; returns whether it is on."""
    choice = os.environ.get(ENV, "").strip()
    if choice == "0":
        return False
    if choice not in ("", "1"):
        raise ValueError(f"{ENV} must be 0 or 1, got {choice!r}")
    if not sys.platform.startswith("linux") or (choice != "1" and accelerator_present()):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc (musl, ...): nothing to tune
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    settings = ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
    return all(mallopt(param, value) == 1 for param, value in settings)
