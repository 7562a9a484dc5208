"""``difforge train``: thin entry point; the work is in ``stages.train.loop``."""

from __future__ import annotations

import logging

import jax

from jaxcore.artifacts import ArtifactWriter, Manifest, open_artifact
from stages.common.checkpoints import resolve_checkpoint_source
from stages.common.distributed import maybe_initialize_distributed
from stages.common.preemption import Preempted
from stages.train.config import TrainConfig

log = logging.getLogger(__name__)


def run(config: TrainConfig, *, force: bool = False) -> Manifest | None:
    """Train (resuming from the output's latest checkpoint) and commit the artifact.

    Raises :class:`~stages.common.preemption.Preempted`, with no manifest written, when
    SIGTERM stopped the run after a checkpoint.
    """
    from stages.train import loop

    maybe_initialize_distributed()
    inputs = {}
    data_manifest = open_artifact(config.data, "convert") if config.data else None
    if data_manifest is not None:
        inputs["data"] = data_manifest
    prior_manifest = None
    if config.prior_preservation.enabled:
        prior_manifest = open_artifact(config.prior_preservation.data, "convert")
        inputs["prior_data"] = prior_manifest
    if config.model.init_from:
        source = resolve_checkpoint_source(config.model.init_from, config.model.init_checkpoint)
        inputs.update({f"init_from_{k}": m for k, m in source.inputs.items()})
    writer = ArtifactWriter(config.output_dir, "train", config, inputs)
    done = writer.existing(force)
    if done is not None:
        log.info("train: %s is already finished (same config and inputs)", done.uri)
        return done
    result = loop.train(config, writer.uri, data_manifest, prior_manifest)
    if not loop.is_writer():  # process 0 commits, once every process has finished its part
        return None
    if result.preempted:
        raise Preempted(
            f"train: stopped by SIGTERM after the step-{result.final_step} checkpoint; "
            "rerun to resume"
        )
    return writer.commit(
        {
            "final_step": result.final_step,
            "final_loss": result.final_loss,
            "checkpoints": result.checkpoints,
            "checkpoint_dir": loop.CHECKPOINT_DIR,
            "family": result.family,
            "model_config": result.model_config,
            "embedded_inputs": result.embedded_inputs,
            "objective": result.objective,
            "model_source": result.model_source,
            "eval_history": result.eval_history,
            "best_checkpoint_step": result.best_checkpoint_step,
            "exported_denoiser": result.exported_denoiser,
            "lora": result.lora,
            "controlnet": result.controlnet,
            "process_count": jax.process_count(),
        }
    )
