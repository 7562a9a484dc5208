"""Native CPU kernels: C++ sources in ``jaxcore/kernels/native/``, XLA CPU custom calls (FFI).

Two today, each a fused attention forward and backward for the head-pair loop of
:mod:`jaxcore.kernels.blockwise`, which they replace where they can run (see each source's
header for why and for their exact semantics):
- ``amx_attention.cc``: bf16, blocks of 32 queries on Intel AMX (head dim a multiple of 32);
- ``avx512_attention.cc``: float32, the same blocks with AVX-512 FMA (head dim a multiple of 16).
Both include ``attention_common.h``. ``mkl_gemm.cc`` (dense products in Intel oneMKL) is built
by the same :func:`build` and driven by :mod:`jaxcore.kernels.cpu_gemm`.

A kernel is built by ``difforge prepare`` (:func:`prepare`; ``make install`` and the test
suite run it), never while a program traces, with the system's C++ compiler (``c++``, or
``$CXX``) against the XLA FFI headers jaxlib ships, into ``$DIFFORGE_CACHE/native/`` under a
name that hashes the sources, the flags, jaxlib's version and the compiler's, so a changed
source or jaxlib is rebuilt and concurrent processes never see a half-written library (temp
file, then rename). Where one cannot run (not built, no compiler, not Linux x86_64, a CPU
without its instructions, the OS refusing AMX's tile state, ``DIFFORGE_NATIVE_KERNELS=0``) the
XLA path runs instead and one log line says why: the results agree within rounding either way
(tests/jaxcore/test_native_attention.py).
"""

from __future__ import annotations

import ctypes
import dataclasses
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
AMX_FLAGS = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mamx-tile", "-mamx-bf16")
BASE_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC")
PREPARE_HINT = "run `difforge prepare` (make install and make test do)"


class NativeBuildError(RuntimeError):
    """The compiler is missing or refused a kernel's source."""


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")


def _compiler_version(compiler: str) -> str:
    done = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False)
    return done.stdout.splitlines()[0] if done.stdout else "unknown"


def ffi_include_dir() -> Path:
    return Path(jaxlib.__file__).resolve().parent / "include"


def build(
    name: str, flags: tuple[str, ...], libraries: tuple[str, ...] = (), *, compile: bool = True
) -> Path:
    """The shared library of ``native/<name>.cc`` (with the shared headers), compiled now unless
    cached; ``libraries``: linker arguments after the source (libraries it links). With
    ``compile=False`` (every use inside a program: nothing compiles while JAX traces) a library
    not built yet is a :class:`NativeBuildError` that says how to build it."""
    compiler = _compiler()
    if compiler is None:
        raise NativeBuildError("no C++ compiler (set CXX or install g++)")
    source = SOURCES / f"{name}.cc"
    command = [*BASE_FLAGS, *flags, f"-I{ffi_include_dir()}"]
    key = hashlib.sha256()
    for header in sorted(SOURCES.glob("*.h")):
        key.update(header.read_bytes())
    parts = (source.read_bytes(), repr((command, libraries)).encode(), jaxlib.__version__.encode())
    for part in parts:
        key.update(part)
    key.update(_compiler_version(compiler).encode())
    target = cache_dir() / "native" / f"{name}-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    if not compile:
        raise NativeBuildError(f"{name} is not built for this source and jaxlib: {PREPARE_HINT}")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        log.info("building native kernel %s (%s)", name, compiler)
        done = subprocess.run(
            [compiler, *command, str(source), *libraries, "-o", str(built)],
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


@dataclasses.dataclass(frozen=True)
class AttentionKernel:
    """One native attention kernel: ``native/<name>.cc``, whose library exports the FFI
    handlers ``<symbol>`` (forward) and ``<symbol>Backward``, registered as :attr:`target` and
    :attr:`backward_target`; it takes ``dtype`` inputs whose head dim is a multiple of
    ``d_multiple``, on a CPU with ``cpu_flags``."""

    name: str
    symbol: str
    dtype: str
    d_multiple: int
    flags: tuple[str, ...]
    cpu_flags: frozenset[str]
    uses_amx: bool  # the library exports difforge_amx_ready (the OS must grant AMX's state)

    @property
    def target(self) -> str:
        return f"difforge_{self.name}"

    @property
    def backward_target(self) -> str:
        return f"difforge_{self.name}_backward"


AMX_ATTENTION = AttentionKernel(
    "amx_attention",
    "DifforgeAmxAttention",
    "bfloat16",
    32,
    AMX_FLAGS,
    frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "amx_tile", "amx_bf16"}),
    uses_amx=True,
)
AVX512_ATTENTION = AttentionKernel(
    "avx512_attention",
    "DifforgeAvx512Attention",
    "float32",
    16,
    ("-mavx512f",),
    frozenset({"avx512f"}),
    uses_amx=False,
)
KERNELS = (AMX_ATTENTION, AVX512_ATTENTION)


