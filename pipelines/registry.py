"""The stages the ``difforge`` command knows, by import path (``module:name``), so that
reading the table imports neither JAX nor TensorFlow; the command (:mod:`pipelines.cli`) and a
pipeline's step resolution (:mod:`pipelines.config`) both read it."""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class StageEntry:
    config_class: str  # "module:Name"
    run: str  # "module:function" taking (config, *, force: bool) -> Manifest
    summary: str


STAGES: dict[str, StageEntry] = {
    "convert": StageEntry(
        "stages.convert.config:ConvertConfig",
        "stages.convert.run:run",
        "Hugging Face dataset -> sharded TFRecords of VAE latents + text embeddings (Beam)",
    ),
    "train": StageEntry(
        "stages.train.config:TrainConfig",
        "stages.train.run:run",
        "training of a model family on converted TFRecords (sharded, checkpointed)",
    ),
    "evaluate": StageEntry(
        "stages.evaluate.config:EvaluateConfig",
        "stages.evaluate.run:run",
        "eval-timestep loss of training checkpoints",
    ),
    "generate": StageEntry(
        "stages.generate.config:GenerateConfig",
        "stages.generate.run:run",
        "bulk rendering of a prompt file to images/videos with a manifest and gallery",
    ),
    "calibrate": StageEntry(
        "stages.generate.config:GenerateConfig",
        "stages.generate.run:calibrate",
        "generate densely and measure MagCache's ratios (a cache.calibration artifact)",
    ),
    "run": StageEntry(
        "pipelines.config:PipelineConfig",
        "pipelines.runner:run",
        "a whole pipeline: chained stages through artifacts (configs/pipelines/*.yml)",
    ),
    "demo": StageEntry(
        "pipelines.demo.run:DemoConfig",
        "pipelines.demo.run:run",
        "the CPU demo: shapes data -> convert -> train -> evaluate -> generate -> colour check",
    ),
    "fit": StageEntry(
        "pipelines.fit:FitConfig",
        "pipelines.fit:run",
        "compile a train or generate step for a TPU slice: HBM per chip, fits, estimated time",
    ),
    "prepare": StageEntry(
        "pipelines.prepare:PrepareConfig",
        "pipelines.prepare:run",
        "build the native CPU kernels (attention, MKL products) ahead of any run",
    ),
    "deploy": StageEntry(
        "pipelines.deploy:DeployConfig",
        "pipelines.deploy:run",
        "write xpk/JobSet, Dataflow and Argo CronWorkflow launch files for a pipeline",
    ),
}


STAGE_NAMES = ("convert", "train", "evaluate", "generate")  # the stages proper


def load_entry(path: str):
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)
