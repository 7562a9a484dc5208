"""Benchmark: step caching in bulk generation, dense vs each cache kind, one prompt file.

The generate stage renders the same prompt file with ``cache.kind`` none (impl ``difforge``,
the reference), ``first_block`` at diffusers' default threshold and at 0.2, and ``magcache``
at diffusers' default settings with ratios measured by ``difforge calibrate`` in the same run.
Each kind is warmed up (compiles) and then timed into fresh folders; the records carry the
block-stack evaluation ratio (dense / cached), the quality against the dense render (mean and
min PSNR, mean SSIM, from a ``compare_dense`` run) and ``vs_difforge`` (dense wall / cached
wall: > 1 means the cache is faster).

The model is the demo's DiT (``configs/models/wan_demo.yml``) with random weights unless a
trained demo (``make demo``) is at ``outputs/demo``, whose best checkpoint is then used: random
models change fast between steps and rarely skip, so their figures say little about quality.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from bench.common import BenchContext, timed_record

BENCH = "step_cache"
REPO = Path(__file__).resolve().parent.parent
NUM_PROMPTS = {"smoke": 2, "quick": 8, "full": 24}
STEPS = {"smoke": 6, "quick": 20, "full": 30}
KINDS = {
    "first_block": ["cache.kind=first_block"],
    "first_block_0.2": ["cache.kind=first_block", "cache.threshold=0.2"],
    "magcache": ["cache.kind=magcache"],  # + cache.calibration (added below)
}


def _model(work: Path) -> list[str]:
    """The overrides naming the model: the trained demo when there is one, else random."""
    demo = REPO / "outputs/demo"
    if (demo / "evaluate/manifest.json").is_file() and (demo / "assets/tiny_wan").is_dir():
        return [
            f"pretrained_model_name_or_path={demo / 'evaluate'}",
            f"model.base_pipeline={demo / 'assets/tiny_wan'}",
        ]
    from pipelines.embedded.tiny import build_tiny_wan_pipeline

    directory = work / "demo_dit_random"
    if not (directory / "model_index.json").exists():
        build_tiny_wan_pipeline(directory, model_config=REPO / "configs/models/wan_demo.yml")
    return [f"pretrained_model_name_or_path={directory}"]


def _run(stage: str, overrides: list[str]):
    from jaxcore.config import load_config
    from stages.generate import run as generate
    from stages.generate.config import GenerateConfig

    config = load_config(GenerateConfig, REPO / "configs/stages/generate.yml", overrides)
    return (generate.calibrate if stage == "calibrate" else generate.run)(config)


def run(ctx: BenchContext) -> list[dict]:
    work = ctx.scratch("step_cache")
    count, steps = NUM_PROMPTS[ctx.profile], STEPS[ctx.profile]
    colours, shapes = ("red", "green", "blue", "yellow"), ("circle", "square", "triangle")
    prompts = [
        {"id": f"p{i}", "prompt": f"a {colours[i % 4]} {shapes[i % 3]} on a white background"}
        for i in range(count)
    ]
    prompt_file = work / "prompts.jsonl"
    prompt_file.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    base = [
        *_model(work),
        f"prompt_file={prompt_file}",
        "height=32",
        "width=32",
        "num_frames=1",
        f"num_inference_steps={steps}",
        "guidance_scale=2.0",
        "max_sequence_length=16",
        "per_device_batch_size=1",
    ]
    calibration = work / "calibration"
    _run("calibrate", [*base, f"output_dir={calibration}"])
    kinds = {"none": [], **KINDS}
    kinds["magcache"] = [*kinds["magcache"], f"cache.calibration={calibration}"]

    def timed(name: str, extra: list[str]) -> list[float]:
        _run("generate", [*base, *extra, f"output_dir={work / name / 'warmup'}"])
        times = []
        for rep in range(ctx.reps):
            started = time.perf_counter()
            _run("generate", [*base, *extra, f"output_dir={work / name / f'rep{rep}'}"])
            times.append(time.perf_counter() - started)
        return times

    records = []
    case = f"{count}prompts-{steps}steps"
    for name, extra in kinds.items():
        times = timed(name, extra)
        impl = "difforge" if name == "none" else f"cache_{name}"
        fields = {"steps": steps}
        if name != "none":
            quality = _run(
                "generate",
                [
                    *base,
                    *extra,
                    "cache.compare_dense=true",
                    f"output_dir={work / name / 'quality'}",
                ],
            ).summary["cache"]
            report = quality.get("quality") or {}
            fields.update(
                evaluation_ratio=quality["evaluation_ratio"],
                mean_psnr_db=report.get("mean_psnr"),
                min_psnr_db=report.get("min_psnr"),
                mean_ssim=report.get("mean_ssim"),
            )
        records.append(
            timed_record(BENCH, case, impl, times, items=count, item_unit="prompts", **fields)
        )
    return records
