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
    "v6e-4": ("tpu-v6e-slice", "2x2", 1, 4),
    "v6e-8": ("tpu-v6e-slice", "2x4", 1, 8),
    "v6e-16": ("tpu-v6e-slice", "4x4", 4, 4),
    "v6e-32": ("tpu-v6e-slice", "4x8", 8, 4),
    "v6e-64": ("tpu-v6e-slice", "8x8", 16, 4),
    # TPU7x (Ironwood): named by TensorCores as v5p is, two a chip (tpu7x-8: 4 chips, 1 host)
    "tpu7x-8": ("tpu7x", "2x2x1", 1, 4),
    "tpu7x-16": ("tpu7x", "2x2x2", 2, 4),
    "tpu7x-32": ("tpu7x", "2x2x4", 4, 4),
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
    """``fit_check``: before a train or generate step goes to a TPU slice (an xpk workload, an
    Argo JobSet), compile it ahead of time for that slice (:mod:`jaxcore.aot`) and refuse it
    when it cannot fit the chips' HBM: ``auto`` when libtpu is installed (else it says it
    skipped), ``required`` (no libtpu or no known model is an error), ``off``.
    ``fit_check_model``: the model YAML (or local pipeline directory) to check with when the
    step's model is known only at run time (a train artifact, ``gs://``, a hub id).
    ``fit_check_headroom``: the share of HBM a step may not use."""

    pipeline: str
    target: Literal["xpk", "argo", "dataflow"] = "argo"
    step: str = ""  # for xpk / dataflow: which step of the pipeline
    out: str = "outputs/deploy"
    root: str = ""  # overrides the pipeline's root (e.g. gs://bucket/runs/x)
    xpk: XpkConfig = XpkConfig()
    dataflow: DataflowConfig = DataflowConfig()
    run_xpk_dry_run: bool = True
    # YAML reads a bare `off` as false: both mean "off"
    fit_check: Literal["auto", "required", "off", False] = "auto"
    fit_check_model: str = ""
    fit_check_headroom: float = 0.05  # jaxcore.aot.DEFAULT_HEADROOM

    def __post_init__(self):
        if self.fit_check is False:
            object.__setattr__(self, "fit_check", "off")
        if self.fit_check not in ("auto", "required", "off"):
            raise ValueError(f"fit_check must be auto, required or off, got {self.fit_check!r}")
        if not 0.0 <= self.fit_check_headroom < 1.0:
            raise ValueError(f"fit_check_headroom must be in [0, 1), got {self.fit_check_headroom}")


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
        for s in steps:  # the train steps become JobSets on the slice
            if s.step.stage == "train":
                fit_check(cfg, steps, s, out)
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
    fit_check(cfg, steps, step, out)
    argv = xpk_command(cfg, pipeline, step)
    (out / f"{step.step.name}-xpk.sh").write_text(shlex.join(argv) + "\n")
    print(shlex.join(argv))
    if cfg.run_xpk_dry_run:
        manifest = run_xpk_dry_run(argv, out / f"{step.step.name}-jobset.yaml")
        if manifest:
            print(f"xpk --dry-run wrote {manifest}")
    return None


# --- the fit check: does the step fit the slice? (compiled ahead of time, no TPU needed) -------


class FitCheckError(ConfigError):
    """A step that does not fit its slice, or could not be checked with fit_check=required."""


@dataclasses.dataclass(frozen=True)
class FitModel:
    """A model known without its weights: family, component configs, scheduler config."""

    family: object
    configs: dict
    scheduler_config: dict
    source: str


def fit_model(path: str) -> FitModel:
    """The model of a model YAML, a local diffusers pipeline directory or ``tiny[:family]``."""
    from jaxcore import families
    from jaxcore.families.base import read_scheduler_config
    from jaxcore.model_configs import read_model_yaml
    from pipelines.embedded import tiny

    name, _, which = path.partition(":")
    which = which or tiny.DEFAULT_FAMILY
    if name == "tiny" and which in tiny.BUILDERS:
        path = str(tiny.BUILDERS[which][1])
    local = Path(path)
    if local.suffix in (".yml", ".yaml"):
        family, configs = read_model_yaml(local)
        return FitModel(family, dict(configs), family.default_scheduler_config(), path)
    if (local / "model_index.json").is_file():
        family = families.for_pipeline(local)
        configs = family.component_configs(local)
        return FitModel(family, configs, read_scheduler_config(local), path)
    raise FitCheckError(
        f"{path}: not a model YAML or a local pipeline directory (set fit_check_model)"
    )


