"""The difforge command: help, dry runs, one-line user errors without tracebacks."""

import subprocess
import sys
from pathlib import Path

import pytest

from pipelines import cli

REPO = Path(__file__).resolve().parents[2]


def difforge(*args, cwd=REPO):
    return subprocess.run(
        [sys.executable, "-m", "pipelines.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_help_lists_stages():
    out = difforge("--help")
    assert out.returncode == 0
    for stage in ("convert", "train", "evaluate", "generate", "run"):
        assert stage in out.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["train", "configs/stages/train.yml", "no_such_key=1"], "unknown key no_such_key"),
        (
            ["train", "configs/stages/nope.yml"],
            "config file configs/stages/nope.yml does not exist",
        ),
    ],
)
def test_user_errors_are_one_line(args, message):
    out = difforge(*args)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("difforge ")]
    assert len(lines) == 1 and message in lines[0], out.stderr


def test_malformed_yaml_and_wrong_type(tmp_path, capsys):
    bad = tmp_path / "bad.yml"
    bad.write_text("output_dir: [\n")
    assert cli.main(["train", str(bad)]) == 2
    assert "malformed YAML" in capsys.readouterr().err
    assert cli.main(["train", "configs/stages/train.yml", "seed=abc"]) == 2
    assert "seed: expected an integer, got 'abc'" in capsys.readouterr().err


def test_dry_run_prints_resolved_config(capsys):
    assert cli.main(["train", "configs/stages/train.yml", "seed=7", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "seed: 7" in out


def test_overrides_may_follow_flags(capsys):
    """`difforge train cfg.yml -q key=value` works as `... key=value -q` does."""
    argv = ["train", "configs/stages/train.yml", "learning_rate=2e-4", "--dry-run"]
    assert cli.main([*argv, "max_train_steps=7", "seed=3"]) == 0
    printed = capsys.readouterr().out
    assert (
        "max_train_steps: 7" in printed
        and "seed: 3" in printed
        and "learning_rate: 0.0002" in printed
    )
    with pytest.raises(SystemExit):
        cli.main([*argv, "--no-such-flag"])


@pytest.mark.parametrize(
    ("jaxlib_version", "accelerator", "warned"),
    [("0.12.1", False, True), ("0.12.1", True, False), ("0.12.0.1", False, False)],
)
def test_a_jaxlib_with_slow_cpu_products_is_named_once(
    monkeypatch, caplog, jaxlib_version, accelerator, warned
):
    import jaxlib

    from jaxcore import host_memory

    monkeypatch.setattr(jaxlib, "__version__", jaxlib_version)
    monkeypatch.setattr(host_memory, "accelerator_present", lambda: accelerator)
    with caplog.at_level("WARNING", logger="difforge"):
        cli.warn_about_slow_cpu_jaxlib()
    lines = [r.getMessage() for r in caplog.records if r.name == "difforge"]
    assert len(lines) == int(warned)
    if warned:
        assert (
            "jaxlib 0.12.1" in lines[0] and "pip install jax==0.12.0.1 jaxlib==0.12.0.1" in lines[0]
        )
