"""Deployment generators: xpk command, Dataflow command, Argo CronWorkflow DAG with JobSets."""

import shlex
import shutil
from pathlib import Path

import pytest
import yaml

from jaxcore.config import ConfigError, load_config
from pipelines import deploy
from pipelines.config import PipelineConfig, load_pipeline_spec

REPO = Path(__file__).resolve().parents[2]

PIPELINE = """
name: nightly
root: gs://bucket/runs/nightly
schedule: {cron: "0 2 * * *", timezone: Europe/Paris}
steps:
  - {name: data, stage: convert, config: configs/stages/convert.yml}
  - name: train_low
    stage: train
    config: configs/stages/train.yml
    set: {max_train_steps: 5}
    inputs: {data: data}
  - {name: eval_low, stage: evaluate, config: configs/stages/evaluate.yml,
     inputs: {checkpoints: train_low, data: data}}
"""


@pytest.fixture
def pipeline_file(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    path = tmp_path / "nightly.yml"
    path.write_text(PIPELINE)
    return str(path)


def _cfg(pipeline_file, tmp_path, **kw):
    # the TPU fit check has its own tests (tests/foundation/test_aot.py); off here, or each
    # test would compile the step for a TPU slice wherever libtpu is installed
    overrides = [
        f"pipeline={pipeline_file}",
        f"out={tmp_path / 'deploy'}",
        "run_xpk_dry_run=false",
        "fit_check=off",
    ]
    overrides += [f"{k}={v}" for k, v in kw.items()]
    return load_config(deploy.DeployConfig, "configs/deploy/cluster.yml", overrides)


def test_stage_argv_is_explicit(pipeline_file):
    pipeline = load_config(PipelineConfig, pipeline_file)
    steps = load_pipeline_spec(pipeline)
    argv = deploy.stage_argv(pipeline, steps[1])
    assert argv[:3] == ["difforge", "train", "configs/stages/train.yml"]
    assert "data=gs://bucket/runs/nightly/data" in argv
    assert "output_dir=gs://bucket/runs/nightly/train_low" in argv
    assert "max_train_steps=5" in argv


def test_xpk_command(pipeline_file, tmp_path):
    cfg = _cfg(pipeline_file, tmp_path, target="xpk", step="train_low", **{"xpk.num_slices": 2})
    pipeline = deploy._pipeline(cfg)
    step = deploy._find_step(load_pipeline_spec(pipeline), "train_low")
    argv = deploy.xpk_command(cfg, pipeline, step)
    assert argv[:3] == ["xpk", "workload", "create"]
    assert argv[argv.index("--tpu-type") + 1] == "v5p-8"
    assert argv[argv.index("--num-slices") + 1] == "2"
    inner = shlex.split(argv[argv.index("--command") + 1])
    assert (
        inner[:2] == ["difforge", "train"]
        and "output_dir=gs://my-bucket/difforge/two_stage/train_low" in inner
    )


def test_argo_dag_and_schedule(pipeline_file, tmp_path):
    cfg = _cfg(pipeline_file, tmp_path, target="argo", root="gs://bucket/runs/nightly")
    deploy.run(cfg)
    doc = yaml.safe_load((tmp_path / "deploy" / "nightly-cronworkflow.yaml").read_text())
    assert doc["kind"] == "CronWorkflow"
    assert doc["spec"]["schedule"] == "0 2 * * *" and doc["spec"]["timezone"] == "Europe/Paris"
    templates = {t["name"]: t for t in doc["spec"]["workflowSpec"]["templates"]}
    tasks = {t["name"]: t for t in templates["chain"]["dag"]["tasks"]}
    assert set(tasks) == {"data", "train-low", "eval-low"}
    assert "dependencies" not in tasks["data"]
    assert tasks["train-low"]["dependencies"] == ["data"]
    assert tasks["eval-low"]["dependencies"] == ["data", "train-low"]
    # convert runs on Dataflow
    data_cmd = templates["data"]["container"]["command"]
    assert data_cmd[:2] == ["difforge", "convert"] and "runner=DataflowRunner" in data_cmd
    # each run writes its own artifacts; convert is incremental against the LATEST pointer
    run = "gs://bucket/runs/nightly/data/{{workflow.name}}"
    assert f"output_dir={run}" in data_cmd
    pointer = "gs://bucket/runs/nightly/data/LATEST"
    assert f"base={pointer}" in data_cmd and f"latest={pointer}" in data_cmd
    # train is a JobSet whose terminal state the task waits for
    resource = templates["train-low"]["resource"]
    assert resource["successCondition"] == "status.terminalState == Completed"
    jobset = yaml.safe_load(resource["manifest"])
    assert jobset["kind"] == "JobSet"
    pod = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert pod["nodeSelector"]["cloud.google.com/gke-tpu-topology"] == "2x2x1"
    train_cmd = pod["containers"][0]["command"]
    assert train_cmd[:2] == ["difforge", "train"] and f"data={run}" in train_cmd
    assert "output_dir=gs://bucket/runs/nightly/train_low/{{workflow.name}}" in train_cmd
    # preemption (exit 75 or an eviction) restarts the JobSet without using up max_restarts
    job = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]
    rules = job["podFailurePolicy"]["rules"]
    assert rules[0]["onExitCodes"] == {
        "containerName": "difforge",
        "operator": "In",
        "values": [75],
    }
    assert rules[1]["onPodConditions"][0]["type"] == "DisruptionTarget"
    assert all(rule["action"] == "FailJob" for rule in rules)
    (restart,) = jobset["spec"]["failurePolicy"]["rules"]
    assert restart["action"] == "RestartJobSetAndIgnoreMaxRestarts"
    assert restart["onJobFailureReasons"] == ["PodFailurePolicy"]
    # container steps are retried when they exit 75, only then
    retry = templates["data"]["retryStrategy"]
    assert retry["expression"] == "asInt(lastRetry.exitCode) == 75" and retry["limit"] >= 1


def test_dataflow_only_for_convert(pipeline_file, tmp_path):
    cfg = _cfg(pipeline_file, tmp_path, target="dataflow", step="train_low")
    with pytest.raises(ConfigError, match="Dataflow runs convert"):
        deploy.run(cfg)
    with pytest.raises(ConfigError, match="step 'nope' is not in the pipeline"):
        deploy.run(_cfg(pipeline_file, tmp_path, target="xpk", step="nope"))


@pytest.mark.slow
def test_xpk_dry_run_writes_jobset(pipeline_file, tmp_path):
    """xpk itself, offline (--dry-run): the JobSet it would apply runs our command."""
    if not (REPO / ".venv-xpk/bin/xpk").exists() and not shutil.which("xpk"):
        import subprocess

        subprocess.run(["make", "xpk-venv"], cwd=REPO, check=True, timeout=900)
    cfg = _cfg(pipeline_file, tmp_path, target="xpk", step="train_low", run_xpk_dry_run="true")
    deploy.run(cfg)
    docs = list(yaml.safe_load_all((tmp_path / "deploy" / "train_low-jobset.yaml").read_text()))
    jobset = next(d for d in docs if d and d.get("kind") == "JobSet")
    pod = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert pod["nodeSelector"]["cloud.google.com/gke-tpu-accelerator"] == "tpu-v5p-slice"
    command = " ".join(
        pod["containers"][0].get("command", []) + pod["containers"][0].get("args", [])
    )
    assert "difforge train" in command
