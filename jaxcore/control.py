"""ControlNets beside a denoiser: loading, per-prompt inputs, and their residuals in the loop.

diffusers' ControlNet pipelines (``StableDiffusionControlNetPipeline``,
``StableDiffusionXLControlNetPipeline``, ``StableDiffusionXLControlNetUnionPipeline``,
``FluxControlNetPipeline``) call one ControlNet (or several, whose residuals add up) before every
denoiser call and hand its residuals to the denoiser. Here:

- :class:`ControlNets` holds the loaded ControlNets (modules and weights) of a pipeline;
  :func:`load_controlnets` reads them from diffusers folders.
- :class:`ControlInput` is one prompt's inputs: a control image per ControlNet, conditioning
  scales, the guidance window (``control_guidance_start`` / ``end``), guess mode, union modes.
- :func:`conditioning` turns a batch's inputs into conditioning tensors that join the
  denoiser's (``control_image [B, K, 3, H, W]`` in [0, 1], per row and ControlNet scales and
  window, ``control_guess [B]``); the negative branch's scales are 0 in guess mode (diffusers
  runs the ControlNet on the conditional half only and adds zeros to the other).
- :func:`per_step` expands the window into a ``[B, steps, K]`` scale table once the step count
  is known (diffusers' ``controlnet_keep``, computed in float64 as Python computes it), and
  :func:`at_step` picks step i's column inside the jitted loop.
- :class:`Controlled` is the denoiser with its ControlNets, as the loop calls it: the family's
  ``apply`` sees it and adds the residuals (:func:`unet_residuals` for the UNet families).

Per-prompt settings are per row here where diffusers takes one per call: a bulk render batches
prompts with different scales, windows and guess modes into one program.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxcore import weights
from jaxcore.family_types import FamilyError

CONTROLNET, UNION = "ControlNetModel", "ControlNetUnionModel"
CONTROLNET_CLASSES = (CONTROLNET, UNION)
# conditioning names (the loop indexes CONTROL_SCALE by step, see at_step)
CONTROL_IMAGE = "control_image"
CONTROL_SCALE = "control_scale"
CONTROL_START = "control_start"
CONTROL_END = "control_end"
CONTROL_GUESS = "control_guess"
# the negative branch of a guess-mode row: no residuals at all (diffusers adds zeros there)
CONTROL_OFF = "control_off"
# union ControlNets: the types used ([B, num_control_type] 0/1) and each image's type [B, K]
CONTROL_TYPE = "control_type"
CONTROL_MODE = "control_mode"


@dataclasses.dataclass(frozen=True)
class ControlInput:
    """One prompt's ControlNet inputs, one entry per ControlNet (diffusers' lists)."""

    images: tuple  # PIL images
    scales: tuple[float, ...]
    starts: tuple[float, ...]
    ends: tuple[float, ...]
    guess_mode: bool = False
    # union ControlNets: the control type of each image (diffusers' control_mode); () = none
    modes: tuple[int, ...] = ()


@dataclasses.dataclass
class ControlNets:
    """A pipeline's ControlNets: flax modules, their weights, and where they were read."""

    modules: tuple
    params: tuple
    sources: tuple[str, ...]

    def __len__(self) -> int:
        return len(self.modules)

    @property
    def union(self) -> bool:
        """One ControlNetUnionModel: its images (one per control mode) vary per prompt."""
        from jaxcore.models import controlnet_union

        return isinstance(self.modules[0], controlnet_union.ControlNetUnionModel)

    @property
    def global_pool(self) -> bool:
        """diffusers reads ``global_pool_conditions`` of the first ControlNet only."""
        return bool(getattr(self.modules[0].config, "global_pool_conditions", False))


@dataclasses.dataclass(frozen=True)
class Controlled:
    """The denoiser and its ControlNets as one hashable thing the loop compiles; it reads like
    the denoiser (``config``, ``dtype``, ``param_dtype``). Its weights are
    ``{"denoiser": ..., "controlnets": (...)}``."""

    denoiser: Any
    controlnets: tuple

    @property
    def config(self):
        return self.denoiser.config

    @property
    def dtype(self):
        return self.denoiser.dtype

    @property
    def param_dtype(self):
        return self.denoiser.param_dtype


def controlled(denoiser, denoiser_params, nets: ControlNets | None):
    """``(module, params)`` the loop runs: the denoiser alone, or with its ControlNets."""
    if nets is None:
        return denoiser, denoiser_params
    module = Controlled(denoiser, tuple(nets.modules))
    return module, {"denoiser": denoiser_params, "controlnets": tuple(nets.params)}


# --- loading -------------------------------------------------------------------------------


