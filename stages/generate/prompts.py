"""Prompt files -> validated :class:`PromptSpec` list, before anything is rendered.

Formats (local path or ``gs://``):
- ``.txt``: one prompt per line; blank lines and lines starting with ``#`` are ignored.
- ``.jsonl``: one JSON object per line (blank and ``#`` lines ignored) with ``prompt`` and
  optionally ``id``, ``negative_prompt``, ``seed``, ``height``, ``width``, ``num_frames``,
  ``num_inference_steps``, ``guidance_scale``, ``guidance_scale_2`` (the second expert's
  scale of two-expert Wan 2.2 models; default ``guidance_scale``), ``true_cfg_scale``,
  ``flow_shift`` and ``latents`` (a ``.npy`` of the initial noise, relative to the prompt file
  or absolute/gs://), ``image`` and ``last_image`` (conditioning images of image-to-video
  models, PNG/JPEG/..., paths as for ``latents``; ``image`` may be a list of 1-N paths, the
  reference images of a model whose family takes several, e.g. Flux.2 [klein]'s 1-4; a batch
  shares their number and sizes) and ``loras`` (a list of ``{"path", "scale", "expert"}``,
  ``expert`` ``low`` for a two-expert model's ``transformer_2``: the LoRAs of this prompt
  instead of the config's ``model.loras``; prompts are grouped by LoRA set), and the render
  settings only some families take (:data:`FAMILY_SETTINGS`: LTX-Video's ``frame_rate``,
  ``decode_timestep``, ``decode_noise_scale`` and ``image_cond_noise_scale``; the audio's and
  the modalities' guidance of a family that renders sound, ``audio_guidance_scale``,
  ``audio_guidance_rescale``, ``modality_scale``, ``audio_modality_scale``,
  ``use_cross_timestep`` (a bool), its spatio-temporal guidance ``stg_scale``,
  ``audio_stg_scale`` and ``spatio_temporal_guidance_blocks`` (a list of block indices), and
  LTX-2's ``noise_scale``, ``motion_speed`` and ``image_crf``; a model whose family has no
  default for one refuses it, naming the line; prompts are grouped by
  :data:`SHAPE_SETTINGS`), ``audio_latents`` (a ``.npy`` of the initial audio latents beside
  ``latents``, for a family whose latents hold sound; paths as for
  ``latents``; the family says which arrays it takes and their shapes, another family
  refuses it naming the line), and ``conditions`` (a list of
  ``{"image" | "video": path, "frame_index": int, "strength": number}``, LTXConditionPipeline
  only: a ``video`` is a ``.npy`` of frames ``[F, H, W, 3]`` in [0, 1] or a video file imageio
  reads; paths as for ``latents``), and ``timesteps`` (a custom timestep list, as diffusers'
  ``timesteps=``: strictly decreasing numbers in [0, 1000], the step count their number; taken
  by a model whose family's defaults name ``timesteps``, LTXConditionPipeline's, e.g. the
  distilled LTX-Video models; prompts are grouped by it).
  Values a line leaves out come from the config's ``sampling`` section, then from the
  pipeline's own defaults; sizes are checked against the model.

Every problem (broken JSON, unknown field, wrong type, bad value, empty prompt, duplicate id)
is a :class:`StageInputError` naming the file and line; all lines are checked first.

Determinism: a prompt without an explicit ``seed`` gets one derived from the config seed and
its id (:func:`derive_seed`), so its noise never depends on batch composition or device count,
and the derived seed is recorded so the run can be reproduced elsewhere.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from collections.abc import Iterable

from jaxcore import storage
from jaxcore.families import MICRO_CONDITIONING, Geometry, ImageInputs
from stages.common.errors import StageInputError
from stages.generate import control_inputs
from stages.generate.config import ControlSection, SamplingSection

FIELDS_INT = ("seed", "height", "width", "num_frames", "num_inference_steps")
# Render settings only some families take (LTX-Video's RoPE frame rate and decode noise): a
# line's value, else the config's sampling section, else the model's sampling_defaults; a
# family takes one exactly when its sampling_defaults name it. They reach the family with the
# size conditioning (PromptSpec.micro_conditioning), together with the prompt's seed (the
# decode noise is drawn from it).
FAMILY_NUMBERS = (
    "frame_rate",
    "decode_timestep",
    "decode_noise_scale",
    "image_cond_noise_scale",
    # the guidance of a family that renders sound (per modality, and its modality guidance)
    "audio_guidance_scale",
    "audio_guidance_rescale",
    "modality_scale",
    "audio_modality_scale",
    # spatio-temporal guidance (LTX-2: a pass with the listed blocks' self-attention off)
    "stg_scale",
    "audio_stg_scale",
    # LTX-2: how far given latents are noised (diffusers' noise_scale), and the motion's
    # speed (its RoPE reads frame_rate / motion_speed)
    "noise_scale",
    "motion_speed",
    # LTX-2 image-to-video: the H.264 CRF its conditioning image is re-compressed at
    "image_crf",
)
FAMILY_BOOLS = ("use_cross_timestep",)
# integer lists: the blocks a family's spatio-temporal guidance perturbs (LTX-2)
FAMILY_INDEX_LISTS = ("spatio_temporal_guidance_blocks",)
FAMILY_SETTINGS = (*FAMILY_NUMBERS, *FAMILY_BOOLS, *FAMILY_INDEX_LISTS)
# Family settings a batch shares, in PromptSpec.group_key: they size a render's latents (LTX-2:
# its sound lasts num_frames / frame_rate; LTX-Video's prompts are grouped by them too)
SHAPE_SETTINGS = ("frame_rate",)
# Frame conditions (LTXConditionPipeline): taken by a model whose defaults name this setting
CONDITIONS_SETTING = "image_cond_noise_scale"
FIELDS_FLOAT = (
    "guidance_scale",
    "guidance_scale_2",
    "true_cfg_scale",
    "flow_shift",
    "guidance_rescale",
    *FAMILY_NUMBERS,
)
FIELDS_BOOL = FAMILY_BOOLS
# .npy files of a line's initial latents: which ones a model takes is its family's
# (Family.latent_inputs); the loop's latents are made from them by Family.initial_latents
LATENT_FILES = ("latents", "audio_latents")
FIELDS_STR = ("id", "prompt", "negative_prompt", *LATENT_FILES, "image", "last_image")
FIELDS_LIST = ("loras", "conditions")
# A custom timestep list (diffusers' timesteps=), taken by a model whose defaults name it
TIMESTEPS = "timesteps"
MAX_TIMESTEP = 1000  # the flow-match schedulers' num_train_timesteps (the family re-checks)
FIELDS_PAIR = MICRO_CONDITIONING  # SDXL's size / crop conditioning: [a, b] integer pairs
KNOWN_FIELDS = frozenset(
    (
        *FIELDS_INT,
        *FIELDS_FLOAT,
        *FIELDS_BOOL,
        *FIELDS_STR,
        *FIELDS_LIST,
        *FIELDS_PAIR,
        *FAMILY_INDEX_LISTS,
        TIMESTEPS,
        *control_inputs.FIELDS,
    )
)

# Per-prompt values that fall back to the config's sampling section (then the model's).
PER_PROMPT_DEFAULTS = (
    "height",
    "width",
    "num_frames",
    "num_inference_steps",
    "guidance_scale",
    "guidance_scale_2",
    "true_cfg_scale",
    "flow_shift",
    "guidance_rescale",
)
# Per-prompt values whose None is meaningful (the pipeline's own choice).
OPTIONAL_VALUES = ("flow_shift", "guidance_scale_2")

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
MAX_NAME_LENGTH = 80


@dataclasses.dataclass(frozen=True)
class PromptSpec:
    """One prompt with every render parameter resolved (file values over config defaults)."""

    index: int  # position in the file (0-based, counting prompts only)
    line: int  # 1-based line number in the prompt file
    id: str
    name: str  # file-safe, collision-free output name derived from id
    prompt: str
    negative_prompt: str
    seed: int
    height: int
    width: int
    num_frames: int
    num_inference_steps: int
    guidance_scale: float
    true_cfg_scale: float
    flow_shift: float | None
    latents: str | None  # URI of a .npy of initial noise, or None
    # (path, scale, expert) merged into the denoiser ("high") or a second expert ("low")
    loras: tuple[tuple[str, float, str], ...] = ()
    guidance_scale_2: float | None = None  # the second expert's scale (two-expert models)
    guidance_rescale: float = 0.0  # SD / SDXL's rescale of the CFG result (0 = off)
    # URI of the conditioning image (image-to-video), or the URIs of a line's list of
    # reference images (a model that takes several)
    image: str | tuple[str, ...] | None = None
    last_image: str | None = None  # URI of the last frame's image (first-last-frame models)
    # what the family's size conditioning reads, (name, value) sorted by name: SDXL's
    # micro-conditioning the line sets ((a, b) pairs; unset = defaults) and the family render
    # settings (FAMILY_SETTINGS, with the seed) of a family that takes them
    micro_conditioning: tuple[tuple[str, tuple[int, int] | float | int], ...] = ()
    # frame conditions (LTXConditionPipeline): (kind "image" | "video", URI, frame_index,
    # strength)
    conditions: tuple[tuple[str, str, int, float], ...] = ()
    # a custom timestep list (num_inference_steps is its length), None: the pipeline's schedule
    timesteps: tuple[float, ...] | None = None
    # ControlNet inputs (control images, scales, window, ...), None: none
    control: control_inputs.ControlSpec | None = None
    # the sides ("height", "width") neither the line nor the config gives, for a model that
    # sizes a render by its first image (ImageInputs.size_from_image), each side on its own as
    # the pipeline's ``height or image_height``: they hold the defaults until run.py reads it
    size_from_image: tuple[str, ...] = ()
    # (width, height) of each reference image, set (after the files are read) only for a model
    # that takes several: a batch shares its references' token layout; None: not grouped by it
    image_sizes: tuple[tuple[int, int], ...] | None = None
    # URI of a .npy of the initial audio latents (a family whose latents hold sound), or None
    audio_latents: str | None = None

    @property
    def latent_files(self) -> dict[str, str]:
        """The line's initial-latent files by field (:data:`LATENT_FILES`), those it gives."""
        uris = {"latents": self.latents, "audio_latents": self.audio_latents}
        return {name: uri for name, uri in uris.items() if uri is not None}

    @property
    def image_uris(self) -> tuple[str, ...]:
        """The ``image`` slot's URIs (none, one, or a line's list)."""
        if self.image is None:
            return ()
        return self.image if isinstance(self.image, tuple) else (self.image,)

    @property
    def uses_cfg(self) -> bool:
        """Whether the render runs classifier-free guidance: its guidance scale > 1, or (a
        family that renders sound, as diffusers' LTX-2 pipelines) its audio's."""
        audio = dict(self.micro_conditioning).get("audio_guidance_scale") or 0.0
        return self.guidance_scale > 1.0 or audio > 1.0

    @property
    def group_key(self) -> tuple:
        """Prompts with the same key share one compiled program (shape, steps, CFG on/off)."""
        return (
            self.height,
            self.width,
            self.num_frames,
            self.num_inference_steps,
            self.uses_cfg,
            self.true_cfg_scale > 1.0,
            self.flow_shift,
            self.loras,
            self.image is not None,
            self.last_image is not None,
            self.conditions,  # a batch shares its conditions' token layout
            self.timesteps,
            # a batch shares whether it is controlled, and how many control images it has
            None if self.control is None else len(self.control.images),
            self.image_sizes,  # None unless the model takes several reference images
            # the family settings that size the latents (LTX-2's sound follows frame_rate)
            tuple((k, v) for k, v in self.micro_conditioning if k in SHAPE_SETTINGS),
        )

    def params(self) -> dict:
        """The render parameters, as recorded in the per-prompt record and the manifest
        (``guidance_rescale`` and SDXL's micro-conditioning only when set, so earlier runs'
        fingerprints still match)."""
        out = {
            "prompt": self.prompt,
            "negative_prompt": self.negative_prompt,
            "seed": self.seed,
            "height": self.height,
            "width": self.width,
            "num_frames": self.num_frames,
            "num_inference_steps": self.num_inference_steps,
            "guidance_scale": self.guidance_scale,
            "guidance_scale_2": self.guidance_scale_2,
            "true_cfg_scale": self.true_cfg_scale,
            "flow_shift": self.flow_shift,
            "latents": self.latents,
            "loras": [lora_entry(*use) for use in self.loras],
            "image": list(self.image) if isinstance(self.image, tuple) else self.image,
            "last_image": self.last_image,
        }
        if self.guidance_rescale:
            out["guidance_rescale"] = self.guidance_rescale
        if self.audio_latents is not None:
            out["audio_latents"] = self.audio_latents
        if self.conditions:
            out["conditions"] = [condition_entry(*c) for c in self.conditions]
        if self.timesteps is not None:
            out[TIMESTEPS] = list(self.timesteps)
        if self.control is not None:
            out.update(self.control.entry())
        for name, value in self.micro_conditioning:
            out[name] = list(value) if isinstance(value, tuple) else value
        return out


