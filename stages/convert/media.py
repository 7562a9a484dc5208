"""Pure per-element media functions: decode an image or video, sample frames, resize and crop.

An image is a 1-frame video. Videos are decoded with imageio's ffmpeg plugin (imageio-ffmpeg
ships the binary). Every failure raises :class:`DropItem` carrying a *reason* (a short counter
name such as ``undecodable_media``) so the Beam graph can count and skip the row.
"""

from __future__ import annotations

import io
import math
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from stages.common.subprocesses import allow_fork_exec_under_jax

# Drop reasons: each becomes a Beam Metrics counter and a manifest entry.
MISSING_MEDIA = "missing_media"
UNDECODABLE_MEDIA = "undecodable_media"
TOO_FEW_FRAMES = "too_few_frames"
EMPTY_CAPTION = "empty_caption"
TOO_SMALL = "media_too_small"
MISSING_SOUND = "missing_sound"
UNDECODABLE_SOUND = "undecodable_sound"
DROP_REASONS = (
    MISSING_MEDIA,
    UNDECODABLE_MEDIA,
    TOO_FEW_FRAMES,
    EMPTY_CAPTION,
    TOO_SMALL,
    MISSING_SOUND,
    UNDECODABLE_SOUND,
)

VIDEO_SUFFIXES = (".mp4", ".webm", ".mov", ".avi", ".mkv", ".gif", ".m4v")


class DropItem(Exception):
    """A source row that cannot become a record; ``reason`` is one of :data:`DROP_REASONS`."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class Clip:
    """Decoded frames ``[T, H, W, 3]`` uint8 and the source frame rate (None for an image)."""

    frames: np.ndarray
    fps: float | None


def media_bytes(value: Any) -> tuple[bytes, str]:
    """The raw bytes and a name hint of a dataset cell.

    Accepts what ``datasets`` yields for an undecoded ``Image``/``Video`` feature
    (``{"bytes": ..., "path": ...}``), raw bytes, or a file path string.
    """
    if value is None:
        raise DropItem(MISSING_MEDIA, "the media cell is empty")
    if isinstance(value, bytes | bytearray):
        return bytes(value), ""
    if isinstance(value, str):
        return _read_path(value), value
    if isinstance(value, Mapping):
        data, path = value.get("bytes"), value.get("path") or ""
        if data:
            return bytes(data), path
        if path:
            return _read_path(path), path
        raise DropItem(MISSING_MEDIA, "the media cell has neither bytes nor a path")
    raise DropItem(UNDECODABLE_MEDIA, f"unsupported media cell type {type(value).__name__}")


def _read_path(path: str) -> bytes:
    from jaxcore import storage

    try:
        return storage.read_bytes(path)
    except (OSError, storage.StorageError) as err:
        raise DropItem(MISSING_MEDIA, f"cannot read {path}: {err}") from None


def decode_media(data: bytes, name: str = "") -> Clip:
    """Bytes of an image or a video -> :class:`Clip`. Images are tried first (cheap)."""
    if not name.lower().endswith(VIDEO_SUFFIXES):
        image = _try_decode_image(data)
        if image is not None:
            return Clip(image[None], None)
    return _decode_video(data, name)


def _try_decode_image(data: bytes) -> np.ndarray | None:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            if getattr(image, "n_frames", 1) > 1:
                return None  # animated GIF/WebP: decode as a video
            return np.asarray(image.convert("RGB"))
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError):
        return None


def _decode_video(data: bytes, name: str) -> Clip:
    """Decode every frame with imageio's ffmpeg plugin (through a temp file: ffmpeg seeks)."""
    import imageio.v2 as imageio

    allow_fork_exec_under_jax()  # ffmpeg is a child process

    suffix = os.path.splitext(name)[1] or ".mp4"
    with tempfile.NamedTemporaryFile(suffix=suffix) as tmp:
        tmp.write(data)
        tmp.flush()
        try:
            reader = imageio.get_reader(tmp.name, format="ffmpeg")
            try:
                fps = float(reader.get_meta_data().get("fps") or 0.0) or None
                frames = [np.asarray(f)[..., :3] for f in reader]
            finally:
                reader.close()
        except Exception as err:  # imageio/ffmpeg raise many types for bad input
            label = f" {name}" if name else ""
            raise DropItem(UNDECODABLE_MEDIA, f"cannot decode{label}: {err}") from None
    if not frames:
        raise DropItem(UNDECODABLE_MEDIA, f"no frames in {name or 'the video'}")
    return Clip(np.stack(frames).astype(np.uint8), fps)


