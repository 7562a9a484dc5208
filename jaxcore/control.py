"""ControlNets beside a denoiser: loading, per-prompt inputs, and their residuals in the loop.

diffusers' ControlNet pipelines (``StableDiffusionControlNetPipeline``,
``StableDiffusionXLControlNetPipeline``, ``StableDiffusionXLControlNetUnionPipeline``,
``FluxControlNetPipeline``) call one ControlNet (or several, whose residuals add up) before every
denoiser call and hand its residuals to the denoiser. Here:

- :class:`ControlNets` holds the loaded ControlNets (modules and weights) of a pipeline
  (each family loads its own kind: ``jaxcore/families/*_control.py``).
- :class:`ControlInput` is one prompt's inputs: a control image per ControlNet, conditioning
  scales, the guidance window (``control_guidance_start`` / ``end``), guess mode, union modes.
- the family's ``control_conditioning`` turns a batch's inputs into conditioning tensors that join the
  denoiser's (``control_image [B, K, 3, H, W]`` in [0, 1], per row and ControlNet scales and
  window, ``control_guess [B]``); the negative branch's scales are 0 in guess mode (diffusers
  runs the ControlNet on the conditional half only and adds zeros to the other).
- :func:`per_step` expands the window into a ``[B, steps, K]`` scale table once the step count
  is known (diffusers' ``controlnet_keep``, computed in float64 as Python computes it), and
  :func:`at_step` picks step i's column inside the jitted loop.
- :class:`Controlled` is the denoiser with its ControlNets, as the loop calls it: the family's
  ``apply`` sees it and adds the residuals.

Per-prompt settings are per row here where diffusers takes one per call: a bulk render batches
prompts with different scales, windows and guess modes into one program.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

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
    union: bool = False  # one union ControlNet: its images (one per control mode) vary per row

    def __len__(self) -> int:
        return len(self.modules)

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


# model_index.json's class of several ControlNets (diffusers' MultiControlNetModel and its
# families' twins), saved as controlnet, controlnet_1, ... (a family's multi class that
# diffusers cannot save itself, having no config, takes the same layout)
MULTI_SUFFIX = "MultiControlNetModel"


def controlnet_folders(pipeline_dir: Path, index: Mapping) -> list[Path]:
    """The ControlNet folders a pipeline folder holds: ``controlnet`` (and, for several
    ControlNets, ``controlnet_1``, ``controlnet_2``, ... as diffusers saves them)."""
    entry = index.get("controlnet")
    if not entry or entry[0] is None:
        return []
    folders = [pipeline_dir / "controlnet"]
    if str(entry[1]).endswith(MULTI_SUFFIX):
        k = 1
        while (pipeline_dir / f"controlnet_{k}").is_dir():
            folders.append(pipeline_dir / f"controlnet_{k}")
            k += 1
    return folders


def chosen_folders(pipeline_dir, given) -> list[Path]:
    """The ControlNet folders a pipeline loads: ``given`` (``controlnet=<folder or list>``),
    else the pipeline folder's own (none without a model_index.json)."""
    if given:
        return [Path(given)] if isinstance(given, str | Path) else [Path(g) for g in given]
    pipeline_dir = Path(pipeline_dir)
    index_file = pipeline_dir / "model_index.json"
    if not index_file.is_file():
        return []
    return controlnet_folders(pipeline_dir, json.loads(index_file.read_text()))


def prepare_image(image, height: int, width: int) -> np.ndarray:
    """diffusers' control image processor (``VaeImageProcessor(do_convert_rgb=True,
    do_normalize=False)``): resized to (height, width) with Lanczos, then RGB, in [0, 1];
    ``[3, H, W]`` float32."""
    from PIL import Image

    resized = image.resize((width, height), resample=Image.LANCZOS)
    if resized.mode != "RGB":
        resized = resized.convert("RGB")
    return np.transpose(np.asarray(resized, np.float32) / 255.0, (2, 0, 1))


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
