"""Matrix products in a form XLA CPU runs fast: the left operand contracted over its last axis.

XLA CPU hands a dot to YNNPACK (AMX / AVX512-BF16 in bf16) when its left operand is contracted
over its last axis (``[M, K] @ [K, N]``, and ``[M, K] @ [N, K]^T``). One whose left operand is
contracted over its first axis (``x^T dy``, ``ds^T k``) runs in Eigen, at about half the rate in
float32, and in bf16 only after XLA upcasts both operands to float32: 2.86 against 0.57 ms at
1024 x 512 x 512. Writing the transpose out does not help by itself: XLA folds a plain
transpose into the consuming dot's dimension numbers, and first sinks it through elementwise
operations (``x.T * s``, ``x.T + y.T`` and a reduce_precision were all folded back, as was an
optimization_barrier, which XLA CPU expands before it simplifies). :func:`transposed_copy`
writes a copy XLA keeps.

A caution these copies must respect: XLA CPU decides whether to upcast a bf16 product before it
simplifies, and fails at run time (``Unsupported element type for DotThunk``) on a bf16
product that was left as is and later rearranged (a transpose of its result folded into it).
So a product fed by these copies must not have its result transposed either: route such a
result through :func:`transposed_copy` too (tests/stages/test_mixed_precision.py compiles
every family's bf16 gradient).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def transposed_copy(x: jax.Array) -> jax.Array:
    """``x`` with its last two axes swapped: on CPU an array in memory
    (:func:`materialised_transpose`), elsewhere a plain transpose (which folds into the product
    that reads it, as the platform's own kernels want)."""
    return jax.lax.platform_dependent(x, cpu=materialised_transpose, default=_swap_last_axes)


def materialised_transpose(x: jax.Array) -> jax.Array:
    """``x`` with its last two axes swapped, written by a one-trip while loop whose trip count
    XLA cannot evaluate (a flag the body clears), so the copy survives to the product that
    reads it: one trip, the copy, no other work. If a later XLA sees through it, the product is
    the folded one again: slower, never different (tests/jaxcore/test_layers.py and
    tests/jaxcore/test_attention.py check that the compiled products stay bf16)."""

    def copy_once(carry):
        _, source, _ = carry
        return jnp.bool_(False), source, _swap_last_axes(source)

    start = (jnp.bool_(True), x, jnp.zeros(transposed_shape(x.shape), x.dtype))
    return jax.lax.while_loop(lambda carry: carry[0], copy_once, start)[2]


def transposed_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """``shape`` with its last two axes swapped: that of a :func:`transposed_copy`."""
    return (*shape[:-2], shape[-1], shape[-2])


def _swap_last_axes(x: jax.Array) -> jax.Array:
    return jnp.swapaxes(x, -1, -2)
