"""ControlNet training (diffusers' examples/controlnet/train_controlnet.py and
train_controlnet_sdxl.py): a ControlNet learns beside the frozen denoiser.

The ControlNet starts as the family makes it from the denoiser (diffusers'
``ControlNetModel.from_unet``: the encoder half copied, the residual convs and the control
embedding's ``conv_out`` zero, so it adds nothing until trained) or from a diffusers ControlNet
folder (:meth:`Family.controlnet_for_training`). Each step
runs the denoiser with the ControlNet's residuals on the records' conditioning images
(``records.CONDITIONING_PIXELS``, stored by convert's ``conditioning_image_column``) at scale
1, no guess mode, and the loss is the UNet's usual objective (epsilon / v as the pipeline's
scheduler says): diffusers' scripts do the same. Only the ControlNet's parameters (and their
AdamW state) are trained and checkpointed; the run exports them as a diffusers
``ControlNetModel`` folder, ``<artifact>/controlnet``.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path

import jax

from jaxcore import sharding, storage, weights
from jaxcore.family_types import FamilyError
from stages.common import records

# the loss's family view of a ControlNet run, shared with evaluate's scoring
from stages.common.checkpoints import ControlledFamily, control_conditioning  # noqa: F401
from stages.common.errors import StageInputError

CONTROLNET_DIR = "controlnet"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "diffusion_pytorch_model.safetensors"


@dataclasses.dataclass
class ControlNet:
    """The ControlNet being trained: its flax module, initial params, their shardings, and
    where it came from (recorded in the manifest)."""

    module: object
    params: object
    shardings: object
    provenance: dict


def build_controlnet(built, section, compute, mesh, rng) -> ControlNet:
    """The ControlNet of ``section`` (``init``: ``"denoiser"`` = made from the denoiser of
    ``built``, else a diffusers ControlNet folder), checked to fit the denoiser and placed on
    ``mesh`` by the logical axis rules (as the denoiser is)."""
    from flax import linen as nn

    options = built.family.denoiser_kwargs(compute)  # dtype, attention, remat: the denoiser's
    try:
        module, params, boxed, provenance = built.family.controlnet_for_training(
            built.module,
            built.params,
            rng,
            section.init,
            options,
            conditioning_embedding_out_channels=section.conditioning_embedding_out_channels,
        )
    except FamilyError as err:
        raise StageInputError(f"controlnet: {err}") from None
    shardings = nn.meta.unbox(sharding.param_shardings(mesh, boxed))
    return ControlNet(module, jax.device_put(params, shardings), shardings, provenance)


def check_features(features, where: str) -> None:
    """A ControlNet run's records must hold the conditioning images' pixels."""
    if not any(f.name == records.CONDITIONING_PIXELS for f in features):
        raise StageInputError(
            f"{where}: the records hold no {records.CONDITIONING_PIXELS!r}: convert the data "
            "with dataset.conditioning_image_column set for ControlNet training"
        )


def export(family, module, params, uri: str) -> str:
    """Write ``params`` as a diffusers ControlNet folder at ``uri`` (config.json +
    diffusion_pytorch_model.safetensors, :meth:`Family.controlnet_export`)."""
    state, config = family.controlnet_export(module, params)
    with tempfile.TemporaryDirectory() as tmp:
        local = Path(tmp)
        weights.save_safetensors(state, local / WEIGHTS_FILE)
        (local / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        for name in (WEIGHTS_FILE, CONFIG_FILE):
            storage.upload_file(local / name, storage.join(uri, name))
    return CONTROLNET_DIR
