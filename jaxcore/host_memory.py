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

Better still is tcmalloc, where the host has it (Debian: ``libtcmalloc-minimal4``; the CPU image
installs it): it keeps freed blocks per size class without the single arena's lock, and the
steps ran faster than under the glibc policy (Wan bench size S, alternating processes: the
float32 train step 1.66-1.71 -> 1.51-1.53 s, the bf16-activations step 0.96-1.00 -> 0.81 s, the
bf16 forward 264-265 -> 239-243 ms). An allocator must be loaded before the process starts, so
:func:`reexec_with_tcmalloc` re-executes the program with tcmalloc in ``LD_PRELOAD``; the
``difforge`` command and ``make bench`` call it first thing (``DIFFORGE_TCMALLOC=0`` turns it
off, ``=1`` applies it whatever the host). Where it runs, the glibc policy above is moot.
tcmalloc too hands freed pages back to the kernel by default, a little on every free, so a
step that followed other work (another step function, PyTorch in the bench) faulted its
temporaries in again: the Wan M float32 train step took 6.2 s right after such work, 4.1-4.3
s otherwise; with ``TCMALLOC_RELEASE_RATE=0``, which the re-execution sets unless the user
set it, 4.0-4.2 s in every position (alternately in one process).
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys
from pathlib import Path

ENV = "DIFFORGE_KEEP_HOST_MEMORY"
TCMALLOC_ENV = "DIFFORGE_TCMALLOC"
# set in the re-executed process: it is not re-executed again, whatever LD_PRELOAD became
_REEXECUTED_ENV = "DIFFORGE_TCMALLOC_PRELOADED"
# gperftools' rate of handing freed pages back to the kernel; 0: never (unless the user set it)
TCMALLOC_RELEASE_ENV = "TCMALLOC_RELEASE_RATE"
_TCMALLOC_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
_LIBRARY_DIRS = (
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/usr/lib64",
    "/usr/lib",
)

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


def _choice(env: str) -> str:
    choice = os.environ.get(env, "").strip()
    if choice not in ("", "0", "1"):
        raise ValueError(f"{env} must be 0 or 1, got {choice!r}")
    return choice


def _wanted_here(env: str) -> bool:
    """Whether a host policy applies: on Linux, on a CPU-only host unless ``env`` is 1."""
    choice = _choice(env)
    if choice == "0" or not sys.platform.startswith("linux"):
        return False
    return choice == "1" or not accelerator_present()


def tcmalloc_active() -> bool:
    """Whether tcmalloc serves this process's allocations (preloaded)."""
    return any("tcmalloc" in Path(p).name for p in os.environ.get("LD_PRELOAD", "").split(":"))


def find_tcmalloc() -> str | None:
    """The path of the host's tcmalloc shared library, or None."""
    for directory in _LIBRARY_DIRS:
        for name in _TCMALLOC_NAMES:
            path = Path(directory) / name
            if path.is_file():
                return str(path)
    return None


def reexec_with_tcmalloc() -> None:
    """Re-execute this program (``sys.orig_argv``) with tcmalloc preloaded, where wanted (see
    the module docstring) and found; returns only when it does not. Call it first thing in a
    program's entry point, never from a function other code calls in-process."""
    if not _wanted_here(TCMALLOC_ENV) or tcmalloc_active() or os.environ.get(_REEXECUTED_ENV):
        return
    library = find_tcmalloc()
    if library is None:
        if _choice(TCMALLOC_ENV) == "1":
            raise ValueError(f"{TCMALLOC_ENV}=1 but no tcmalloc in {', '.join(_LIBRARY_DIRS)}")
        return
    preload = ":".join(p for p in (library, os.environ.get("LD_PRELOAD", "")) if p)
    env = {**os.environ, "LD_PRELOAD": preload, _REEXECUTED_ENV: "1"}
    env.setdefault(TCMALLOC_RELEASE_ENV, "0")  # keep freed memory (see the module docstring)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def keep_freed_host_memory() -> bool:
    """Apply the policy (see the module docstring) if wanted here; returns whether it is on."""
    if not _wanted_here(ENV) or tcmalloc_active():
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc (musl, ...): nothing to tune
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    settings = ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
    return all(mallopt(param, value) == 1 for param, value in settings)
