"""Pipeline files: a chain of stage runs whose outputs feed later inputs.

A pipeline YAML (``configs/pipelines/*.yml``)::

    name: demo
    root: outputs/demo            # every step writes to <root>/<step name>; root=gs://... works
    steps:
      - name: data
        stage: convert
        config: configs/stages/convert.yml      # the stage's base YAML (optional)
        set: {num_frames: 1, source: "${root}/assets/shapes"}   # overrides; ${root} = root
      - name: train
        stage: train
        config: configs/stages/train.yml
        inputs: {data: data}                    # config key <- artifact URI of step 'data'

Each step is validated against its stage's config dataclass before anything runs, so a typo in
the last step fails the whole file up front, naming the step and the key.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Literal

from jaxcore import storage
from jaxcore.config import ConfigError, apply_values, from_dict, read_yaml

StageName = Literal["convert", "train", "evaluate", "generate"]


@dataclasses.dataclass(frozen=True)
class StepConfig:
    name: str
    stage: StageName
    config: str | None = None
    set: dict[str, Any] = dataclasses.field(default_factory=dict)
    inputs: dict[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if not self.name or "/" in self.name or self.name.startswith("."):
            raise ValueError(f"step name {self.name!r} must be a plain folder name")


@dataclasses.dataclass(frozen=True)
class ScheduleConfig:
    """When the chain runs on a cluster (an Argo CronWorkflow), see infra/."""

    cron: str = ""
    timezone: str = "UTC"
    namespace: str = "default"
    image: str = "difforge:latest"


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    name: str
    root: str
    steps: tuple[StepConfig, ...]
    schedule: ScheduleConfig = ScheduleConfig()

    def __post_init__(self):
        names = [s.name for s in self.steps]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"steps: duplicate step names {dupes}")
        if not self.steps:
            raise ValueError("steps: a pipeline needs at least one step")
        seen: set[str] = set()
        for step in self.steps:
            for key, source in step.inputs.items():
                if source not in seen:
                    raise ValueError(
                        f"step {step.name!r}: input {key}={source!r} names no earlier step "
                        f"(earlier: {sorted(seen) or 'none'})"
                    )
            seen.add(step.name)


@dataclasses.dataclass(frozen=True)
class ResolvedStep:
    step: StepConfig
    output_dir: str
    config: Any  # the stage's validated config dataclass
    # the overrides on top of the step's base YAML (set + inputs + output_dir ...), as a
    # scheduler passes them on the command line
    values: dict[str, Any] = dataclasses.field(default_factory=dict)


def substitute_root(value: Any, root: str) -> Any:
    """Replace ``${root}`` in string values (recursively), so steps can name files under root."""
    if isinstance(value, str):
        return value.replace("${root}", root)
    if isinstance(value, dict):
        return {k: substitute_root(v, root) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [substitute_root(v, root) for v in value]
    return value


LATEST = "LATEST"


def step_output(pipeline: PipelineConfig, step_name: str, run: str = "") -> str:
    """Where a step writes: ``<root>/<step>``, or ``<root>/<step>/<run>`` for one run of a
    scheduled chain (each run its own artifacts)."""
    if run:
        return storage.join(pipeline.root, step_name, run)
    return storage.join(pipeline.root, step_name)


def latest_pointer(pipeline: PipelineConfig, step_name: str) -> str:
    """The pointer a scheduled chain's convert step moves to its newest artifact."""
    return storage.join(pipeline.root, step_name, LATEST)


def resolve_step(pipeline: PipelineConfig, step: StepConfig, run: str = "") -> ResolvedStep:
    """The step's stage config: base YAML + ``set`` + input artifact URIs + output_dir.

    With ``run`` (a scheduled chain), outputs go to per-run folders and a convert step is
    incremental: it encodes only what its previous run's artifact lacks (``base`` and
    ``latest`` = the step's ``LATEST`` pointer)."""
    from pipelines.registry import STAGES, load_entry

    cls = load_entry(STAGES[step.stage].config_class)
    data = read_yaml(step.config) if step.config else {}
    values = substitute_root(dict(step.set), pipeline.root)
    for key, source in step.inputs.items():
        values[key] = step_output(pipeline, source, run)
    output_dir = step_output(pipeline, step.name, run)
    values["output_dir"] = output_dir
    if run and step.stage == "convert":
        values["base"] = values["latest"] = latest_pointer(pipeline, step.name)
    try:
        config = from_dict(cls, apply_values(cls, data, values))
    except ConfigError as err:
        raise ConfigError(f"pipeline {pipeline.name!r}, step {step.name!r}: {err}") from None
    return ResolvedStep(step, output_dir, config, values)


def load_pipeline_spec(pipeline: PipelineConfig, run: str = "") -> list[ResolvedStep]:
    """Validate every step up front (errors name the step and key); ``run``: see
    :func:`resolve_step`."""
    for step in pipeline.steps:
        if step.config and not Path(step.config).exists() and not storage.is_gcs(step.config):
            raise ConfigError(
                f"pipeline {pipeline.name!r}, step {step.name!r}: config file {step.config} does not exist"
            )
    return [resolve_step(pipeline, step, run) for step in pipeline.steps]
