"""Restore each checkpoint of a train artifact onto this mesh and score it."""

from __future__ import annotations

import logging

from jaxcore import quantization, sharding
from jaxcore.artifacts import Manifest
from stages.common import checkpoints, data, objective, scoring
from stages.common.errors import StageInputError
from stages.evaluate.config import EvaluateConfig

log = logging.getLogger(__name__)


def evaluate_checkpoints(
    config: EvaluateConfig, train_manifest: Manifest, data_manifest: Manifest, steps: list[int]
) -> dict[int, dict]:
    """{step: EvalResult.to_dict()} for each checkpoint step."""
    mesh = sharding.make_mesh(config.mesh)
    spec = data.split_spec(data_manifest, config.split)
    restorer = checkpoints.DenoiserRestorer(train_manifest, config.compute, mesh)
    family, module = restorer.family, restorer.module
    if spec.family != family.name:
        raise StageInputError(
            f"{data_manifest.uri} holds {spec.family!r} records, but {train_manifest.uri} "
            f"trained a {family.name!r} model"
        )
    family.check_features(module.config, spec.by_name, data_manifest.uri)
    if restorer.controlnet is not None:
        checkpoints.check_control_features(spec.by_name, data_manifest.uri)
    # the loss's model: the denoiser, or a ControlNet run's denoiser + ControlNet
    family, module, param_sh = restorer.scoring_model(
        checkpoints.param_shardings(family, module, mesh)
    )
    # the denoiser's scalar inputs (Flux dev: guidance) as training used them
    embedded = train_manifest.summary.get("embedded_inputs") or {}
    # the training target and noise schedule (manifests from before it: flow matching)
    where = f"{train_manifest.uri} objective"
    target = objective.TrainingTarget.from_dict(train_manifest.summary.get("objective"), where)
    mode = config.compute.quantization
    eval_fn = scoring.make_eval_fn(
        family, module, mesh, param_sh, spec, config.eval_seed, embedded, target, mode
    )
    ways = sharding.batch_axis_size(mesh)
    batch = -(-config.eval_batch_size // ways) * ways
    results = {}
    for step in steps:
        params = _quantized(restorer.scored_params(step), mode)
        result = scoring.score(
            eval_fn, params, spec, batch_size=batch, max_records=config.max_eval_records
        )
        log.info("checkpoint %d: eval loss %.6f", step, result.eval_loss)
        results[step] = result.to_dict()
    return results


def _quantized(params, mode: str):
    """``params`` scored as generate renders with ``compute.quantization``: the denoiser
    quantized, a ControlNet (``{"denoiser", "controlnets"}``) kept in its dtype."""
    if mode == "none":
        return params
    quantize = quantization.quantizer(mode)
    if isinstance(params, dict) and set(params) == {"denoiser", "controlnets"}:
        return {**params, "denoiser": quantize(params["denoiser"])}
    return quantize(params)
