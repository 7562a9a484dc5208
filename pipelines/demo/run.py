"""``difforge demo`` (what ``make demo`` runs): the whole chain on a laptop-sized problem.

1. Assets under ``<root>/assets`` (:mod:`pipelines.demo.assets`): a coloured-shapes dataset
   written as a Hugging Face imagefolder, a tiny Wan pipeline whose VAE is the fitted
   ``configs/models/demo_vae`` (the DiT and UMT5 are random-init; the DiT is trained here),
   and one prompt per colour/shape/background combination.
2. The pipeline ``configs/pipelines/demo.yml``: convert -> train from scratch -> evaluate ->
   generate (with the checkpoint evaluation named best).
3. The check: the dominant colour of each generated shape must be the prompt's colour
   (:func:`pipelines.demo.assets.check_colours`); the report goes to
   ``<root>/demo_check.json`` and the run fails below ``min_pass_fraction``.
"""

from __future__ import annotations

import dataclasses
import json
import logging

import numpy as np

from jaxcore import artifacts, storage
from jaxcore.config import load_config

log = logging.getLogger(__name__)


class DemoCheckError(RuntimeError):
    """The generated images do not show what the prompts ask for often enough."""


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    root: str = "outputs/demo"
    pipeline: str = "configs/pipelines/demo.yml"
    num_items: int = 1200
    seed: int = 0
    min_pass_fraction: float = 0.8

    def __post_init__(self):
        if not 0.0 <= self.min_pass_fraction <= 1.0:
            raise ValueError(f"min_pass_fraction must be in [0, 1], got {self.min_pass_fraction}")
        if storage.is_gcs(self.root):
            raise ValueError("root: the demo writes its assets locally; use a local folder")


def _rendered(manifest: artifacts.Manifest) -> tuple[list[np.ndarray], list[str]]:
    from PIL import Image

    images, prompts = [], []
    for record in manifest.summary["prompts"]:
        path = storage.local_copy(manifest.path(record["output"]))
        images.append(np.asarray(Image.open(path).convert("RGB")))
        prompts.append(record["params"]["prompt"])
    return images, prompts


def run(config: DemoConfig, *, force: bool = False):
    """Assets, the chain, the colour check. Returns the generate artifact's manifest."""
    from pipelines import runner
    from pipelines.config import PipelineConfig
    from pipelines.demo.assets import build_demo_assets, check_colours

    assets = build_demo_assets(config.root, num_items=config.num_items, seed=config.seed)
    log.info("demo assets: %s", assets)
    pipeline = load_config(PipelineConfig, config.pipeline, [f"root={config.root}"])
    runner.run(pipeline, force=force)
    render = artifacts.open_artifact(storage.join(config.root, "render"), "generate")
    images, prompts = _rendered(render)
    report = check_colours(images, prompts)
    result = {
        "pass_fraction": report.pass_fraction,
        "min_pass_fraction": config.min_pass_fraction,
        "passed": report.passed(config.min_pass_fraction),
        **report.to_dict(),
    }
    storage.write_text(storage.join(config.root, "demo_check.json"), json.dumps(result, indent=2))
    _print_report(report, config)
    if not result["passed"]:
        raise DemoCheckError(
            f"only {report.pass_fraction:.0%} of the generated images show the prompt's colour "
            f"(needed {config.min_pass_fraction:.0%}); see {config.root}/demo_check.json"
        )
    return render


def _print_report(report, config: DemoConfig) -> None:
    lines = ["", "prompt                                        colour found   ok"]
    for check in report.checks:
        found = check.found or "-"
        lines.append(f"{check.prompt:<45} {found:<12} {'yes' if check.passed else 'NO'}")
    passed = sum(c.passed for c in report.checks)
    lines += [
        f"colour check: {passed}/{len(report.checks)} prompts ({report.pass_fraction:.0%}); "
        f"needed {config.min_pass_fraction:.0%}",
        f"gallery: {config.root}/render/index.html   contact sheet: "
        f"{config.root}/render/contact_sheet.png",
        f"loss curve: {config.root}/train/loss_curve.png   eval plots: {config.root}/evaluate/",
        "",
    ]
    print("\n".join(lines))
