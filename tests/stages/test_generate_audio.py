"""generate's sound: renders of a family whose ``decode_audio`` gives a waveform.

- The writer (:func:`stages.generate.outputs.write_prompt_outputs`) with synthetic stereo and
  mono sines at 16 / 24 kHz and odd sample counts: the MP4 holds exactly one H.264 and one AAC
  stream at the waveform's rate and channel count (probed with imageio-ffmpeg's ffmpeg); the
  AAC decoded back has the input's length within one AAC frame (1024 samples; measured: the
  same length) and correlates with it (> 0.99 per channel; measured 0.9995-0.99995); the WAV
  holds ``round(x * 32767)`` exactly; the ``.audio.npy`` is the input, bit for bit; the record
  describes all of it. A rate AAC lacks (20 kHz) is carried at the next AAC rate in the MP4 only.
- A render without sound writes what it wrote before: the same files and record keys, an MP4
  of one video stream equal to ``encode_mp4``'s, no ``<audio>`` in the gallery (when written,
  also checked byte for byte against the writer as it was before sound).
- A failure between the files and the record leaves no record (the prompt is not done).
- ``difforge generate`` end to end on the tiny Wan pipeline with ``decode_audio`` patched to a
  function of the latents: each prompt's sound reaches its own files, record and manifest.
"""

from __future__ import annotations

import io
import json
import re
import subprocess
import wave
from pathlib import Path

import numpy as np
import pytest

from jaxcore import storage
from jaxcore.sampling import to_uint8
from stages.common.subprocesses import allow_fork_exec_under_jax
from stages.generate import outputs

REPO = Path(__file__).resolve().parents[2]
AAC_FRAME = 1024  # samples per AAC frame: the duration tolerance
MIN_CORRELATION = 0.99
FPS = 8
FRAMES = 5


def _sine(sample_rate: int, channels: int, samples: int) -> np.ndarray:
    """A waveform [channels, samples]: a different tone and phase in each channel."""
    t = np.arange(samples) / sample_rate
    rows = [
        (0.6 - 0.2 * c) * np.sin(2 * np.pi * (330 + 110 * c) * t + 0.7 * c) for c in range(channels)
    ]
    return np.stack(rows).astype(np.float32)


@pytest.fixture(autouse=True)
def _fork_exec_allowed():
    """The writer ignores JAX's fork warning for ffmpeg once per process; pytest restores the
    warning filters after every test, so each test sets the filter again (as a process does)."""
    allow_fork_exec_under_jax.__wrapped__()


def _video(frames: int = FRAMES) -> np.ndarray:
    return np.random.default_rng(frames).random((frames, 16, 16, 3), dtype=np.float32)


def _record(name: str, frames: int = FRAMES) -> dict:
    params = {
        "prompt": f"a {name}",
        "negative_prompt": "",
        "seed": 0,
        "width": 16,
        "height": 16,
        "num_frames": frames,
        "num_inference_steps": 2,
        "guidance_scale": 1.0,
        "flow_shift": 1.0,
    }
    return {"id": name, "name": name, "params": params, "seconds": 0.5}


def _write(root: Path, name: str, audio, frames: int = FRAMES, save_arrays: bool = True):
    return outputs.write_prompt_outputs(
        str(root),
        _record(name, frames),
        _video(frames),
        fps=FPS,
        save_arrays=save_arrays,
        thumbnail_size=32,
        audio=audio,
    )


def _ffmpeg(*args: str) -> subprocess.CompletedProcess:
    import imageio_ffmpeg

    command = [imageio_ffmpeg.get_ffmpeg_exe(), "-nostdin", "-hide_banner", *args]
    return subprocess.run(command, capture_output=True, check=False)


def _streams(path: Path) -> list[str]:
    """The ``Stream #0:n ...: Video|Audio: ...`` lines ``ffmpeg -i`` prints of a file."""
    probe = _ffmpeg("-i", str(path)).stderr.decode()
    return [line.strip() for line in probe.splitlines() if re.search(r"Stream #0:\d", line)]


