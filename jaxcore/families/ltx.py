"""LTX-Video as a family: the twin of diffusers' ``LTXPipeline`` (text-to-video),
``LTXImageToVideoPipeline`` (image-to-video) and ``LTXConditionPipeline`` (frame conditions),
for generate.

Reference: ``diffusers/pipelines/ltx/pipeline_ltx.py``, ``pipeline_ltx_image2video.py`` and
``pipeline_ltx_condition.py`` (diffusers 0.42):

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
  ``sigmoid(N(mu, 1))`` with ``mu`` linear in the token count: the shared
  ``timestep_sampling=shifted_logit_normal`` (``jaxcore.flow_matching.shifted_logit_mean``);
- image-to-video (records converted with an ``LTXImageToVideoPipeline``, clips of more than
  one latent frame): each record also holds its clip's first frame encoded as generate encodes
  a conditioning image (``image_latents``); training puts it in place of the first latent frame
  with timestep 0 for its tokens (as generate does) and scores the other frames only
  (:meth:`LTXFamily.loss_mask`). LTX-Video-Trainer does this for a random share
  ``first_frame_conditioning_p`` of its steps; here every step of such records (1.0).

Conditioning on frames (``LTXConditionPipeline``, ``pipeline_ltx_condition.py``; see
:class:`LTXCondition` and :func:`condition_inputs`): each condition (an image or a video of
``t k + 1`` frames, at ``frame_index``, with ``strength``) is resized like the image above
(videos trimmed as ``trim_conditioning_sequence``), VAE-encoded (posterior mean) and normalised
without ``scaling_factor``. At ``frame_index`` 0 its latent frames are blended into the first
frames of the initial latents (``torch.lerp(latents, cond, strength)``, the conditioning mask
``strength`` there); elsewhere its first latent frame (a video: its first two, the rest blended
into the main latents from ``frame_index // t + 2``) becomes extra tokens placed *before* the
video's tokens (``lerp(noise, cond, strength)``, mask ``strength``) with their own RoPE
coordinates (``_scale_video_ids`` with ``frame_index``; every token's frame coordinate is the
causal-fixed ``max(f t + 1 - t, 0) + frame_index`` times ``1 / frame_rate``). The loop carries
the extra tokens as extra latent frames in front ([B, C, F_x + F', H', W'], packed in the same
order as diffusers concatenates), set up by :meth:`LTXFamily.start_latents` and dropped by
:meth:`LTXFamily.finish_latents`. Every step: the tokens with mask ~1 are replaced by ``cond +
image_cond_noise_scale * noise * (t / 1000) ** 2`` for the transformer's input, the per-token
timesteps are ``min(t, 1000 (1 - mask))``, and only tokens with ``t / 1000 - 1e-6 < 1 - mask``
are stepped (here: the others' prediction is 0, so the Euler step leaves them as they are).
The schedule is the pipeline's ``linear_quadratic_schedule`` (timesteps ``1000 sigma`` handed to
the scheduler, which must not shift them: no dynamic shifting, shift 1, no ``shift_terminal``,
as 0.9.5 / 0.9.7 ship). T5 runs *with* the tokenizer's mask there, and the pipeline's defaults
``max_sequence_length`` 256 and ``image_cond_noise_scale`` 0.15 (a per-prompt setting). Randomness diffusers draws with torch is drawn here from the prompt's
seed, as the decode noise (streams 2 and 3 below): stream 2, the noise of extra tokens with
strength < 1; stream 3 folded with the float32 bits of ``t``, the per-step noise of
``image_cond_noise_scale``. Two known differences from diffusers beyond those numbers: the
hard-conditioned tokens are decoded as their clean latents (diffusers decodes them with the
last step's ``image_cond_noise``, ``0.15 noise (t_N / 1000) ** 2``), and a token whose
``1 - mask`` lies within 1e-6 below ``t / 1000`` steps with the full step (diffusers: from its
own timestep). Not built for it: ``denoise_strength`` < 1 (video-to-video), ``guidance_rescale``
(diffusers' rescale takes the std over the frozen tokens' predictions too), overlapping
conditions on the same latent frames, step caching. Custom timesteps (a prompt's
``timesteps``, diffusers' ``timesteps=``, the distilled models' lists; :func:`custom_schedule`)
replace that schedule here only: diffusers' other two pipelines fail with them.

Step caching (First-Block-Cache, MagCache) runs the transformer's block stack as for Wan, in
the text- and image-to-video pipelines; LoRAs load (:mod:`jaxcore.lora.ltx`) and train
(the attention projections by default). Not built: multi-scale / latent upsampling.
"""

from __future__ import annotations

import dataclasses
import functools
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
from jaxcore.families import flow_match
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
)
from jaxcore.families.wan import pixels  # diffusers' VideoProcessor, as for Wan's images
from jaxcore.family_types import options_from_dict
from jaxcore.models import ltx_transformer, ltx_vae, t5

