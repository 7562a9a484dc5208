"""Benchmark 4: bulk generation with the generate stage, and against diffusers' WanPipeline.

- ``tiny``: the tiny embedded Wan pipeline. The stage (``stages.generate.run.run``: prompt
  file -> videos + records + gallery + manifest) renders the prompts twice in one process: a
  warm-up run (compiles) and a timed run into a fresh folder.
- ``S`` (CPU full/quick profiles): a pipeline directory of bench size S (the S transformer,
  the real Wan 2.1 VAE architecture, the UMT5-base-size encoder of ``bench.convert``'s S case in
  place of umt5-xxl, which does not fit this machine), rendered at 256x256, one frame, 4 steps, CFG
  5.0, fp32, the stage's default config. **Steady-state seconds per prompt**: the stage's wall
  time for 2N prompts minus that for N, over N (load and compile cancel), against diffusers'
  ``WanPipeline`` from the same directory rendering the same prompts one call each (the way a
  script loops over a prompt list) and saving each frame as a PNG.

Both: device compute is timed separately on the same batches (denoising loop + VAE decode on
prompt embeddings encoded beforehand), so ``outside_compute_share`` = 1 - compute / wall is the
share of the stage's wall time spent on I/O, prompt encoding and host work. Goal < 10%.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np

from bench.common import BenchContext, block, set_torch_threads, timed_record

BENCH = "generate"
REPO = Path(__file__).resolve().parent.parent
NUM_PROMPTS = {"smoke": 2, "quick": 16, "full": 32}
S_PROMPTS = {"quick": 4, "full": 8}
S_SAMPLING = {"height": 256, "width": 256, "num_frames": 1, "num_inference_steps": 4}
S_GUIDANCE = 5.0  # the stage's default guidance_scale


def _config(pipeline_dir: Path, prompt_file: Path, output_dir: Path, sampling=None):
    from jaxcore.config import load_config
    from stages.generate.config import GenerateConfig

    return load_config(
        GenerateConfig,
        REPO / "configs/stages/generate.yml",
        [
            f"pretrained_model_name_or_path={pipeline_dir}",
            f"prompt_file={prompt_file}",
            f"output_dir={output_dir}",
            *(f"sampling.{key}={value}" for key, value in (sampling or {}).items()),
        ],
    )


def device_seconds(config, prompts: list[str]) -> float:
    """Seconds of denoising + decoding the prompts' batches, embeddings encoded beforehand."""
    from jaxcore.sampling import initial_latents
    from jaxcore.sharding import make_mesh
    from stages.generate import model, render
    from stages.generate.config import DEFAULT_MAX_SEQUENCE_LENGTH

    s = config.sampling
    text_length = s.max_sequence_length or DEFAULT_MAX_SEQUENCE_LENGTH  # the Wan pipeline's
    pipe = model.load(model.describe(config), config.compute, make_mesh(config.mesh))
    batch = render.global_batch_size(config.per_device_batch_size, pipe.batch_ways)
    shape = pipe.latent_shape(s.height, s.width, s.num_frames)
    batches = []
    for start in range(0, len(prompts), batch):
        chunk = prompts[start : start + batch]
        chunk += [chunk[-1]] * (math.ceil(batch / pipe.batch_ways) * pipe.batch_ways - len(chunk))
        guidance = [pipe.guidance(s.guidance_scale, s.true_cfg_scale)] * len(chunk)
        cond, uncond, scales = pipe.conditioning(
            chunk, [s.negative_prompt] * len(chunk), guidance, text_length
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


def _write_prompts(path: Path, prompts: list[str]) -> Path:
    path.write_text("\n".join(prompts) + "\n")
    return path


def _tiny_case(ctx: BenchContext) -> dict:
    from pipelines.embedded.tiny import build_tiny_wan_pipeline
    from stages.generate.run import run as run_stage

    work = ctx.scratch("generate")
    pipeline_dir = work / "tiny_pipeline"
    if not (pipeline_dir / "model_index.json").exists():
        build_tiny_wan_pipeline(pipeline_dir)
    count = NUM_PROMPTS[ctx.profile]
    prompts = [f"a small red cube number {i} turning slowly" for i in range(count)]
    prompt_file = _write_prompts(work / "prompts.txt", prompts)

    run_stage(_config(pipeline_dir, prompt_file, work / "out_warmup"))
    walls = []
    for rep in range(ctx.reps):
        started = time.perf_counter()
        run_stage(_config(pipeline_dir, prompt_file, work / f"out_{rep}"))
        walls.append(time.perf_counter() - started)
    config = _config(pipeline_dir, prompt_file, work / "unused")
    compute = device_seconds(config, prompts)
    wall = float(np.median(walls))
    return timed_record(
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
    )


def _diffusers_renderer(pipeline_dir: Path, out_dir: Path):
    """render(i, prompt): diffusers' WanPipeline on one prompt, its frame saved as a PNG."""
    import torch
    from diffusers import WanPipeline
    from PIL import Image

    set_torch_threads()
    pipe = WanPipeline.from_pretrained(pipeline_dir)
    pipe.set_progress_bar_config(disable=True)
    out_dir.mkdir(parents=True, exist_ok=True)

    def render(i: int, prompt: str) -> None:
        with torch.inference_mode():
            frames = pipe(
                prompt=prompt,
                negative_prompt="",
                guidance_scale=S_GUIDANCE,
                generator=torch.Generator().manual_seed(i),
                output_type="np",
                **S_SAMPLING,
            ).frames[0]
        pixels = (np.clip(frames[0], 0, 1) * 255).round().astype(np.uint8)
        Image.fromarray(pixels).save(out_dir / f"{i:05d}.png")

    return render


def _s_case(ctx: BenchContext) -> list[dict]:
    """Steady-state seconds per prompt, difforge's stage vs diffusers' WanPipeline, size S."""
    from bench.convert import s_model_yaml
    from pipelines.embedded.tiny import cached_tiny_pipeline
    from stages.generate.run import run as run_stage

    work = ctx.scratch("generate_s")
    pipeline_dir = cached_tiny_pipeline("wan", s_model_yaml(work, transformer=True))
    n = S_PROMPTS[ctx.profile]
    prompts = [f"a small red cube number {i} turning slowly" for i in range(2 * n)]
    files = {
        count: _write_prompts(work / f"prompts_{count}.txt", prompts[:count])
        for count in (n, 2 * n)
    }

    def stage_wall(count: int, tag: str) -> float:
        started = time.perf_counter()
        run_stage(_config(pipeline_dir, files[count], work / f"out_{tag}", S_SAMPLING))
        return time.perf_counter() - started

    stage_wall(n, "warmup")
    render = _diffusers_renderer(pipeline_dir, work / "diffusers")
    render(0, prompts[0])  # warm-up

    ours, theirs = [], []
    for rep in range(ctx.reps):
        # per prompt: (wall of 2N prompts - wall of N prompts) / N; load and compile cancel
        ours.append((stage_wall(2 * n, f"{rep}_2n") - stage_wall(n, f"{rep}_n")) / n)
        started = time.perf_counter()
        for i, prompt in enumerate(prompts[:n]):
            render(i, prompt)
        theirs.append((time.perf_counter() - started) / n)
    compute = device_seconds(
        _config(pipeline_dir, files[n], work / "unused", S_SAMPLING), prompts[:n]
    )
    per_prompt = float(np.median(ours))
    common = {"items": 1, "item_unit": "prompts", "prompts": n, **S_SAMPLING}
    return [
        timed_record(
            BENCH,
            "S-256px-steady",
            "difforge",
            ours,
            **common,
            device_compute_s_per_prompt=compute / n,
            outside_compute_share=max(0.0, 1 - compute / n / per_prompt),
            timing="seconds per prompt: (stage wall for 2N prompts - for N) / N",
        ),
        timed_record(
            BENCH,
            "S-256px-steady",
            "diffusers_wanpipeline",
            theirs,
            **common,
            timing="seconds per prompt: one pipeline call per prompt, PNG saved",
        ),
    ]


def run(ctx: BenchContext) -> list[dict]:
    records = [_tiny_case(ctx)]
    if ctx.profile in S_PROMPTS and not ctx.on_accelerator:
        records += _s_case(ctx)
    return records