def derive_seed(base_seed: int, prompt_id: str) -> int:
    """A 31-bit seed from the config seed and the prompt id (stable across runs and hosts)."""
    digest = hashlib.sha256(f"{base_seed}:{prompt_id}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def safe_name(prompt_id: str) -> str:
    """A file name for ``prompt_id``: no path separators, no traversal, no collisions.

    Ids that are already safe (letters, digits, ``._-``, not starting with a dot, at most
    ``MAX_NAME_LENGTH`` long) are used as they are. Any other id is sanitised and suffixed with
    a hash of the original, so two different ids never map to the same name.
    """
    if (
        prompt_id
        and not _UNSAFE.search(prompt_id)
        and not prompt_id.startswith(".")
        and len(prompt_id) <= MAX_NAME_LENGTH
    ):
        return prompt_id
    cleaned = _UNSAFE.sub("_", prompt_id).strip("._")[: MAX_NAME_LENGTH - 9] or "prompt"
    digest = hashlib.sha256(prompt_id.encode()).hexdigest()[:8]
    return f"{cleaned}-{digest}"


def _where(uri: str, line: int) -> str:
    return f"{uri} line {line}"


def lora_entry(path: str, scale: float, expert: str = "high") -> dict:
    """How a LoRA use is recorded (``expert`` only where it is not the default)."""
    entry = {"path": path, "scale": scale}
    if expert != "high":
        entry["expert"] = expert
    return entry


def condition_entry(kind: str, uri: str, frame_index: int, strength: float) -> dict:
    """How a frame condition is recorded (as the prompt line gives it, the path resolved)."""
    return {kind: uri, "frame_index": frame_index, "strength": strength}


def _check_conditions(value, where: str) -> list[dict]:
    """A line's ``conditions``: a list of ``{"image" | "video": str, "frame_index": int >= 0,
    "strength": number in [0, 1]}`` (frame_index 0 and strength 1 by default)."""
    if not isinstance(value, list) or not value:
        raise StageInputError(
            f'{where}: conditions must be a non-empty list of {{"image" | "video": path, '
            f'"frame_index": int, "strength": number}}, got {value!r}'
        )
    for i, item in enumerate(value):
        name = f"{where}: conditions[{i}]"
        if not isinstance(item, dict):
            raise StageInputError(f"{name} must be an object, got {item!r}")
        unknown = sorted(set(item) - {"image", "video", "frame_index", "strength"})
        if unknown:
            raise StageInputError(f"{name} has unknown field(s) {unknown}")
        kinds = [k for k in ("image", "video") if k in item]
        if len(kinds) != 1 or not isinstance(item[kinds[0]], str) or not item[kinds[0]]:
            raise StageInputError(f"{name} needs exactly one of image and video (a path)")
        index = item.get("frame_index", 0)
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise StageInputError(f"{name}.frame_index must be an integer >= 0, got {index!r}")
        strength = item.get("strength", 1.0)
        if isinstance(strength, bool) or not isinstance(strength, int | float):
            raise StageInputError(f"{name}.strength must be a number, got {strength!r}")
        if not 0.0 <= strength <= 1.0:
            raise StageInputError(f"{name}.strength must be in [0, 1], got {strength!r}")
    return value


def _resolve_conditions(given: list[dict], prompt_file: str, where: str, model_defaults):
    """(kind, URI, frame_index, strength) per condition; refused where the model's family
    takes none (its defaults have no :data:`CONDITIONS_SETTING`)."""
    if model_defaults is not None and CONDITIONS_SETTING not in model_defaults:
        raise StageInputError(
            f"{where}: conditions are for LTXConditionPipeline models; this model takes none"
        )
    out = []
    for item in given:
        kind = "image" if "image" in item else "video"
        uri = _resolve_path(item[kind], prompt_file)
        out.append((kind, uri, int(item.get("frame_index", 0)), float(item.get("strength", 1.0))))
    return tuple(out)


def _check_loras(value, where: str) -> list[dict]:
    """A line's ``loras``: a list of ``{"path": str, "scale": number, "expert": "high" |
    "low"}`` objects (scale and expert optional)."""
    if not isinstance(value, list):
        raise StageInputError(f"{where}: loras must be a list of {{path, scale}}, got {value!r}")
    for i, item in enumerate(value):
        if not isinstance(item, dict) or not isinstance(item.get("path"), str) or not item["path"]:
            raise StageInputError(f'{where}: loras[{i}] must be {{"path": ..., "scale": ...}}')
        unknown = sorted(set(item) - {"path", "scale", "expert"})
        if unknown:
            raise StageInputError(f"{where}: loras[{i}] has unknown field(s) {unknown}")
        scale = item.get("scale", 1.0)
        if isinstance(scale, bool) or not isinstance(scale, int | float):
            raise StageInputError(f"{where}: loras[{i}].scale must be a number, got {scale!r}")
        if item.get("expert", "high") not in ("high", "low"):
            raise StageInputError(
                f"{where}: loras[{i}].expert must be 'high' or 'low', got {item['expert']!r}"
            )
    return value


def _check_timesteps(value, where: str) -> tuple[float, ...]:
    """A line's ``timesteps``: a non-empty list of numbers, strictly decreasing, each in
    ``[0, MAX_TIMESTEP]``."""
    numbers = isinstance(value, list) and all(
        not isinstance(v, bool) and isinstance(v, int | float) for v in value
    )
    if not numbers or not value:
        raise StageInputError(
            f"{where}: timesteps must be a non-empty list of numbers, got {value!r}"
        )
    if not all(math.isfinite(v) and 0 <= v <= MAX_TIMESTEP for v in value):
        raise StageInputError(
            f"{where}: timesteps must each be in [0, {MAX_TIMESTEP}], got {value!r}"
        )
    if any(b >= a for a, b in zip(value, value[1:], strict=False)):
        raise StageInputError(f"{where}: timesteps must be strictly decreasing, got {value!r}")
    return tuple(float(v) for v in value)


def _resolve_timesteps(given: dict, fields: dict, where: str, model_defaults) -> tuple | None:
    """The line's ``timesteps`` (None when it gives none), refused where the model takes none
    (its defaults do not name them) or where the line's ``num_inference_steps`` differs from
    their count; ``fields["num_inference_steps"]`` becomes their count."""
    timesteps = given.get(TIMESTEPS)
    if timesteps is None:
        return None
    if model_defaults is not None and TIMESTEPS not in model_defaults:
        raise StageInputError(
            f"{where}: timesteps are for models whose pipeline takes a custom timestep list "
            "(an LTXConditionPipeline, as the distilled models are); this model takes none"
        )
    steps = given.get("num_inference_steps")
    if steps is not None and steps != len(timesteps):
        raise StageInputError(
            f"{where}: num_inference_steps={steps} with {len(timesteps)} timesteps; leave "
            "num_inference_steps unset (the steps are the timesteps' count)"
        )
    fields["num_inference_steps"] = len(timesteps)
    return timesteps


def _check_image(value, where: str):
    """A line's ``image``: a path, or a non-empty list of paths (the model checks the count)."""
    if isinstance(value, list):
        if not value or not all(isinstance(v, str) and v for v in value):
            raise StageInputError(
                f"{where}: image must be a path or a non-empty list of paths, got {value!r}"
            )
        return value
    if not isinstance(value, str):
        raise StageInputError(f"{where}: image must be a string or a list, got {value!r}")
    return value


def _check_type(value, field: str, where: str):
    """Validate one field's JSON type; ints are accepted for float fields."""
    if field == "image":
        return _check_image(value, where)
    if field == TIMESTEPS:
        return _check_timesteps(value, where)
    if field in control_inputs.FIELDS:
        return control_inputs.check_field(field, value, where)
    if field == "conditions":
        return _check_conditions(value, where)
    if field in FIELDS_LIST:
        return _check_loras(value, where)
    if field in FAMILY_INDEX_LISTS:
        ok = isinstance(value, list) and all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
        )
        if not ok:
            raise StageInputError(
                f"{where}: {field} must be a list of block indices (integers >= 0), got {value!r}"
            )
        return tuple(value)
    if field in FIELDS_PAIR:
        pair_ok = isinstance(value, list) and len(value) == 2
        if not pair_ok or any(isinstance(v, bool) or not isinstance(v, int) for v in value):
            raise StageInputError(f"{where}: {field} must be two integers [a, b], got {value!r}")
        if min(value) < 0:
            raise StageInputError(f"{where}: {field} must not be negative, got {value!r}")
        return tuple(value)
    if field in FIELDS_INT:
        if isinstance(value, bool) or not isinstance(value, int):
            raise StageInputError(f"{where}: {field} must be an integer, got {value!r}")
        return value
    if field in FIELDS_BOOL:
        if not isinstance(value, bool):
            raise StageInputError(f"{where}: {field} must be true or false, got {value!r}")
        return value
    if field in FIELDS_FLOAT:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise StageInputError(f"{where}: {field} must be a number, got {value!r}")
        if not math.isfinite(value):  # JSON's NaN / Infinity extensions
            raise StageInputError(f"{where}: {field} must be a finite number, got {value!r}")
        return float(value)
    if not isinstance(value, str):
        raise StageInputError(f"{where}: {field} must be a string, got {value!r}")
    return value


