"""What each rendered prompt leaves in the artifact, and the run's gallery.

Layout of a generate artifact::

    outputs/<name>.png | outputs/<name>.mp4   1-frame renders as PNG, videos as MP4 (H.264,
                                              and AAC when the render has sound)
    outputs/<name>.npy                        float32 [F, H, W, 3] in [0, 1] (save_arrays=true)
    outputs/<name>.wav                        the render's sound, 16-bit PCM (families with audio)
    outputs/<name>.audio.npy                  float32 [channels, samples] (sound, save_arrays=true)
    thumbs/<name>.png                         first frame, small (for the gallery)
    records/<name>.json                       per-prompt record, written LAST for that prompt
    contact_sheet.png, index.html             the gallery of the whole run
    manifest.json                             written last of all (jaxcore.artifacts)

Every file is written atomically (``storage.write_bytes`` / ``upload_file``: temp + rename
locally, a single upload on GCS), and a prompt counts as done only when its record exists with
the same fingerprint, so a killed run leaves no half-visible output and a rerun redoes exactly
the missing prompts.
"""

from __future__ import annotations

import dataclasses
import html
import io
import json
import logging
import os
import subprocess
import tempfile
import wave
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from jaxcore import storage
from stages.common.subprocesses import allow_fork_exec_under_jax

log = logging.getLogger(__name__)

OUTPUTS, THUMBS, RECORDS = "outputs", "thumbs", "records"
CONTACT_SHEET, GALLERY = "contact_sheet.png", "index.html"
CACHE_REPORT, CACHE_COMPARISON = "cache_report.json", "cache_comparison.png"
IDENTICAL_PSNR = 200.0
# the sample rates AAC (ISO 14496-3) defines; another rate is resampled to the next one up
AAC_SAMPLE_RATES = (
    7350, 8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000, 64000, 88200, 96000
)  # fmt: skip
AAC_MAX_CHANNELS = 8
AAC_BITRATE_PER_CHANNEL = 96_000  # bit/s: transparent for speech and music at 16-48 kHz
PCM_SCALE = 32767.0  # float [-1, 1] -> 16-bit PCM, symmetric as diffusers' LTX-2 export


@dataclasses.dataclass(frozen=True)
class Audio:
    """One render's sound: ``waveform`` float32 [channels, samples] in [-1, 1] and its
    ``sample_rate`` in Hz (a row of :meth:`jaxcore.families.base.Family.decode_audio`)."""

    waveform: np.ndarray
    sample_rate: int

    def __post_init__(self):
        waveform = np.asarray(self.waveform, np.float32)
        if waveform.ndim != 2 or not 1 <= waveform.shape[0] <= AAC_MAX_CHANNELS:
            raise ValueError(
                f"audio waveform: expected [channels (1-{AAC_MAX_CHANNELS}), samples], got "
                f"shape {waveform.shape}"
            )
        if waveform.shape[1] == 0 or not np.isfinite(waveform).all():
            raise ValueError("audio waveform: expected finite samples, at least one")
        if int(self.sample_rate) != self.sample_rate or not 0 < self.sample_rate <= 192_000:
            raise ValueError(
                f"audio sample_rate: expected Hz in (0, 192000], got {self.sample_rate}"
            )
        object.__setattr__(self, "waveform", waveform)
        object.__setattr__(self, "sample_rate", int(self.sample_rate))

    @property
    def channels(self) -> int:
        return self.waveform.shape[0]

    @property
    def samples(self) -> int:
        return self.waveform.shape[1]

    @property
    def seconds(self) -> float:
        return self.samples / self.sample_rate


def media_path(name: str, num_frames: int) -> str:
    """Relative path of a prompt's image (1 frame) or video."""
    return f"{OUTPUTS}/{name}.png" if num_frames == 1 else f"{OUTPUTS}/{name}.mp4"


