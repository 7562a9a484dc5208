"""The JAX encoders of the convert stage and their Beam ``ModelHandler``.

:class:`WanEncoders` loads a diffusers-format pipeline directory (``vae/``, ``text_encoder/``,
``tokenizer/``; local or ``gs://``) with ``jaxcore`` and encodes fixed-size batches:

- video ``[B, 3, F, H, W]`` in [-1, 1] -> the VAE posterior *mean*, normalised with the VAE's
  ``latents_mean``/``latents_std`` (WanPipeline's convention; the manifest says
  ``latent_sampling: mean``);
- captions -> UMT5 embeddings ``[B, max_sequence_length, D]``, zero past each prompt's tokens,
  exactly as ``jaxcore.text.encode_prompts`` (= WanPipeline) computes them.

Every call is padded to ``batch_size`` rows, so a Beam batch of any size reuses one compiled
program. The class is an ordinary object (weak-referenceable, as Beam's shared model cache
needs), and importable on its own so a benchmark can time the bare encoders
(:func:`encode_batch_throughput`) against the whole Beam job.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from apache_beam.ml.inference.base import ModelHandler

from stages.convert.config import EncoderConfig

log = logging.getLogger(__name__)

VAE_DIR, TEXT_ENCODER_DIR, TOKENIZER_DIR = "vae", "text_encoder", "tokenizer"


class EncoderLoadError(ValueError):
    """The pipeline directory is missing a part or holds an unusable model; names the path."""


def resolve_pipeline_dir(pretrained_model_name_or_path: str) -> Path:
    """A local pipeline directory for a local path, a ``gs://`` URI (cached copy) or ``tiny``.

    ``tiny`` builds (once, in the difforge cache) the random-init tiny Wan pipeline of
    ``jaxcore.tiny_pipeline``, for the demo and tests.
    """
    from jaxcore.wan_pipeline import PipelineError
    from jaxcore.wan_pipeline import resolve_pipeline_dir as resolve

    try:
        directory = resolve(pretrained_model_name_or_path)
    except PipelineError as err:
        raise EncoderLoadError(str(err)) from None
    for part in (VAE_DIR, TEXT_ENCODER_DIR, TOKENIZER_DIR):
        if not (directory / part).is_dir():
            raise EncoderLoadError(
                f"pretrained_model_name_or_path {pretrained_model_name_or_path}: no {part}/ "
                f"folder (a diffusers pipeline directory needs {VAE_DIR}/, "
                f"{TEXT_ENCODER_DIR}/ and {TOKENIZER_DIR}/)"
            )
    return directory


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise EncoderLoadError(f"{path} does not exist") from None
    except json.JSONDecodeError as err:
        raise EncoderLoadError(f"{path} is not valid JSON: {err}") from None


@dataclass(frozen=True)
class EncoderShapes:
    """Per-record shapes: latents ``[C, F, H, W]`` and text ``[L, D]``; latent statistics."""

    latents: tuple[int, int, int, int]
    text: tuple[int, int]
    latents_mean: tuple[float, ...]
    latents_std: tuple[float, ...]


def expected_shapes(
    pipeline_dir: Path, num_frames: int, height: int, width: int, max_sequence_length: int
) -> EncoderShapes:
    """Record shapes from the configs alone (no weights): the driver sizes shards with them."""
    from jaxcore.models.umt5 import UMT5Config
    from jaxcore.models.wan_vae import WanVAEConfig

    vae = WanVAEConfig.from_dict(_read_json(pipeline_dir / VAE_DIR / "config.json"))
    text = UMT5Config.from_dict(_read_json(pipeline_dir / TEXT_ENCODER_DIR / "config.json"))
    spatial = 2 ** (len(vae.dim_mult) - 1)
    temporal = 2 ** sum(bool(t) for t in vae.temperal_downsample)
    if height % spatial or width % spatial or (num_frames - 1) % temporal:
        raise EncoderLoadError(
            f"{pipeline_dir / VAE_DIR}: height {height} and width {width} must be multiples of "
            f"{spatial}, and num_frames - 1 ({num_frames - 1}) a multiple of {temporal}"
        )
    latents = (vae.z_dim, (num_frames - 1) // temporal + 1, height // spatial, width // spatial)
    return EncoderShapes(
        latents=latents,
        text=(max_sequence_length, text.d_model),
        latents_mean=tuple(float(v) for v in vae.latents_mean),
        latents_std=tuple(float(v) for v in vae.latents_std),
    )


class WanEncoders:
    """The loaded VAE encoder + UMT5 text encoder + tokenizer, encoding fixed-size batches."""

    def __init__(self, config: EncoderConfig):
        import jax.numpy as jnp

        from jaxcore import text
        from jaxcore.models.umt5 import load_umt5
        from jaxcore.models.wan_vae import load_wan_vae

        self.config = config
        self.batch_size = config.batch_size
        directory = resolve_pipeline_dir(config.pretrained_model_name_or_path)
        act = jnp.dtype(config.activations_dtype)
        started = time.perf_counter()
        self.vae, self.vae_params = load_wan_vae(directory / VAE_DIR, dtype=act)
        self.text_encoder, self.text_params = load_umt5(
            directory / TEXT_ENCODER_DIR, dtype=act, param_dtype=jnp.dtype(config.weights_dtype)
        )
        self.tokenizer = text.load_tokenizer(directory / TOKENIZER_DIR)
        log.info("loaded encoders from %s in %.1fs", directory, time.perf_counter() - started)

    def encode_videos(self, videos: np.ndarray) -> np.ndarray:
        """``[B, 3, F, H, W]`` in [-1, 1], B <= batch_size -> normalised latents ``[B, C, f, h, w]``.

        The VAE posterior mean (no sampling), normalised: (mean - latents_mean) / latents_std.
        """
        from jaxcore.models.wan_vae import encode, normalize_latents

        count = self._check_batch(len(videos), "videos")
        padded = _pad_rows(np.asarray(videos, np.float32), self.batch_size)
        posterior = encode(self.vae, self.vae_params, padded)
        latents = normalize_latents(posterior.mean.astype("float32"), self.vae.config)
        return np.asarray(latents, np.float32)[:count]

    def encode_captions(self, captions: Sequence[str]) -> np.ndarray:
        """Captions (<= batch_size) -> embeddings ``[B, max_sequence_length, D]`` float32."""
        from jaxcore.text import encode_prompts

        self._check_batch(len(captions), "captions")
        embeddings, _ = encode_prompts(
            self.tokenizer,
            self.text_encoder,
            self.text_params,
            list(captions),
            self.config.max_sequence_length,
            pad_batch_to=self.batch_size,
        )
        return np.asarray(embeddings, np.float32)

    def _check_batch(self, count: int, what: str) -> int:
        if not 1 <= count <= self.batch_size:
            raise ValueError(f"{count} {what} do not fit in encoder batch_size={self.batch_size}")
        return count


def _pad_rows(array: np.ndarray, rows: int) -> np.ndarray:
    """Pad the leading axis to ``rows`` by repeating the last row (keeps values in range)."""
    extra = rows - array.shape[0]
    if extra <= 0:
        return array
    return np.concatenate([array, np.repeat(array[-1:], extra, axis=0)], axis=0)


class WanEncoderHandler(ModelHandler[dict, dict, WanEncoders]):
    """Beam ``ModelHandler``: ``{"source_id", "caption", "video"}`` -> the same with encodings.

    Each output element is ``{"source_id", "caption", "latents" [C,F,H,W],
    "encoder_hidden_states" [L,D]}`` (the video is dropped). Batches hold 1..batch_size
    elements; :class:`WanEncoders` pads them to batch_size.
    """

    def __init__(self, config: EncoderConfig, expected: EncoderShapes | None = None):
        super().__init__()
        self._config = config
        self._expected = expected

    def load_model(self) -> WanEncoders:
        return WanEncoders(self._config)

    def run_inference(
        self, batch: Sequence[dict], model: WanEncoders, inference_args: dict | None = None
    ) -> Iterable[dict]:
        videos = np.stack([item["video"] for item in batch])
        latents = model.encode_videos(videos)
        embeddings = model.encode_captions([item["caption"] for item in batch])
        if self._expected is not None:
            _check_shape("latents", latents.shape[1:], self._expected.latents)
            _check_shape("encoder_hidden_states", embeddings.shape[1:], self._expected.text)
        for item, z, emb in zip(batch, latents, embeddings, strict=True):
            yield {
                "source_id": item["source_id"],
                "caption": item["caption"],
                "latents": z,
                "encoder_hidden_states": emb,
            }

    def batch_elements_kwargs(self) -> dict[str, Any]:
        return {"min_batch_size": 1, "max_batch_size": self._config.batch_size}

    def share_model_across_processes(self) -> bool:
        return self._config.large_model

    def get_metrics_namespace(self) -> str:
        return "convert_encoder"


def _check_shape(name: str, got: Sequence[int], expected: Sequence[int]) -> None:
    if tuple(got) != tuple(expected):
        raise ValueError(f"encoded {name} have shape {list(got)}, expected {list(expected)}")


def encode_batch_throughput(
    encoders: WanEncoders, videos: np.ndarray, captions: Sequence[str], repeats: int = 3
) -> dict[str, float]:
    """Items/s of the bare encoders on one full batch (first call compiles and is not timed).

    For the benchmark that compares the whole Beam job with the encoders alone.
    """
    encoders.encode_videos(videos)
    encoders.encode_captions(captions)
    started = time.perf_counter()
    for _ in range(repeats):
        encoders.encode_videos(videos)
        encoders.encode_captions(captions)
    seconds = time.perf_counter() - started
    return {"items_per_s": repeats * len(videos) / seconds, "seconds_per_batch": seconds / repeats}
