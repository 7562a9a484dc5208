"""Benchmark 5: the convert stage's Beam job against its bare encoders.

Cases: ``tiny`` (the demo's data step: the tiny Wan VAE + UMT5, 32x32 images, batch 32,
16 tokens) and ``S`` (the Wan 2.1 VAE of ``configs/models/wan_bench_s.yml`` and a UMT5 of
UMT5-base size, 64x64 images, batch 8, 64 tokens), on the synthetic shapes imagefolder.

Each case runs ``stages.convert.run.run`` (DirectRunner in memory, ``configs/stages/convert.yml``)
in one process: one warm-up run (imports, compiles), then timed runs on a small and a large
dataset, alternately. Reported:

- ``records_per_s``: records / wall of the whole stage on the large dataset (opening the
  dataset, loading the encoders, the Beam job, the manifest), ``vs_encoders`` that over the
  bare encoders' items/s (``encode_batch_throughput``: full batches, no Beam, no I/O, measured
  in the same process, alternately with the runs);
- ``marginal_records_per_s`` = (large - small records) / (large - small median wall), what each
  further record costs once the fixed start-up is paid, and ``marginal_vs_encoders``;
- ``startup_s``: the wall the small run would take at the marginal rate's zero, i.e. the fixed
  cost of a run (dataset folder listing scales with rows and is part of the marginal cost).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from pathlib import Path

import numpy as np

from bench.common import BenchContext, timed_record

BENCH = "convert"
REPO = Path(__file__).resolve().parent.parent


@dataclasses.dataclass(frozen=True)
class ConvertCase:
    name: str
    size: int  # image height = width
    batch_size: int
    max_sequence_length: int
    items: tuple[int, int]  # (small, large) dataset sizes

    def pipeline(self, work: Path) -> Path:
        from pipelines.embedded.tiny import cached_tiny_pipeline

        if self.name == "tiny":
            return cached_tiny_pipeline("wan")
        return cached_tiny_pipeline("wan", s_model_yaml(work))


CASES = {
    "smoke": (ConvertCase("tiny", 32, 4, 16, (4, 8)),),
    "quick": (ConvertCase("tiny", 32, 32, 16, (64, 256)), ConvertCase("S", 64, 8, 64, (8, 16))),
    "full": (ConvertCase("tiny", 32, 32, 16, (300, 1200)), ConvertCase("S", 64, 8, 64, (16, 64))),
}


def s_model_yaml(work: Path, *, transformer: bool = False) -> Path:
    """Wan 2.1's VAE (the bench model S's) with a UMT5-base-size text encoder (UMT5-XXL, the
    real one, does not fit this machine's memory) and, with ``transformer``, the S transformer
    (its text_dim set to the encoder's width), else a one-layer one (unused by convert)."""
    import yaml

    s = yaml.safe_load((REPO / "configs/models/wan_bench_s.yml").read_text())
    text = {
        **s["text_encoder"],
        "vocab_size": 4096,
        "d_model": 768,
        "d_kv": 64,
        "d_ff": 2048,
        "num_layers": 12,
        "num_heads": 12,
    }
    denoiser = {**s["transformer"], "text_dim": 768}
    if not transformer:
        denoiser.update(num_layers=1, ffn_dim=256, num_attention_heads=2, attention_head_dim=32)
        denoiser.update(freq_dim=32)
    name = "wan_s_pipeline.yml" if transformer else "wan_convert_s.yml"
    path = work / name
    model = {"family": "wan", "transformer": denoiser, "vae": s["vae"], "text_encoder": text}
    path.write_text(yaml.safe_dump(model, sort_keys=True))
    return path


def _config(case: ConvertCase, pipeline: Path, output_dir: Path, items: int):
    """The shipped convert config on ``case``'s encoders and the synthetic shapes."""
    from jaxcore.config import load_config
    from pipelines.embedded.sources import resolve
    from stages.convert.config import ConvertConfig

    size = case.size
    config = load_config(
        ConvertConfig,
        REPO / "configs/stages/convert.yml",
        [
            f"output_dir={output_dir}",
            f"source=synthetic:shapes?num_items={items}&seed=0&height={size}&width={size}",
            f"pretrained_model_name_or_path={pipeline}",
            f"height={size}",
            f"width={size}",
            f"batch_size={case.batch_size}",
            f"max_sequence_length={case.max_sequence_length}",
            "eval_fraction=0.1",
            "records_per_shard=512",
        ],
    )
    return resolve(config)


def _encoder_rate(config, reps: int) -> float:
    from stages.convert.encode import encode_batch_throughput, load_encoders

    encoders = load_encoders(config.encoder, config.compute)
    m, b = config.media, config.encoder.batch_size
    videos = np.random.default_rng(0).uniform(-1, 1, (b, 3, m.num_frames, m.height, m.width))
    captions = [f"a red circle on a blue background {i}" for i in range(b)]
    rate = encode_batch_throughput(encoders, videos.astype(np.float32), captions, repeats=reps)
    return rate["items_per_s"]


def run_case(ctx: BenchContext, case: ConvertCase) -> list[dict]:
    from stages.convert.run import run as run_stage

    work = ctx.scratch(f"convert-{case.name}")
    pipeline = case.pipeline(work)
    small, large = case.items
    _config(case, pipeline, work / "unused", large)  # writes the large dataset, untimed
    run_stage(_config(case, pipeline, work / "warmup", small), force=True)
    walls: dict[int, list[float]] = {small: [], large: []}
    encoder_rates = []
    for rep in range(ctx.reps):  # alternately: the machine's load drifts
        for items in (small, large):
            started = time.perf_counter()
            run_stage(_config(case, pipeline, work / f"out_{items}_{rep}", items), force=True)
            walls[items].append(time.perf_counter() - started)
        reps = 3 if case.name == "tiny" else 2
        encoder_rates.append(_encoder_rate(_config(case, pipeline, work / "unused", small), reps))
    bare = statistics.median(encoder_rates)
    t_small, t_large = (statistics.median(walls[n]) for n in (small, large))
    rate = large / t_large
    marginal = (large - small) / (t_large - t_small) if t_large > t_small else float("nan")
    return [
        timed_record(
            BENCH,
            f"{case.name}-{large}items",
            "difforge_beam",
            walls[large],
            items=large,
            item_unit="records",
            batch_size=case.batch_size,
            records_per_s=rate,
            encoder_items_per_s=bare,
            encoder_items_per_s_all=encoder_rates,
            vs_encoders=rate / bare,
            small_items=small,
            small_median_s=t_small,
            marginal_records_per_s=marginal,
            marginal_vs_encoders=marginal / bare,
            startup_s=t_small - small / marginal if marginal == marginal else float("nan"),
        ),
    ]


def run(ctx: BenchContext) -> list[dict]:
    return [record for case in CASES[ctx.profile] for record in run_case(ctx, case)]