def sample_frame_indices(
    num_source_frames: int, source_fps: float | None, num_frames: int, fps: float
) -> list[int]:
    """Indices of ``num_frames`` frames taken at ``fps`` from the start of the clip.

    Frame k is at time k / fps, i.e. source frame ``floor(k * source_fps / fps)``; an image
    (``source_fps`` None) is one frame. Too short a clip raises ``DropItem(too_few_frames)``.
    """
    if num_frames < 1:
        raise ValueError(f"num_frames must be >= 1, got {num_frames}")
    step = 1.0 if source_fps is None else source_fps / fps
    indices = [int(math.floor(k * step + 1e-6)) for k in range(num_frames)]
    if indices[-1] >= num_source_frames:
        duration = "an image" if source_fps is None else f"{num_source_frames} frames"
        raise DropItem(
            TOO_FEW_FRAMES,
            f"{num_frames} frames at {fps} fps need source frame {indices[-1]}, the clip has "
            f"{duration}",
        )
    return indices


def resize_center_crop(frames: np.ndarray, height: int, width: int) -> np.ndarray:
    """``[T, h, w, 3]`` uint8 -> ``[T, height, width, 3]``: scale to cover, then crop the centre.

    The scale is the smallest that makes both sides at least the target (aspect ratio kept);
    resampling is bicubic (PIL), the usual choice of diffusion data pipelines.
    """
    from PIL import Image

    _, h, w, _ = frames.shape
    if (h, w) == (height, width):
        return frames
    scale = max(height / h, width / w)
    new_h, new_w = max(height, round(h * scale)), max(width, round(w * scale))
    top, left = (new_h - height) // 2, (new_w - width) // 2
    out = np.empty((frames.shape[0], height, width, 3), np.uint8)
    for t, frame in enumerate(frames):
        image = Image.fromarray(frame)
        if (new_h, new_w) != (h, w):
            image = image.resize((new_w, new_h), Image.Resampling.BICUBIC)
        out[t] = np.asarray(image)[top : top + height, left : left + width]
    return out


def to_model_input(frames: np.ndarray) -> np.ndarray:
    """``[T, H, W, 3]`` uint8 -> float32 ``[3, T, H, W]`` in [-1, 1] (the VAE's input layout)."""
    video = frames.astype(np.float32) / 127.5 - 1.0
    return np.ascontiguousarray(video.transpose(3, 0, 1, 2))


def prepare_video(
    value: Any, *, height: int, width: int, num_frames: int, fps: float, min_side: int = 1
) -> np.ndarray:
    """A dataset media cell -> float32 ``[3, num_frames, height, width]`` in [-1, 1].

    Raises :class:`DropItem` (missing, undecodable, too few frames, smaller than ``min_side``).
    """
    data, name = media_bytes(value)
    clip = decode_media(data, name)
    _, h, w, _ = clip.frames.shape
    if min(h, w) < min_side:
        raise DropItem(TOO_SMALL, f"{w}x{h} media is smaller than min_side={min_side}")
    indices = sample_frame_indices(len(clip.frames), clip.fps, num_frames, fps)
    frames = resize_center_crop(clip.frames[indices], height, width)
    return to_model_input(frames)


def prepare_conditioning_image(
    value: Any, *, height: int, width: int, what: str = "conditioning image"
) -> np.ndarray:
    """A conditioning-image cell (a ControlNet's image, an edit's reference image) -> uint8
    ``[height, width, 3]``: decoded, resized and centre-cropped exactly as
    :func:`prepare_video` treats the row's image (diffusers' train_controlnet.py gives both
    the same Resize + CenterCrop). Raises :class:`DropItem` (missing, undecodable) with the
    detail saying it is ``what``."""
    try:
        data, name = media_bytes(value)
        clip = decode_media(data, name)
    except DropItem as drop:
        raise DropItem(drop.reason, f"{what}: {drop.detail}") from None
    return resize_center_crop(clip.frames[:1], height, width)[0]


def clean_caption(value: Any) -> str:
    """Strip a caption; an empty or missing one raises ``DropItem(empty_caption)``."""
    caption = "" if value is None else str(value).strip()
    if not caption:
        raise DropItem(EMPTY_CAPTION, "the caption is empty")
    return caption


# --- sound (a family whose records hold each clip's sound: DatasetConfig.audio_column) -------


@dataclass(frozen=True)
class Sound:
    """A clip's sound: ``waveform`` float32 ``[channels, samples]`` at ``sample_rate`` Hz."""

    waveform: np.ndarray
    sample_rate: int