def _step_model(cfg: DeployConfig, step: ResolvedStep) -> FitModel | str:
    """The step's model, or why it is known only at run time."""
    if cfg.fit_check_model:
        return fit_model(cfg.fit_check_model)
    config = step.config
    if step.step.stage == "train":
        source = config.model.model_config or config.model.pretrained_model_name_or_path
    else:
        source = config.pretrained_model_name_or_path
    if source and (
        source == "tiny"
        or source.startswith("tiny:")
        or Path(source).suffix in (".yml", ".yaml")
        or (Path(source) / "model_index.json").is_file()
    ):
        return fit_model(source)
    return f"the model ({source or config.model.init_from}) is known only at run time; set fit_check_model"


def _train_features(config, model: FitModel, steps, step):
    """The batch tensors a train step will read: its synthetic ones, or the records its
    pipeline's convert step writes (latents of that step's size); None when unknown."""
    if config.input.dataset_type == "synthetic":
        shape, text = tuple(config.input.synthetic_latent_shape), config.input.synthetic_text_length
    else:
        producer = next((s for s in steps if s.step.name == step.step.inputs.get("data")), None)
        if producer is None or producer.step.stage != "convert" or "vae" not in model.configs:
            return None
        media = producer.config.media
        shape = tuple(
            model.family.latent_shape(model.configs, media.height, media.width, media.num_frames)
        )
        text = producer.config.encoder.max_sequence_length
    return batch_features(config, model, shape, text, config.input.synthetic_image_tokens)


def batch_features(config, model: FitModel, latent_shape, text_length: int, image_tokens: int):
    """The tensors of a train batch of ``config``'s denoiser: latents of ``latent_shape`` and
    the family's conditioning (``image_tokens`` where the model's configs do not say)."""
    from jaxcore.families import TensorSpec
    from stages.common import records

    denoiser = _denoiser_config(config, model)
    tokens = model.family.image_tokens(model.configs) or image_tokens
    specs = model.family.conditioning_specs(denoiser, text_length, latent_shape, tokens)
    return (TensorSpec(records.LATENTS, tuple(latent_shape)), *specs)


def _denoiser_config(config, model: FitModel):
    family = model.family
    section = config.model.model_config_section or family.denoiser_component
    if config.model.expert is not None:
        section = family.expert_component(model.configs, config.model.expert)
    return model.configs[section]


def train_program(config, model: FitModel, mesh, features=None):
    """The train stage's own step (:func:`stages.train.trainer.make_train_step`, AdamW, the
    config's objective, donated buffers) as a :class:`jaxcore.aot.Program` with abstract
    params, optimiser state and batch: ``per_device_batch_size`` x the mesh's devices, of
    ``features`` (default: the config's synthetic shapes). Full fine-tuning only."""
    from jaxcore import aot, sharding
    from stages.common import objective
    from stages.train import loop, trainer
    from stages.train.config import global_batch_size
    from stages.train.model import Model

    if config.lora.enabled:
        raise FitCheckError("the fit check covers full fine-tuning; this step trains a LoRA")
    family = model.family
    prior = config.prior_preservation.enabled  # DreamBooth: a class batch beside each batch
    denoiser = _denoiser_config(config, model)
    module = family.make_denoiser(denoiser, config.compute, mesh)
    batch = global_batch_size(config.per_device_batch_size, mesh.size)
    sharding.check_divisible(mesh, batch=batch)
    family.check_heads(denoiser, mesh)
    pipeline_dir = Path(model.source) if Path(model.source).is_dir() else None
    target = objective.training_target(family, config.objective, pipeline_dir)
    built = Model(family, module, None, {"source": model.source})
    features = features or loop.batch_features(config, built, None)
    tx, schedule = trainer.make_optimizer(config.optimizer, config.max_train_steps)
    params, param_sh, opt_state, opt_sh = _abstract_train_state(family, module, tx, mesh)
    step = trainer.make_train_step(
        family,
        module,
        tx,
        schedule,
        config.objective,
        mesh,
        param_sh,
        opt_sh,
        features,
        config.seed,
        target=target,
        quantization_mode=config.compute.quantization,
        **({"prior_loss_weight": config.prior_preservation.prior_loss_weight} if prior else {}),
    )
    batch_args = _abstract_batch(features, batch, mesh)
    args = _train_step_args(step.fn, params, opt_state, batch_args, prior, mesh)
    details = {
        "batch": batch,
        "features": {f.name: list(f.shape) for f in features},
        "params": aot.param_count(params),
        "weights_dtype": config.compute.weights_dtype,
        "attention": config.compute.attention,
        "remat_policy": config.compute.remat_policy,
        "prior_preservation": prior,
    }
    rows = batch * (2 if prior else 1)
    return aot.Program(
        "train_step",
        step.fn,
        args,
        mesh,
        model_flops=loop.training_flops(built, features, rows),
        details=details,
        attention_flops=loop.training_attention_flops(built, features, rows),
    )


