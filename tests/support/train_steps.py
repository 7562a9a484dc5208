"""One training step of a model built as the train stage builds it, for the tests that compare
steps (sharded vs one device, caption dropout vs captions written by hand), and the arguments
of a short ``difforge train`` run (:func:`train_args`)."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np

from jaxcore.compute import ComputeConfig
from stages.common import checkpoints, data
from stages.common.objective import ObjectiveSection
from stages.train import model, trainer
from stages.train.config import ModelSection, OptimizerSection


def random_batch(features, rows: int = 8, seed: int = 0) -> dict[str, np.ndarray]:
    """Standard-normal host tensors for ``features`` (TensorSpecs), ``rows`` each."""
    rng = np.random.default_rng(seed)
    return {f.name: rng.standard_normal((rows, *f.shape), np.float32) for f in features}


def one_step(section: ModelSection, mesh, features, host_batch, step: int = 0, **step_options):
    """(parameters after one AdamW step at lr 1e-3 on ``host_batch``, the step's loss);
    ``step_options`` go to :func:`stages.train.trainer.make_train_step`."""
    built = model.build_model(section, ComputeConfig(), mesh, jax.random.key(0))
    tx, sched = trainer.make_optimizer(
        OptimizerSection(learning_rate=1e-3, warmup_steps_fraction=0.0), 10
    )
    p_sh = checkpoints.param_shardings(built.family, built.module, mesh)
    o_sh = trainer.opt_state_shardings(tx, built.params, p_sh, mesh)
    opt = jax.jit(tx.init, out_shardings=o_sh)(built.params)
    train_step = trainer.make_train_step(
        built.family, built.module, tx, sched, ObjectiveSection(), mesh, p_sh, o_sh, features, 0,
        **step_options,
    )  # fmt: skip
    rows = len(next(iter(host_batch.values())))
    batch = data.to_global(host_batch, mesh, rows, keys=tuple(host_batch))
    params, _, metrics = train_step(built.params, opt, batch, step)
    return jax.device_get(params), float(metrics["loss"])


TRAIN_YML = Path(__file__).resolve().parents[2] / "configs" / "stages" / "train.yml"


def train_args(data_uri, model_yaml, out, steps: int, *extra: str) -> list[str]:
    """``difforge train`` arguments (after the program name) for a short tfrecord run on
    ``data_uri`` with the model YAML ``model_yaml``: a synchronous checkpoint every 4 steps, the
    last 2 kept."""
    return [
        "train",
        str(TRAIN_YML),
        f"data={data_uri}",
        f"output_dir={out}",
        "dataset_type=tfrecord",
        f"model.model_config={model_yaml}",
        f"max_train_steps={steps}",
        "checkpoint_every=4",
        "max_to_keep=2",
        "enable_async_checkpointing=false",
        *extra,
        "-q",
    ]
