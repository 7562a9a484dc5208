"""Flux ControlNets in the Flux family: the twin of diffusers' ``FluxControlNetPipeline``.

Reference: ``diffusers/pipelines/flux/pipeline_flux_controlnet.py`` (diffusers 0.42):

- each control image goes through ``VaeImageProcessor`` (Lanczos resize to the render size,
  [-1, 1]); for a ControlNet without ``input_hint_block`` (InstantX-style) it is then
  VAE-encoded, normalised ``(z - shift_factor) * scaling_factor`` and packed into tokens like
  the latents; with one (XLabs-style) it stays pixels and ``controlnet_blocks_repeat`` is on.
  diffusers decides both by its first ControlNet, so all of a pipeline's must agree;
- several ControlNets (``FluxMultiControlNetModel``) add their residuals; one union ControlNet
  with several conditions runs once per (image, mode, scale);
- ``controlnet_conditioning_scale`` times ``controlnet_keep`` (the guidance window) per step
  (:func:`jaxcore.control.per_step`), the ControlNet at ``timestep / 1000`` with guidance iff
  its config embeds guidance;
- with true CFG diffusers runs the ControlNet once, on the positive prompt, and gives the same
  residuals to the negative transformer call. The loop here runs the negative branch as its own
  rows, so both branches carry the positive prompt's text under their own names
  (``control_text``, ``control_pooled``): the negative rows' ControlNet computes the positive
  residuals (the same inputs, so the same values; the ControlNet runs on 2N rows where diffusers
  runs it on N).

Differences from diffusers: the control image's VAE posterior *mean* where diffusers draws a
sample (``retrieve_latents(..., generator)``; at the real VAE's small variance the two are
close); control images of any mode are converted to RGB (diffusers' processor keeps a
single-channel image single-channel, which its VAE then refuses); per-row settings in one batch
where diffusers takes one per call.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from jaxcore import control, weights
from jaxcore.family_types import FamilyError
from jaxcore.models import autoencoder_kl, flux_controlnet, flux_transformer

CONTROLNET_CLASSES = ("FluxControlNetModel",)
# conditioning names beside jaxcore.control's (image, scale, window)
CONTROL_MODE = "control_mode"  # [B, K] int32: each condition's union mode (-1: none)
# the positive prompt's text, in both branches: what the ControlNet reads (see the docstring)
CONTROL_TEXT, CONTROL_POOLED = "control_text", "control_pooled"


# --- loading -------------------------------------------------------------------------------


def load_controlnets(folders: Sequence, kwargs: Mapping, mesh=None, rules=None):
    """:class:`jaxcore.control.ControlNets` from ``FluxControlNetModel`` folders, with the
    transformer's module keywords (dtype, attention, remat)."""
    modules, params = [], []
    kwargs = {k: v for k, v in kwargs.items() if k != "scan_layers"}  # blocks run unrolled
    for folder in map(Path, folders):
        try:
            config = weights.read_config(folder)
        except (OSError, ValueError) as err:
            raise FamilyError(f"controlnet {folder}: no readable config.json ({err})") from None
        name = config.get("_class_name")
        if name not in CONTROLNET_CLASSES:
            raise FamilyError(
                f"controlnet {folder}: _class_name {name!r} is not one of {CONTROLNET_CLASSES}"
            )
        try:
            module, p = flux_controlnet.load_flux_controlnet(
                folder, mesh=mesh, rules=rules, **kwargs
            )
        except (ValueError, weights.WeightsError) as err:
            raise FamilyError(f"controlnet {folder}: {err}") from None
        modules.append(module)
        params.append(p)
    return control.ControlNets(tuple(modules), tuple(params), tuple(str(f) for f in folders))


def check_against(nets: control.ControlNets, transformer_config) -> None:
    """Each ControlNet must feed this transformer (token channels, text and pooled widths,
    hidden width, RoPE axes), and all must agree on what diffusers reads from the first one
    (pixels or latents as control image; guidance)."""
    first = nets.modules[0].config
    for module, source in zip(nets.modules, nets.sources, strict=True):
        c = module.config
        keys = ("in_channels", "joint_attention_dim", "pooled_projection_dim", "axes_dims_rope")
        for key in (*keys, "attention_head_dim", "num_attention_heads"):
            if getattr(c, key) != getattr(transformer_config, key):
                raise FamilyError(
                    f"controlnet {source}: {key}={getattr(c, key)!r} but the transformer has "
                    f"{getattr(transformer_config, key)!r}"
                )
        if c.guidance_embeds and not transformer_config.guidance_embeds:
            raise FamilyError(
                f"controlnet {source} embeds guidance but the transformer does not (schnell): "
                "there is no guidance scale to give it"
            )
        for key in ("guidance_embeds", "conditioning_embedding_channels"):
            if getattr(c, key) != getattr(first, key):
                raise FamilyError(
                    f"controlnet {source}: {key}={getattr(c, key)!r} differs from the first "
                    f"ControlNet's {getattr(first, key)!r} (diffusers applies the first's to all)"
                )


# --- per-prompt inputs -> conditioning -----------------------------------------------------


