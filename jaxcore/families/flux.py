"""Flux.1 (dev and schnell) text-to-image as a family: the twin of diffusers' ``FluxPipeline``.

Reference: ``diffusers/pipelines/flux/pipeline_flux.py`` (``FluxPipeline.__call__``):

- prompts -> CLIP-L's pooled output (``pooled_projections`` [768]; the CLIP tokenizer pads and
  truncates to its 77 tokens, no attention mask) and T5 v1.1's last hidden state
  (``encoder_hidden_states`` [max_sequence_length, 4096]; padded to ``max_sequence_length``,
  no attention mask, so that length changes the result);
- latents ``[16, H/8, W/8]`` normalised ``(z - shift_factor) * scaling_factor``; the denoiser
  packs them into 2x2 patches ``[H/16 * W/16, 64]`` with image ids (0, row, col) and text ids
  (zeros) for its 3-axis RoPE, and takes ``timestep / 1000``;
- guidance: dev's embedded guidance (``guidance_scale``, a denoiser input of every sample);
  true CFG with the negative prompt when ``true_cfg_scale > 1`` (a second pass,
  ``neg + true_cfg_scale * (cond - neg)``); schnell has no guidance embedding;
- the flow-match Euler scheduler with FluxPipeline's sigmas ``linspace(1, 1/N, N)`` and, under
  dynamic shifting (dev), ``mu`` linear in the image sequence length;
- decode: ``z / scaling_factor + shift_factor`` -> VAE -> ``image / 2 + 0.5`` in [0, 1].

``FluxControlNetPipeline`` folders load as this family too, their ControlNets beside the
transformer (:mod:`jaxcore.families.flux_control`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from jaxcore import control, sharding
from jaxcore.compute import ComputeConfig
from jaxcore.families import flow_match, flux_control
from jaxcore.families.base import (
    DenoiserModel,
    Encoders,
    Family,
    FamilyError,
    Geometry,
    Guidance,
    TensorSpec,
    decoded_frames,
)
from jaxcore.models import autoencoder_kl, clip_text, flux_transformer, t5
from jaxcore.text import load_tokenizer

# MagCache's published ratios for FLUX.1-dev at 28 steps (diffusers'
# FLUX_MAG_RATIOS, from the MagCache repository); other models calibrate (difforge calibrate).
MAG_RATIOS_28_STEPS = (1.0, 1.21094, 1.11719, 1.07812, 1.0625, 1.03906, 1.03125, 1.03906, 1.02344,
                   1.03125, 1.02344, 0.98047, 1.01562, 1.00781, 1.0, 1.00781, 1.0, 1.00781,
                   1.0, 1.0, 0.99609, 0.99609, 0.98047, 0.98828, 0.96484, 0.95703, 0.93359,
                   0.89062)  # fmt: skip

# FLUX.1-dev's scheduler (dynamic shifting by image size): the scheduler of a model YAML, which
# names none.
REFERENCE_SCHEDULER_CONFIG: dict[str, object] = {
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "max_image_seq_len": 4096,
    "max_shift": 1.15,
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
}


log = logging.getLogger(__name__)

TEXT = "encoder_hidden_states"
POOLED = "pooled_projections"
GUIDANCE = "guidance"
PACK = 2  # Flux packs latents into 2x2 patches
DEFAULT_SAMPLE_SIZE = 128  # FluxPipeline.default_sample_size (in latent pixels)


# --- prompt encoding ----------------------------------------------------------------------------


def encode_text(components: dict, prompts: Sequence[str], max_sequence_length: int) -> dict:
    """``{encoder_hidden_states [B, L, D], pooled_projections [B, P]}`` float32 on the host."""
    clip, clip_params = components["text_encoder"]
    encoder, encoder_params = components["text_encoder_2"]
    tokenizer = components["tokenizer"]
    clip_length = int(getattr(tokenizer, "model_max_length", 77) or 77)
    clip_length = min(clip_length, clip.config.max_position_embeddings)
    _, pooled, _ = clip_text.encode_prompts(tokenizer, clip, clip_params, prompts, clip_length)
    hidden = t5.encode_prompts(
        components["tokenizer_2"], encoder, encoder_params, prompts, max_sequence_length
    )
    return {TEXT: hidden, POOLED: pooled}


def _load_text_encoders(directory: Path, compute: ComputeConfig, mesh=None) -> dict:
    try:
        clip, clip_params = clip_text.load_clip_text(
            directory / "text_encoder",
            dtype=compute.dtype,
            param_dtype=compute.param_dtype,
            mesh=mesh,
        )
        encoder, encoder_params = t5.load_t5_encoder(
            directory / "text_encoder_2",
            dtype=compute.dtype,
            param_dtype=compute.param_dtype,
            mesh=mesh,
        )
    except (clip_text.CLIPTextConfigError, t5.T5ConfigError) as err:
        raise FamilyError(f"{directory}: {err}") from None
    return {
        "text_encoder": (clip, clip_params),
        "text_encoder_2": (encoder, encoder_params),
        "tokenizer": load_tokenizer(directory / "tokenizer"),
        "tokenizer_2": load_tokenizer(directory / "tokenizer_2"),
    }


def _load_vae(
    directory: Path, compute: ComputeConfig, mesh=None, rules=None, encoder_only: bool = False
):
    try:
        return autoencoder_kl.load_autoencoder_kl(
            directory / "vae",
            dtype=compute.dtype,
            param_dtype=compute.param_dtype,
            attention=compute.attention,
            mesh=mesh,
            rules=rules,
            encoder_only=encoder_only,
        )
    except autoencoder_kl.AutoencoderKLConfigError as err:
        raise FamilyError(f"{directory / 'vae'}: {err}") from None


class FluxEncoders(Encoders):
    """The VAE encoder, CLIP-L and T5 of a Flux pipeline directory (convert).

    Media -> the VAE posterior *mean*, normalised ``(z - shift_factor) * scaling_factor``
    (diffusers' Flux training scripts sample the posterior; the mean keeps records
    deterministic); captions -> the two text conditionings, exactly as :func:`encode_text`.
    """

    def __init__(
        self, directory: Path, compute: ComputeConfig, max_sequence_length: int, batch_size: int
    ):
        self.batch_size = batch_size
        self.max_sequence_length = max_sequence_length
        started = time.perf_counter()
        self.vae, self.vae_params = _load_vae(directory, compute, encoder_only=True)
        self.text = _load_text_encoders(directory, compute)
        log.info("loaded Flux encoders from %s in %.1fs", directory, time.perf_counter() - started)

    def encode_media(self, videos: np.ndarray) -> np.ndarray:
        images, count = self._padded_images(videos, "Flux")
        posterior = autoencoder_kl.encode(self.vae, self.vae_params, images)
        latents = autoencoder_kl.normalize_latents(
            posterior.mean.astype(jnp.float32), self.vae.config
        )
        return np.asarray(latents, np.float32)[:count]

    def encode_text(self, captions: Sequence[str]) -> dict[str, np.ndarray]:
        padded, count = self._padded(list(captions), "captions")
        encoded = encode_text(self.text, padded, self.max_sequence_length)
        return {name: value[:count] for name, value in encoded.items()}


class FluxFamily(Family):
    name = "flux"
    description = "Flux.1 dev / schnell text-to-image (FluxPipeline)"
    # FluxControlNetPipeline: the same components plus controlnet (flux_control)
    pipeline_classes = ("FluxPipeline", "FluxControlNetPipeline")
    denoiser_classes = ("FluxTransformer2DModel",)
    denoiser_component = "transformer"
    objective = "flow_matching"
    # diffusers' train_dreambooth_lora_flux.py defaults: attention and feed-forward layers
    lora_default_targets = (
        "attn.to_k",
        "attn.to_q",
        "attn.to_v",
        "attn.to_out.0",
        "attn.add_k_proj",
        "attn.add_q_proj",
        "attn.add_v_proj",
        "attn.to_add_out",
        "ff.net.0.proj",
        "ff.net.2",
        "ff_context.net.0.proj",
        "ff_context.net.2",
    )

    denoiser_model = DenoiserModel(
        kind=flux_transformer.KIND,
        weight_map=flux_transformer.weight_map,
        config_error=flux_transformer.FluxConfigError,
    )

    def component_config_classes(self) -> dict[str, type]:
        return {
            "transformer": flux_transformer.FluxTransformerConfig,
            "vae": autoencoder_kl.AutoencoderKLConfig,
            "text_encoder": clip_text.CLIPTextConfig,
            "text_encoder_2": t5.T5Config,
        }

    # --- the denoiser -----------------------------------------------------------------------
    def apply(self, module, params, latents, timestep, conditioning, run_stack=None):
        """Pack ``latents [B, C, h, w]``, run the transformer at ``timestep / 1000``, unpack;
        with ControlNets (:class:`jaxcore.control.Controlled`) their residuals first."""
        _, _, h, w = latents.shape
        text = conditioning[TEXT]
        tokens = flux_transformer.pack_latents(latents.astype(module.dtype))
        t = timestep.astype(jnp.float32) / 1000.0
        image_ids = flux_transformer.latent_image_ids(h, w)
        text_ids = np.zeros((text.shape[1], 3), np.float32)
        control_kwargs = {}
        if isinstance(module, control.Controlled):
            samples = flux_control.residuals(
                module,
                params,
                tokens,
                t,
                text_ids,
                image_ids,
                conditioning,
                conditioning.get(GUIDANCE),
            )
            control_kwargs = {
                "controlnet_block_samples": samples[0],
                "controlnet_single_block_samples": samples[1],
                "controlnet_blocks_repeat": flux_control.blocks_repeat(module),
            }
            module, params = module.denoiser, params["denoiser"]
        guidance = conditioning.get(GUIDANCE)
        if module.config.guidance_embeds and guidance is None:
            raise FamilyError("this Flux model embeds guidance: the conditioning needs 'guidance'")
        out = module.apply(
            {"params": params},
            tokens,
            text.astype(module.dtype),
            conditioning[POOLED].astype(module.dtype),
            t,
            image_ids,
            text_ids,
            guidance if module.config.guidance_embeds else None,
            run_stack=run_stack,
            **control_kwargs,
        )
        if run_stack is None:
            return flux_transformer.unpack_latents(out, h, w)
        out, extra = out
        return flux_transformer.unpack_latents(out, h, w), extra

    def flops_per_forward(self, config, batch, latent_shape, conditioning_shapes):
        text_tokens = conditioning_shapes[TEXT][0]
        image_tokens = self.tokens_per_example(config, latent_shape)
        return flux_transformer.flops_per_forward(config, batch, image_tokens, text_tokens)

    def attention_flops_per_forward(self, config, batch, latent_shape, conditioning_shapes):
        text_tokens = conditioning_shapes[TEXT][0]
        image_tokens = self.tokens_per_example(config, latent_shape)
        return flux_transformer.joint_attention_flops(config, batch, image_tokens, text_tokens)

    def tokens_per_example(self, config, latent_shape):
        _, h, w = latent_shape
        return (h // PACK) * (w // PACK)

    def lora_to_diffusers(self, state_dict, denoiser_config, where: str):
        from jaxcore.lora import flux

        return flux.to_diffusers(state_dict, denoiser_config, where)

    def check_heads(self, config, mesh) -> None:
        sharding.check_divisible(mesh, heads=config.num_attention_heads)

    # --- conditioning and latents -----------------------------------------------------------
    def conditioning_specs(self, denoiser_config, text_length, latent_shape, image_tokens=None):
        del latent_shape, image_tokens
        return (
            TensorSpec(TEXT, (text_length, denoiser_config.joint_attention_dim)),
            TensorSpec(POOLED, (denoiser_config.pooled_projection_dim,)),
        )

    def latent_channels(self, denoiser_config) -> int:
        return denoiser_config.in_channels // (PACK * PACK)

    def geometry(self, configs) -> Geometry:
        return Geometry(
            spatial_multiple=configs["vae"].spatial_compression * PACK, temporal_multiple=0
        )

    def latent_shape(self, configs, height, width, num_frames):
        vae = configs["vae"]
        s = vae.spatial_compression
        return (vae.latent_channels, height // s, width // s)

    def load_encoders(self, directory, compute, max_sequence_length, batch_size):
        return FluxEncoders(Path(directory), compute, max_sequence_length, batch_size)

    def latent_normalization(self, configs) -> dict:
        vae = configs["vae"]
        return {
            "latent_sampling": "mean",
            "formula": "(z - shift_factor) * scaling_factor",
            "shift_factor": vae.shift_factor,
            "scaling_factor": vae.scaling_factor,
        }

    # --- inference --------------------------------------------------------------------------
    def default_scheduler_config(self) -> dict:
        return dict(REFERENCE_SCHEDULER_CONFIG)

    def load_components(self, directory, configs, compute, mesh, rules, denoiser):
        module = denoiser[0]
        vae = _load_vae(directory, compute, mesh, rules)
        channels = self.latent_channels(module.config)
        if channels != vae[0].config.latent_channels:
            raise FamilyError(
                f"{directory}: transformer in_channels {module.config.in_channels} (= 4 x "
                f"{channels}) do not fit the vae's latent_channels {vae[0].config.latent_channels}"
            )
        # Text encoders outside the mesh: their params are replicated, nothing is lost.
        return {"components": {"vae": vae, **_load_text_encoders(directory, compute)}}

    def load_controlnets(self, directory, denoiser_config, compute, mesh, rules, given):
        """FluxControlNetModel folders (``controlnet=``, else the pipeline's own ``controlnet``,
        ``controlnet_1``, ...), with the transformer's module keywords; each checked to fit it.
        They stay in their dtype under ``compute.quantization`` (only the transformer is)."""
        folders = control.chosen_folders(directory, given)
        if not folders:
            return None
        kwargs = dict(compute.denoiser_kwargs)
        nets = flux_control.load_controlnets(folders, kwargs, mesh, rules)
        flux_control.check_against(nets, denoiser_config)
        return nets

    def control_conditioning(self, pipe, controls, height: int, width: int, positive):
        """The Flux ControlNets' tensors (:func:`flux_control.conditioning`): VAE-encoded
        packed control images, union modes, scales, windows and the positive prompt's text."""
        text = (positive[TEXT], positive[POOLED])
        return flux_control.conditioning(pipe, controls, height, width, text)

    def encode_prompts(self, pipe, prompts, max_sequence_length):
        if max_sequence_length > 512:
            raise FamilyError(
                f"max_sequence_length cannot exceed 512 for Flux, got {max_sequence_length}"
            )
        return encode_text(pipe.components, prompts, max_sequence_length)

    def decode(self, pipe, latents, conditioning=None):
        del conditioning  # decoding takes no per-prompt settings
        vae, params = pipe.components["vae"]
        z = autoencoder_kl.denormalize_latents(jnp.asarray(latents, jnp.float32), vae.config)
        return decoded_frames(autoencoder_kl.decode(vae, params, z.astype(vae.dtype)))

    def sampling_defaults(self, configs) -> dict:
        # FluxPipeline.__call__'s defaults
        size = DEFAULT_SAMPLE_SIZE * configs["vae"].spatial_compression
        return {
            "height": size,
            "width": size,
            "num_frames": 1,
            "num_inference_steps": 28,
            "guidance_scale": 3.5,
        }

    def default_scheduler(self, scheduler_config) -> str:
        return flow_match.scheduler_name(scheduler_config, "Flux")

    def make_schedule(self, pipe, scheduler, num_inference_steps, shift, latent_shape):
        _, _, h, w = latent_shape
        mu = flow_match.config_mu(pipe.scheduler_config, (h // PACK) * (w // PACK))
        return flow_match.image_schedule(pipe, scheduler, num_inference_steps, shift, mu, "Flux")

    def guidance(
        self,
        configs,
        *,
        guidance_scale: float,
        true_cfg_scale: float,
        guidance_scale_2: float | None = None,
    ) -> Guidance:
        if guidance_scale_2 is not None:
            raise FamilyError(
                f"guidance_scale_2={guidance_scale_2}: Flux has one denoiser; guidance_scale_2 is "
                "the second expert's scale of two-expert models (Wan 2.2 A14B)"
            )
        embedded = {}
        if configs["transformer"].guidance_embeds:
            embedded[GUIDANCE] = float(guidance_scale)
        return Guidance(cfg_scale=float(true_cfg_scale), embedded=embedded)
