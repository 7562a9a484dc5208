"""LTX-2 as a family: the twin of diffusers' ``LTX2Pipeline`` (text to video with audio) and
``LTX2ImageToVideoPipeline`` (what image-to-video adds: :mod:`jaxcore.families.ltx2_image`).

Reference: ``diffusers/pipelines/ltx2/pipeline_ltx2.py`` (diffusers 0.42):

- prompts -> Gemma-3's hidden states packed ``[L, D * (N + 1)]`` (left-padded to
  ``max_sequence_length``, :func:`jaxcore.models.gemma3.prompt_embeds`) -> the text connectors
  (:func:`jaxcore.models.ltx2_connectors.encode`): the video captions
  (``encoder_hidden_states``), the audio captions (``audio_encoder_hidden_states``) and one mask
  for both (``encoder_attention_mask``);
- the transformer (:mod:`jaxcore.models.ltx2_transformer`) denoises video tokens (the VAE's
  normalised latents packed ``[F' H' W', C]``) and audio tokens (the audio VAE's normalised
  latents packed ``[L, C_a M']``) together, at the same timestep, with RoPE coordinates from the
  grid, ``frame_rate / motion_speed`` and the audio length (``use_cross_timestep`` on,
  diffusers' default; both modalities are at one timestep, so off is the same render);
- the schedule: flow-match Euler with sigmas ``linspace(1, 1/N, N)`` and ``mu`` linear in the
  video's token count with the pipeline's own fallbacks (1024 / 4096 tokens, shifts 0.95 / 2.05);
  one schedule steps both modalities (diffusers deep-copies its scheduler for the audio);
- decode: the video as the LTX-2 VAE decodes it (:func:`jaxcore.models.ltx2_vae.decode_inputs`),
  the audio denormalised, unpacked, decoded to a mel spectrogram and vocoded
  (:meth:`LTX2Family.decode_audio`).

**The loop's latents (one array for two modalities).** The shared sampling loop denoises one
array, and the schedule, the Euler step and CFG are elementwise, so the family's latents hold
both modalities in one array ``[C + K, F', H', W']``: channels ``0..C-1`` are the video latents as
a prompt's ``latents`` file holds them, the ``K`` channels after them hold the audio's packed
tokens ``[L, C_a M']`` flattened (``K = ceil(L C_a M' / (F' H' W'))``, the rest zeros). The shape
keeps the video grid (so ``mu`` and the unpacking need nothing else); the audio length ``L``
follows from the frame count and the prompt's ``frame_rate`` (:func:`layout`; the render's
conditioning carries the audio tokens' coordinates, :data:`AUDIO_COORDS`, whose length says
``L`` where the shape alone cannot; without them, as in training records, :data:`FRAME_RATE`);
the two packed widths (C and ``C_a M'``) may differ. Zeros past the audio stay zero: their prediction is zero,
so the Euler step and CFG keep them. :func:`joint_latents` / :func:`split_latents` convert.
Why this layout: it needs no change to the loop or the pipeline (every hook sees one array),
and the one thing :meth:`LTX2Family.make_schedule` gets, the latents' shape, still says the
video's token count; one token array ``[F' H' W' + L, D]`` would need equal packed widths and
would hide where the video ends. A prompt's initial latents
(:meth:`LTX2Family.initial_latents`) are its ``latents`` and ``audio_latents`` files where it
gives them (noised by its ``noise_scale``, as diffusers' ``_create_noised_state``, with the
noise its seed would have drawn in their place), else noise from its seed (video first, then
audio, from one generator). The cost
is small: the released model at 121 frames of 768 x 512 has 6144 video tokens and 126 x 128
audio values, K = 3 channels beside 128.

Guidance (diffusers' delta formula on x0 predictions, ``x0 = x - sigma v``, per modality):
``x0_c + (g - 1)(x0_c - x0_u) + s (x0_c - x0_p) + (m - 1)(x0_c - x0_i)`` with
``guidance_scale`` / ``stg_scale`` / ``modality_scale`` for the video and
``audio_guidance_scale`` / ``audio_stg_scale`` / ``audio_modality_scale`` for the audio
(per-prompt settings; 0 or None: the video's, as diffusers' ``or``), ``x0_p`` the prediction
of a transformer pass whose ``spatio_temporal_guidance_blocks`` (diffusers' default [28]) return
their self-attentions' value projections (STG; the blocks reach the transformer as per-row,
per-block weights, :func:`stg_layer_weights`, so a batch may mix block lists; run where a row
perturbs a block the model has and the model has ``perturbed_attn``: otherwise diffusers' pass
equals the conditional one and its delta is 0), ``x0_i`` the prediction of a pass with the
cross-modal attention off (modality guidance, run where a row of the batch has a modality
scale > 1), then ``guidance_rescale`` /
``audio_guidance_rescale`` (``rescale_noise_cfg`` over each modality's own x0), back to a
velocity for the Euler step. The shared loop runs CFG by the video's scale, with both branches
in one denoiser call (``batched_cfg``, its default); :meth:`LTX2Family.apply` sees the pair
(the branches are marked by :data:`CFG_BRANCH`, a size-conditioning tensor that is 0 in the
conditional branch and 1 in the negative one) and gives *both* rows of a pair the guided
velocity, so the loop's ``n + g (p - n)`` returns it unchanged and its own rescale stays off;
without CFG the conditional rows get the modality guidance and the rescale alone. With
unbatched CFG the loop's velocity-space CFG is diffusers' formula rewritten (x0 is affine in v)
as long as the audio uses the video's scale and nothing else guides; otherwise such a render is
NaN (loud, never silently different). As in diffusers CFG runs when ``guidance_scale > 1`` or
``audio_guidance_scale > 1`` (:meth:`LTX2Family.with_settings_guidance`). The modality and STG passes run on all rows of the call, the negative ones included (diffusers:
the conditional ones only; the cost of not splitting the batched branches).

Per prompt: ``frame_rate`` (the playback rate: the sound lasts ``num_frames / frame_rate``, so
it sizes the latents and prompts are grouped by it) and ``motion_speed`` (the video's RoPE
reads ``frame_rate / motion_speed``, diffusers' ``conditioning_frame_rate``): the render's
conditioning carries each row's video coordinates (:data:`VIDEO_COORDS`, made on the host as
diffusers makes them: XLA's float32 division is a unit in the last place off, which moved
pixels by 6e-5).

Training records (convert, :class:`LTX2Encoders`) hold the same joint latents, the clip's
sound encoded by the audio VAE beside its frames, and :data:`JOINT_SIZES` per record, from
which :meth:`LTX2Family.loss_weights` weights the video's and the audio's values so the loss
is the sum of the two modalities' mean squared errors, as ltx-trainer's
(:func:`joint_loss_weights`; the padding left out). Both modalities train at one sigma, as
ltx-trainer does, and that sigma is the sampled ``t`` itself (``training_sigma_min`` 0, not
MaxDiffusion's); ``timestep_sampling=stretched_logit_normal`` draws ``t`` as ltx-trainer does.

Decode settings (``decode_timestep``, ``decode_noise_scale``, a timestep-conditioned VAE only):
the noise is drawn from the prompt's seed as LTX-Video's family draws it
(:func:`jaxcore.families.ltx.decode_noise`); diffusers draws it with torch, so pixels agree only
with ``decode_noise_scale=0`` or a VAE without timestep conditioning.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxcore import sharding
from jaxcore.families import flow_match, ltx2_image
from jaxcore.families.base import (
    LATENTS_FIELD,
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
from jaxcore.families.ltx import decode_noise, seed_words
from jaxcore.models import (
    gemma3,
    ltx2_audio_vae,
    ltx2_connectors,
    ltx2_mel,
    ltx2_transformer,
    ltx2_vae,
    ltx2_vocoder,
    ltx_transformer,
)

TEXT = TEXT_FEATURE  # [L, D]: the video connector's captions
AUDIO_TEXT = "audio_encoder_hidden_states"  # [L, Da]: the audio connector's captions
TEXT_MASK = "encoder_attention_mask"  # [L]: the connectors' mask (both modalities)
LATENTS = LATENTS_FIELD  # a prompt's video latents [C, F', H', W'] (normalised)
AUDIO_LATENTS = "audio_latents"  # a prompt's audio latents [C_a, L, M'] (normalised)
DECODE_TIMESTEP = "decode_timestep"  # []
DECODE_NOISE_SCALE = "decode_noise_scale"  # []
DECODE_SEED = "decode_seed"  # [2] uint32: the prompt's seed, low and high words
# a render's RoPE inputs (absent from training records: FRAME_RATE, coordinates from the grid)
VIDEO_COORDS = "video_coords"  # [3, F'H'W', 2]: the video tokens' RoPE bounds at the row's rate
AUDIO_COORDS = "audio_coords"  # [1, L, 2]: the audio tokens' [start, end) times, L its length
# Guidance (see the module docstring), per row in both branches
GUIDANCE_SCALE = "guidance_scale"  # []: the video's CFG scale (Guidance.embedded)
GUIDANCE_RESCALE = "guidance_rescale"  # []: the video's rescale, 0 = off (Guidance.embedded)
AUDIO_GUIDANCE_SCALE = "audio_guidance_scale"  # []: 0 = the video's (diffusers' `or`)
AUDIO_GUIDANCE_RESCALE = "audio_guidance_rescale"  # []: 0 = the video's
CFG_BRANCH = "cfg_branch"  # []: 0 in the conditional branch, 1 in the negative one
# only where a row of the batch has modality guidance on (its extra transformer pass)
MODALITY_SCALE = "modality_scale"  # []: 1 = off
AUDIO_MODALITY_SCALE = "audio_modality_scale"  # []: the audio's (diffusers' `or` resolved)
# only where a row of the batch has spatio-temporal guidance that perturbs something
STG_SCALE = "stg_scale"  # []: 0 = off
AUDIO_STG_SCALE = "audio_stg_scale"  # []: the audio's (diffusers' `or` resolved)
STG_LAYERS = "stg_layer_weights"  # [num_layers]: the STG pass's lerp weights, 0 = perturbed
STG_BLOCKS = "spatio_temporal_guidance_blocks"
DEFAULT_STG_BLOCKS = (28,)  # LTX2Pipeline.__call__'s default block list

PIPELINE_CLASS = "LTX2Pipeline"
NUM_TRAIN_TIMESTEPS = 1000  # the transformer's timestep t = 1000 sigma
PIPELINE_SIZE_MULTIPLE = 32  # diffusers' check_inputs: height and width divisible by 32
FRAME_RATE = 24.0  # LTX2Pipeline.__call__'s default frame_rate (and the training records')
DEFAULT_MAX_SEQUENCE_LENGTH = 1024  # LTX2Pipeline.__call__'s default
CONNECTOR_PADDING_SIDE = "left"  # the pipeline left-pads Gemma's prompts
# LTX2Pipeline's calculate_shift fallbacks (scheduler configs without these keys)
SHIFT_DEFAULTS = {
    "base_image_seq_len": 1024,
    "max_image_seq_len": 4096,
    "base_shift": 0.95,
    "max_shift": 2.05,
}
# Per-prompt settings (LTX2Pipeline.__call__'s arguments of those names)
SETTINGS = (
    "frame_rate",
    "motion_speed",
    "noise_scale",
    "image_crf",  # image-to-video: the image's H.264 re-compression (None: the pipeline's)
    "decode_timestep",
    "decode_noise_scale",
    AUDIO_GUIDANCE_SCALE,
    AUDIO_GUIDANCE_RESCALE,
    MODALITY_SCALE,
    AUDIO_MODALITY_SCALE,
    STG_SCALE,
    AUDIO_STG_SCALE,
    STG_BLOCKS,
    # both modalities denoise at one timestep here, so each one's cross-modal timestep is its
    # own and the flag changes nothing (diffusers renders the same either way)
    "use_cross_timestep",
)


# --- pure helpers ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class JointLayout:
    """Where each modality lives in the loop's latents ``[C + K, F', H', W']`` (see the module
    docstring): ``channels`` C video channels, ``audio_frames`` L audio tokens of
    ``audio_width`` = C_a M' features in the ``extra`` K channels after them."""

    channels: int
    grid: tuple[int, int, int]
    audio_frames: int
    audio_width: int

    @property
    def video_tokens(self) -> int:
        return math.prod(self.grid)

    @property
    def audio_size(self) -> int:
        return self.audio_frames * self.audio_width

    @property
    def extra(self) -> int:
        return -(-self.audio_size // self.video_tokens)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.channels + self.extra, *self.grid)


def audio_width(audio_vae: ltx2_audio_vae.LTX2AudioVAEConfig) -> int:
    """Features of one packed audio token: latent channels x latent mel bins."""
    mel_bins = audio_vae.mel_bins // ltx2_audio_vae.LATENT_DOWNSAMPLE_FACTOR
    return audio_vae.latent_channels * mel_bins


def layout(configs: Mapping, grid: Sequence[int], frame_rate: float = FRAME_RATE) -> JointLayout:
    """The joint layout of a video latent grid ``(F', H', W')`` whose sound plays at
    ``frame_rate`` (``LTX2Pipeline`` sizes it from ``num_frames / frame_rate``)."""
    vae, audio_vae = configs["vae"], configs["audio_vae"]
    num_frames = vae.temporal_compression_ratio * (grid[0] - 1) + 1
    frames = ltx2_audio_vae.audio_latent_length(audio_vae, num_frames, frame_rate)
    return JointLayout(
        vae.latent_channels, tuple(int(n) for n in grid), frames, audio_width(audio_vae)
    )


def joint_latents(video_bcfhw, audio_bclm, joint: JointLayout) -> np.ndarray:
    """Video latents ``[B, C, F', H', W']`` and audio latents ``[B, C_a, L, M']`` (both
    normalised) -> the loop's latents ``[B, C + K, F', H', W']``."""
    video = np.asarray(video_bcfhw, np.float32)
    audio = np.asarray(audio_bclm, np.float32)
    batch = video.shape[0]
    if (
        audio.ndim != 4
        or (audio.shape[0], audio.shape[2]) != (batch, joint.audio_frames)
        or audio.shape[1] * audio.shape[3] != joint.audio_width
    ):
        raise FamilyError(
            f"audio_latents {list(audio.shape)}: expected [B, C_a, {joint.audio_frames}, M'] "
            f"with C_a M' = {joint.audio_width} for this video's {joint.grid[0]} latent frames"
        )
    tokens = np.transpose(audio, (0, 2, 1, 3)).reshape(batch, -1)  # packed [L, C_a M']
    padded = np.zeros((batch, joint.extra * joint.video_tokens), np.float32)
    padded[:, : tokens.shape[1]] = tokens
    return np.concatenate([video, padded.reshape(batch, joint.extra, *joint.grid)], axis=1)


def split_latents(latents, joint: JointLayout):
    """The loop's latents -> (video ``[B, C, F', H', W']``, packed audio ``[B, L, C_a M']``)."""
    batch = latents.shape[0]
    audio = latents[:, joint.channels :].reshape(batch, -1)[:, : joint.audio_size]
    return latents[:, : joint.channels], audio.reshape(batch, joint.audio_frames, -1)


def joined_prediction(video_bcfhw, audio_bld, joint: JointLayout):
    """A prediction per modality -> the loop's layout (zeros past the audio)."""
    batch = video_bcfhw.shape[0]
    flat = audio_bld.reshape(batch, -1)
    flat = jnp.pad(flat, ((0, 0), (0, joint.extra * joint.video_tokens - joint.audio_size)))
    return jnp.concatenate([video_bcfhw, flat.reshape(batch, joint.extra, *joint.grid)], axis=1)


@dataclasses.dataclass(frozen=True)
class RowSettings:
    """One prompt's render settings: the decode timestep and noise scale, the seed's words, the
    audio's guidance scale and rescale (0: the video's, as diffusers' ``or`` reads None), the
    modality and STG guidance, the frame rate, the motion speed and the noise scale."""

    decode_timestep: float = 0.0
    decode_noise_scale: float = 0.0
    seed_words: tuple[int, int] = (0, 0)
    audio_guidance_scale: float = 0.0
    audio_guidance_rescale: float = 0.0
    modality_scale: float = 1.0
    audio_modality_scale: float = 1.0
    stg_scale: float = 0.0
    audio_stg_scale: float = 0.0
    stg_blocks: tuple[int, ...] = ()
    frame_rate: float = FRAME_RATE
    motion_speed: float = 1.0
    noise_scale: float = 0.0
    image_crf: int | None = None

    @property
    def rope_fps(self) -> float:
        """The rate the video's coordinates read (diffusers' ``conditioning_frame_rate``)."""
        return self.frame_rate / self.motion_speed

    @property
    def modality_guidance(self) -> bool:
        """diffusers runs the isolated pass when either modality's scale is > 1."""
        return self.modality_scale > 1 or self.audio_modality_scale > 1

    @property
    def spatio_temporal_guidance(self) -> bool:
        """diffusers runs the perturbed pass when either modality's STG scale is > 0."""
        return self.stg_scale > 0 or self.audio_stg_scale > 0


def _number(values: Mapping, key: str, default: float) -> float:
    value = values.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise FamilyError(f"{key}={value!r}: expected a finite number")
    return float(value)


def check_settings(values: Mapping) -> RowSettings:
    """One prompt's :class:`RowSettings`; an unknown setting, or one out of range, is an error
    naming it."""
    unknown = sorted(set(values) - {*SETTINGS, "seed"})
    if unknown:
        raise FamilyError(f"{unknown}: not settings of LTX-2 (this one takes {list(SETTINGS)})")
    frame_rate = _number(values, "frame_rate", FRAME_RATE)
    motion_speed = _number(values, "motion_speed", 1.0)
    if not (frame_rate > 0 and motion_speed > 0):  # diffusers: motion_speed must be positive
        raise FamilyError(f"frame_rate={frame_rate}, motion_speed={motion_speed}: must be > 0")
    noise_scale = _number(values, "noise_scale", 0.0)
    if not 0.0 <= noise_scale <= 1.0:
        raise FamilyError(f"noise_scale={noise_scale}: must be in [0, 1] (a share of noise)")
    crf = values.get("image_crf")
    if crf is not None and (
        isinstance(crf, bool) or not float(crf).is_integer() or not 0 <= crf <= ltx2_image.MAX_CRF
    ):
        raise FamilyError(f"image_crf={crf!r}: expected an integer in [0, {ltx2_image.MAX_CRF}]")
    timestep = _number(values, "decode_timestep", 0.0)
    scale = _number(values, "decode_noise_scale", timestep)  # diffusers: None -> the timestep
    if timestep < 0 or not 0.0 <= scale <= 1.0:
        raise FamilyError(
            f"decode_timestep={timestep}, decode_noise_scale={scale}: need >= 0 and [0, 1]"
        )
    audio_scale = _number(values, AUDIO_GUIDANCE_SCALE, 0.0)
    audio_rescale = _number(values, AUDIO_GUIDANCE_RESCALE, 0.0)
    if audio_scale < 0 or audio_rescale < 0:
        raise FamilyError(
            f"{AUDIO_GUIDANCE_SCALE}={audio_scale}, {AUDIO_GUIDANCE_RESCALE}={audio_rescale}: "
            "must be >= 0 (0 or None: the video's)"
        )
    modality = _number(values, MODALITY_SCALE, 1.0)
    audio_modality = _number(values, AUDIO_MODALITY_SCALE, 0.0) or modality  # diffusers' `or`
    if not (modality > 1 or audio_modality > 1):  # diffusers: no isolated pass, no delta
        modality = audio_modality = 1.0
    stg = _number(values, STG_SCALE, 0.0)
    audio_stg = _number(values, AUDIO_STG_SCALE, 0.0) or stg  # diffusers' `or`
    blocks = _stg_blocks(values.get(STG_BLOCKS))
    if stg < 0 or audio_stg < 0:
        raise FamilyError(f"{STG_SCALE}={stg}, {AUDIO_STG_SCALE}={audio_stg}: must be >= 0")
    if (stg > 0 or audio_stg > 0) and not blocks:  # diffusers' check_inputs
        raise FamilyError(
            f"{STG_SCALE}={stg}, {AUDIO_STG_SCALE}={audio_stg} with no {STG_BLOCKS}: name the "
            "blocks spatio-temporal guidance perturbs, or set both scales to 0"
        )
    if not isinstance(values.get("use_cross_timestep", True), bool):
        raise FamilyError(f"use_cross_timestep={values['use_cross_timestep']!r}: expected a bool")
    seed = values.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise FamilyError(f"seed={seed!r}: expected an integer >= 0")
    return RowSettings(
        timestep,
        scale,
        seed_words(seed),
        audio_scale,
        audio_rescale,
        modality,
        audio_modality,
        stg,
        audio_stg,
        blocks,
        frame_rate,
        motion_speed,
        noise_scale,
        None if crf is None else int(crf),
    )


def _stg_blocks(value) -> tuple[int, ...]:
    """A block list (None: none); indices past the model's blocks perturb nothing, as in
    diffusers (whose default [28] names a block a small model does not have)."""
    if value is None:
        return ()
    items = list(value) if isinstance(value, list | tuple) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in items):
        raise FamilyError(f"{STG_BLOCKS}={value!r}: expected a list of block indices >= 0")
    return tuple(sorted(set(items)))