def _parse_jsonl_line(text: str, where: str) -> dict:
    try:
        record = json.loads(text)
    except json.JSONDecodeError as err:
        raise StageInputError(
            f"{where}: malformed JSON ({err.msg} at column {err.colno})"
        ) from None
    if not isinstance(record, dict):
        raise StageInputError(f"{where}: expected a JSON object, got {type(record).__name__}")
    unknown = sorted(set(record) - KNOWN_FIELDS)
    if unknown:
        raise StageInputError(
            f"{where}: unknown field(s) {unknown}; known fields: {sorted(KNOWN_FIELDS)}"
        )
    if "prompt" not in record:
        raise StageInputError(f"{where}: missing field 'prompt'")
    return {k: _check_type(v, k, where) for k, v in record.items()}


def _resolve_path(path: str, prompt_file: str) -> str:
    """A relative path (``latents``, ``image``, ...) is relative to the prompt file's folder."""
    if storage.is_gcs(path) or path.startswith("/"):
        return path
    folder = prompt_file.rsplit("/", 1)[0] if "/" in prompt_file else "."
    return storage.join(folder, path)


def _resolve_latent_files(given: dict, prompt_file: str, where: str) -> dict[str, str]:
    """The line's :data:`LATENT_FILES`, each a ``.npy`` path resolved as ``latents``'s."""
    out = {}
    for field in LATENT_FILES:
        path = given.get(field)
        if path is None:
            continue
        if not path.endswith(".npy"):
            raise StageInputError(f"{where}: {field} must name a .npy file, got {path!r}")
        out[field] = _resolve_path(path, prompt_file)
    return out


