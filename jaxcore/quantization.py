"""Quantized denoisers: weights, or weights and activations, in int8 / fp8, for every family
through one mechanism.

``compute.quantization`` names the mode (:data:`MODES`):

- ``none``: the weights as loaded;
- ``int8_weights`` / ``fp8_weights``: every product kernel of the denoiser (a parameter named
  ``kernel`` with two or more axes: dense layers, packed dense kernels, convolutions) held as
  int8 / float8_e4m3fn values with one float32 scale per output channel (the kernel's last
  axis; absmax calibration), as torchao's int8 weight-only does. The products still run in the
  activations' dtype: each kernel is dequantized where the denoiser is called
  (:func:`dequantized`), so what a mode saves is the weights' memory, not product time;
- ``int8`` / ``fp8``: the kernels held the same way, and the products themselves quantized
  (as MaxDiffusion's qwix ``quantization=int8`` / ``fp8``, and torchao's int8 dynamic): each
  product's activations are quantized where it runs, absmax with one scale per row (per
  token: the non-contracting axes, qwix's default), and the product runs on the quantized values (int8 x int8 accumulating in int32,
  e4m3 x e4m3 in float32) before both scales are applied. The seam is
  :mod:`jaxcore.models.layers` (dense, packed dense, heads einsum): a kernel reaching it
  quantized runs there quantized (:func:`dot_general`, :func:`einsum`). Convolutions
  dequantize their kernel and keep float activations (see ``layers.conv2d`` for why).

The quantized values are qwix's (``qwix.quantize`` / ``qwix.dot_general`` ..., Google's
quantization library, the one MaxDiffusion uses).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Any

import jax
import jax.numpy as jnp

MODES = ("none", "int8_weights", "fp8_weights", "int8", "fp8")
_QTYPES = {
    "int8_weights": jnp.int8,
    "fp8_weights": jnp.float8_e4m3fn,
    "int8": jnp.int8,
    "fp8": jnp.float8_e4m3fn,
}


def check_mode(mode: str, key: str = "quantization") -> None:
    """Raise ValueError naming ``key`` for a mode that is not one of :data:`MODES`."""
    if mode not in MODES:
        raise ValueError(f"{key}: unknown quantization {mode!r}; choose one of {list(MODES)}")


# modes a training step takes (compute.quantization in train): fp8 products, float weights
TRAINABLE = ("none", "fp8")
# set while a training step is traced (training_products): how its dense products run
_TRAINING = contextvars.ContextVar("difforge_training_quantization", default="none")


@contextlib.contextmanager
def training_products(mode: str):
    """While tracing a training step under it, the denoiser's dense products (the
    :mod:`jaxcore.models.layers` seam) run in float8 as MaxDiffusion's qwix ``fp8_full``:
    activations and kernels in e4m3 and the incoming gradients of the backward products in
    e5m2, each scaled by its absmax per tensor; the weights and the optimizer stay in their
    own dtype (:func:`training_dot`). ``none``: nothing changes."""
    if mode not in TRAINABLE:
        raise ValueError(f"compute.quantization={mode!r} does not train; choose one of {TRAINABLE}")
    token = _TRAINING.set(mode)
    try:
        yield
    finally:
        _TRAINING.reset(token)


def trains_quantized() -> bool:
    """Whether a training step with quantized products is being traced."""
    return _TRAINING.get() != "none"


@functools.cache
def _fp8_training_config():
    from qwix._src.core import dot_general_qt

    e4m3, e5m2 = jnp.float8_e4m3fn, jnp.float8_e5m2
    return dot_general_qt.DotGeneralQtConfig(
        lhs_qtype=e4m3,
        rhs_qtype=e4m3,
        lhs_disable_channelwise_axes=True,
        rhs_disable_channelwise_axes=True,
        dlhs_grad_qtype=e5m2,
        drhs_grad_qtype=e5m2,
        dlhs_grad_disable_channelwise_axes=True,
        drhs_grad_disable_channelwise_axes=True,
    )


def training_dot(x: jax.Array, kernel: jax.Array, dimensions) -> jax.Array:
    """``dot_general(x, kernel, dimensions)`` as :func:`training_products` says (qwix's
    ``dot_general_qt``: quantized forward and backward products, a custom VJP); the result in
    ``x``'s dtype."""
    from qwix._src.core import dot_general_qt

    out = dot_general_qt.dot_general_qt(x, kernel, dimensions, _fp8_training_config())
    return out.astype(x.dtype)


