"""LTX-Video through convert, train, evaluate and generate, on a tiny diffusers-built
``LTXPipeline`` (tests/support/tiny_ltx.py: 8 latent channels, 8 x 8 pixels and 4 frames per
latent voxel), with nothing LTX-specific in the stages.

- convert: 32 x 32, 5-frame mp4 clips -> records of latents ``[8, 2, 4, 4]`` equal to diffusers'
  ``vae.encode(video).latent_dist.mean`` normalised by ``LTXPipeline._normalize_latents`` with the
  VAE's ``scaling_factor`` (and to the family's own VAE encode + normalisation, 1e-5), T5 states
  and mask equal to ``LTXPipeline.encode_prompt``'s, and the RoPE scale of 25 fps; images are
  1-frame clips; sizes LTX cannot make are refused naming the parameter.
- train: 30 steps from the tiny pipeline's transformer, the loss falls; evaluate scores the
  checkpoints as periodic eval did; generate renders the trained checkpoint through
  ``model.base_pipeline``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from jaxcore.artifacts import open_artifact
from jaxcore.compute import ComputeConfig
from pipelines import cli
from tests.support.tiny_ltx import build_ltx_pipeline

REPO = Path(__file__).resolve().parents[2]
SIZE, FRAMES, LENGTH = 32, 5, 16
LATENTS = [8, 2, 4, 4]  # (F - 1) / 4 + 1 frames, H / 8 x W / 8
ROPE_25FPS = [4 / 25, 8.0, 8.0]  # (t / frame_rate, s, s)


@pytest.fixture(scope="module")
def ltx_dir(tmp_path_factory) -> Path:
    return build_ltx_pipeline(tmp_path_factory.mktemp("ltx"), seed=7)


@pytest.fixture(scope="module")
def clip_data(ltx_dir, tmp_path_factory) -> Path:
    """8 clips converted with the tiny pipeline (a convert artifact with train and eval
    records)."""
    root = tmp_path_factory.mktemp("ltx_clips")
    source = _write_clips(root / "clips", 8)
    out = root / "convert"
    clips = ("media_column=video", f"num_frames={FRAMES}", "fps=25")
    assert _convert(ltx_dir, source, out, *clips, eval_fraction=0.4) == 0
    return out


def _write_clips(directory: Path, count: int) -> Path:
    """A JSONL dataset of ``count`` small mp4 clips (a moving bar, one colour per clip)."""
    import imageio.v2 as imageio

    directory.mkdir(parents=True)
    rng = np.random.default_rng(5)
    rows = []
    for i in range(count):
        clip = np.zeros((FRAMES, SIZE, SIZE, 3), np.uint8)
        colour = rng.integers(40, 255, 3)
        for t in range(FRAMES):
            clip[t, :, 4 * t : 4 * t + 10] = colour
        path = directory / f"clip{i}.mp4"
        imageio.mimwrite(path, list(clip), fps=25, format="ffmpeg", macro_block_size=1)
        rows.append({"id": f"clip{i}", "video": str(path), "text": f"a bar of colour {i}"})
    data = directory / "data.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return data


def _convert(ltx_dir, source, out, *extra, eval_fraction: float = 0.3) -> int:
    return cli.main(
        [
            "convert",
            str(REPO / "configs/stages/convert.yml"),
            f"source={source}",
            f"output_dir={out}",
            f"pretrained_model_name_or_path={ltx_dir}",
            f"height={SIZE}",
            f"width={SIZE}",
            f"max_sequence_length={LENGTH}",
            f"eval_fraction={eval_fraction}",
            *extra,
            "-q",
        ]
    )


def _first_record(out: Path) -> dict:
    import tensorflow as tf

    from stages.common import data, records

    manifest = open_artifact(str(out), "convert")
    spec = data.split_spec(manifest, "train")
    shards = [str(out / s) for s in manifest.summary["splits"]["train"]["shards"]]
    return next(
        tf.data.TFRecordDataset(shards)
        .map(lambda x: records.parse_example(x, spec.shapes))
        .as_numpy_iterator()
    )


def _reference_latents(ltx_dir: Path, video: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(diffusers' normalised posterior mean, the family's VAE encode + normalisation) of one
    ``[3, F, H, W]`` clip."""
    import jax.numpy as jnp
    import torch
    from diffusers import AutoencoderKLLTXVideo, LTXPipeline

    from jaxcore.models import ltx_vae

    vae = AutoencoderKLLTXVideo.from_pretrained(ltx_dir / "vae").eval()
    with torch.no_grad():
        mean = vae.encode(torch.from_numpy(video[None])).latent_dist.mean
        expected = LTXPipeline._normalize_latents(
            mean, vae.latents_mean, vae.latents_std, vae.config.scaling_factor
        )[0].numpy()
    module, params = ltx_vae.load_ltx_vae(ltx_dir / "vae")
    posterior = ltx_vae.encode(module, params, jnp.asarray(video[None]))
    ours = ltx_vae.normalize_latents(posterior.mean, params, module.config)
    return expected, np.asarray(ours)[0]


