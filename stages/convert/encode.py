"""The encoders of the convert stage and their Beam ``ModelHandler``, for any model family.

The pipeline directory names its family (``model_index.json``); the family supplies the
encoders (:meth:`jaxcore.families.Family.load_encoders`: media -> normalised latents, captions
-> its conditioning tensors) and the record features they produce
(:meth:`~jaxcore.families.Family.record_features`, from the configs alone, so the driver can
size shards before any weights load). This module knows no model.

Every encoder call is padded to ``batch_size`` rows, so a Beam batch of any size reuses one
compiled program. :func:`encode_batch_throughput` times the bare encoders for the benchmark that
compares them with the whole Beam job.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from jaxcore import families
from jaxcore.compute import ComputeConfig
from jaxcore.families import Encoders, TensorSpec
from jaxcore.pipeline import resolve_pipeline_dir
from stages.common import records
from stages.convert.config import CONTROL_ITEM, REFERENCE_ITEM, SOUND_ITEM, EncoderConfig

log = logging.getLogger(__name__)


class EncoderLoadError(ValueError):
    """The pipeline directory is missing a part or holds an unusable model; names the path."""


@dataclass(frozen=True)
class EncoderPlan:
    """The family of a pipeline directory and the per-record tensors its encoders produce."""

    family: str
    directory: Path
    features: tuple[TensorSpec, ...]  # latents first
    latent_normalization: dict

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {f.name: f.shape for f in self.features}


def plan_encoders(config: EncoderConfig, height: int, width: int, num_frames: int) -> EncoderPlan:
    """Family and record features of ``config``'s pipeline, from its configs (no weights)."""
    source = config.pretrained_model_name_or_path
    try:
        directory = resolve_pipeline_dir(source)
        family = families.for_pipeline(directory)
        features = family.record_features(
            directory, height, width, num_frames, config.max_sequence_length
        )
        configs = family.component_configs(directory)
    except (families.FamilyError, ValueError) as err:
        raise EncoderLoadError(f"pretrained_model_name_or_path {source}: {err}") from None
    return EncoderPlan(family.name, directory, features, family.latent_normalization(configs))


def load_encoders(config: EncoderConfig, compute: ComputeConfig) -> Encoders:
    """The family's encoders of ``config``'s pipeline directory."""
    directory = resolve_pipeline_dir(config.pretrained_model_name_or_path)
    family = families.for_pipeline(directory)
    return family.load_encoders(directory, compute, config.max_sequence_length, config.batch_size)


class EncoderHandler:
    """Loads the encoders and encodes batches: ``{"source_id", "caption", "video"}`` -> the
    record's tensors.

    Each output element is ``{"source_id", "caption", "tensors": {name: array}}`` with the
    latents and the family's conditioning tensors (from the caption and, for image-to-video,
    from the video's own frames); the video is dropped. A batch holds 1..batch_size elements;
    every encoder call is padded to batch_size rows (videos and captions alike), so one compiled
    program serves every batch.

    The methods are those of Beam's ``ModelHandler`` (``load_model``, ``run_inference``,
    ``batch_elements_kwargs``, ...), but the class does not derive from it: importing
    ``apache_beam.ml`` imports torch, seconds in every worker process. The graph encodes with
    its own DoFn (:class:`stages.convert.pipeline.EncodeBatches`); ``large_model`` jobs wrap
    this in a real ModelHandler for ``RunInference`` (:mod:`stages.convert.model_handler`).
    """

    def __init__(
        self, config: EncoderConfig, compute: ComputeConfig, plan: EncoderPlan | None = None
    ):
        self._config = config
        self._compute = compute
        self._plan = plan

    @property
    def batch_size(self) -> int:
        return self._config.batch_size

    def load_model(self) -> Encoders:
        return load_encoders(self._config, self._compute)

    def encode_threads(self) -> int:
        """Encoder calls in flight at once in a worker process (``encoder.encode_threads``);
        by default 2 where JAX computes on the CPU, else 1. Ask after the model loaded."""
        if self._config.encode_threads is not None:
            return self._config.encode_threads
        import jax

        return 2 if jax.default_backend() == "cpu" else 1

    def run_inference(
        self, batch: Sequence[dict], model: Encoders, inference_args: dict | None = None
    ) -> Iterable[dict]:
        count = len(batch)
        videos = np.stack([item["video"] for item in batch])
        tensors = {records.LATENTS: _encode_media(batch, videos, model)}
        tensors.update(model.encode_media_conditioning(videos))
        tensors.update(_encode_references(batch, model))
        # full batches of captions too: the text encoder's results are sliced per call, and a
        # new batch length would compile new slicing programs (rows are independent)
        captions = [item["caption"] for item in batch]
        captions += captions[-1:] * (self.batch_size - count)
        text = {name: value[:count] for name, value in model.encode_text(captions).items()}
        tensors.update(text)
        if self._plan is not None:
            for name, shape in self._plan.shapes.items():
                if name == records.CONDITIONING_PIXELS:  # the item's own, not encoded
                    continue
                if name not in tensors:
                    raise ValueError(f"the encoders produced no {name!r}")
                _check_shape(name, tensors[name].shape[1:], shape)
        for i, item in enumerate(batch):
            # the empty-prompt item (see records.EMPTY_PROMPT_FILE) keeps its text tensors only
            names = text if item["source_id"] == records.EMPTY_PROMPT_ID else tensors
            out = {name: tensors[name][i] for name in names}
            if CONTROL_ITEM in item:  # the ControlNet's pixels, stored as they are (no encoder)
                out[records.CONDITIONING_PIXELS] = item[CONTROL_ITEM].astype(np.float32)
            yield {"source_id": item["source_id"], "caption": item["caption"], "tensors": out}

    def encode_empty_prompt(self, model: Encoders) -> dict:
        """The empty caption's text tensors (see records.EMPTY_PROMPT_FILE), as the element
        ``run_inference`` makes of the empty-prompt item, without encoding a blank video."""
        text = model.encode_text([""] * self.batch_size)  # a full batch: the same program
        return {
            "source_id": records.EMPTY_PROMPT_ID,
            "caption": "",
            "tensors": {name: value[0] for name, value in text.items()},
        }

    def batch_elements_kwargs(self) -> dict[str, Any]:
        """Full batches: a smaller one costs a full batch's compute (it is padded)."""
        return {"min_batch_size": self.batch_size, "max_batch_size": self.batch_size}

    def share_model_across_processes(self) -> bool:
        return self._config.large_model

    def get_metrics_namespace(self) -> str:
        return "convert_encoder"


