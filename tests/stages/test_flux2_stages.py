"""Flux.2 [klein] through convert, train, evaluate and generate, text-to-image and edit pairs, on
a tiny diffusers-built ``Flux2KleinPipeline`` (tests/support/tiny_flux2.py), with nothing
Flux.2-specific in the stages.

- convert: text-to-image records carry the latents diffusers' ``Flux2KleinPipeline.
  _encode_vae_image`` makes of the image (posterior mode, 2x2 patchify, BatchNorm) and the
  prompt embeddings of its ``encode_prompt`` (reached ~3e-6); edit-pair records
  (``dataset.reference_image_column``: the source image, resized / cropped to the record's size
  as its image is) add ``reference_0``, equal to what the library's ``encode_images`` makes of
  that reference (0.0), their latents and text to the library's too (1e-5);
- the reference column is refused naming the option by a family that takes no reference, and
  at a record size the pipeline refuses as a reference; a missing reference drops its row;
- the loss of an edit pair (what train and evaluate compute) equals diffusers' transformer
  run as diffusers' train_dreambooth_lora_flux2_klein_img2img.py runs it: the noised target's
  tokens, then the clean reference's with ids t = 10, the MSE over the noise tokens only
  (reached ~6e-7 relative);
- slow tier: the tiny Klein learns text-to-image records and edit-pair records (the loss falls
  to ~0.35x / ~0.4x), evaluate scores the checkpoints as periodic eval did, the trained
  artifact renders an edit through generate as the library does with its weights (~3e-6), and a
  run on edit pairs killed (SIGKILL) after its step-4 checkpoint and rerun logs the straight
  run's losses.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

from jaxcore.artifacts import open_artifact
from pipelines import cli
from stages.common import data, records
from tests.support.tiny_flux2 import build_flux2_pipeline, write_edit_pairs

REPO = Path(__file__).resolve().parents[2]
LENGTH = 16  # max_sequence_length of the records
EDIT_SIZE = 64  # Flux2KleinPipeline refuses references smaller than 64 px
T2I_SIZE = 16
PAIRS = 8
TOLERANCE = 1e-5
T2I_STEPS = 60
EDIT_STEPS = 40
RESUME_STEPS = 12


@pytest.fixture(scope="module")
def klein_dir(tmp_path_factory) -> Path:
    return build_flux2_pipeline(tmp_path_factory.mktemp("klein"), seed=3)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> Path:
    return write_edit_pairs(tmp_path_factory.mktemp("pairs") / "imgs", PAIRS, EDIT_SIZE, seed=2)


def _convert(pipeline: Path, source: Path, out: Path, size: int, *extra: str) -> int:
    return cli.main(
        [
            "convert",
            str(REPO / "configs/stages/convert.yml"),
            f"source={source}",
            f"output_dir={out}",
            f"pretrained_model_name_or_path={pipeline}",
            f"height={size}",
            f"width={size}",
            f"max_sequence_length={LENGTH}",
            "eval_fraction=0.3",
            *extra,
            "-q",
        ]
    )


@pytest.fixture(scope="module")
def edit_data(klein_dir, pairs, tmp_path_factory) -> Path:
    """The edit pairs converted with their source images as references."""
    out = tmp_path_factory.mktemp("edit") / "convert"
    column = "dataset.reference_image_column=source_image"
    assert _convert(klein_dir, pairs, out, EDIT_SIZE, column) == 0
    return out


@pytest.fixture(scope="module")
def t2i_data(klein_dir, pairs, tmp_path_factory) -> Path:
    """The edited images alone (text-to-image records), at a small size."""
    out = tmp_path_factory.mktemp("t2i") / "convert"
    assert _convert(klein_dir, pairs, out, T2I_SIZE) == 0
    return out


def _records(out: Path) -> list[dict]:
    """Every record of a convert artifact (both splits), parsed."""
    import tensorflow as tf

    manifest = open_artifact(str(out), "convert")
    spec = data.split_spec(manifest, "train")
    rows = []
    for split in records.SPLITS:
        shards = [str(out / s) for s in manifest.summary["splits"][split]["shards"]]
        parse = lambda x: records.parse_example(x, spec.shapes)  # noqa: E731
        rows += list(tf.data.TFRecordDataset(shards).map(parse).as_numpy_iterator())
    return rows


def _rows_by_image(pairs: Path) -> dict[str, dict]:
    lines = (pairs / "metadata.jsonl").read_text().splitlines()
    return {row["file_name"]: row for row in map(json.loads, lines)}


def _diffusers_encodings(reference, images: list[Path], captions: list[str], size: int):
    """(``Flux2KleinPipeline._encode_vae_image`` of the images resized / cropped to ``size``
    as convert does, ``encode_prompt`` of the captions), one batch each."""
    import torch

    from stages.convert.media import prepare_video

    pixels = [
        prepare_video(p.read_bytes(), height=size, width=size, num_frames=1, fps=16)[:, 0]
        for p in images
    ]
    with torch.no_grad():
        latents = reference._encode_vae_image(torch.from_numpy(np.stack(pixels)), None)
        embeds, _ = reference.encode_prompt(captions, max_sequence_length=LENGTH)
    return latents.numpy(), embeds.numpy()


def _worst(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))))


def test_text_to_image_records_are_what_the_pipeline_encodes(klein_dir, pairs, t2i_data):
    from diffusers import Flux2KleinPipeline

    summary = open_artifact(str(t2i_data), "convert").summary
    assert summary["family"] == "flux2"
    assert {k: v["shape"] for k, v in summary["features"].items()} == {
        "latents": [24, T2I_SIZE // 4, T2I_SIZE // 4],
        "encoder_hidden_states": [LENGTH, 96],
    }
    reference = Flux2KleinPipeline.from_pretrained(klein_dir)
    rows = _rows_by_image(pairs)
    converted = _records(t2i_data)
    assert len(converted) == PAIRS
    sources = [rows[record[records.SOURCE_ID].decode()] for record in converted]
    images = [pairs / row["file_name"] for row in sources]
    latents, text = _diffusers_encodings(
        reference, images, [row["text"] for row in sources], T2I_SIZE
    )
    worst = {
        "latents": _worst(np.stack([r["latents"] for r in converted]), latents),
        "text": _worst(np.stack([r["encoder_hidden_states"] for r in converted]), text),
    }
    scale = {"latents": np.abs(latents).max(), "text": np.abs(text).max()}
    print("text-to-image records vs diffusers, max abs:", worst, "of values up to", scale)
    assert max(worst.values()) < TOLERANCE, worst


def test_edit_pair_records_are_what_the_library_encodes(klein_dir, pairs, edit_data):
    import PIL.Image

    from jaxcore import families
    from stages.convert.media import prepare_conditioning_image

    summary = open_artifact(str(edit_data), "convert").summary
    latent = [24, EDIT_SIZE // 4, EDIT_SIZE // 4]
    assert {k: v["shape"] for k, v in summary["features"].items()} == {
        "latents": latent,
        "encoder_hidden_states": [LENGTH, 96],
        "reference_0": latent,
    }
    assert summary["source"]["image_columns"] == {"reference": "source_image"}
    pipe = families.load_pipeline(klein_dir)
    family = pipe.family
    rows = _rows_by_image(pairs)
    worst = {"latents": 0.0, "text": 0.0, "reference_0": 0.0}
    for record in _records(edit_data):
        row = rows[record[records.SOURCE_ID].decode()]

        def library(path: str):
            pixels = prepare_conditioning_image(str(path), height=EDIT_SIZE, width=EDIT_SIZE)
            image = PIL.Image.fromarray(pixels)
            latents = family.encode_images(pipe, [(image, None)], EDIT_SIZE, EDIT_SIZE, 1)
            return latents["reference_0"][0]

        worst["latents"] = max(
            worst["latents"], _worst(record["latents"], library(pairs / row["file_name"]))
        )
        worst["reference_0"] = max(
            worst["reference_0"], _worst(record["reference_0"], library(row["source_image"]))
        )
        text = family.encode_prompts(pipe, [row["text"]], LENGTH)["encoder_hidden_states"][0]
        worst["text"] = max(worst["text"], _worst(record["encoder_hidden_states"], text))
    print("edit-pair records vs the library, max abs:", worst)
    assert max(worst.values()) < TOLERANCE, worst
    # the reference is not the target: the records would not teach editing otherwise
    record = _records(edit_data)[0]
    assert _worst(record["latents"], record["reference_0"]) > 0.1


def test_the_reference_column_is_refused_by_name(pairs, tmp_path, capsys):
    column = "dataset.reference_image_column=source_image"
    # "tiny": the embedded tiny Wan pipeline (built once into the difforge cache)
    assert _convert("tiny", pairs, tmp_path / "out", 16, column) == 2
    err = capsys.readouterr().err
    assert "dataset.reference_image_column=source_image" in err
    assert "take no reference images" in err


def test_a_record_size_the_pipeline_refuses_as_a_reference_is_named(
    klein_dir, pairs, tmp_path, capsys
):
    column = "dataset.reference_image_column=source_image"
    assert _convert(klein_dir, pairs, tmp_path / "out", 32, column) == 2
    err = capsys.readouterr().err
    assert "dataset.reference_image_column=source_image" in err
    assert "reference image too small: 32x32" in err


def _train(data_uri: Path, pipeline: Path, out: Path, steps: int, *extra: str) -> list[str]:
    """``difforge train`` arguments: full fine-tuning of the pipeline's transformer on the
    records, a batch of 8 (one row per virtual device)."""
    return [
        "train",
        str(REPO / "configs/stages/train.yml"),
        f"data={data_uri}",
        f"output_dir={out}",
        "dataset_type=tfrecord",
        "model.model_config=null",
        f"model.pretrained_model_name_or_path={pipeline}",
        f"max_train_steps={steps}",
        "per_device_batch_size=1",
        *extra,
        "-q",
    ]


def _losses(out: Path) -> dict[int, float]:
    rows = (json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["loss"] for r in rows}


def _falls(losses: dict[int, float], window: int) -> tuple[float, float]:
    """(mean of the first ``window`` losses, mean of the last ``window``)."""
    values = [losses[s] for s in sorted(losses)]
    return float(np.mean(values[:window])), float(np.mean(values[-window:]))


@pytest.mark.slow  # ~40 s; the edit-pair loss is proven against diffusers in the default tier
def test_klein_learns_text_to_image_records(klein_dir, t2i_data, tmp_path):
    out = tmp_path / "train"
    args = _train(
        t2i_data, klein_dir, out, T2I_STEPS, "learning_rate=3e-3", f"checkpoint_every={T2I_STEPS}"
    )
    assert cli.main(args) == 0
    first, last = _falls(_losses(out), 10)
    print(f"text-to-image loss: first 10 {first:.4f}, last 10 {last:.4f}")
    assert last < 0.6 * first, (first, last)


@pytest.mark.slow  # ~2.5 min (three stage runs at 64 px, the pipeline's smallest reference)
def test_klein_learns_edit_pairs_evaluates_and_renders_an_edit(
    klein_dir, pairs, edit_data, tmp_path
):
    out = tmp_path / "train"
    steps = f"checkpoint_every={EDIT_STEPS // 2}", f"eval_every={EDIT_STEPS // 2}"
    args = _train(edit_data, klein_dir, out, EDIT_STEPS, "learning_rate=3e-3", *steps)
    args.insert(-1, "export_diffusers=true")
    started = time.perf_counter()
    assert cli.main(args) == 0
    print(f"train: {time.perf_counter() - started:.1f}s")
    summary = open_artifact(str(out), "train").summary
    assert summary["family"] == "flux2"
    first, last = _falls(_losses(out), 10)
    print(f"edit-pair loss: first 10 {first:.4f}, last 10 {last:.4f}")
    assert last < 0.6 * first, (first, last)

    ev = tmp_path / "evaluate"
    args = ["evaluate", str(REPO / "configs/stages/evaluate.yml"), f"checkpoints={out}"]
    started = time.perf_counter()
    assert cli.main([*args, f"data={edit_data}", f"output_dir={ev}", "-q"]) == 0
    print(f"evaluate: {time.perf_counter() - started:.1f}s")
    evaluated = open_artifact(str(ev), "evaluate").summary["eval_loss"]
    history = {e["step"]: e["eval_loss"] for e in summary["eval_history"]}
    assert sorted(history) == [EDIT_STEPS // 2, EDIT_STEPS]
    for step, loss in history.items():  # evaluate scores as periodic eval did
        assert evaluated[str(step)] == pytest.approx(loss, rel=1e-5)

    row = next(iter(_rows_by_image(pairs).values()))
    line = {"id": "edit", "prompt": row["text"], "image": row["source_image"], "seed": 1}
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps(line) + "\n")
    render = tmp_path / "render"
    generate = [
        "generate",
        str(REPO / "configs/stages/generate.yml"),
        f"pretrained_model_name_or_path={out}",
        f"model.base_pipeline={klein_dir}",
        f"prompt_file={prompts}",
        f"output_dir={render}",
        f"height={EDIT_SIZE}",
        f"width={EDIT_SIZE}",
        "num_inference_steps=2",
        f"sampling.max_sequence_length={LENGTH}",
        "save_arrays=true",
        "-q",
    ]
    started = time.perf_counter()
    assert cli.main(generate) == 0
    print(f"generate: {time.perf_counter() - started:.1f}s")
    rendered = open_artifact(str(render), "generate")
    assert rendered.summary["model"]["source"] == "train_artifact"
    image = np.load(render / "outputs" / "edit.npy")
    expected = _library_edit(klein_dir, out / "transformer", line)
    print(f"the trained edit render vs the library, max abs: {_worst(image, expected):.2e}")
    np.testing.assert_allclose(image, expected, atol=1e-4, rtol=0)
    untrained = _library_edit(klein_dir, klein_dir / "transformer", line)
    assert _worst(image, untrained) > 1e-3  # the trained transformer rendered


def _library_edit(klein_dir: Path, transformer: Path, line: dict) -> np.ndarray:
    """The prompt line's render [1, H, W, 3] through the Pipeline API with ``transformer``'s
    weights in the pipeline, from its seed's latents, at generate.yml's guidance_scale 5."""
    import PIL.Image

    from jaxcore import families
    from jaxcore.compute import ComputeConfig
    from jaxcore.sampling import initial_latents

    denoiser = families.get("flux2").load_denoiser(transformer, ComputeConfig())
    pipe = families.load_pipeline(klein_dir, denoiser=denoiser)
    size = (EDIT_SIZE, EDIT_SIZE, 1)
    latents = initial_latents(line["seed"], pipe.latent_shape(*size))[None]
    images = [(PIL.Image.open(line["image"]).convert("RGB"), None)]
    guidance = pipe.guidance(5.0)
    cond, uncond, scales = pipe.conditioning(
        [line["prompt"]], [""], [guidance], LENGTH, images=images, size=size
    )
    z = pipe.sample(latents, cond, uncond, num_inference_steps=2, cfg_scale=scales)
    return np.asarray(pipe.decode(z))[0]


@pytest.mark.slow  # ~3 runs of a subprocess; the loop is shared (test_train.py resumes others)
def test_kill_9_on_edit_pairs_then_resume_equals_an_uninterrupted_run(
    klein_dir, edit_data, tmp_path
):
    """A run on edit-pair records SIGKILLed after its step-4 checkpoint, rerun, logs exactly
    the losses of an uninterrupted run."""
    import os
    import signal
    import subprocess
    import sys

    from tests.support import train_steps

    def command(out):
        extra = (f"model.pretrained_model_name_or_path={klein_dir}", "eval_every=0")
        args = train_steps.train_args(edit_data, "null", out, RESUME_STEPS, *extra)
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
    a, b = _losses(straight), _losses(killed)
    assert sorted(a) == sorted(b) == list(range(1, RESUME_STEPS + 1))
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-6, abs=1e-7), step


def test_an_edit_pair_loss_is_diffusers_transformer_on_noise_and_clean_reference(klein_dir):
    """The training loss of an edit pair (stages.common.objective, as train and evaluate run
    it) equals one computed with diffusers' Flux2Transformer2DModel as Flux2KleinPipeline
    calls it: the noised target's tokens then the *clean* reference's (ids t = 10), the MSE
    over the noise tokens' outputs only (1e-5 relative); another reference changes it."""
    import jax.numpy as jnp
    import torch
    from diffusers import Flux2KleinPipeline, Flux2Transformer2DModel

    from jaxcore import families
    from jaxcore.compute import ComputeConfig
    from stages.common import objective

    family = families.get("flux2")
    module, params = family.load_denoiser(klein_dir / "transformer", ComputeConfig())
    rng = np.random.default_rng(0)
    latents = rng.standard_normal((2, 24, 4, 6), np.float32)
    reference = rng.standard_normal((2, 24, 3, 5), np.float32)
    text = rng.standard_normal((2, 8, 96), np.float32)
    noise = rng.standard_normal(latents.shape, np.float32)
    t = np.asarray([0.3, 0.8], np.float32)

    def ours(ref):
        conditioning = {"encoder_hidden_states": jnp.asarray(text), "reference_0": ref}
        args = (jnp.asarray(latents), conditioning, jnp.asarray(t), jnp.asarray(noise))
        return np.asarray(objective.loss_at(family, module, params, *args))

    pipe = Flux2KleinPipeline
    transformer = Flux2Transformer2DModel.from_pretrained(klein_dir / "transformer").eval()
    x0, eps, ref = (torch.from_numpy(a) for a in (latents, noise, reference))
    sigma = torch.from_numpy((1 - t) * objective.SIGMA_MIN + t).view(-1, 1, 1, 1)
    x_t = (1 - sigma) * x0 + sigma * eps
    ids = [pipe._prepare_image_ids([ref[i : i + 1]]) for i in range(2)]
    with torch.no_grad():
        out = transformer(
            hidden_states=torch.cat([pipe._pack_latents(x_t), pipe._pack_latents(ref)], dim=1),
            encoder_hidden_states=torch.from_numpy(text),
            timestep=torch.from_numpy(t),
            img_ids=torch.cat([pipe._prepare_latent_ids(x_t), torch.cat(ids)], dim=1),
            txt_ids=pipe._prepare_text_ids(torch.from_numpy(text)),
        ).sample
    noise_tokens = out[:, : 4 * 6]
    theirs = ((noise_tokens - pipe._pack_latents(eps - x0)) ** 2).mean(dim=(1, 2)).numpy()
    got = ours(jnp.asarray(reference))
    relative = float(np.max(np.abs(got - theirs) / np.abs(theirs)))
    print(f"edit-pair loss vs diffusers: ours {got}, theirs {theirs}, max relative {relative:.2e}")
    assert relative < 1e-5
    other = ours(jnp.asarray(rng.standard_normal(reference.shape, np.float32)))
    assert np.abs(other - got).max() > 1e-3  # the reference is in context


