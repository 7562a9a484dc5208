"""Wan 2.1 / 2.2 as a family: the twin of diffusers' ``WanPipeline`` and
``WanImageToVideoPipeline``.

Reference: ``diffusers/pipelines/wan/pipeline_wan.py`` (``WanPipeline.__call__``) and
``pipeline_wan_i2v.py`` (diffusers 0.42). Text-to-video:

- prompts -> UMT5 embeddings, trimmed to each prompt's length and zero-padded to
  ``max_sequence_length`` (:mod:`jaxcore.text`): the conditioning ``encoder_hidden_states``;
- latents ``[z_dim, (num_frames - 1) // 4 + 1, height // 8, width // 8]``, normalised with the
  VAE's ``latents_mean`` / ``latents_std``;
- the denoiser (``WanTransformer3DModel``) predicts the flow velocity at timesteps on the
  0..1000 scale; guidance is classifier-free (``guidance_scale``, on when > 1);
- the scheduler is the pipeline's (UniPC with flow sigmas for Wan 2.1; flow-match Euler too);
- latents ``* latents_std + latents_mean`` -> VAE decode -> ``video / 2 + 0.5`` in [0, 1].

Variants, all read from ``model_index.json`` and the component configs:

- two experts (Wan 2.2 A14B): ``transformer_2`` + ``boundary_ratio``; the first expert predicts
  while ``t >= boundary_ratio * num_train_timesteps``, then the second, with
  ``guidance_scale_2`` (default ``guidance_scale``); see :mod:`jaxcore.sampling`.
- image-to-video by channel concatenation (Wan 2.1 I2V, Wan 2.2 I2V A14B): the image (and a
  ``last_image``) placed in an otherwise black clip, VAE-encoded (posterior mode, normalised),
  with 4 mask channels marking the given frames: the denoiser takes
  ``[latents, mask, condition]`` (``in_channels = 2 z + 4``). Wan 2.1 I2V also feeds the CLIP
  vision encoder's penultimate hidden states to its image cross-attention.
- Wan 2.2 TI2V (``expand_timesteps``): the image's latent replaces the first latent frame at
  every step, whose tokens get timestep 0; text-to-video and image-to-video from one model.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from jaxcore import sampling, sharding, weights
from jaxcore.compute import ComputeConfig
from jaxcore.families.base import (
    IMAGE_TOKENS_FEATURE,
    TEXT_FEATURE,
    DenoiserModel,
    Encoders,
    Family,
    FamilyError,
    Geometry,
    Guidance,
    ImageInputs,
    TensorSpec,
    decoded_frames,
    read_model_index,
    read_scheduler_config,
)
from jaxcore.models import umt5, wan_transformer, wan_vae
from jaxcore.pipeline import SecondExpert, to_host

log = logging.getLogger(__name__)

TEXT = TEXT_FEATURE
# image-to-video conditioning tensors (see the module docstring)
IMAGE_CONDITION = "image_condition"  # [T + z, F', H', W']: T mask channels + encoded clip
IMAGE_EMBEDS = IMAGE_TOKENS_FEATURE  # [tokens, image_dim]: CLIP vision penultimate hidden states
FIRST_FRAME = "first_frame_latents"  # [z, 1, H', W']: TI2V's encoded conditioning image
FIRST_FRAME_WEIGHT = "first_frame_weight"  # []: 1 where an image conditions the row, else 0

# What diffusers writes for a flow-matching Wan 2.1 pipeline (UniPC with flow sigmas, flow_shift
# 3): the scheduler of a model YAML, which names none.
REFERENCE_SCHEDULER_CONFIG: dict[str, object] = {
    "_class_name": "UniPCMultistepScheduler",
    "beta_end": 0.02,
    "beta_schedule": "linear",
    "beta_start": 0.0001,
    "disable_corrector": [],
    "dynamic_thresholding_ratio": 0.995,
    "final_sigmas_type": "zero",
    "flow_shift": 3.0,
    "lower_order_final": True,
    "num_train_timesteps": 1000,
    "predict_x0": True,
    "prediction_type": "flow_prediction",
    "rescale_betas_zero_snr": False,
    "sample_max_value": 1.0,
    "solver_order": 2,
    "solver_p": None,
    "solver_type": "bh2",
    "steps_offset": 0,
    "thresholding": False,
    "timestep_spacing": "linspace",
    "trained_betas": None,
    "use_beta_sigmas": False,
    "use_exponential_sigmas": False,
    "use_flow_sigmas": True,
    "use_karras_sigmas": False,
}


@dataclasses.dataclass(frozen=True)
class WanPipelineOptions:
    """What ``model_index.json`` says beyond the components (diffusers' registered config)."""

    pipeline_class: str = "WanPipeline"
    boundary_ratio: float | None = None
    expand_timesteps: bool = False
    second_expert: bool = False  # a transformer_2 component
    image_encoder: bool = False  # a CLIP vision image_encoder component

    @classmethod
    def from_index(cls, index: Mapping) -> WanPipelineOptions:
        def present(key):
            value = index.get(key)
            return bool(value) and any(v is not None for v in value)

        ratio = index.get("boundary_ratio")
        return cls(
            pipeline_class=str(index.get("_class_name", "WanPipeline")),
            boundary_ratio=None if ratio is None else float(ratio),
            expand_timesteps=bool(index.get("expand_timesteps", False)),
            second_expert=present("transformer_2"),
            image_encoder=present("image_encoder"),
        )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping) -> WanPipelineOptions:
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data})