def _decoded_audio(path: Path, channels: int) -> np.ndarray:
    """The file's first audio stream decoded by ffmpeg: float32 [channels, samples]."""
    done = _ffmpeg("-v", "error", "-i", str(path), "-map", "0:a:0", "-f", "f32le", "-")
    assert done.returncode == 0, done.stderr.decode()
    return np.frombuffer(done.stdout, "<f4").reshape(-1, channels).T


def _wav(path: Path) -> tuple[np.ndarray, int]:
    """A 16-bit WAV's samples int16 [channels, samples] and its sample rate."""
    with wave.open(str(path), "rb") as wav:
        assert wav.getsampwidth() == 2
        pcm = np.frombuffer(wav.readframes(wav.getnframes()), "<i2")
        return pcm.reshape(-1, wav.getnchannels()).T, wav.getframerate()


@pytest.mark.parametrize(
    ("sample_rate", "channels", "samples", "layout"),
    [(16_000, 2, 16_000 * FRAMES // FPS + 37, "stereo"), (24_000, 1, 14_999, "mono")],
)
def test_mp4_carries_the_sound_as_one_aac_stream(tmp_path, sample_rate, channels, samples, layout):
    waveform = _sine(sample_rate, channels, samples)
    record = _write(tmp_path, "tone", outputs.Audio(waveform, sample_rate))

    mp4 = tmp_path / record["output"]
    streams = _streams(mp4)
    assert len(streams) == 2, streams
    assert sum("Video: h264" in s for s in streams) == 1, streams
    (audio_stream,) = [s for s in streams if "Audio:" in s]
    assert "Audio: aac" in audio_stream and f"{sample_rate} Hz, {layout}," in audio_stream

    decoded = _decoded_audio(mp4, channels)
    assert abs(decoded.shape[1] - samples) <= AAC_FRAME, (decoded.shape, samples)
    common = min(decoded.shape[1], samples)
    for channel in range(channels):
        r = np.corrcoef(decoded[channel, :common], waveform[channel, :common])[0, 1]
        assert r > MIN_CORRELATION, (channel, r)

    pcm, rate = _wav(tmp_path / record["audio"]["wav"])
    assert rate == sample_rate and pcm.shape == (channels, samples)
    np.testing.assert_array_equal(pcm, np.round(waveform * 32767).astype(np.int16))
    array = np.load(tmp_path / record["audio"]["array"])
    assert array.dtype == np.float32
    np.testing.assert_array_equal(array, waveform)

    assert record["audio"] == {
        "wav": "outputs/tone.wav",
        "array": "outputs/tone.audio.npy",
        "sample_rate": sample_rate,
        "channels": channels,
        "samples": samples,
        "seconds": round(samples / sample_rate, 6),
        "in_output": True,
    }
    on_disk = json.loads((tmp_path / "records/tone.json").read_text())
    assert on_disk == record


def test_wav_rounds_and_clips_exactly():
    """Edge values: round half to even as ``np.round``, ±1 to ±32767, beyond ±1 clipped."""
    halves = np.array([0.5, 1.5, -2.5]) / 32767
    row = np.concatenate([[-1.0, 1.0, 0.0, 1.5, -3.0, 1e-9], halves]).astype(np.float32)
    waveform = np.stack([row, -row])
    data = outputs.encode_wav(outputs.Audio(waveform, 11_025))
    with wave.open(io.BytesIO(data), "rb") as wav:
        assert (wav.getnchannels(), wav.getframerate(), wav.getnframes()) == (2, 11_025, 9)
        pcm = np.frombuffer(wav.readframes(9), "<i2").reshape(-1, 2).T
    expected = np.round(np.clip(waveform, -1, 1) * 32767).astype(np.int16)
    np.testing.assert_array_equal(pcm, expected)
    assert list(pcm[0, :6]) == [-32767, 32767, 0, 32767, -32767, 0]


def test_a_rate_aac_lacks_is_resampled_in_the_mp4_only(tmp_path):
    """20 kHz is no AAC rate: the MP4 carries 22.05 kHz, the WAV keeps 20 kHz."""
    assert outputs.aac_sample_rate(20_000) == 22_050
    assert outputs.aac_sample_rate(24_000) == 24_000
    assert outputs.aac_sample_rate(192_000) == 96_000
    waveform = _sine(20_000, 2, 12_345)
    record = _write(tmp_path, "odd", outputs.Audio(waveform, 20_000), save_arrays=False)
    (audio_stream,) = [s for s in _streams(tmp_path / record["output"]) if "Audio:" in s]
    assert "22050 Hz, stereo" in audio_stream
    decoded = _decoded_audio(tmp_path / record["output"], 2)
    assert abs(decoded.shape[1] - round(12_345 * 22_050 / 20_000)) <= AAC_FRAME
    assert _wav(tmp_path / record["audio"]["wav"])[1] == 20_000
    assert record["audio"]["array"] is None and not (tmp_path / "outputs/odd.audio.npy").exists()


def test_a_single_frame_render_keeps_its_sound_beside_the_png(tmp_path):
    waveform = _sine(16_000, 2, 801)
    record = _write(tmp_path, "still", outputs.Audio(waveform, 16_000), frames=1)
    assert record["output"] == "outputs/still.png" and record["audio"]["in_output"] is False
    np.testing.assert_array_equal(
        _wav(tmp_path / "outputs/still.wav")[0], np.round(waveform * 32767).astype(np.int16)
    )


def test_a_render_without_sound_writes_what_it_wrote_before(tmp_path):
    for frames, media in ((FRAMES, "outputs/plain.mp4"), (1, "outputs/plain.png")):
        root = tmp_path / str(frames)
        record = _write(root, "plain", None, frames=frames)
        files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
        assert files == sorted(
            [media, "outputs/plain.npy", "records/plain.json", "thumbs/plain.png"]
        )
        assert sorted(record) == [
            "array", "id", "name", "output", "params", "seconds", "thumbnail"
        ]  # fmt: skip
        html = outputs.gallery_html([record], "run")
        assert "<audio" not in html and "audio" not in json.dumps(record)
        if frames > 1:
            streams = _streams(root / media)
            assert len(streams) == 1 and "Video: h264" in streams[0], streams
            assert "controls loop muted playsinline" in html
            # the video stream is the one encode_mp4 always wrote
            frames_uint8 = to_uint8(_video(frames))
            assert (root / media).read_bytes() == outputs.encode_mp4(frames_uint8, FPS)


def test_the_gallery_plays_the_sound(tmp_path):
    record = _write(tmp_path, "loud", outputs.Audio(_sine(16_000, 1, 999), 16_000))
    html = outputs.gallery_html([record], "run")
    assert '<audio src="outputs/loud.wav" controls' in html
    assert "controls loop playsinline" in html and " muted" not in html


def test_a_failure_before_the_record_leaves_the_prompt_unfinished(tmp_path, monkeypatch):
    """Killed while writing the sound's array: every visible file is whole, no record."""
    real = storage.write_bytes

    def dies_at_the_audio_array(uri: str, data: bytes) -> None:
        if uri.endswith(".audio.npy"):
            raise KeyboardInterrupt("killed")
        real(uri, data)

    monkeypatch.setattr(storage, "write_bytes", dies_at_the_audio_array)
    with pytest.raises(KeyboardInterrupt):
        _write(tmp_path, "cut", outputs.Audio(_sine(16_000, 2, 1001), 16_000))
    assert outputs.load_records(str(tmp_path)) == {}
    assert not list(tmp_path.rglob("*.partial")) and not (tmp_path / "records").exists()
    assert _wav(tmp_path / "outputs/cut.wav")[0].shape == (2, 1001)


@pytest.mark.parametrize(
    ("waveform", "sample_rate", "message"),
    [
        (np.zeros((2, 3, 4)), 16_000, "audio waveform: expected"),
        (np.zeros((9, 4)), 16_000, "channels (1-8)"),
        (np.zeros((2, 0)), 16_000, "at least one"),
        (np.full((1, 4), np.nan), 16_000, "finite"),
        (np.zeros((1, 4)), 0, "audio sample_rate"),
        (np.zeros((1, 4)), 22_050.5, "audio sample_rate"),
    ],
)
def test_a_malformed_sound_is_refused_by_name(waveform, sample_rate, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        outputs.Audio(waveform, sample_rate)


# --- end to end -------------------------------------------------------------------------------

SOUND_RATE = 16_000
SOUND_SAMPLES = SOUND_RATE * FRAMES // FPS + 7  # odd, a little past the video


def _loudness(latents_row: np.ndarray) -> float:
    """What the patched decode_audio makes of a row's latents: a per-prompt amplitude (from
    its first element, of order 1 and unlike between seeds)."""
    return float(0.25 + 0.5 / (1 + np.exp(-latents_row.ravel()[0])))


def _patched_decode_audio(calls: list):
    """A ``Family.decode_audio`` that renders a stereo sine scaled by each row's latents (and
    keeps the rows it saw, so the test knows which amplitude each prompt should get)."""
    import jax.numpy as jnp

    tone = jnp.asarray(_sine(SOUND_RATE, 2, SOUND_SAMPLES))

    def decode_audio(self, pipe, latents, conditioning=None):
        del self, pipe, conditioning
        rows = np.asarray(latents)
        calls.append(rows)
        loud = jnp.asarray([_loudness(r) for r in rows], jnp.float32)
        return loud[:, None, None] * tone[None], SOUND_RATE

    return decode_audio


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    from pipelines.embedded.tiny import build_tiny_wan_pipeline

    return build_tiny_wan_pipeline(tmp_path_factory.mktemp("tiny_wan_audio"), seed=3)


def test_generate_writes_each_prompts_sound(tiny_dir, tmp_path, monkeypatch):
    from jaxcore.artifacts import open_artifact
    from jaxcore.families.wan import WanFamily
    from pipelines import cli

    calls: list = []
    monkeypatch.setattr(WanFamily, "decode_audio", _patched_decode_audio(calls), raising=False)
    prompts = tmp_path / "prompts.jsonl"
    lines = [
        {"id": name, "prompt": f"a {name}", "seed": seed} for name, seed in (("owl", 1), ("cat", 2))
    ]
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "run"
    argv = [
        "generate", str(REPO / "configs/stages/generate.yml"),
        f"pretrained_model_name_or_path={tiny_dir}", f"prompt_file={prompts}",
        f"output_dir={out}", "num_inference_steps=1", "guidance_scale=1",
        f"num_frames={FRAMES}", f"output.fps={FPS}", "save_arrays=true",
        "per_device_batch_size=1", "-q",
    ]  # fmt: skip
    assert cli.main(argv) == 0

    (rows,) = calls  # one batch: both prompts, padded to the mesh's batch ways
    expected = {"owl": _loudness(rows[0]), "cat": _loudness(rows[1])}
    assert abs(expected["owl"] - expected["cat"]) > 1e-3  # the rows are told apart
    manifest = open_artifact(str(out), "generate")
    files = {f["path"] for f in manifest.files}
    tone = _sine(SOUND_RATE, 2, SOUND_SAMPLES)
    for entry in manifest.summary["prompts"]:
        name, sound = entry["name"], entry["audio"]
        assert sound["sample_rate"] == SOUND_RATE and sound["channels"] == 2
        assert sound["samples"] == SOUND_SAMPLES and sound["in_output"] is True
        assert {entry["output"], sound["wav"], sound["array"]} <= files
        array = np.load(out / sound["array"])
        np.testing.assert_allclose(array, expected[entry["id"]] * tone, rtol=1e-6, atol=1e-7)
        record = json.loads((out / f"records/{name}.json").read_text())
        assert record["audio"] == sound
        streams = _streams(out / entry["output"])
        assert len(streams) == 2 and "16000 Hz, stereo" in streams[1], streams
        decoded = _decoded_audio(out / entry["output"], 2)
        common = min(decoded.shape[1], SOUND_SAMPLES)
        assert abs(decoded.shape[1] - SOUND_SAMPLES) <= AAC_FRAME
        assert np.corrcoef(decoded[0, :common], array[0, :common])[0, 1] > MIN_CORRELATION
    gallery = (out / "index.html").read_text()
    assert gallery.count("<audio ") == 2