def test_convert_writes_ltx_records(ltx_dir, clip_data):
    import torch
    from diffusers import LTXPipeline

    from stages.common import records
    from stages.convert.media import prepare_video

    out = clip_data
    summary = open_artifact(str(out), "convert").summary
    assert summary["family"] == "ltx"
    assert {k: v["shape"] for k, v in summary["features"].items()} == {
        "latents": LATENTS,
        "encoder_hidden_states": [LENGTH, 32],
        "encoder_attention_mask": [LENGTH],
        "rope_interpolation_scale": [3],
    }
    normalization = summary["latents_normalization"]
    assert normalization["formula"] == "(z - latents_mean) * scaling_factor / latents_std"
    assert normalization["scaling_factor"] == pytest.approx(0.7)
    assert normalization["frame_rate"] == 25.0

    row = _first_record(out)
    index = int(row[records.SOURCE_ID].decode().removeprefix("clip"))
    video = prepare_video(
        str(out.parent / "clips" / f"clip{index}.mp4"),
        height=SIZE,
        width=SIZE,
        num_frames=FRAMES,
        fps=25,
    )
    expected, ours = _reference_latents(ltx_dir, video)
    np.testing.assert_allclose(row["latents"], ours, atol=1e-5, rtol=0)
    np.testing.assert_allclose(row["latents"], expected, atol=1e-5, rtol=0)
    np.testing.assert_allclose(row["rope_interpolation_scale"], ROPE_25FPS, rtol=1e-6)

    pipe = LTXPipeline.from_pretrained(ltx_dir)
    with torch.no_grad():
        embeds, mask, _, _ = pipe.encode_prompt(
            f"a bar of colour {index}",
            do_classifier_free_guidance=False,
            max_sequence_length=LENGTH,
        )
    np.testing.assert_allclose(row["encoder_hidden_states"], embeds[0].numpy(), atol=1e-5)
    np.testing.assert_array_equal(row["encoder_attention_mask"], mask[0].numpy())


def test_images_convert_as_one_frame_clips_and_bad_sizes_are_named(ltx_dir, tmp_path, capsys):
    from pipelines.embedded.shapes import make_shapes_dataset

    source = make_shapes_dataset(tmp_path / "shapes", num_items=3, height=40, width=40, seed=2)
    out = tmp_path / "images"
    assert _convert(ltx_dir, source, out, "num_frames=1") == 0
    features = open_artifact(str(out), "convert").summary["features"]
    assert features["latents"]["shape"] == [8, 1, 4, 4]

    assert _convert(ltx_dir, source, tmp_path / "bad", "height=48", "num_frames=1") == 2
    assert "height must be a positive multiple of 32, got 48" in capsys.readouterr().err
    assert _convert(ltx_dir, source, tmp_path / "bad", "num_frames=4") == 2
    assert "num_frames must be 1, 5, 9, ... (4k + 1), got 4" in capsys.readouterr().err


