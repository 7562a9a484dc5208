"""Dense layers' matrix products and stride-1 convolutions on CPU in Intel oneMKL's GEMM
(``native/mkl_gemm.cc``).

XLA CPU's float32 dot runs the Wan projections at 270-310 GFLOP/s on a 2-core AVX-512 host;
MKL (PyTorch's GEMM) at 310-350 on the same shapes. Where MKL is installed (the ``mkl`` wheel:
``pip install 'difforge[mkl]'``), :func:`product` hands a dense layer's product to it as an XLA
custom call, cut into slabs run on XLA's own thread pool with MKL single-threaded (MKL's own
threads inside an XLA program fight XLA's for the cores). The Wan M float32 forward ran 1.17 ->
1.05 s with it, the train step 3.95 -> 3.69 s (alternated in one process). float32 only: MKL's
bf16 GEMM ran the Wan S bf16 forward and mixed-precision step no faster than XLA's AMX products.
:func:`conv` does the same for the 2-D convolutions of the SD UNet and VAE (``Conv2d``): one
accumulating GEMM per kernel tap over the padded image (see below).

Where it applies: float32 operands on the CPU backend, products of the three forms
:mod:`jaxcore.models.layers` writes (``x @ W``, ``dy @ W^T``, ``x^T dy``) and stride-1
convolutions, traced with no mesh
or a one-device mesh (``jax.set_mesh``; :func:`jaxcore.sharding.mesh_context`) on operands
placed on one device. A custom call has no sharding rule, so over several devices the
partitioner would gather its operands: there XLA's dot runs instead, as on other platforms (the
product is lowered per platform), and wherever MKL cannot run (not installed, ``DIFFORGE_MKL=0``,
``DIFFORGE_NATIVE_KERNELS=0``, no C++ compiler); one log line says which. Results agree with
XLA's dot to float32 rounding (tests/jaxcore/test_cpu_gemm.py).

``DIFFORGE_MKL``: ``0`` turns it off; a path names a ``libmkl_rt`` whose folder holds the MKL to
link (default: the ``mkl`` wheel's in ``<sys.prefix>/lib``, else the system's). The kernel links
MKL's libraries directly and keeps them out of the process's global symbol scope: through
``libmkl_rt`` they had landed there, and a PyTorch imported afterwards ran its own MKL
single-threaded (see ``native/mkl_gemm.cc``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxcore.kernels import native

log = logging.getLogger(__name__)

ENV = "DIFFORGE_MKL"
TARGET = "difforge_mkl_gemm"
# The name its products carry for rematerialisation policies: a custom call is no dot to
# ``dots_saveable``, so :data:`jaxcore.compute.REMAT_POLICIES` saves this name as well.
PRODUCT_NAME = "mkl_dense_product"

CONV_TARGET = "difforge_mkl_conv"

KERNEL = "mkl_gemm"
LARGEST_DIMENSION = 2**31 - 1  # MKL's LP64 interface takes 32-bit sizes


def find_library() -> str | None:
    """The ``libmkl_rt`` whose folder holds the MKL libraries to link: ``$DIFFORGE_MKL`` if a
    path, else the ``mkl`` wheel's in ``<sys.prefix>/lib``, else the system's
    (``ctypes.util.find_library``); None if none."""
    named = os.environ.get(ENV, "")
    if named not in ("", "1"):
        return named
    wheel = sorted(Path(sys.prefix, "lib").glob("libmkl_rt.so*"))
    if wheel:
        return str(wheel[-1])
    found = ctypes.util.find_library("mkl_rt")
    return None if found is None else _system_library_path(found)


def _system_library_path(name: str) -> str | None:
    """The path of a library ``ctypes.util.find_library`` named (it gives a bare soname)."""
    for folder in ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib"):
        if Path(folder, name).exists():
            return str(Path(folder, name))
    return None


def link_flags(runtime: Path) -> tuple[str, ...]:
    """Linker flags for the MKL next to ``runtime`` (its ``libmkl_rt.so[.N]``): the LP64
    interface, the sequential layer and the core, by their file names, with the folder as the
    run path."""
    suffix = runtime.name[len("libmkl_rt") :]  # ".so" or ".so.N"
    parts = ("mkl_intel_lp64", "mkl_sequential", "mkl_core")
    missing = [p for p in parts if not (runtime.parent / f"lib{p}{suffix}").exists()]
    if missing:
        raise FileNotFoundError(f"{runtime.parent} lacks lib{missing[0]}{suffix}")
    folder = str(runtime.parent)
    return (
        f"-L{folder}",
        f"-Wl,-rpath,{folder}",
        *(f"-l:lib{p}{suffix}" for p in parts),
    )


def _refusal() -> str | None:
    """Why MKL's products cannot run here whatever is built (switched off, no MKL), or None."""
    if os.environ.get(ENV) == "0":
        return f"{ENV}=0"
    refused = native.switched_off_or_unsupported()
    if refused is not None:
        return refused
    if find_library() is None:
        return "no libmkl_rt (pip install 'difforge[mkl]')"
    return None