def stg_layer_weights(rows: Sequence[RowSettings], num_layers: int) -> np.ndarray | None:
    """The STG pass's per-row, per-block lerp weights ``[B, num_layers]`` (0 at the blocks a
    row with STG on perturbs, 1 elsewhere), or None when no row perturbs a block the model
    has: then the pass would equal the conditional one and its delta is 0."""
    weights = np.ones((len(rows), num_layers), np.float32)
    for row, settings in enumerate(rows):
        if settings.spatio_temporal_guidance:
            weights[row, [b for b in settings.stg_blocks if b < num_layers]] = 0.0
    return weights if np.any(weights == 0) else None


def _per_row(x: jax.Array, like: jax.Array) -> jax.Array:
    """``[R]`` values broadcast against ``like`` ``[R, ...]``."""
    return x.reshape((-1,) + (1,) * (like.ndim - 1))


def x0_guided(x, cond, sigma, scales: Mapping, negative=None, isolated=None, perturbed=None):
    """diffusers' LTX-2 guidance of one modality for the conditional rows (velocities ``cond``
    at latents ``x``; per row ``sigma`` and the ``scales`` ``scale`` / ``rescale`` /
    ``modality`` / ``stg``), in x0 space (``x0 = x - sigma v``): ``x0_c`` plus the CFG delta
    ``(scale - 1)(x0_c - x0_u)`` (with the ``negative`` velocities) plus the STG delta
    ``stg (x0_c - x0_p)`` (with the ``perturbed`` ones; no ``- 1``, as diffusers) plus the
    modality delta ``(modality - 1)(x0_c - x0_i)`` (with the ``isolated`` ones), then
    ``rescale_noise_cfg``
    (Lin et al., arXiv 2305.08891, 3.4) of that against ``x0_c`` where ``rescale > 0``, back to
    a velocity ``(x - x0) / sigma``."""
    from jaxcore.sampling import rescale_guidance

    sigma = _per_row(sigma, x)
    x0_cond = x - sigma * cond
    guided = x0_cond
    if negative is not None:
        guided = guided + _per_row(scales["scale"] - 1, x) * (x0_cond - (x - sigma * negative))
    if perturbed is not None:
        guided = guided + _per_row(scales["stg"], x) * (x0_cond - (x - sigma * perturbed))
    if isolated is not None:
        guided = guided + _per_row(scales["modality"] - 1, x) * (x0_cond - (x - sigma * isolated))
    rescale = _per_row(scales["rescale"], x)
    guided = jnp.where(rescale > 0, rescale_guidance(guided, x0_cond, rescale), guided)
    return (x - guided) / sigma