def _resolve_image(given: str | list | None, prompt_file: str) -> str | tuple | None:
    """A line's ``image`` / ``last_image``: its path resolved, or a list's paths (a tuple)."""
    if given is None:
        return None
    if isinstance(given, list):
        return tuple(_resolve_path(path, prompt_file) for path in given)
    return _resolve_path(given, prompt_file)


def _resolve_loras(given: list[dict], prompt_file: str) -> tuple[tuple[str, float, str], ...]:
    """(path, scale, expert); a relative path that exists beside the prompt file is taken
    there."""
    out = []
    for item in given:
        path = item["path"]
        if not (storage.is_gcs(path) or path.startswith("/")):
            beside = _resolve_path(path, prompt_file)
            if storage.exists(beside):
                path = beside
        out.append((path, float(item.get("scale", 1.0)), item.get("expert", "high")))
    return tuple(out)


def _sides_from_image(
    given: dict, defaults: SamplingSection, fields: dict, image_inputs: ImageInputs | None
) -> tuple[str, ...]:
    """The sides a line leaves to its first image (none unless the model sizes by it)."""
    if fields["image"] is None or image_inputs is None or not image_inputs.size_from_image:
        return ()
    return tuple(s for s in ("height", "width") if s not in given and getattr(defaults, s) is None)


