"""LTX-Video LoRA files -> :class:`~jaxcore.lora.base.Converted` (diffusers module names).

Two key layouts name the Linear layers of ``LTXVideoTransformer3DModel``; every key is placed
on its own (a file may mix them), by its prefix:

- ``diffusers``: diffusers/PEFT names, ``transformer.transformer_blocks.0.attn1.to_q.lora_A.weight``
  (the ``transformer.`` prefix may be missing), as ``LTXPipeline.save_lora_weights`` writes
  them.
- ``comfyui``: the original LTX-Video names under ``diffusion_model.`` (LTX-Video-Trainer,
  ComfyUI), renamed as diffusers renames the original checkpoint
  (``convert_ltx_transformer_checkpoint_to_diffusers``): ``patchify_proj`` -> ``proj_in``,
  ``adaln_single`` -> ``time_embed`` (``adaln_single.emb.timestep_embedder.linear_1``,
  ``adaln_single.linear``); ``caption_projection.linear_1/2``, the blocks'
  ``attn1/attn2.to_q/to_k/to_v/to_out.0`` and ``ff.net.0.proj`` / ``ff.net.2`` and
  ``proj_out`` are named alike in both. The diffusers names are accepted under this prefix too
  (diffusers' converter only swaps the prefix), and the original names without one.

Per layer: ``lora_A``/``lora_down`` [r, in] with ``lora_B``/``lora_up`` [out, r] and an
optional ``.alpha`` (scale ``alpha / r``, else 1, as diffusers loads files without alphas);
a factor saved as a 1x1 convolution (``[r, in, 1, 1]``) is read as the matrix it is. The PEFT
config of a diffusers-saved file's header is applied by :func:`jaxcore.lora.merge.load_lora`.

What has no Linear LoRA form here is returned in ``unmatched``, never dropped: text-encoder
LoRAs, unknown modules and blocks the model lacks, norms (``q_norm`` / ``norm_q``), bias
deltas (``lora_B.bias``, ``diff_b``), full deltas (``.diff``), DoRA magnitudes
(``dora_scale``), LoKr / LoHa tensors and an alpha without its pair.

Reference: diffusers 0.42 ``LTXVideoLoraLoaderMixin.lora_state_dict`` (loaders/lora_pipeline.py)
and ``_convert_non_diffusers_ltxv_lora_to_diffusers`` (loaders/lora_conversion_utils.py).
Where this module differs, and why:

- diffusers' LoRA converter swaps ``diffusion_model.`` for ``transformer.`` and renames
  nothing, so a LoRA on ``patchify_proj`` or ``adaln_single.*`` names no module of its model;
  here the original names are renamed as diffusers' single-file checkpoint loader renames them;
- ``.alpha`` keys are applied (``alpha / r``, as ComfyUI and kohya read them); diffusers' LTX
  loader refuses a file holding a key without ``lora`` in its name;
- ``dora_scale`` keys are reported in ``unmatched`` (diffusers drops them with a warning);
- keys without ``transformer.`` are taken (``load_lora_weights`` skips them);
- each key is placed on its own, so a file mixing layouts works (diffusers converts the whole
  file when any key starts with ``diffusion_model.``, and refuses it when not all do).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from jaxcore.lora.base import Converted, LoraError, paired_layer, split_part

if TYPE_CHECKING:
    from jaxcore.models.ltx_transformer import LTXVideoTransformerConfig

DIFFUSERS, COMFYUI = "diffusers", "comfyui"

# Linears of block N (the same name in the original model and in diffusers)
_BLOCK_LINEARS = (
    *(f"{attn}.{proj}" for attn in ("attn1", "attn2") for proj in ("to_q", "to_k", "to_v")),
    "attn1.to_out.0",
    "attn2.to_out.0",
    "ff.net.0.proj",
    "ff.net.2",
)
# original LTX-Video module -> diffusers module, outside the blocks
_TOP_LINEARS = {
    "patchify_proj": "proj_in",
    "adaln_single.emb.timestep_embedder.linear_1": "time_embed.emb.timestep_embedder.linear_1",
    "adaln_single.emb.timestep_embedder.linear_2": "time_embed.emb.timestep_embedder.linear_2",
    "adaln_single.linear": "time_embed.linear",
    "caption_projection.linear_1": "caption_projection.linear_1",
    "caption_projection.linear_2": "caption_projection.linear_2",
    "proj_out": "proj_out",
}

# key suffix -> which part of a layer it is
_PARTS = {
    "lora_A.weight": "down",
    "lora_down.weight": "down",
    "lora_B.weight": "up",
    "lora_up.weight": "up",
    "alpha": "alpha",
}


def linear_modules(config: LTXVideoTransformerConfig) -> dict[str, str]:
    """{original LTX-Video module name: diffusers module name} of every Linear of the model."""
    blocks = {
        f"transformer_blocks.{i}.{name}": f"transformer_blocks.{i}.{name}"
        for i in range(config.num_layers)
        for name in _BLOCK_LINEARS
    }
    return blocks | _TOP_LINEARS


class _Locator:
    """File key -> (format, diffusers module, part), or None for a key no rule places."""

    def __init__(self, config: LTXVideoTransformerConfig):
        self.original = linear_modules(config)
        self.diffusers = set(self.original.values())

    def __call__(self, key: str) -> tuple[str, str, str] | None:
        split = split_part(key, _PARTS)
        placed = None if split is None else self._module(split[0])
        return None if placed is None else (*placed, split[1])

    def _module(self, module: str) -> tuple[str, str] | None:
        if module.startswith("transformer."):
            name = module.removeprefix("transformer.")
            return (DIFFUSERS, name) if name in self.diffusers else None
        if module.startswith("diffusion_model."):
            name = module.removeprefix("diffusion_model.")
            name = self.original.get(name, name if name in self.diffusers else None)
            return None if name is None else (COMFYUI, name)
        if module in self.diffusers:
            return DIFFUSERS, module
        if module in self.original:
            return COMFYUI, self.original[module]
        return None


def to_diffusers(
    state_dict: Mapping[str, np.ndarray], config: LTXVideoTransformerConfig, where: str
) -> Converted:
    """An LTX-Video LoRA file's tensors -> LoRA layers by diffusers module name of ``config``'s
    model.

    Keys no rule places are returned in ``unmatched`` (sorted); a malformed layer (a down
    without its up, ranks that differ, a factor that is not a matrix, two keys for one part of
    a layer) is a :class:`LoraError` naming the key and ``where``.
    """
    locate = _Locator(config)
    modules: dict[str, dict[str, tuple[str, np.ndarray]]] = {}
    formats: dict[str, set[str]] = {}
    unmatched = []
    for key, value in state_dict.items():
        placed = locate(key)
        if placed is None:
            unmatched.append(key)
            continue
        fmt, module, part = placed
        parts = modules.setdefault(module, {})
        if part in parts:
            raise LoraError(f"{where}: {key} and {parts[part][0]} are the same layer {module}")
        parts[part] = (key, value)
        formats.setdefault(module, set()).add(fmt)

    layers = {}
    for module, parts in modules.items():
        layer = paired_layer(parts, where)
        if layer is None:  # an alpha alone
            unmatched.append(parts["alpha"][0])
            formats.pop(module)
        else:
            layers[module] = layer
    found = set().union(*formats.values()) if formats else set()
    return Converted(layers, tuple(sorted(unmatched)), "+".join(sorted(found)) or "none")