def quantizes_products(mode: str) -> bool:
    """Whether ``mode`` runs the products quantized (``int8`` / ``fp8``): the denoiser then
    takes its quantized kernels as they are, instead of dequantized (:func:`dequantized`)."""
    return mode in ("int8", "fp8")


def _is_product_kernel(path, leaf) -> bool:
    """A product kernel: named ``kernel`` (the last entry of a jax key path or of a tuple of
    names) with two or more axes."""
    last = path[-1] if path else None
    name = last if isinstance(last, str) else getattr(last, "key", getattr(last, "name", None))
    return name == "kernel" and getattr(leaf, "ndim", 0) >= 2


def is_quantized_kernel(leaf) -> bool:
    """Whether ``leaf`` is a quantized kernel (a ``qwix.QArray``)."""
    import qwix

    return isinstance(leaf, qwix.QArray)


def _map_kernels(params, mode: str, quantize_one):
    """``params`` with ``quantize_one(kernel, qtype)`` in place of every product kernel, for
    ``mode``'s qtype; ``none`` returns ``params`` itself."""
    check_mode(mode)
    if mode == "none":
        return params
    qtype = _QTYPES[mode]

    def one(path, leaf):
        return quantize_one(leaf, qtype) if _is_product_kernel(path, leaf) else leaf

    return jax.tree_util.tree_map_with_path(one, params)


def quantize_params(params, mode: str):
    """``params`` with every product kernel quantized for ``mode`` (a ``qwix.QArray``: values
    and a float32 scale per output channel); other leaves unchanged. ``none`` returns
    ``params`` itself. Jittable; sharded kernels keep their sharding."""
    import qwix

    def one(kernel, qtype):
        channels = [kernel.ndim - 1]
        return qwix.quantize(kernel, qtype, channelwise_axes=channels, scale_dtype=jnp.float32)

    return _map_kernels(params, mode, one)


@functools.cache
def quantizer(mode: str):
    """:func:`quantize_params` for ``mode``, jitted once per mode (a LoRA set's re-quantizing
    reuses the program that quantized the weights on load)."""
    check_mode(mode)
    return jax.jit(functools.partial(quantize_params, mode=mode))


def on_load(mode: str):
    """``(param path, placed array) -> kept``: a product kernel quantized for ``mode`` (by
    :func:`quantizer`'s one-kernel program), anything else as it is; None for ``none``
    (for :func:`jaxcore.weights.load_params`'s ``finish``)."""
    check_mode(mode)
    if mode == "none":
        return None
    quantize = quantizer(mode)

    def finish(path, leaf):
        if not _is_product_kernel(path, leaf):
            return leaf
        return quantize({"kernel": leaf})["kernel"]

    return finish


def abstract_quantized(abstract_params, mode: str):
    """What :func:`quantize_params` makes of ``abstract_params`` (ShapeDtypeStructs, sharded or
    not), without computing anything: values sharded as the kernel, the scale with the
    reduced axes unsharded (for ``difforge fit``)."""
    import qwix

    def one(kernel, qtype):
        where = getattr(kernel, "sharding", None)
        scale_where = None
        if isinstance(where, jax.sharding.NamedSharding):
            spec = tuple(where.spec) + (None,) * (kernel.ndim - len(where.spec))
            scale_spec = (None,) * (kernel.ndim - 1) + spec[-1:]
            scale_where = jax.sharding.NamedSharding(where.mesh, jax.P(*scale_spec))
        values = jax.ShapeDtypeStruct(kernel.shape, qtype, sharding=where)
        scale_shape = (1,) * (kernel.ndim - 1) + kernel.shape[-1:]
        scale = jax.ShapeDtypeStruct(scale_shape, jnp.float32, sharding=scale_where)
        return qwix.QArray(values, scale, None, qtype)

    return _map_kernels(abstract_params, mode, one)


def is_quantized(params) -> bool:
    """Whether any leaf of ``params`` is a quantized kernel."""
    return any(
        is_quantized_kernel(leaf) for leaf in jax.tree.leaves(params, is_leaf=is_quantized_kernel)
    )


def dequantized(params, dtype: Any):
    """``params`` with every quantized kernel back in ``dtype`` (values x scale); what the
    denoiser's module applies. Other leaves unchanged; a tree without quantized leaves is
    returned as it is."""
    import qwix

    if not is_quantized(params):
        return params
    return jax.tree.map(
        lambda leaf: qwix.dequantize(leaf).astype(dtype) if is_quantized_kernel(leaf) else leaf,
        params,
        is_leaf=is_quantized_kernel,
    )