def test_records_with_reference_features_the_model_cannot_take_are_named(klein_dir):
    from jaxcore import families
    from jaxcore.families import TensorSpec

    family = families.get("flux2")
    config = family.component_configs(klein_dir)["transformer"]
    base = {
        "latents": TensorSpec("latents", (24, 4, 4)),
        "encoder_hidden_states": TensorSpec("encoder_hidden_states", (8, 96)),
    }
    family.check_features(
        config, {**base, "reference_0": TensorSpec("reference_0", (24, 3, 5))}, "ok"
    )
    bad = {**base, "reference_0": TensorSpec("reference_0", (6, 8, 8))}
    with pytest.raises(families.FamilyError, match=r"'reference_0' has shape \[6, 8, 8\]"):
        family.check_features(config, bad, "data")
    gap = {**base, "reference_1": TensorSpec("reference_1", (24, 4, 4))}
    with pytest.raises(families.FamilyError, match=r"must be named \['reference_0'\]"):
        family.check_features(config, gap, "data")


def test_prepare_item_carries_the_reference_and_drops_a_row_whose_reference_is_bad(pairs):
    """ReadRows hands PrepareItem the row's extra images by item key; the reference is
    resized / centre-cropped as the row's image, and a missing one drops the row naming it."""
    import apache_beam as beam

    from stages.convert import media
    from stages.convert.config import DatasetConfig, MediaConfig
    from stages.convert.pipeline import DROPPED_TAG, PrepareItem

    config = DatasetConfig(source=str(pairs), reference_image_column="source_image")
    assert config.image_columns == {"reference": "source_image"}
    row = _rows_by_image(pairs)["target_0.png"]
    dofn = PrepareItem(MediaConfig(height=32, width=48))
    target = str(pairs / row["file_name"])
    good = ("a", target, row["text"], {"reference": row["source_image"]})
    missing = ("b", target, row["text"], {"reference": str(pairs / "gone.png")})
    item, dropped = (out for r in (good, missing) for out in dofn.process(r))
    expected = media.prepare_conditioning_image(row["source_image"], height=32, width=48)
    assert item["reference"].shape == (32, 48, 3)
    np.testing.assert_array_equal(item["reference"], expected)
    assert isinstance(dropped, beam.pvalue.TaggedOutput) and dropped.tag == DROPPED_TAG
    assert dropped.value["reason"] == media.MISSING_MEDIA
    assert dropped.value["detail"].startswith("reference image: ")
