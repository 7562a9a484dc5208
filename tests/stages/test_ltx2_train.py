"""LTX-2 convert / train / evaluate with sound, on a tiny diffusers-built ``LTX2Pipeline``
(tests/support/tiny_ltx2.py) and a tiny video-with-sound data set
(tests/support/tiny_ltx2_dataset.py: mp4 clips, WAV sounds at 22.05 kHz, captions in JSONL).

- records: a clip's joint latents ``[C + K, F', H', W']`` equal diffusers' encode path, the
  video as ``AutoencoderKLLTX2Video.encode(...).latent_dist.mean`` normalised by
  ``LTX2Pipeline._normalize_latents`` with the VAE's ``scaling_factor``, the audio as
  ``AutoencoderKLLTX2Audio.encode(mel).latent_dist.mean`` (its first L frames) through
  ``_pack_audio_latents`` and ``_normalize_audio_latents`` (the log-mel itself is proven
  against the reference's ops in tests/jaxcore/test_ltx2_mel.py); text as generate encodes it.
- the loss: the train objective's loss of those records at a fixed noise and timestep equals
  ltx-trainer's ``video_loss + audio_loss`` computed with diffusers'
  ``LTX2VideoTransformer3DModel`` in PyTorch (the family's loss weights: each modality's mean,
  summed; see jaxcore/families/ltx2.py ``joint_loss_weights``).
- end to end (slow): convert -> train (the loss falls) -> killed with SIGKILL after a
  checkpoint, rerun: the losses of an uninterrupted run -> evaluate (the eval losses of the
  run) -> generate renders the trained checkpoint as an mp4 with a sound track.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from jaxcore.artifacts import open_artifact
from jaxcore.compute import ComputeConfig
from pipelines import cli
from tests.support import tiny_ltx2_dataset
from tests.support.tiny_ltx2 import build_ltx2_pipeline

REPO = Path(__file__).resolve().parents[2]
SIZE, FRAMES, LENGTH = 32, 9, 16  # 9 frames at 24 fps: 3 latent frames, 9 audio tokens
VIDEO = [8, 3, 4, 4]
AUDIO_TOKENS, AUDIO_WIDTH = 9, 8  # round(9 / 24 * 16000 / 160 / 4), 2 channels x 16 / 4 bins
LATENTS = [10, 3, 4, 4]  # 8 video channels + ceil(9 * 8 / 48) = 2 for the audio
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def ltx2_dir(tmp_path_factory) -> Path:
    return build_ltx2_pipeline(tmp_path_factory.mktemp("ltx2"), seed=3)


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> Path:
    return tiny_ltx2_dataset.write_clips(tmp_path_factory.mktemp("ltx2_clips"), 6, FRAMES, SIZE)


def _clip(clips: Path, index: int):
    """Clip ``index`` as convert prepares it: (video [3, F, H, W], its span of sound)."""
    from stages.convert import media

    video = media.prepare_video(
        str(clips.parent / f"clip{index}.mp4"),
        height=SIZE,
        width=SIZE,
        num_frames=FRAMES,
        fps=tiny_ltx2_dataset.FPS,
    )
    sound = media.prepare_sound(str(clips.parent / f"clip{index}.wav"), seconds=FRAMES / 24)
    return video, sound


def _diffusers_latents(ltx2_dir: Path, video: np.ndarray, mel: np.ndarray):
    """(video latents [C, F', H', W'], packed audio latents [L, C_a M']) by diffusers."""
    import torch
    from diffusers import AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, LTX2Pipeline

    vae = AutoencoderKLLTX2Video.from_pretrained(ltx2_dir / "vae").eval()
    audio_vae = AutoencoderKLLTX2Audio.from_pretrained(ltx2_dir / "audio_vae").eval()
    with torch.no_grad():
        mean = vae.encode(torch.from_numpy(video[None])).latent_dist.mean
        video_latents = LTX2Pipeline._normalize_latents(
            mean, vae.latents_mean, vae.latents_std, vae.config.scaling_factor
        )
        audio_mean = audio_vae.encode(torch.from_numpy(mel[None])).latent_dist.mean
        packed = LTX2Pipeline._pack_audio_latents(audio_mean[:, :, :AUDIO_TOKENS])
        audio = LTX2Pipeline._normalize_audio_latents(
            packed, audio_vae.latents_mean, audio_vae.latents_std
        )
    return video_latents[0].numpy(), audio[0].numpy()


def _encoders(ltx2_dir: Path):
    from jaxcore import families

    return families.get("ltx2").load_encoders(ltx2_dir, ComputeConfig(), LENGTH, 2)


def test_records_equal_diffusers_encode_path(ltx2_dir, clips):
    """One clip's joint latents (the encoders convert calls) vs diffusers' encode path."""
    from jaxcore.families import ltx2
    from jaxcore.models import ltx2_mel

    encoders = _encoders(ltx2_dir)
    video, sound = _clip(clips, 1)  # stereo at 22.05 kHz: trimmed, resampled
    assert sound.waveform.shape == (2, int(FRAMES / 24 * tiny_ltx2_dataset.SOUND_RATE))
    joint = encoders.encode_media_with_sound(video[None], [sound])
    assert list(joint.shape[1:]) == LATENTS
    mel = ltx2_mel.clip_spectrogram(sound.waveform, sound.sample_rate, FRAMES / 24, encoders.mel)
    assert mel.shape == (2, 38, 16)  # 6000 samples at 16 kHz: 1 + 6000 // 160 frames
    want_video, want_audio = _diffusers_latents(ltx2_dir, video, mel)
    layout = ltx2.layout(encoders.configs, VIDEO[1:])
    got_video, got_audio = ltx2.split_latents(joint, layout)
    scale = max(np.abs(want_video).max(), np.abs(want_audio).max())
    video_error = np.abs(np.asarray(got_video)[0] - want_video).max()
    audio_error = np.abs(np.asarray(got_audio)[0] - want_audio).max()
    print(f"video {video_error:.2e}, audio {audio_error:.2e} (values up to {scale:.2f})")
    assert want_audio.shape == (AUDIO_TOKENS, AUDIO_WIDTH) and np.abs(want_audio).max() > 0.1
    assert video_error < TOLERANCE * scale and audio_error < TOLERANCE * scale
    assert not np.asarray(joint)[0].reshape(-1)[8 * 48 + AUDIO_TOKENS * AUDIO_WIDTH :].any()
    sizes = encoders.encode_media_conditioning(video[None])[ltx2.JOINT_SIZES]
    np.testing.assert_array_equal(sizes, [[8, AUDIO_TOKENS * AUDIO_WIDTH]])
    with pytest.raises(ltx2.FamilyError, match="dataset.audio_column"):
        encoders.encode_media(video[None])


def _torch_trainer_loss(ltx2_dir: Path, joint, text, t: float, noise) -> float:
    """ltx-trainer's per-sample loss (text_to_video.py ``compute_loss``: the video's mean
    squared error plus the audio's) with diffusers' transformer, ltx-trainer's noisy input
    (``x_t = (1 - t) x0 + t noise``: no sigma_min) and timestep ``1000 t``."""
    import torch
    from diffusers import LTX2VideoTransformer3DModel

    model = LTX2VideoTransformer3DModel.from_pretrained(ltx2_dir / "transformer").eval()
    x0 = torch.from_numpy(np.asarray(joint, np.float32))
    eps = torch.from_numpy(np.asarray(noise, np.float32))
    x_t = (1 - t) * x0 + t * eps
    target = eps - x0

    def video_and_audio(x):  # the joint layout: [C, F', H', W'] then [L, C_a M'] flattened
        video = x[:, :8]
        audio = x[:, 8:].reshape(1, -1)[:, : AUDIO_TOKENS * AUDIO_WIDTH]
        return video, audio.reshape(1, AUDIO_TOKENS, AUDIO_WIDTH)

    video, audio = video_and_audio(x_t)
    packed = video.permute(0, 2, 3, 4, 1).reshape(1, -1, 8)  # _pack_latents, patch 1
    text = {k: torch.from_numpy(np.array(v)) for k, v in text.items()}
    mask = text["encoder_attention_mask"]
    with torch.no_grad():
        pred_video, pred_audio = model(
            hidden_states=packed,
            audio_hidden_states=audio,
            encoder_hidden_states=text["encoder_hidden_states"],
            audio_encoder_hidden_states=text["audio_encoder_hidden_states"],
            timestep=torch.tensor([1000.0 * t]),
            sigma=torch.tensor([1000.0 * t]),
            encoder_attention_mask=mask,
            audio_encoder_attention_mask=mask,
            num_frames=VIDEO[1],
            height=VIDEO[2],
            width=VIDEO[3],
            fps=24.0,
            audio_num_frames=AUDIO_TOKENS,
            return_dict=False,
        )
    want_video, want_audio = video_and_audio(target)
    want_video = want_video.permute(0, 2, 3, 4, 1).reshape(1, -1, 8)
    video_loss = (pred_video - want_video).pow(2).mean(dim=[-2, -1])
    audio_loss = (pred_audio - want_audio).pow(2).mean(dim=[-2, -1])
    return float(video_loss + audio_loss)


def test_training_loss_is_ltx_trainers(ltx2_dir, clips):
    """The train objective's loss of a record (the family's loss weights) vs ltx-trainer's
    loss with diffusers' transformer in PyTorch, at one noise draw and timestep."""
    import jax.numpy as jnp

    from jaxcore.families import load_pipeline, ltx2
    from stages.common import objective

    encoders = _encoders(ltx2_dir)
    video, sound = _clip(clips, 2)
    joint = encoders.encode_media_with_sound(video[None], [sound])
    text = encoders.encode_text(["a bar of colour 2 humming at pitch 2"])
    noise = np.random.default_rng(0).standard_normal(joint.shape).astype(np.float32)
    sizes = encoders.encode_media_conditioning(video[None])
    pipe = load_pipeline(ltx2_dir)
    conditioning = {k: jnp.asarray(v) for k, v in {**text, **sizes}.items()}
    t = 0.63
    ours = objective.loss_at(
        pipe.family,
        pipe.denoiser,
        pipe.denoiser_params,
        jnp.asarray(joint),
        conditioning,
        jnp.asarray([t], jnp.float32),
        jnp.asarray(noise),
    )
    trainer = _torch_trainer_loss(ltx2_dir, joint, text, t, noise)
    error = abs(float(ours[0]) - trainer) / trainer
    print(f"ours {float(ours[0]):.7f} vs ltx-trainer's {trainer:.7f}: {error:.1e} relative")
    assert float(ours[0]) == pytest.approx(trainer, rel=TOLERANCE)
    # the padding counts nowhere: the same records without JOINT_SIZES average it in
    plain = {k: v for k, v in conditioning.items() if k != ltx2.JOINT_SIZES}
    unmasked = objective.loss_at(
        pipe.family,
        pipe.denoiser,
        pipe.denoiser_params,
        jnp.asarray(joint),
        plain,
        jnp.asarray([t], jnp.float32),
        jnp.asarray(noise),
    )
    assert abs(float(unmasked[0]) - float(ours[0])) > 1e-3


