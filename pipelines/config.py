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


def substitute_root(value: Any, root: str) -> Any:
    """Replace ``${root}`` in string values (recursively), so steps can name files under root."""
    if isinstance(value, str):
        return value.replace("${root}", root)
    if isinstance(value, dict):
        return {k: substitute_root(v, root) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [substitute_root(v, root) for v in value]
    return value


def step_output(pipeline: PipelineConfig, step_name: str) -> str:
    return storage.join(pipeline.root, step_name)


def resolve_step(pipeline: PipelineConfig, step: StepConfig) -> ResolvedStep:
    """The step's stage config: base YAML + ``set`` + input artifact URIs + output_dir."""
    from pipelines.cli import STAGES, load_entry

    cls = load_entry(STAGES[step.stage].config_class)
    data = read_yaml(step.config) if step.config else {}
    values = substitute_root(dict(step.set), pipeline.root)
    for key, source in step.inputs.items():
        values[key] = step_output(pipeline, source)
    output_dir = step_output(pipeline, step.name)
    values["output_dir"] = output_dir
    try:
        config = from_dict(cls, apply_values(cls, data, values))
    except ConfigError as err:
        raise ConfigError(f"pipeline {pipeline.name!r}, step {step.name!r}: {err}") from None
    return ResolvedStep(step, output_dir, config)


def load_pipeline_spec(pipeline: PipelineConfig) -> list[ResolvedStep]:
    """Validate every step up front (errors name the step and key)."""
    for step in pipeline.steps:
        if step.config and not Path(step.config).exists() and not storage.is_gcs(step.config):
            raise ConfigError(
                f"pipeline {pipeline.name!r}, step {step.name!r}: config file {step.config} does not exist"
            )
    return [resolve_step(pipeline, step) for step in pipeline.steps]
