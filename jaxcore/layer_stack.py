"""A model's repeated blocks' parameters held as stacks, for training with ``compute.scan_layers``.

Checkpoints, LoRA and the sharding rules name a block's parameters per layer (``blocks_0``,
``blocks_1``, ...). Scanned (:func:`jaxcore.compute.run_blocks`), the model stacks them along a
new leading axis in every call, so the gradient comes back per layer and the optimizer updates
each layer's leaves apart: the train step's program still grows with depth. A train run whose
state is in the *stacked* layout (``blocks_stacked``: every leaf ``[num_layers, ...]``) hands the
model its stacks directly (``run_blocks`` reads them), and the optimizer updates one leaf per
kind of parameter, whatever the depth: the program is the same for 8 layers and for 40.

:class:`LayerStack` converts a tree between the two layouts, for arrays, ShapeDtypeStructs and
NamedShardings alike (a stacked leaf's sharding is the per-layer one with an unsharded leading
axis), and optimizer states (every subtree shaped like the parameters). The train stage keeps
its state stacked and converts at its edges only: checkpoints stay in the per-layer layout, so
a run resumes with or without ``scan_layers`` and every consumer reads them as before.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

STACKED_SUFFIX = "_stacked"


def stacked_key(prefix: str) -> str:
    """The params key of the stack of blocks ``<prefix>_0``, ``<prefix>_1``, ..."""
    return prefix + STACKED_SUFFIX


def split_block_name(name: str) -> tuple[str, int]:
    """(prefix, index) of a block's name: ``"blocks_3"`` -> ``("blocks", 3)``."""
    match = re.fullmatch(r"(.+)_(\d+)", name)
    if match is None:
        raise ValueError(f"{name!r} is not a numbered block name (<prefix>_<index>)")
    return match.group(1), int(match.group(2))


def _join(leaves):
    """One stacked leaf from the per-layer ones (arrays, ShapeDtypeStructs or shardings)."""
    first = leaves[0]
    if isinstance(first, NamedSharding):
        return NamedSharding(first.mesh, PartitionSpec(None, *first.spec))
    if isinstance(first, jax.ShapeDtypeStruct):
        sharding = None if first.sharding is None else _join([first.sharding])
        return jax.ShapeDtypeStruct((len(leaves), *first.shape), first.dtype, sharding=sharding)
    return jnp.stack(leaves)


def _take(leaf, index: int):
    """Layer ``index`` of a stacked leaf (arrays, ShapeDtypeStructs or shardings)."""
    if isinstance(leaf, NamedSharding):
        return NamedSharding(leaf.mesh, PartitionSpec(*tuple(leaf.spec)[1:]))
    if isinstance(leaf, jax.ShapeDtypeStruct):
        sharding = None if leaf.sharding is None else _take(leaf.sharding, index)
        return jax.ShapeDtypeStruct(leaf.shape[1:], leaf.dtype, sharding=sharding)
    return leaf[index]


@dataclasses.dataclass(frozen=True)
class LayerStack:
    """The groups of equal blocks a model scans: ``(prefix, number of blocks)`` each."""

    groups: tuple[tuple[str, int], ...]

    @classmethod
    def of(cls, module, params: Mapping) -> LayerStack | None:
        """The stacks ``module`` reads when it scans its blocks (``scan_layers``), counted in
        ``params`` (per-layer layout); None for a module that does not scan."""
        if not getattr(module, "scan_layers", False):
            return None
        groups = []
        for prefix in getattr(type(module), "scanned_blocks", ()):
            count = sum(1 for key in params if re.fullmatch(rf"{re.escape(prefix)}_\d+", key))
            if count:
                groups.append((prefix, count))
        return cls(tuple(groups)) if groups else None

    def stack(self, params: Mapping) -> dict:
        """``params`` with each group's blocks replaced by one stack of them."""
        out = dict(params)
        for prefix, count in self.groups:
            members = [out.pop(f"{prefix}_{i}") for i in range(count)]
            out[stacked_key(prefix)] = jax.tree.map(lambda *leaves: _join(leaves), *members)
        return out

    def unstack(self, params: Mapping) -> dict:
        """``params`` with each stack split back into its per-layer blocks."""
        out = dict(params)
        for prefix, count in self.groups:
            stacked = out.pop(stacked_key(prefix))
            for i in range(count):
                out[f"{prefix}_{i}"] = jax.tree.map(lambda leaf, i=i: _take(leaf, i), stacked)
        return out

    def stack_state(self, state, like):
        """An optimizer state with every subtree shaped like ``like`` (the per-layer params)
        stacked; counters and other leaves as they are."""
        return _map_param_trees(self.stack, state, jax.tree.structure(like))

    def unstack_state(self, state, like):
        """The inverse of :meth:`stack_state`; ``like``: the stacked params."""
        return _map_param_trees(self.unstack, state, jax.tree.structure(like))


def _map_param_trees(fn: Callable, tree, structure):
    """``fn`` applied to each subtree of ``tree`` (a parameter dict) whose structure is
    ``structure``; everything else kept."""

    def is_params(node) -> bool:
        return isinstance(node, Mapping) and jax.tree.structure(node) == structure

    return jax.tree.map(lambda node: fn(node) if is_params(node) else node, tree, is_leaf=is_params)
