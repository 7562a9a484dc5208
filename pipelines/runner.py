"""Run a pipeline locally: each step in order, skipping steps whose artifact is already complete.

Skipping is the stages' own rule (an artifact whose manifest has the same key is reused), so a
rerun after a failure continues from the failed step, and a changed config reruns exactly the
steps it affects (the key of every later step changes with its inputs' manifests).
"""

from __future__ import annotations

import logging
import time

from jaxcore import artifacts, storage
from jaxcore.config import ConfigError
from pipelines.config import PipelineConfig, load_pipeline_spec
from pipelines.embedded import sources as embedded
from pipelines.registry import STAGES, load_entry

log = logging.getLogger(__name__)

PIPELINE_STAGE = "pipeline"


def run(config: PipelineConfig, *, force: bool = False, from_stage: str | None = None):
    """Run the chain; returns the pipeline's own manifest (at ``<root>/pipeline``).

    ``from_stage``: a step name (or stage name, first match) to start from; earlier steps are
    not run, but their artifacts must be complete. ``force`` rebuilds the steps that run.
    """
    steps = load_pipeline_spec(config)
    start = 0
    if from_stage:
        matches = [i for i, s in enumerate(steps) if from_stage in (s.step.name, s.step.stage)]
        if not matches:
            names = [s.step.name for s in steps]
            raise ConfigError(f"--from {from_stage!r} names no step of {config.name!r}: {names}")
        start = matches[0]
    manifests: dict[str, artifacts.Manifest] = {}
    for index, resolved in enumerate(steps):
        step = resolved.step
        if index < start:
            manifests[step.name] = artifacts.open_artifact(resolved.output_dir, step.stage)
            log.info("[%s] before --from: using %s", step.name, resolved.output_dir)
            continue
        log.info(
            "[%d/%d] %s (%s) -> %s",
            index + 1,
            len(steps),
            step.name,
            step.stage,
            resolved.output_dir,
        )
        began = time.monotonic()
        manifest = load_entry(STAGES[step.stage].run)(
            embedded.resolve(resolved.config), force=force
        )
        manifests[step.name] = manifest
        log.info("[%s] done in %.1f s", step.name, time.monotonic() - began)
    return _record_chain(config, manifests)


def _record_chain(config: PipelineConfig, manifests: dict[str, artifacts.Manifest]):
    """The pipeline's own manifest: which step artifacts this chain is made of."""
    writer = artifacts.ArtifactWriter(
        storage.join(config.root, PIPELINE_STAGE), PIPELINE_STAGE, config, manifests
    )
    found = artifacts.read_manifest(writer.uri)
    if found is not None and found.key == writer.key:
        return found
    if found is not None:  # an earlier chain's record: replaced, its steps' artifacts stay
        storage.delete(storage.join(writer.uri, artifacts.MANIFEST))
    # a list, not a mapping: the manifest's JSON sorts mapping keys, and the order is the chain
    return writer.commit({"steps": [{"name": n, "uri": m.uri} for n, m in manifests.items()]})
