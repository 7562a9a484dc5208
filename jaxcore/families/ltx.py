"""LTX-Video as a family: the twin of diffusers' ``LTXPipeline`` (text-to-video) and
``LTXImageToVideoPipeline`` (image-to-video), for generate.

Reference: ``diffusers/pipelines/ltx/pipeline_ltx.py`` and ``pipeline_ltx_image2video.py``
(diffusers 0.42):

- prompts -> T5 v1.1's last hidden state, the encoder run *without* a mask on the ids padded to
  ``max_sequence_length`` (diffusers' default 128), and the tokenizer's attention mask, which
  the transformer takes as ``encoder_attention_mask`` (``encoder_hidden_states`` [L, 4096],
  ``encoder_attention_mask`` [L]); guidance is classifier-free (``guidance_scale``, on when > 1)
  with diffusers' ``guidance_rescale``;
- latents, as a prompt line's ``latents`` file holds them: the *unpacked* initial noise
  ``[C, F', H', W']`` with ``F' = (F - 1) / t + 1``, ``H' = H / s``, ``W' = W / s`` (t, s: the
  VAE's temporal and spatial compression, 8 and 32 for the released VAEs); the family packs
  them into tokens ``[F' H' W', C]`` for the transformer (patch size 1) and unpacks the
  prediction, so the loop, the scheduler and guidance see ``[B, C, F', H', W']``;
- RoPE positions scaled by ``rope_interpolation_scale = (t / frame_rate, s, s)`` (the render
  setting ``frame_rate``, default 25), per row (the transformer's per-token coordinates);
- the flow-match Euler scheduler with the pipeline's sigmas ``linspace(1, 1/N, N)`` and, under
  dynamic shifting (0.9.1), ``mu`` linear in the video's token count ``F' H' W'`` (then
  ``shift_terminal`` stretches the schedule);
- decode: ``z * latents_std / scaling_factor + latents_mean``; a timestep-conditioned VAE
  (0.9.1+) decodes at ``decode_timestep`` (default 0) after ``(1 - a) z + a noise`` with
  ``a = decode_noise_scale`` (default: ``decode_timestep``), then ``video / 2 + 0.5`` in [0, 1].

Image-to-video: the conditioning image is resized to the render size (Lanczos, as diffusers'
VideoProcessor), VAE-encoded as a one-frame clip and normalised *without* ``scaling_factor``
(diffusers' image-to-video pipeline calls ``_normalize_latents`` with its default 1.0); that
latent frame replaces the first latent frame of the denoiser's input at every step, its tokens
get timestep 0 (``t * (1 - conditioning_mask)``), the scheduler steps the other frames only
(here: all frames are stepped and the first is replaced again before every prediction and
after the loop, the same result for the elementwise Euler step) and the decoder gets it as the
first frame. diffusers encodes the image with a posterior *sample* drawn by its torch
generator; the family takes the posterior mean (the image conditioning has no seed).

Decode noise (the only randomness after the initial latents): per prompt, standard normal
``jax.random`` (threefry) numbers from ``key(DECODE_NOISE_KEY)`` folded with the prompt's seed
(low and high 32-bit words) and a stream number: stream 0 is the ``[C, F', H', W']`` noise
mixed into the latents, stream 1 the ``[H, W]`` draws a noise-injecting decoder (0.9.1) adds
(:func:`jaxcore.models.ltx_vae.sample_decoder_noise`, each prompt decoded alone). So a render
does not depend on its batch; diffusers draws both with torch, so pixels match it only where
the noise does not enter: ``decode_noise_scale=0``, a VAE without timestep conditioning, and a
decoder that injects none.

How the render settings reach the family: ``frame_rate``, ``decode_timestep``,
``decode_noise_scale`` (and the prompt's seed, for the decode noise) are per-prompt values of
the size conditioning (:meth:`LTXFamily.size_conditioning`), which turns them into per-row
tensors that join both CFG branches; :meth:`LTXFamily.decode` reads the decode settings
from the rows' conditioning the pipeline hands it with the latents.

Convert and train (:class:`LTXEncoders`, as LTX-Video-Trainer's preprocessing and
``_training_step``, ``src/ltxv_trainer/trainer.py``):

- a record holds the VAE posterior *mean* of its clip normalised as the pipelines normalise
  (``(z - latents_mean) * scaling_factor / latents_std``, :func:`jaxcore.models.ltx_vae.
  normalize_latents`; the trainer samples the posterior, the mean keeps records deterministic)
  in the unpacked layout ``[C, F', H', W']``, the T5 states and attention mask exactly as
  :func:`encode_text` makes them for generate, and the RoPE scale ``[3]`` the transformer is
  trained with: :data:`TRAIN_FRAME_RATE` = 25 fps (the pipelines' default ``frame_rate``;
  convert samples clips at its own ``fps``, so set ``fps=25`` to train what the scale says).
  Images are 1-frame clips;
- training is the shared flow-matching objective (``stages/common/objective.py``): ``x_t =
  (1 - s) x + s noise``, target velocity ``noise - x``, the transformer applied by
  :meth:`LTXFamily.apply` as generate applies it (packed tokens, the records' RoPE scale, the
  attention mask), timesteps ``1000 s``. The trainer's ``shifted_logit_normal`` sampling is
  ``sigmoid(N(mu, 1))`` with ``mu`` linear in the token count (:func:`trainer_logit_mean`),
  which the shared ``timestep_sampling=logit_normal logit_mean=<mu>`` draws;
- image-to-video (records converted with an ``LTXImageToVideoPipeline``, clips of more than
  one latent frame): each record also holds its clip's first frame encoded as generate encodes
  a conditioning image (``image_latents``); training puts it in place of the first latent frame
  with timestep 0 for its tokens (as generate does) and scores the other frames only
  (:meth:`LTXFamily.loss_mask`). LTX-Video-Trainer does this for a random share
  ``first_frame_conditioning_p`` of its steps; here every step of such records (1.0).

Not built: ``LTXConditionPipeline`` (0.9.5+ conditioning on frames at any position, 0.9.7's
pipelines; refused by name), multi-scale / latent upsampling, LoRA, step caching.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxcore import sharding
from jaxcore.compute import ComputeConfig
from jaxcore.families.base import (
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
)
from jaxcore.families.wan import pixels  # diffusers' VideoProcessor, as for Wan's images
from jaxcore.models import ltx_transformer, ltx_vae, t5

log = logging.getLogger(__name__)

TEXT = TEXT_FEATURE  # [L, caption_channels]: T5's last hidden state
TEXT_MASK = "encoder_attention_mask"  # [L]: 1 for the prompt's tokens, 0 for padding
ROPE_SCALE = "rope_interpolation_scale"  # [3]: (t / frame_rate, s, s)
DECODE_TIMESTEP = "decode_timestep"  # []
DECODE_NOISE_SCALE = "decode_noise_scale"  # []
DECODE_SEED = "decode_seed"  # [2] uint32: the prompt's seed, low and high words
IMAGE_LATENTS = "image_latents"  # [C, 1, H', W']: image-to-video's first latent frame

T2V_PIPELINE = "LTXPipeline"
I2V_PIPELINE = "LTXImageToVideoPipeline"
CONDITION_PIPELINE = "LTXConditionPipeline"
# LTXPipeline / LTXImageToVideoPipeline.__call__'s defaults
DEFAULT_FRAME_RATE = 25.0
DEFAULT_MAX_SEQUENCE_LENGTH = 128
# The frame rate whose RoPE scale convert writes into the records (the pipelines' default)
TRAIN_FRAME_RATE = DEFAULT_FRAME_RATE
# LTX-Video-Trainer's shifted_logit_normal: mu linear from 0.95 at 1024 tokens to 2.05 at 4096
TRAINER_SHIFT_TOKENS = (1024, 4096)
TRAINER_SHIFTS = (0.95, 2.05)
# diffusers' check_inputs: height and width divisible by 32 whatever the VAE
PIPELINE_SIZE_MULTIPLE = 32
# The render settings a prompt gives the size conditioning (with its seed).
SETTINGS = ("frame_rate", "decode_timestep", "decode_noise_scale")
DECODE_NOISE_KEY = 0x4C5458  # "LTX"
LATENT_NOISE_STREAM, DECODER_NOISE_STREAM = 0, 1

# LTX-Video 0.9.1's scheduler (diffusers' convert_ltx_to_diffusers.py; 0.9.5 and 0.9.7 use
# the scheduler's defaults, no dynamic shifting): the scheduler of a model YAML, which names none.
REFERENCE_SCHEDULER_CONFIG: dict[str, object] = {
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "base_image_seq_len": 1024,
    "base_shift": 0.95,
    "max_image_seq_len": 4096,
    "max_shift": 2.05,
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "shift_terminal": 0.1,
    "use_dynamic_shifting": True,
}


def _refuse_condition_pipeline(class_name: str) -> None:
    if class_name == CONDITION_PIPELINE:
        raise ValueError(
            f"{CONDITION_PIPELINE} (LTX-Video 0.9.5+ conditioning on frames and videos, the "
            f"pipeline 0.9.7 ships with) is not built yet; {T2V_PIPELINE} and {I2V_PIPELINE} "
            "are (load the same transformer, VAE and T5 in one of them)"
        )


@dataclasses.dataclass(frozen=True)
class LTXPipelineOptions:
    """What ``model_index.json`` says beyond the components: the pipeline class (text- or
    image-to-video; the components are the same)."""

    pipeline_class: str = T2V_PIPELINE

    def __post_init__(self):
        _refuse_condition_pipeline(self.pipeline_class)
        if self.pipeline_class not in (T2V_PIPELINE, I2V_PIPELINE):
            raise ValueError(
                f"pipeline_class={self.pipeline_class!r}: expected {T2V_PIPELINE} or {I2V_PIPELINE}"
            )

    @property
    def image_to_video(self) -> bool:
        return self.pipeline_class == I2V_PIPELINE

    @classmethod
    def from_index(cls, index: Mapping) -> LTXPipelineOptions:
        return cls(pipeline_class=str(index.get("_class_name", T2V_PIPELINE)))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping) -> LTXPipelineOptions:
        unknown = sorted(set(data) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"unknown pipeline option(s) {unknown}; known: ['pipeline_class']")
        return cls(**data)


# --- pure helpers -------------------------------------------------------------------------------


def pipeline_compression(vae: ltx_vae.LTXVideoVAEConfig) -> tuple[int, int]:
    """(temporal, spatial) compression as diffusers' pipelines read it from the VAE
    (``vae.temporal_compression_ratio`` / ``spatial_compression_ratio``: the config's values,
    else ``patch * 2 ** sum(spatio_temporal_scaling)``)."""
    scaled = sum(bool(s) for s in vae.spatio_temporal_scaling)
    spatial = vae.spatial_compression_ratio or vae.patch_size * 2**scaled
    temporal = vae.temporal_compression_ratio or vae.patch_size_t * 2**scaled
    return int(temporal), int(spatial)


def rope_scale(frame_rate: float, temporal: int, spatial: int) -> np.ndarray:
    """``rope_interpolation_scale`` [3] float32 as the pipelines build it (the temporal entry
    divided in float64 and rounded once, as torch rounds a Python scalar to the grid's dtype)."""
    return np.asarray(
        ltx_transformer.frame_rate_rope_scale(frame_rate, temporal, spatial), np.float32
    )


def trainer_logit_mean(tokens: int) -> float:
    """The mean of LTX-Video-Trainer's ``shifted_logit_normal`` timestep sampling for a video of
    ``tokens`` latent tokens (``F' H' W'``): linear through (1024, 0.95) and (4096, 2.05), not
    clipped, as the trainer's ``_get_shift_for_sequence_length``. Its sigmas are
    ``sigmoid(N(mu, 1))``: the shared ``timestep_sampling=logit_normal`` with this
    ``logit_mean``."""
    (lo, hi), (low, high) = TRAINER_SHIFT_TOKENS, TRAINER_SHIFTS
    slope = (high - low) / (hi - lo)
    return float(slope * tokens + low - slope * lo)


def seed_words(seed: int) -> tuple[int, int]:
    """A seed >= 0 as (low, high) 32-bit words."""
    return seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF


def _row_key(words: jax.Array, stream: int) -> jax.Array:
    key = jax.random.fold_in(jax.random.key(DECODE_NOISE_KEY), words[0])
    return jax.random.fold_in(jax.random.fold_in(key, words[1]), stream)


def decode_noise(seeds: jax.Array, shape: Sequence[int]) -> jax.Array:
    """The latents' decode noise ``[B, *shape]`` float32 of rows with these seeds (``[B, 2]``
    words, :func:`seed_words`): stream 0 of the module docstring's definition."""
    shape = tuple(int(n) for n in shape)

    def one(words):
        return jax.random.normal(_row_key(words, LATENT_NOISE_STREAM), shape, jnp.float32)

    return jax.vmap(one)(jnp.asarray(seeds, jnp.uint32))


def decoder_noise(config: ltx_vae.LTXVideoVAEConfig, words, latent_hw) -> tuple:
    """One row's noise for a noise-injecting decoder (stream 1)."""
    key = _row_key(jnp.asarray(words, jnp.uint32), DECODER_NOISE_STREAM)
    return ltx_vae.sample_decoder_noise(config, latent_hw, key)


def token_positions(grid: tuple[int, int, int]) -> np.ndarray:
    """[3, F H W] float32 (frame, row, column) of each token, in the packed order."""
    f, h, w = grid
    ids = np.meshgrid(np.arange(f), np.arange(h), np.arange(w), indexing="ij")
    return np.stack(ids).reshape(3, -1).astype(np.float32)


def video_coords(scale_b3: jax.Array, grid: tuple[int, int, int]) -> jax.Array:
    """Per-row RoPE coordinates [B, 3, L]: the grid positions times each row's
    ``rope_interpolation_scale`` (patch size 1), what diffusers' ``_prepare_video_coords``
    computes before dividing by the base (the transformer divides)."""
    positions = jnp.asarray(token_positions(grid))
    return positions[None] * scale_b3.astype(jnp.float32)[:, :, None]


def first_frame_inputs(latents, timestep_b, image_latents):
    """Image-to-video: the denoiser's input with the image's latent frame first, and per-token
    timesteps ``t * (1 - conditioning_mask)`` (0 on the first frame's tokens) [B, L]."""
    _, _, f, h, w = latents.shape
    x = jnp.concatenate([image_latents.astype(latents.dtype), latents[:, :, 1:]], axis=2)
    mask = np.zeros((f, h, w), np.float32)
    mask[0] = 1.0
    per_token = timestep_b.astype(jnp.float32)[:, None] * jnp.asarray(1.0 - mask.reshape(-1))
    return x, per_token


def image_latents(vae, params, clips) -> np.ndarray:
    """One-frame clips ``[B, 3, 1, H, W]`` in [-1, 1] -> the image-to-video pipeline's first
    latent frames ``[B, C, 1, H', W']`` float32: the posterior mean normalised *without*
    ``scaling_factor`` (diffusers' image-to-video pipeline calls ``_normalize_latents`` with its
    default 1.0)."""
    unscaled = dataclasses.replace(vae.config, scaling_factor=1.0)
    posterior = ltx_vae.encode(vae, params, jnp.asarray(clips, vae.dtype))
    mean = posterior.mean.astype(jnp.float32)
    return np.asarray(ltx_vae.normalize_latents(mean, params, unscaled), np.float32)


def first_frame_loss_mask(frames: int) -> np.ndarray:
    """``[1, 1, F', 1, 1]``: 0 on the first latent frame (kept clean, not scored), 1 elsewhere."""
    mask = np.ones((1, 1, frames, 1, 1), np.float32)
    mask[:, :, 0] = 0.0
    return mask


def _number(values: Mapping, key: str, default):
    """``values[key]`` as a float (``default`` when absent or None); an error names a value
    that is not a finite number."""
    value = values.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise FamilyError(f"{key}={value!r}: expected a finite number")
    return float(value)


def render_settings(values: Mapping[str, Any]) -> tuple[float, float, float, tuple[int, int]]:
    """One row's (frame rate, decode timestep, decode noise scale, seed words) from a prompt's
    size-conditioning values, with diffusers' defaults; an unknown or bad value is an error
    naming it."""
    unknown = sorted(set(values) - {*SETTINGS, "seed"})
    if unknown:
        raise FamilyError(
            f"{unknown}: not settings of LTX-Video's pipelines (they take {list(SETTINGS)})"
        )
    frame_rate = _number(values, "frame_rate", DEFAULT_FRAME_RATE)
    if not frame_rate > 0:
        raise FamilyError(f"frame_rate={frame_rate}: must be > 0")
    timestep = _number(values, "decode_timestep", 0.0)
    if timestep < 0:
        raise FamilyError(f"decode_timestep={timestep}: must be >= 0")
    scale = _number(values, "decode_noise_scale", None)
    scale = timestep if scale is None else scale  # diffusers: None -> decode_timestep
    if not 0.0 <= scale <= 1.0:
        raise FamilyError(f"decode_noise_scale={scale}: must be in [0, 1] (an interpolation)")
    seed = values.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise FamilyError(f"seed={seed!r}: expected an integer >= 0")
    return frame_rate, timestep, scale, seed_words(seed)


def encode_text(components: Mapping, prompts: Sequence[str], max_sequence_length: int) -> dict:
    """``{encoder_hidden_states [B, L, D], encoder_attention_mask [B, L]}`` float32 on the host,
    as ``LTXPipeline._get_t5_prompt_embeds``: ids padded to ``L`` (truncated, ``</s>``
    appended), T5 run without a mask, the tokenizer's mask beside."""
    from jaxcore.text import call_tokenizer

    encoder, params = components["text_encoder"]
    tokenizer = components["tokenizer"]
    prompts = list(prompts)
    hidden = t5.encode_prompts(tokenizer, encoder, params, prompts, max_sequence_length)
    encoded = call_tokenizer(
        tokenizer,
        prompts,
        padding="max_length",
        max_length=max_sequence_length,
        truncation=True,
        return_tensors="np",
    )
    return {TEXT: hidden, TEXT_MASK: np.asarray(encoded["attention_mask"], np.float32)}


def _transformer_problems(transformer) -> list[str]:
    if transformer is None:
        return []
    problems = []
    if (transformer.patch_size, transformer.patch_size_t) != (1, 1):
        problems.append(
            f"transformer patch_size {transformer.patch_size} / patch_size_t "
            f"{transformer.patch_size_t}: only 1 / 1 (every released LTX-Video) is supported"
        )
    if transformer.in_channels != transformer.out_channels:
        problems.append(
            f"transformer in_channels {transformer.in_channels} != out_channels "
            f"{transformer.out_channels} (it predicts the velocity of its input)"
        )
    return problems


def _vae_problems(vae) -> list[str]:
    if vae is None:
        return []
    stated = pipeline_compression(vae)
    real = (vae.temporal_compression, vae.spatial_compression)
    if stated == real:
        return []
    return [
        f"vae temporal / spatial compression {real[0]} / {real[1]} of its levels, but the "
        f"pipelines would read {stated[0]} / {stated[1]} (temporal_compression_ratio / "
        "spatial_compression_ratio)"
    ]


def _fit_problems(configs: Mapping) -> list[str]:
    transformer = configs.get("transformer")
    vae, encoder = configs.get("vae"), configs.get("text_encoder")
    problems = []
    if transformer is None:
        return problems
    if vae is not None and transformer.in_channels != vae.latent_channels:
        problems.append(
            f"transformer in_channels {transformer.in_channels} != vae latent_channels "
            f"{vae.latent_channels}"
        )
    if encoder is not None and transformer.caption_channels != encoder.d_model:
        problems.append(
            f"transformer caption_channels {transformer.caption_channels} != text_encoder "
            f"d_model {encoder.d_model}"
        )
    return problems


def _load_vae(directory: Path, compute: ComputeConfig, mesh=None, rules=None):
    try:
        return ltx_vae.load_ltx_vae(directory / "vae", dtype=compute.dtype, mesh=mesh, rules=rules)
    except ltx_vae.LTXVideoVAEConfigError as err:
        raise FamilyError(f"{directory / 'vae'}: {err}") from None


def _load_text_encoder(directory: Path, compute: ComputeConfig) -> dict:
    from jaxcore.text import load_tokenizer

    try:
        encoder = t5.load_t5_encoder(
            directory / "text_encoder", dtype=compute.dtype, param_dtype=compute.param_dtype
        )
    except t5.T5ConfigError as err:
        raise FamilyError(f"{directory / 'text_encoder'}: {err}") from None
    return {"text_encoder": encoder, "tokenizer": load_tokenizer(directory / "tokenizer")}


def _conditions_first_frame(num_frames: int, vae) -> bool:
    """Whether a clip of ``num_frames`` trains image-to-video: it has latent frames after the
    first (a 1-frame clip would have nothing left to score, as LTX-Video-Trainer skips it)."""
    temporal, _ = pipeline_compression(vae)
    return (num_frames - 1) // temporal + 1 > 1


class LTXEncoders(Encoders):
    """The VAE encoder, T5 and tokenizer of an LTX-Video pipeline directory (convert).

    Media ``[B, 3, F, H, W]`` -> the posterior *mean* normalised as the pipelines normalise
    (``(z - latents_mean) * scaling_factor / latents_std``) ``[B, C, F', H', W']``, and per
    clip the RoPE scale of :data:`TRAIN_FRAME_RATE`; captions -> the T5 states and mask exactly
    as :func:`encode_text` (generate) makes them.
    """

    def __init__(
        self,
        directory: Path,
        compute: ComputeConfig,
        max_sequence_length: int,
        batch_size: int,
        configs: Mapping,
    ):
        self.batch_size = batch_size
        self.max_sequence_length = max_sequence_length
        started = time.perf_counter()
        try:
            self.vae, self.vae_params = ltx_vae.load_ltx_vae(
                directory / "vae", dtype=compute.dtype, encoder_only=True
            )
        except ltx_vae.LTXVideoVAEConfigError as err:
            raise FamilyError(f"{directory / 'vae'}: {err}") from None
        self.text = _load_text_encoder(directory, compute)
        temporal, spatial = pipeline_compression(configs["vae"])
        self.rope_scale = rope_scale(TRAIN_FRAME_RATE, temporal, spatial)
        self.image_to_video = configs.get("pipeline", LTXPipelineOptions()).image_to_video
        log.info("loaded LTX encoders from %s in %.1fs", directory, time.perf_counter() - started)

    def encode_media(self, videos: np.ndarray) -> np.ndarray:
        videos = np.asarray(videos, np.float32)
        padded, count = self._padded(list(videos), "videos")
        posterior = ltx_vae.encode(self.vae, self.vae_params, jnp.asarray(np.stack(padded)))
        mean = posterior.mean.astype(jnp.float32)
        latents = ltx_vae.normalize_latents(mean, self.vae_params, self.vae.config)
        return np.asarray(latents, np.float32)[:count]

    def encode_media_conditioning(self, videos: np.ndarray) -> dict[str, np.ndarray]:
        """Per clip the RoPE scale and, for an image-to-video pipeline and clips of more than
        one latent frame, the clip's first frame as generate encodes a conditioning image."""
        count = self._check_batch(len(videos), "videos")
        out = {ROPE_SCALE: np.tile(self.rope_scale[None], (count, 1))}
        videos = np.asarray(videos, np.float32)
        if self.image_to_video and _conditions_first_frame(videos.shape[2], self.vae.config):
            padded, _ = self._padded(list(videos[:, :, :1]), "videos")
            first = image_latents(self.vae, self.vae_params, np.stack(padded))
            out[IMAGE_LATENTS] = first[:count]
        return out

    def encode_text(self, captions: Sequence[str]) -> dict[str, np.ndarray]:
        padded, count = self._padded(list(captions), "captions")
        encoded = encode_text(self.text, padded, self.max_sequence_length)
        return {name: value[:count] for name, value in encoded.items()}


class LTXFamily(Family):
    name = "ltx"
    description = (
        "LTX-Video text-to-video and image-to-video (LTXPipeline, LTXImageToVideoPipeline)"
    )
    # LTXConditionPipeline is listed so that its model_index.json finds this family, whose
    # check_model_index refuses it by name (not built yet)
    pipeline_classes = (T2V_PIPELINE, I2V_PIPELINE, CONDITION_PIPELINE)
    denoiser_classes = ("LTXVideoTransformer3DModel",)
    denoiser_component = "transformer"
    objective = "flow_matching"
    denoiser_model = DenoiserModel(
        kind=ltx_transformer.KIND,
        weight_map=ltx_transformer.weight_map,
        config_error=ltx_transformer.LTXConfigError,
    )

    def component_config_classes(self) -> dict[str, type]:
        return {
            "transformer": ltx_transformer.LTXVideoTransformerConfig,
            "vae": ltx_vae.LTXVideoVAEConfig,
            "text_encoder": t5.T5Config,
        }

    def optional_config_classes(self) -> dict[str, type]:
        return {"pipeline": LTXPipelineOptions}

    def check_model_index(self, index: Mapping, where: str) -> None:
        try:
            _refuse_condition_pipeline(str(index.get("_class_name")))
        except ValueError as err:
            raise FamilyError(f"{where}: {err}") from None

    def component_configs(self, directory) -> dict:
        """The transformer, VAE and T5 configs, and the pipeline class as ``pipeline``."""
        directory = Path(directory)
        index = read_model_index(directory)
        self.check_model_index(index, str(directory / "model_index.json"))
        configs = super().component_configs(directory)
        configs["pipeline"] = LTXPipelineOptions.from_index(index)
        self.check_configs(configs, str(directory))
        return configs

    def check_configs(self, configs, where) -> None:
        """The components must make one LTX-Video: transformer in = out = the VAE's latent
        channels (patch size 1: every released model), captions of the T5's width, and a VAE
        whose compression diffusers' pipelines read (its ``*_compression_ratio``) is the one
        its levels have. Each check runs where the configs it compares are given."""
        problems = [
            *_transformer_problems(configs.get("transformer")),
            *_vae_problems(configs.get("vae")),
            *_fit_problems(configs),
        ]
        if problems:
            raise FamilyError(f"{where}: " + "; ".join(problems))

    # --- the denoiser -----------------------------------------------------------------------
    def apply(self, module, params, latents, timestep, conditioning, run_stack=None):
        """Pack ``latents [B, C, F', H', W']`` into tokens, run the transformer with each row's
        RoPE scale (image-to-video: the image's latent frame first, per-token timesteps),
        unpack the prediction."""
        if run_stack is not None:
            raise FamilyError("step caching is not built for the ltx family yet")
        if ROPE_SCALE not in conditioning:
            raise FamilyError(
                f"the ltx conditioning needs {ROPE_SCALE!r} (generate: the size conditioning, "
                "size_conditioning; train: the records, written by convert)"
            )
        _, _, f, h, w = latents.shape
        x, t = latents, timestep.astype(jnp.float32)
        if IMAGE_LATENTS in conditioning:
            x, t = first_frame_inputs(x, t, conditioning[IMAGE_LATENTS])
        dtype = module.dtype
        prediction = module.apply(
            {"params": params},
            ltx_transformer.pack_latents(x.astype(dtype)),
            conditioning[TEXT].astype(dtype),
            t,
            conditioning[TEXT_MASK],
            video_coords=video_coords(conditioning[ROPE_SCALE], (f, h, w)),
        )
        return ltx_transformer.unpack_latents(prediction, f, h, w)

    def loss_mask(self, latents_shape, conditioning):
        """Image-to-video training (records with ``image_latents``): the first latent frame is
        the clean conditioning (its tokens at timestep 0, :meth:`apply`) and not scored."""
        if IMAGE_LATENTS not in conditioning:
            return None
        return jnp.asarray(first_frame_loss_mask(latents_shape[2]))

    def finish_latents(self, latents, conditioning):
        """Image-to-video: the first latent frame is the image's."""
        if IMAGE_LATENTS in conditioning:
            image = conditioning[IMAGE_LATENTS].astype(latents.dtype)
            latents = jnp.concatenate([image, latents[:, :, 1:]], axis=2)
        return latents

    def flops_per_forward(self, config, batch, latent_shape, conditioning_shapes):
        text_tokens = conditioning_shapes[TEXT][0]
        video_tokens = self.tokens_per_example(config, latent_shape)
        return ltx_transformer.flops_per_forward(config, batch, video_tokens, text_tokens)

    def tokens_per_example(self, config, latent_shape):
        _, f, h, w = latent_shape
        return (f // config.patch_size_t) * (h // config.patch_size) * (w // config.patch_size)

    def lora_to_diffusers(self, state_dict, denoiser_config, where: str):
        from jaxcore.lora import ltx

        return ltx.to_diffusers(state_dict, denoiser_config, where)

    def check_heads(self, config, mesh) -> None:
        sharding.check_divisible(mesh, heads=config.num_attention_heads)

    # --- conditioning and latents -----------------------------------------------------------
    def conditioning_specs(self, denoiser_config, text_length, latent_shape, image_tokens=None):
        """T5's states and attention mask, and the RoPE scale (records: the one of
        :data:`TRAIN_FRAME_RATE`; generate: each prompt's ``frame_rate``)."""
        del latent_shape, image_tokens
        return (
            TensorSpec(TEXT, (text_length, denoiser_config.caption_channels)),
            TensorSpec(TEXT_MASK, (text_length,)),
            TensorSpec(ROPE_SCALE, (3,)),
        )

    def latent_channels(self, denoiser_config) -> int:
        return denoiser_config.in_channels

    def record_features(self, directory, height, width, num_frames, max_sequence_length):
        """The base records and, for an image-to-video pipeline and clips of more than one
        latent frame, ``image_latents [C, 1, H', W']``: the clip's first frame encoded as
        generate encodes a conditioning image, which trains first-frame conditioning."""
        features = super().record_features(
            directory, height, width, num_frames, max_sequence_length
        )
        configs = self.component_configs(directory)
        if configs["pipeline"].image_to_video and _conditions_first_frame(
            num_frames, configs["vae"]
        ):
            channels, _, h, w = features[0].shape
            features = (*features, TensorSpec(IMAGE_LATENTS, (channels, 1, h, w)))
        return features

    def geometry(self, configs) -> Geometry:
        temporal, spatial = pipeline_compression(configs["vae"])
        return Geometry(
            spatial_multiple=math.lcm(PIPELINE_SIZE_MULTIPLE, spatial),
            temporal_multiple=temporal,
        )

    def latent_shape(self, configs, height, width, num_frames):
        vae = configs["vae"]
        t, s = pipeline_compression(vae)
        return (vae.latent_channels, (num_frames - 1) // t + 1, height // s, width // s)

    def load_encoders(self, directory, compute, max_sequence_length, batch_size):
        configs = self.component_configs(directory)
        return LTXEncoders(Path(directory), compute, max_sequence_length, batch_size, configs)

    def latent_normalization(self, configs) -> dict:
        vae = configs["vae"]
        temporal, spatial = pipeline_compression(vae)
        return {
            "latent_sampling": "mean",
            "formula": "(z - latents_mean) * scaling_factor / latents_std",
            "scaling_factor": vae.scaling_factor,
            "latents_mean": "the VAE's latents_mean buffer (vae/*.safetensors)",
            "latents_std": "the VAE's latents_std buffer (vae/*.safetensors)",
            "layout": "[C, F', H', W'] (unpacked)",
            "frame_rate": TRAIN_FRAME_RATE,
            ROPE_SCALE: rope_scale(TRAIN_FRAME_RATE, temporal, spatial).tolist(),
        }

    # --- inference --------------------------------------------------------------------------
    def default_scheduler_config(self) -> dict:
        return dict(REFERENCE_SCHEDULER_CONFIG)

    def load_components(self, directory, configs, compute, mesh, rules, denoiser):
        """The VAE (on the mesh), T5 and its tokenizer (outside it: their parameters are
        replicated, nothing is lost)."""
        components = {"vae": _load_vae(directory, compute, mesh, rules)}
        components.update(_load_text_encoder(directory, compute))
        return {"components": components}

    def encode_prompts(self, pipe, prompts, max_sequence_length):
        return encode_text(pipe.components, prompts, max_sequence_length)

    def size_conditioning(self, configs, height, width, micro):
        """Per row, the render settings (:data:`SETTINGS`, diffusers' defaults where a row
        gives none) and the seed as tensors for both branches: ``rope_interpolation_scale``
        [B, 3] from ``frame_rate``, ``decode_timestep`` [B], ``decode_noise_scale`` [B] (None:
        ``decode_timestep``, as diffusers), ``decode_seed`` [B, 2] (seed 0 when none is
        given)."""
        del height, width
        temporal, spatial = pipeline_compression(configs["vae"])
        rows = [render_settings(values) for values in micro]
        cond = {
            ROPE_SCALE: np.stack([rope_scale(r[0], temporal, spatial) for r in rows]),
            DECODE_TIMESTEP: np.asarray([r[1] for r in rows], np.float32),
            DECODE_NOISE_SCALE: np.asarray([r[2] for r in rows], np.float32),
            DECODE_SEED: np.asarray([r[3] for r in rows], np.uint32).reshape(len(rows), 2),
        }
        return cond, dict(cond)

    def decode(self, pipe, latents, conditioning=None):
        """Latents -> frames ``[B, F, H, W, 3]`` in [0, 1] (see the module docstring), with
        each row's decode timestep, noise scale and seed from ``conditioning`` (None: timestep
        0, no noise, seed 0)."""
        vae, params = pipe.components["vae"]
        rows = np.shape(latents)[0]
        if conditioning is None or DECODE_TIMESTEP not in conditioning:
            zeros = np.zeros((rows,), np.float32)
            conditioning = {
                DECODE_TIMESTEP: zeros,
                DECODE_NOISE_SCALE: zeros,
                DECODE_SEED: np.zeros((rows, 2), np.uint32),
            }
        seeds = conditioning[DECODE_SEED]
        z = jnp.asarray(latents, jnp.float32)
        z = ltx_vae.denormalize_latents(z, params, vae.config)
        temb = None
        if vae.config.timestep_conditioning:  # diffusers mixes noise only for such a VAE
            noise = decode_noise(seeds, z.shape[1:])
            z = ltx_vae.mix_decode_noise(z, noise, conditioning[DECODE_NOISE_SCALE])
            temb = conditioning[DECODE_TIMESTEP]
        z = z.astype(vae.dtype)
        if not vae.config.injects_noise:
            return decoded_frames(ltx_vae.decode(vae, params, z, temb))
        frames = []
        for row in range(z.shape[0]):  # each prompt's decoder noise from its own seed
            noise = decoder_noise(vae.config, seeds[row], z.shape[3:5])
            t = None if temb is None else temb[row : row + 1]
            frames.append(ltx_vae.decode(vae, params, z[row : row + 1], t, noise=noise))
        return decoded_frames(jnp.concatenate(frames))

    def sampling_defaults(self, configs) -> dict:
        # LTXPipeline / LTXImageToVideoPipeline.__call__'s defaults, the render settings too
        return {
            "height": 512,
            "width": 704,
            "num_frames": 161,
            "num_inference_steps": 50,
            "guidance_scale": 3.0,
            "frame_rate": DEFAULT_FRAME_RATE,
            "decode_timestep": 0.0,
            "decode_noise_scale": None,
            "max_sequence_length": 128,
        }

    def default_scheduler(self, scheduler_config) -> str:
        name = scheduler_config.get("_class_name", "FlowMatchEulerDiscreteScheduler")
        if name != "FlowMatchEulerDiscreteScheduler":
            raise FamilyError(
                f"scheduler {name!r} is not supported for LTX-Video "
                "(FlowMatchEulerDiscreteScheduler)"
            )
        return "flow_euler"

    def make_schedule(self, pipe, scheduler, num_inference_steps, shift, latent_shape):
        """The pipelines' schedule: sigmas ``linspace(1, 1/N, N)``, ``mu`` from the video's
        token count (used under dynamic shifting), the config's ``shift_terminal``."""
        from jaxcore.schedulers import make_scheduler
        from jaxcore.schedulers.flow_euler import (
            FlowEulerConfigError,
            calculate_shift,
            flow_euler_options,
            pipeline_sigmas,
        )

        if scheduler != "flow_euler":
            raise FamilyError(f"scheduler={scheduler!r}: LTX-Video samples with flow_euler only")
        config = pipe.scheduler_config
        where = f"{pipe.source}/scheduler/scheduler_config.json"
        try:
            options = flow_euler_options(config, where)
        except FlowEulerConfigError as err:
            raise FamilyError(str(err)) from None
        if options.use_dynamic_shifting and float(shift) != float(options.shift):
            raise FamilyError(
                f"flow_shift={shift}: this scheduler shifts by the video's size "
                "(use_dynamic_shifting), so a flow_shift has no effect; leave it unset"
            )
        _, _, f, h, w = latent_shape
        mu = calculate_shift(
            f * h * w,
            config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5),
            config.get("max_shift", 1.15),
        )
        try:
            return make_scheduler(
                "flow_euler",
                num_inference_steps,
                shift,
                euler_options=options,
                sigmas=pipeline_sigmas(num_inference_steps),
                mu=mu,
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
                f"true_cfg_scale={true_cfg_scale}: LTX-Video has no true CFG; its guidance_scale "
                "is the classifier-free guidance scale"
            )
        if guidance_scale_2 is not None:
            raise FamilyError(
                f"guidance_scale_2={guidance_scale_2}: LTX-Video has one transformer "
                "(guidance_scale_2 is for two-expert Wan 2.2 models)"
            )
        return Guidance(cfg_scale=float(guidance_scale))

    def with_guidance_rescale(self, configs, guidance, guidance_rescale):
        del configs
        value = float(guidance_rescale)
        if not value >= 0.0:
            raise FamilyError(f"guidance_rescale={guidance_rescale}: must be >= 0 (0 = off)")
        return dataclasses.replace(guidance, guidance_rescale=value)

    # --- image-to-video ---------------------------------------------------------------------
    def image_inputs(self, configs) -> ImageInputs:
        options = configs.get("pipeline", LTXPipelineOptions())
        return ImageInputs("required" if options.image_to_video else "none")

    def encode_images(self, pipe, images, height, width, num_frames):
        """Image-to-video: per row the image's latent frame ``[C, 1, H', W']``, the posterior
        mean normalised without ``scaling_factor`` (as diffusers' pipeline does)."""
        del num_frames
        inputs = self.image_inputs(pipe.configs)
        for row, (image, last) in enumerate(images):
            try:
                inputs.check(image is not None, last is not None, f"row {row}")
            except ValueError as err:
                raise FamilyError(str(err)) from None
        if inputs.image == "none":
            return {}
        if not height:
            raise FamilyError("LTX-Video image conditioning needs the render size")
        vae, params = pipe.components["vae"]
        rows = []
        for image, _ in images:  # one at a time: the VAE is compiled for one clip
            clip = pixels(image, height, width)[None, :, None]
            rows.append(image_latents(vae, params, clip)[0])
        return {IMAGE_LATENTS: np.stack(rows)}
