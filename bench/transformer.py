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
import jax.numpy as jnp
import numpy as np

from bench.common import (
    BenchContext,
    block,
    diffusers_model,
    interleaved_times,
    set_torch_threads,
    timed_record,
)
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
    dtype: str = "float32"  # weights, activations and inputs of both sides

    def config(self) -> wan.WanTransformerConfig:
        base = load_model_yaml(REPO / self.model_yaml, ("transformer",))["transformer"]
        return dataclasses.replace(base, **dict(self.overrides))


TINY = ForwardCase(
    "tiny", "configs/models/wan_tiny.yml", (1, 4, 2, 8, 8), 16, (("rope_max_seq_len", 64),)
)
BENCH_S = ForwardCase("S", "configs/models/wan_bench_s.yml", (1, 16, 4, 32, 32), 512)
BENCH_M = ForwardCase("M", "configs/models/wan_bench_m.yml", (1, 16, 4, 32, 32), 512)
# bf16 weights and activations (diffusers: the model and inputs cast to bfloat16)
BENCH_S_BF16 = dataclasses.replace(BENCH_S, name="S-bf16", torch_compile=False, dtype="bfloat16")
# Wan 2.1 1.3B at 480p, 81 frames: latents 21 x 60 x 104 (32,760 tokens), 512 text tokens.
WAN_1_3B_480P = ForwardCase(
    "1.3B-480p", "configs/models/wan2.1_t2v_1.3b.yml", (1, 16, 21, 60, 104), 512
)
CASES = {
    "smoke": (TINY,),
    "quick": (TINY, BENCH_S),
    "full": (TINY, BENCH_S, BENCH_M, BENCH_S_BF16),
}
ACCELERATOR_CASES = {"smoke": (TINY,), "quick": (TINY, BENCH_S), "full": (BENCH_S, WAN_1_3B_480P)}


def cases_for(ctx: BenchContext) -> tuple[ForwardCase, ...]:
    return (ACCELERATOR_CASES if ctx.on_accelerator else CASES)[ctx.profile]


def video_tokens(config: wan.WanTransformerConfig, latent_shape) -> int:
    grid = wan.patch_grid(latent_shape, config.patch_size)
    return latent_shape[0] * int(np.prod(grid))


def make_inputs(config: wan.WanTransformerConfig, case: ForwardCase, seed: int = 0):
    rng = np.random.default_rng(seed)
    latents = rng.standard_normal(case.latent_shape, dtype=np.float32)
    timestep = np.full((case.latent_shape[0],), 500.0, np.float32)
    text = rng.standard_normal((case.latent_shape[0], case.text_tokens, config.text_dim))
    return latents, timestep, text.astype(np.float32)


def jax_forward(directory: Path, attention: str = "dot_product", dtype: str = "float32"):
    """(jitted forward(latents, timestep, text), params) of our loaded model, weights and
    activations in ``dtype``."""
    kind = jnp.dtype(dtype)
    module, params = wan.load_wan_transformer(
        directory, attention=attention, dtype=kind, param_dtype=kind
    )

    @jax.jit
    def forward(params, latents, timestep, text):
        return module.apply({"params": params}, latents.astype(kind), timestep, text.astype(kind))

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
    attentions: tuple[str, ...] = ("flash", "dot_product"),
    **extra,
) -> list[dict]:
    """difforge (each of ``attentions``), diffusers eager and torch.compile on one input:
    timed records, each difforge one with its max |diff| to diffusers' output.

    Every side is compiled and run once, then all are timed **in turn, call by call**
    (:func:`bench.common.interleaved_times`), so the ratios hold under this VM's drift.
    ``forward_for(attention)`` returns a no-argument call of our jitted forward."""
    import torch

    threads = set_torch_threads()

    def eager():
        with torch.inference_mode():
            return torch_model(**torch_inputs)[0]

    reference = eager().float().numpy()
    # the stages' default backend is the "difforge" row every ratio is taken against
    labels = {"flash": "difforge", "dot_product": "difforge_dot_product"}
    calls, firsts, diffs = {}, {}, {}
    for attention in attentions:
        label = labels[attention]
        call = forward_for(attention)
        started = time.perf_counter()
        ours = np.asarray(block(call()), np.float32)
        firsts[label] = time.perf_counter() - started
        diffs[label] = float(np.max(np.abs(reference - ours)))
        calls[label] = lambda call=call: block(call())
    calls["diffusers_eager"] = eager
    if torch_compile and ctx.profile != "smoke":
        compiled = torch.compile(torch_model)

        def compiled_call():
            with torch.inference_mode():
                return compiled(**torch_inputs)[0]

        started = time.perf_counter()
        compiled_call()
        firsts["diffusers_compile"] = time.perf_counter() - started
        calls["diffusers_compile"] = compiled_call
    times = interleaved_times(calls, reps=ctx.reps, warmup=max(ctx.warmup - 1, 0))
    records = []
    for label, measured in times.items():
        info = {"timing": "alternating call by call"}
        if label in firsts:
            info["first_call_s"] = firsts[label]
        if label in diffs:
            info["max_abs_diff_vs_diffusers"] = diffs[label]
        if label.startswith("diffusers"):
            info["threads"] = threads
        if label == "difforge":
            info.update(extra)
        records.append(timed_record(bench, case_name, label, measured, **common, **info))
    return records


def run_case(ctx: BenchContext, case: ForwardCase) -> list[dict]:
    """difforge jit (flash, the default, and dot_product in float32; flash in bf16), diffusers
    eager and torch.compile on one shape, in ``case.dtype``."""
    import torch

    config = case.config()
    directory = ctx.scratch(f"wan_{case.model_yaml.rsplit('/', 1)[-1]}")
    torch_model = diffusers_model("WanTransformer3DModel", config, directory)
    latents, timestep, text = make_inputs(config, case)
    tokens = video_tokens(config, case.latent_shape)
    flops = wan.flops_per_forward(
        config, case.latent_shape[0], tokens // case.latent_shape[0], case.text_tokens
    )
    common = {"flops": flops, "items": tokens, "item_unit": "video tokens", "dtype": case.dtype}

    def forward_for(attention: str):
        forward, params = jax_forward(directory, attention, case.dtype)
        return lambda: forward(params, latents, timestep, text)

    torch_dtype = getattr(torch, case.dtype)
    if torch_dtype != torch.float32:
        # as a diffusers user loads it: the modules it keeps in float32 stay there
        from diffusers import WanTransformer3DModel

        torch_model = WanTransformer3DModel.from_pretrained(directory, torch_dtype=torch_dtype)
    t_inputs = {
        "hidden_states": torch.from_numpy(latents).to(torch_dtype),
        "timestep": torch.from_numpy(timestep),
        "encoder_hidden_states": torch.from_numpy(text).to(torch_dtype),
        "return_dict": False,
    }
    return compare_with_diffusers(
        ctx,
        BENCH,
        case.name,
        forward_for,
        torch_model.eval(),
        t_inputs,
        common,
        torch_compile=case.torch_compile,
        attentions=("flash", "dot_product") if case.dtype == "float32" else ("flash",),
        params=wan.count_params(config),
    )


def run(ctx: BenchContext) -> list[dict]:
    records = []
    for case in cases_for(ctx):
        log.info("transformer forward: case %s", case.name)
        records += run_case(ctx, case)
    return records
