"""Benchmark 5: the convert stage's Beam job against its bare encoders.

Runs ``stages.convert.run.run`` (DirectRunner, the tiny embedded pipeline, synthetic shapes
dataset; ``configs/stages/convert.yml``) twice (the first warms caches and compiles) and reports
records/s of the second, next to ``encode_batch_throughput`` of the same ``WanEncoders`` (VAE +
UMT5 on full batches, no Beam, no I/O). ``vs_encoders`` = job records/s / encoder items/s.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from bench.common import BenchContext, timed_record

BENCH = "convert"
REPO = Path(__file__).resolve().parent.parent
NUM_ITEMS = {"smoke": 8, "quick": 32, "full": 64}


def _config(output_dir: Path, items: int):
    """The shipped convert config on the embedded tiny pipeline and synthetic shapes."""
    from jaxcore.config import load_config
    from pipelines.demo.embedded import resolve
    from stages.convert.config import ConvertConfig

    config = load_config(
        ConvertConfig,
        REPO / "configs/stages/convert.yml",
        [
            f"output_dir={output_dir}",
            f"source=synthetic:shapes?num_items={items}&seed=0&height=64&width=64",
        ],
    )
    return resolve(config)


def encoder_throughput(config, reps: int) -> dict:
    from stages.convert.encode import encode_batch_throughput, load_encoders

    encoders = load_encoders(config.encoder, config.compute)
    m, b = config.media, config.encoder.batch_size
    videos = np.random.default_rng(0).uniform(-1, 1, (b, 3, m.num_frames, m.height, m.width))
    captions = [f"a shape number {i}" for i in range(b)]
    return encode_batch_throughput(encoders, videos.astype(np.float32), captions, repeats=reps)


def run(ctx: BenchContext) -> list[dict]:
    from stages.convert.run import run as run_stage

    items = NUM_ITEMS[ctx.profile]
    work = ctx.scratch("convert")
    run_stage(_config(work / "warmup", items))
    walls, rates = [], []
    for rep in range(ctx.reps):
        started = time.perf_counter()
        manifest = run_stage(_config(work / f"out_{rep}", items))
        walls.append(time.perf_counter() - started)
        rates.append(manifest.summary.get("records_per_second"))
    bare = encoder_throughput(_config(work / "unused", items), max(ctx.reps, 2))
    job_rate = items / float(np.median(walls))
    return [
        timed_record(
            BENCH,
            f"tiny-{items}items",
            "difforge_beam",
            walls,
            items=items,
            item_unit="records",
            stage_reported_records_per_s=rates,
            encoder_items_per_s=bare["items_per_s"],
            vs_encoders=job_rate / bare["items_per_s"],
        ),
    ]