log = logging.getLogger(__name__)

TEXT = TEXT_FEATURE  # [L, caption_channels]: T5's last hidden state
TEXT_MASK = "encoder_attention_mask"  # [L]: 1 for the prompt's tokens, 0 for padding
ROPE_SCALE = "rope_interpolation_scale"  # [3]: (t / frame_rate, s, s)
DECODE_TIMESTEP = "decode_timestep"  # []
DECODE_NOISE_SCALE = "decode_noise_scale"  # []
DECODE_SEED = "decode_seed"  # [2] uint32: the prompt's seed, low and high words
IMAGE_LATENTS = "image_latents"  # [C, 1, H', W']: image-to-video's first latent frame
# LTXConditionPipeline (F_x: the extra conditioning frames, L = (F_x + F') H' W')
CONDITION_LATENTS = "condition_latents"  # [C, F_x + F', H', W']: conditions' latents (else 0)
CONDITION_MASK = "conditioning_mask"  # [F']: each latent frame's strength (0: free)
EXTRA_MASK = "extra_conditioning_mask"  # [F_x]: the extra frames' strengths
CONDITION_IDS = "condition_video_ids"  # [3, L]: scaled (frame, row, column) ids, before 1/fps
FRAME_SCALE = "frame_coordinate_scale"  # []: float32(1 / frame_rate)
IMAGE_COND_NOISE_SCALE = "image_cond_noise_scale"  # []

T2V_PIPELINE = "LTXPipeline"
I2V_PIPELINE = "LTXImageToVideoPipeline"
CONDITION_PIPELINE = "LTXConditionPipeline"
# LTXPipeline / LTXImageToVideoPipeline.__call__'s defaults
DEFAULT_FRAME_RATE = 25.0
DEFAULT_MAX_SEQUENCE_LENGTH = 128
# The frame rate whose RoPE scale convert writes into the records (the pipelines' default)
TRAIN_FRAME_RATE = DEFAULT_FRAME_RATE
# LTX-Video-Trainer's shifted_logit_normal: mu linear from 0.95 at 1024 tokens to 2.05 at 4096
# diffusers' check_inputs: height and width divisible by 32 whatever the VAE
PIPELINE_SIZE_MULTIPLE = 32
# The render settings a prompt gives the size conditioning (with its seed).
SETTINGS = ("frame_rate", "decode_timestep", "decode_noise_scale")
# LTXConditionPipeline.__call__'s defaults that differ, and its own setting
CONDITION_MAX_SEQUENCE_LENGTH = 256
DEFAULT_IMAGE_COND_NOISE_SCALE = 0.15
CONDITION_SETTINGS = (*SETTINGS, IMAGE_COND_NOISE_SCALE)
DECODE_NOISE_KEY = 0x4C5458  # "LTX"
LATENT_NOISE_STREAM, DECODER_NOISE_STREAM = 0, 1
EXTRA_TOKEN_NOISE_STREAM, COND_STEP_NOISE_STREAM = 2, 3
HARD_CONDITION_EPS = 1e-6  # add_noise_to_image_conditioning_latents' eps

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


@dataclasses.dataclass(frozen=True)
class LTXPipelineOptions:
    """What ``model_index.json`` says beyond the components: the pipeline class (text- or
    image-to-video, or conditioning on frames; the components are the same)."""

    pipeline_class: str = T2V_PIPELINE

    def __post_init__(self):
        known = (T2V_PIPELINE, I2V_PIPELINE, CONDITION_PIPELINE)
        if self.pipeline_class not in known:
            raise ValueError(
                f"pipeline_class={self.pipeline_class!r}: expected one of {list(known)}"
            )

    @property
    def image_to_video(self) -> bool:
        return self.pipeline_class == I2V_PIPELINE

    @property
    def frame_conditions(self) -> bool:
        """``LTXConditionPipeline``: conditions on frames at any index (:class:`LTXCondition`)."""
        return self.pipeline_class == CONDITION_PIPELINE

    @classmethod
    def from_index(cls, index: Mapping) -> LTXPipelineOptions:
        return cls(pipeline_class=str(index.get("_class_name", T2V_PIPELINE)))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping) -> LTXPipelineOptions:
        return options_from_dict(cls, data)


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


# --- LTXConditionPipeline -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LTXCondition:
    """One of diffusers' ``LTXVideoCondition``: ``image`` (a PIL image) or ``video`` (a sequence
    of PIL images, ``t k + 1`` of them once trimmed to the render), conditioning the video at
    pixel frame ``frame_index`` with ``strength`` in [0, 1] (1: the frames are kept)."""

    image: Any = None
    video: Sequence[Any] | None = None
    frame_index: int = 0
    strength: float = 1.0

    def __post_init__(self):
        if (self.image is None) == (self.video is None):
            raise ValueError("a condition takes exactly one of image and video")
        index = self.frame_index
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise ValueError(f"frame_index={index!r}: expected an integer >= 0")
        strength = self.strength
        if isinstance(strength, bool) or not isinstance(strength, int | float):
            raise ValueError(f"strength={strength!r}: expected a number in [0, 1]")
        if not 0.0 <= float(strength) <= 1.0:
            raise ValueError(f"strength={strength}: must be in [0, 1]")