def test_bad_sounds_are_named(tmp_path):
    """Sound cells convert cannot use drop their row with the reason and what was wrong."""
    from stages.convert import media

    with pytest.raises(media.DropItem, match="missing_sound: the sound cell is empty"):
        media.decode_sound(None)
    with pytest.raises(media.DropItem, match=r"undecodable_sound: array of shape \[2, 3, 4\]"):
        media.decode_sound({"array": np.zeros((2, 3, 4)), "sampling_rate": 16000})
    with pytest.raises(media.DropItem, match="undecodable_sound: sampling_rate=None"):
        media.decode_sound({"array": np.zeros(10), "sampling_rate": None})
    with pytest.raises(media.DropItem, match="missing_sound: sound: cannot read"):
        media.decode_sound(str(tmp_path / "absent.wav"))
    junk = tmp_path / "junk.wav"
    junk.write_bytes(b"not a sound")
    with pytest.raises(media.DropItem, match="undecodable_sound: cannot decode the sound of"):
        media.decode_sound(str(junk))
    sound = media.prepare_sound({"array": np.ones(100), "sampling_rate": 1000}, seconds=0.25)
    assert sound.waveform.shape == (1, 250) and sound.waveform[0, 100:].sum() == 0


def test_a_videos_own_sound_track_decodes(tmp_path):
    """``audio_column`` may be the video column: ffmpeg decodes an mp4's sound track."""
    from stages.convert import media
    from stages.generate.outputs import Audio, encode_mp4

    frames = tiny_ltx2_dataset.clip_frames(0, FRAMES, SIZE)
    tone = tiny_ltx2_dataset.clip_sound(0, 1.0)
    mp4 = tmp_path / "clip.mp4"
    mp4.write_bytes(encode_mp4(frames, 24, Audio(np.concatenate([tone, tone]), 22050)))
    sound = media.decode_sound(str(mp4))
    assert sound.waveform.shape[0] == 2 and sound.sample_rate == 22050
    assert sound.waveform.shape[1] >= 22050 * 0.9 and np.abs(sound.waveform).max() > 0.2


