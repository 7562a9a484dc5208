"""Flux through the four stages, with nothing Flux-specific in the stages themselves.

- generate: ``difforge generate`` on a tiny diffusers-built FluxPipeline directory, with the
  unpacked initial latents ``[C, H/8, W/8]`` given per prompt line, reproduces
  ``FluxPipeline(latents=packed, output_type="np")`` within 1e-4 on [0, 1] pixels: embedded
  guidance, true CFG with a negative prompt, a non-square size (reached ~4e-6).
- convert: Flux records carry the latents and both text conditionings, equal to the family's
  encoders called directly (1e-5).
- train: dp x fsdp x tp on 8 devices equals one device (loss 1e-5, params 5e-5); the tiny
  Flux learns (loss falls to 0.23x in 160 steps; asserted < 0.5x); evaluate scores it with the same guidance input;
  a checkpoint renders through generate.
- the Flux pipeline chain (configs/pipelines/flux.yml) runs end to end on ``tiny:flux``.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxcore import sharding
from jaxcore.artifacts import open_artifact
from jaxcore.compute import ComputeConfig
from jaxcore.families import TensorSpec
from jaxcore.models.flux_transformer import pack_latents
from jaxcore.sampling import initial_latents
from pipelines import cli
from stages.common import data
from stages.train.config import ModelSection
from tests.support import train_steps
from tests.support.convert_artifacts import FLUX, TinyDataConfig, write_convert_artifact
from tests.support.tiny_flux import build_flux_pipeline

REPO = Path(__file__).resolve().parents[2]
TOLERANCE = 1e-4
# (id, prompt, negative prompt or None, guidance_scale, true_cfg_scale, width, latents seed)
CASES = [
    ("embedded", "a red circle on a white background", None, 3.5, 1.0, 16, 1),
    ("true-cfg", "a blue square", "dark background", 2.0, 3.0, 16, 2),
    ("wide", "a yellow star", None, 5.0, 1.0, 24, 3),
]


@pytest.fixture(scope="module")
def flux_dir(tmp_path_factory) -> Path:
    return build_flux_pipeline(tmp_path_factory.mktemp("flux"), seed=5)


def _latents(width: int, seed: int) -> np.ndarray:
    return initial_latents(seed, (4, 8, width // 2))


def _generate(model_path, prompt_file, out, *extra) -> int:
    return cli.main(
        [
            "generate",
            str(REPO / "configs/stages/generate.yml"),
            f"pretrained_model_name_or_path={model_path}",
            f"prompt_file={prompt_file}",
            f"output_dir={out}",
            "num_inference_steps=3",
            "max_sequence_length=32",
            "save_arrays=true",
            *extra,
            "-q",
        ]
    )


def test_generate_matches_flux_pipeline(flux_dir, tmp_path):
    import torch
    from diffusers import FluxPipeline

    lines = []
    for case_id, prompt, negative, guidance, true_cfg, width, seed in CASES:
        np.save(tmp_path / f"{case_id}.npy", _latents(width, seed))
        line = {"id": case_id, "prompt": prompt, "guidance_scale": guidance, "width": width}
        line |= {"true_cfg_scale": true_cfg, "latents": f"{case_id}.npy"}
        if negative is not None:
            line["negative_prompt"] = negative
        lines.append(json.dumps(line))
    (tmp_path / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "run"
    assert _generate(flux_dir, tmp_path / "prompts.jsonl", out) == 0
    summary = open_artifact(str(out), "generate").summary
    assert summary["model"]["family"] == "flux"

    reference = FluxPipeline.from_pretrained(flux_dir)
    for case_id, prompt, negative, guidance, true_cfg, width, seed in CASES:
        expected = reference(
            prompt=prompt,
            negative_prompt=negative,
            guidance_scale=guidance,
            true_cfg_scale=true_cfg,
            height=16,
            width=width,
            num_inference_steps=3,
            max_sequence_length=32,
            latents=torch.from_numpy(np.asarray(pack_latents(_latents(width, seed)[None]))),
            output_type="np",
        ).images[0]
        ours = np.load(out / "outputs" / f"{case_id}.npy")
        assert ours.shape == (1, 16, width, 3)
        np.testing.assert_allclose(ours[0], expected, atol=TOLERANCE, rtol=0, err_msg=case_id)


def test_generate_refuses_sizes_and_frames_flux_cannot_make(flux_dir, tmp_path, capsys):
    prompts = tmp_path / "bad.jsonl"
    prompts.write_text('{"prompt": "ok"}\n{"prompt": "video", "num_frames": 5}\n')
    assert _generate(flux_dir, prompts, tmp_path / "out") == 2
    assert "bad.jsonl line 2: num_frames must be 1" in capsys.readouterr().err
    prompts.write_text('{"prompt": "odd", "height": 18}\n')
    assert _generate(flux_dir, prompts, tmp_path / "out") == 2
    assert "height must be a positive multiple of 4" in capsys.readouterr().err


def test_convert_writes_flux_records(flux_dir, tmp_path):
    import tensorflow as tf

    from pipelines.embedded.shapes import make_items, make_shapes_dataset
    from stages.common import records
    from stages.convert.media import prepare_video

    source = make_shapes_dataset(tmp_path / "shapes", num_items=6, height=20, width=20, seed=4)
    out = tmp_path / "convert"
    args = [
        "convert",
        str(REPO / "configs/stages/convert.yml"),
        f"source={source}",
        f"output_dir={out}",
        f"pretrained_model_name_or_path={flux_dir}",
        "height=16",
        "width=16",
        "max_sequence_length=12",
        "eval_fraction=0.3",
        "-q",
    ]
    assert cli.main(args) == 0
    summary = open_artifact(str(out), "convert").summary
    assert summary["family"] == "flux"
    assert {k: v["shape"] for k, v in summary["features"].items()} == {
        "latents": [4, 8, 8],
        "encoder_hidden_states": [12, 32],
        "pooled_projections": [24],
    }
    assert summary["latents_normalization"]["formula"] == "(z - shift_factor) * scaling_factor"

    spec = data.split_spec(open_artifact(str(out), "convert"), "train")
    row = next(
        iter(
            tf.data.TFRecordDataset([str(out / s) for s in summary["splits"]["train"]["shards"]])
            .map(lambda x: records.parse_example(x, spec.shapes))
            .as_numpy_iterator()
        )
    )
    item = {i["id"]: i for i in make_items(6, 20, 20, seed=4)}[row[records.SOURCE_ID].decode()]
    from jaxcore import families

    encoders = families.get("flux").load_encoders(flux_dir, ComputeConfig(), 12, 2)
    video = prepare_video(item["image_bytes"], height=16, width=16, num_frames=1, fps=16)
    np.testing.assert_allclose(row["latents"], encoders.encode_media(video[None])[0], atol=1e-5)
    text = encoders.encode_text([item["text"]])
    for name in ("encoder_hidden_states", "pooled_projections"):
        np.testing.assert_allclose(row[name], text[name][0], atol=1e-5, err_msg=name)


FEATURES = (
    TensorSpec("latents", (4, 8, 8)),
    TensorSpec("encoder_hidden_states", (8, 32)),
    TensorSpec("pooled_projections", (24,)),
)


def _one_step(flux_dir, mesh):
    section = ModelSection(pretrained_model_name_or_path=str(flux_dir))
    return train_steps.one_step(section, mesh, FEATURES, train_steps.random_batch(FEATURES))


def test_sharded_flux_step_equals_single_device(flux_dir):
    single = sharding.make_mesh(sharding.MeshConfig(), devices=jax.devices()[:1])
    ref_params, ref_loss = _one_step(flux_dir, single)
    mesh = sharding.make_mesh(
        sharding.MeshConfig(
            ici_data_parallelism=2, ici_fsdp_parallelism=2, ici_tensor_parallelism=2
        )
    )
    params, loss = _one_step(flux_dir, mesh)
    assert loss == pytest.approx(ref_loss, abs=1e-5)
    worst = max(
        jax.tree.leaves(jax.tree.map(lambda a, b: float(np.max(np.abs(a - b))), params, ref_params))
    )
    assert worst < 5e-5, worst


@pytest.mark.slow  # ~45 s; Flux's train step stays in the default tier (sharded == single device)
def test_flux_trains_evaluates_and_renders_its_checkpoint(flux_dir, tmp_path):
    data_uri = str(tmp_path / "data")
    write_convert_artifact(data_uri, TinyDataConfig(**FLUX))
    out = tmp_path / "train"
    args = [
        "train",
        str(REPO / "configs/stages/train.yml"),
        f"data={data_uri}",
        f"output_dir={out}",
        "dataset_type=tfrecord",
        "model.model_config=null",
        f"model.pretrained_model_name_or_path={flux_dir}",
        "max_train_steps=160",
        "checkpoint_every=80",
        "eval_every=80",
        "learning_rate=3e-3",
        "per_device_batch_size=1",
        "export_diffusers=true",
        "-q",
    ]
    assert cli.main(args) == 0
    summary = open_artifact(str(out), "train").summary
    assert summary["family"] == "flux" and summary["embedded_inputs"] == {"guidance": 3.5}
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows]
    assert np.mean(losses[-10:]) < 0.5 * np.mean(losses[:10]), (losses[:10], losses[-10:])
    assert (out / "transformer" / "diffusion_pytorch_model.safetensors").is_file()

    ev = tmp_path / "evaluate"
    args = ["evaluate", str(REPO / "configs/stages/evaluate.yml"), f"checkpoints={out}"]
    assert cli.main([*args, f"data={data_uri}", f"output_dir={ev}", "-q"]) == 0
    evaluated = open_artifact(str(ev), "evaluate").summary["eval_loss"]
    history = {e["step"]: e["eval_loss"] for e in summary["eval_history"]}
    for step, loss in history.items():  # evaluate and periodic eval: same guidance input
        assert evaluated[str(step)] == pytest.approx(loss, rel=1e-5)

    prompts = tmp_path / "p.txt"
    prompts.write_text("a red circle\na blue square\n")
    render = tmp_path / "render"
    assert _generate(ev, prompts, render, f"model.base_pipeline={flux_dir}") == 0
    rendered = open_artifact(str(render), "generate")
    assert rendered.summary["model"]["source"] == "train_artifact"
    assert len(rendered.file_paths("outputs/", ".png")) == 2


@pytest.mark.slow  # the chain machinery is the Wan chain's (default tier); Flux's stages
# each run in test_flux_trains_evaluates_and_renders_its_checkpoint
def test_flux_pipeline_chain(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    root = tmp_path / "flux"
    assert cli.main(["run", "configs/pipelines/flux.yml", f"root={root}", "-q"]) == 0
    convert = open_artifact(str(root / "data"), "convert")
    assert convert.summary["family"] == "flux"
    train = open_artifact(str(root / "train"), "train")
    assert train.summary["family"] == "flux" and train.summary["checkpoints"] == [2, 4]
    render = open_artifact(str(root / "render"), "generate")
    assert render.inputs["evaluation"]["uri"] == str(root / "evaluate")
    assert len(render.file_paths("outputs/", ".png")) == 4
