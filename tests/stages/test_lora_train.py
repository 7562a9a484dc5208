"""LoRA training (Wan and Flux): adapters on a frozen base, checkpoints and exact resume,
evaluate and generate through the train artifact, and a ``lora/pytorch_lora_weights.safetensors``
that diffusers' ``load_lora_weights`` reads without a warning and renders with exactly as
difforge does (1e-4 on [0, 1] pixels).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest

from jaxcore.artifacts import open_artifact
from jaxcore.config import load_config
from jaxcore.sampling import initial_latents
from pipelines import cli
from pipelines.embedded.tiny import build_tiny_wan_pipeline
from stages.train.config import TrainConfig
from tests.support.convert_artifacts import FLUX, TinyDataConfig, write_convert_artifact
from tests.support.tiny_flux import build_flux_pipeline

REPO = Path(__file__).resolve().parents[2]
TRAIN_YML = REPO / "configs/stages/train.yml"
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def wan(tmp_path_factory):
    root = tmp_path_factory.mktemp("wan_lora")
    pipeline = build_tiny_wan_pipeline(root / "pipeline", seed=3, transformer_output_scale=20.0)
    data = str(root / "data")
    write_convert_artifact(data)
    return pipeline, data


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    root = tmp_path_factory.mktemp("flux_lora")
    data = str(root / "data")
    write_convert_artifact(data, TinyDataConfig(**FLUX))
    return build_flux_pipeline(root / "pipeline", seed=4), data


def _train_args(pipeline, data, out, *extra) -> list[str]:
    return [
        "train",
        str(TRAIN_YML),
        f"data={data}",
        f"output_dir={out}",
        "dataset_type=tfrecord",
        "model.model_config=null",
        f"model.pretrained_model_name_or_path={pipeline}",
        "lora.rank=4",
        "lora.alpha=8",
        "learning_rate=1e-2",
        "per_device_batch_size=1",
        *extra,
        "-q",
    ]


def _losses(out: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


@pytest.mark.parametrize("family", ["wan", pytest.param("flux", marks=pytest.mark.slow)])
def test_lora_trains_evaluates_and_loads_in_diffusers(family, request, tmp_path, caplog):
    pipeline, data = request.getfixturevalue(family)
    out = tmp_path / "train"
    args = _train_args(pipeline, data, out, "max_train_steps=40", "checkpoint_every=20")
    assert cli.main([*args, "eval_every=20"]) == 0
    summary = open_artifact(str(out), "train").summary
    lora = summary["lora"]
    assert lora["rank"] == 4 and lora["scale"] == 2.0 and lora["targets"]
    assert lora["file"] == "lora/pytorch_lora_weights.safetensors"
    losses = _losses(out)
    assert np.mean([losses[s] for s in range(31, 41)]) < np.mean([losses[s] for s in range(1, 11)])

    # evaluate scores base + adapters, as the periodic eval did
    ev = tmp_path / "evaluate"
    args = ["evaluate", str(REPO / "configs/stages/evaluate.yml"), f"checkpoints={out}"]
    assert cli.main([*args, f"data={data}", f"output_dir={ev}", "-q"]) == 0
    evaluated = open_artifact(str(ev), "evaluate").summary["eval_loss"]
    for entry in summary["eval_history"]:
        assert evaluated[str(entry["step"])] == pytest.approx(entry["eval_loss"], rel=1e-5)

    # diffusers loads the exported file with no warning, and it changes the render ...
    shape = (4, 1, 8, 8) if family == "wan" else (4, 8, 8)
    latents = initial_latents(21, shape)
    np.save(tmp_path / "z.npy", latents)
    line = {"id": "p", "prompt": "a red circle", "latents": "z.npy"}
    (tmp_path / "p.jsonl").write_text(json.dumps(line) + "\n")
    guidance = "guidance_scale=1" if family == "wan" else "guidance_scale=3.5"
    common = [
        "generate",
        str(REPO / "configs/stages/generate.yml"),
        f"prompt_file={tmp_path / 'p.jsonl'}",
        "height=16",
        "width=16",
        "num_frames=1",
        "num_inference_steps=3",
        "max_sequence_length=32",
        "save_arrays=true",
        guidance,
    ]
    with_file = tmp_path / "with_file"
    lora_arg = f"model.loras=[{{path: {out / 'lora'}}}]"
    model_arg = f"pretrained_model_name_or_path={pipeline}"
    assert cli.main([*common, model_arg, f"output_dir={with_file}", lora_arg, "-q"]) == 0
    ours = np.load(with_file / "outputs/p.npy")
    # ... and the train artifact itself renders the same (its last checkpoint: base + adapters)
    through = tmp_path / "through_artifact"
    artifact_args = [f"pretrained_model_name_or_path={out}", "model.checkpoint=final"]
    artifact_args.append(f"model.base_pipeline={pipeline}")
    assert cli.main([*common, *artifact_args, f"output_dir={through}", "-q"]) == 0
    np.testing.assert_allclose(np.load(through / "outputs/p.npy"), ours, atol=1e-5, rtol=0)

    expected, plain = _diffusers_renders(family, pipeline, out / "lora", latents, caplog)
    assert np.abs(expected - plain).max() > 1e-3  # the trained LoRA changes the render
    np.testing.assert_allclose(ours.reshape(expected.shape), expected, atol=TOLERANCE, rtol=0)


def _diffusers_renders(family, pipeline, lora_dir, latents, caplog):
    """(diffusers with the LoRA, diffusers without) frames [H, W, 3]; the load warns about
    nothing of the transformer (diffusers warns about keys it cannot place)."""
    import torch

    if family == "wan":
        from diffusers import WanPipeline as Cls

        inputs = {"num_frames": 1, "guidance_scale": 1.0}
        latents_in = torch.from_numpy(latents[None])
    else:
        from diffusers import FluxPipeline as Cls

        from jaxcore.models.flux_transformer import pack_latents

        inputs = {"guidance_scale": 3.5}
        latents_in = torch.from_numpy(np.asarray(pack_latents(latents[None])))
    common = dict(
        prompt="a red circle",
        height=16,
        width=16,
        num_inference_steps=3,
        max_sequence_length=32,
        output_type="np",
        **inputs,
    )
    pipe = Cls.from_pretrained(pipeline)
    plain = pipe(latents=latents_in.clone(), **common)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        pipe.load_lora_weights(str(lora_dir))
    # FluxPipeline also looks for CLIP keys and says their absence "is safe to ignore": it
    # says so for every transformer-only LoRA, diffusers' own training scripts' included.
    warnings = [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING
        and not r.getMessage().startswith("No LoRA keys associated to CLIPTextModel")
    ]
    assert not warnings, warnings
    with_lora = pipe(latents=latents_in.clone(), **common)

    def frame(out):
        return np.asarray(out.frames[0] if hasattr(out, "frames") else out.images[0])

    return frame(with_lora).reshape(16, 16, 3), frame(plain).reshape(16, 16, 3)


@pytest.mark.slow
def test_lora_resume_equals_an_uninterrupted_run(wan, tmp_path):
    """Checkpoints hold the adapters and their optimiser state: a run resumed from step 4
    logs exactly the losses of a straight run (the base is rebuilt, not saved)."""
    from stages.train import loop

    pipeline, data = wan

    def config(out, steps):
        args = _train_args(pipeline, data, out, f"max_train_steps={steps}", "checkpoint_every=2")
        overrides = [a for a in args[2:] if a != "-q"]
        return load_config(TrainConfig, TRAIN_YML, overrides)

    straight = tmp_path / "straight"
    loop.train(config(straight, 8), str(straight), open_artifact(data, "convert"))
    resumed = tmp_path / "resumed"
    loop.train(config(resumed, 4), str(resumed), open_artifact(data, "convert"))
    loop.train(config(resumed, 8), str(resumed), open_artifact(data, "convert"))
    a, b = _losses(straight), _losses(resumed)
    assert sorted(a) == sorted(b) == list(range(1, 9))
    for step in range(1, 9):
        assert b[step] == pytest.approx(a[step], rel=1e-6, abs=1e-7), step


def test_lora_config_errors_name_the_key(tmp_path):
    from jaxcore.config import ConfigError

    for override, message in (
        ("lora.rank=-1", "rank must be >= 0"),
        ("lora.alpha=0", "alpha must be > 0"),
        ("lora.target_modules=['to q']", "not a module name"),
    ):
        with pytest.raises(ConfigError, match=message):
            load_config(TrainConfig, TRAIN_YML, [f"output_dir={tmp_path}", override])