@pytest.mark.slow  # ~20 s; the LoRA test below trains LTX in the default tier
def test_ltx_trains_evaluates_and_renders_its_checkpoint(ltx_dir, clip_data, tmp_path):
    data_dir = clip_data
    out = tmp_path / "train"
    args = [
        "train",
        str(REPO / "configs/stages/train.yml"),
        f"data={data_dir}",
        f"output_dir={out}",
        "dataset_type=tfrecord",
        "model.model_config=null",
        f"model.pretrained_model_name_or_path={ltx_dir}",
        "max_train_steps=30",
        "checkpoint_every=15",
        "eval_every=15",
        "learning_rate=3e-3",
        "per_device_batch_size=1",
        "-q",
    ]
    assert cli.main(args) == 0
    summary = open_artifact(str(out), "train").summary
    assert summary["family"] == "ltx"
    losses = [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert np.mean(losses[-10:]) < 0.7 * np.mean(losses[:10]), (losses[:10], losses[-10:])

    ev = tmp_path / "evaluate"
    args = ["evaluate", str(REPO / "configs/stages/evaluate.yml"), f"checkpoints={out}"]
    assert cli.main([*args, f"data={data_dir}", f"output_dir={ev}", "-q"]) == 0
    evaluated = open_artifact(str(ev), "evaluate").summary["eval_loss"]
    history = {e["step"]: e["eval_loss"] for e in summary["eval_history"]}
    assert sorted(history) == [15, 30]
    for step, loss in history.items():
        assert evaluated[str(step)] == pytest.approx(loss, rel=1e-5)

    prompts = tmp_path / "p.jsonl"
    line = {"id": "bar", "prompt": "a bar of colour 1", "num_frames": FRAMES}
    prompts.write_text(json.dumps(line | {"height": SIZE, "width": SIZE}) + "\n")
    render = tmp_path / "render"
    generate = [
        "generate",
        str(REPO / "configs/stages/generate.yml"),
        f"pretrained_model_name_or_path={ev}",
        f"prompt_file={prompts}",
        f"output_dir={render}",
        f"model.base_pipeline={ltx_dir}",
        "num_inference_steps=3",
        f"max_sequence_length={LENGTH}",
        "save_arrays=true",
        "-q",
    ]
    assert cli.main(generate) == 0
    rendered = open_artifact(str(render), "generate")
    assert rendered.summary["model"]["source"] == "train_artifact"
    frames = np.load(render / "outputs" / "bar.npy")
    assert frames.shape == (FRAMES, SIZE, SIZE, 3) and np.isfinite(frames).all()


def test_shifted_logit_normal_is_ltx_trainers_sampling(ltx_dir):
    """timestep_sampling=shifted_logit_normal: LTX-Video-Trainer's mean (linear in the token
    count: 0.95 at 1024, 2.05 at 4096) with the tokens of the batch, the draws exactly
    sigmoid(N(mean, 1)) of logit_normal at that mean."""
    import jax

    from jaxcore import flow_matching as fm
    from jaxcore.families import load_pipeline
    from stages.common import objective

    assert fm.shifted_logit_mean(1024) == pytest.approx(0.95)
    assert fm.shifted_logit_mean(4096) == pytest.approx(2.05)
    assert fm.shifted_logit_mean(2560) == pytest.approx(1.5)
    pipe = load_pipeline(ltx_dir)
    tokens = pipe.family.tokens_per_example(pipe.denoiser.config, tuple(LATENTS))
    assert tokens == 2 * 4 * 4
    key = jax.random.key(0)
    shifted = objective.ObjectiveSection(timestep_sampling="shifted_logit_normal")
    plain = objective.ObjectiveSection(
        timestep_sampling="logit_normal", logit_mean=fm.shifted_logit_mean(tokens)
    )
    np.testing.assert_array_equal(
        objective.sample_t(key, 64, shifted, tokens), objective.sample_t(key, 64, plain)
    )


def test_encoders_pad_to_their_batch(ltx_dir):
    from jaxcore import families

    encoders = families.get("ltx").load_encoders(ltx_dir, ComputeConfig(), LENGTH, 2)
    video = np.zeros((1, 3, FRAMES, SIZE, SIZE), np.float32)
    assert encoders.encode_media(video).shape == (1, *LATENTS)
    assert encoders.encode_media_conditioning(video)["rope_interpolation_scale"].shape == (1, 3)
    text = encoders.encode_text(["a"])
    assert text["encoder_hidden_states"].shape == (1, LENGTH, 32)
    assert text["encoder_attention_mask"].shape == (1, LENGTH)


@pytest.fixture(scope="module")
def i2v_dir(tmp_path_factory) -> Path:
    return build_ltx_pipeline(tmp_path_factory.mktemp("ltx_i2v"), seed=7, image_to_video=True)


@pytest.mark.slow  # ~20 s; the LoRA test below trains LTX in the default tier
def test_i2v_records_train_on_the_frames_after_the_first(i2v_dir, clip_data, tmp_path):
    """An image-to-video pipeline's records hold each clip's first frame encoded as generate
    encodes a conditioning image; training keeps that frame clean (timestep 0) and scores the
    other frames only (the loss does not see the first frame's noise); the checkpoint renders
    an image prompt."""
    import jax.numpy as jnp

    from jaxcore import families
    from jaxcore.families import ltx, wan
    from stages.common import objective, records
    from stages.convert.media import prepare_video

    out = tmp_path / "convert"
    source = clip_data.parent / "clips" / "data.jsonl"
    clips = ("media_column=video", f"num_frames={FRAMES}", "fps=25")
    assert _convert(i2v_dir, source, out, *clips, eval_fraction=0.4) == 0
    features = open_artifact(str(out), "convert").summary["features"]
    assert features["image_latents"]["shape"] == [8, 1, 4, 4]

    row = _first_record(out)
    index = int(row[records.SOURCE_ID].decode().removeprefix("clip"))
    path = str(clip_data.parent / "clips" / f"clip{index}.mp4")
    video = prepare_video(path, height=SIZE, width=SIZE, num_frames=FRAMES, fps=25)
    family = families.get("ltx")
    pipe = family.load_pipeline(i2v_dir, ComputeConfig())
    image = wan.to_pil(video[:, 0])
    expected = family.encode_images(pipe, [(image, None)], SIZE, SIZE, FRAMES)
    np.testing.assert_allclose(row["image_latents"], expected["image_latents"][0], atol=1e-5)

    names = ("encoder_hidden_states", "encoder_attention_mask", "rope_interpolation_scale")
    conditioning = {name: jnp.asarray(row[name][None]) for name in (*names, "image_latents")}
    latents = jnp.asarray(row["latents"][None])
    noise = np.random.default_rng(0).standard_normal(latents.shape).astype(np.float32)
    other_first, other_second = noise.copy(), noise.copy()
    other_first[:, :, 0] += 1.0
    other_second[:, :, 1] += 1.0

    def loss(n):
        t = jnp.asarray([0.6])
        args = (family, pipe.denoiser, pipe.denoiser_params, latents, conditioning, t)
        return float(objective.loss_at(*args, jnp.asarray(n))[0])

    assert loss(other_first) == pytest.approx(loss(noise), rel=1e-6)
    assert loss(other_second) != pytest.approx(loss(noise), rel=1e-3)
    assert ltx.first_frame_loss_mask(2).ravel().tolist() == [0.0, 1.0]

    train = tmp_path / "train"
    args = [
        "train",
        str(REPO / "configs/stages/train.yml"),
        f"data={out}",
        f"output_dir={train}",
        "dataset_type=tfrecord",
        "model.model_config=null",
        f"model.pretrained_model_name_or_path={i2v_dir}",
        "max_train_steps=2",
        "checkpoint_every=2",
        "eval_every=2",
        "per_device_batch_size=1",
        "-q",
    ]
    assert cli.main(args) == 0
    image.save(tmp_path / "first.png")
    prompts = tmp_path / "p.jsonl"
    line = {"id": "a", "prompt": "a bar", "image": "first.png", "num_frames": FRAMES}
    prompts.write_text(json.dumps(line | {"height": SIZE, "width": SIZE}) + "\n")
    render = tmp_path / "render"
    generate = [
        "generate",
        str(REPO / "configs/stages/generate.yml"),
        f"pretrained_model_name_or_path={train}",
        f"prompt_file={prompts}",
        f"output_dir={render}",
        f"model.base_pipeline={i2v_dir}",
        "num_inference_steps=2",
        f"max_sequence_length={LENGTH}",
        "save_arrays=true",
        "-q",
    ]
    assert cli.main(generate) == 0
    assert np.load(render / "outputs" / "a.npy").shape == (FRAMES, SIZE, SIZE, 3)


@pytest.mark.slow  # ~40 s; the loop is shared, test_train.py resumes every other family
def test_kill_9_then_resume_equals_an_uninterrupted_run(ltx_dir, clip_data, tmp_path):
    """An LTX run SIGKILLed after its step-4 checkpoint, rerun, logs exactly the losses of an
    uninterrupted run."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from tests.support import train_steps

    def command(out):
        extra = (f"model.pretrained_model_name_or_path={ltx_dir}", "eval_every=0")
        args = train_steps.train_args(clip_data, "null", out, 12, *extra)
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
    while not (killed / "checkpoints" / "4").is_dir() and time.monotonic() < deadline:
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
    assert sorted(a) == sorted(b) == list(range(1, 13))
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-6, abs=1e-7), step


def test_an_ltx_lora_trains_and_its_export_renders_in_diffusers(
    ltx_dir, clip_data, tmp_path, caplog
):
    """LoRA training on LTX-Video records (the shared adapter path): the loss falls, the exported
    PEFT file loads into diffusers' LTXPipeline with no warning, and diffusers with it renders
    what generate renders with it (``model.loras``) within 1e-4 on [0, 1] pixels from the same
    latents, a render the LoRA changes."""
    import logging

    import torch
    from diffusers import LTXPipeline

    from jaxcore.models import ltx_transformer
    from jaxcore.sampling import initial_latents

    out = tmp_path / "train"
    args = [
        "train",
        str(REPO / "configs/stages/train.yml"),
        f"data={clip_data}",
        f"output_dir={out}",
        "dataset_type=tfrecord",
        "model.model_config=null",
        f"model.pretrained_model_name_or_path={ltx_dir}",
        "lora.rank=4",
        "lora.alpha=8",
        "timestep_sampling=shifted_logit_normal",  # LTX-Video-Trainer's
        "max_train_steps=20",
        "checkpoint_every=20",
        "learning_rate=1e-2",
        "per_device_batch_size=1",
        "-q",
    ]
    assert cli.main(args) == 0
    assert open_artifact(str(out), "train").summary["lora"]["targets"]
    losses = [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert np.mean(losses[-5:]) < np.mean(losses[:5])

    latents = initial_latents(21, tuple(LATENTS))
    np.save(tmp_path / "z.npy", latents)
    line = {"id": "p", "prompt": "a bar of colour 1", "latents": "z.npy", "num_frames": FRAMES}
    (tmp_path / "p.jsonl").write_text(json.dumps(line | {"height": SIZE, "width": SIZE}) + "\n")
    render = tmp_path / "render"
    generate = [
        "generate",
        str(REPO / "configs/stages/generate.yml"),
        f"pretrained_model_name_or_path={ltx_dir}",
        f"prompt_file={tmp_path / 'p.jsonl'}",
        f"output_dir={render}",
        f"model.loras=[{{path: {out / 'lora'}}}]",
        "num_inference_steps=3",
        "guidance_scale=1",
        f"max_sequence_length={LENGTH}",
        "save_arrays=true",
        "-q",
    ]
    assert cli.main(generate) == 0
    ours = np.load(render / "outputs" / "p.npy")

    pipe = LTXPipeline.from_pretrained(ltx_dir)
    common = dict(
        prompt="a bar of colour 1",
        height=SIZE,
        width=SIZE,
        num_frames=FRAMES,
        num_inference_steps=3,
        guidance_scale=1.0,
        max_sequence_length=LENGTH,
        output_type="np",
    )
    packed = torch.from_numpy(np.asarray(ltx_transformer.pack_latents(latents[None])))
    plain = pipe(latents=packed.clone(), **common).frames[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        pipe.load_lora_weights(str(out / "lora"))
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    theirs = pipe(latents=packed.clone(), **common).frames[0]
    assert np.abs(theirs - plain).max() > 1e-3  # the trained LoRA changes the render
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)
