"""Attention backends beyond the reference ``dot_product`` (named in ``jaxcore.attention.BACKENDS``).

- ``flash``: memory-efficient exact attention (cuDNN on GPU, splash on TPU, chunked online
  softmax elsewhere), sharded over batch/heads/query-sequence when given a mesh.
- ``ulysses``: sequence parallelism over ``context`` by all_to_all (sequence <-> heads).
- ``ring``: sequence parallelism over ``context`` by rotating k/v with ppermute.
- ``sharded``: what the three share: input checks, padding, mesh specs, the shard_map call.

All share ``fn(q, k, v, *, kv_mask=None, scale=None, mesh=None) -> out`` in ``[B, L, H, D]``
and accept ``block_sizes=BlockSizes(...)`` when called directly.
"""

from jaxcore.kernels.flash import BlockSizes, flash_attention
from jaxcore.kernels.ring import ring_attention
from jaxcore.kernels.ulysses import ulysses_attention

__all__ = ["BlockSizes", "flash_attention", "ring_attention", "ulysses_attention"]