def _pad_rows(array: np.ndarray, rows: int) -> np.ndarray:
    """Pad the leading axis to ``rows`` by repeating the last row (keeps values in range)."""
    extra = rows - array.shape[0]
    if extra <= 0:
        return array
    return np.concatenate([array, np.repeat(array[-1:], extra, axis=0)], axis=0)


def pixels(image, height: int, width: int) -> np.ndarray:
    """A PIL image -> ``[3, height, width]`` float32 in [-1, 1], as diffusers' VideoProcessor
    preprocesses a conditioning image (PIL Lanczos resize to the render size, then /255, x2-1).
    Images that are not RGB are converted (diffusers would fail on them)."""
    from PIL import Image

    resized = image.resize((width, height), resample=Image.LANCZOS, reducing_gap=None)
    if resized.mode != "RGB":
        resized = resized.convert("RGB")
    array = np.asarray(resized, np.float32) / 255.0
    return np.transpose(array * 2.0 - 1.0, (2, 0, 1))


def i2v_mask(num_frames: int, latent_frames: int, folded: int, last_image: bool) -> np.ndarray:
    """The mask channels of image-to-video, ``[folded, latent_frames]`` (``folded``: pixel
    frames per latent frame, 4 for the real VAEs): per latent frame, which of the pixel frames
    it folds are given (the first frame counts ``folded`` times, as diffusers'
    ``prepare_latents`` repeats it to fill the first latent frame's group)."""
    given = np.zeros(num_frames, np.float32)
    given[0] = 1.0
    if last_image:
        given[-1] = 1.0
    frames = np.concatenate([np.repeat(given[:1], folded), given[1:]])
    return frames.reshape(latent_frames, folded).T


def encode_clips(vae, params, clips_bcfhw) -> np.ndarray:
    """Clips ``[B, 3, F, H, W]`` in [-1, 1] -> normalised posterior modes (= means; diffusers'
    ``sample_mode="argmax"`` for conditioning, the records' latents for training)."""
    posterior = wan_vae.encode(vae, params, jnp.asarray(clips_bcfhw, vae.dtype))
    z = wan_vae.normalize_latents(posterior.mean.astype(jnp.float32), vae.config)
    return np.asarray(z, np.float32)


def image_condition(encode, firsts, lasts, num_frames: int, folded: int) -> np.ndarray:
    """Image-to-video's channel-concatenated conditioning ``[B, folded + z, F', H', W']``.

    ``firsts``: ``[B, 3, H, W]`` in [-1, 1]; ``lasts``: per row a last frame or None.
    Each row's clip ``[first, 0..., last?]`` is encoded by ``encode`` (clips -> normalised
    latents, all rows at once) and put behind the mask of its given frames."""
    firsts = np.asarray(firsts, np.float32)
    rows, _, height, width = firsts.shape
    clips = np.zeros((rows, 3, num_frames, height, width), np.float32)
    clips[:, :, 0] = firsts
    for row, last in enumerate(lasts):
        if last is not None:
            clips[row, :, -1] = last
    latents = np.asarray(encode(clips), np.float32)[:rows]
    _, _, frames, h, w = latents.shape
    masks = np.stack([i2v_mask(num_frames, frames, folded, last is not None) for last in lasts])
    masks = np.broadcast_to(masks[:, :, :, None, None], masks.shape + (h, w))
    return np.concatenate([masks, latents], axis=1).astype(np.float32)


