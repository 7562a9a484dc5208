"""SD / SDXL ControlNets in the SD family: loading, per-batch inputs, residuals, training.

The family-neutral plumbing (per-prompt inputs, the guidance window, the loop's module) is
:mod:`jaxcore.control`; this is what is particular to the UNet's ControlNets
(``ControlNetModel``, ``ControlNetUnionModel``; diffusers' ``pipeline_controlnet.py``,
``pipeline_controlnet_sd_xl.py`` and ``pipeline_controlnet_union_sd_xl.py``): control images in
[0, 1] pixels, the residuals of several ControlNets summed (MultiControlNetModel), guess mode's
negative branch switched off, a union ControlNet's types and modes per row, and training's
ControlNet made from the UNet (``ControlNetModel.from_unet``) and exported for diffusers.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from jaxcore import weights
from jaxcore.control import (
    CONTROL_END,
    CONTROL_GUESS,
    CONTROL_IMAGE,
    CONTROL_MODE,
    CONTROL_OFF,
    CONTROL_SCALE,
    CONTROL_START,
    CONTROL_TYPE,
    ControlInput,
    Controlled,
    ControlNets,
    prepare_image,
)
from jaxcore.family_types import FamilyError

CONTROLNET, UNION = "ControlNetModel", "ControlNetUnionModel"
CONTROLNET_CLASSES = (CONTROLNET, UNION)


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
    union = bool(modules) and isinstance(modules[0], controlnet_union.ControlNetUnionModel)
    return ControlNets(tuple(modules), tuple(params), tuple(str(f) for f in folders), union=union)


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


def residuals(module: Controlled, params, latents, timestep, context, added, conditioning_):
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


# --- training ------------------------------------------------------------------------------


def for_training(denoiser, denoiser_params, rng, init: str, options: Mapping, **control):
    """(module, params, boxed abstract params, provenance) of the ControlNet a train run
    learns: ``init == "denoiser"`` makes it from the UNet as diffusers'
    ``ControlNetModel.from_unet`` does (``control``: its embedding's channels), else ``init``
    is a ControlNetModel folder to go on from; checked to fit the UNet."""
    from jaxcore.models import controlnet

    if init == "denoiser":
        module, params = controlnet.from_unet(
            denoiser.config, denoiser_params, rng, options=dict(options), **control
        )
        provenance = {"source": "denoiser"}
    else:
        try:
            module, params = controlnet.load_controlnet(init, **options)
        except (OSError, ValueError, weights.WeightsError) as err:
            raise FamilyError(f"controlnet.init {init}: {err}") from None
        provenance = {"source": "pretrained", "path": init}
    check_against(ControlNets((module,), (params,), (str(init),)), denoiser.config)
    return module, params, controlnet.abstract_params(module), provenance


def exported(module, params) -> tuple[dict, dict]:
    """(diffusers state dict, config.json) of a trained ControlNet."""
    from jaxcore.models import controlnet

    state = weights.export_state_dict(params, controlnet.weight_map(module.config))
    return state, {"_class_name": CONTROLNET, **module.config.to_dict()}


def template(config: Mapping, options: Mapping):
    """``(module, abstract params, boxed abstract params)`` of a ControlNetModel with
    ``config`` (its ``config.to_dict()``, as a train manifest records it), no weights made:
    what a trained ControlNet's checkpoints restore onto (``Family.controlnet_template``)."""
    from flax import linen as nn

    from jaxcore.models import controlnet

    try:
        module = controlnet.ControlNetModel(
            controlnet.ControlNetConfig.from_dict(config), **options
        )
    except ValueError as err:
        raise FamilyError(f"controlnet config: {err}") from None
    boxed = controlnet.abstract_params(module)
    return module, nn.meta.unbox(boxed), boxed