def _abstract_train_state(family, module, tx, mesh):
    """(params, their shardings, AdamW state, its shardings) of full fine-tuning, abstract:
    ShapeDtypeStructs carrying their shardings, nothing allocated."""
    import jax

    from jaxcore.layer_stack import LayerStack
    from stages.common import checkpoints
    from stages.train import trainer

    params = checkpoints.abstract_params_with_shardings(family, module, mesh)
    param_sh = checkpoints.param_shardings(family, module, mesh)
    layers = LayerStack.of(module, params)  # compute.scan_layers: the run holds stacks
    if layers is not None:
        params, param_sh = layers.stack(params), layers.stack(param_sh)
    opt_sh = trainer.opt_state_shardings(tx, params, param_sh, mesh)
    opt_state = jax.tree.map(
        lambda s, where: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=where),
        jax.eval_shape(tx.init, params),
        opt_sh,
    )
    return params, param_sh, opt_state, opt_sh


def _abstract_batch(features, batch: int, mesh) -> dict:
    """A global batch of ``batch`` rows of ``features``, abstract, sharded on its batch axis."""
    import jax
    import jax.numpy as jnp

    from stages.common.data import batch_sharding

    return {
        f.name: jax.ShapeDtypeStruct(
            (batch, *f.shape), jnp.dtype(f.dtype), sharding=batch_sharding(mesh, 1 + len(f.shape))
        )
        for f in features
    }


def _train_step_args(step_fn, params, opt_state, batch_args: dict, prior: bool, mesh) -> tuple:
    """The train step's arguments in the order its signature names them."""
    import inspect

    import jax
    import jax.numpy as jnp

    from stages.common.data import replicated

    index = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated(mesh))
    # the step's arguments by name (its positional order is the trainer's business): the
    # trainable params, their AdamW state, the batch (and a prior-preservation run's class
    # batch of the same rows) and the step number; no frozen base (full fine-tuning)
    named = {"params": params, "opt_state": opt_state, "batch": batch_args, "step": index}
    if prior:
        named["prior"] = batch_args
    names = list(inspect.signature(step_fn).parameters)
    if not set(named) <= set(names):
        raise FitCheckError(f"the train step takes {names}; the fit check knows {list(named)}")
    return tuple(named.get(name, {}) for name in names)


