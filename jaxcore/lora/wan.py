"""Wan 2.1 LoRA files -> :class:`~jaxcore.lora.base.Converted` (diffusers module names).

Three key layouts name the same Linear layers of the Wan transformer; every key is placed on
its own (a file may mix them), by its prefix:

- ``diffusers``: diffusers/PEFT names, ``transformer.blocks.0.attn1.to_q.lora_A.weight`` (the
  ``transformer.`` prefix may be missing), as ``WanPipeline.save_lora_weights`` writes them.
- ``comfyui``: the original Wan names under ``diffusion_model.`` (ComfyUI, AI-Toolkit,
  lightx2v / CausVid and most hub LoRAs): ``diffusion_model.blocks.0.self_attn.q.lora_down.weight``
  (``self_attn``/``cross_attn`` ``q k v o``, ``ffn.0``, ``ffn.2``, ``text_embedding.0/2``,
  ``time_embedding.0/2``, ``time_projection.1``, ``head.head``); the original names are also
  accepted without the prefix.
- ``musubi``: kohya's musubi-tuner, the original names with ``_`` for ``.`` under
  ``lora_unet_``: ``lora_unet_blocks_0_self_attn_q.lora_down.weight``.

Per layer: ``lora_A``/``lora_down`` [r, in] with ``lora_B``/``lora_up`` [out, r] and an
optional ``.alpha`` (scale ``alpha / r``, else 1, as diffusers loads files without alphas), and
``.diff``, a full ``[out, in]`` delta, kept exactly as a LoRA of rank ``min(out, in)`` with an
identity factor (a layer with both is one LoRA of the summed ranks). A factor saved as a 1x1
convolution (``[r, in, 1, 1]``) is read as the matrix it is.

What has no Linear LoRA form here is returned in ``unmatched``, never dropped: text-encoder
LoRAs, unknown modules and blocks the model lacks, the image-conditioning layers of Wan I2V
(``img_emb``, ``k_img``, ``v_img``), ``patch_embedding`` (a Conv3d), bias deltas (``diff_b``,
``lora_B.bias``), norm deltas and DoRA magnitudes (``dora_scale``).

Reference: diffusers 0.42 ``WanLoraLoaderMixin.lora_state_dict`` and
``_convert_non_diffusers_wan_lora_to_diffusers`` / ``_convert_musubi_wan_lora_to_diffusers``
(diffusers/loaders/lora_conversion_utils.py). Where this module differs, and why:

- alphas are applied on every layer; diffusers applies them on block layers only and raises on
  an alpha elsewhere (``time_projection``, ``head``, the embedders);
- a musubi file may omit layers or name layers outside the blocks (diffusers requires every
  block layer and nothing else);
- diffusers/PEFT keys without ``transformer.`` are taken (``load_lora_weights`` skips them
  with a warning; ``WanTransformer3DModel.load_lora_adapter(prefix=None)`` takes them);
- ``.diff`` of any Linear is applied (diffusers applies ``head.head.diff`` only and drops the
  others with a log line); it costs an identity factor of ``min(out, in)`` squared floats;
- bias deltas (``diff_b``, ``lora_B.bias``) and a PEFT Conv3d LoRA on ``patch_embedding`` are
  reported, not applied (diffusers applies them): a LoraLayer is a Linear weight's delta, and
  the merge goes through weight transforms for Linear weights;
- each key is placed on its own, so a file mixing layouts (or ``lora_A`` with ``lora_down``)
  works; diffusers picks one layout and one naming for the whole file.

Not read: the PEFT config diffusers keeps in a file's ``lora_adapter_metadata`` header (a
``lora_alpha`` other than the rank): such a file loads here at scale 1.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from jaxcore.lora.base import Converted, LoraError, LoraLayer, paired_layer, split_part

if TYPE_CHECKING:
    from jaxcore.models.wan_transformer import WanTransformerConfig

DIFFUSERS, COMFYUI, MUSUBI = "diffusers", "comfyui", "musubi"

# original Wan module -> diffusers module, inside block N and outside the blocks
_BLOCK_LINEARS = {
    "self_attn.q": "attn1.to_q",
    "self_attn.k": "attn1.to_k",
    "self_attn.v": "attn1.to_v",
    "self_attn.o": "attn1.to_out.0",
    "cross_attn.q": "attn2.to_q",
    "cross_attn.k": "attn2.to_k",
    "cross_attn.v": "attn2.to_v",
    "cross_attn.o": "attn2.to_out.0",
    "ffn.0": "ffn.net.0.proj",
    "ffn.2": "ffn.net.2",
}
_TOP_LINEARS = {
    "text_embedding.0": "condition_embedder.text_embedder.linear_1",
    "text_embedding.2": "condition_embedder.text_embedder.linear_2",
    "time_embedding.0": "condition_embedder.time_embedder.linear_1",
    "time_embedding.2": "condition_embedder.time_embedder.linear_2",
    "time_projection.1": "condition_embedder.time_proj",
    "head.head": "proj_out",
}

# key suffix -> which part of a layer it is
_PARTS = {
    "lora_A.weight": "down",
    "lora_down.weight": "down",
    "lora_B.weight": "up",
    "lora_up.weight": "up",
    "alpha": "alpha",
    "diff": "diff",
}


def linear_modules(config: WanTransformerConfig) -> dict[str, str]:
    """{original Wan module name: diffusers module name} of every Linear layer of the model."""
    names = {
        f"blocks.{i}.{ours}": f"blocks.{i}.{theirs}"
        for i in range(config.num_layers)
        for ours, theirs in _BLOCK_LINEARS.items()
    }
    return names | _TOP_LINEARS


class _Locator:
    """File key -> (format, diffusers module, part), or None for a key no rule places."""

    def __init__(self, config: WanTransformerConfig):
        self.original = linear_modules(config)
        self.diffusers = set(self.original.values())
        self.musubi = {name.replace(".", "_"): name for name in self.original}

    def __call__(self, key: str) -> tuple[str, str, str] | None:
        split = split_part(key, _PARTS)
        placed = None if split is None else self._module(split[0])
        return None if placed is None else (*placed, split[1])

    def _module(self, module: str) -> tuple[str, str] | None:
        if module.startswith("transformer."):
            name = module.removeprefix("transformer.")
            return (DIFFUSERS, name) if name in self.diffusers else None
        if module.startswith("diffusion_model."):
            name = self.original.get(module.removeprefix("diffusion_model."))
            return None if name is None else (COMFYUI, name)
        if module.startswith("lora_unet_"):
            original = self.musubi.get(module.removeprefix("lora_unet_"))
            return None if original is None else (MUSUBI, self.original[original])
        if module in self.diffusers:
            return DIFFUSERS, module
        if module in self.original:
            return COMFYUI, self.original[module]
        return None


def _identity_factor(delta: np.ndarray) -> LoraLayer:
    """A full ``[out, in]`` delta as a LoRA of rank ``min(out, in)``: ``I @ delta`` or
    ``delta @ I``, which reproduces the delta bit for bit."""
    out_features, in_features = delta.shape
    if out_features <= in_features:
        return LoraLayer(down=delta, up=np.eye(out_features, dtype=delta.dtype))
    return LoraLayer(down=np.eye(in_features, dtype=delta.dtype), up=delta)


def _concat(a: LoraLayer, b: LoraLayer) -> LoraLayer:
    """One LoRA whose delta is ``a.delta() + b.delta()`` (ranks stacked, scales folded into up)."""
    up = [np.float32(layer.scale) * np.asarray(layer.up, np.float32) for layer in (a, b)]
    down = [np.asarray(layer.down, np.float32) for layer in (a, b)]
    return LoraLayer(down=np.concatenate(down, axis=0), up=np.concatenate(up, axis=1))


def _layer(
    parts: Mapping[str, tuple[str, np.ndarray]], where: str
) -> tuple[LoraLayer | None, list[str]]:
    """The LoRA of one module from its parts {"down"|"up"|"alpha"|"diff": (key, value)}, and the
    keys it did not use (an alpha without a down/up pair)."""
    layer, unused = paired_layer(parts, where), []
    if layer is None and "alpha" in parts:
        unused.append(parts["alpha"][0])
    if "diff" in parts:
        diff_key, diff = parts["diff"]
        full = _identity_factor(np.asarray(diff))
        if layer is not None:
            if (layer.up.shape[0], layer.down.shape[1]) != diff.shape:
                raise LoraError(
                    f"{where}: {diff_key} is {list(diff.shape)} but the module's LoRA is "
                    f"[{layer.up.shape[0]}, {layer.down.shape[1]}]"
                )
            full = _concat(layer, full)
        layer = full
    return layer, unused


def to_diffusers(
    state_dict: Mapping[str, np.ndarray], config: WanTransformerConfig, where: str
) -> Converted:
    """A Wan LoRA file's tensors -> LoRA layers by diffusers module name of ``config``'s model.

    Keys no rule places are returned in ``unmatched`` (sorted); a malformed layer (a down
    without its up, ranks that differ, a factor that is not a matrix) is a :class:`LoraError`
    naming the key and ``where``.
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
        if part == "diff" and np.ndim(value) != 2:
            unmatched.append(key)  # a Linear's delta is [out, in]; anything else has no place
            continue
        parts = modules.setdefault(module, {})
        if part in parts:
            raise LoraError(f"{where}: {key} and {parts[part][0]} are the same layer {module}")
        parts[part] = (key, value)
        formats.setdefault(module, set()).add(fmt)

    layers = {}
    for module, parts in modules.items():
        layer, unused = _layer(parts, where)
        unmatched.extend(unused)
        if layer is None:  # an alpha alone
            formats.pop(module)
        else:
            layers[module] = layer
    found = set().union(*formats.values()) if formats else set()
    return Converted(layers, tuple(sorted(unmatched)), "+".join(sorted(found)) or "none")