def linear_quadratic_schedule(num_steps: int) -> list[float]:
    """LTXConditionPipeline's sigmas (``linear_quadratic_schedule``, from LTX-Video's
    ``schedulers/rf.py``; threshold noise 0.025, half the steps linear), python floats as the
    pipeline computes them before ``torch.tensor``."""
    threshold_noise, linear_steps = 0.025, num_steps // 2
    if num_steps < 2:
        return [1.0]
    linear = [i * threshold_noise / linear_steps for i in range(linear_steps)]
    step_diff = linear_steps - threshold_noise * num_steps
    quadratic_steps = num_steps - linear_steps
    quadratic_coef = step_diff / (linear_steps * quadratic_steps**2)
    linear_coef = threshold_noise / linear_steps - 2 * step_diff / (quadratic_steps**2)
    const = quadratic_coef * (linear_steps**2)
    quadratic = [
        quadratic_coef * (i**2) + linear_coef * i + const for i in range(linear_steps, num_steps)
    ]
    schedule = [1.0 - x for x in [*linear, *quadratic, 1.0]]
    return schedule[:-1]


def condition_schedule(num_steps: int, num_train_timesteps: int = 1000):
    """``(sigmas [N + 1], timesteps [N])`` float32 as the pipeline hands ``timesteps =
    sigmas * 1000`` (float32) to an unshifted scheduler: sigmas ``timesteps / 1000``, then 0."""
    timesteps = np.asarray(linear_quadratic_schedule(num_steps), np.float32) * np.float32(1000)
    sigmas = (timesteps / np.float32(num_train_timesteps)).astype(np.float32)
    return np.concatenate([sigmas, np.zeros(1, np.float32)]), timesteps


def custom_schedule(timesteps: Sequence[float], num_train_timesteps: int = 1000):
    """``(sigmas [N + 1], timesteps [N])`` float32 for a custom ``timesteps=`` list, as
    ``FlowMatchEulerDiscreteScheduler.set_timesteps(timesteps=...)`` makes them for an unshifted
    scheduler (what ``LTXConditionPipeline`` calls; the distilled models' lists): the timesteps
    as given (float32), sigmas ``timesteps / num_train_timesteps``, then 0. ValueError for a
    list that is empty, not strictly decreasing or outside ``[0, num_train_timesteps]``."""
    problem = timesteps_problem(timesteps, num_train_timesteps)
    if problem:
        raise ValueError(problem)
    steps = np.asarray(list(timesteps), np.float64).astype(np.float32)
    sigmas = (steps / np.float32(num_train_timesteps)).astype(np.float32)
    return np.concatenate([sigmas, np.zeros(1, np.float32)]), steps


def timesteps_problem(timesteps: Sequence[float], num_train_timesteps: int = 1000) -> str | None:
    """What is wrong with a custom timestep list (None: nothing): it must be non-empty,
    finite, strictly decreasing and within ``[0, num_train_timesteps]``."""
    values = [float(t) for t in timesteps]
    if not values:
        return "timesteps must be a non-empty list of numbers"
    if not all(math.isfinite(t) and 0.0 <= t <= num_train_timesteps for t in values):
        return f"timesteps={values}: each must be in [0, {num_train_timesteps}]"
    if any(b >= a for a, b in zip(values, values[1:], strict=False)):
        return f"timesteps={values}: must be strictly decreasing"
    return None


def torch_lerp(start, end, weight):
    """``torch.lerp`` as its CPU kernel computes it: ``start + w (end - start)`` for ``|w| <
    0.5``, else ``end - (end - start) (1 - w)`` (so weight 1 gives ``end`` exactly)."""
    w = jnp.asarray(weight, jnp.float32)
    diff = end - start
    return jnp.where(jnp.abs(w) < 0.5, start + w * diff, end - diff * (1.0 - w))


def trim_condition_frames(frames: int, frame_index: int, num_frames: int, temporal: int) -> int:
    """``trim_conditioning_sequence``: at most the frames left after ``frame_index``, cut to
    ``t k + 1``."""
    count = min(frames, num_frames - frame_index)
    return (count - 1) // temporal * temporal + 1


def _step_noise_key(words, t) -> jax.Array:
    bits = jax.lax.bitcast_convert_type(jnp.asarray(t, jnp.float32), jnp.uint32)
    return jax.random.fold_in(_row_key(words, COND_STEP_NOISE_STREAM), bits)


