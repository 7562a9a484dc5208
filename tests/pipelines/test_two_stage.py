"""The shipped two-stage training pipeline, end to end at tiny size, through the CLI."""

import json
from pathlib import Path

import pytest

from jaxcore import artifacts
from pipelines import cli

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # ~75 s; each stage has its own default end-to-end test and test_runner covers the chaining
def test_two_stage_chain(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    root = tmp_path / "run"
    assert cli.main(["run", "configs/pipelines/two_stage.yml", f"root={root}", "-q"]) == 0

    train_high = artifacts.open_artifact(str(root / "train_high"), "train")
    # initialised from the checkpoint evaluation named best in the first stage
    assert train_high.inputs["init_from_evaluation"]["uri"] == str(root / "eval_low")
    assert train_high.inputs["data"]["uri"] == str(root / "data_high")
    eval_low = artifacts.open_artifact(str(root / "eval_low"), "evaluate")
    assert train_high.summary["model_source"]["step"] == eval_low.summary["best_checkpoint_step"]
    # the second stage trains at the higher resolution
    data_low = artifacts.open_artifact(str(root / "data_low"), "convert")
    data_high = artifacts.open_artifact(str(root / "data_high"), "convert")
    low = data_low.summary["features"]["latents"]["shape"]
    high = data_high.summary["features"]["latents"]["shape"]
    assert high[2] == 2 * low[2]

    render = artifacts.open_artifact(str(root / "render"), "generate")
    assert render.inputs["evaluation"]["uri"] == str(root / "eval_high")
    pngs = render.file_paths("outputs/", ".png")
    assert len(pngs) == 4
    chain = artifacts.open_artifact(str(root / "pipeline"), "pipeline")
    names = [step["name"] for step in chain.summary["steps"]]
    assert names == [
        "data_low", "data_high", "train_low", "eval_low", "train_high", "eval_high", "render"
    ]  # fmt: skip

    # a rerun finds every artifact finished and changes nothing
    before = {p: (root / p / "manifest.json").read_bytes() for p in names}
    capsys.readouterr()
    assert cli.main(["run", "configs/pipelines/two_stage.yml", f"root={root}", "-q"]) == 0
    after = {p: (root / p / "manifest.json").read_bytes() for p in names}
    assert before == after
    assert json.loads(after["render"])["key"] == render.key
