"""Stable Diffusion / SDXL UNet LoRA files -> :class:`~jaxcore.lora.base.Converted`.

Key layouts, each key placed on its own (a file may mix them):

- ``diffusers`` (PEFT): ``unet.down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q
  .lora_A.weight`` (``unet.`` may be missing), as ``StableDiffusion(XL)Pipeline.save_lora_weights``
  writes them; the older attention-processor names (``...attn1.processor.to_q_lora.down.weight``,
  ``to_out_lora`` = ``to_out.0``) too.
- ``kohya`` (sd-scripts, most hub LoRAs): ``lora_unet_<module with _ for .>.lora_down.weight``
  with ``.alpha``; SD 1.x/2.x files use diffusers' module names, SDXL files the original
  (SGM / LDM) block names ``input_blocks.4.1``, ``middle_block.1``, ``output_blocks.2.1``, mapped
  here to ``down_blocks.1.attentions.0``, ``mid_block.attentions.0``, ``up_blocks.0.attentions.2``
  (and resnets, samplers, ``conv_in``, embeddings: :func:`diffusers_to_sgm`) from the UNet's
  ``layers_per_block`` (diffusers' ``_maybe_map_sgm_blocks_to_diffusers``).

Scale per layer: ``alpha / rank`` when the file gives an alpha, else 1 (diffusers' loading).
Linear layers (attention projections, feed-forward, linear ``proj_in``/``proj_out``, time
embeddings) and convolutions (resnets' ``conv1``/``conv2``/``conv_shortcut``, down/upsamplers,
``conv_in``/``conv_out``, 1x1-conv ``proj_in`` of SD 1.x: LoCon / PEFT ``Conv2d`` LoRAs, as the
LCM-LoRA, SDXL-Lightning and Hyper-SD distillation LoRAs carry them) take a LoRA, in diffusers
names and in kohya's spelling of either naming (SDXL files: the SGM names, resnets'
``input_blocks.1.0.in_layers.2`` too). What has no place — text-encoder LoRAs (``lora_te*``,
``text_encoder.``), norms, DoRA magnitudes — is returned in ``unmatched``, never silently
dropped (``lora_strict=false`` skips them with a warning). Reference: diffusers 0.42
``StableDiffusionLoraLoaderMixin`` / ``lora_conversion_utils._convert_non_diffusers_lora_to_diffusers``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from jaxcore.lora.base import (
    Converted,
    LoraError,
    LoraLayer,
    alpha_scale,
    conv_down_factor,
    linear_factor,
)

if TYPE_CHECKING:
    from jaxcore.models.unet_2d_condition import UNet2DConditionConfig

DIFFUSERS, KOHYA = "diffusers", "kohya"

_PARTS = {
    "lora_A.weight": "down",
    "lora_B.weight": "up",
    "lora_down.weight": "down",
    "lora_up.weight": "up",
    "lora.down.weight": "down",
    "lora.up.weight": "up",
    "alpha": "alpha",
}
# the attention-processor names of older diffusers LoRA files
_PROCESSOR = re.compile(r"\.processor\.(to_q|to_k|to_v|to_out)_lora\.(down|up)\.weight$")


def lora_modules(config: UNet2DConditionConfig) -> dict[str, int]:
    """{diffusers name: 2 (Linear) or 4 (Conv2d)} of the UNet's layers a LoRA may update: the
    weights whose torch shape is 2-D or 4-D."""
    from flax.core import meta

    from jaxcore.lora.merge import _torch_shape
    from jaxcore.models import unet_2d_condition as unet

    params = meta.unbox(unet.abstract_params(unet.UNet2DConditionModel(config)))
    names = {}
    for path, (key, transform) in unet.weight_map(config).items():
        leaf = params
        for part in path:
            leaf = leaf[part]
        rank = len(_torch_shape(transform, leaf.shape))
        if key.endswith(".weight") and rank in (2, 4):
            names[key.removesuffix(".weight")] = rank
    return names


class _Locator:
    """File key -> (format, diffusers module, part), or None."""

    def __init__(self, config: UNet2DConditionConfig):
        self.modules = lora_modules(config)
        self.kohya = {name.replace(".", "_"): name for name in self.modules}
        # SGM names of every layer, by their kohya spelling
        self.sgm = {}
        for name in self.modules:
            sgm = diffusers_to_sgm(name, config)
            if sgm is not None:
                self.sgm[sgm.replace(".", "_")] = name

    def __call__(self, key: str) -> tuple[str, str, str] | None:
        processor = _PROCESSOR.search(key)
        if processor:
            projection = "to_out.0" if processor.group(1) == "to_out" else processor.group(1)
            module = key[: processor.start()].removeprefix("unet.") + f".{projection}"
            return (DIFFUSERS, module, processor.group(2)) if module in self.modules else None
        for suffix, part in _PARTS.items():
            if key.endswith(f".{suffix}"):
                return self._place(key[: -len(suffix) - 1], part)
        return None

    def _place(self, module: str, part: str) -> tuple[str, str, str] | None:
        if module.startswith("lora_unet_"):
            flat = module.removeprefix("lora_unet_")
            name = self.kohya.get(flat) or self.sgm.get(flat)
            return None if name is None else (KOHYA, name, part)
        name = module.removeprefix("unet.")
        return (DIFFUSERS, name, part) if name in self.modules else None


# diffusers ResnetBlock2D parts -> the SGM ResBlock's
_SGM_RESNET = {
    "conv1": "in_layers.2",
    "conv2": "out_layers.3",
    "time_emb_proj": "emb_layers.1",
    "conv_shortcut": "skip_connection",
}
_SGM_TOP = {
    "conv_in": "input_blocks.0.0",
    "conv_out": "out.2",
    "time_embedding.linear_1": "time_embed.0",
    "time_embedding.linear_2": "time_embed.2",
    "add_embedding.linear_1": "label_emb.0.0",
    "add_embedding.linear_2": "label_emb.0.2",
}


def diffusers_to_sgm(name: str, config: UNet2DConditionConfig) -> str | None:
    """The SGM / LDM UNet name (what kohya SDXL files spell with ``_``) of a diffusers UNet
    module, as diffusers' ``_maybe_map_sgm_blocks_to_diffusers`` and ``_convert_unet_lora_key``
    read them backwards: ``down_blocks.L.{resnets,attentions}.J`` ->
    ``input_blocks.{1 + L * (lpb + 1) + J}.{0,1}``, its downsampler ->
    ``input_blocks.{1 + L * (lpb + 1) + lpb}.0.op``, ``mid_block`` -> ``middle_block.{0,1,2}``,
    ``up_blocks.L.{resnets,attentions}.J`` -> ``output_blocks.{L * (lpb + 1) + J}.{0,1}``, its
    upsampler -> the level's last output block, after its attention when it has one; None for
    what has no SGM name."""
    lpb = config.layers_per_block
    lpb = lpb if isinstance(lpb, int) else int(lpb[0])
    per = lpb + 1
    if name in _SGM_TOP:
        return _SGM_TOP[name]
    match = re.match(r"(down|up)_blocks\.(\d+)\.(resnets|attentions)\.(\d+)\.(.+)$", name)
    if match:
        side, level, kind, within, rest = match.groups()
        index = int(level) * per + int(within) + (1 if side == "down" else 0)
        prefix = "input_blocks" if side == "down" else "output_blocks"
        return _sgm_part(f"{prefix}.{index}", kind, rest)
    match = re.match(r"mid_block\.(resnets|attentions)\.(\d+)\.(.+)$", name)
    if match:
        kind, within, rest = match.groups()
        index = 1 if kind == "attentions" else 2 * int(within)
        return _sgm_part(f"middle_block.{index}", kind, rest)
    match = re.match(r"down_blocks\.(\d+)\.downsamplers\.0\.conv$", name)
    if match:
        return f"input_blocks.{1 + int(match.group(1)) * per + lpb}.0.op"
    match = re.match(r"up_blocks\.(\d+)\.upsamplers\.0\.conv$", name)
    if match:
        level = int(match.group(1))
        after = 2 if config.up_block_types[level].startswith("CrossAttn") else 1
        return f"output_blocks.{level * per + lpb}.{after}.conv"
    return None


def _sgm_part(block: str, kind: str, rest: str) -> str | None:
    if kind == "attentions":
        return f"{block}.1.{rest}" if not block.startswith("middle") else f"{block}.{rest}"
    sgm = _SGM_RESNET.get(rest)
    if sgm is None:
        return None
    return f"{block}.0.{sgm}" if not block.startswith("middle") else f"{block}.{sgm}"


def to_diffusers(
    state_dict: Mapping[str, np.ndarray], config: UNet2DConditionConfig, where: str
) -> Converted:
    """A UNet LoRA file's tensors -> LoRA layers by diffusers module name; keys no rule
    places are returned in ``unmatched``; a malformed layer is a LoraError naming the key."""
    locate = _Locator(config)
    modules: dict[str, dict[str, tuple[str, np.ndarray]]] = {}
    formats: set[str] = set()
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
        formats.add(fmt)
    layers = {}
    for module, parts in modules.items():
        if "down" not in parts or "up" not in parts:
            if set(parts) == {"alpha"}:
                unmatched.append(parts["alpha"][0])
                continue
            have = next(iter(parts.values()))[0]
            raise LoraError(f"{where}: {have} has no matching down/up factor")
        (down_key, down), (up_key, up) = parts["down"], parts["up"]
        conv = locate.modules[module] == 4
        down = (conv_down_factor if conv else linear_factor)(down_key, down, where)
        up = linear_factor(up_key, up, where)
        if up.shape[1] != down.shape[0]:
            raise LoraError(
                f"{where}: rank mismatch: {down_key} is {list(down.shape)} but {up_key} is "
                f"{list(up.shape)}"
            )
        alpha = parts["alpha"][1] if "alpha" in parts else None
        layers[module] = LoraLayer(down=down, up=up, scale=alpha_scale(alpha, down.shape[0]))
    return Converted(layers, tuple(sorted(unmatched)), "+".join(sorted(formats)) or "none")
