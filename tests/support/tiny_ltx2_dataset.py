"""A tiny video-with-sound data set for LTX-2's convert / train tests.

The format convert reads for LTX-2 (``dataset.audio_column``): a JSONL file whose rows name an
mp4 clip (``video``), a WAV file of its sound (``audio``) and a caption (``text``). Each clip is
a bar of one colour moving right, 24 fps; its sound two tones of its own pitch, at 22.05 kHz
(so convert resamples to the audio VAE's 16 kHz), mono or stereo by row, a little longer than
the clip (so convert trims it).
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np

FPS = 24
SOUND_RATE = 22050


def clip_frames(index: int, num_frames: int, size: int) -> np.ndarray:
    """``[F, size, size, 3]`` uint8: a bar of the clip's colour moving right."""
    colour = np.random.default_rng(index).integers(40, 255, 3)
    clip = np.zeros((num_frames, size, size, 3), np.uint8)
    for t in range(num_frames):
        start = (3 * t) % size
        clip[t, :, start : start + 8] = colour
    return clip


def clip_sound(index: int, seconds: float, channels: int = 1) -> np.ndarray:
    """``[channels, samples]`` float32 at :data:`SOUND_RATE`: the clip's two tones."""
    t = np.arange(int(seconds * SOUND_RATE)) / SOUND_RATE
    pitch = 220.0 * (1 + index)
    tone = 0.4 * np.sin(2 * np.pi * pitch * t) + 0.2 * np.sin(2 * np.pi * 2.5 * pitch * t)
    sound = np.stack([tone * (1.0 - 0.3 * c) for c in range(channels)])
    return sound.astype(np.float32)


def wav_bytes(sound: np.ndarray, rate: int) -> bytes:
    """16-bit PCM WAV of ``[channels, samples]`` in [-1, 1]."""
    from scipy.io import wavfile

    buffer = io.BytesIO()
    pcm = np.round(np.clip(sound, -1, 1) * 32767).astype(np.int16)
    wavfile.write(buffer, rate, pcm.T if pcm.shape[0] > 1 else pcm[0])
    return buffer.getvalue()


def write_clips(directory: Path, count: int, num_frames: int, size: int) -> Path:
    """``count`` rows (``clip<i>``: mp4, WAV, caption) and their ``data.jsonl``; returns it."""
    import imageio.v2 as imageio

    directory.mkdir(parents=True, exist_ok=True)
    seconds = num_frames / FPS + 0.1
    rows = []
    for i in range(count):
        video = directory / f"clip{i}.mp4"
        frames = list(clip_frames(i, num_frames, size))
        imageio.mimwrite(video, frames, fps=FPS, format="ffmpeg", macro_block_size=1)
        audio = directory / f"clip{i}.wav"
        audio.write_bytes(wav_bytes(clip_sound(i, seconds, 1 + i % 2), SOUND_RATE))
        text = f"a bar of colour {i} humming at pitch {i}"
        rows.append({"id": f"clip{i}", "video": str(video), "audio": str(audio), "text": text})
    data = directory / "data.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return data