def condition_step_noise(seeds, timestep_b, shape) -> jax.Array:
    """``[B, *shape]``: each row's ``image_cond_noise`` at timestep ``t`` (stream 3 of its
    seed folded with ``t``'s float32 bits)."""
    shape = tuple(int(n) for n in shape)

    def one(words, t):
        return jax.random.normal(_step_noise_key(words, t), shape, jnp.float32)

    return jax.vmap(one)(jnp.asarray(seeds, jnp.uint32), timestep_b.astype(jnp.float32))


def extra_token_noise(seeds, shape) -> jax.Array:
    """``[B, *shape]``: each row's noise for extra conditioning tokens (stream 2)."""
    shape = tuple(int(n) for n in shape)

    def one(words):
        return jax.random.normal(_row_key(words, EXTRA_TOKEN_NOISE_STREAM), shape, jnp.float32)

    return jax.vmap(one)(jnp.asarray(seeds, jnp.uint32))


def _condition_pixels(condition: LTXCondition, height, width, num_frames, temporal, where):
    """``[3, F, H, W]`` in [-1, 1]: the image, or the video trimmed (VideoProcessor's resize)."""
    if condition.image is not None:
        return pixels(condition.image, height, width)[:, None]
    frames = list(condition.video)
    count = trim_condition_frames(len(frames), condition.frame_index, num_frames, temporal)
    if count < 1 or count % temporal != 1 % temporal:
        raise FamilyError(
            f"{where}: a video of {len(frames)} frames at frame_index={condition.frame_index} "
            f"keeps {count} frames of {num_frames}; needs t k + 1 (t = {temporal}) frames"
        )
    return np.stack([pixels(frame, height, width) for frame in frames[:count]], axis=1)


