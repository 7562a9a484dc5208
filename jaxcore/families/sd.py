"""Stable Diffusion 1.x / 2.x and SDXL text-to-image as one family (inference).

The twin of diffusers' ``StableDiffusionPipeline`` (pipelines/stable_diffusion/
pipeline_stable_diffusion.py) and ``StableDiffusionXLPipeline`` (pipelines/stable_diffusion_xl/
pipeline_stable_diffusion_xl.py), ``__call__`` with their defaults. The variant is data: an SDXL
pipeline has ``text_encoder_2`` / ``tokenizer_2`` and a UNet with
``addition_embed_type="text_time"``; an SD pipeline has neither.

- prompts (``encode_prompt`` with ``clip_skip=None``): every CLIP tokenizer pads and truncates
  to its ``model_max_length`` (77), no attention mask. SD: the text encoder's last hidden state
  after ``final_layer_norm`` (``encoder_hidden_states [77, D]``). SDXL: the *penultimate*
  hidden state (``hidden_states[-2]``, before the final norm) of ``text_encoder`` (CLIP-L) and
  ``text_encoder_2`` (OpenCLIP bigG, with projection) concatenated on the channel axis, and the
  second encoder's projected pooled output (``text_embeds [1280]``);
- SDXL negatives: with ``force_zeros_for_empty_prompt`` (model_index.json; diffusers' default
  true) an empty negative prompt gives all-zero embeddings, as diffusers does for
  ``negative_prompt=None`` (diffusers encodes an explicitly passed ``""``; here ``""`` means
  "no negative prompt");
- SDXL size conditioning: ``time_ids = original_size + crops_coords_top_left + target_size``
  with diffusers' defaults ``(H, W, 0, 0, H, W)``, the same for the negative branch
  (:meth:`SDFamily.size_conditioning`);
- latents ``[unet.in_channels, H / s, W / s]`` (``s`` = the VAE's ``2 ** (levels - 1)``); the
  loop is the shared one (:mod:`jaxcore.sampling`) with a classic sampler
  (:mod:`jaxcore.schedulers`) built from the pipeline's ``scheduler_config.json`` as diffusers'
  ``from_config`` builds it: the denoiser gets ``scale_model_input(x)`` and the raw scheduler
  timestep, CFG ``uncond + guidance_scale * (cond - uncond)`` when ``guidance_scale > 1``, then
  ``guidance_rescale`` (``rescale_noise_cfg``) where > 0;
- decode: ``z / scaling_factor`` (SDXL with ``latents_mean``/``latents_std`` in the VAE config:
  ``z * std / scaling_factor + mean``) -> VAE -> ``(image / 2 + 0.5)`` clamped to [0, 1]; the VAE
  runs in float32 when its config says ``force_upcast``.

Not reproduced: diffusers' safety checker (SD 1.x pipelines that ship one black out flagged
images; SD 2.x / SDXL ship none) and SDXL's invisible watermark (applied by diffusers only when
the ``invisible-watermark`` package is installed); ``clip_skip``, ``prompt_2`` / separate second
prompts, IP adapters, ``timestep_cond`` UNets (LCM), and convert/train (records): this family renders.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxcore import control, sharding, weights
from jaxcore.compute import ComputeConfig
from jaxcore.families import sd_control
from jaxcore.families.base import (
    MICRO_CONDITIONING,
    DenoiserModel,
    Encoders,
    Family,
    FamilyError,
    Geometry,
    Guidance,
    TensorSpec,
    decoded_frames,
    read_json,
    read_model_index,
    read_scheduler_config,
)
from jaxcore.models import autoencoder_kl, clip_text
from jaxcore.models import unet_2d_condition as unet
from jaxcore.text import load_tokenizer

log = logging.getLogger(__name__)

TEXT = "encoder_hidden_states"
POOLED = "text_embeds"
TIME_IDS = "time_ids"
NUM_TIME_IDS = 6  # original (h, w), crop top-left (y, x), target (h, w)
SD_PIPELINE, XL_PIPELINE = "StableDiffusionPipeline", "StableDiffusionXLPipeline"
# the ControlNet pipelines: the same components plus controlnet (jaxcore.control)
SD_CONTROLNET_PIPELINE = "StableDiffusionControlNetPipeline"
XL_CONTROLNET_PIPELINE = "StableDiffusionXLControlNetPipeline"
XL_UNION_PIPELINE = "StableDiffusionXLControlNetUnionPipeline"
XL_PIPELINES = (XL_PIPELINE, XL_CONTROLNET_PIPELINE, XL_UNION_PIPELINE)
# diffusers' check_inputs: "height and width have to be divisible by 8", whatever the VAE
DIFFUSERS_SIZE_MULTIPLE = 8
XL_DEFAULT_SAMPLE_SIZE = 128  # StableDiffusionXLPipeline.default_sample_size without a UNet one
SD_DEFAULT_SAMPLE_SIZE = 64
# scheduler_config.json _class_name -> our sampler
SCHEDULER_NAMES = {
    "DDIMScheduler": "ddim",
    "EulerDiscreteScheduler": "euler",
    "EulerAncestralDiscreteScheduler": "euler_ancestral",
    "DPMSolverMultistepScheduler": "dpmsolver_multistep",
    "PNDMScheduler": "pndm",
}


@dataclasses.dataclass(frozen=True)
class SDVariant:
    """What differs between the two pipelines beyond the component configs."""

    xl: bool
    force_zeros_for_empty_prompt: bool = False


def is_xl(configs: Mapping) -> bool:
    """SDXL-like: the UNet takes the pooled text embedding and the size ids."""
    return configs["unet"].addition_embed_type == unet.TEXT_TIME


def pooled_width(unet_config: unet.UNet2DConditionConfig) -> int:
    """Width of SDXL's ``text_embeds``: the added-embedding input minus the time ids."""
    return (
        unet_config.projection_class_embeddings_input_dim
        - NUM_TIME_IDS * unet_config.addition_time_embed_dim
    )


