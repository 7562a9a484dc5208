"""Merging LoRA layers into a denoiser's parameters, through its family's weight map.

A :class:`~jaxcore.lora.base.LoraLayer` is a delta of a torch ``Linear`` weight ``[out, in]``
named by its diffusers module. The family's ``weight_map`` already says where every diffusers
weight lives in our parameters and how it is laid out (``transform``: transposes, reshapes for
fused or split layers), so the delta goes through the same transform and is added to that
parameter: nothing LoRA-specific is written per model.

:class:`LoraMerger` keeps the base parameters untouched and returns merged copies, so switching
LoRA sets between prompt groups re-merges from the base (no reload from disk), the merged
parameters have the base's shapes, dtypes and shardings (no recompilation), and "un-merging"
returns the base parameters bit for bit.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxcore import weights
from jaxcore.lora.base import (
    Converted,
    LoraError,
    apply_peft_config,
    file_sha256,
    lora_metadata,
    read_lora_file,
    resolve_lora_file,
)

log = logging.getLogger(__name__)

ParamPath = tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class LoadedLora:
    """One LoRA file converted for a denoiser, and what it is called in errors and manifests."""

    name: str  # the path the user gave
    checksum: str  # sha256 of the file
    converted: Converted


def load_lora(source: str, family, denoiser_config) -> LoadedLora:
    """Read and convert one LoRA for a denoiser of ``family`` (errors name ``source``)."""
    path = resolve_lora_file(source)
    state = read_lora_file(path)
    where = f"LoRA {source}"
    converted = family.lora_to_diffusers(state, denoiser_config, where=where)
    peft_config = lora_metadata(path, family.denoiser_component)
    if peft_config is not None:  # a diffusers-saved file: its alphas live in the header
        converted = apply_peft_config(converted, peft_config, where)
    return LoadedLora(source, file_sha256(path), converted)


def _module_index(weight_map: Mapping) -> dict[str, tuple[ParamPath, object]]:
    """diffusers weight key -> (flax path, transform), from the family's weight map."""
    return {key: (path, transform) for path, (key, transform) in weight_map.items()}


def _get(tree: Mapping, path: ParamPath):
    for part in path:
        tree = tree[part]
    return tree


def _set(tree: dict, path: ParamPath, value) -> dict:
    """A copy of ``tree`` with ``path`` replaced (only the dicts on the path are copied)."""
    if len(path) == 1:
        return {**tree, path[0]: value}
    return {**tree, path[0]: _set(tree[path[0]], path[1:], value)}


def _torch_shape(transform, shape) -> tuple[int, ...]:
    """The diffusers (torch) shape of a parameter of our ``shape`` under ``transform``
    (shapes only: nothing the size of the parameter is allocated)."""
    inverse = getattr(transform, "inverse", None) or weights.INVERSE_TRANSFORMS.get(transform)
    if inverse is None:
        return tuple(shape)
    return tuple(jax.eval_shape(inverse, jax.ShapeDtypeStruct(tuple(shape), jnp.float32)).shape)


@jax.jit
def _add(param: jax.Array, delta: jax.Array) -> jax.Array:
    """param + delta in float32, cast back to the parameter's dtype (sharding kept)."""
    return (param.astype(jnp.float32) + delta).astype(param.dtype)


class LoraMerger:
    """Base parameters of one denoiser, and merged copies for sets of LoRAs."""

    def __init__(self, base_params: Mapping, weight_map: Mapping):
        self.base = base_params
        self._index = _module_index(weight_map)

    def plan(
        self, loras: Sequence[tuple[LoadedLora, float]], *, strict: bool = True
    ) -> dict[ParamPath, list[tuple[object, float, object]]]:
        """{flax param path: [(layer, scale, transform)]} of ``(lora, scale)`` pairs, checked
        without computing a delta (so every set can be checked before anything renders).

        ``strict``: a file key that names no layer of the denoiser is an error naming the key
        and the file; otherwise a warning with the count. A layer whose shape does not fit its
        parameter (a LoRA for another model) is always an error naming both.
        """
        out: dict[ParamPath, list] = {}
        for lora, scale in loras:
            unmatched = list(lora.converted.unmatched)
            for module, layer in lora.converted.layers.items():
                key = f"{module}.weight"
                if key not in self._index:
                    unmatched.append(module)
                    continue
                path, transform = self._index[key]
                expected = _torch_shape(transform, _get(self.base, path).shape)
                got = layer.torch_shape
                if got != expected:
                    raise LoraError(
                        f"LoRA {lora.name}: {module} is {list(got)} (rank {layer.rank}), but "
                        f"the model's {key} is {list(expected)} (a LoRA for another model?)"
                    )
                out.setdefault(path, []).append((layer, scale, transform))
            if unmatched:
                shown = ", ".join(unmatched[:6]) + (
                    f" and {len(unmatched) - 6} more" if len(unmatched) > 6 else ""
                )
                message = f"LoRA {lora.name}: {len(unmatched)} key(s) match no layer: {shown}"
                if strict:
                    raise LoraError(message + " (set lora_strict=false to skip them)")
                log.warning("%s; skipped (lora_strict=false)", message)
        return out

    def merged(self, loras: Sequence[tuple[LoadedLora, float]], *, strict: bool = True):
        """A copy of the base parameters with every LoRA of ``loras`` added (scaled).

        One parameter at a time: its summed delta is computed on the host in float32, put on
        the parameter's sharding and added there, so no full set of deltas is ever held.
        """
        params = self.base
        for path, items in self.plan(loras, strict=strict).items():
            delta = sum(
                np.asarray(transform(np.float32(scale) * layer.delta()), np.float32)
                for layer, scale, transform in items
            )
            param = _get(self.base, path)
            placed = jax.device_put(delta, getattr(param, "sharding", None))
            params = _set(params, path, _add(param, placed))
        return params