def _library(*, compile: bool) -> Path:
    """The product library (:func:`jaxcore.kernels.native.build`), for a :func:`_refusal`-free
    machine."""
    return native.build(KERNEL, (), link_flags(Path(find_library())), compile=compile)


def _unavailable_reason() -> str | None:
    refused = _refusal()
    if refused is not None:
        return refused
    try:
        built = _library(compile=False)
        # Local, and deep-bound: MKL's libraries stay out of the global symbol scope (where
        # PyTorch's own MKL would bind to them) and never bind to a PyTorch loaded before.
        library = ctypes.CDLL(str(built), mode=os.RTLD_LOCAL | os.RTLD_DEEPBIND)
    except (native.NativeBuildError, OSError) as error:
        return str(error)
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(library.DifforgeMklGemm), platform="cpu")
    jax.ffi.register_ffi_target(
        CONV_TARGET, jax.ffi.pycapsule(library.DifforgeMklConv), platform="cpu"
    )
    return None


def prepare() -> str:
    """Build the MKL product library (``difforge prepare``): its path, or why it is not built."""
    refused = _refusal()
    if refused is not None:
        return f"not built: {refused}"
    try:
        return str(_library(compile=True))
    except (native.NativeBuildError, OSError) as error:
        return f"not built: {error}"


@functools.cache
def unavailable() -> str | None:
    """None when MKL's GEMM can run in this process (built, loaded and registered on the first
    call), else why not; logged once either way."""
    reason = _unavailable_reason()
    if reason is None:
        log.info("float32 dense products on CPU: MKL (%s)", find_library())
    else:
        log.info("float32 dense products on CPU: XLA's dot (MKL unavailable: %s)", reason)
    return reason


def _on_one_device(*operands) -> bool:
    """True when the product being traced is not partitioned over several devices: no mesh of
    more than one device is set (``jax.set_mesh``) and none is on its operands' types (jit
    arguments placed with a ``NamedSharding``, and what is computed from them)."""
    meshes = [jax.sharding.get_abstract_mesh()]
    meshes += [getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None) for x in operands]
    return all(mesh is None or mesh.empty or mesh.size == 1 for mesh in meshes)


def gemm(a: jax.Array, b: jax.Array, transpose_a: bool, transpose_b: bool) -> jax.Array:
    """``op(a) @ op(b)`` of 2-D float32 operands in MKL: the custom call itself, for a process
    where :func:`unavailable` is None."""
    m = a.shape[1] if transpose_a else a.shape[0]
    n = b.shape[0] if transpose_b else b.shape[1]
    call = jax.ffi.ffi_call(
        TARGET, jax.ShapeDtypeStruct((m, n), jnp.float32), vmap_method="sequential"
    )
    return call(a, b, transpose_a=transpose_a, transpose_b=transpose_b)