def _sound_array(value: Mapping) -> Sound:
    """A decoded cell, ``{"array": [samples] or [channels, samples], "sampling_rate": Hz}``
    (a decoded Hugging Face ``Audio`` feature, or a plain struct column)."""
    rate = value.get("sampling_rate")
    if isinstance(rate, bool) or not isinstance(rate, int | float) or not rate > 0:
        raise DropItem(UNDECODABLE_SOUND, f"sampling_rate={rate!r}: expected Hz > 0")
    try:
        array = np.asarray(value["array"], np.float32)
    except (TypeError, ValueError) as err:
        raise DropItem(UNDECODABLE_SOUND, f"array: not numbers ({err})") from None
    if array.ndim == 1:
        array = array[None]
    if array.ndim != 2 or 0 in array.shape or not np.isfinite(array).all():
        raise DropItem(
            UNDECODABLE_SOUND,
            f"array of shape {list(array.shape)}: expected finite [samples] or [channels, samples]",
        )
    return Sound(array, int(rate))


def _wav(data: bytes) -> Sound | None:
    """A WAV file's samples in [-1, 1] (integer PCM scaled by its full range), else None."""
    from scipy.io import wavfile

    try:
        rate, samples = wavfile.read(io.BytesIO(data))
    except (ValueError, EOFError, OSError):
        return None
    samples = np.asarray(samples)
    if np.issubdtype(samples.dtype, np.integer):
        info = np.iinfo(samples.dtype)
        middle = (int(info.max) + int(info.min) + 1) / 2  # 0, or 128 for unsigned 8-bit
        samples = (samples.astype(np.float64) - middle) / (info.max - middle + 1)
    samples = samples.astype(np.float32)
    return Sound(samples.T if samples.ndim == 2 else samples[None], int(rate))


def _ffmpeg_wav(data: bytes, name: str) -> bytes:
    """Any file ffmpeg reads (a video's sound track, mp3, flac, ...) -> float WAV bytes."""
    import subprocess

    import imageio_ffmpeg

    allow_fork_exec_under_jax()
    suffix = os.path.splitext(name)[1] or ".bin"
    with tempfile.TemporaryDirectory() as folder:
        source, wav = os.path.join(folder, f"in{suffix}"), os.path.join(folder, "out.wav")
        with open(source, "wb") as f:
            f.write(data)
        command = [imageio_ffmpeg.get_ffmpeg_exe(), "-v", "error", "-i", source, "-vn"]
        done = subprocess.run([*command, "-acodec", "pcm_f32le", wav], capture_output=True)
        if done.returncode == 0 and os.path.exists(wav):
            with open(wav, "rb") as f:
                return f.read()
    detail = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no sound"]
    what = name or "the cell"
    raise DropItem(UNDECODABLE_SOUND, f"cannot decode the sound of {what}: {detail[0]}")


def decode_sound(value: Any) -> Sound:
    """A dataset sound cell -> :class:`Sound`: ``{"array", "sampling_rate"}``, or the bytes /
    path of a WAV file or of any file with a sound track ffmpeg decodes (a video's own)."""
    if value is None:
        raise DropItem(MISSING_SOUND, "the sound cell is empty")
    if isinstance(value, Mapping) and "array" in value:
        return _sound_array(value)
    try:
        data, name = media_bytes(value)
    except DropItem as drop:
        reason = MISSING_SOUND if drop.reason == MISSING_MEDIA else UNDECODABLE_SOUND
        raise DropItem(reason, f"sound: {drop.detail}") from None
    sound = _wav(data)
    if sound is None:
        sound = _wav(_ffmpeg_wav(data, name))
    if sound is None or 0 in sound.waveform.shape:
        raise DropItem(UNDECODABLE_SOUND, f"no samples in the sound of {name or 'the cell'}")
    return sound


def prepare_sound(value: Any, *, seconds: float) -> Sound:
    """A dataset sound cell -> the clip's span of it: the first ``int(seconds * rate)`` samples,
    zeros appended where the sound is shorter (the span of the clip's ``num_frames / fps``
    seconds, as LTX-2's trainer pairs sound with frames)."""
    sound = decode_sound(value)
    target = int(seconds * sound.sample_rate)
    waveform = sound.waveform[:, :target]
    if waveform.shape[1] < target:
        waveform = np.pad(waveform, ((0, 0), (0, target - waveform.shape[1])))
    return Sound(np.ascontiguousarray(waveform, np.float32), sound.sample_rate)