def image_embeddings(encode, params, processor, images) -> np.ndarray:
    """Wan 2.1 I2V: per row ``(image, last_image or None)`` (PIL) -> the CLIP vision
    penultimate hidden states ``[B, tokens, D]``, a last image's tokens after the first's
    (as the FLF2V transformer takes them)."""
    from jaxcore.models import clip_image_processor

    rows = []
    for image, last in images:
        given = [image] if last is None else [image, last]
        pixel_values = clip_image_processor.preprocess(given, processor)
        states = encode(params, jnp.asarray(pixel_values))  # [n, tokens, D]
        rows.append(np.asarray(states, np.float32).reshape(-1, states.shape[-1]))
    return np.stack(rows)


def to_pil(frame) -> object:
    """A frame ``[3, H, W]`` in [-1, 1] (the convert stage's pixels) -> the RGB PIL image it
    was made from (convert maps uint8 ``u`` to ``u / 127.5 - 1``, so this is exact)."""
    from PIL import Image

    array = np.rint((np.transpose(np.asarray(frame, np.float32), (1, 2, 0)) + 1.0) * 127.5)
    return Image.fromarray(np.clip(array, 0, 255).astype(np.uint8), "RGB")


def _load_image_encoder(directory: Path, compute: ComputeConfig, mesh=None, rules=None):
    """Wan 2.1 I2V's CLIP vision encoder -> (jitted encode, params, preprocessor config)."""
    from jaxcore.models import clip_image_processor, clip_vision

    try:
        # diffusers loads a CLIPVisionModel: no visual projection
        module, params = clip_vision.load_clip_vision(
            directory / "image_encoder",
            dtype=compute.dtype,
            mesh=mesh,
            rules=rules,
            with_projection=False,
        )
        processor = clip_image_processor.CLIPImageProcessorConfig.from_pretrained(
            directory / "image_processor"
        )
    except ValueError as err:
        raise FamilyError(f"{directory}: {err}") from None
    return clip_vision.encode_fn(module), params, processor


def _first_frame_mask(shape, weight):
    """``[B, 1, F, 1, 1]``: 1 - weight on the first latent frame, 1 elsewhere."""
    frames = jnp.arange(shape[2])[None, None, :, None, None]
    keep = (1.0 - weight.astype(jnp.float32)).reshape(-1, 1, 1, 1, 1)
    return jnp.where(frames == 0, keep, 1.0)


def _first_frame_inputs(config, latents, timestep, conditioning):
    """TI2V (diffusers' ``expand_timesteps``): the conditioning image's latent in place of the
    first frame, and per-token timesteps that are 0 on its tokens."""
    mask = _first_frame_mask(latents.shape, conditioning[FIRST_FRAME_WEIGHT])
    first = conditioning[FIRST_FRAME].astype(jnp.float32)
    x = (1 - mask) * first + mask * latents.astype(jnp.float32)
    b, _, f, h, w = latents.shape
    pt, ph, pw = config.patch_size
    # diffusers: (mask[0][0][:, ::2, ::2] * t).flatten() (its patch size is 2)
    token_mask = jnp.broadcast_to(mask, (b, 1, f, h, w))[:, 0, ::pt, ::ph, ::pw]
    per_token = token_mask * timestep.astype(jnp.float32).reshape(b, 1, 1, 1)
    return x, per_token.reshape(b, -1)