def controlnet_folders(pipeline_dir: Path, index: Mapping) -> list[Path]:
    """The ControlNet folders a pipeline folder holds: ``controlnet`` (and, for diffusers'
    ``MultiControlNetModel``, ``controlnet_1``, ``controlnet_2``, ... as it saves them)."""
    entry = index.get("controlnet")
    if not entry or entry[0] is None:
        return []
    folders = [pipeline_dir / "controlnet"]
    if entry[1] == "MultiControlNetModel":
        k = 1
        while (pipeline_dir / f"controlnet_{k}").is_dir():
            folders.append(pipeline_dir / f"controlnet_{k}")
            k += 1
    return folders


def load_controlnets(folders: Sequence, kwargs: Mapping, mesh=None, rules=None) -> ControlNets:
    """ControlNets from diffusers ``ControlNetModel`` folders, with the denoiser's module
    keywords (dtype, attention, remat, ...)."""
    from jaxcore.models import controlnet, controlnet_union

    loaders = {
        CONTROLNET: controlnet.load_controlnet,
        # the fusion per sample: a render must not depend on its batch (controlnet_union)
        UNION: functools.partial(controlnet_union.load_controlnet_union, attend_across_batch=False),
    }
    modules, params = [], []
    for folder in folders:
        folder = Path(folder)
        try:
            config = weights.read_config(folder)
        except (OSError, ValueError) as err:
            raise FamilyError(f"controlnet {folder}: no readable config.json ({err})") from None
        name = config.get("_class_name")
        if name not in CONTROLNET_CLASSES:
            raise FamilyError(
                f"controlnet {folder}: _class_name {name!r} is not one of {CONTROLNET_CLASSES}"
            )
        if name == UNION and len(folders) > 1:
            raise FamilyError(
                f"controlnet {folder}: several union ControlNets (MultiControlNetUnionModel) "
                "are not supported; give one union ControlNet several control images instead"
            )
        try:
            module, p = loaders[name](folder, mesh=mesh, rules=rules, **kwargs)
        except (ValueError, weights.WeightsError) as err:
            raise FamilyError(f"controlnet {folder}: {err}") from None
        modules.append(module)
        params.append(p)
    return ControlNets(tuple(modules), tuple(params), tuple(str(f) for f in folders))


def check_against(nets: ControlNets, denoiser_config) -> None:
    """Each ControlNet must feed this denoiser: the same latent channels, text width and
    (SDXL) added embedding, and one residual per skip of the UNet."""
    for module, source in zip(nets.modules, nets.sources, strict=True):
        c = module.config
        for key in ("in_channels", "cross_attention_dim", "addition_embed_type"):
            if getattr(c, key) != getattr(denoiser_config, key):
                raise FamilyError(
                    f"controlnet {source}: {key}={getattr(c, key)!r} but the UNet has "
                    f"{getattr(denoiser_config, key)!r}"
                )
        if tuple(c.block_out_channels) != tuple(denoiser_config.block_out_channels) or tuple(
            c.resnets_per_level
        ) != tuple(denoiser_config.resnets_per_level):
            raise FamilyError(
                f"controlnet {source}: block_out_channels {list(c.block_out_channels)} / "
                f"layers_per_block do not match the UNet's "
                f"{list(denoiser_config.block_out_channels)}: its residuals would not fit"
            )


# --- per-prompt inputs -> conditioning -----------------------------------------------------


def prepare_image(image, height: int, width: int) -> np.ndarray:
    """diffusers' control image processor (``VaeImageProcessor(do_convert_rgb=True,
    do_normalize=False)``): resized to (height, width) with Lanczos, then RGB, in [0, 1];
    ``[3, H, W]`` float32."""
    from PIL import Image

    resized = image.resize((width, height), resample=Image.LANCZOS)
    if resized.mode != "RGB":
        resized = resized.convert("RGB")
    return np.transpose(np.asarray(resized, np.float32) / 255.0, (2, 0, 1))


def conditioning(
    inputs: Sequence[ControlInput], nets: ControlNets, height: int, width: int
) -> tuple[dict, dict]:
    """(conditional, negative) control tensors for a batch, one :class:`ControlInput` per row
    (see the module docstring)."""
    _check_counts(inputs, nets)
    images = np.stack(
        [np.stack([prepare_image(im, height, width) for im in given.images]) for given in inputs]
    )
    scales = np.asarray([given.scales for given in inputs], np.float64)
    guess = np.asarray([given.guess_mode or nets.global_pool for given in inputs])
    cond = {
        CONTROL_IMAGE: images,
        CONTROL_SCALE: scales,
        CONTROL_START: np.asarray([given.starts for given in inputs], np.float64),
        CONTROL_END: np.asarray([given.ends for given in inputs], np.float64),
        CONTROL_GUESS: guess,
        CONTROL_OFF: np.zeros_like(guess),
    }
    if nets.union:
        cond.update(_union_types(inputs, nets.modules[0].config.num_control_type))
    uncond = dict(cond)
    uncond[CONTROL_SCALE] = np.where(guess[:, None], 0.0, scales)
    uncond[CONTROL_OFF] = guess
    return cond, uncond