def prepare_image(image, height: int, width: int) -> np.ndarray:
    """diffusers' ``VaeImageProcessor.preprocess``: Lanczos to (height, width), [-1, 1];
    ``[3, H, W]`` float32 (any mode converted to RGB, see the module docstring)."""
    return control.prepare_image(image, height, width) * 2.0 - 1.0


def _check_inputs(controls: Sequence[control.ControlInput], nets: control.ControlNets) -> int:
    """The number of conditions K per row (the same in every row); refuses what the Flux
    pipeline does not have (guess mode) and mismatched lists."""
    counts = {len(given.images) for given in controls}
    if len(counts) != 1:
        raise FamilyError(f"every prompt needs the same number of control images, got {counts}")
    count = counts.pop()
    if len(nets) > 1 and count != len(nets):
        raise FamilyError(f"{count} control image(s) per prompt for {len(nets)} ControlNets")
    union = any(m.config.union for m in nets.modules)
    for row, given in enumerate(controls):
        if given.guess_mode:
            raise FamilyError(f"row {row}: guess_mode: FluxControlNetPipeline has no guess mode")
        lists = {"scales": given.scales, "starts": given.starts, "ends": given.ends}
        if given.modes or union:
            lists["modes"] = given.modes
        for name, values in lists.items():
            if len(values) != count:
                raise FamilyError(
                    f"row {row}: {len(values)} {name} for {count} control image(s)"
                    + (" (a union ControlNet needs a mode per image)" if name == "modes" else "")
                )
    return count


def _encode(pipe, pixels: np.ndarray) -> np.ndarray:
    """Control images ``[N, 3, H, W]`` in [-1, 1] -> packed normalised VAE latents
    ``[N, L, C]`` (the posterior mean, see the module docstring)."""
    vae, params = pipe.components["vae"]
    posterior = autoencoder_kl.encode(vae, params, jnp.asarray(pixels, vae.dtype))
    z = autoencoder_kl.normalize_latents(posterior.mean.astype(jnp.float32), vae.config)
    return np.asarray(flux_transformer.pack_latents(z), np.float32)


def conditioning(
    pipe,
    controls: Sequence[control.ControlInput],
    height: int,
    width: int,
    positive_text: tuple,
):
    """(conditional, negative) control tensors for a batch, one ControlInput per row: the
    control images (packed latents ``[B, K, L, C]``, or pixels ``[B, K, 3, H, W]`` for
    ControlNets with an ``input_hint_block``), modes, scales, windows and the positive prompt's
    ``(text states, pooled)``; both branches alike (diffusers' negative call takes the positive
    residuals)."""
    nets = pipe.controlnets
    count = _check_inputs(controls, nets)
    pixels = np.stack(
        [prepare_image(im, height, width) for given in controls for im in given.images]
    )
    if nets.modules[0].config.conditioning_embedding_channels is None:
        pixels = _encode(pipe, pixels)
    images = pixels.reshape(len(controls), count, *pixels.shape[1:])
    modes = [given.modes or (-1,) * count for given in controls]
    cond = {
        control.CONTROL_IMAGE: images,
        control.CONTROL_SCALE: np.asarray([given.scales for given in controls], np.float64),
        control.CONTROL_START: np.asarray([given.starts for given in controls], np.float64),
        control.CONTROL_END: np.asarray([given.ends for given in controls], np.float64),
        CONTROL_MODE: np.asarray(modes, np.int32),
        CONTROL_TEXT: positive_text[0],
        CONTROL_POOLED: positive_text[1],
    }
    return cond, dict(cond)


# --- residuals -----------------------------------------------------------------------------


def residuals(
    module: control.Controlled, params, tokens, timestep, text_ids, image_ids, cond, guidance
):
    """The ControlNets' summed ``(block samples, single block samples)`` at this step's scales
    (diffusers' ``FluxMultiControlNetModel``: one union net runs once per condition)."""
    dtype = module.dtype
    text, pooled = cond[CONTROL_TEXT].astype(dtype), cond[CONTROL_POOLED].astype(dtype)
    first = module.controlnets[0].config
    guidance = guidance if first.guidance_embeds else None
    images = cond[control.CONTROL_IMAGE]
    count = images.shape[1]
    scales = cond[control.CONTROL_SCALE]
    multi = flux_controlnet.MultiFluxControlNet(tuple(module.controlnets))
    return multi(
        list(params["controlnets"]),
        tokens,
        [images[:, k].astype(dtype) for k in range(count)],
        [cond[CONTROL_MODE][:, k] for k in range(count)],
        [scales[:, k].reshape(-1, 1, 1) for k in range(count)],
        text,
        pooled,
        timestep,
        image_ids,
        text_ids,
        guidance,
    )


def blocks_repeat(module: control.Controlled) -> bool:
    """diffusers' ``controlnet_blocks_repeat``: XLabs ControlNets (with ``input_hint_block``)
    cycle their residuals over the transformer's blocks; read from the first ControlNet."""
    return module.controlnets[0].config.conditioning_embedding_channels is not None