def modality_scales(conditioning: Mapping) -> dict[str, dict[str, jax.Array]]:
    """Per modality its rows' ``scale``, ``rescale``, ``modality`` and ``stg`` scales (the
    audio's 0: the video's, diffusers' ``or``; ``modality`` 1 without modality guidance,
    ``stg`` 0 without spatio-temporal guidance)."""

    def audio(name: str, video: jax.Array) -> jax.Array:
        return jnp.where(conditioning[name] > 0, conditioning[name], video)

    ones = jnp.ones_like(conditioning[GUIDANCE_SCALE])
    video = {
        "scale": conditioning[GUIDANCE_SCALE],
        "rescale": conditioning[GUIDANCE_RESCALE],
        "modality": conditioning.get(MODALITY_SCALE, ones),
        "stg": conditioning.get(STG_SCALE, 0 * ones),
    }
    return {
        "video": video,
        "audio": {
            "scale": audio(AUDIO_GUIDANCE_SCALE, video["scale"]),
            "rescale": audio(AUDIO_GUIDANCE_RESCALE, video["rescale"]),
            "modality": conditioning.get(AUDIO_MODALITY_SCALE, video["modality"]),
            "stg": conditioning.get(AUDIO_STG_SCALE, video["stg"]),
        },
    }


def guided_predictions(latents, predictions, isolated, timestep, conditioning, perturbed=None):
    """Both modalities' predictions of one denoiser call, guided as diffusers guides them.

    ``latents`` and ``predictions``: ``(video, audio)`` of the call's rows; ``isolated``: the
    predictions with the cross-modal attention off (modality guidance), or None;
    ``perturbed``: those of the STG pass (the listed blocks' self-attention off), or None. A call that
    holds both CFG branches (``[cond; negative]``, :data:`CFG_BRANCH` 0 then 1: the loop's
    batched CFG) gives every row of a pair the guided velocity, so the loop's
    ``n + g (p - n)`` returns it whatever ``g``; a call of conditional rows alone (no CFG) gets
    the modality guidance and the rescale. A call of negative rows alone (the loop's unbatched
    CFG) cannot guide per modality: where that would differ from the loop's one-scale velocity
    CFG its rows are NaN, so the render fails loudly instead of differing."""
    branch = conditioning[CFG_BRANCH]
    scales = modality_scales(conditioning)
    video, audio = scales["video"], scales["audio"]
    per_modality = (
        (audio["scale"] != video["scale"])
        | (video["rescale"] > 0)
        | (audio["rescale"] > 0)
        | (video["modality"] != 1)
        | (audio["modality"] != 1)
        | (video["stg"] != 0)
        | (audio["stg"] != 0)
    )
    unguidable = (branch == 1) & per_modality
    sigma = timestep / NUM_TRAIN_TIMESTEPS
    rows = branch.shape[0]
    half = rows // 2
    paired = jnp.asarray(False)
    if rows % 2 == 0:
        paired = jnp.all(branch[:half] == 0) & jnp.all(branch[half:] == 1)
    out = []
    for index, name in enumerate(("video", "audio")):
        x, prediction = latents[index], predictions[index]
        iso = None if isolated is None else isolated[index]
        per = None if perturbed is None else perturbed[index]
        alone = x0_guided(x, prediction, sigma, scales[name], isolated=iso, perturbed=per)
        guided = jnp.where(_per_row(branch == 0, x), alone, prediction)
        if rows % 2 == 0:
            first = {k: v[:half] for k, v in scales[name].items()}
            pair = x0_guided(
                x[:half],
                prediction[:half],
                sigma[:half],
                first,
                negative=prediction[half:],
                isolated=None if iso is None else iso[:half],
                perturbed=None if per is None else per[:half],
            )
            guided = jnp.where(paired, jnp.concatenate([pair, pair]), guided)
        out.append(jnp.where(_per_row(unguidable & ~paired, x), jnp.float32(jnp.nan), guided))
    return tuple(out)