def _convert(ltx2_dir, source, out, *extra) -> int:
    return cli.main(
        [
            "convert",
            str(REPO / "configs/stages/convert.yml"),
            f"source={source}",
            f"output_dir={out}",
            f"pretrained_model_name_or_path={ltx2_dir}",
            f"height={SIZE}",
            f"width={SIZE}",
            f"num_frames={FRAMES}",
            "fps=24",
            "media_column=video",
            f"max_sequence_length={LENGTH}",
            *extra,
            "-q",
        ]
    )


def test_convert_needs_the_audio_column(ltx2_dir, clips, tmp_path, capsys):
    assert _convert(ltx2_dir, clips, tmp_path / "a") == 2
    assert "records hold each clip's sound: set dataset.audio_column" in capsys.readouterr().err
    assert _convert(ltx2_dir, clips, tmp_path / "b", "audio_column=sound") == 2
    assert "audio_column='sound' is not a column" in capsys.readouterr().err


@pytest.mark.slow  # ~4 min: convert, three short trainings, evaluate, generate
def test_convert_train_resume_evaluate_render(ltx2_dir, clips, tmp_path):
    data = tmp_path / "convert"
    assert _convert(ltx2_dir, clips, data, "audio_column=audio", "eval_fraction=0.34") == 0
    summary = open_artifact(str(data), "convert").summary
    assert summary["family"] == "ltx2" and summary["source"]["audio_column"] == "audio"
    assert {k: v["shape"] for k, v in summary["features"].items()} == {
        "latents": LATENTS,
        "encoder_hidden_states": [LENGTH, 48],
        "audio_encoder_hidden_states": [LENGTH, 48],
        "encoder_attention_mask": [LENGTH],
        "joint_sizes": [2],
    }
    assert sum(summary["dropped"].values()) == 0

    # train: 24 steps straight (the loss falls), and the same run killed after its step-8
    # checkpoint then rerun
    from tests.support import train_steps

    def command(out):
        extra = (
            f"model.pretrained_model_name_or_path={ltx2_dir}",
            "eval_every=8",
            "learning_rate=3e-3",
            "objective.timestep_sampling=stretched_logit_normal",  # ltx-trainer's LTX-2 default
        )
        args = train_steps.train_args(data, "null", out, 24, *extra)
        return [sys.executable, "-m", "pipelines.cli", *args]

    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0",
        "JAX_PLATFORMS": "cpu",
    }
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    subprocess.run(command(straight), cwd=REPO, env=env, check=True, timeout=900)
    proc = subprocess.Popen(command(killed), cwd=REPO, env=env)
    deadline = time.monotonic() + 600
    while not (killed / "checkpoints" / "8").is_dir() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert proc.poll() is None, "the run finished before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (killed / "manifest.json").exists()
    subprocess.run(command(killed), cwd=REPO, env=env, check=True, timeout=900)

    def losses(out):
        rows = (json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines())
        return {r["step"]: r["loss"] for r in rows}

    a, b = losses(straight), losses(killed)
    assert sorted(a) == sorted(b) == list(range(1, 25))
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-6, abs=1e-7), step
    first, last = np.mean([a[s] for s in range(1, 9)]), np.mean([a[s] for s in range(17, 25)])
    print(f"loss: steps 1-8 {first:.4f}, steps 17-24 {last:.4f}")
    assert last < 0.8 * first

    evaluated = tmp_path / "evaluate"
    args = ["evaluate", str(REPO / "configs/stages/evaluate.yml"), f"checkpoints={straight}"]
    assert cli.main([*args, f"data={data}", f"output_dir={evaluated}", "-q"]) == 0
    scores = open_artifact(str(evaluated), "evaluate").summary["eval_loss"]
    history = open_artifact(str(straight), "train").summary["eval_history"]
    for entry in history:
        if str(entry["step"]) in scores:
            assert scores[str(entry["step"])] == pytest.approx(entry["eval_loss"], rel=1e-5)
    assert "24" in scores

    prompts = tmp_path / "p.jsonl"
    line = {"id": "bar", "prompt": "a bar of colour 1 humming at pitch 1", "seed": 3}
    prompts.write_text(json.dumps(line | {"num_frames": FRAMES, "height": SIZE, "width": SIZE}))
    render = tmp_path / "render"
    generate = [
        "generate",
        str(REPO / "configs/stages/generate.yml"),
        f"pretrained_model_name_or_path={evaluated}",
        f"prompt_file={prompts}",
        f"output_dir={render}",
        f"model.base_pipeline={ltx2_dir}",
        "num_inference_steps=3",
        f"max_sequence_length={LENGTH}",
        "save_arrays=true",
        "-q",
    ]
    assert cli.main(generate) == 0
    assert open_artifact(str(render), "generate").summary["model"]["source"] == "train_artifact"
    frames = np.load(render / "outputs" / "bar.npy")
    wave = np.load(render / "outputs" / "bar.audio.npy")
    assert frames.shape == (FRAMES, SIZE, SIZE, 3) and np.isfinite(frames).all()
    assert wave.ndim == 2 and np.isfinite(wave).all() and wave.std() > 0
    assert _streams(render / "outputs" / "bar.mp4") == {"Video", "Audio"}


