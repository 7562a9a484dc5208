"""Native CPU kernels: C++ sources in ``jaxcore/kernels/native/``, XLA CPU custom calls (FFI).

Today one: ``amx_attention.cc``, bf16 attention fused per block of 32 queries on Intel AMX,
forward and backward (see its header for why and for their exact semantics). They replace
XLA's forward and backward of the head-pair loop in :mod:`jaxcore.kernels.blockwise` where
they can run.

A kernel is built on first use with the system's C++ compiler (``c++``, or ``$CXX``) against
the XLA FFI headers jaxlib ships, into ``$DIFFORGE_CACHE/native/`` under a name that hashes
the source, the flags, jaxlib's version and the compiler's, so a changed source or jaxlib is
rebuilt and concurrent processes never see a half-written library (temp file, then rename).
Where it cannot run (no compiler, not Linux x86_64, a CPU without AMX-BF16, the OS refusing
AMX's tile state, ``DIFFORGE_NATIVE_KERNELS=0``) the XLA path runs instead and one log line
says why: the results agree within bf16 rounding either way
(tests/jaxcore/test_native_attention.py).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jaxlib
import numpy as np

from jaxcore.storage import cache_dir

log = logging.getLogger(__name__)

SOURCES = Path(__file__).resolve().parent / "native"
ENV_SWITCH = "DIFFORGE_NATIVE_KERNELS"  # "0": never use the native kernels
AMX_ATTENTION_TARGET = "difforge_amx_attention"
AMX_ATTENTION_BACKWARD_TARGET = "difforge_amx_attention_backward"
AMX_FLAGS = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mamx-tile", "-mamx-bf16")
AMX_CPU_FLAGS = frozenset(
    {"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "amx_tile", "amx_bf16"}
)
BASE_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC")


class NativeBuildError(RuntimeError):
    """The compiler is missing or refused a kernel's source."""


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")


def _compiler_version(compiler: str) -> str:
    done = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False)
    return done.stdout.splitlines()[0] if done.stdout else "unknown"


def ffi_include_dir() -> Path:
    return Path(jaxlib.__file__).resolve().parent / "include"


def build(name: str, flags: tuple[str, ...]) -> Path:
    """The shared library of ``native/<name>.cc``, compiled now unless cached."""
    compiler = _compiler()
    if compiler is None:
        raise NativeBuildError("no C++ compiler (set CXX or install g++)")
    source = SOURCES / f"{name}.cc"
    command = [*BASE_FLAGS, *flags, f"-I{ffi_include_dir()}"]
    key = hashlib.sha256()
    for part in (source.read_bytes(), repr(command).encode(), jaxlib.__version__.encode()):
        key.update(part)
    key.update(_compiler_version(compiler).encode())
    target = cache_dir() / "native" / f"{name}-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        log.info("building native kernel %s (%s)", name, compiler)
        done = subprocess.run(
            [compiler, *command, str(source), "-o", str(built)],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode:
            errors = [line for line in done.stderr.splitlines() if "error" in line]
            raise NativeBuildError(
                f"{compiler} failed on {source.name}: " + " | ".join(errors[:3] or ["see stderr"])
            )
        os.replace(built, target)
    return target


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (Linux ``/proc/cpuinfo``); empty where unknown."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def _amx_unavailable_reason() -> str | None:
    """None when the AMX attention kernel is registered and usable here, else why not."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return f"{ENV_SWITCH}=0"
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return f"{platform.system()} {platform.machine()} (the kernel is Linux x86_64 only)"
    missing = AMX_CPU_FLAGS - cpu_flags()
    if missing:
        return f"this CPU lacks {', '.join(sorted(missing))}"
    try:
        library = ctypes.CDLL(str(build("amx_attention", AMX_FLAGS)))
    except (NativeBuildError, OSError) as error:
        return str(error)
    if not library.difforge_amx_ready():
        return "the OS refused AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM)"
    for target, symbol in (
        (AMX_ATTENTION_TARGET, library.DifforgeAmxAttention),
        (AMX_ATTENTION_BACKWARD_TARGET, library.DifforgeAmxAttentionBackward),
    ):
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(symbol), platform="cpu")
    return None


@functools.cache
def amx_attention_unavailable() -> str | None:
    """None when :func:`amx_attention` can run in this process (it is built and registered on
    the first call), else the reason it cannot; logged once either way."""
    reason = _amx_unavailable_reason()
    if reason is None:
        log.info("bf16 attention on CPU: the native AMX kernel (jaxcore/kernels/native)")
    else:
        log.info("bf16 attention on CPU: XLA's path (native AMX kernel unavailable: %s)", reason)
    return reason


def amx_attention_available() -> bool:
    return amx_attention_unavailable() is None


def amx_attention_supports(q: jax.Array, k: jax.Array) -> bool:
    """Whether q ``[P, Lq, D]`` / k ``[P, Lk, D]`` are a case the kernel takes: bf16, D a
    multiple of 32 (one AMX tile row), and the kernel available."""
    return (
        q.dtype == jax.numpy.bfloat16
        and k.dtype == q.dtype
        and q.shape[-1] % 32 == 0
        and q.shape[-1] == k.shape[-1]
        and amx_attention_available()
    )


def amx_attention(q, k, v, mask, scale: float):
    """(out ``[P, Lq, D]`` bf16, lse ``[P, Lq]`` float32) of q over k/v ``[P, Lk, D]`` with
    ``mask`` ``[P, Lk]`` (True = attend) and the scores scaled by ``scale``; the semantics of
    :func:`jaxcore.kernels.blockwise._forward` for one pair. Call only where
    :func:`amx_attention_supports` holds."""
    pairs, lq, d = q.shape
    call = jax.ffi.ffi_call(
        AMX_ATTENTION_TARGET,
        (
            jax.ShapeDtypeStruct((pairs, lq, d), q.dtype),
            jax.ShapeDtypeStruct((pairs, lq), jax.numpy.float32),
        ),
        vmap_method="sequential",
    )
    return call(q, k, v, mask, scale=np.float32(scale))


def amx_attention_backward(q, k, v, mask, out, lse, d_out, scale: float):
    """(dq, dk, dv) in bf16 of :func:`amx_attention` given its ``out``, ``lse`` and the output's
    cotangent ``d_out``: the semantics of :func:`jaxcore.kernels.blockwise._backward` for one
    pair (float32 accumulation, the probabilities and score gradients rounded to bf16 for the
    products, as there). Call only where :func:`amx_attention_supports` holds."""
    call = jax.ffi.ffi_call(
        AMX_ATTENTION_BACKWARD_TARGET,
        tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)),
        vmap_method="sequential",
    )
    return call(q, k, v, mask, out, lse, d_out, scale=np.float32(scale))
