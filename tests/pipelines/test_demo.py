"""The CPU demo end to end: the generated images must show the colours the prompts ask for."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_demo_pipeline_passes_its_colour_check(tmp_path):
    # The demo as `make demo` runs it: its own process, with the command's XLA settings and
    # matmul precision. In this process the suite's -O0 and "highest" precision (conftest.py)
    # would make its 2,300 training steps take over an hour instead of ~8 minutes.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "DIFFORGE_"))}
    env["JAX_PLATFORMS"] = "cpu"
    root = tmp_path / "demo"
    command = [sys.executable, "-m", "pipelines.cli", "demo", f"root={root}", "-q"]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads((root / "demo_check.json").read_text())
    assert report["passed"] and report["pass_fraction"] >= 0.8
    assert len(report["checks"]) >= 16
    assert (root / "render/index.html").exists() and (root / "render/contact_sheet.png").exists()
    assert (root / "train/loss_curve.png").exists()


def test_demo_config_validates():
    from jaxcore.config import ConfigError, load_config
    from pipelines.demo.run import DemoConfig

    assert load_config(DemoConfig, None, ["root=/tmp/x"]).min_pass_fraction == 0.8
    with pytest.raises(ConfigError, match="min_pass_fraction must be in"):
        load_config(DemoConfig, None, ["min_pass_fraction=2"])


def test_chain_is_rebuilt_when_its_assets_change(tmp_path):
    from jaxcore import artifacts
    from pipelines.demo.run import CHAIN_ASSETS_MARKER, chain_is_stale

    root = str(tmp_path)
    assert not chain_is_stale(root, "aaa")  # a fresh root: nothing to rebuild
    # A chain that ran before the marker existed: its assets are unknown.
    writer = artifacts.ArtifactWriter(str(tmp_path / "pipeline"), "pipeline", {"steps": 0})
    writer.commit({"steps": []})
    assert chain_is_stale(root, "aaa")
    (tmp_path / CHAIN_ASSETS_MARKER).write_text("aaa")
    assert not chain_is_stale(root, "aaa")
    assert chain_is_stale(root, "bbb")


def test_clear_chain_deletes_only_the_steps_under_the_root(tmp_path):
    from jaxcore.config import load_config
    from pipelines.config import PipelineConfig
    from pipelines.demo.run import clear_chain

    root = tmp_path / "demo"
    made = [root / name / "work.txt" for name in ("data", "train", "evaluate", "render")]
    kept = [root / "assets" / "shapes" / "metadata.jsonl", tmp_path / "elsewhere.txt"]
    for path in [*made, *kept, root / "pipeline" / "manifest.json"]:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("x")
    demo_yml = Path(__file__).resolve().parents[2] / "configs/pipelines/demo.yml"
    pipeline = load_config(PipelineConfig, demo_yml, [f"root={root}"])
    clear_chain(pipeline)
    assert not [p for p in made if p.parent.exists()]
    assert not (root / "pipeline").exists()
    assert all(p.exists() for p in kept)