def encode_png(frame_hwc: np.ndarray) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(np.asarray(frame_hwc, np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


def encode_mp4(frames_fhwc: np.ndarray, fps: float, audio: Audio | None = None) -> bytes:
    """H.264 MP4 through imageio's ffmpeg (bundled by imageio-ffmpeg), via a temp file; with
    ``audio``, the same video stream muxed with an AAC stream of it."""
    allow_fork_exec_under_jax()  # ffmpeg is a child process

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "video.mp4")
        _write_h264(path, frames_fhwc, fps)
        if audio is not None:
            path = _mux_aac(path, audio, tmp)
        return Path(path).read_bytes()


def _write_h264(path: str, frames_fhwc: np.ndarray, fps: float) -> None:
    import imageio.v2 as imageio

    writer = imageio.get_writer(
        path, fps=fps, codec="libx264", quality=8, macro_block_size=16, ffmpeg_log_level="error"
    )
    try:
        for frame in frames_fhwc:
            writer.append_data(np.asarray(frame, np.uint8))
    finally:
        writer.close()


def aac_sample_rate(sample_rate: int) -> int:
    """The rate an MP4's AAC stream carries ``sample_rate`` at: itself where AAC defines it,
    else the next defined rate up (the top one past it)."""
    return next((r for r in AAC_SAMPLE_RATES if r >= sample_rate), AAC_SAMPLE_RATES[-1])


def _mux_aac(video_path: str, audio: Audio, tmp: str) -> str:
    """The H.264 stream copied beside an AAC encoding of ``audio`` (from a WAV, so the AAC is
    made from the same 16-bit samples the artifact's WAV holds); returns the new file's path."""
    import imageio_ffmpeg

    wav_path, out_path = os.path.join(tmp, "audio.wav"), os.path.join(tmp, "muxed.mp4")
    Path(wav_path).write_bytes(encode_wav(audio))
    rate = aac_sample_rate(audio.sample_rate)
    # an AAC frame holds at most 6144 bits per channel per 1024 samples: 6 bits per sample
    bitrate = audio.channels * min(AAC_BITRATE_PER_CHANNEL, 6 * rate)
    command = [
        imageio_ffmpeg.get_ffmpeg_exe(), "-nostdin", "-v", "error", "-y",
        "-i", video_path, "-i", wav_path, "-map", "0:v:0", "-map", "1:a:0",
        "-c:v", "copy", "-c:a", "aac", "-b:a", str(bitrate), "-ar", str(rate), out_path,
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(
            f"ffmpeg could not mux the audio ({audio.channels} channel(s), {audio.sample_rate} "
            f"Hz) into the MP4: {done.stderr.strip()[-2000:]}"
        )
    return out_path


def encode_wav(audio: Audio) -> bytes:
    """16-bit PCM WAV of ``audio`` (channels and sample rate kept; samples clipped to [-1, 1]
    and rounded: ``round(x * 32767)``)."""
    pcm = np.round(np.clip(audio.waveform, -1.0, 1.0) * PCM_SCALE).astype("<i2")
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(audio.channels)
        out.setsampwidth(2)
        out.setframerate(audio.sample_rate)
        out.writeframes(np.ascontiguousarray(pcm.T).tobytes())  # interleaved frames
    return buffer.getvalue()


def thumbnail(frame_hwc: np.ndarray, size: int) -> bytes:
    """PNG of the frame scaled so its longer side is ``size`` (nearest: tiny renders stay crisp)."""
    from PIL import Image

    image = Image.fromarray(np.asarray(frame_hwc, np.uint8))
    scale = size / max(image.size)
    target = (max(1, round(image.width * scale)), max(1, round(image.height * scale)))
    buffer = io.BytesIO()
    image.resize(target, Image.NEAREST).save(buffer, format="PNG")
    return buffer.getvalue()


def npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, np.asarray(array, np.float32), allow_pickle=False)
    return buffer.getvalue()


def write_prompt_outputs(
    root: str,
    record: dict,
    video_fhwc: np.ndarray,
    *,
    fps: float,
    save_arrays: bool,
    thumbnail_size: int,
    audio: Audio | None = None,
) -> dict:
    """Encode and write one prompt's files, then its record (last). Returns the record.

    ``video_fhwc``: float32 [F, H, W, 3] in [0, 1]; ``record`` holds id/name/params/...;
    the written paths are added to it. ``audio``: the render's sound (muxed into a video's
    MP4; written as WAV, and as .audio.npy with ``save_arrays``); the record's ``audio``
    describes it. Without sound, the files and record are what they were before sound.
    """
    from jaxcore.sampling import to_uint8

    name = record["name"]
    frames = to_uint8(video_fhwc)
    output = media_path(name, frames.shape[0])
    data = encode_png(frames[0]) if frames.shape[0] == 1 else encode_mp4(frames, fps, audio)
    storage.write_bytes(storage.join(root, output), data)
    thumb = f"{THUMBS}/{name}.png"
    storage.write_bytes(storage.join(root, thumb), thumbnail(frames[0], thumbnail_size))
    record = {**record, "output": output, "thumbnail": thumb, "array": None}
    if save_arrays:
        record["array"] = f"{OUTPUTS}/{name}.npy"
        storage.write_bytes(storage.join(root, record["array"]), npy_bytes(video_fhwc))
    if audio is not None:
        record["audio"] = write_audio(root, name, audio, save_arrays, muxed=frames.shape[0] > 1)
    storage.write_text(
        storage.join(root, f"{RECORDS}/{name}.json"), json.dumps(record, indent=1, sort_keys=True)
    )
    return record


def write_audio(root: str, name: str, audio: Audio, save_arrays: bool, muxed: bool) -> dict:
    """The sound's WAV (and, with ``save_arrays``, its float32 .npy); what the record says of
    it: the files, ``sample_rate``, ``channels``, ``samples``, ``seconds``, and whether the
    output MP4 carries it too (``in_output``; a 1-frame render's PNG cannot)."""
    wav = f"{OUTPUTS}/{name}.wav"
    storage.write_bytes(storage.join(root, wav), encode_wav(audio))
    array = f"{OUTPUTS}/{name}.audio.npy" if save_arrays else None
    if array is not None:
        storage.write_bytes(storage.join(root, array), npy_bytes(audio.waveform))
    return {
        "wav": wav,
        "array": array,
        "sample_rate": audio.sample_rate,
        "channels": audio.channels,
        "samples": audio.samples,
        "seconds": round(audio.seconds, 6),
        "in_output": muxed,
    }


def write_dense(root: str, name: str, cached_fhwc: np.ndarray, dense_fhwc: np.ndarray) -> dict:
    """The dense render's first frame beside a cached one (``cache.compare_dense``), and how
    far the cached render is from it: ``{dense_output, psnr, ssim}``."""
    from jaxcore.sampling import to_uint8
    from stages.generate import quality

    path = f"{OUTPUTS}/{name}.dense.png"
    storage.write_bytes(storage.join(root, path), encode_png(to_uint8(dense_fhwc)[0]))
    return {
        "dense_output": path,
        # identical renders have an infinite PSNR; JSON has no inf: 200 dB stands for it
        "psnr": round(min(quality.psnr(dense_fhwc, cached_fhwc), IDENTICAL_PSNR), 4),
        "ssim": round(quality.ssim(dense_fhwc, cached_fhwc), 6),
    }


def write_cache_report(root: str, records: Sequence[Mapping], report: Mapping) -> None:
    """``cache_report.json`` (the quality gate's table) and ``cache_comparison.png`` (one row
    per prompt: dense, cached, |difference| x4)."""
    from PIL import Image

    from stages.generate import quality

    storage.write_text(
        storage.join(root, CACHE_REPORT), json.dumps(report, indent=1, sort_keys=True)
    )
    rows = []
    for record in records:
        cache = record.get("cache") or {}
        if "dense_output" not in cache:
            continue
        pair = []
        for path in (
            cache["dense_output"],
            record["thumbnail"] if record["output"].endswith(".mp4") else record["output"],
        ):
            image = Image.open(io.BytesIO(storage.read_bytes(storage.join(root, path))))
            pair.append(np.asarray(image.convert("RGB"), np.float32) / 255.0)
        if pair[0].shape != pair[1].shape:  # a video's thumbnail: compare at its size
            pair[0] = (
                np.asarray(
                    Image.fromarray((pair[0] * 255).astype(np.uint8)).resize(pair[1].shape[1::-1]),
                    np.float32,
                )
                / 255.0
            )
        rows.append(tuple(pair))
    storage.write_bytes(storage.join(root, CACHE_COMPARISON), quality.comparison_grid(rows))


def load_records(root: str, threads: int = 8) -> dict[str, dict]:
    """{name: record} of every finished prompt under ``root`` (unreadable records are skipped:
    they are rendered again)."""
    names = [
        f.path[: -len(".json")]
        for f in storage.list_files(storage.join(root, RECORDS))
        if f.path.endswith(".json") and "/" not in f.path and not f.path.startswith(".")
    ]

    def read(name: str):
        try:
            return name, json.loads(storage.read_text(storage.join(root, RECORDS, f"{name}.json")))
        except (storage.StorageError, json.JSONDecodeError) as err:
            log.warning("ignoring unreadable record %s: %s", name, err)
            return name, None

    with ThreadPoolExecutor(max_workers=threads) as pool:
        return {name: rec for name, rec in pool.map(read, names) if rec is not None}


def remove_stale_partials(root: str) -> int:
    """Delete temp files a killed local run left (``.*.partial``); GCS uploads leave none."""
    if storage.is_gcs(root):
        return 0
    removed = 0
    for folder in (OUTPUTS, THUMBS, RECORDS):
        path = Path(root) / folder
        if path.is_dir():
            for stale in path.glob(".*.partial"):
                stale.unlink(missing_ok=True)
                removed += 1
    return removed


def contact_sheet(root: str, records: Iterable[Mapping], columns: int, size: int) -> bytes:
    """A grid of every prompt's thumbnail (in prompt order) as PNG bytes."""
    from PIL import Image

    records = list(records)
    rows = max(1, -(-len(records) // columns))
    cols = min(columns, max(1, len(records)))
    pad = 4
    sheet = Image.new("RGB", (cols * (size + pad) + pad, rows * (size + pad) + pad), (24, 24, 24))
    for i, record in enumerate(records):
        thumb = Image.open(io.BytesIO(storage.read_bytes(storage.join(root, record["thumbnail"]))))
        x = pad + (i % cols) * (size + pad) + (size - thumb.width) // 2
        y = pad + (i // cols) * (size + pad) + (size - thumb.height) // 2
        sheet.paste(thumb.convert("RGB"), (x, y))
    buffer = io.BytesIO()
    sheet.save(buffer, format="PNG")
    return buffer.getvalue()


def _cache_section(report: Mapping | None) -> str:
    """The quality gate's table and comparison grid, for the gallery."""
    if report is None:
        return ""
    rows = "".join(
        f"<tr><td>{html.escape(p['id'])}</td><td>{p['psnr']:.2f}</td><td>{p['ssim']:.4f}</td>"
        f"<td>{p['block_stack_runs']}</td><td>{p['block_stack_skips']}</td></tr>"
        for p in report["prompts"]
    )
    ratio = report["evaluation_ratio"]
    speed = report["wall_speedup"]
    head = (
        f"mean PSNR {report['mean_psnr']:.2f} dB (min {report['min_psnr']:.2f}), mean SSIM "
        f"{report['mean_ssim']:.4f} (min {report['min_ssim']:.4f})"
        + (f"; {ratio:.2f}x fewer block-stack evaluations" if ratio else "")
        + (f", {speed:.2f}x wall time" if speed else "")
    )
    # reports from before quantization compared cached renders only
    title = {"cached": "Step cache"}.get(report.get("compared", "cached"), report.get("compared"))
    return (
        f"<h2>{html.escape(title)} vs dense</h2><p>{html.escape(head)}</p>"
        "<table><tr><th>id</th><th>PSNR dB</th><th>SSIM</th><th>stack runs</th>"
        f"<th>skips</th></tr>{rows}</table>"
        f"<p>dense | cached | |difference| x4</p><p><img src='{CACHE_COMPARISON}' "
        "alt='dense vs cached'></p>"
    )


def _audio_player(audio: Mapping) -> str:
    """A card's player for its WAV (styled inline: a gallery without sound keeps its bytes)."""
    return (
        f'<audio src="{html.escape(audio["wav"])}" controls preload="none" '
        'style="width:256px;display:block"></audio>'
    )


def gallery_html(
    records: Iterable[Mapping], title: str, cache_report: Mapping | None = None
) -> str:
    """A self-contained index.html: one card per prompt with its media, prompt and settings
    (and, after a quality-gated cached run, the cache-vs-dense table and grid)."""
    cards = []
    for record in records:
        params = record["params"]
        output = html.escape(record["output"])
        audio = record.get("audio")
        if output.endswith(".mp4"):
            muted = "" if audio else " muted"  # a render with sound plays it
            media = (
                f'<video src="{output}" poster="{html.escape(record["thumbnail"])}" '
                f"controls loop{muted} playsinline></video>"
            )
        else:
            media = f'<img src="{output}" alt="{html.escape(record["id"])}">'
        settings = (
            f"seed {params['seed']} · {params['width']}x{params['height']} · "
            f"{params['num_frames']} frame(s) · {params['num_inference_steps']} steps · "
            f"guidance {params['guidance_scale']:g} · shift {params['flow_shift']:g}"
        )
        negative = params.get("negative_prompt") or ""
        cards.append(
            '<figure class="card">'
            f'<a href="{output}">{media}</a>{_audio_player(audio) if audio else ""}'
            f"<figcaption><b>{html.escape(record['id'])}</b> {html.escape(params['prompt'])}"
            + (f'<br><span class="neg">not: {html.escape(negative)}</span>' if negative else "")
            + f'<br><span class="meta">{html.escape(settings)} · '
            f"{record.get('seconds', 0):.2f} s</span></figcaption></figure>"
        )
    style = (
        "body{font-family:sans-serif;background:#111;color:#ddd;margin:1em}"
        ".grid{display:flex;flex-wrap:wrap;gap:12px}.card{width:260px;margin:0}"
        ".card img,.card video{width:256px;image-rendering:pixelated;background:#000}"
        ".meta,.neg{color:#999;font-size:smaller}"
    )
    return (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title><style>{style}</style></head><body>"
        f"<h1>{html.escape(title)}</h1><p><img src='{CONTACT_SHEET}' alt='contact sheet'></p>"
        f"<div class='grid'>{''.join(cards)}</div>{_cache_section(cache_report)}</body></html>\n"
    )
