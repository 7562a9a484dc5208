"""The shipped LoRA pipeline (full fine-tune, then a LoRA on its best checkpoint), end to end
at tiny size through the CLI (slow: ~1-2 minutes on 2 cores)."""

from pathlib import Path

import pytest

from jaxcore import artifacts
from pipelines import cli

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_lora_chain(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    root = tmp_path / "run"
    assert cli.main(["run", "configs/pipelines/lora.yml", f"root={root}", "-q"]) == 0
    lora = artifacts.open_artifact(str(root / "lora"), "train")
    assert lora.summary["lora"]["rank"] == 4
    assert lora.summary["model_source"]["source"] == "train_artifact"
    evaluated = artifacts.open_artifact(str(root / "evaluate"), "evaluate")
    assert lora.summary["model_source"]["step"] == evaluated.summary["best_checkpoint_step"]
    assert (root / "lora" / "lora" / "pytorch_lora_weights.safetensors").is_file()
    render = artifacts.open_artifact(str(root / "render"), "generate")
    assert render.inputs["evaluation"]["uri"] == str(root / "evaluate_lora")
    assert len(render.file_paths("outputs/", ".png")) == 4
