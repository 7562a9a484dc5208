"""Benchmark 1: one Wan transformer forward (one denoising step), difforge vs diffusers.

Same weights: diffusers' ``WanTransformer3DModel`` is built from the same config with a fixed
seed, written with ``save_pretrained`` and read by ``load_wan_transformer``; the outputs of
both are compared (``max_abs_diff``) so the timings are of the same computation. diffusers
runs eager and under ``torch.compile`` with as many threads as XLA uses. FLOPs are
MaxDiffusion's Wan formula (``wan_transformer.flops_per_forward``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from bench.common import BenchContext, block, set_torch_threads, time_calls, timed_record
from jaxcore.model_configs import load_model_yaml
from jaxcore.models import wan_transformer as wan

log = logging.getLogger(__name__)

BENCH = "transformer_forward"
REPO = Path(__file__).resolve().parent.parent


@dataclasses.dataclass(frozen=True)
class ForwardCase:
    """A model config (from a model YAML, optionally with overrides) and its input shapes."""

    name: str
    model_yaml: str
    latent_shape: tuple[int, int, int, int, int]  # [B, C, F, H, W]
    text_tokens: int
    overrides: tuple[tuple[str, object], ...] = ()
    torch_compile: bool = True

    def config(self) -> wan.WanTransformerConfig:
        base = load_model_yaml(REPO / self.model_yaml, ("transformer",))["transformer"]
        return dataclasses.replace(base, **dict(self.overrides))


TINY = ForwardCase(
    "tiny", "configs/models/wan_tiny.yml", (1, 4, 2, 8, 8), 16, (("rope_max_seq_len", 64),)
)
BENCH_S = ForwardCase("S", "configs/models/wan_bench_s.yml", (1, 16, 4, 32, 32), 512)
BENCH_M = ForwardCase("M", "configs/models/wan_bench_m.yml", (1, 16, 4, 32, 32), 512)
# Wan 2.1 1.3B at 480p, 81 frames: latents 21 x 60 x 104 (32,760 tokens), 512 text tokens.
WAN_1_3B_480P = ForwardCase(
    "1.3B-480p", "configs/models/wan2.1_t2v_1.3b.yml", (1, 16, 21, 60, 104), 512
)
CASES = {
    "smoke": (TINY,),
    "quick": (TINY, BENCH_S),
    "full": (TINY, BENCH_S, BENCH_M),
}
ACCELERATOR_CASES = {"smoke": (TINY,), "quick": (TINY, BENCH_S), "full": (BENCH_S, WAN_1_3B_480P)}


def cases_for(ctx: BenchContext) -> tuple[ForwardCase, ...]:
    return (ACCELERATOR_CASES if ctx.on_accelerator else CASES)[ctx.profile]


def video_tokens(config: wan.WanTransformerConfig, latent_shape) -> int:
    grid = wan.patch_grid(latent_shape, config.patch_size)
    return latent_shape[0] * int(np.prod(grid))


def write_diffusers_model(config: wan.WanTransformerConfig, directory: Path, seed: int = 0):
    """Random-init diffusers model of this config, saved as safetensors; returns the model."""
    import torch
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    model = WanTransformer3DModel(**config.to_dict()).eval()
    if not (directory / "config.json").exists():
        model.save_pretrained(directory)
    return model


def make_inputs(config: wan.WanTransformerConfig, case: ForwardCase, seed: int = 0):
    rng = np.random.default_rng(seed)
    latents = rng.standard_normal(case.latent_shape, dtype=np.float32)
    timestep = np.full((case.latent_shape[0],), 500.0, np.float32)
    text = rng.standard_normal((case.latent_shape[0], case.text_tokens, config.text_dim))
    return latents, timestep, text.astype(np.float32)


def jax_forward(directory: Path, attention: str = "dot_product"):
    """(jitted forward(latents, timestep, text), params) of our loaded model."""
    module, params = wan.load_wan_transformer(directory, attention=attention)

    @jax.jit
    def forward(params, latents, timestep, text):
        return module.apply({"params": params}, latents, timestep, text)

    return forward, params


def compare_with_diffusers(
    ctx: BenchContext,
    bench: str,
    case_name: str,
    forward_for: Callable[[str], Callable[[], Any]],
    torch_model,
    torch_inputs: dict,
    common: dict,
    *,
    torch_compile: bool,
    **extra,
) -> list[dict]:
    """difforge (dot_product and flash attention), diffusers eager and torch.compile on one
    input: timed records, each difforge one with its max |diff| to diffusers' output.

    ``forward_for(attention)`` returns a no-argument call of our jitted forward."""
    import torch

    threads = set_torch_threads()

    def eager():
        with torch.inference_mode():
            return torch_model(**torch_inputs)[0]

    reference = eager().numpy()
    records = []
    for attention, label in (("dot_product", "difforge"), ("flash", "difforge_flash")):
        call = forward_for(attention)
        started = time.perf_counter()
        ours = np.asarray(block(call()))
        first = time.perf_counter() - started
        times, _ = time_calls(lambda call=call: block(call()), reps=ctx.reps, warmup=ctx.warmup)
        info = {"first_call_s": first, **(extra if label == "difforge" else {})}
        records.append(
            timed_record(
                bench,
                case_name,
                label,
                times,
                **common,
                max_abs_diff_vs_diffusers=float(np.max(np.abs(reference - ours))),
                **info,
            )
        )
    eager_times, _ = time_calls(eager, reps=ctx.reps, warmup=ctx.warmup)
    records.append(
        timed_record(bench, case_name, "diffusers_eager", eager_times, **common, threads=threads)
    )
    if torch_compile and ctx.profile != "smoke":
        records.append(
            _compiled_record(ctx, bench, case_name, torch_model, torch_inputs, common, threads)
        )
    return records


def run_case(ctx: BenchContext, case: ForwardCase) -> list[dict]:
    """difforge jit (both attention backends), diffusers eager and torch.compile on one shape."""
    import torch

    config = case.config()
    directory = ctx.scratch(f"wan_{case.name}")
    torch_model = write_diffusers_model(config, directory)
    latents, timestep, text = make_inputs(config, case)
    tokens = video_tokens(config, case.latent_shape)
    flops = wan.flops_per_forward(
        config, case.latent_shape[0], tokens // case.latent_shape[0], case.text_tokens
    )
    common = {"flops": flops, "items": tokens, "item_unit": "video tokens"}

    def forward_for(attention: str):
        forward, params = jax_forward(directory, attention)
        return lambda: forward(params, latents, timestep, text)

    t_inputs = {
        "hidden_states": torch.from_numpy(latents),
        "timestep": torch.from_numpy(timestep),
        "encoder_hidden_states": torch.from_numpy(text),
        "return_dict": False,
    }
    return compare_with_diffusers(
        ctx,
        BENCH,
        case.name,
        forward_for,
        torch_model,
        t_inputs,
        common,
        torch_compile=case.torch_compile,
        params=wan.count_params(config),
    )


def _compiled_record(ctx, bench, case_name, torch_model, t_inputs, common, threads) -> dict:
    import torch

    compiled = torch.compile(torch_model)

    def call():
        with torch.inference_mode():
            return compiled(**t_inputs)[0]

    started = time.perf_counter()
    call()
    compile_s = time.perf_counter() - started
    times, _ = time_calls(call, reps=ctx.reps, warmup=max(ctx.warmup - 1, 0))
    return timed_record(
        bench,
        case_name,
        "diffusers_compile",
        times,
        **common,
        threads=threads,
        first_call_s=compile_s,
    )


def run(ctx: BenchContext) -> list[dict]:
    records = []
    for case in cases_for(ctx):
        log.info("transformer forward: case %s", case.name)
        records += run_case(ctx, case)
    return records