def encode_text(components: Mapping, prompts: Sequence[str], max_sequence_length: int) -> dict:
    """Gemma-3 then the connectors, as ``LTX2Pipeline.encode_prompt`` + ``connectors(...)``:
    ``{encoder_hidden_states, audio_encoder_hidden_states, encoder_attention_mask}`` float32."""
    encoder, params = components["text_encoder"]
    states, mask = gemma3.prompt_embeds(
        components["tokenizer"], encoder, params, list(prompts), 1, max_sequence_length
    )
    connectors, connector_params = components["connectors"]
    video, audio, out_mask = ltx2_connectors.encode(
        connectors, connector_params, states, mask, CONNECTOR_PADDING_SIDE
    )
    return {
        TEXT: np.asarray(video, np.float32),
        AUDIO_TEXT: np.asarray(audio, np.float32),
        TEXT_MASK: np.asarray(out_mask, np.float32),
    }


def _fit_problems(configs: Mapping) -> list[str]:
    """Components that do not make one LTX-2 pipeline (channels and widths between them)."""
    transformer, vae, audio_vae = (configs.get(k) for k in ("transformer", "vae", "audio_vae"))
    problems = []
    if transformer is None:
        return problems
    if transformer.patch_size != 1 or transformer.patch_size_t != 1:
        problems.append("transformer patch_size / patch_size_t must be 1 (every released LTX-2)")
    if vae is not None and transformer.in_channels != vae.latent_channels:
        problems.append(
            f"transformer in_channels {transformer.in_channels} != vae latent_channels "
            f"{vae.latent_channels}"
        )
    if vae is not None and transformer.vae_scale_factors[0] != vae.temporal_compression_ratio:
        problems.append(  # apply sizes the audio from the transformer's config
            f"transformer vae_scale_factors[0] {transformer.vae_scale_factors[0]} != vae "
            f"temporal_compression_ratio {vae.temporal_compression_ratio}"
        )
    if audio_vae is None:
        return problems
    if transformer.audio_in_channels != audio_width(audio_vae):
        problems.append(
            f"transformer audio_in_channels {transformer.audio_in_channels} != audio_vae "
            f"latent_channels x mel_bins / 4 = {audio_width(audio_vae)}"
        )
    pairs = (
        ("audio_sampling_rate", "sample_rate"),
        ("audio_hop_length", "mel_hop_length"),
    )
    for ours, theirs in pairs:
        if getattr(transformer, ours) != getattr(audio_vae, theirs):
            problems.append(
                f"transformer {ours} {getattr(transformer, ours)} != audio_vae {theirs} "
                f"{getattr(audio_vae, theirs)}"
            )
    if transformer.audio_scale_factor != ltx2_audio_vae.LATENT_DOWNSAMPLE_FACTOR:
        problems.append(f"transformer audio_scale_factor {transformer.audio_scale_factor} != 4")
    return problems


def _text_components(directory: Path, compute) -> dict:
    """Gemma-3 (replicated), its tokenizer and the connectors of a pipeline folder: what
    :func:`encode_text` takes (generate and convert)."""
    from jaxcore.text import load_tokenizer

    return {
        "text_encoder": _loaded(
            gemma3.load_gemma3,
            directory / "text_encoder",
            (gemma3.Gemma3ConfigError,),
            dtype=compute.dtype,
            param_dtype=compute.param_dtype,
        ),
        "connectors": _loaded(
            ltx2_connectors.load_ltx2_connectors,
            directory / "connectors",
            (ltx2_connectors.LTX2ConnectorsConfigError,),
            dtype=compute.dtype,
        ),
        "tokenizer": load_tokenizer(directory / "tokenizer"),
    }


def _loaded(load, directory: Path, errors: tuple, **kwargs):
    try:
        return load(directory, **kwargs)
    except errors as err:
        raise FamilyError(f"{directory}: {err}") from None


# --- training records (convert) and their loss ----------------------------------------------

# A record's [2]: (video latent channels C, audio values L C_a M') of its joint latents, so the
# loss can tell the two modalities and the zero padding apart (loss_mask sees no config).
JOINT_SIZES = "joint_sizes"


def clip_seconds(num_frames: int) -> float:
    """The duration of ``num_frames`` video frames at :data:`FRAME_RATE`: the span of sound a
    record of that clip holds (the audio length follows the frame count at that rate)."""
    return num_frames / FRAME_RATE


def joint_loss_weights(latents_shape, sizes):
    """Per-element weights ``[B, C + K, F', H', W']`` of the loss over joint latents whose
    ``sizes`` ``[B, 2]`` are :data:`JOINT_SIZES`: ``1 / (video values)`` on the video,
    ``1 / (audio values)`` on the audio, 0 on the padding. The loop's masked mean
    ``sum(w e)`` is then ``mean_video + mean_audio``: ltx-trainer's ``video_loss +
    audio_loss`` (each a mean over its own values, text_to_video.py ``compute_loss``).
    Jittable."""
    _, channels, *grid = latents_shape
    tokens = math.prod(grid)
    sizes = jnp.round(jnp.asarray(sizes, jnp.float32)).astype(jnp.int32)  # exact integers
    shape = (-1, 1) + (1,) * len(grid)
    video = (sizes[:, 0] * tokens).reshape(shape)
    audio = sizes[:, 1].reshape(shape)
    index = jnp.arange(channels * tokens, dtype=jnp.int32).reshape(1, channels, *grid)
    in_video = index < video
    in_audio = (index >= video) & (index < video + audio)
    weights = jnp.where(in_audio, 1.0 / audio.astype(jnp.float32), 0.0)
    return jnp.where(in_video, 1.0 / video.astype(jnp.float32), weights)


@dataclasses.dataclass(frozen=True)
class Sound:
    """One clip's sound as convert hands it over: ``waveform`` ``[channels, samples]`` float32
    at ``sample_rate`` Hz, already the clip's span (``num_frames / fps`` seconds). The
    encoders read these two attributes alone, so convert's own sound type serves as well."""

    waveform: np.ndarray
    sample_rate: int


