"""The local chain runner: order, skipping finished steps, --from, --force, failures.

Uses two small test stages registered in place of the real ones, so the runner's own logic is
tested in milliseconds; the real stages are chained by the demo and two-stage pipeline tests.
"""

import dataclasses

import pytest

from jaxcore import artifacts, storage
from jaxcore.config import ConfigError, load_config
from pipelines import registry, runner
from pipelines.config import PipelineConfig

CALLS: list[str] = []


@dataclasses.dataclass(frozen=True)
class MakeConfig:
    output_dir: str
    text: str = "hello"
    fail: bool = False


@dataclasses.dataclass(frozen=True)
class UseConfig:
    output_dir: str
    source: str = ""
    suffix: str = "!"


def run_make(cfg: MakeConfig, *, force=False):
    writer = artifacts.ArtifactWriter(cfg.output_dir, "convert", cfg)
    if (found := writer.existing(force)) is not None:
        return found
    CALLS.append(f"make:{cfg.text}")
    storage.write_text(writer.file("data.txt"), cfg.text)
    if cfg.fail:
        raise RuntimeError("boom")
    return writer.commit({"chars": len(cfg.text)})


def run_use(cfg: UseConfig, *, force=False):
    source = artifacts.open_artifact(cfg.source, "convert")
    writer = artifacts.ArtifactWriter(cfg.output_dir, "train", cfg, {"source": source})
    if (found := writer.existing(force)) is not None:
        return found
    CALLS.append("use")
    text = storage.read_text(source.path("data.txt")) + cfg.suffix
    storage.write_text(writer.file("out.txt"), text)
    return writer.commit()


@pytest.fixture(autouse=True)
def fake_stages(monkeypatch):
    here = __name__
    monkeypatch.setitem(
        registry.STAGES,
        "convert",
        registry.StageEntry(f"{here}:MakeConfig", f"{here}:run_make", ""),
    )
    monkeypatch.setitem(
        registry.STAGES, "train", registry.StageEntry(f"{here}:UseConfig", f"{here}:run_use", "")
    )
    CALLS.clear()


def pipeline(tmp_path, **make_set):
    text = f"""
name: chain
root: {tmp_path / "root"}
steps:
  - name: make
    stage: convert
    set: {dict(make_set) or {}}
  - name: use
    stage: train
    set: {{suffix: "?"}}
    inputs: {{source: make}}
"""
    path = tmp_path / "chain.yml"
    path.write_text(text)
    return load_config(PipelineConfig, path)


def test_chain_runs_in_order_and_records_itself(tmp_path):
    manifest = runner.run(pipeline(tmp_path))
    assert CALLS == ["make:hello", "use"]
    assert storage.read_text(str(tmp_path / "root/use/out.txt")) == "hello?"
    assert manifest.stage == "pipeline"
    assert set(manifest.inputs) == {"make", "use"}
    assert [s["name"] for s in manifest.summary["steps"]] == ["make", "use"]
    assert manifest.summary["steps"][1]["uri"].endswith("root/use")


def test_rerun_skips_finished_steps_and_config_change_reruns_downstream(tmp_path):
    runner.run(pipeline(tmp_path))
    CALLS.clear()
    runner.run(pipeline(tmp_path))
    assert CALLS == []
    # a changed upstream config rebuilds both (the downstream key follows its input's manifest)
    with pytest.raises(artifacts.ArtifactError, match="--force"):
        runner.run(pipeline(tmp_path, text="other"))
    runner.run(pipeline(tmp_path, text="other"), force=True)
    assert CALLS == ["make:other", "use"]
    assert storage.read_text(str(tmp_path / "root/use/out.txt")) == "other?"


def test_failed_step_stops_chain_and_rerun_continues(tmp_path):
    with pytest.raises(RuntimeError, match="boom"):
        runner.run(pipeline(tmp_path, fail=True))
    assert CALLS == ["make:hello"]
    assert artifacts.read_manifest(str(tmp_path / "root/make")) is None  # no half artifact
    assert not (tmp_path / "root/use").exists()
    CALLS.clear()
    runner.run(pipeline(tmp_path, fail=False))
    assert CALLS == ["make:hello", "use"]


def test_from_step(tmp_path):
    with pytest.raises(artifacts.ArtifactError, match="no manifest.json"):
        runner.run(pipeline(tmp_path), from_stage="use")  # earlier step never ran
    runner.run(pipeline(tmp_path))
    CALLS.clear()
    runner.run(pipeline(tmp_path), from_stage="use", force=True)
    assert CALLS == ["use"]
    with pytest.raises(ConfigError, match="--from 'nope' names no step"):
        runner.run(pipeline(tmp_path), from_stage="nope")


def test_bad_pipeline_files(tmp_path):
    bad = tmp_path / "bad.yml"
    bad.write_text(
        f"name: x\nroot: {tmp_path}\nsteps:\n  - {{name: a, stage: train, inputs: {{source: b}}}}\n"
    )
    with pytest.raises(ConfigError, match="input source='b' names no earlier step"):
        load_config(PipelineConfig, bad)
    bad.write_text(
        f"name: x\nroot: {tmp_path}\nsteps:\n  - {{name: a, stage: convert, set: {{txt: 1}}}}\n"
    )
    with pytest.raises(ConfigError, match=r"step 'a': unknown key txt \(did you mean 'text'\?\)"):
        runner.run(load_config(PipelineConfig, bad))
    bad.write_text(f"name: x\nroot: {tmp_path}\nsteps:\n  - {{name: a, stage: cook}}\n")
    with pytest.raises(ConfigError, match="stage: 'cook' is not one of"):
        load_config(PipelineConfig, bad)