def for_denoiser(params, quantized_products: bool, dtype: Any):
    """The weights a denoiser's module takes: quantized kernels as they are when its products
    run quantized (``int8`` / ``fp8``), else dequantized to ``dtype`` (:func:`dequantized`)."""
    return params if quantized_products else dequantized(params, dtype)


def weight_bytes(params) -> int:
    """Bytes of the arrays of ``params`` (quantized kernels: values and scales)."""
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(params))


# --- quantized products (compute.quantization=int8 / fp8), called by jaxcore.models.layers ---


def as_dtype(array, dtype: Any):
    """``array`` in ``dtype``, or a quantized kernel as it is (its product runs quantized)."""
    return array if is_quantized_kernel(array) else array.astype(dtype)


def reshape_kernel(kernel, shape: tuple[int, ...]):
    """``kernel.reshape(shape)``; a quantized kernel keeps its last axis (the one with the
    scales)."""
    import qwix

    if not is_quantized_kernel(kernel):
        return kernel.reshape(shape)
    if shape[-1] != kernel.shape[-1]:
        raise ValueError(f"reshape_kernel keeps the output axis: {kernel.shape} -> {shape}")
    scale = kernel.scale.reshape((1,) * (len(shape) - 1) + shape[-1:])
    return qwix.QArray(kernel.qvalue.reshape(shape), scale, None, kernel.qtype)


def _activations(x: jax.Array, qtype, contracting) -> Any:
    """``x`` quantized in ``qtype``, absmax with one float32 scale per element of its
    non-contracting axes (per token)."""
    import qwix

    rows = [axis for axis in range(x.ndim) if axis not in contracting]
    return qwix.quantize(x, qtype, channelwise_axes=rows, scale_dtype=jnp.float32)


def dot_general(x: jax.Array, kernel, dimensions) -> jax.Array:
    """``jax.lax.dot_general(x, kernel, dimensions)`` with ``kernel`` quantized: ``x``
    quantized per row as the kernel is, the product on the quantized values, both scales
    after; the result in ``x``'s dtype."""
    import qwix

    (x_contracting, _), _ = dimensions
    qx = _activations(x, kernel.qtype, x_contracting)
    out = qwix.dot_general(qx, kernel, dimensions, preferred_element_type=jnp.float32)
    return out.astype(x.dtype)


def einsum(spec: str, x: jax.Array, kernel) -> jax.Array:
    """``jnp.einsum(spec, x, kernel)`` (two operands) with ``kernel`` quantized, as
    :func:`dot_general`."""
    import qwix

    inputs, output = spec.replace(" ", "").split("->")
    x_letters, kernel_letters = inputs.split(",")
    contracting = [i for i, c in enumerate(x_letters) if c in kernel_letters and c not in output]
    qx = _activations(x, kernel.qtype, contracting)
    out = qwix.einsum(spec, qx, kernel, preferred_element_type=jnp.float32)
    return out.astype(x.dtype)


# --- quantized weights as tensors (the cache generate keeps, stages.generate.quantized_cache) ---


def _name(path) -> str:
    return "/".join(str(getattr(k, "key", k)) for k in path)


def to_tensors(params) -> dict[str, Any]:
    """``{name: array}`` of a (quantized) parameter tree: a quantized kernel as
    ``<path>.qvalue`` and ``<path>.scale``, any other leaf as ``<path>`` (names ``/``-joined).
    The arrays stay where they are (the caller fetches them)."""
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(params, is_leaf=is_quantized_kernel):
        name = _name(path)
        if is_quantized_kernel(leaf):
            out[f"{name}.qvalue"], out[f"{name}.scale"] = leaf.qvalue, leaf.scale
        else:
            out[name] = leaf
    return out


def from_tensors(get, abstract_quantized_params):
    """The tree :func:`to_tensors` wrote, read by ``get(name, ShapeDtypeStruct) -> array``
    (which places it) in the structure, dtypes and shardings of ``abstract_quantized_params``
    (:func:`abstract_quantized` of the model's sharded abstract parameters)."""
    import qwix

    def one(path, leaf):
        name = _name(path)
        if is_quantized_kernel(leaf):
            values = get(f"{name}.qvalue", leaf.qvalue)
            return qwix.QArray(values, get(f"{name}.scale", leaf.scale), None, leaf.qtype)
        return get(name, leaf)

    return jax.tree_util.tree_map_with_path(
        one, abstract_quantized_params, is_leaf=is_quantized_kernel
    )