# --- prompt encoding ----------------------------------------------------------------------------


def _encode(components: dict, which: str, prompts: Sequence[str], hidden_layer: int | None):
    """(hidden states, text_embeds or None) of ``text_encoder{which}``: encode_prompt's
    tokenization (padded to the tokenizer's ``model_max_length``, truncated)."""
    module, params = components[f"text_encoder{which}"]
    tokenizer = components[f"tokenizer{which}"]
    length = int(tokenizer.model_max_length)
    if length > module.config.max_position_embeddings:
        raise FamilyError(
            f"tokenizer model_max_length {length} exceeds the text encoder's "
            f"max_position_embeddings {module.config.max_position_embeddings}"
        )
    hidden, _, embeds = clip_text.encode_prompts(
        tokenizer, module, params, prompts, length, hidden_layer
    )
    return hidden, embeds


def encode_text(components: dict, variant: SDVariant, prompts: Sequence[str]) -> dict:
    """``{encoder_hidden_states [B, 77, D]}`` (+ SDXL ``text_embeds [B, P]``), float32 on the
    host, as the pipelines' ``encode_prompt`` with ``clip_skip=None``."""
    if not variant.xl:
        hidden, _ = _encode(components, "", prompts, None)
        return {TEXT: hidden}
    first, _ = _encode(components, "", prompts, -2)
    second, pooled = _encode(components, "_2", prompts, -2)
    if first.shape[1] != second.shape[1]:
        raise FamilyError(
            f"the tokenizers pad to {first.shape[1]} and {second.shape[1]} tokens; SDXL "
            "concatenates both encoders' states, which needs one length"
        )
    return {TEXT: np.concatenate([first, second], axis=-1), POOLED: pooled}


# --- loading --------------------------------------------------------------------------------------


def _load_text_encoders(directory: Path, compute: ComputeConfig, xl: bool) -> dict:
    out = {}
    # SDXL's second encoder is CLIPTextModelWithProjection (its text_embeds are the pooled input)
    for which, projection in (("", False), ("_2", True)) if xl else (("", False),):
        try:
            out[f"text_encoder{which}"] = clip_text.load_clip_text(
                directory / f"text_encoder{which}",
                dtype=compute.dtype,
                param_dtype=compute.param_dtype,
                with_projection=projection,
            )
        except (clip_text.CLIPTextConfigError, weights.WeightsError) as err:
            raise FamilyError(f"{directory / f'text_encoder{which}'}: {err}") from None
        out[f"tokenizer{which}"] = load_tokenizer(directory / f"tokenizer{which}")
    return out


def _load_vae(
    directory: Path,
    config: autoencoder_kl.AutoencoderKLConfig,
    compute,
    mesh,
    rules,
    encoder_only: bool = False,
):
    """The VAE, in float32 when its config says ``force_upcast`` (diffusers' flag for VAEs that
    overflow in half precision), else in the compute dtypes; ``encoder_only``: see
    :func:`~jaxcore.models.autoencoder_kl.load_autoencoder_kl`."""
    dtype = jnp.float32 if config.force_upcast else compute.dtype
    param_dtype = jnp.float32 if config.force_upcast else compute.param_dtype
    try:
        return autoencoder_kl.load_autoencoder_kl(
            directory / "vae",
            dtype=dtype,
            param_dtype=param_dtype,
            attention=compute.attention,
            mesh=mesh,
            rules=rules,
            encoder_only=encoder_only,
        )
    except autoencoder_kl.AutoencoderKLConfigError as err:
        raise FamilyError(f"{directory / 'vae'}: {err}") from None