def generate_program(config, model: FitModel, mesh):
    """The generate stage's denoising loop for a batch of its ``sampling`` section (the
    pipeline's defaults where unset): ``per_device_batch_size`` x the mesh's batch ways,
    padded to a multiple of them, as generate batches prompts."""
    import math

    from jaxcore import aot, sharding
    from stages.generate.config import DEFAULT_MAX_SEQUENCE_LENGTH
    from stages.generate.prompts import family_settings, resolved_defaults

    s = config.sampling
    defaults = model.family.sampling_defaults(model.configs)
    # a line's family settings as generate resolves them (the config's, else the pipeline's),
    # with a seed: they may add passes (LTX-2's modality guidance) or switch CFG on
    base = resolved_defaults(s, defaults)
    settings = dict(family_settings({}, base, None, s.seed, "sampling"))
    ways = sharding.batch_axis_size(mesh)
    batch = math.ceil(max(1, round(config.per_device_batch_size * ways)) / ways) * ways
    return aot.generate_program(
        model.family,
        model.configs,
        model.scheduler_config,
        config.compute,
        mesh,
        batch=batch,
        height=s.height or defaults["height"],
        width=s.width or defaults["width"],
        num_frames=s.num_frames or defaults["num_frames"],
        num_inference_steps=s.num_inference_steps or defaults["num_inference_steps"],
        guidance_scale=defaults["guidance_scale"] if s.guidance_scale is None else s.guidance_scale,
        true_cfg_scale=s.true_cfg_scale,
        guidance_rescale=defaults.get("guidance_rescale", 0.0)
        if s.guidance_rescale is None
        else s.guidance_rescale,
        settings=settings,
        text_length=s.max_sequence_length
        or defaults.get("max_sequence_length", DEFAULT_MAX_SEQUENCE_LENGTH),
        scheduler=s.scheduler,
        shift=s.flow_shift,
    )


def step_program(cfg: DeployConfig, steps, step: ResolvedStep, mesh):
    """The step's program on ``mesh``, or why it cannot be built before the run (a str)."""
    model = _step_model(cfg, step)
    if isinstance(model, str):
        return model
    if step.step.stage == "generate":
        return generate_program(step.config, model, mesh)
    if step.config.lora.enabled:
        return "the fit check covers full fine-tuning; this step trains a LoRA"
    features = _train_features(step.config, model, steps, step)
    if features is None:
        return "the records' shapes are known only at run time (data from outside the pipeline)"
    return train_program(step.config, model, mesh, features)


def fit_check(cfg: DeployConfig, steps, step: ResolvedStep, out: Path | None = None):
    """Compile a train / generate step for ``xpk.tpu_type`` ahead of time, print the report,
    and raise :class:`FitCheckError` when it does not fit (see :class:`DeployConfig`).
    Returns the report, or None when the check was off, skipped or not for this step."""
    if cfg.fit_check == "off" or step.step.stage not in ("train", "generate"):
        return None
    from jaxcore import aot, families, sharding
    from stages.common.errors import StageInputError
    from stages.train.config import batch_mesh

    where = f"step {step.step.name!r} ({step.step.stage}) on {cfg.xpk.tpu_type}"
    reason = None
    if cfg.xpk.tpu_type not in aot.TOPOLOGIES:
        reason = f"{cfg.xpk.tpu_type} is not a TPU slice it knows ({sorted(aot.TOPOLOGIES)})"
    elif not aot.libtpu_available():
        reason = f"libtpu is not installed: {aot.INSTALL_HINT}"
    program = None
    if reason is None:
        slice_ = aot.topology(cfg.xpk.tpu_type)
        try:
            mesh_config = step.config.mesh
            if step.step.stage == "train":  # as the run will: see stages.train.loop.prepare
                mesh_config, _ = batch_mesh(
                    step.config, slice_.chips * cfg.xpk.num_slices, cfg.xpk.num_slices
                )
            mesh = aot.topology_mesh(slice_, mesh_config, cfg.xpk.num_slices)
            program = step_program(cfg, steps, step, mesh)
        except (sharding.ShardingError, families.FamilyError, StageInputError, ValueError) as err:
            raise FitCheckError(f"fit check of {where}: {err}") from None
        if isinstance(program, str):
            reason, program = program, None
    if program is None:
        if cfg.fit_check == "required":
            raise FitCheckError(f"fit check of {where} (fit_check=required) cannot run: {reason}")
        print(f"fit check of {where}: skipped: {reason}")
        return None
    print(f"fit check of {where}: compiling ahead of time (minutes for billion-parameter models)")
    report = aot.compile_program(program, slice_, headroom=cfg.fit_check_headroom)
    print(f"  {report.summary()}\n  per chip: {report.breakdown()}")
    if out is not None:
        import json

        path = Path(out) / f"{step.step.name}-fit.json"
        path.write_text(json.dumps(report.to_dict(), indent=1, default=str) + "\n")
    if not report.fits:
        try:
            report.check()
        except aot.DoesNotFit as err:
            raise FitCheckError(
                f"{where} refused: {err} (fit_check=off launches it anyway)"
            ) from None
    return report