def _encode_media(batch: Sequence[dict], videos: np.ndarray, model: Encoders) -> np.ndarray:
    """The latents of a batch: of the videos alone, or of the videos with their sounds (items
    with a ``sound``, ``DatasetConfig.audio_column``) by the family's
    ``encode_media_with_sound``. The empty-prompt item of a ``large_model`` job has no sound:
    it borrows a row's (only its text is kept)."""
    sounds = [item.get(SOUND_ITEM) for item in batch]
    given = [sound for sound in sounds if sound is not None]
    if not given:
        return model.encode_media(videos)
    return model.encode_media_with_sound(videos, [given[0] if s is None else s for s in sounds])


def _encode_references(batch: Sequence[dict], model: Encoders) -> dict[str, np.ndarray]:
    """The reference latents of a batch of edit pairs (items with a ``reference`` image), by
    the family's ``encode_references``; none for other batches. The empty-prompt item of a
    ``large_model`` job has no reference: it borrows a row's (only its text is kept)."""
    references = [item.get(REFERENCE_ITEM) for item in batch]
    given = [image for image in references if image is not None]
    if not given:
        return {}
    return model.encode_references([given[0] if r is None else r for r in references])


def plan_references(plan: EncoderPlan, height: int, width: int) -> EncoderPlan:
    """``plan`` with the reference latents one reference image of ``height x width`` adds to
    every record (edit pairs), by the family's ``reference_features``. A family whose
    pipelines take no references, or a size they refuse as a reference, is an
    EncoderLoadError."""
    family = families.get(plan.family)
    try:
        specs = family.reference_features(plan.directory, height, width)
    except (families.FamilyError, ValueError) as err:
        raise EncoderLoadError(str(err)) from None
    return dataclasses.replace(plan, features=(*plan.features, *specs))


def _check_shape(name: str, got: Sequence[int], expected: Sequence[int]) -> None:
    if tuple(got) != tuple(expected):
        raise ValueError(f"encoded {name} have shape {list(got)}, expected {list(expected)}")


def encode_batch_throughput(
    encoders: Encoders, videos: np.ndarray, captions: Sequence[str], repeats: int = 3
) -> dict[str, float]:
    """Items/s of the bare encoders on one full batch (first call compiles and is not timed)."""
    encoders.encode_media(videos)
    encoders.encode_text(captions)
    started = time.perf_counter()
    for _ in range(repeats):
        encoders.encode_media(videos)
        encoders.encode_text(captions)
    seconds = time.perf_counter() - started
    return {"items_per_s": repeats * len(videos) / seconds, "seconds_per_batch": seconds / repeats}