def _check_counts(inputs: Sequence[ControlInput], nets: ControlNets) -> None:
    """One image per ControlNet (a union ControlNet: one per control mode, the same count in
    a batch), a mode per image exactly for a union ControlNet."""
    for row, given in enumerate(inputs):
        if nets.union:
            if len(given.modes) != len(given.images) or len(given.images) != len(inputs[0].images):
                raise FamilyError(
                    f"row {row}: a union ControlNet takes one control_mode per control image "
                    f"(got {len(given.modes)} modes, {len(given.images)} images; a batch shares "
                    "the count)"
                )
        elif given.modes:
            raise FamilyError(f"row {row}: control_mode is for union ControlNets only")
        elif len(given.images) != len(nets):
            raise FamilyError(
                f"row {row}: {len(given.images)} control image(s) for {len(nets)} ControlNet(s)"
            )


def _union_types(inputs: Sequence[ControlInput], types: int) -> dict:
    """A union ControlNet's ``control_type`` (1 at each mode used) and ``control_mode``."""
    modes = np.asarray([given.modes for given in inputs], np.int32)
    if modes.min() < 0 or modes.max() >= types:
        raise FamilyError(f"control_mode must be in [0, {types}), got {sorted(set(modes.flat))}")
    used = np.zeros((len(inputs), types), np.float32)
    np.put_along_axis(used, modes, 1.0, axis=1)
    return {CONTROL_TYPE: used, CONTROL_MODE: modes}


def keep_table(starts: np.ndarray, ends: np.ndarray, steps: int) -> np.ndarray:
    """diffusers' ``controlnet_keep``: ``1 - (i / steps < start or (i + 1) / steps > end)`` per
    step, in float64 as Python evaluates it; ``[B, steps, K]``."""
    i = np.arange(steps, dtype=np.float64)[None, :, None]
    off = (i / steps < starts[:, None, :]) | ((i + 1) / steps > ends[:, None, :])
    return 1.0 - off.astype(np.float64)


def per_step(conditioning_: Mapping[str, Any], steps: int) -> dict:
    """The control scale as a per-step table ``[B, steps, K]`` float32 (scale x keep), the
    window's start and end dropped; anything else as is."""
    if CONTROL_SCALE not in conditioning_:
        return dict(conditioning_)
    out = {k: v for k, v in conditioning_.items() if k not in (CONTROL_START, CONTROL_END)}
    keep = keep_table(conditioning_[CONTROL_START], conditioning_[CONTROL_END], steps)
    scales = np.asarray(conditioning_[CONTROL_SCALE], np.float64)[:, None, :]
    out[CONTROL_SCALE] = (scales * keep).astype(np.float32)
    return out


def at_step(conditioning_: Mapping[str, Any], i) -> Mapping[str, Any]:
    """The conditioning of step ``i``: the control scale table's column (jittable)."""
    if CONTROL_SCALE not in conditioning_:
        return conditioning_
    out = dict(conditioning_)
    out[CONTROL_SCALE] = jax.lax.dynamic_index_in_dim(
        conditioning_[CONTROL_SCALE], i, axis=1, keepdims=False
    )
    return out


# --- residuals -----------------------------------------------------------------------------


def unet_residuals(module: Controlled, params, latents, timestep, context, added, conditioning_):
    """Every ControlNet's residuals at this step's scales, summed (diffusers'
    ``MultiControlNetModel``); ``context``: the text states the UNet attends to; ``added``:
    SDXL's ``(text_embeds, time_ids)`` or Nones."""
    dtype = module.dtype
    x, context = latents.astype(dtype), context.astype(dtype)
    c = conditioning_
    if CONTROL_MODE in c:  # one union ControlNet, all images at once
        (net,), (p,) = module.controlnets, params["controlnets"]
        down, mid = net.apply(
            {"params": p},
            *(x, timestep, context, c[CONTROL_IMAGE], c[CONTROL_TYPE], c[CONTROL_MODE]),
            *(c[CONTROL_SCALE], *added, c[CONTROL_GUESS]),
        )
        return _switched_off(list(down), mid, c[CONTROL_OFF])
    total_down = total_mid = None
    for k, (net, p) in enumerate(zip(module.controlnets, params["controlnets"], strict=True)):
        down, mid = net.apply(
            {"params": p},
            *(x, timestep, context, c[CONTROL_IMAGE][:, k], c[CONTROL_SCALE][:, k]),
            *(*added, c[CONTROL_GUESS]),
        )
        if total_mid is None:
            total_down, total_mid = list(down), mid
        else:
            total_down = [a + b for a, b in zip(total_down, down, strict=True)]
            total_mid = total_mid + mid
    return _switched_off(total_down, total_mid, c[CONTROL_OFF])


def _switched_off(down, mid, off_b):
    """Zero residuals on the rows ``off_b`` marks (the negative branch of guess mode)."""
    keep = (~off_b).astype(mid.dtype).reshape(-1, 1, 1, 1)
    return [d * keep for d in down], mid * keep