def _check_values(
    fields: dict, where: str, geometry: Geometry | None, image_inputs: ImageInputs | None
) -> None:
    if not fields["prompt"].strip():
        raise StageInputError(f"{where}: empty prompt")
    for key in PER_PROMPT_DEFAULTS:
        if fields[key] is None and key not in OPTIONAL_VALUES:
            raise StageInputError(f"{where}: no {key} (set sampling.{key} or the line's {key})")
    for key in ("height", "width", "num_frames", "num_inference_steps"):
        if fields[key] < 1:
            raise StageInputError(f"{where}: {key} must be >= 1, got {fields[key]}")
    if fields["seed"] < 0:
        raise StageInputError(f"{where}: seed must be >= 0, got {fields['seed']}")
    if not 0.0 <= fields["guidance_rescale"] <= 1.0:
        raise StageInputError(
            f"{where}: guidance_rescale must be in [0, 1], got {fields['guidance_rescale']}"
        )
    if fields["flow_shift"] is not None and fields["flow_shift"] <= 0:
        raise StageInputError(f"{where}: flow_shift must be > 0, got {fields['flow_shift']}")
    if geometry is not None:
        try:
            geometry.check(fields["height"], fields["width"], fields["num_frames"])
        except ValueError as err:
            raise StageInputError(f"{where}: {err}") from None
    if image_inputs is not None:
        has_image, has_last = fields["image"] is not None, fields["last_image"] is not None
        try:
            if isinstance(fields["image"], tuple):
                image_inputs.check_count(len(fields["image"]), where)
            image_inputs.check(has_image, has_last, where)
        except ValueError as err:
            raise StageInputError(str(err)) from None