class WanEncoders(Encoders):
    """The Wan VAE encoder + UMT5 + tokenizer of a pipeline directory (convert).

    Media -> the VAE posterior *mean* (no sampling), normalised ``(mean - latents_mean) /
    latents_std``; captions -> UMT5 embeddings ``[B, max_sequence_length, D]``, zero past each
    prompt's tokens, exactly as :func:`jaxcore.text.encode_prompts` (= WanPipeline).

    Image-to-video pipelines: each clip's first frame (and its last, for a first-last-frame
    transformer) conditions it, encoded as inference encodes a conditioning image
    (:func:`image_condition`; Wan 2.1 I2V also :func:`image_embeddings`).
    """

    def __init__(
        self,
        directory: Path,
        compute: ComputeConfig,
        max_sequence_length: int,
        batch_size: int,
        configs: Mapping | None = None,
    ):
        from jaxcore import text

        self.batch_size = batch_size
        self.max_sequence_length = max_sequence_length
        started = time.perf_counter()
        self.vae, self.vae_params = wan_vae.load_wan_vae(
            directory / "vae", dtype=compute.dtype, encoder_only=True
        )
        self.text_encoder, self.text_params = umt5.load_umt5(
            directory / "text_encoder", dtype=compute.dtype, param_dtype=compute.param_dtype
        )
        self.tokenizer = text.load_tokenizer(directory / "tokenizer")
        transformer = (configs or {}).get("transformer")
        self.image_conditioned = transformer is not None and (
            transformer.in_channels != transformer.out_channels
        )
        self.last_frame = self.image_conditioned and transformer.pos_embed_seq_len is not None
        self.image_encoder = None
        if self.image_conditioned and "image_encoder" in configs:
            self.image_encoder = _load_image_encoder(directory, compute)
        log.info("loaded Wan encoders from %s in %.1fs", directory, time.perf_counter() - started)

    def encode_media(self, videos: np.ndarray) -> np.ndarray:
        count = self._check_batch(len(videos), "videos")
        padded = _pad_rows(np.asarray(videos, np.float32), self.batch_size)
        return encode_clips(self.vae, self.vae_params, padded)[:count]

    def encode_media_conditioning(self, videos: np.ndarray) -> dict[str, np.ndarray]:
        if not self.image_conditioned:
            return {}
        self._check_batch(len(videos), "videos")
        videos = np.asarray(videos, np.float32)
        firsts = videos[:, :, 0]
        lasts = [video[:, -1] if self.last_frame else None for video in videos]

        def encode(clips):  # padded to batch_size rows: the program encode_media compiled
            padded = _pad_rows(clips, self.batch_size)
            return encode_clips(self.vae, self.vae_params, padded)

        folded = self.vae.config.temporal_compression
        out = {IMAGE_CONDITION: image_condition(encode, firsts, lasts, videos.shape[2], folded)}
        if self.image_encoder is not None:
            encode_image, params, processor = self.image_encoder
            images = [
                (to_pil(first), None if last is None else to_pil(last))
                for first, last in zip(firsts, lasts, strict=True)
            ]
            out[IMAGE_EMBEDS] = image_embeddings(encode_image, params, processor, images)
        return out

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
    description = (
        "Wan 2.1 / 2.2 text-to-video and image-to-video (WanPipeline, WanImageToVideoPipeline)"
    )
    pipeline_classes = ("WanPipeline", "WanImageToVideoPipeline")
    denoiser_classes = ("WanTransformer3DModel",)
    denoiser_component = "transformer"
    objective = "flow_matching"
    # the attention projections (self- and cross-attention), as diffusers' Wan LoRA scripts
    lora_default_targets = ("to_q", "to_k", "to_v", "to_out.0")
    denoiser_model = DenoiserModel(
        kind=wan_transformer.KIND,
        weight_map=wan_transformer.weight_map,
        config_error=wan_transformer.WanConfigError,
    )

    def component_config_classes(self) -> dict[str, type]:
        return {
            "transformer": wan_transformer.WanTransformerConfig,
            "vae": wan_vae.WanVAEConfig,
            "text_encoder": umt5.UMT5Config,
        }

    def optional_config_classes(self) -> dict[str, type]:
        from jaxcore.models import clip_vision

        return {
            "transformer_2": wan_transformer.WanTransformerConfig,
            "image_encoder": clip_vision.CLIPVisionConfig,
            "pipeline": WanPipelineOptions,
        }

    def expert_component(self, configs, expert: str) -> str:
        if "transformer_2" not in configs:
            raise FamilyError(
                f"model.expert={expert}: not a two-expert pipeline (model_index.json with "
                "transformer_2 and boundary_ratio)"
            )
        if expert not in ("high", "low"):
            raise FamilyError(f"expert must be 'high' or 'low', got {expert!r}")
        return "transformer" if expert == "high" else "transformer_2"

    def second_expert_component(self, configs) -> str | None:
        return "transformer_2" if "transformer_2" in configs else None

    def expert_boundary_ratio(self, configs) -> float:
        return float(configs["pipeline"].boundary_ratio)

    def check_model_index(self, index: Mapping, where: str) -> None:
        ratio = index.get("boundary_ratio")
        if ratio is not None and not (
            isinstance(ratio, (int, float)) and not isinstance(ratio, bool) and 0 < ratio < 1
        ):
            raise FamilyError(f"{where}: boundary_ratio must be a number in (0, 1), got {ratio!r}")
        options = WanPipelineOptions.from_index(index)
        if ratio is not None and not options.second_expert:
            raise FamilyError(f"{where}: boundary_ratio={ratio} needs a transformer_2 component")

    def component_configs(self, directory) -> dict:
        """The transformer, VAE and UMT5 configs, with ``transformer_2`` / ``image_encoder``
        where the pipeline has them and the model_index options as ``pipeline``."""
        directory = Path(directory)
        configs = super().component_configs(directory)
        options = WanPipelineOptions.from_index(read_model_index(directory))
        if options.second_expert and options.boundary_ratio is not None:
            # diffusers runs transformer_2 only with a boundary_ratio; without one it is unused
            path = directory / "transformer_2"
            configs["transformer_2"] = self.denoiser_config(weights.read_config(path), path)
        if options.image_encoder:
            from jaxcore.models import clip_vision

            path = directory / "image_encoder"
            try:
                configs["image_encoder"] = clip_vision.CLIPVisionConfig.from_dict(
                    weights.read_config(path)
                )
            except (ValueError, TypeError, KeyError) as err:
                raise FamilyError(f"{path}/config.json: {err}") from None
        configs["pipeline"] = options
        self.check_configs(configs, directory)
        return configs

    def check_configs(self, configs, where) -> None:
        """The components must agree on one of the Wan variants (see the module docstring).
        Checks the transformer against the VAE (and the pipeline options, default: a plain
        ``WanPipeline``) where both are given."""
        if "transformer" not in configs or "vae" not in configs:
            return
        options = configs.get("pipeline", WanPipelineOptions())
        transformer = configs["transformer"]
        if ("transformer_2" in configs) != (
            options.second_expert and options.boundary_ratio is not None
        ):
            raise FamilyError(
                f"{where}: a transformer_2 goes with a pipeline that has second_expert and a "
                f"boundary_ratio (got second_expert={options.second_expert}, boundary_ratio="
                f"{options.boundary_ratio}, transformer_2 "
                + ("given)" if "transformer_2" in configs else "absent)")
            )
        z = configs["vae"].z_dim
        # one mask channel per pixel frame a latent frame folds (4 for the real VAEs)
        mask_channels = configs["vae"].temporal_compression
        if transformer.out_channels != z:
            raise FamilyError(
                f"{where}: transformer out_channels {transformer.out_channels} != vae z_dim {z}"
            )
        if transformer.in_channels not in (z, 2 * z + mask_channels):
            raise FamilyError(
                f"{where}: transformer in_channels {transformer.in_channels} fits no Wan variant "
                f"for vae z_dim {z}: {z} (text-to-video, TI2V) or {2 * z + mask_channels} "
                "(image-to-video)"
            )
        concat = transformer.in_channels != z
        if concat and options.pipeline_class != "WanImageToVideoPipeline":
            raise FamilyError(
                f"{where}: an image-to-video transformer (in_channels {transformer.in_channels}) "
                f"in a {options.pipeline_class}; diffusers runs it as WanImageToVideoPipeline"
            )
        if concat and options.expand_timesteps:
            raise FamilyError(f"{where}: expand_timesteps with an image-concatenating transformer")
        if (transformer.image_dim is not None) != ("image_encoder" in configs):
            raise FamilyError(
                f"{where}: transformer image_dim={transformer.image_dim} but the pipeline "
                + ("has no image_encoder" if transformer.image_dim else "has an image_encoder")
            )
        second = configs.get("transformer_2")
        if second is not None and second.in_channels != transformer.in_channels:
            raise FamilyError(
                f"{where}: transformer_2 in_channels {second.in_channels} != transformer's "
                f"{transformer.in_channels}"
            )
        if options.pipeline_class == "WanImageToVideoPipeline" and not (
            concat or options.expand_timesteps
        ):
            raise FamilyError(
                f"{where}: a WanImageToVideoPipeline needs an image-to-video transformer "
                f"(in_channels {2 * z + mask_channels}) or expand_timesteps"
            )

    # --- the denoiser ---------------------------------------------------------------------
    def apply(self, module, params, latents, timestep, conditioning, run_stack=None):
        x = latents
        if FIRST_FRAME in conditioning:
            x, timestep = _first_frame_inputs(module.config, x, timestep, conditioning)
        if IMAGE_CONDITION in conditioning:
            x = jnp.concatenate([x, conditioning[IMAGE_CONDITION].astype(x.dtype)], axis=1)
        args = [x.astype(module.dtype), timestep, conditioning[TEXT].astype(module.dtype)]
        if IMAGE_EMBEDS in conditioning:
            args.append(conditioning[IMAGE_EMBEDS].astype(module.dtype))
        return module.apply({"params": params}, *args, run_stack=run_stack)

    def finish_latents(self, latents, conditioning):
        """TI2V: the first latent frame is the conditioning image's (diffusers blends after
        the loop too); other variants: as is."""
        if FIRST_FRAME not in conditioning:
            return latents
        mask = _first_frame_mask(latents.shape, conditioning[FIRST_FRAME_WEIGHT])
        return (1 - mask) * conditioning[FIRST_FRAME] + mask * latents

    def flops_per_forward(self, config, batch, latent_shape, conditioning_shapes):
        text_tokens = conditioning_shapes[TEXT][0]
        video_tokens = self.tokens_per_example(config, latent_shape)
        image_tokens = conditioning_shapes.get(IMAGE_EMBEDS, (0,))[0]
        return wan_transformer.flops_per_forward(
            config, batch, video_tokens, text_tokens, image_tokens=image_tokens
        )

    def attention_flops_per_forward(self, config, batch, latent_shape, conditioning_shapes):
        video_tokens = self.tokens_per_example(config, latent_shape)
        return wan_transformer.self_attention_flops(config, batch, video_tokens)

    def tokens_per_example(self, config, latent_shape):
        _, f, h, w = latent_shape
        pt, ph, pw = config.patch_size
        return (f // pt) * (h // ph) * (w // pw)

    def lora_to_diffusers(self, state_dict, denoiser_config, where: str):
        from jaxcore.lora import wan

        return wan.to_diffusers(state_dict, denoiser_config, where)

    def check_heads(self, config, mesh) -> None:
        sharding.check_divisible(mesh, heads=config.num_attention_heads)

    # --- conditioning and latents ---------------------------------------------------------
    def conditioning_specs(self, denoiser_config, text_length, latent_shape, image_tokens=None):
        """Text; image-to-video adds the mask + encoded clip (``in - out`` channels on the
        latent grid) and, with image cross-attention, the CLIP tokens (a first-last-frame
        transformer takes exactly its ``pos_embed_seq_len``)."""
        config = denoiser_config
        specs = [TensorSpec(TEXT, (text_length, config.text_dim))]
        if config.in_channels != config.out_channels:
            channels = config.in_channels - config.out_channels
            specs.append(TensorSpec(IMAGE_CONDITION, (channels, *tuple(latent_shape)[1:])))
        if config.image_dim is not None:
            tokens = config.pos_embed_seq_len or image_tokens
            if not tokens:
                raise FamilyError("an image cross-attention transformer needs image_tokens")
            specs.append(TensorSpec(IMAGE_EMBEDS, (tokens, config.image_dim)))
        return tuple(specs)

    def image_tokens(self, configs) -> int | None:
        encoder = configs.get("image_encoder")
        if encoder is None:
            return None
        return (encoder.image_size // encoder.patch_size) ** 2 + 1  # patches + class token

    def latent_channels(self, denoiser_config) -> int:
        return denoiser_config.out_channels

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
        configs = self.component_configs(directory)
        return WanEncoders(Path(directory), compute, max_sequence_length, batch_size, configs)

    def latent_normalization(self, configs) -> dict:
        vae = configs["vae"]
        return {
            "latent_sampling": "mean",
            "formula": "(z - latents_mean) / latents_std",
            "latents_mean": list(vae.latents_mean),
            "latents_std": list(vae.latents_std),
        }

    # --- inference ------------------------------------------------------------------------
    def default_scheduler_config(self) -> dict:
        return dict(REFERENCE_SCHEDULER_CONFIG)

    def load_components(
        self, directory, configs, compute, mesh, rules, denoiser, second_denoiser=None
    ):
        """The VAE, UMT5 and its tokenizer, the CLIP vision encoder (Wan 2.1 I2V) and a
        two-expert pipeline's second expert; ``second_denoiser`` replaces ``transformer_2``
        (a fine-tuned low-noise expert) as ``denoiser`` replaces ``transformer``."""
        from jaxcore import text

        fields = {}
        if "transformer_2" in configs:
            fields = self._second_expert(
                directory, configs, compute, mesh, rules, denoiser[1], second_denoiser
            )
        components = self._vae_and_encoders(directory, configs, compute, mesh, rules)
        components["tokenizer"] = text.load_tokenizer(directory / "tokenizer")
        return {"components": components, **fields}

    def _second_expert(self, directory, configs, compute, mesh, rules, params, second) -> dict:
        """The Pipeline fields of Wan 2.2 A14B's low-noise expert. With idle_expert=host the
        first expert leaves the devices before the second loads, so the two never need
        device memory together."""
        first_host = to_host(params) if compute.idle_expert == "host" else None
        if second is None:
            second = self.load_denoiser(
                directory / "transformer_2", compute, mesh, rules, quantize=True
            )
        module_2, params_2 = second
        configs["transformer_2"] = module_2.config
        boundary = sampling.boundary_timestep(
            configs["pipeline"].boundary_ratio,
            int(read_scheduler_config(directory).get("num_train_timesteps", 1000)),
        )
        expert = SecondExpert(module_2, params_2, float(boundary), compute.idle_expert)
        if first_host is None:
            return {"second_expert": expert}
        host_experts = (first_host, to_host(params_2))
        expert.params = None
        return {"second_expert": expert, "_host_experts": host_experts, "denoiser_params": None}

    def _vae_and_encoders(self, directory, configs, compute, mesh, rules) -> dict:
        """The VAE, UMT5 and (Wan 2.1 I2V) the CLIP vision encoder with its preprocessor."""
        try:
            vae, vae_params = wan_vae.load_wan_vae(
                directory / "vae", dtype=compute.dtype, mesh=mesh, rules=rules
            )
            encoder, encoder_params = umt5.load_umt5(directory / "text_encoder", mesh=mesh)
        except (wan_vae.WanVAEConfigError, umt5.UMT5ConfigError) as err:
            raise FamilyError(f"{directory}: {err}") from None
        components = {"vae": (vae, vae_params), "text_encoder": (encoder, encoder_params)}
        if "image_encoder" in configs:
            encode, params, processor = _load_image_encoder(directory, compute, mesh, rules)
            components["image_encoder"] = (encode, params)
            components["image_processor"] = processor
        return components

    def encode_prompts(self, pipe, prompts, max_sequence_length):
        from jaxcore import text

        encoder, params = pipe.components["text_encoder"]
        # Outside the mesh context: the text encoder's params are replicated, nothing is lost.
        embeddings, _ = text.encode_prompts(
            pipe.components["tokenizer"], encoder, params, list(prompts), max_sequence_length
        )
        return {TEXT: embeddings}

    def decode(self, pipe, latents, conditioning=None):
        del conditioning  # decoding takes no per-prompt settings
        vae, params = pipe.components["vae"]
        z = wan_vae.denormalize_latents(jnp.asarray(latents, jnp.float32), vae.config)
        return decoded_frames(wan_vae.decode(vae, params, z.astype(vae.dtype)))

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

    def guidance(
        self,
        configs,
        *,
        guidance_scale: float,
        true_cfg_scale: float,
        guidance_scale_2: float | None = None,
    ) -> Guidance:
        if true_cfg_scale != 1.0:
            raise FamilyError(
                f"true_cfg_scale={true_cfg_scale}: Wan has no true CFG; its guidance_scale is "
                "the classifier-free guidance scale"
            )
        if "transformer_2" not in configs:
            if guidance_scale_2 is not None:
                raise FamilyError(
                    f"guidance_scale_2={guidance_scale_2}: the pipeline has one transformer "
                    "(guidance_scale_2 is for two-expert Wan 2.2 models with a boundary_ratio)"
                )
            return Guidance(cfg_scale=float(guidance_scale))
        second = guidance_scale if guidance_scale_2 is None else guidance_scale_2
        return Guidance(cfg_scale=float(guidance_scale), cfg_scale_2=float(second))

    # --- image-to-video -------------------------------------------------------------------
    def image_inputs(self, configs) -> ImageInputs:
        options, transformer = configs["pipeline"], configs["transformer"]
        if options.expand_timesteps:
            # TI2V: diffusers conditions on the first frame only (a last_image is ignored)
            return ImageInputs("optional", last_image=False)
        if transformer.in_channels == transformer.out_channels:
            return ImageInputs("none")
        if transformer.image_dim is None:  # Wan 2.2 I2V: the mask marks the last frame too
            return ImageInputs("required", last_image=True)
        # Wan 2.1: two CLIP embeddings fit only a transformer with FLF2V position embeddings
        return ImageInputs("required", last_image=transformer.pos_embed_seq_len is not None)

    def encode_images(self, pipe, images, height, width, num_frames, settings=None):
        del settings
        inputs = self.image_inputs(pipe.configs)
        inputs.check_rows(images)
        if inputs.image == "none":
            return {}
        if not height:
            raise FamilyError("Wan image conditioning needs the render size")
        shape = self.latent_shape(pipe.configs, height, width, num_frames)
        if pipe.configs["pipeline"].expand_timesteps:
            return self._first_frame_conditioning(pipe, images, height, width, shape)
        out = self._concat_conditioning(pipe, images, height, width, num_frames)
        if "image_encoder" in pipe.configs:
            out[IMAGE_EMBEDS] = self._image_embeddings(pipe, images)
        return out

    def _encode_pixels(self, pipe, video_bcfhw: np.ndarray) -> np.ndarray:
        vae, params = pipe.components["vae"]
        return encode_clips(vae, params, video_bcfhw)

    def _first_frame_conditioning(self, pipe, images, height, width, shape):
        """TI2V: each row's image encoded alone (one latent frame), weight 1; rows without
        an image get zeros and weight 0 (then the loop is plain text-to-video)."""
        z, _, h, w = shape
        latents = np.zeros((len(images), z, 1, h, w), np.float32)
        weight = np.zeros((len(images),), np.float32)
        for row, (image, _) in enumerate(images):
            if image is not None:
                clip = pixels(image, height, width)[None, :, None]
                latents[row] = self._encode_pixels(pipe, clip)[0]
                weight[row] = 1.0
        return {FIRST_FRAME: latents, FIRST_FRAME_WEIGHT: weight}

    def _concat_conditioning(self, pipe, images, height, width, num_frames):
        """I2V: per row the clip ``[image, black..., last_image?]`` encoded, behind the mask."""
        firsts = np.stack([pixels(image, height, width) for image, _ in images])
        lasts = [None if last is None else pixels(last, height, width) for _, last in images]

        def encode(clips):  # one row at a time, as the pipeline's VAE is compiled for it
            return np.concatenate([self._encode_pixels(pipe, clip[None]) for clip in clips])

        folded = pipe.configs["vae"].temporal_compression
        return {IMAGE_CONDITION: image_condition(encode, firsts, lasts, num_frames, folded)}

    def _image_embeddings(self, pipe, images) -> np.ndarray:
        encode, params = pipe.components["image_encoder"]  # -> hidden_states[-2]
        return image_embeddings(encode, params, pipe.components["image_processor"], images)
