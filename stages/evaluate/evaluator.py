"""Restore each checkpoint of a train artifact onto this mesh and score it."""

from __future__ import annotations

import logging

from jaxcore import sharding, storage
from jaxcore.artifacts import Manifest
from jaxcore.models import wan_transformer as wan
from stages.evaluate import scoring
from stages.evaluate.config import EvaluateConfig
from stages.train import checkpointing, data, model
from stages.train.config import ModelSection

log = logging.getLogger(__name__)


def evaluate_checkpoints(
    config: EvaluateConfig, train_manifest: Manifest, data_manifest: Manifest, steps: list[int]
) -> dict[int, dict]:
    """{step: EvalResult.to_dict()} for each checkpoint step."""
    mesh = sharding.make_mesh(config.mesh)
    spec = data.split_spec(data_manifest, config.split)
    wan_config = wan.WanTransformerConfig.from_dict(train_manifest.summary["model_config"])
    data.check_model_shapes(
        spec.latent_shape,
        spec.text_shape,
        wan_config.in_channels,
        wan_config.text_dim,
        data_manifest.uri,
    )
    section = ModelSection(
        model_config="(from the checkpoint)",
        weights_dtype=config.weights_dtype,
        activations_dtype=config.activations_dtype,
        attention=config.attention,
    )
    module = model.make_module(wan_config, section, mesh)
    param_sh = model.param_target_shardings(module, mesh)
    eval_fn = scoring.make_eval_fn(module, mesh, param_sh, config.eval_seed)
    ways = sharding.batch_axis_size(mesh)
    batch = -(-config.eval_batch_size // ways) * ways
    directory = storage.join(train_manifest.uri, train_manifest.summary["checkpoint_dir"])
    results = {}
    for step in steps:
        params = checkpointing.restore_params(directory, step, module, mesh)
        result = scoring.score(
            eval_fn, params, spec, batch_size=batch, max_records=config.max_eval_records
        )
        log.info("checkpoint %d: eval loss %.6f", step, result.eval_loss)
        results[step] = result.to_dict()
    return results
