"""The CPU demo end to end: the generated images must show the colours the prompts ask for."""

import json
from pathlib import Path

import pytest

from pipelines import cli

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_demo_pipeline_passes_its_colour_check(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    root = tmp_path / "demo"
    assert cli.main(["demo", f"root={root}", "-q"]) == 0
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