def family_settings(
    given: dict, base: dict, model_defaults: dict | None, seed: int, where: str
) -> tuple[tuple[str, float | int], ...]:
    """A line's :data:`FAMILY_SETTINGS` (the line's, else the config's / the model's defaults),
    and its seed beside them when the model's family takes any; a setting the model's family
    has no default for is an error naming the line (without a model, all pass through)."""
    settings: dict[str, float | int] = {}
    for key in FAMILY_SETTINGS:
        value = given.get(key, base.get(key))
        if value is None:
            continue
        if model_defaults is not None and key not in model_defaults:
            raise StageInputError(
                f"{where}: {key}={value} is not a setting of this model's pipelines (its "
                "family takes no such value); leave it unset"
            )
        settings[key] = value
    takes = model_defaults is not None and any(k in model_defaults for k in FAMILY_SETTINGS)
    if settings or takes:
        settings["seed"] = seed
    return tuple(settings.items())


def _raw_entries(uri: str, lines: Iterable[str]) -> Iterable[tuple[int, dict]]:
    """(line number, fields given on that line) for every prompt line."""
    is_jsonl = uri.endswith(".jsonl")
    for number, raw in enumerate(lines, start=1):
        text = raw.strip()
        if not text or text.startswith("#"):
            continue
        where = _where(uri, number)
        yield number, _parse_jsonl_line(text, where) if is_jsonl else {"prompt": text}