class LTX2Encoders(Encoders):
    """The video VAE's and the audio VAE's encoders, Gemma-3, its tokenizer and the connectors
    of an LTX-2 pipeline directory (convert).

    A clip ``[3, F, H, W]`` with its sound -> the loop's joint latents ``[C + K, F', H', W']``
    (:func:`joint_latents`): the video VAE's posterior mean normalised as ``LTX2Pipeline``
    denormalises before decoding (``(z - latents_mean) * scaling_factor / latents_std``), and
    the sound as ltx-trainer's ``process_videos.py`` encodes it (:mod:`jaxcore.models.
    ltx2_mel`: stereo, resampled, log-mel) through the audio VAE's posterior mean, its first
    ``L`` latent frames (:func:`jaxcore.models.ltx2_audio_vae.audio_latent_length`; a clip's
    ``1 + samples // hop`` mel frames give ``ceil(. / 4) >= L``, the causal encoder's first
    ``L`` see only the clip's start), packed and normalised as ``LTX2Pipeline`` packs and
    normalises audio latents. Both use the posterior mean, as ltx-core's encoders return it.
    Captions -> the connectors' captions and mask exactly as :func:`encode_text` (generate)
    makes them.
    """

    def __init__(self, directory: Path, compute, max_sequence_length: int, batch_size: int):
        self.batch_size = batch_size
        self.max_sequence_length = max_sequence_length
        dtype = compute.dtype
        self.vae, self.vae_params = _loaded(
            ltx2_vae.load_ltx2_vae,
            directory / "vae",
            (ltx2_vae.LTX2VideoVAEConfigError,),
            dtype=dtype,
            encoder_only=True,
        )
        self.audio_vae, self.audio_params = _loaded(
            ltx2_audio_vae.load_ltx2_audio_vae,
            directory / "audio_vae",
            (ltx2_audio_vae.LTX2AudioVAEConfigError,),
            dtype=dtype,
            encoder_only=True,
        )
        self.text = _text_components(directory, compute)
        self.configs = {"vae": self.vae.config, "audio_vae": self.audio_vae.config}
        self.mel = ltx2_mel.MelSettings.of_audio_vae(self.audio_vae.config)

    def encode_media(self, videos: np.ndarray) -> np.ndarray:
        raise FamilyError(
            "LTX-2 records hold each clip's sound beside its frames: set dataset.audio_column "
            "(a column of sounds, or the video column itself for the videos' own sound tracks)"
        )

    def encode_media_with_sound(self, videos: np.ndarray, sounds: Sequence[Sound]) -> np.ndarray:
        """Clips ``[B, 3, F, H, W]`` in [-1, 1] and their sounds -> joint latents
        ``[B, C + K, F', H', W']`` float32."""
        videos = np.asarray(videos, np.float32)
        padded, count = self._padded(list(videos), "videos")
        if len(sounds) != count:
            raise ValueError(f"{len(sounds)} sounds for {count} videos")
        posterior = ltx2_vae.encode(self.vae, self.vae_params, jnp.asarray(np.stack(padded)))
        video = ltx2_vae.normalize_latents(
            posterior.mean.astype(jnp.float32), self.vae_params, self.vae.config.scaling_factor
        )
        joint = layout(self.configs, video.shape[2:])
        audio = self.encode_sounds(sounds, videos.shape[2], joint.audio_frames)
        return joint_latents(np.asarray(video)[:count], audio, joint)

    def encode_sounds(self, sounds: Sequence[Sound], num_frames: int, frames: int) -> np.ndarray:
        """Sounds of ``num_frames``-frame clips -> normalised audio latents ``[B, C_a, L, M']``
        (``L = frames``), the layout a prompt's ``audio_latents`` file holds."""
        seconds = clip_seconds(num_frames)
        mels = []
        for index, sound in enumerate(sounds):
            expected = int(seconds * sound.sample_rate)
            if sound.waveform.ndim != 2 or abs(sound.waveform.shape[1] - expected) > 1:
                raise FamilyError(
                    f"sound {index}: waveform {list(sound.waveform.shape)} at "
                    f"{sound.sample_rate} Hz is not [channels, {expected}]: LTX-2 records pair "
                    f"{num_frames} frames with {seconds:.4f} s of sound ({FRAME_RATE:g} fps, "
                    "the rate its audio length follows); set media.fps to it"
                )
            mels.append(
                ltx2_mel.clip_spectrogram(sound.waveform, sound.sample_rate, seconds, self.mel)
            )
        padded, count = self._padded(mels, "sounds")
        posterior = ltx2_audio_vae.encode(self.audio_vae, self.audio_params, np.stack(padded))
        mean = posterior.mean.astype(jnp.float32)
        if mean.shape[2] < frames:
            raise FamilyError(
                f"the audio VAE encodes {seconds:.4f} s to {mean.shape[2]} latent frames, "
                f"fewer than the {frames} LTX2Pipeline renders for {num_frames} frames"
            )
        packed = ltx2_audio_vae.pack_audio_latents(mean[:, :, :frames])
        normalised = ltx2_audio_vae.normalize_audio_latents(packed, self.audio_params)
        unpacked = ltx2_audio_vae.unpack_audio_latents(normalised, mean.shape[3])
        return np.asarray(unpacked, np.float32)[:count]

    def encode_media_conditioning(self, videos: np.ndarray) -> dict[str, np.ndarray]:
        """Per clip its :data:`JOINT_SIZES` (what the loss tells apart)."""
        count = self._check_batch(len(videos), "videos")
        vae = self.vae.config
        frames = (np.asarray(videos).shape[2] - 1) // vae.temporal_compression_ratio + 1
        joint = layout(self.configs, (frames, 1, 1))
        sizes = np.asarray([joint.channels, joint.audio_size], np.float32)
        return {JOINT_SIZES: np.tile(sizes[None], (count, 1))}

    def encode_text(self, captions: Sequence[str]) -> dict[str, np.ndarray]:
        padded, count = self._padded(list(captions), "captions")
        encoded = encode_text(self.text, padded, self.max_sequence_length)
        return {name: value[:count] for name, value in encoded.items()}


