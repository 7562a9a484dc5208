"""Benchmark 4: bulk generation with the generate stage on the tiny embedded Wan pipeline.

The stage (``stages.generate.run.run``: prompt file -> videos + records + gallery + manifest)
renders the prompts twice in one process: a warm-up run (compiles) and a timed run into a fresh
folder. Device compute is timed separately on the same batches (denoising loop + VAE decode on
prompt embeddings encoded beforehand), so ``outside_compute_share`` = 1 - compute / wall is the
share of the stage's wall time spent on I/O, prompt encoding and host work. Goal < 10%.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np

from bench.common import BenchContext, block, timed_record

BENCH = "generate"
REPO = Path(__file__).resolve().parent.parent
NUM_PROMPTS = {"smoke": 2, "quick": 16, "full": 32}


def _config(pipeline_dir: Path, prompt_file: Path, output_dir: Path):
    from jaxcore.config import load_config
    from stages.generate.config import GenerateConfig

    return load_config(
        GenerateConfig,
        REPO / "configs/stages/generate.yml",
        [
            f"pretrained_model_name_or_path={pipeline_dir}",
            f"prompt_file={prompt_file}",
            f"output_dir={output_dir}",
        ],
    )


def device_seconds(config, prompts: list[str]) -> float:
    """Seconds of denoising + decoding the prompts' batches, embeddings encoded beforehand."""
    from jaxcore.sampling import initial_latents
    from jaxcore.sharding import make_mesh
    from stages.generate import model, render

    s = config.sampling
    pipe = model.load(model.describe(config), config.compute, make_mesh(config.mesh))
    batch = render.global_batch_size(config.per_device_batch_size, pipe.batch_ways)
    shape = pipe.latent_shape(s.height, s.width, s.num_frames)
    batches = []
    for start in range(0, len(prompts), batch):
        chunk = prompts[start : start + batch]
        chunk += [chunk[-1]] * (math.ceil(batch / pipe.batch_ways) * pipe.batch_ways - len(chunk))
        guidance = [pipe.guidance(s.guidance_scale, s.true_cfg_scale)] * len(chunk)
        cond, uncond, scales = pipe.conditioning(
            chunk, [s.negative_prompt] * len(chunk), guidance, s.max_sequence_length
        )
        latents = np.stack([initial_latents(i, shape) for i in range(len(chunk))])
        batches.append((latents, cond, uncond, scales))

    def render_all():
        for latents, cond, uncond, scales in batches:
            z = pipe.sample(
                latents,
                cond,
                uncond,
                num_inference_steps=s.num_inference_steps,
                cfg_scale=scales,
                shift=s.flow_shift,
                scheduler=s.scheduler,
            )
            block(pipe.decode(z))

    render_all()  # compile
    started = time.perf_counter()
    render_all()
    return time.perf_counter() - started


def run(ctx: BenchContext) -> list[dict]:
    from pipelines.demo.tiny import build_tiny_wan_pipeline
    from stages.generate.run import run as run_stage

    work = ctx.scratch("generate")
    pipeline_dir = work / "tiny_pipeline"
    if not (pipeline_dir / "model_index.json").exists():
        build_tiny_wan_pipeline(pipeline_dir)
    count = NUM_PROMPTS[ctx.profile]
    prompts = [f"a small red cube number {i} turning slowly" for i in range(count)]
    prompt_file = work / "prompts.txt"
    prompt_file.write_text("\n".join(prompts) + "\n")

    run_stage(_config(pipeline_dir, prompt_file, work / "out_warmup"))
    walls = []
    for rep in range(ctx.reps):
        started = time.perf_counter()
        run_stage(_config(pipeline_dir, prompt_file, work / f"out_{rep}"))
        walls.append(time.perf_counter() - started)
    config = _config(pipeline_dir, prompt_file, work / "unused")
    compute = device_seconds(config, prompts)
    wall = float(np.median(walls))
    return [
        timed_record(
            BENCH,
            f"tiny-{count}prompts",
            "difforge",
            walls,
            items=count,
            item_unit="prompts",
            device_compute_s=compute,
            outside_compute_share=max(0.0, 1 - compute / wall),
            steps=config.sampling.num_inference_steps,
            goal="outside share < 0.10",
        ),
    ]