def resolved_defaults(defaults: SamplingSection, model_defaults: dict | None) -> dict:
    """The config's sampling values, with ``None`` filled from the model's own defaults."""
    values = dataclasses.asdict(defaults)
    for key, value in (model_defaults or {}).items():
        if values.get(key) is None:
            values[key] = value
    return values


def parse_entries(uri: str, lines: Iterable[str]) -> list[tuple[int, dict]]:
    """(line number, fields) of every prompt line, syntax and field types checked."""
    if not uri.endswith((".txt", ".jsonl")):
        raise StageInputError(f"prompt_file {uri}: expected a .txt or .jsonl file")
    entries = list(_raw_entries(uri, lines))
    if not entries:
        raise StageInputError(f"prompt_file {uri} holds no prompts")
    return entries


def parse_prompts(
    uri: str,
    lines: Iterable[str],
    defaults: SamplingSection,
    model_defaults: dict | None = None,
    geometry: Geometry | None = None,
) -> list[PromptSpec]:
    """Validate every line and resolve defaults (:func:`resolve_prompts`)."""
    return resolve_prompts(uri, parse_entries(uri, lines), defaults, model_defaults, geometry)


def _unique_id(given: dict, index: int, number: int, where: str, seen_ids, seen_names):
    """(the line's id, its output name), both unused so far (recorded in ``seen_*``)."""
    prompt_id = given.get("id", f"{index:05d}")
    if not prompt_id.strip():
        raise StageInputError(f"{where}: empty id")
    if prompt_id in seen_ids:
        raise StageInputError(
            f"{where}: duplicate id {prompt_id!r} (first used on line {seen_ids[prompt_id]})"
        )
    seen_ids[prompt_id] = number
    name = safe_name(prompt_id)
    if name in seen_names:  # only possible when a raw id equals another's sanitised name
        raise StageInputError(
            f"{where}: id {prompt_id!r} gives the output name {name!r} already used on "
            f"line {seen_names[name]}; choose another id"
        )
    seen_names[name] = number
    return prompt_id, name