def condition_inputs(
    encode,
    conditions: Sequence[LTXCondition],
    grid,
    channels: int,
    temporal: int,
    spatial: int,
    where: str,
) -> dict[str, np.ndarray]:
    """One row's conditioning tensors (see the module docstring), as ``prepare_latents``
    lays them out: ``condition_latents [C, F_x + F', H', W']`` (the extra frames first),
    ``extra_conditioning_mask [F_x]``, ``conditioning_mask [F']`` and ``condition_video_ids
    [3, L]``. ``encode``: ``[1, 3, F, H, W]`` pixels
    -> normalised latents ``[1, C, F'', H', W']``; ``grid``: ``(num_frames, height, width)``."""
    num_frames, height, width = grid
    frames, h, w = (num_frames - 1) // temporal + 1, height // spatial, width // spatial
    main, mask = np.zeros((channels, frames, h, w), np.float32), np.zeros(frames, np.float32)
    extras, extra_masks, extra_ids = [], [], []
    prefix = 2  # prepare_latents' num_prefix_latent_frames
    for number, condition in enumerate(conditions):
        here = f"{where}, condition {number}"
        clip = _condition_pixels(condition, height, width, num_frames, temporal, here)
        latents = np.asarray(encode(clip[None]), np.float32)[0]
        strength, index = float(condition.strength), condition.frame_index
        count = latents.shape[1]

        def blend(start, values, here=here, strength=strength):
            stop = start + values.shape[1]
            if stop > frames or (mask[start:stop] > 0).any():
                raise FamilyError(
                    f"{here}: its latent frames {start}..{stop - 1} overlap another condition's "
                    f"or pass the video's {frames} (not built)"
                )
            main[:, start:stop] = values
            mask[start:stop] = strength

        if index == 0:
            blend(0, latents)
            continue
        if clip.shape[1] > 1:
            if count < prefix:
                raise FamilyError(f"{here}: a video needs at least {prefix} latent frames")
            if count > prefix:
                blend(index // temporal + prefix, latents[:, prefix:])
                latents = latents[:, :prefix]
        extras.append(latents)
        extra_masks.append(np.full(latents.shape[1], strength, np.float32))
        extra_ids.append(
            ltx_transformer.condition_video_coords(
                1,
                latents.shape[1],
                h,
                w,
                1.0,
                vae_temporal_compression_ratio=temporal,
                vae_spatial_compression_ratio=spatial,
                frame_index=index,
            )[0]
        )
    ids = ltx_transformer.condition_video_coords(
        1,
        frames,
        h,
        w,
        1.0,
        vae_temporal_compression_ratio=temporal,
        vae_spatial_compression_ratio=spatial,
    )[0]
    return {
        CONDITION_LATENTS: np.concatenate([*extras, main], axis=1),
        EXTRA_MASK: np.concatenate([np.zeros(0, np.float32), *extra_masks]),
        CONDITION_MASK: mask,
        CONDITION_IDS: np.concatenate([*extra_ids, ids], axis=1),
    }


def _frame_mask(conditioning) -> jax.Array:
    """``[B, F_x + F']``: every latent frame's strength, the extra frames first."""
    extra = jnp.asarray(conditioning[EXTRA_MASK], jnp.float32)
    return jnp.concatenate([extra, jnp.asarray(conditioning[CONDITION_MASK], jnp.float32)], 1)


def start_condition_latents(latents, conditioning):
    """``prepare_latents``' blending: the extra frames ``lerp(noise, cond, strength)`` in front
    of the initial latents, the conditioned frames ``lerp(latents, cond, strength)``."""
    cond = jnp.asarray(conditioning[CONDITION_LATENTS], jnp.float32)
    mask = _frame_mask(conditioning)
    latents = jnp.asarray(latents, jnp.float32)
    extra = conditioning[EXTRA_MASK].shape[1]
    if extra:
        noise = extra_token_noise(
            conditioning[DECODE_SEED], (*cond.shape[1:2], extra, *cond.shape[3:])
        )
        latents = jnp.concatenate([noise, latents], axis=2)
    return torch_lerp(latents, cond, mask[:, None, :, None, None])


def condition_model_inputs(latents, timestep_b, conditioning):
    """The transformer's input, per-token timesteps ``[B, L]``, RoPE coordinates ``[B, 3, L]``
    and which latent frames the step moves ``[B, 1, F, 1, 1]`` (see the module docstring)."""
    _, _, f, h, w = latents.shape
    mask = _frame_mask(conditioning)  # [B, F_x + F']
    frame_mask = mask[:, None, :, None, None]
    t = timestep_b.astype(jnp.float32)
    sigma = t / 1000.0
    scale = conditioning[IMAGE_COND_NOISE_SCALE].astype(jnp.float32)
    cond = conditioning[CONDITION_LATENTS].astype(jnp.float32)
    noise = condition_step_noise(conditioning[DECODE_SEED], t, latents.shape[1:])
    per_row = (-1, 1, 1, 1, 1)
    noised = cond + (scale.reshape(per_row) * noise) * (sigma * sigma).reshape(per_row)
    hard = (frame_mask > 1.0 - HARD_CONDITION_EPS) & (scale.reshape(per_row) > 0)
    x = jnp.where(hard, noised, latents)
    token_mask = jnp.repeat(mask, h * w, axis=1)
    per_token = jnp.minimum(t[:, None], (1.0 - token_mask) * 1000.0)
    ids = conditioning[CONDITION_IDS].astype(jnp.float32)
    frame_scale = conditioning[FRAME_SCALE].astype(jnp.float32)
    coords = jnp.concatenate([ids[:, :1] * frame_scale[:, None, None], ids[:, 1:]], axis=1)
    moves = (sigma - HARD_CONDITION_EPS).reshape(per_row) < (1.0 - frame_mask)
    return x, per_token, coords, moves


def _number(values: Mapping, key: str, default):
    """``values[key]`` as a float (``default`` when absent or None); an error names a value
    that is not a finite number."""
    value = values.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise FamilyError(f"{key}={value!r}: expected a finite number")
    return float(value)


def render_settings(
    values: Mapping[str, Any], settings: Sequence[str] = SETTINGS
) -> tuple[float, float, float, tuple[int, int]]:
    """One row's (frame rate, decode timestep, decode noise scale, seed words) from a prompt's
    size-conditioning values, with diffusers' defaults; an unknown or bad value is an error
    naming it."""
    unknown = sorted(set(values) - {*settings, "seed"})
    if unknown:
        raise FamilyError(
            f"{unknown}: not settings of LTX-Video's pipelines (this one takes {list(settings)})"
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


def image_cond_noise_scale(values: Mapping[str, Any]) -> float:
    """A row's ``image_cond_noise_scale`` (LTXConditionPipeline; default 0.15)."""
    scale = _number(values, IMAGE_COND_NOISE_SCALE, DEFAULT_IMAGE_COND_NOISE_SCALE)
    if scale < 0:
        raise FamilyError(f"{IMAGE_COND_NOISE_SCALE}={scale}: must be >= 0")
    return scale


def encode_text(
    components: Mapping, prompts: Sequence[str], max_sequence_length: int, masked: bool = False
) -> dict:
    """``{encoder_hidden_states [B, L, D], encoder_attention_mask [B, L]}`` float32 on the host,
    as ``LTXPipeline._get_t5_prompt_embeds``: ids padded to ``L`` (truncated, ``</s>``
    appended), T5 run without a mask, the tokenizer's mask beside. ``masked``: T5 run with
    the tokenizer's mask, as ``LTXConditionPipeline._get_t5_prompt_embeds``."""
    from jaxcore.text import call_tokenizer

    encoder, params = components["text_encoder"]
    tokenizer = components["tokenizer"]
    prompts = list(prompts)
    encoded = call_tokenizer(
        tokenizer,
        prompts,
        padding="max_length",
        max_length=max_sequence_length,
        truncation=True,
        return_tensors="np",
    )
    mask = np.asarray(encoded["attention_mask"], np.int32)
    if masked:
        ids = np.asarray(encoded["input_ids"], np.int32)
        hidden = np.asarray(_masked_encoder(encoder)(params, ids, mask), np.float32)
    else:
        hidden = t5.encode_prompts(tokenizer, encoder, params, prompts, max_sequence_length)
    return {TEXT: hidden, TEXT_MASK: mask.astype(np.float32)}


@functools.lru_cache(maxsize=4)
def _masked_encoder(module):
    return jax.jit(lambda params, ids, mask: module.apply({"params": params}, ids, mask))


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
        self.image_to_video = _options(configs).image_to_video
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
        "LTX-Video text-to-video, image-to-video and frame conditions (LTXPipeline, "
        "LTXImageToVideoPipeline, LTXConditionPipeline)"
    )
    pipeline_classes = (T2V_PIPELINE, I2V_PIPELINE, CONDITION_PIPELINE)
    pipeline_options = LTXPipelineOptions  # the pipeline class
    denoiser_classes = ("LTXVideoTransformer3DModel",)
    denoiser_component = "transformer"
    objective = "flow_matching"
    # the attention projections, as LTX-Video-Trainer's and diffusers' LoRA scripts train them
    lora_default_targets = ("to_q", "to_k", "to_v", "to_out.0")
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

    def component_configs(self, directory) -> dict:
        """The transformer, VAE and T5 configs, and the pipeline class as ``pipeline``."""
        configs = super().component_configs(directory)
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
        unpack the prediction. ``run_stack``: step caching runs the block stack (the
        prediction comes with what the cache measured)."""
        if run_stack is not None and CONDITION_MASK in conditioning:
            raise FamilyError("step caching is not built for LTXConditionPipeline yet")
        if ROPE_SCALE not in conditioning:
            raise FamilyError(
                f"the ltx conditioning needs {ROPE_SCALE!r} (generate: the size conditioning, "
                "size_conditioning; train: the records, written by convert)"
            )
        _, _, f, h, w = latents.shape
        x, t = latents, timestep.astype(jnp.float32)
        moves = None
        if CONDITION_MASK in conditioning:
            x, t, coords, moves = condition_model_inputs(x, t, conditioning)
        else:
            coords = video_coords(conditioning[ROPE_SCALE], (f, h, w))
        if IMAGE_LATENTS in conditioning:
            x, t = first_frame_inputs(x, t, conditioning[IMAGE_LATENTS])
        dtype = module.dtype
        prediction = module.apply(
            {"params": params},
            ltx_transformer.pack_latents(x.astype(dtype)),
            conditioning[TEXT].astype(dtype),
            t,
            conditioning[TEXT_MASK],
            video_coords=coords,
            run_stack=run_stack,
        )
        extra = None
        if run_stack is not None:
            prediction, extra = prediction
        prediction = ltx_transformer.unpack_latents(prediction, f, h, w)
        if moves is not None:  # frozen tokens: a 0 velocity, so the Euler step keeps them
            prediction = jnp.where(moves, prediction, jnp.zeros_like(prediction))
        return prediction if run_stack is None else (prediction, extra)

    def loss_mask(self, latents_shape, conditioning):
        """Image-to-video training (records with ``image_latents``): the first latent frame is
        the clean conditioning (its tokens at timestep 0, :meth:`apply`) and not scored."""
        if IMAGE_LATENTS not in conditioning:
            return None
        return jnp.asarray(first_frame_loss_mask(latents_shape[2]))

    def start_latents(self, latents, conditioning):
        """LTXConditionPipeline: the conditions blended into the initial latents and their
        extra frames in front (:func:`start_condition_latents`)."""
        if CONDITION_MASK not in conditioning:
            return latents
        return np.asarray(start_condition_latents(latents, conditioning))

    def finish_latents(self, latents, conditioning):
        """Image-to-video: the first latent frame is the image's. Conditions on frames: the
        extra frames dropped."""
        if CONDITION_MASK in conditioning:
            latents = latents[:, :, conditioning[EXTRA_MASK].shape[1] :]
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
        masked = _options(pipe.configs).frame_conditions  # LTXConditionPipeline masks T5
        return encode_text(pipe.components, prompts, max_sequence_length, masked)

    def size_conditioning(self, configs, height, width, micro, num_frames=None):
        """Per row, the render settings (:data:`SETTINGS`, diffusers' defaults where a row
        gives none) and the seed as tensors for both branches: ``rope_interpolation_scale``
        [B, 3] from ``frame_rate``, ``decode_timestep`` [B], ``decode_noise_scale`` [B] (None:
        ``decode_timestep``, as diffusers), ``decode_seed`` [B, 2] (seed 0 when none is
        given)."""
        del height, width, num_frames
        temporal, spatial = pipeline_compression(configs["vae"])
        conditions = _options(configs).frame_conditions
        settings = CONDITION_SETTINGS if conditions else SETTINGS
        rows = [render_settings(values, settings) for values in micro]
        cond = {
            ROPE_SCALE: np.stack([rope_scale(r[0], temporal, spatial) for r in rows]),
            DECODE_TIMESTEP: np.asarray([r[1] for r in rows], np.float32),
            DECODE_NOISE_SCALE: np.asarray([r[2] for r in rows], np.float32),
            DECODE_SEED: np.asarray([r[3] for r in rows], np.uint32).reshape(len(rows), 2),
        }
        if conditions:  # the frame coordinates' scale, as the pipeline rounds 1 / frame_rate
            cond[FRAME_SCALE] = np.asarray([1.0 / r[0] for r in rows], np.float32)
            cond[IMAGE_COND_NOISE_SCALE] = np.asarray(
                [image_cond_noise_scale(values) for values in micro], np.float32
            )
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
        # LTXPipeline / LTXImageToVideoPipeline / LTXConditionPipeline.__call__'s defaults,
        # the render settings too
        if _options(configs).frame_conditions:
            return {
                **self._sampling_defaults(),
                "max_sequence_length": CONDITION_MAX_SEQUENCE_LENGTH,
                IMAGE_COND_NOISE_SCALE: DEFAULT_IMAGE_COND_NOISE_SCALE,
                "timesteps": None,  # a custom timestep list (the distilled models')
            }
        return self._sampling_defaults()

    def _sampling_defaults(self) -> dict:
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
        return flow_match.scheduler_name(scheduler_config, "LTX-Video")

    def make_seeded_schedule(
        self, pipe, scheduler, num_inference_steps, shift, latent_shape, seeds=None, timesteps=None
    ):
        """:meth:`make_schedule` (the family's samplers draw no noise); ``timesteps``: a custom
        timestep list (see :meth:`make_schedule`)."""
        del seeds
        return self.make_schedule(
            pipe, scheduler, num_inference_steps, shift, latent_shape, timesteps=timesteps
        )

    def make_schedule(
        self, pipe, scheduler, num_inference_steps, shift, latent_shape, timesteps=None
    ):
        """The pipelines' schedule: sigmas ``linspace(1, 1/N, N)``, ``mu`` from the video's
        token count (used under dynamic shifting), the config's ``shift_terminal``.

        ``timesteps`` (a list, as diffusers' ``timesteps=``; the distilled models'): taken by an
        ``LTXConditionPipeline`` only (diffusers' ``LTXPipeline`` / ``LTXImageToVideoPipeline``
        fail with one: they pass their own ``sigmas`` too), as its unshifted scheduler takes
        them (:func:`custom_schedule`); ``num_inference_steps`` must be their count."""
        from jaxcore.schedulers import make_scheduler
        from jaxcore.schedulers.flow_euler import pipeline_sigmas

        options = flow_match.euler_options(pipe, scheduler, shift, "LTX-Video", "the video's size")
        where = f"{pipe.source}/scheduler/scheduler_config.json"
        frame_conditions = _options(getattr(pipe, "configs", {})).frame_conditions
        if timesteps is not None and not frame_conditions:
            raise FamilyError(
                f"timesteps={list(timesteps)}: custom timesteps are taken by an "
                f"{CONDITION_PIPELINE} model only (diffusers' {T2V_PIPELINE} and "
                f"{I2V_PIPELINE} fail with them)"
            )
        if frame_conditions:
            return _condition_schedule(options, num_inference_steps, shift, where, timesteps)
        _, _, f, h, w = latent_shape
        mu = flow_match.config_mu(pipe.scheduler_config, f * h * w)
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
        value = float(guidance_rescale)
        if not value >= 0.0:
            raise FamilyError(f"guidance_rescale={guidance_rescale}: must be >= 0 (0 = off)")
        if value and _options(configs).frame_conditions:
            raise FamilyError(
                f"guidance_rescale={guidance_rescale}: not built for {CONDITION_PIPELINE} "
                "(diffusers' rescale reads the frozen conditioning tokens' predictions too)"
            )
        return dataclasses.replace(guidance, guidance_rescale=value)

    # --- image-to-video ---------------------------------------------------------------------
    def image_inputs(self, configs) -> ImageInputs:
        options = _options(configs)
        return ImageInputs("required" if options.image_to_video else "none")

    def encode_conditions(
        self, pipe, conditions: Sequence[Sequence[LTXCondition]], height, width, num_frames
    ) -> dict[str, np.ndarray]:
        """LTXConditionPipeline: per row its conditions (:class:`LTXCondition`, none for a
        plain render) -> the conditioning tensors of :func:`condition_inputs`, ``[B, ...]``,
        for both branches. The rows of one batch must have as many extra frames."""
        if not _options(pipe.configs).frame_conditions:
            raise FamilyError(
                f"conditions on frames need an {CONDITION_PIPELINE} (this model's pipeline is "
                f"{pipe.configs['pipeline'].pipeline_class})"
            )
        if not height:
            raise FamilyError("LTX-Video frame conditions need the render size")
        vae, params = pipe.components["vae"]
        temporal, spatial = pipeline_compression(vae.config)
        channels = vae.config.latent_channels

        def encode(clip):  # one at a time: the VAE is compiled per clip length
            return image_latents(vae, params, clip)

        rows = [
            condition_inputs(
                encode,
                _as_conditions(row, f"row {number}"),
                (num_frames, height, width),
                channels,
                temporal,
                spatial,
                f"row {number}",
            )
            for number, row in enumerate(conditions)
        ]
        extra = {row[EXTRA_MASK].shape[0] for row in rows}
        if len(extra) > 1:
            raise FamilyError(
                f"the rows of one batch have {sorted(extra)} extra conditioning frames; "
                "render them in separate batches"
            )
        return {name: np.stack([row[name] for row in rows]) for name in rows[0]}

    def encode_images(self, pipe, images, height, width, num_frames, settings=None):
        """Image-to-video: per row the image's latent frame ``[C, 1, H', W']``, the posterior
        mean normalised without ``scaling_factor`` (as diffusers' pipeline does).
        LTXConditionPipeline: rows without conditions (:meth:`encode_conditions`)."""
        del settings
        if _options(pipe.configs).frame_conditions:
            if any(image is not None or last is not None for image, last in images):
                raise FamilyError(
                    f"{CONDITION_PIPELINE} takes its images as conditions, not as image"
                )
            return self.encode_conditions(pipe, [[] for _ in images], height, width, num_frames)
        inputs = self.image_inputs(pipe.configs)
        inputs.check_rows(images)
        if inputs.image == "none":
            return {}
        if not height:
            raise FamilyError("LTX-Video image conditioning needs the render size")
        del num_frames
        vae, params = pipe.components["vae"]
        rows = []
        for image, _ in images:  # one at a time: the VAE is compiled for one clip
            clip = pixels(image, height, width)[None, :, None]
            rows.append(image_latents(vae, params, clip)[0])
        return {IMAGE_LATENTS: np.stack(rows)}


def _as_conditions(row: Sequence, where: str) -> list[LTXCondition]:
    """A row's conditions: :class:`LTXCondition` or mappings of its fields."""
    out = []
    for number, item in enumerate(row):
        try:
            out.append(item if isinstance(item, LTXCondition) else LTXCondition(**item))
        except (TypeError, ValueError) as err:
            raise FamilyError(f"{where}, condition {number}: {err}") from None
    return out


def _options(configs: Mapping) -> LTXPipelineOptions:
    return configs.get("pipeline", LTXPipelineOptions())


def _condition_schedule(options, num_inference_steps: int, shift, where: str, timesteps=None):
    """LTXConditionPipeline's schedule (:func:`condition_schedule`, or the custom
    ``timesteps``' :func:`custom_schedule`) as a flow-Euler state and step; the scheduler must
    take the pipeline's timesteps as they are (diffusers fails or shifts them otherwise)."""
    from jaxcore.schedulers import flow_euler, make_scheduler

    unshifted = (
        not options.use_dynamic_shifting
        and float(options.shift) == 1.0
        and not options.shift_terminal
        and not options.invert_sigmas
        and not (
            options.use_karras_sigmas or options.use_exponential_sigmas or options.use_beta_sigmas
        )
    )
    if not unshifted:
        raise FamilyError(
            f"{where}: {CONDITION_PIPELINE} is built for an unshifted scheduler (shift 1, no "
            "dynamic shifting, shift_terminal, respacing or inversion: 0.9.5 / 0.9.7's); this "
            "one shifts its timesteps"
        )
    if shift is not None and float(shift) != 1.0:
        raise FamilyError(f"flow_shift={shift}: {CONDITION_PIPELINE}'s schedule is not shifted")
    if timesteps is None:
        sigmas, timesteps = condition_schedule(num_inference_steps, options.num_train_timesteps)
    else:
        try:
            sigmas, timesteps = custom_schedule(timesteps, options.num_train_timesteps)
        except ValueError as err:
            raise FamilyError(str(err)) from None
        if len(timesteps) != num_inference_steps:
            raise FamilyError(
                f"num_inference_steps={num_inference_steps} with {len(timesteps)} custom "
                "timesteps: the steps are the timesteps' count"
            )
    _, step_fn = make_scheduler("flow_euler", num_inference_steps, 1.0)
    state = flow_euler.FlowEulerState(
        sigmas=jnp.asarray(sigmas),
        timesteps=jnp.asarray(timesteps),
        step_index=jnp.zeros((), jnp.int32),
    )
    return state, step_fn