class LTX2Family(Family):
    name = "ltx2"
    description = (
        "LTX-2 text- and image-to-video with audio (LTX2Pipeline, LTX2ImageToVideoPipeline)"
    )
    pipeline_classes = (PIPELINE_CLASS, ltx2_image.I2V_PIPELINE)
    denoiser_classes = ("LTX2VideoTransformer3DModel",)
    denoiser_component = "transformer"
    objective = "flow_matching"
    training_sigma_min = 0.0  # ltx-trainer noises at sigma = t (text_to_video.py)
    pipeline_options = ltx2_image.LTX2PipelineOptions  # the pipeline class, image_crf
    denoiser_model = DenoiserModel(
        kind=ltx2_transformer.KIND,
        weight_map=ltx2_transformer.weight_map,
        config_error=ltx2_transformer.LTX2ConfigError,
    )
    # q/k/v/out of every attention (video and audio self / text attentions and both
    # cross-modal ones, by suffix): no diffusers LTX-2 LoRA script exists to take a default
    # from; LTX-Video's family default, which DiffSynth-Studio's LTX-2 LoRA scripts also use
    lora_default_targets = ("to_q", "to_k", "to_v", "to_out.0")

    def component_config_classes(self) -> dict[str, type]:
        return {
            "transformer": ltx2_transformer.LTX2VideoTransformerConfig,
            "vae": ltx2_vae.LTX2VideoVAEConfig,
            "audio_vae": ltx2_audio_vae.LTX2AudioVAEConfig,
            "connectors": ltx2_connectors.LTX2TextConnectorsConfig,
            "text_encoder": gemma3.Gemma3TextConfig,
        }

    def check_configs(self, configs, where) -> None:
        problems = _fit_problems(configs)
        if problems:
            raise FamilyError(f"{where}: " + "; ".join(problems))

    # --- the denoiser -----------------------------------------------------------------------
    def apply(self, module, params, latents, timestep, conditioning, run_stack=None):
        """Split the loop's latents into video and audio tokens, run the transformer on both
        (timestep and sigma ``t``; the render's coordinates, :data:`VIDEO_COORDS` and
        :data:`AUDIO_COORDS`, else from the grid at :data:`FRAME_RATE`; again with
        the cross-modal attention off for modality guidance), guide (a render's conditioning:
        :func:`guided_predictions`) and join the two velocities into the loop's layout.
        Image-to-video (:data:`jaxcore.families.ltx2_image.IMAGE_LATENTS` in the
        conditioning): the image's latent frame first, the video's per-token timesteps 0 on
        it, and its guided velocity 0 there (the step keeps it; :mod:`~jaxcore.families.
        ltx2_image`)."""
        if run_stack is not None:
            raise FamilyError("step caching is not built for LTX-2")
        joint = _layout_of(module.config, latents.shape, conditioning)
        video, audio = split_latents(latents, joint)
        t = timestep.astype(jnp.float32)
        image = conditioning.get(ltx2_image.IMAGE_LATENTS)
        video_t = None
        if image is not None:
            video = ltx2_image.with_first_frame(video, image)
            video_t = ltx2_image.video_timesteps(t, joint.grid)

        def predict(isolate: bool, layer_perturbation=None):
            return _transformer(
                module,
                params,
                video,
                audio,
                t,
                conditioning,
                joint,
                isolate,
                layer_perturbation,
                video_t=video_t,
            )

        predictions = predict(False)
        if CFG_BRANCH in conditioning:  # a render (training conditioning has no branches)
            isolated = predict(True) if MODALITY_SCALE in conditioning else None
            perturbed = None
            if STG_LAYERS in conditioning:
                perturbed = predict(False, conditioning[STG_LAYERS])
            predictions = guided_predictions(
                (video, audio), predictions, isolated, t, conditioning, perturbed
            )
        if image is not None:
            predictions = (ltx2_image.frozen_first_frame(predictions[0]), predictions[1])
        return joined_prediction(*predictions, joint)

    def flops_per_forward(self, config, batch, latent_shape, conditioning_shapes):
        """Matmul FLOPs of one denoiser call (:meth:`apply`) over ``batch`` rows: one
        transformer pass (:func:`jaxcore.models.ltx2_transformer.flops_per_forward`: video
        tokens ``F' H' W'``, audio tokens of the joint layout, the captions' lengths from the
        conditioning), plus the passes guidance adds to a render (every row of the call runs
        them): the isolated pass (no cross-modal attention) where the conditioning carries
        :data:`MODALITY_SCALE`, and the STG pass (a whole pass: its blocks compute the
        attention and ``lerp`` it with the values) where it carries :data:`STG_LAYERS`. CFG's
        negative rows are counted by the caller, in ``batch``, as for every family."""
        passes = self._transformer_passes(config, latent_shape, conditioning_shapes)
        return sum(ltx2_transformer.flops_per_forward(config, batch, *p) for p in passes)

    def attention_flops_per_forward(self, config, batch, latent_shape, conditioning_shapes):
        """The scores and values of every attention of :meth:`flops_per_forward` (self, text
        and cross-modal: all run through the attention backend, the splash kernel on TPU)."""
        passes = self._transformer_passes(config, latent_shape, conditioning_shapes)
        return sum(ltx2_transformer.attention_flops_per_forward(config, batch, *p) for p in passes)

    @staticmethod
    def _transformer_passes(config, latent_shape, conditioning_shapes) -> list[tuple]:
        """Per transformer pass of one :meth:`apply`: (video tokens, audio tokens, caption
        tokens, audio caption tokens, cross-modal attention on)."""
        joint = _layout_of(config, (1, *latent_shape), conditioning_shapes)
        text = conditioning_shapes[TEXT][0]
        audio_text = conditioning_shapes.get(AUDIO_TEXT, (text,))[0]
        tokens = (joint.video_tokens, joint.audio_frames, text, audio_text)
        passes = [(*tokens, True)]
        if CFG_BRANCH in conditioning_shapes:  # a render: the guidance passes apply runs
            if MODALITY_SCALE in conditioning_shapes:
                passes.append((*tokens, False))  # modality guidance's isolated pass
            if STG_LAYERS in conditioning_shapes:
                passes.append((*tokens, True))  # the STG pass
        return passes

    def timestep_tokens(self, config, latent_shape):
        """The video's tokens (ltx-trainer shifts its sampler by the video latents' length)."""
        return _layout_of(config, (1, *latent_shape)).video_tokens

    def tokens_per_example(self, config, latent_shape):
        """Video tokens plus audio tokens (the two streams the transformer runs)."""
        joint = _layout_of(config, (1, *latent_shape))
        return joint.video_tokens + joint.audio_frames

    def lora_to_diffusers(self, state_dict, denoiser_config, where: str):
        """diffusers / PEFT (``transformer.``) and LTX-2 trainer / ComfyUI
        (``diffusion_model.``, original names) LTX-2 LoRAs (:mod:`jaxcore.lora.ltx2`)."""
        from jaxcore.lora import ltx2 as ltx2_lora

        return ltx2_lora.to_diffusers(state_dict, denoiser_config, where)

    def check_heads(self, config, mesh) -> None:
        sharding.check_divisible(mesh, heads=config.num_attention_heads)
        sharding.check_divisible(mesh, heads=config.audio_num_attention_heads)

    # --- conditioning and latents -----------------------------------------------------------
    def conditioning_specs(self, denoiser_config, text_length, latent_shape, image_tokens=None):
        """The connectors' video and audio captions and their mask (what generate makes, and
        what records hold beside their latents and :data:`JOINT_SIZES`): ``caption_channels``
        wide where the transformer projects them (LTX-2.0), else at its attention widths
        (LTX-2.3)."""
        del latent_shape, image_tokens
        config = denoiser_config
        widths = (config.caption_channels, config.caption_channels)
        if not config.use_prompt_embeddings:
            widths = (config.cross_attention_dim, config.audio_cross_attention_dim)
        return (
            TensorSpec(TEXT, (text_length, widths[0])),
            TensorSpec(AUDIO_TEXT, (text_length, widths[1])),
            TensorSpec(TEXT_MASK, (text_length,)),
        )

    def latent_channels(self, denoiser_config) -> int:
        return denoiser_config.in_channels

    def geometry(self, configs) -> Geometry:
        vae = configs["vae"]
        spatial = math.lcm(PIPELINE_SIZE_MULTIPLE, vae.spatial_compression_ratio)
        return Geometry(spatial, vae.temporal_compression_ratio)

    def latent_shape(self, configs, height, width, num_frames):
        """``[C + K, F', H', W']``: the video's latents and the audio's in K more channels (the
        sound at :data:`FRAME_RATE`)."""
        return self.render_latent_shape(configs, height, width, num_frames, {})

    def render_latent_shape(self, configs, height, width, num_frames, settings):
        """:meth:`latent_shape` with the sound as long as ``num_frames`` at the prompt's
        ``frame_rate``."""
        vae = configs["vae"]
        t, s = vae.temporal_compression_ratio, vae.spatial_compression_ratio
        grid = ((num_frames - 1) // t + 1, height // s, width // s)
        return layout(configs, grid, _frame_rate(settings)).shape

    def latent_inputs(self, configs, shape, settings=None) -> dict[str, tuple[int, ...]]:
        """A prompt's two initial arrays: the video's ``latents`` ``[C, F', H', W']`` and the
        ``audio_latents`` ``[C_a, L, M']`` (normalised, the audio VAE's [channels, time, mel]
        layout; L from the prompt's ``frame_rate``), both as :func:`joint_latents` joins
        them."""
        joint = layout(configs, shape[1:], _frame_rate(settings))
        audio_vae = configs["audio_vae"]
        mel_bins = joint.audio_width // audio_vae.latent_channels
        return {
            LATENTS: (joint.channels, *joint.grid),
            AUDIO_LATENTS: (audio_vae.latent_channels, joint.audio_frames, mel_bins),
        }

    def initial_latents(self, configs, shape, seed, given, settings=None):
        """The loop's latents of one prompt: its video and audio arrays where it gives them,
        else drawn from its seed, video first then audio, from one generator
        (:func:`jaxcore.sampling.initial_latent_parts`: the video noise is every other
        family's noise of its shape, the audio noise the same whether or not a video is
        given), joined by :func:`joint_latents`. A given array is noised by the prompt's
        ``noise_scale`` ``s`` as diffusers' ``_create_noised_state``: ``s n + (1 - s) x``, ``n``
        the noise the seed draws in its place (diffusers draws it with torch)."""
        from jaxcore.sampling import initial_latent_parts

        settings = dict(settings or {})
        noise_scale = check_settings(settings).noise_scale
        shapes = self.latent_inputs(configs, shape, settings)
        drawn = dict(zip(shapes, initial_latent_parts(seed, list(shapes.values())), strict=True))
        parts = []
        for name in shapes:
            part = drawn[name]
            if name in given:
                x = np.asarray(given[name], np.float32)
                part = x if noise_scale == 0 else _noised(x, drawn[name], noise_scale)
            parts.append(np.asarray(part, np.float32)[None])
        return joint_latents(*parts, layout(configs, shape[1:], _frame_rate(settings)))[0]

    # --- image-to-video (LTX2ImageToVideoPipeline, jaxcore/families/ltx2_image.py) ----------
    def image_inputs(self, configs) -> ImageInputs:
        """An image-to-video pipeline takes one image per prompt (required); the text-to-video
        one none."""
        return ImageInputs("required" if ltx2_image.options(configs).image_to_video else "none")

    def encode_images(self, pipe, images, height, width, num_frames, settings=None):
        """Image-to-video: per row the image's latent frame ``[C, 1, H', W']``
        (:func:`jaxcore.families.ltx2_image.image_latents`, re-compressed at the row's
        ``image_crf`` setting, else the pipeline option's) as
        :data:`jaxcore.families.ltx2_image.IMAGE_LATENTS`."""
        del num_frames
        inputs = self.image_inputs(pipe.configs)
        inputs.check_rows(images)
        if inputs.image == "none":
            return {}
        if not height:
            raise FamilyError("LTX-2 image conditioning needs the render size")
        vae, params = pipe.components["vae"]
        default = ltx2_image.options(pipe.configs).crf
        crfs = [check_settings(values).image_crf for values in settings or [{}] * len(images)]
        crfs = [default if crf is None else crf for crf in crfs]
        rows = [image for image, _ in images]
        latents = ltx2_image.image_latents(vae, params, rows, height, width, crfs)
        return {ltx2_image.IMAGE_LATENTS: latents}

    def start_latents(self, latents, conditioning):
        """Image-to-video: the video's first latent frame is the image's (the audio and the
        other frames: the prompt's noise)."""
        if ltx2_image.IMAGE_LATENTS not in conditioning:
            return latents
        image = conditioning[ltx2_image.IMAGE_LATENTS]
        return np.asarray(ltx2_image.with_first_frame(jnp.asarray(latents), image))

    def finish_latents(self, latents, conditioning):
        """Image-to-video: the first latent frame is the image's (the loop kept it: its
        velocity is 0; set again so the decode never depends on that)."""
        if ltx2_image.IMAGE_LATENTS not in conditioning:
            return latents
        return ltx2_image.with_first_frame(latents, conditioning[ltx2_image.IMAGE_LATENTS])

    def load_encoders(self, directory, compute, max_sequence_length, batch_size):
        """:class:`LTX2Encoders` (convert: clips with their sound, captions)."""
        return LTX2Encoders(Path(directory), compute, max_sequence_length, batch_size)

    def records_sound(self) -> bool:
        """Convert pairs every clip with its sound (``dataset.audio_column``)."""
        return True

    def record_features(self, directory, height, width, num_frames, max_sequence_length):
        """The base records (joint latents ``[C + K, F', H', W']``, the connectors' captions and
        mask) and :data:`JOINT_SIZES` ``[2]``."""
        features = super().record_features(
            directory, height, width, num_frames, max_sequence_length
        )
        return (*features, TensorSpec(JOINT_SIZES, (2,)))

    def check_features(self, denoiser_config, features, where):
        """Records must hold the joint latents the transformer's config lays out for their
        video grid (the audio length and width from its audio settings), then what every
        family checks (the conditioning, the video channels)."""
        latents = features.get(LATENTS)
        if latents is None:
            return super().check_features(denoiser_config, features, where)
        joint = _layout_of(denoiser_config, (1, *latents.shape))
        if tuple(latents.shape) != joint.shape:
            raise FamilyError(
                f"{where}: records do not fit the {self.name} model: 'latents' "
                f"{list(latents.shape)}, the transformer takes {list(joint.shape)} for that "
                f"grid ({joint.channels} video channels, then {joint.audio_frames} audio tokens "
                f"of {joint.audio_width} in {joint.extra} more channels)"
            )
        video = TensorSpec(LATENTS, (joint.channels, *joint.grid))
        return super().check_features(denoiser_config, {**features, LATENTS: video}, where)

    def loss_weights(self, latents_shape, conditioning):
        """Records with :data:`JOINT_SIZES`: the video and the audio each weighted by its own
        size, the padding left out (:func:`joint_loss_weights`; the loss is the sum of the two
        means); else None (the mean over every value)."""
        if JOINT_SIZES not in conditioning:
            return None
        return joint_loss_weights(latents_shape, conditioning[JOINT_SIZES])

    def latent_normalization(self, configs) -> dict:
        vae, audio_vae = configs["vae"], configs["audio_vae"]
        mel = ltx2_mel.MelSettings.of_audio_vae(audio_vae)
        return {
            "latent_sampling": "mean",
            "formula": "(z - latents_mean) * scaling_factor / latents_std",
            "scaling_factor": vae.scaling_factor,
            "audio_formula": "(packed z - latents_mean) / latents_std (audio_vae's buffers)",
            "layout": "[C + K, F', H', W']: video channels, then the packed audio tokens [L, "
            "C_a M'] flattened and zero-padded (jaxcore/families/ltx2.py)",
            "frame_rate": FRAME_RATE,
            "audio": dataclasses.asdict(mel),
        }

    # --- inference --------------------------------------------------------------------------
    def load_components(self, directory, configs, compute, mesh, rules, denoiser):
        """The video VAE, the audio VAE and the vocoder (on the mesh: they decode the loop's
        latents), Gemma-3, its tokenizer and the connectors (replicated), and the joint
        layout's inputs in ``configs``."""
        directory = Path(directory)
        dtype = compute.dtype
        components = {
            "vae": _loaded(
                ltx2_vae.load_ltx2_vae,
                directory / "vae",
                (ltx2_vae.LTX2VideoVAEConfigError,),
                dtype=dtype,
                mesh=mesh,
                rules=rules,
            ),
            "audio_vae": _loaded(
                ltx2_audio_vae.load_ltx2_audio_vae,
                directory / "audio_vae",
                (ltx2_audio_vae.LTX2AudioVAEConfigError,),
                dtype=dtype,
                mesh=mesh,  # decode_audio runs in the mesh's context, on the loop's latents
                rules=rules,
            ),
            "vocoder": _loaded(
                ltx2_vocoder.load_ltx2_vocoder,
                directory / "vocoder",
                (ltx2_vocoder.LTX2VocoderConfigError,),
                dtype=dtype,
                mesh=mesh,
                rules=rules,
            ),
            **_text_components(directory, compute),
        }
        return {"components": components}

    def encode_prompts(self, pipe, prompts, max_sequence_length):
        return encode_text(pipe.components, prompts, max_sequence_length)

    def size_conditioning(self, configs, height, width, micro, num_frames=None):
        """Per row the decode settings, the seed, the audio's guidance settings (both
        branches), which CFG branch a row is in (:data:`CFG_BRANCH`) and, given the size, the
        tokens' coordinates (:data:`VIDEO_COORDS` at each row's ``frame_rate /
        motion_speed``, :data:`AUDIO_COORDS`: a batch shares one audio length, so one frame
        rate; prompts are grouped by it). Settings out of range are refused by name
        (:func:`check_settings`)."""
        rows = [check_settings(values) for values in micro]
        transformer = configs["transformer"]
        # image-to-video: the video's per-token timesteps differ from the audio's, so
        # diffusers' cross-modal attention renders otherwise without the cross timestep
        cross_off = any(values.get("use_cross_timestep") is False for values in micro)
        if cross_off and ltx2_image.options(configs).image_to_video:
            raise FamilyError(
                "use_cross_timestep=False: not built for LTX-2 image-to-video (its "
                "first frame's timesteps differ from the audio's, so it changes the render)"
            )

        def column(name, dtype=np.float32):
            return np.asarray([getattr(r, name) for r in rows], dtype)

        cond = {
            DECODE_TIMESTEP: column("decode_timestep"),
            DECODE_NOISE_SCALE: column("decode_noise_scale"),
            DECODE_SEED: column("seed_words", np.uint32).reshape(len(rows), 2),
            AUDIO_GUIDANCE_SCALE: column("audio_guidance_scale"),
            AUDIO_GUIDANCE_RESCALE: column("audio_guidance_rescale"),
            CFG_BRANCH: np.zeros((len(rows),), np.float32),
        }
        if _render_coords(rows, height, width, num_frames):
            cond[VIDEO_COORDS] = _video_coords(configs, rows, (num_frames, height, width))
            cond[AUDIO_COORDS] = _audio_coords(configs, rows, num_frames)
        if any(r.modality_guidance for r in rows):  # the extra pass only where it is needed
            cond[MODALITY_SCALE] = column("modality_scale")
            cond[AUDIO_MODALITY_SCALE] = column("audio_modality_scale")
        # the STG pass only where it perturbs a block: without perturbed_attn (every released
        # LTX-2.0) or past the model's blocks diffusers' pass equals the conditional one
        weights = stg_layer_weights(rows, transformer.num_layers)
        if weights is not None and transformer.perturbed_attn:
            cond[STG_SCALE] = column("stg_scale")
            cond[AUDIO_STG_SCALE] = column("audio_stg_scale")
            cond[STG_LAYERS] = weights
        return cond, {**cond, CFG_BRANCH: np.ones((len(rows),), np.float32)}

    def decode(self, pipe, latents, conditioning=None):
        """The video part -> frames ``[B, F, H, W, 3]`` in [0, 1] (LTX2Pipeline's decode)."""
        vae, params = pipe.components["vae"]
        video = jnp.asarray(latents, jnp.float32)[:, : vae.config.latent_channels]
        rows = video.shape[0]
        conditioning = conditioning or {}
        timestep = conditioning.get(DECODE_TIMESTEP, np.zeros((rows,), np.float32))
        scale = conditioning.get(DECODE_NOISE_SCALE, timestep)
        noise = None
        if vae.config.timestep_conditioning:
            seeds = conditioning.get(DECODE_SEED, np.zeros((rows, 2), np.uint32))
            noise = decode_noise(seeds, video.shape[1:])
        z, temb = ltx2_vae.decode_inputs(
            video,
            params,
            vae.config,
            decode_timestep=timestep,
            decode_noise_scale=scale,
            noise_bcfhw=noise,
        )
        return decoded_frames(ltx2_vae.decode(vae, params, z.astype(vae.dtype), temb))

    def decode_audio(self, pipe, latents, conditioning=None):
        """The audio part -> (waveform float32 ``[B, channels, samples]``, sample rate):
        denormalised, unpacked, decoded to a mel spectrogram, vocoded (LTX2Pipeline's chain);
        its length from the ``conditioning``'s :data:`AUDIO_COORDS` (else at
        :data:`FRAME_RATE`)."""
        audio_vae, audio_params = pipe.components["audio_vae"]
        vocoder, vocoder_params = pipe.components["vocoder"]
        joint = _layout_of(pipe.configs["transformer"], latents.shape, conditioning or {})
        _, tokens = split_latents(jnp.asarray(latents, jnp.float32), joint)
        tokens = ltx2_audio_vae.denormalize_audio_latents(tokens, audio_params)
        mel_bins = audio_vae.config.mel_bins // ltx2_audio_vae.LATENT_DOWNSAMPLE_FACTOR
        z = ltx2_audio_vae.unpack_audio_latents(tokens, mel_bins)
        mel = ltx2_audio_vae.decode(audio_vae, audio_params, z.astype(audio_vae.dtype))
        wave = ltx2_vocoder.vocode(vocoder, vocoder_params, mel)
        return np.asarray(wave, np.float32), int(vocoder.config.output_sampling_rate)

    def sampling_defaults(self, configs) -> dict:
        # LTX2Pipeline.__call__'s defaults (num_frames: its fallback without a duration head),
        # its guidance too (STG at scale 1 on block 28); image-to-video's image_crf
        image = ltx2_image.options(configs)
        crf = {"image_crf": image.crf} if image.image_to_video else {}
        return {
            **crf,
            "height": 512,
            "width": 768,
            "num_frames": 121,
            "num_inference_steps": 30,
            "guidance_scale": 3.0,
            "guidance_rescale": 0.7,
            AUDIO_GUIDANCE_SCALE: 7.0,
            AUDIO_GUIDANCE_RESCALE: 0.7,
            MODALITY_SCALE: 3.0,
            AUDIO_MODALITY_SCALE: 3.0,
            "frame_rate": FRAME_RATE,
            "motion_speed": 1.0,
            "noise_scale": 0.0,
            "decode_timestep": 0.0,
            "decode_noise_scale": None,
            "use_cross_timestep": True,
            STG_SCALE: 1.0,
            AUDIO_STG_SCALE: 1.0,
            STG_BLOCKS: DEFAULT_STG_BLOCKS,
            "max_sequence_length": DEFAULT_MAX_SEQUENCE_LENGTH,
        }

    def default_scheduler(self, scheduler_config) -> str:
        return flow_match.scheduler_name(scheduler_config, "LTX-2")

    def make_schedule(self, pipe, scheduler, num_inference_steps, shift, latent_shape):
        """The pipeline's schedule: sigmas ``linspace(1, 1/N, N)``, ``mu`` from the video's
        token count ``F' H' W'`` with the pipeline's fallbacks (:data:`SHIFT_DEFAULTS`)."""
        from jaxcore.schedulers import make_scheduler
        from jaxcore.schedulers.flow_euler import calculate_shift, pipeline_sigmas

        options = flow_match.euler_options(pipe, scheduler, shift, "LTX-2", "the video's size")
        config = {**SHIFT_DEFAULTS, **pipe.scheduler_config}
        f, h, w = latent_shape[-3:]
        mu = calculate_shift(
            f * h * w,
            config["base_image_seq_len"],
            config["max_image_seq_len"],
            config["base_shift"],
            config["max_shift"],
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
            raise FamilyError(f"{pipe.source}/scheduler/scheduler_config.json: {err}") from None

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
                f"true_cfg_scale={true_cfg_scale}: LTX-2 has no true CFG; its guidance_scale is "
                "the classifier-free guidance scale"
            )
        if guidance_scale_2 is not None:
            raise FamilyError(f"guidance_scale_2={guidance_scale_2}: LTX-2 has one transformer")
        scale = float(guidance_scale)
        # the loop's CFG runs by the video's scale; the family guides (apply) with both
        return Guidance(cfg_scale=scale, embedded={GUIDANCE_SCALE: scale, GUIDANCE_RESCALE: 0.0})

    def with_settings_guidance(self, configs, guidance, settings):
        """CFG on when the audio's scale is > 1 though the video's is not (diffusers'
        ``do_classifier_free_guidance``): the loop then runs both branches and :meth:`apply`
        guides each modality by its own scale (the video's delta is 0 at scale 1; the loop's
        ``n + g (p - n)`` returns apply's result whatever ``g``)."""
        del configs
        audio = _number(settings, AUDIO_GUIDANCE_SCALE, 0.0)
        if guidance.uses_cfg or not audio > 1.0:
            return guidance
        return dataclasses.replace(guidance, cfg_scale=audio)

    def with_guidance_rescale(self, configs, guidance, guidance_rescale):
        """diffusers' ``guidance_rescale`` for the video (and the audio, unless a row sets
        ``audio_guidance_rescale``), applied by :meth:`apply` to each modality's x0; the
        loop's own velocity-space rescale stays off."""
        value = float(guidance_rescale)
        if not value >= 0.0:
            raise FamilyError(f"guidance_rescale={guidance_rescale}: must be >= 0 (0 = off)")
        embedded = {**guidance.embedded, GUIDANCE_RESCALE: value}
        return dataclasses.replace(guidance, embedded=embedded, guidance_rescale=0.0)


def _transformer(
    module,
    params,
    video,
    audio,
    t,
    conditioning,
    joint: JointLayout,
    isolate,
    perturb=None,
    video_t=None,
):
    """One transformer call as ``LTX2Pipeline`` makes it: (video velocity ``[B, C, F', H',
    W']``, audio velocity ``[B, L, C_a M']``) float32; ``isolate``: no cross-modal attention;
    ``perturb``: the STG pass's per-row, per-block lerp weights (``layer_perturbation``);
    ``video_t``: the video's per-token timesteps ``[B, F' H' W']`` (image-to-video), else
    ``t`` for both modalities (the audio's timestep and ``sigma`` are always ``t``)."""
    f, h, w = joint.grid
    dtype = module.dtype
    mask = conditioning[TEXT_MASK]
    # a render's coordinates (each row's rate, the render's sound); else from the grid
    coords = {k: conditioning[k] for k in (VIDEO_COORDS, AUDIO_COORDS) if k in conditioning}
    video_out, audio_out = module.apply(
        {"params": params},
        ltx_transformer.pack_latents(video.astype(dtype)),
        audio.astype(dtype),
        conditioning[TEXT].astype(dtype),
        conditioning[AUDIO_TEXT].astype(dtype),
        t if video_t is None else video_t,
        audio_timestep=t,
        sigma=t,
        encoder_attention_mask=mask,
        audio_encoder_attention_mask=mask,
        num_frames=f,
        height=h,
        width=w,
        fps=FRAME_RATE,
        audio_num_frames=joint.audio_frames,
        isolate_modalities=isolate,
        use_cross_timestep=True,
        layer_perturbation=perturb,
        **coords,
    )
    video_out = ltx_transformer.unpack_latents(video_out, f, h, w)
    return video_out.astype(jnp.float32), audio_out.astype(jnp.float32)


def _layout_of(config, shape, conditioning: Mapping | None = None) -> JointLayout:
    """The joint layout of the loop's latents from the transformer's config; the audio length
    is that of the ``conditioning``'s :data:`AUDIO_COORDS` (arrays ``[B, 1, L, 2]`` or
    per-example shapes ``(1, L, 2)``), else :data:`FRAME_RATE` at the video's frame count, as
    :func:`layout`."""
    grid = tuple(int(n) for n in shape[2:])
    coords = (conditioning or {}).get(AUDIO_COORDS)
    if coords is not None:  # an array, or its per-example shape (the FLOP counts)
        frames = int((coords if isinstance(coords, tuple) else np.shape(coords))[-2])
    else:
        scale_t = int(config.vae_scale_factors[0])
        num_frames = scale_t * (grid[0] - 1) + 1
        frames = ltx2_transformer.audio_num_frames(
            num_frames,
            FRAME_RATE,
            config.audio_sampling_rate,
            config.audio_hop_length,
            config.audio_scale_factor,
        )
    return JointLayout(config.in_channels, grid, frames, config.audio_in_channels)


def _frame_rate(settings: Mapping | None) -> float:
    """A prompt's ``frame_rate`` (:data:`FRAME_RATE` unless its settings give one)."""
    return _number(settings or {}, "frame_rate", FRAME_RATE)


def _noised(x: np.ndarray, noise: np.ndarray, scale: float) -> np.ndarray:
    """diffusers' ``_create_noised_state``: ``scale * noise + (1 - scale) * x`` (float32)."""
    scale = np.float32(scale)
    return scale * noise + (np.float32(1) - scale) * x


def _render_coords(rows: Sequence[RowSettings], height, width, num_frames) -> bool:
    """Whether the conditioning carries the tokens' coordinates: given the render's size (else
    every row must play at :data:`FRAME_RATE` and speed 1, the transformer's own grid)."""
    if None not in (height, width, num_frames):
        return True
    if any(r.frame_rate != FRAME_RATE or r.motion_speed != 1.0 for r in rows):
        raise FamilyError(
            "frame_rate / motion_speed: the sound's length and the video's coordinates follow "
            "them; pass size=(height, width, num_frames) to Pipeline.conditioning"
        )
    return False


def _audio_coords(configs, rows: Sequence[RowSettings], num_frames: int) -> np.ndarray:
    """The audio tokens' coordinates ``[B, 1, L, 2]`` of a render of ``num_frames``
    (``prepare_audio_coords``); the rows must share one audio length."""
    rates = sorted({r.frame_rate for r in rows})
    transformer, audio_vae = configs["transformer"], configs["audio_vae"]
    lengths = {
        rate: ltx2_audio_vae.audio_latent_length(audio_vae, num_frames, rate) for rate in rates
    }
    if len(set(lengths.values())) > 1:
        raise FamilyError(
            f"frame_rate {rates} in one batch: {num_frames} frames then give sounds of "
            f"{sorted(set(lengths.values()))} latent frames; a batch shares one (group by "
            "frame_rate)"
        )
    return ltx2_transformer.audio_coords(
        len(rows),
        lengths[rates[0]],
        patch_size_t=transformer.audio_patch_size_t,
        scale_factor=transformer.audio_scale_factor,
        sampling_rate=transformer.audio_sampling_rate,
        hop_length=transformer.audio_hop_length,
        causal_offset=transformer.causal_offset,
    )


def _video_coords(configs, rows: Sequence[RowSettings], size) -> np.ndarray:
    """The video tokens' coordinates ``[B, 3, F' H' W', 2]`` of a render of ``size`` (frames,
    height, width), each row's at its ``frame_rate / motion_speed``
    (:func:`jaxcore.models.ltx2_transformer.video_coords`, diffusers' float32 operations)."""
    transformer, vae = configs["transformer"], configs["vae"]
    t, s = vae.temporal_compression_ratio, vae.spatial_compression_ratio
    num_frames, height, width = size
    grid = ((num_frames - 1) // t + 1, height // s, width // s)
    by_rate = {
        fps: ltx2_transformer.video_coords(
            1,
            *grid,
            fps,
            patch_size=transformer.patch_size,
            patch_size_t=transformer.patch_size_t,
            scale_factors=transformer.vae_scale_factors,
            causal_offset=transformer.causal_offset,
        )
        for fps in {r.rope_fps for r in rows}
    }
    return np.concatenate([by_rate[r.rope_fps] for r in rows])
