"""Deployment at scale: the same stages as xpk/JobSet workloads, Dataflow jobs and an Argo
CronWorkflow, generated from a pipeline file.

    difforge deploy configs/deploy/cluster.yml target=xpk pipeline=configs/pipelines/two_stage.yml step=train_low
    difforge deploy configs/deploy/cluster.yml target=argo pipeline=configs/pipelines/two_stage.yml

Nothing here talks to a cloud: it writes the commands and manifests (``out``) that an operator
or a scheduler applies. ``xpk`` is run with ``--dry-run`` when it is installed, which writes
the JobSet manifest it would apply.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Literal

import yaml

from jaxcore import storage
from jaxcore.config import ConfigError, load_config
from pipelines.config import (
    PipelineConfig,
    ResolvedStep,
    load_pipeline_spec,
)
from stages.common.preemption import EXIT_PREEMPTED

log = logging.getLogger(__name__)

# TPU slice type -> (GKE accelerator label, topology, hosts per slice, chips per host).
TPU_SLICES = {
    "v4-8": ("tpu-v4-podslice", "2x2x1", 1, 4),
    "v4-16": ("tpu-v4-podslice", "2x2x2", 2, 4),
    "v4-32": ("tpu-v4-podslice", "2x2x4", 4, 4),
    "v5p-8": ("tpu-v5p-slice", "2x2x1", 1, 4),
    "v5p-16": ("tpu-v5p-slice", "2x2x2", 2, 4),
    "v5p-32": ("tpu-v5p-slice", "2x2x4", 4, 4),
    "v5p-64": ("tpu-v5p-slice", "2x4x4", 8, 4),
    "v5litepod-8": ("tpu-v5-lite-podslice", "2x4", 1, 8),
    "v5litepod-16": ("tpu-v5-lite-podslice", "4x4", 4, 4),
    "v5litepod-32": ("tpu-v5-lite-podslice", "4x8", 8, 4),
    "v6e-8": ("tpu-v6e-slice", "2x4", 1, 8),
    "v6e-16": ("tpu-v6e-slice", "4x4", 4, 4),
    "v6e-32": ("tpu-v6e-slice", "4x8", 8, 4),
    "v6e-64": ("tpu-v6e-slice", "8x8", 16, 4),
}


@dataclasses.dataclass(frozen=True)
class XpkConfig:
    cluster: str = "my-cluster"
    project: str = "my-project"
    zone: str = "us-central2-b"
    tpu_type: str = "v5p-8"  # or a GPU device type such as h100-80gb-8
    num_slices: int = 1
    docker_image: str = "gcr.io/my-project/difforge-tpu:latest"
    workload_prefix: str = "difforge"
    max_restarts: int = 3
    priority: Literal["very-low", "low", "medium", "high", "very-high"] = "medium"


@dataclasses.dataclass(frozen=True)
class DataflowConfig:
    project: str = "my-project"
    region: str = "us-central1"
    temp_location: str = "gs://my-bucket/tmp"
    sdk_container_image: str = ""
    machine_type: str = "n1-standard-8"
    max_num_workers: int = 10


@dataclasses.dataclass(frozen=True)
class DeployConfig:
    pipeline: str
    target: Literal["xpk", "argo", "dataflow"] = "argo"
    step: str = ""  # for xpk / dataflow: which step of the pipeline
    out: str = "outputs/deploy"
    root: str = ""  # overrides the pipeline's root (e.g. gs://bucket/runs/x)
    xpk: XpkConfig = XpkConfig()
    dataflow: DataflowConfig = DataflowConfig()
    run_xpk_dry_run: bool = True


def _dns_name(*parts: str) -> str:
    name = "-".join(p for p in parts if p).lower()
    name = re.sub(r"[^a-z0-9-]+", "-", name).strip("-")
    return name[:40].rstrip("-")


def _pipeline(cfg: DeployConfig) -> PipelineConfig:
    pipeline = load_config(PipelineConfig, cfg.pipeline, [f"root={cfg.root}"] if cfg.root else [])
    return pipeline


def _find_step(steps: list[ResolvedStep], name: str) -> ResolvedStep:
    for s in steps:
        if s.step.name == name:
            return s
    raise ConfigError(
        f"step {name!r} is not in the pipeline; steps: {[s.step.name for s in steps]}"
    )


def _override(key: str, value) -> str:
    text = value if isinstance(value, str) and value.strip() == value and value else None
    if text is None or yaml.safe_load(text) != value:
        text = yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("\n...")
    return f"{key}={text}"


def stage_argv(
    pipeline: PipelineConfig, step: ResolvedStep, extra: dict | None = None
) -> list[str]:
    """The container command for one step: ``difforge <stage> <yml> key=value ...``.

    Fully explicit (base YAML + the step's ``set`` + input artifact URIs + output_dir), so a
    scheduler can run it alone; the stage refuses to start before its inputs are complete.
    """
    del pipeline  # the resolved step carries its overrides
    argv = ["difforge", step.step.stage]
    if step.step.config:
        argv.append(step.step.config)
    values = {**step.values, **(extra or {})}
    return argv + [_override(k, v) for k, v in values.items()]


def xpk_command(cfg: DeployConfig, pipeline: PipelineConfig, step: ResolvedStep) -> list[str]:
    """``xpk workload create ...`` for one train/evaluate/generate step on a TPU/GPU slice."""
    x = cfg.xpk
    command = shlex.join(stage_argv(pipeline, step))
    device_flag = "--tpu-type" if x.tpu_type in TPU_SLICES else "--device-type"
    return [
        "xpk",
        "workload",
        "create",
        "--cluster",
        x.cluster,
        "--workload",
        _dns_name(x.workload_prefix, pipeline.name, step.step.name),
        device_flag,
        x.tpu_type,
        "--num-slices",
        str(x.num_slices),
        "--docker-image",
        x.docker_image,
        "--max-restarts",
        str(x.max_restarts),
        "--priority",
        x.priority,
        "--project",
        x.project,
        "--zone",
        x.zone,
        "--command",
        command,
    ]


def run_xpk_dry_run(argv: list[str], manifest_path: Path) -> Path | None:
    """Run xpk offline with --dry-run; returns the JobSet manifest it wrote (None if no xpk)."""
    xpk = shutil.which("xpk") or shutil.which(str(Path(".venv-xpk/bin/xpk").resolve()))
    if xpk is None:
        log.warning("xpk is not installed (make xpk-venv); wrote the command only")
        return None
    full = [
        xpk,
        *argv[1:],
        "--dry-run",
        "--skip-validation",
        "--project-number",
        "1",
        "--output-manifest-file",
        str(manifest_path),
        "--no-dependency-auto-download",
    ]
    proc = subprocess.run(full, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0 or not manifest_path.exists():
        raise RuntimeError(f"xpk dry run failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return manifest_path


def dataflow_argv(cfg: DeployConfig, pipeline: PipelineConfig, step: ResolvedStep) -> list[str]:
    """``difforge convert`` on Dataflow with the options from the deploy config."""
    if step.step.stage != "convert":
        raise ConfigError(
            f"step {step.step.name!r} is a {step.step.stage} step; Dataflow runs convert"
        )
    d = cfg.dataflow
    opts = {
        "runner": "DataflowRunner",
        "beam.project": d.project,
        "beam.region": d.region,
        "beam.temp_location": d.temp_location,
        "beam.machine_type": d.machine_type,
        "beam.max_num_workers": d.max_num_workers,
    }
    if d.sdk_container_image:
        opts["beam.sdk_container_image"] = d.sdk_container_image
    return stage_argv(pipeline, step, opts)


def jobset_manifest(cfg: DeployConfig, pipeline: PipelineConfig, step: ResolvedStep) -> dict:
    """A JobSet for one step on ``num_slices`` TPU slices (what the Argo DAG creates).

    Preemption restarts the whole JobSet without using up ``max_restarts``: a pod that exits
    with ``EXIT_PREEMPTED`` (the stage kept its work after SIGTERM) or is evicted
    (``DisruptionTarget``) fails its Job by the pod failure policy, and the JobSet restarts on
    that reason; any other failure restarts it at most ``max_restarts`` times."""
    x = cfg.xpk
    if x.tpu_type not in TPU_SLICES:
        raise ConfigError(
            f"xpk.tpu_type {x.tpu_type!r} has no JobSet template here; known: {sorted(TPU_SLICES)} "
            "(for other slices use target=xpk, which lets xpk write the JobSet)"
        )
    accelerator, topology, hosts, chips_per_host = TPU_SLICES[x.tpu_type]
    name = _dns_name(x.workload_prefix, pipeline.name, step.step.name)
    container = {
        "name": "difforge",
        "image": x.docker_image,
        "command": stage_argv(pipeline, step),
        "resources": {"limits": {"google.com/tpu": chips_per_host}},
    }
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {
            "name": name,
            "labels": {"difforge/pipeline": pipeline.name, "difforge/step": step.step.name},
        },
        "spec": {
            "failurePolicy": {
                "maxRestarts": x.max_restarts,
                "rules": [
                    {
                        "name": "preempted",
                        "action": "RestartJobSetAndIgnoreMaxRestarts",
                        "onJobFailureReasons": ["PodFailurePolicy"],
                    }
                ],
            },
            "replicatedJobs": [
                {
                    "name": "slice",
                    "replicas": x.num_slices,
                    "template": {
                        "spec": {
                            "parallelism": hosts,
                            "completions": hosts,
                            "backoffLimit": 0,
                            "podFailurePolicy": {"rules": _preemption_rules(container["name"])},
                            "template": {
                                "spec": {
                                    "restartPolicy": "Never",
                                    "nodeSelector": {
                                        "cloud.google.com/gke-tpu-accelerator": accelerator,
                                        "cloud.google.com/gke-tpu-topology": topology,
                                    },
                                    "containers": [container],
                                }
                            },
                        }
                    },
                }
            ],
        },
    }


def _preemption_rules(container: str) -> list[dict]:
    """Pod failure policy rules that mark a preempted pod's failure as such (Job reason
    ``PodFailurePolicy``)."""
    return [
        {
            "action": "FailJob",
            "onExitCodes": {
                "containerName": container,
                "operator": "In",
                "values": [EXIT_PREEMPTED],
            },
        },
        {"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
    ]


# Argo fills this in per workflow run (a CronWorkflow's runs are named <name>-<timestamp>)
ARGO_RUN = "{{workflow.name}}"


def argo_cron_workflow(cfg: DeployConfig, pipeline: PipelineConfig) -> dict:
    """An Argo CronWorkflow whose DAG mirrors the pipeline: convert on Dataflow (a container
    that launches and waits for the job), train steps as JobSets (the task waits for the
    JobSet's terminal state), evaluate/generate as containers.

    Each scheduled run writes its own artifacts (``<root>/<step>/<workflow name>``) and its
    convert steps are incremental: they convert against the step's ``LATEST`` pointer (the
    last committed artifact) and move it when done, so a daily run encodes only what arrived
    since the last one (see :mod:`stages.convert.incremental`)."""
    steps = load_pipeline_spec(pipeline, run=ARGO_RUN)
    templates = []
    tasks = []
    for s in steps:
        tname = _dns_name(s.step.name)
        if s.step.stage == "train":
            jobset = jobset_manifest(cfg, pipeline, s)
            templates.append(
                {
                    "name": tname,
                    "resource": {
                        "action": "create",
                        "setOwnerReference": True,
                        "successCondition": "status.terminalState == Completed",
                        "failureCondition": "status.terminalState == Failed",
                        "manifest": yaml.safe_dump(jobset, sort_keys=False),
                    },
                }
            )
        else:
            argv = (
                dataflow_argv(cfg, pipeline, s)
                if s.step.stage == "convert"
                else stage_argv(pipeline, s)
            )
            templates.append(
                {
                    "name": tname,
                    "container": {"image": cfg.xpk.docker_image, "command": argv},
                    # a preempted stage kept its work: run it again (it resumes)
                    "retryStrategy": {
                        "limit": cfg.xpk.max_restarts,
                        "retryPolicy": "Always",
                        "expression": f"asInt(lastRetry.exitCode) == {EXIT_PREEMPTED}",
                    },
                }
            )
        task = {"name": tname, "template": tname}
        deps = sorted({_dns_name(src) for src in s.step.inputs.values()})
        if deps:
            task["dependencies"] = deps
        tasks.append(task)
    templates.insert(0, {"name": "chain", "dag": {"tasks": tasks}})
    return {
        "apiVersion": "argoproj.io/v1alpha1",
        "kind": "CronWorkflow",
        "metadata": {
            "name": _dns_name("difforge", pipeline.name),
            "namespace": pipeline.schedule.namespace,
        },
        "spec": {
            "schedule": pipeline.schedule.cron or "0 3 * * *",
            "timezone": pipeline.schedule.timezone,
            "concurrencyPolicy": "Forbid",
            "workflowSpec": {"entrypoint": "chain", "templates": templates},
        },
    }


def run(cfg: DeployConfig, *, force: bool = False):
    """Write the deployment files for ``cfg.target`` under ``cfg.out``; returns None."""
    del force
    pipeline = _pipeline(cfg)
    steps = load_pipeline_spec(pipeline)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    if cfg.target == "argo":
        path = out / f"{_dns_name(pipeline.name)}-cronworkflow.yaml"
        path.write_text(yaml.safe_dump(argo_cron_workflow(cfg, pipeline), sort_keys=False))
        print(f"wrote {path}\napply with: kubectl apply -f {path}")
        return None
    step = _find_step(steps, cfg.step or steps[0].step.name)
    if cfg.target == "dataflow":
        argv = dataflow_argv(cfg, pipeline, step)
        (out / f"{step.step.name}-dataflow.sh").write_text(shlex.join(argv) + "\n")
        print(shlex.join(argv))
        return None
    argv = xpk_command(cfg, pipeline, step)
    (out / f"{step.step.name}-xpk.sh").write_text(shlex.join(argv) + "\n")
    print(shlex.join(argv))
    if cfg.run_xpk_dry_run:
        manifest = run_xpk_dry_run(argv, out / f"{step.step.name}-jobset.yaml")
        if manifest:
            print(f"xpk --dry-run wrote {manifest}")
    return None


def storage_root_is_remote(pipeline: PipelineConfig) -> bool:
    return storage.is_gcs(pipeline.root)