def switched_off_or_unsupported() -> str | None:
    """Why no native kernel runs in this process (``DIFFORGE_NATIVE_KERNELS=0``, or not Linux
    x86_64), else None."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return f"{ENV_SWITCH}=0"
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return f"{platform.system()} {platform.machine()} (the kernel is Linux x86_64 only)"
    return None


def _refusal(kernel: AttentionKernel) -> str | None:
    """Why ``kernel`` cannot run here whatever is built (switched off, another platform, a CPU
    without its instructions), or None."""
    refused = switched_off_or_unsupported()
    if refused is not None:
        return refused
    missing = kernel.cpu_flags - cpu_flags()
    if missing:
        return f"this CPU lacks {', '.join(sorted(missing))}"
    return None


def _unavailable_reason(kernel: AttentionKernel) -> str | None:
    """None when ``kernel`` is registered and usable here, else why not."""
    refused = _refusal(kernel)
    if refused is not None:
        return refused
    try:
        library = ctypes.CDLL(str(build(kernel.name, kernel.flags, compile=False)))
    except (NativeBuildError, OSError) as error:
        return str(error)
    if kernel.uses_amx and not library.difforge_amx_ready():
        return "the OS refused AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM)"
    for target, symbol in (
        (kernel.target, kernel.symbol),
        (kernel.backward_target, f"{kernel.symbol}Backward"),
    ):
        handler = getattr(library, symbol)
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(handler), platform="cpu")
    return None


def prepare() -> dict[str, str]:
    """Build every attention kernel this machine can run (the explicit step, ``difforge
    prepare``): {kernel: its library's path, or why it is not built}."""
    out = {}
    for kernel in KERNELS:
        refused = _refusal(kernel)
        if refused is not None:
            out[kernel.name] = f"not built: {refused}"
            continue
        try:
            out[kernel.name] = str(build(kernel.name, kernel.flags))
        except NativeBuildError as error:
            out[kernel.name] = f"not built: {error}"
    return out


@functools.cache
def unavailable(kernel: AttentionKernel) -> str | None:
    """None when ``kernel`` can run in this process (it is built and registered on the first
    call), else the reason it cannot; logged once either way."""
    reason = _unavailable_reason(kernel)
    if reason is None:
        log.info("%s attention on CPU: the native kernel %s", kernel.dtype, kernel.name)
    else:
        log.info(
            "%s attention on CPU: XLA's path (native %s unavailable: %s)",
            kernel.dtype,
            kernel.name,
            reason,
        )
    return reason


def kernel_for(dtype, head_dim: int) -> AttentionKernel | None:
    """The native kernel that takes attention inputs of ``dtype`` and ``head_dim`` here (built
    and registered now if need be), or None: XLA's path."""
    for kernel in KERNELS:
        if jax.numpy.dtype(dtype) == jax.numpy.dtype(kernel.dtype) and (
            head_dim % kernel.d_multiple == 0
        ):
            return kernel if unavailable(kernel) is None else None
    return None


def attention(kernel: AttentionKernel, q, k, v, mask, scale: float):
    """(out ``[B, Lq, H, D]``, lse ``[B, H, Lq]`` float32) of q ``[B, Lq, H, D]`` over k/v
    ``[B, Lk, H, D]`` with ``mask`` ``[B, Lk]`` (True = attend) and the scores scaled by
    ``scale`` (> 0): the semantics of :func:`jaxcore.kernels.blockwise._forward` for each (batch
    row, head) pair. Only for a :func:`kernel_for` of the inputs."""
    batch, lq, heads, _ = q.shape
    call = jax.ffi.ffi_call(
        kernel.target,
        (
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct((batch, heads, lq), jax.numpy.float32),
        ),
        vmap_method="sequential",
    )
    return call(q, k, v, mask.astype(bool), scale=np.float32(scale))


def attention_backward(kernel: AttentionKernel, q, k, v, mask, out, lse, d_out, scale: float):
    """(dq, dk, dv) of :func:`attention` given its ``out``, ``lse`` and the output's cotangent
    ``d_out``: the semantics of :func:`jaxcore.kernels.blockwise._backward` for one pair
    (float32 accumulation; in bf16 the probabilities and score gradients rounded to bf16 for
    the products, as there)."""
    call = jax.ffi.ffi_call(
        kernel.backward_target,
        tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)),
        vmap_method="sequential",
    )
    return call(q, k, v, mask.astype(bool), out, lse, d_out, scale=np.float32(scale))