def resolve_prompts(
    uri: str,
    entries: list[tuple[int, dict]],
    defaults: SamplingSection,
    model_defaults: dict | None = None,
    geometry: Geometry | None = None,
    loras: tuple[tuple[str, float, str], ...] = (),
    image_inputs: ImageInputs | None = None,
    control: ControlSection | None = None,
) -> list[PromptSpec]:
    """Prompt entries -> PromptSpecs; raises StageInputError naming the line.

    ``model_defaults`` fill the config's ``None`` values (the pipeline's own defaults);
    ``geometry`` checks each prompt's size against the model; ``loras`` are the (path, scale,
    expert) uses of every prompt without its own ``loras`` list; ``image_inputs`` checks each line's
    ``image`` / ``last_image`` against what the model takes; ``control``: the config's defaults
    of the ControlNet fields (:mod:`stages.generate.control_inputs`).
    """
    control = control or ControlSection()
    base = resolved_defaults(defaults, model_defaults)
    specs: list[PromptSpec] = []
    seen_ids: dict[str, int] = {}
    seen_names: dict[str, int] = {}
    for number, given in entries:
        where = _where(uri, number)
        index = len(specs)
        prompt_id, name = _unique_id(given, index, number, where, seen_ids, seen_names)
        fields = {
            "prompt": given["prompt"],
            "negative_prompt": given.get("negative_prompt", base["negative_prompt"]),
            "seed": given.get("seed", derive_seed(base["seed"], prompt_id)),
        }
        for key in PER_PROMPT_DEFAULTS:
            fields[key] = given.get(key, base[key])
        if fields["guidance_rescale"] is None:  # neither given nor a pipeline default: off
            fields["guidance_rescale"] = 0.0
        timesteps = _resolve_timesteps(given, fields, where, model_defaults)
        for key in ("image", "last_image"):
            fields[key] = _resolve_image(given.get(key), uri)
        _check_values(fields, where, geometry, image_inputs)
        latent_files = _resolve_latent_files(given, uri, where)
        own = _resolve_loras(given["loras"], uri) if "loras" in given else tuple(loras)
        micro = [(key, given[key]) for key in FIELDS_PAIR if key in given]
        micro += family_settings(given, base, model_defaults, fields["seed"], where)
        conditions = ()
        if "conditions" in given:
            conditions = _resolve_conditions(given["conditions"], uri, where, model_defaults)
        sized = "height" in given or "width" in given or defaults.height or defaults.width
        controlled = control_inputs.resolve(
            given, control, lambda path: _resolve_path(path, uri), where, bool(sized)
        )
        specs.append(
            PromptSpec(
                index=index,
                line=number,
                id=prompt_id,
                name=name,
                latents=latent_files.get("latents"),
                audio_latents=latent_files.get("audio_latents"),
                loras=own,
                micro_conditioning=tuple(sorted(micro)),
                conditions=conditions,
                timesteps=timesteps,
                control=controlled,
                size_from_image=_sides_from_image(given, defaults, fields, image_inputs),
                **fields,
            )
        )
    return specs


def read_prompt_entries(uri: str) -> list[tuple[int, dict]]:
    """Read a prompt file (local or gs://) and check every line's syntax and fields."""
    try:
        text = storage.read_text(uri)
    except storage.StorageError:
        raise StageInputError(f"prompt_file {uri} does not exist") from None
    except UnicodeDecodeError as err:
        raise StageInputError(f"prompt_file {uri} is not UTF-8 text: {err}") from None
    return parse_entries(uri, text.splitlines())
