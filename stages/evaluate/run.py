"""``difforge evaluate``: score each selected checkpoint of a train artifact on the eval split."""

from __future__ import annotations

import logging

from jaxcore.artifacts import ArtifactWriter, Manifest, open_artifact
from stages.common.errors import StageInputError
from stages.evaluate.config import EvaluateConfig

log = logging.getLogger(__name__)


def selected_steps(train_manifest: Manifest, wanted: list[int] | None) -> list[int]:
    """The requested checkpoint steps (all kept ones by default); unknown steps are errors."""
    kept = sorted(int(s) for s in train_manifest.summary.get("checkpoints", []))
    if not kept:
        raise StageInputError(f"{train_manifest.uri}: the train artifact lists no checkpoints")
    if wanted is None:
        return kept
    missing = sorted(set(wanted) - set(kept))
    if missing:
        raise StageInputError(
            f"steps {missing} are not checkpoints of {train_manifest.uri} (it keeps {kept})"
        )
    return sorted(set(wanted))


def run(config: EvaluateConfig, *, force: bool = False) -> Manifest:
    train_manifest = open_artifact(config.checkpoints, "train")
    data_manifest = open_artifact(config.data, "convert")
    writer = ArtifactWriter(
        config.output_dir,
        "evaluate",
        config,
        {"checkpoints": train_manifest, "data": data_manifest},
    )
    done = writer.existing(force)
    if done is not None:
        return done
    from stages.evaluate import evaluator, report

    steps = selected_steps(train_manifest, config.steps)
    results = evaluator.evaluate_checkpoints(config, train_manifest, data_manifest, steps)
    report.write_metrics(writer.uri, results)
    report.write_csv(writer.uri, results)
    report.write_plots(writer.uri, results)
    best = min(results, key=lambda s: results[s]["eval_loss"])
    return writer.commit(
        {
            "best_checkpoint_step": best,
            "eval_loss": {str(s): r["eval_loss"] for s, r in sorted(results.items())},
            "steps": steps,
            "train_artifact": train_manifest.uri,
        }
    )
