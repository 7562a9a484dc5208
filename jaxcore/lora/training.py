"""Trainable LoRA adapters on a frozen denoiser, and their diffusers/PEFT export.

The adapters live in diffusers' layout: for each targeted Linear (its diffusers module name,
e.g. ``transformer_blocks.0.attn.to_q``) a ``down`` ``[rank, in]`` (PEFT ``lora_A``) and an
``up`` ``[out, rank]`` (``lora_B``), in a tree nested by the module path. Inside the jitted
step :func:`merge_traced` adds ``scale * up @ down`` to the frozen base weight through the
family's weight-map transform (the same path as :mod:`jaxcore.lora.merge` for files), so one
code path serves any family. ``up`` starts at zero (PEFT's default): step 0 is the base model.

:func:`export_peft` writes what diffusers' ``load_lora_weights`` reads
(``transformer.<module>.lora_A.weight`` / ``lora_B.weight``), with the ``alpha / rank`` scale
folded into ``lora_B`` so diffusers' default scale of 1 reproduces our deltas.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxcore.lora.base import LoraError, LoraLayer


@dataclasses.dataclass(frozen=True)
class LoraTarget:
    """A Linear layer an adapter trains: where its weight lives in our parameters."""

    module: str  # diffusers module name
    path: tuple[str, ...]  # our param path of its weight
    transform: object  # diffusers weight layout -> ours (from the family's weight map)
    out_features: int
    in_features: int


def _matches(module: str, pattern: str) -> bool:
    """PEFT's ``target_modules`` rule: the name, or a dotted suffix of it, equals the entry."""
    return module == pattern or module.endswith("." + pattern)


def find_targets(
    weight_map: Mapping, abstract_params: Mapping, target_modules: Sequence[str]
) -> dict[str, LoraTarget]:
    """The Linear layers (2-D weights, ``.weight`` keys) whose names match ``target_modules``."""
    from jaxcore.lora.merge import _torch_shape

    out = {}
    for path, (key, transform) in weight_map.items():
        if not key.endswith(".weight"):
            continue
        module = key.removesuffix(".weight")
        if not any(_matches(module, p) for p in target_modules):
            continue
        leaf = abstract_params
        for part in path:
            leaf = leaf[part]
        shape = _torch_shape(transform, leaf.shape)
        if len(shape) != 2:
            continue  # a conv or a table, not a Linear
        out[module] = LoraTarget(module, tuple(path), transform, shape[0], shape[1])
    if not out:
        raise LoraError(f"lora.target_modules {list(target_modules)} match no Linear layer")
    return dict(sorted(out.items()))


def _nest(flat: Mapping[str, object]) -> dict:
    tree: dict = {}
    for module, value in flat.items():
        node = tree
        parts = module.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return tree


def _leaf(tree: Mapping, module: str):
    for part in module.split("."):
        tree = tree[part]
    return tree


def init_adapters(targets: Mapping[str, LoraTarget], rank: int, rng: jax.Array) -> dict:
    """``{module path...: {"down": [r, in], "up": [out, r]}}``: down ~ U(+-1/sqrt(in)) (PEFT's
    kaiming-uniform with a = sqrt(5)), up = 0 (so the adapted model starts as the base)."""
    keys = jax.random.split(rng, len(targets))
    flat = {}
    for key, (module, target) in zip(keys, targets.items(), strict=True):
        bound = 1.0 / math.sqrt(target.in_features)
        flat[module] = {
            "down": jax.random.uniform(key, (rank, target.in_features), jnp.float32, -bound, bound),
            "up": jnp.zeros((target.out_features, rank), jnp.float32),
        }
    return _nest(flat)


def merge_traced(base: Mapping, adapters: Mapping, targets: Mapping[str, LoraTarget], scale):
    """``base`` with ``scale * up @ down`` added at every target (traceable; used in the step)."""
    params = base
    for module, target in targets.items():
        adapter = _leaf(adapters, module)
        delta = target.transform(scale * (adapter["up"] @ adapter["down"]))
        params = _replace(params, target.path, lambda w, d=delta: _add(w, d))
    return params


def _add(weight: jax.Array, delta: jax.Array) -> jax.Array:
    return (weight.astype(jnp.float32) + delta.astype(jnp.float32)).astype(weight.dtype)


def _replace(tree: Mapping, path: tuple[str, ...], fn) -> dict:
    if len(path) == 1:
        return {**tree, path[0]: fn(tree[path[0]])}
    return {**tree, path[0]: _replace(tree[path[0]], path[1:], fn)}


def adapter_layers(adapters: Mapping, targets: Mapping[str, LoraTarget], scale: float):
    """The trained adapters as host :class:`LoraLayer` s (for merging and export)."""
    out = {}
    for module in targets:
        adapter = _leaf(adapters, module)
        out[module] = LoraLayer(
            down=np.asarray(jax.device_get(adapter["down"]), np.float32),
            up=np.asarray(jax.device_get(adapter["up"]), np.float32),
            scale=float(scale),
        )
    return out


def export_peft(layers: Mapping[str, LoraLayer], prefix: str) -> dict[str, np.ndarray]:
    """diffusers/PEFT tensors ``<prefix>.<module>.lora_A/B.weight`` (scale folded into B)."""
    out = {}
    for module, layer in layers.items():
        out[f"{prefix}.{module}.lora_A.weight"] = np.ascontiguousarray(layer.down, np.float32)
        up = np.asarray(layer.up, np.float32) * np.float32(layer.scale)
        out[f"{prefix}.{module}.lora_B.weight"] = np.ascontiguousarray(up)
    return out


def check_target_patterns(patterns: Sequence[str]) -> None:
    for pattern in patterns:
        if not pattern or not re.fullmatch(r"[A-Za-z0-9_.]+", pattern):
            raise ValueError(f"lora.target_modules: {pattern!r} is not a module name")