def scale_latents(z: jax.Array, config: autoencoder_kl.AutoencoderKLConfig, xl: bool):
    """Raw VAE latents -> the pipelines' latents (the inverse of :func:`unscale_latents`)."""
    if xl and config.latents_mean is not None and config.latents_std is not None:
        shape = (1, -1, 1, 1)
        mean = jnp.asarray(config.latents_mean, z.dtype).reshape(shape)
        std = jnp.asarray(config.latents_std, z.dtype).reshape(shape)
        return (z - mean) * config.scaling_factor / std
    return z * config.scaling_factor


def size_ids(height: int, width: int, batch: int) -> np.ndarray:
    """SDXL's ``add_time_ids`` for a ``height x width`` image that was neither resized from
    another size nor cropped: ``(H, W, 0, 0, H, W)`` per row, float32 ``[B, 6]``."""
    row = np.asarray([height, width, 0, 0, height, width], np.float32)
    return np.tile(row, (batch, 1))


def micro_time_ids(
    height: int, width: int, values: Mapping[str, Sequence[int]]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(conditional, negative) ``add_time_ids`` rows of one prompt, as
    ``StableDiffusionXLPipeline.__call__`` builds them from its micro-conditioning arguments.

    diffusers ignores ``negative_crops_coords_top_left`` (and a lone negative size) unless both
    ``negative_original_size`` and ``negative_target_size`` are given; here that is an error
    rather than a silently dropped value."""
    unknown = sorted(set(values) - set(MICRO_CONDITIONING))
    if unknown:
        raise FamilyError(
            f"unknown micro-conditioning {unknown}; known: {list(MICRO_CONDITIONING)}"
        )
    for name, pair in values.items():
        if len(pair) != 2 or any(int(v) != v or v < 0 for v in pair):
            raise FamilyError(f"{name}={list(pair)}: expected two integers >= 0")
    own = (height, width)
    cond = (
        *values.get("original_size", own),
        *values.get("crops_coords_top_left", (0, 0)),
        *values.get("target_size", own),
    )
    negatives = sorted(name for name in values if name.startswith("negative_"))
    if not negatives:
        return cond, cond
    if "negative_original_size" not in values or "negative_target_size" not in values:
        raise FamilyError(
            f"{negatives}: the negative branch's micro-conditioning needs both "
            "negative_original_size and negative_target_size (diffusers ignores the others alone)"
        )
    uncond = (
        *values["negative_original_size"],
        *values.get("negative_crops_coords_top_left", (0, 0)),
        *values["negative_target_size"],
    )
    return cond, uncond


def tokenizer_length(directory: Path) -> int:
    """The CLIP tokenizer's ``model_max_length`` (77): the pipelines pad every prompt to it."""
    config = read_json(directory / "tokenizer" / "tokenizer_config.json", "a CLIP tokenizer")
    length = config.get("model_max_length")
    if not isinstance(length, int) or not 0 < length < 10_000:
        raise FamilyError(f"{directory}/tokenizer: model_max_length {length!r} is not a length")
    return length


class SDEncoders(Encoders):
    """The VAE encoder and CLIP text encoder(s) of an SD / SDXL pipeline directory (convert).

    Media -> the VAE posterior *mean* scaled as the pipelines scale latents (diffusers'
    training scripts sample the posterior; the mean keeps records deterministic); captions ->
    ``encoder_hidden_states`` (+ SDXL's pooled ``text_embeds``) exactly as the pipelines encode
    prompts; SDXL records also carry ``time_ids`` for their own size, uncropped (diffusers'
    SDXL training script records the source size and crop it made; convert resizes and
    centre-crops, so here original = target = the record's size)."""

    def __init__(self, directory: Path, configs: Mapping, compute: ComputeConfig, batch_size: int):
        self.batch_size = batch_size
        self.xl = is_xl(configs)
        self.vae_config = configs["vae"]
        self.vae, self.vae_params = _load_vae(
            directory, self.vae_config, compute, None, None, encoder_only=True
        )
        self.text = _load_text_encoders(directory, compute, self.xl)
        self.variant = SDVariant(xl=self.xl)

    def encode_media(self, videos: np.ndarray) -> np.ndarray:
        images, count = self._padded_images(videos, "SD")
        posterior = autoencoder_kl.encode(self.vae, self.vae_params, images)
        latents = scale_latents(posterior.mean.astype(jnp.float32), self.vae_config, self.xl)
        return np.asarray(latents, np.float32)[:count]

    def encode_text(self, captions: Sequence[str]) -> dict[str, np.ndarray]:
        padded, count = self._padded(list(captions), "captions")
        encoded = encode_text(self.text, self.variant, padded)
        return {name: value[:count] for name, value in encoded.items()}

    def encode_media_conditioning(self, videos: np.ndarray) -> dict[str, np.ndarray]:
        if not self.xl:
            return {}
        batch, _, _, height, width = np.shape(videos)
        return {TIME_IDS: size_ids(height, width, batch)}


def unscale_latents(z: jax.Array, config: autoencoder_kl.AutoencoderKLConfig, xl: bool):
    """The pipelines' latents -> raw VAE latents: SD ``z / scaling_factor`` (its pipeline reads
    nothing else), SDXL with ``latents_mean`` and ``latents_std`` set ``z * std / scaling_factor
    + mean``."""
    if xl and config.latents_mean is not None and config.latents_std is not None:
        shape = (1, -1, 1, 1)
        mean = jnp.asarray(config.latents_mean, z.dtype).reshape(shape)
        std = jnp.asarray(config.latents_std, z.dtype).reshape(shape)
        return z * std / config.scaling_factor + mean
    return z / config.scaling_factor


# --- FLOPs ------------------------------------------------------------------------------------------


def _conv_flops(positions: int, kernel: int, cin: int, cout: int) -> int:
    return 2 * positions * kernel * kernel * cin * cout


def _resnet_flops(positions: int, cin: int, cout: int, temb: int) -> int:
    """conv1, conv2, the time projection and a 1x1 shortcut when the width changes."""
    flops = _conv_flops(positions, 3, cin, cout) + _conv_flops(positions, 3, cout, cout)
    flops += 2 * temb * cout
    return flops + (_conv_flops(positions, 1, cin, cout) if cin != cout else 0)


def _transformer_flops(positions: int, width: int, tokens: int, context: int, depth: int) -> int:
    """proj_in/out plus per block: self-attention (q, k, v, out projections, scores and
    values over ``positions``), cross-attention (q/out on the image, k/v on the ``tokens`` text
    tokens of width ``context``) and the GEGLU feed-forward (``D -> 2 x 4D``, ``4D -> D``)."""
    p, c = positions, width
    self_attention = 8 * p * c * c + 4 * p * p * c
    cross_attention = 4 * p * c * c + 4 * tokens * context * c + 4 * p * tokens * c
    feed_forward = 2 * p * c * (2 * unet.FF_MULT * c) + 2 * p * (unet.FF_MULT * c) * c
    return 4 * p * c * c + depth * (self_attention + cross_attention + feed_forward)


def unet_flops(config: unet.UNet2DConditionConfig, h: int, w: int, text_tokens: int) -> int:
    """Matmul/conv FLOPs (2 per multiply-add) of one UNet forward on one ``[C, h, w]`` latent,
    walking diffusers' block structure (skips included); norms and activations not counted."""
    levels = config.num_levels
    channels, temb = config.block_out_channels, config.time_embed_dim
    depth, resnets = config.transformer_depth_per_level, config.resnets_per_level
    context = config.cross_attention_dim

    def attention(positions, c, level):
        return _transformer_flops(positions, c, text_tokens, context, depth[level])

    sizes = [(h, w)]
    for _ in range(levels - 1):  # stride-2 convs with padding: ceil(n / 2)
        sizes.append(tuple(-(-n // 2) for n in sizes[-1]))
    positions = [a * b for a, b in sizes]
    flops = _conv_flops(positions[0], config.conv_in_kernel, config.in_channels, channels[0])
    flops += 2 * (channels[0] * temb + temb * temb)
    if config.addition_embed_type == unet.TEXT_TIME:
        flops += 2 * (config.projection_class_embeddings_input_dim * temb + temb * temb)
    skips, width = [channels[0]], channels[0]
    for level in range(levels):
        p, c = positions[level], channels[level]
        for _ in range(resnets[level]):
            flops += _resnet_flops(p, width, c, temb)
            width = c
            if config.down_block_types[level] == unet.CROSS_DOWN:
                flops += attention(p, c, level)
            skips.append(c)
        if level < levels - 1:
            flops += _conv_flops(positions[level + 1], 3, c, c)
            skips.append(c)
    if config.mid_block_type is not None:
        p = positions[-1]
        flops += 2 * _resnet_flops(p, width, width, temb) + attention(p, width, levels - 1)
    for i in range(levels):
        level = levels - 1 - i
        p, c = positions[level], channels[level]
        for _ in range(resnets[level] + 1):
            flops += _resnet_flops(p, width + skips.pop(), c, temb)
            width = c
            if config.up_block_types[i] == unet.CROSS_UP:
                flops += attention(p, c, level)
        if i < levels - 1:
            flops += _conv_flops(positions[level - 1], 3, c, c)
    return flops + _conv_flops(positions[0], config.conv_out_kernel, width, config.out_channels)


# --- the family ---------------------------------------------------------------------------------


SD_TRAINING_SCHEDULE = {
    "num_train_timesteps": 1000,
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "prediction_type": "epsilon",
}


class SDFamily(Family):
    name = "sd"
    description = (
        "Stable Diffusion 1.x / 2.x and SDXL text-to-image "
        "(StableDiffusionPipeline, StableDiffusionXLPipeline; inference)"
    )
    pipeline_classes = (SD_PIPELINE, SD_CONTROLNET_PIPELINE, *XL_PIPELINES)
    denoiser_classes = ("UNet2DConditionModel",)
    denoiser_component = "unet"
    size_from_control_image = True
    # the class-level default; a pipeline's own comes from its scheduler config
    # (pipeline_objective: SD 2.1 768 and other v-models are "v_prediction")
    objective = "epsilon"
    denoiser_model = DenoiserModel(
        kind=unet.KIND, weight_map=unet.weight_map, config_error=unet.UNet2DConditionConfigError
    )

    def component_config_classes(self) -> dict[str, type]:
        return {
            "unet": unet.UNet2DConditionConfig,
            "vae": autoencoder_kl.AutoencoderKLConfig,
            "text_encoder": clip_text.CLIPTextConfig,
        }

    def optional_config_classes(self) -> dict[str, type]:
        return {"text_encoder_2": clip_text.CLIPTextConfig}  # SDXL's OpenCLIP bigG

    def component_configs(self, directory) -> dict:
        configs = super().component_configs(directory)
        path = Path(directory) / "text_encoder_2"
        if (path / "config.json").is_file():
            try:
                configs["text_encoder_2"] = clip_text.CLIPTextConfig.from_dict(
                    weights.read_config(path)
                )
            except (ValueError, TypeError, KeyError) as err:
                raise FamilyError(f"{path / 'config.json'}: {err}") from None
        return configs

    def check_model_index(self, index, where: str) -> None:
        sd_classes = (SD_PIPELINE, SD_CONTROLNET_PIPELINE)
        if index.get("_class_name") in sd_classes and index.get("safety_checker", [None])[0]:
            log.warning(
                "%s: the pipeline ships a safety checker; it is not run here (diffusers blacks "
                "out the images it flags)",
                where,
            )

    def check_configs(self, configs, where: str) -> None:
        """The text encoders' widths must make the UNet's cross-attention (and SDXL's pooled)
        input, as diffusers' pipelines need them to."""
        if "unet" not in configs or "text_encoder" not in configs:
            return
        u, first, second = configs["unet"], configs["text_encoder"], configs.get("text_encoder_2")
        if is_xl(configs):
            if second is None:
                raise FamilyError(
                    f"{where}: the UNet has addition_embed_type='text_time' (SDXL) but there is "
                    "no text_encoder_2"
                )
            widths = first.hidden_size + second.hidden_size
            if second.projection_dim != pooled_width(u):
                raise FamilyError(
                    f"{where}: text_encoder_2 projection_dim {second.projection_dim} + "
                    f"{NUM_TIME_IDS} time ids x addition_time_embed_dim "
                    f"{u.addition_time_embed_dim} != the UNet's "
                    f"projection_class_embeddings_input_dim {u.projection_class_embeddings_input_dim}"
                )
        else:
            if second is not None:
                raise FamilyError(
                    f"{where}: a text_encoder_2 needs an SDXL UNet (addition_embed_type="
                    "'text_time')"
                )
            widths = first.hidden_size
        if widths != u.cross_attention_dim:
            raise FamilyError(
                f"{where}: the text encoders' hidden width {widths} != the UNet's "
                f"cross_attention_dim {u.cross_attention_dim}"
            )

    # --- the denoiser -----------------------------------------------------------------------
    def denoiser_kwargs(self, compute: ComputeConfig) -> dict:
        """compute's denoiser keywords for the UNet: its down/mid/up blocks differ in width and
        kind from one to the next, so there is no stack of equal layers to scan."""
        kwargs = dict(compute.denoiser_kwargs)
        if kwargs.pop("scan_layers"):
            raise FamilyError(
                "compute.scan_layers: the SD/SDXL UNet has no repeated equal blocks to scan "
                "(it applies to the transformer families, wan and flux); set it to false"
            )
        return kwargs

    def apply(self, module, params, latents, timestep, conditioning, run_stack=None):
        """The UNet at the scheduler's own timestep (diffusers passes ``t`` as is); SDXL's
        ``text_embeds`` / ``time_ids`` are its ``added_cond_kwargs``."""
        if run_stack is not None:
            raise FamilyError("step caching is not supported for the UNet (Stable Diffusion)")
        dtype = module.dtype
        added = (None, None)
        if module.config.addition_embed_type == unet.TEXT_TIME:
            added = (conditioning[POOLED], conditioning[TIME_IDS].astype(jnp.float32))
        residuals = ()
        if isinstance(module, control.Controlled):  # ControlNets first, their residuals added
            residuals = sd_control.residuals(
                module, params, latents, timestep, conditioning[TEXT], added, conditioning
            )
            module, params = module.denoiser, params["denoiser"]
        return module.apply(
            {"params": params},
            latents.astype(dtype),
            timestep,
            conditioning[TEXT].astype(dtype),
            *added,
            *residuals,
        )

    def lora_to_diffusers(self, state_dict, denoiser_config, where: str):
        from jaxcore.lora import sd

        return sd.to_diffusers(state_dict, denoiser_config, where)

    def flops_per_forward(self, config, batch, latent_shape, conditioning_shapes):
        _, h, w = latent_shape
        return batch * unet_flops(config, h, w, conditioning_shapes[TEXT][0])

    def tokens_per_example(self, config, latent_shape):
        _, h, w = latent_shape
        return h * w

    def check_heads(self, config, mesh) -> None:
        for heads in sorted(set(config.heads_per_level)):
            sharding.check_divisible(mesh, heads=heads)

    # --- conditioning and latents -----------------------------------------------------------
    def conditioning_specs(self, denoiser_config, text_length, latent_shape, image_tokens=None):
        """``encoder_hidden_states [L, cross_attention_dim]`` (L: the CLIP tokenizers'
        ``model_max_length``, 77; SD renders ignore ``max_sequence_length``); SDXL also
        ``text_embeds [P]`` and ``time_ids [6]``."""
        del latent_shape, image_tokens
        specs = [TensorSpec(TEXT, (text_length, denoiser_config.cross_attention_dim))]
        if denoiser_config.addition_embed_type == unet.TEXT_TIME:
            specs += [
                TensorSpec(POOLED, (pooled_width(denoiser_config),)),
                TensorSpec(TIME_IDS, (NUM_TIME_IDS,)),
            ]
        return tuple(specs)

    def latent_channels(self, denoiser_config) -> int:
        return denoiser_config.in_channels

    def geometry(self, configs) -> Geometry:
        s = configs["vae"].spatial_compression
        return Geometry(spatial_multiple=math.lcm(DIFFUSERS_SIZE_MULTIPLE, s), temporal_multiple=0)

    def latent_shape(self, configs, height, width, num_frames):
        s = configs["vae"].spatial_compression
        return (configs["unet"].in_channels, height // s, width // s)

    def record_features(self, directory, height, width, num_frames, max_sequence_length):
        """As the base class, with the text padded to the tokenizer's length (77), which is
        what the pipelines condition on; ``max_sequence_length`` is not an SD setting."""
        del max_sequence_length
        length = tokenizer_length(Path(directory))
        return super().record_features(directory, height, width, num_frames, length)

    def load_encoders(self, directory, compute, max_sequence_length, batch_size):
        del max_sequence_length  # the tokenizers' own length (see record_features)
        directory = Path(directory)
        return SDEncoders(directory, self.component_configs(directory), compute, batch_size)

    def latent_normalization(self, configs) -> dict:
        vae = configs["vae"]
        xl_stats = is_xl(configs) and vae.latents_mean is not None and vae.latents_std is not None
        return {
            "latent_sampling": "mean",
            "formula": (
                "(z - latents_mean) * scaling_factor / latents_std"
                if xl_stats
                else "z * scaling_factor"
            ),
            "scaling_factor": vae.scaling_factor,
            "latents_mean": vae.latents_mean if xl_stats else None,
            "latents_std": vae.latents_std if xl_stats else None,
        }

    # --- inference --------------------------------------------------------------------------
    def load_components(self, directory, configs, compute, mesh, rules, denoiser):
        module = denoiser[0]
        index = read_model_index(directory)
        xl = index.get("_class_name") in XL_PIPELINES
        if is_xl(configs) != xl:
            raise FamilyError(
                f"{directory}: a {index.get('_class_name')} needs a UNet with addition_embed_type="
                f"{'text_time' if xl else 'null'}, got {module.config.addition_embed_type!r}"
            )
        vae = _load_vae(directory, configs["vae"], compute, mesh, rules)
        latent_channels = vae[0].config.latent_channels
        if latent_channels != module.config.in_channels:
            raise FamilyError(
                f"{directory}: unet in_channels {module.config.in_channels} != the vae's "
                f"latent_channels {latent_channels}"
            )
        variant = SDVariant(
            xl=xl,
            # StableDiffusionXLPipeline.__init__'s default is True
            force_zeros_for_empty_prompt=xl
            and bool(index.get("force_zeros_for_empty_prompt", True)),
        )
        # text encoders outside the mesh: their params are replicated, nothing is lost
        encoders = _load_text_encoders(directory, compute, xl)
        return {"components": {"vae": vae, "variant": variant, **encoders}}

    def load_controlnets(self, directory, denoiser_config, compute, mesh, rules, given):
        """ControlNetModel folders (``controlnet=``, else the pipeline's own ``controlnet``,
        ``controlnet_1``, ...), with the UNet's module keywords; each checked to fit the UNet.
        They stay in their dtype under ``compute.quantization`` (only the UNet is quantized)."""
        folders = control.chosen_folders(directory, given)
        if not folders:
            return None
        nets = sd_control.load_controlnets(folders, self.denoiser_kwargs(compute), mesh, rules)
        sd_control.check_against(nets, denoiser_config)
        return nets

    def control_conditioning(self, pipe, controls, height: int, width: int, positive):
        """Control images in [0, 1] pixels, scales, windows, guess mode, union modes
        (:func:`sd_control.conditioning`)."""
        del positive  # the UNet ControlNets read each branch's own text, as diffusers' do
        return sd_control.conditioning(controls, pipe.controlnets, height, width)

    def controlnet_for_training(self, denoiser, denoiser_params, rng, init, options, **control):
        return sd_control.for_training(denoiser, denoiser_params, rng, init, options, **control)

    def controlnet_export(self, module, params) -> tuple[dict, dict]:
        return sd_control.exported(module, params)

    def controlnet_template(self, denoiser, config, options):
        del denoiser  # the recorded config says it all
        return sd_control.template(config, options)

    def pipeline_objective(self, pipe) -> str:
        return str(pipe.scheduler_config.get("prediction_type", "epsilon"))

    def noise_schedule(self, pipeline_dir) -> dict:
        """The DDPM schedule the UNet trains with: the pipeline's scheduler_config.json; without
        a pipeline (a model YAML), Stable Diffusion's own (scaled_linear betas 0.00085..0.012
        over 1000 steps, epsilon)."""
        if pipeline_dir is None:
            return dict(SD_TRAINING_SCHEDULE)
        return read_scheduler_config(pipeline_dir)

    def encode_prompts(self, pipe, prompts, max_sequence_length):
        del max_sequence_length  # CLIP's length is its tokenizer's (diffusers has no option)
        return encode_text(pipe.components, pipe.components["variant"], prompts)

    def negative_conditioning(self, pipe, negative_prompts, uncond):
        """SDXL with ``force_zeros_for_empty_prompt``: empty negative prompts -> zeros."""
        if not pipe.components["variant"].force_zeros_for_empty_prompt:
            return uncond
        empty = np.asarray([not p for p in negative_prompts])
        if not empty.any():
            return uncond
        return {
            name: np.where(empty.reshape((-1,) + (1,) * (v.ndim - 1)), 0.0, v).astype(v.dtype)
            for name, v in uncond.items()
        }

    def size_conditioning(self, configs, height, width, micro, num_frames=None):
        """SDXL's ``time_ids`` per row, ``original_size + crops_coords_top_left + target_size``
        with diffusers' defaults ``(H, W)``, ``(0, 0)``, ``(H, W)``; the negative branch's from
        the ``negative_*`` values when both ``negative_original_size`` and
        ``negative_target_size`` are set, else the conditional branch's (as the pipeline
        does)."""
        if not is_xl(configs):
            return super().size_conditioning(configs, height, width, micro, num_frames)
        if height is None or width is None:
            raise FamilyError(
                "SDXL conditions on the render size (time_ids): pass size=(height, width, "
                "num_frames) to Pipeline.conditioning"
            )
        rows = [micro_time_ids(height, width, values) for values in micro]
        cond = np.asarray([c for c, _ in rows], np.float32).reshape(len(rows), NUM_TIME_IDS)
        uncond = np.asarray([u for _, u in rows], np.float32).reshape(len(rows), NUM_TIME_IDS)
        return {TIME_IDS: cond}, {TIME_IDS: uncond}

    def decode(self, pipe, latents, conditioning=None):
        del conditioning  # decoding takes no per-prompt settings
        vae, params = pipe.components["vae"]
        z = unscale_latents(jnp.asarray(latents, jnp.float32), vae.config, is_xl(pipe.configs))
        return decoded_frames(autoencoder_kl.decode(vae, params, z.astype(vae.dtype)))

    def sampling_defaults(self, configs) -> dict:
        # the pipelines' __call__ defaults; the size is the UNet's sample_size in pixels
        xl = is_xl(configs)
        size = configs["unet"].sample_size
        if size is None:
            size = XL_DEFAULT_SAMPLE_SIZE if xl else SD_DEFAULT_SAMPLE_SIZE
        height, width = (size, size) if isinstance(size, int) else tuple(size)[:2]
        s = configs["vae"].spatial_compression
        return {
            "height": height * s,
            "width": width * s,
            "num_frames": 1,
            "num_inference_steps": 50,
            "guidance_scale": 5.0 if xl else 7.5,
        }

    def default_scheduler(self, scheduler_config) -> str:
        name = scheduler_config.get("_class_name")
        if name not in SCHEDULER_NAMES:
            raise FamilyError(
                f"scheduler {name!r} of this pipeline is not supported for Stable Diffusion; "
                f"pass scheduler= one of {sorted(set(SCHEDULER_NAMES.values()))} (it reads the "
                f"pipeline's scheduler config as diffusers' from_config does)"
            )
        return SCHEDULER_NAMES[name]

    def make_schedule(self, pipe, scheduler, num_inference_steps, shift, latent_shape, seeds=None):
        """The classic sampler ``scheduler`` built from the pipeline's scheduler config (as
        ``SchedulerClass.from_config(pipe.scheduler.config)``); ``seeds`` feed the stochastic
        ones."""
        from jaxcore.schedulers import CLASSIC_SCHEDULERS, make_scheduler

        if scheduler not in CLASSIC_SCHEDULERS:
            raise FamilyError(
                f"scheduler={scheduler!r}: Stable Diffusion samples with one of "
                f"{list(CLASSIC_SCHEDULERS)}"
            )
        if shift is not None and float(shift) != 1.0:
            raise FamilyError(
                f"flow_shift={shift}: Stable Diffusion's schedulers have no shift; leave it unset"
            )
        try:
            return make_scheduler(
                scheduler,
                num_inference_steps,
                None,
                config=pipe.scheduler_config,
                seeds=seeds,
                sample_shape=tuple(latent_shape),
            )
        except ValueError as err:  # ClassicConfigError included
            where = f"{pipe.source}/scheduler/scheduler_config.json" if pipe.source else "scheduler"
            raise FamilyError(f"{where} as {scheduler}: {err}") from None

    def make_seeded_schedule(
        self, pipe, scheduler, num_inference_steps, shift, latent_shape, seeds=None
    ):
        return self.make_schedule(
            pipe, scheduler, num_inference_steps, shift, latent_shape, seeds=seeds
        )

    def guidance(
        self,
        configs,
        *,
        guidance_scale: float,
        true_cfg_scale: float,
        guidance_scale_2: float | None = None,
        guidance_rescale: float = 0.0,
    ) -> Guidance:
        if true_cfg_scale != 1.0:
            raise FamilyError(
                f"true_cfg_scale={true_cfg_scale}: Stable Diffusion's CFG scale is guidance_scale "
                "(with the negative prompt); true_cfg_scale is Flux's"
            )
        if guidance_scale_2 is not None:
            raise FamilyError(
                f"guidance_scale_2={guidance_scale_2}: Stable Diffusion has one denoiser; "
                "guidance_scale_2 is the second expert's scale of two-expert models (Wan 2.2)"
            )
        guidance = Guidance(cfg_scale=float(guidance_scale))
        if guidance_rescale:
            guidance = self.with_guidance_rescale(configs, guidance, guidance_rescale)
        return guidance

    def with_guidance_rescale(self, configs, guidance, guidance_rescale):
        del configs
        value = float(guidance_rescale)
        if not value >= 0.0:
            raise FamilyError(f"guidance_rescale={guidance_rescale}: must be >= 0 (0 = off)")
        return dataclasses.replace(guidance, guidance_rescale=value)
