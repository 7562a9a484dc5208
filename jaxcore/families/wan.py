"""Wan 2.1 text-to-video as a family: the twin of diffusers' ``WanPipeline``.

Reference: ``diffusers/pipelines/wan/pipeline_wan.py`` (``WanPipeline.__call__``):

- prompts -> UMT5 embeddings, trimmed to each prompt's length and zero-padded to
  ``max_sequence_length`` (:mod:`jaxcore.text`): the conditioning ``encoder_hidden_states``;
- latents ``[z_dim, (num_frames - 1) // 4 + 1, height // 8, width // 8]``, normalised with the
  VAE's ``latents_mean`` / ``latents_std``;
- the denoiser (``WanTransformer3DModel``) predicts the flow velocity at timesteps on the
  0..1000 scale; guidance is classifier-free (``guidance_scale``, on when > 1);
- the scheduler is the pipeline's (UniPC with flow sigmas for Wan 2.1; flow-match Euler too);
- latents ``* latents_std + latents_mean`` -> VAE decode -> ``video / 2 + 0.5`` in [0, 1].

Wan 2.2 (``transformer_2``, ``expand_timesteps``) and image-to-video are refused with an error.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from jaxcore import sharding, weights
from jaxcore.compute import ComputeConfig
from jaxcore.families.base import (
    Encoders,
    Family,
    FamilyError,
    Geometry,
    Guidance,
    TensorSpec,
    read_scheduler_config,
)
from jaxcore.models import umt5, wan_transformer, wan_vae

log = logging.getLogger(__name__)

TEXT = "encoder_hidden_states"


def _pad_rows(array: np.ndarray, rows: int) -> np.ndarray:
    """Pad the leading axis to ``rows`` by repeating the last row (keeps values in range)."""
    extra = rows - array.shape[0]
    if extra <= 0:
        return array
    return np.concatenate([array, np.repeat(array[-1:], extra, axis=0)], axis=0)


class WanEncoders(Encoders):
    """The Wan VAE encoder + UMT5 + tokenizer of a pipeline directory (convert).

    Media -> the VAE posterior *mean* (no sampling), normalised ``(mean - latents_mean) /
    latents_std``; captions -> UMT5 embeddings ``[B, max_sequence_length, D]``, zero past each
    prompt's tokens, exactly as :func:`jaxcore.text.encode_prompts` (= WanPipeline).
    """

    def __init__(
        self, directory: Path, compute: ComputeConfig, max_sequence_length: int, batch_size: int
    ):
        from jaxcore import text

        self.batch_size = batch_size
        self.max_sequence_length = max_sequence_length
        started = time.perf_counter()
        self.vae, self.vae_params = wan_vae.load_wan_vae(directory / "vae", dtype=compute.dtype)
        self.text_encoder, self.text_params = umt5.load_umt5(
            directory / "text_encoder", dtype=compute.dtype, param_dtype=compute.param_dtype
        )
        self.tokenizer = text.load_tokenizer(directory / "tokenizer")
        log.info("loaded Wan encoders from %s in %.1fs", directory, time.perf_counter() - started)

    def _check_batch(self, count: int, what: str) -> int:
        if not 1 <= count <= self.batch_size:
            raise ValueError(f"{count} {what} do not fit in encoder batch_size={self.batch_size}")
        return count

    def encode_media(self, videos: np.ndarray) -> np.ndarray:
        count = self._check_batch(len(videos), "videos")
        padded = _pad_rows(np.asarray(videos, np.float32), self.batch_size)
        posterior = wan_vae.encode(self.vae, self.vae_params, padded)
        latents = wan_vae.normalize_latents(posterior.mean.astype("float32"), self.vae.config)
        return np.asarray(latents, np.float32)[:count]

    def encode_text(self, captions: Sequence[str]) -> dict[str, np.ndarray]:
        from jaxcore.text import encode_prompts

        self._check_batch(len(captions), "captions")
        embeddings, _ = encode_prompts(
            self.tokenizer,
            self.text_encoder,
            self.text_params,
            list(captions),
            self.max_sequence_length,
            pad_batch_to=self.batch_size,
        )
        return {TEXT: np.asarray(embeddings, np.float32)}


class WanFamily(Family):
    name = "wan"
    description = "Wan 2.1 text-to-video (WanPipeline)"
    pipeline_classes = ("WanPipeline",)
    denoiser_classes = ("WanTransformer3DModel",)
    denoiser_component = "transformer"
    objective = "flow_matching"
    # the attention projections (self- and cross-attention), as diffusers' Wan LoRA scripts
    lora_default_targets = ("to_q", "to_k", "to_v", "to_out.0")

    def component_config_classes(self) -> dict[str, type]:
        return {
            "transformer": wan_transformer.WanTransformerConfig,
            "vae": wan_vae.WanVAEConfig,
            "text_encoder": umt5.UMT5Config,
        }

    def check_model_index(self, index: Mapping, where: str) -> None:
        second = index.get("transformer_2")
        if second and any(second):
            raise FamilyError(f"{where}: transformer_2 (Wan 2.2 two-stage) is not supported")
        if index.get("expand_timesteps"):
            raise FamilyError(f"{where}: expand_timesteps=true (Wan 2.2 TI2V) is not supported")

    # --- the denoiser ---------------------------------------------------------------------
    def make_denoiser(self, config, compute: ComputeConfig, mesh=None):
        return wan_transformer.WanTransformer(config, mesh=mesh, **compute.denoiser_kwargs)

    def abstract_params(self, module):
        return wan_transformer.abstract_params(module)

    def init_denoiser(self, config, rng, compute: ComputeConfig, mesh=None, rules=None):
        return wan_transformer.init_wan_transformer(
            config, rng, mesh=mesh, rules=rules, **compute.denoiser_kwargs
        )

    def load_denoiser(self, directory, compute: ComputeConfig, mesh=None, rules=None):
        try:
            return wan_transformer.load_wan_transformer(
                directory, mesh=mesh, rules=rules, **compute.denoiser_kwargs
            )
        except wan_transformer.WanConfigError as err:
            raise FamilyError(f"{directory}/config.json: {err}") from None

    def apply(self, module, params, latents, timestep, conditioning):
        text = conditioning[TEXT].astype(module.dtype)
        return module.apply({"params": params}, latents.astype(module.dtype), timestep, text)

    def export_denoiser(self, module, params):
        state = weights.export_state_dict(params, wan_transformer.weight_map(module.config))
        return state, {"_class_name": "WanTransformer3DModel", **module.config.to_dict()}

    def flops_per_forward(self, config, batch, latent_shape, conditioning_shapes):
        text_tokens = conditioning_shapes[TEXT][0]
        video_tokens = self.tokens_per_example(config, latent_shape)
        return wan_transformer.flops_per_forward(config, batch, video_tokens, text_tokens)

    def tokens_per_example(self, config, latent_shape):
        _, f, h, w = latent_shape
        pt, ph, pw = config.patch_size
        return (f // pt) * (h // ph) * (w // pw)

    def lora_to_diffusers(self, state_dict, denoiser_config, where: str):
        from jaxcore.lora import wan

        return wan.to_diffusers(state_dict, denoiser_config, where)

    def lora_weight_map(self, denoiser_config):
        """diffusers weight keys of the denoiser -> our parameters (where LoRA deltas go)."""
        return wan_transformer.weight_map(denoiser_config)

    def check_heads(self, config, mesh) -> None:
        sharding.check_divisible(mesh, heads=config.num_attention_heads)

    # --- conditioning and latents ---------------------------------------------------------
    def conditioning_specs(self, denoiser_config, text_length: int):
        return (TensorSpec(TEXT, (text_length, denoiser_config.text_dim)),)

    def latent_channels(self, denoiser_config) -> int:
        return denoiser_config.in_channels

    def geometry(self, configs) -> Geometry:
        vae, transformer = configs["vae"], configs["transformer"]
        _, ph, pw = transformer.patch_size
        spatial = vae.spatial_compression * math.lcm(ph, pw)
        return Geometry(spatial_multiple=spatial, temporal_multiple=vae.temporal_compression)

    def latent_shape(self, configs, height, width, num_frames):
        vae = configs["vae"]
        t, s = vae.temporal_compression, vae.spatial_compression
        return (vae.z_dim, (num_frames - 1) // t + 1, height // s, width // s)

    def load_encoders(self, directory, compute, max_sequence_length, batch_size):
        return WanEncoders(Path(directory), compute, max_sequence_length, batch_size)

    def latent_normalization(self, configs) -> dict:
        vae = configs["vae"]
        return {
            "latent_sampling": "mean",
            "formula": "(z - latents_mean) / latents_std",
            "latents_mean": list(vae.latents_mean),
            "latents_std": list(vae.latents_std),
        }

    # --- inference ------------------------------------------------------------------------
    def load_pipeline(
        self, directory, compute: ComputeConfig, mesh=None, rules=None, denoiser=None
    ):
        from jaxcore import text
        from jaxcore.pipeline import Pipeline

        directory = Path(directory)
        rules = tuple(rules) if rules is not None else sharding.LOGICAL_AXIS_RULES
        configs = self.component_configs(directory)
        if denoiser is None:
            denoiser = self.load_denoiser(directory / "transformer", compute, mesh, rules)
        module, params = denoiser
        configs["transformer"] = module.config
        try:
            vae, vae_params = wan_vae.load_wan_vae(
                directory / "vae", dtype=compute.dtype, mesh=mesh, rules=rules
            )
            encoder, encoder_params = umt5.load_umt5(directory / "text_encoder", mesh=mesh)
        except (wan_vae.WanVAEConfigError, umt5.UMT5ConfigError) as err:
            raise FamilyError(f"{directory}: {err}") from None
        if module.config.in_channels != vae.config.z_dim:
            raise FamilyError(
                f"{directory}: transformer in_channels {module.config.in_channels} != "
                f"vae z_dim {vae.config.z_dim}"
            )
        return Pipeline(
            family=self,
            denoiser=module,
            denoiser_params=params,
            components={
                "vae": (vae, vae_params),
                "text_encoder": (encoder, encoder_params),
                "tokenizer": text.load_tokenizer(directory / "tokenizer"),
            },
            configs=configs,
            scheduler_config=read_scheduler_config(directory),
            mesh=mesh,
            rules=rules,
            source=str(directory),
        )

    def encode_prompts(self, pipe, prompts, max_sequence_length):
        from jaxcore import text

        encoder, params = pipe.components["text_encoder"]
        # Outside the mesh context: the text encoder's params are replicated, nothing is lost.
        embeddings, _ = text.encode_prompts(
            pipe.components["tokenizer"], encoder, params, list(prompts), max_sequence_length
        )
        return {TEXT: embeddings}

    def decode(self, pipe, latents):
        vae, params = pipe.components["vae"]
        z = wan_vae.denormalize_latents(jnp.asarray(latents, jnp.float32), vae.config)
        video_bcfhw = wan_vae.decode(vae, params, z.astype(vae.dtype))
        video = jnp.clip(video_bcfhw.astype(jnp.float32) / 2 + 0.5, 0.0, 1.0)
        return jnp.transpose(video, (0, 2, 3, 4, 1))

    def sampling_defaults(self, configs) -> dict:
        # WanPipeline.__call__'s defaults
        return {
            "height": 480,
            "width": 832,
            "num_frames": 81,
            "num_inference_steps": 50,
            "guidance_scale": 5.0,
        }

    def default_scheduler(self, scheduler_config) -> str:
        name = scheduler_config.get("_class_name", "UniPCMultistepScheduler")
        known = {
            "UniPCMultistepScheduler": "unipc",
            "FlowMatchEulerDiscreteScheduler": "flow_euler",
        }
        if name not in known:
            raise FamilyError(
                f"scheduler {name!r} is not supported for Wan; known: {sorted(known)}"
            )
        return known[name]

    def make_schedule(self, pipe, scheduler, num_inference_steps, shift, latent_shape):
        from jaxcore.schedulers import make_scheduler
        from jaxcore.schedulers.flow_euler import flow_euler_options
        from jaxcore.schedulers.unipc import unipc_options

        where = f"{pipe.source}/scheduler/scheduler_config.json"
        config = pipe.scheduler_config
        try:
            if scheduler == "unipc":
                options = unipc_options(config, where)
            elif config.get("_class_name") == "FlowMatchEulerDiscreteScheduler":
                options = {"euler_options": flow_euler_options(config, where)}
            else:  # Euler on a pipeline configured for UniPC: its training-timestep count only
                options = {"num_train_timesteps": int(config.get("num_train_timesteps", 1000))}
            return make_scheduler(
                scheduler, num_inference_steps, shift, sample_shape=latent_shape, **options
            )
        except ValueError as err:
            raise FamilyError(f"{where}: {err}") from None

    def guidance(self, configs, *, guidance_scale: float, true_cfg_scale: float) -> Guidance:
        if true_cfg_scale != 1.0:
            raise FamilyError(
                f"true_cfg_scale={true_cfg_scale}: Wan has no true CFG; its guidance_scale is "
                "the classifier-free guidance scale"
            )
        return Guidance(cfg_scale=float(guidance_scale))
