"""Dtype facts the kernels and the models share (this module imports nothing from jaxcore, so
both can use it without an import cycle)."""

from __future__ import annotations

import jax.numpy as jnp

HALF_PRECISION = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def is_half_precision(dtype) -> bool:
    """bfloat16 or float16: the dtypes whose products accumulate in float32 (torch's GEMMs, the
    TPU's MXU) and which XLA CPU multiplies on AMX / AVX512-BF16 only as a plain product."""
    return jnp.dtype(dtype) in HALF_PRECISION