def _as_matrices(a, b, dimensions):
    """(a2, b2, transpose_a, transpose_b, output shape) when ``dimensions`` is one of the dense
    layers' products: ``[..., K] x [K, N]``, ``[..., K] x [N, K]^T`` or ``[K, M]^T x [K, N]``;
    else None."""
    (contract_a, contract_b), batch = dimensions
    if batch != ((), ()) or b.ndim != 2 or a.ndim < 2:
        return None
    if max(*b.shape, a.shape[-1], a.size // max(a.shape[-1], 1)) > LARGEST_DIMENSION:
        return None
    if tuple(contract_a) == (a.ndim - 1,) and tuple(contract_b) in ((0,), (1,)):
        transpose_b = tuple(contract_b) == (1,)
        n = b.shape[0] if transpose_b else b.shape[1]
        return a.reshape(-1, a.shape[-1]), b, False, transpose_b, (*a.shape[:-1], n)
    if a.ndim == 2 and tuple(contract_a) == (0,) and tuple(contract_b) == (0,):
        return a, b, True, False, (a.shape[1], b.shape[1])
    return None


def takes(a: jax.Array, b: jax.Array, dimensions) -> bool:
    """Whether :func:`product` computes this product in MKL on CPU."""
    if a.dtype != jnp.float32 or b.dtype != jnp.float32 or jax.default_backend() != "cpu":
        return False
    if _as_matrices(a, b, dimensions) is None:
        return False
    return _on_one_device(a, b) and unavailable() is None


def product(a: jax.Array, b: jax.Array, dimensions, xla_dot) -> jax.Array:
    """``xla_dot(a, b, dimensions)``, computed by MKL where it applies on CPU (see the module
    docstring): on the CPU platform the custom call, on any other the XLA dot."""
    if not takes(a, b, dimensions):
        return xla_dot(a, b, dimensions)

    def on_cpu(a, b):
        a2, b2, transpose_a, transpose_b, shape = _as_matrices(a, b, dimensions)
        out = gemm(a2, b2, transpose_a, transpose_b).reshape(shape)
        return checkpoint_name(out, PRODUCT_NAME)

    def elsewhere(a, b):
        return xla_dot(a, b, dimensions)

    return jax.lax.platform_dependent(a, b, cpu=on_cpu, default=elsewhere)


# --- convolutions -------------------------------------------------------------------------------
#
# A stride-1 2-D convolution, [B, H, W, C] x [KH, KW, C, O], as KH x KW accumulating GEMMs over
# the zero-padded image (``native/mkl_gemm.cc``, ``Conv``): no im2col copy, each tap's input rows
# contiguous. XLA CPU runs the SD UNet's 3 x 3 convolutions at 220-260 GFLOP/s on the 2-core
# AVX-512 host, PyTorch (oneDNN) at 280-350, these GEMMs at 250-310 (timings vary +-15% run to
# run; bench/unet.py: the SD 2 layout at half width 1.19 -> 1.03 s a forward with them). Only the
# forward: the gradients are XLA's convolution's (training the UNet keeps XLA's speed there).


def conv_takes(x: jax.Array, kernel: jax.Array, strides, padding) -> bool:
    """Whether :func:`conv` computes this convolution in MKL on CPU: float32, stride 1, zero or
    positive padding, one device, MKL available."""
    if x.dtype != jnp.float32 or kernel.dtype != jnp.float32 or jax.default_backend() != "cpu":
        return False
    if x.ndim != 4 or kernel.ndim != 4 or tuple(strides) != (1, 1):
        return False
    if any(p < 0 for pair in padding for p in pair):
        return False
    padded = [x.shape[1 + i] + sum(padding[i]) for i in range(2)]
    if any(n < k for n, k in zip(padded, kernel.shape[:2], strict=True)):
        return False
    if max(x.shape[-1], kernel.shape[-1], padded[0] * padded[1]) > LARGEST_DIMENSION:
        return False
    return _on_one_device(x, kernel) and unavailable() is None


def _mkl_conv(x, kernel, padding):
    """The custom call: pad, convolve "wide" (every padded column), drop the extra columns."""
    (top, bottom), (left, right) = padding
    padded = jnp.pad(x, ((0, 0), (top, bottom), (left, right), (0, 0)))
    b, hp, wp, _ = padded.shape
    kh, kw, _, o = kernel.shape
    call = jax.ffi.ffi_call(
        CONV_TARGET,
        jax.ShapeDtypeStruct((b, hp - kh + 1, wp, o), jnp.float32),
        vmap_method="sequential",
    )
    return call(padded, kernel)[:, :, : wp - kw + 1]


def conv(x: jax.Array, kernel: jax.Array, strides, padding, xla_conv) -> jax.Array:
    """``xla_conv(x, kernel)`` (NHWC x HWIO, ``strides`` and explicit ``padding`` pairs),
    computed by MKL where :func:`conv_takes` says so: on the CPU platform the custom call, on any
    other the XLA convolution. The gradients are XLA's convolution's (a custom VJP): the
    forward is what inference runs."""
    if not conv_takes(x, kernel, strides, padding):
        return xla_conv(x, kernel)
    padding = tuple(tuple(pair) for pair in padding)

    @jax.custom_vjp
    def convolve(x, kernel):
        def on_cpu(x, kernel):
            return _mkl_conv(x, kernel, padding)

        return jax.lax.platform_dependent(x, kernel, cpu=on_cpu, default=xla_conv)

    def forward(x, kernel):
        return convolve(x, kernel), (x, kernel)

    def backward(residuals, cotangent):
        _, pullback = jax.vjp(xla_conv, *residuals)
        return pullback(cotangent)

    convolve.defvjp(forward, backward)
    return convolve(x, kernel)


def saving_products(policy):
    """``policy`` (a ``jax.checkpoint`` policy) that also saves the products this module runs
    in MKL: custom calls, which the dot policies do not see. Remat policies are built through
    it, so no other module needs to know how CPU products are named."""
    policies = jax.checkpoint_policies
    return policies.save_from_both_policies(policy, policies.save_only_these_names(PRODUCT_NAME))