def _streams(path: Path) -> set[str]:
    """The kinds of stream ffmpeg finds in ``path``."""
    import imageio_ffmpeg

    from stages.common.subprocesses import allow_fork_exec_under_jax

    allow_fork_exec_under_jax()
    probe = [imageio_ffmpeg.get_ffmpeg_exe(), "-hide_banner", "-i", str(path)]
    text = subprocess.run(probe, capture_output=True, text=True).stderr
    return set(re.findall(r"Stream #0:\d+\S*: (Video|Audio):", text))


def test_an_audio_feature_column_is_read_undecoded(clips, tmp_path):
    """A saved data set whose sound column is a Hugging Face ``Audio`` feature: convert reads
    its cells undecoded (bytes / path; decoding them needs torchcodec) and decodes the WAV."""
    import datasets

    from stages.convert import media
    from stages.convert.config import DatasetConfig
    from stages.convert.source import load_source

    rows = [json.loads(line) for line in clips.read_text().splitlines()][:2]
    table = {key: [row[key] for row in rows] for key in ("video", "audio", "text")}
    saved = tmp_path / "saved"
    dataset = datasets.Dataset.from_dict(table).cast_column("audio", datasets.Audio())
    dataset.save_to_disk(str(saved))
    config = DatasetConfig(source=str(saved), media_column="video", audio_column="audio")
    cell = load_source(config)[1]["audio"]
    assert set(cell) == {"bytes", "path"}
    sound = media.decode_sound(cell)
    assert sound.sample_rate == tiny_ltx2_dataset.SOUND_RATE and sound.waveform.shape[0] == 2


def test_records_without_the_audio_channels_are_refused(ltx2_dir):
    """Train checks the records' latents against the joint layout of the transformer's
    config: video-only latents are named with the shape the model takes."""
    from jaxcore import families
    from jaxcore.families import TensorSpec

    family = families.get("ltx2")
    config = family.component_configs(ltx2_dir)["transformer"]
    features = {
        spec.name: spec for spec in family.record_features(ltx2_dir, SIZE, SIZE, FRAMES, LENGTH)
    }
    family.check_features(config, features, "records")
    features["latents"] = TensorSpec("latents", tuple(VIDEO))
    with pytest.raises(families.FamilyError, match=r"'latents' \[8, 3, 4, 4\], the transformer"):
        family.check_features(config, features, "records")
