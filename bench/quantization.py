"""Benchmark: one Wan transformer forward in each ``compute.quantization`` mode, against torchao's
quantized diffusers model on the same weights.

The model is ``bench/transformer.py``'s (the S config, diffusers' ``WanTransformer3DModel``
saved and loaded by both). difforge runs float32 (the reference, impl ``difforge``), bf16,
and each quantization mode (its kernels quantized as generate holds them); diffusers runs
float32 eager and, quantized by torchao's ``quantize_``, int8 weight-only
(``Int8WeightOnlyConfig``) and int8 dynamic (``Int8DynamicActivationInt8WeightConfig``), the two
a diffusers user reaches for. Every record carries ``psnr_db``: the output's PSNR against
float32 diffusers' (peak = the reference's largest magnitude), so speed and quality sit side
by side; all sides are timed in turn, call by call. The CPU times say what XLA CPU makes of
each mode (int8 products ran about 2x faster than float32 at size S on this 2-core host; float8
ones have no CPU kernel and are converted), not what a TPU does: the TPU figure is
``difforge fit``'s estimate.

Needs ``torchao`` (in the ``test`` extra); without it the torchao rows are left out with a note.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from bench.common import BenchContext, block, diffusers_model, interleaved_times, timed_record
from bench.transformer import BENCH_S, TINY, jax_forward, make_inputs, video_tokens
from jaxcore.models import wan_transformer as wan

log = logging.getLogger(__name__)

BENCH = "quantization"
MODES = ("int8_weights", "fp8_weights", "int8", "fp8")
CASES = {"smoke": TINY, "quick": BENCH_S, "full": BENCH_S}


IDENTICAL_PSNR = 200.0  # what an identical output reads as (records hold no inf)


def psnr(reference: np.ndarray, output: np.ndarray) -> float:
    """20 log10(peak / RMSE), the peak being the reference's largest magnitude."""
    error = float(np.sqrt(np.mean((np.asarray(output, np.float64) - reference) ** 2)))
    peak = float(np.max(np.abs(reference)))
    return IDENTICAL_PSNR if error == 0 else min(20 * np.log10(peak / error), IDENTICAL_PSNR)


def _difforge_calls(directory, latents, timestep, text) -> dict:
    """label -> a no-argument call of our jitted forward, float32, bf16 and each mode."""
    import jax

    from jaxcore import quantization

    calls = {}
    for dtype in ("float32", "bfloat16"):
        forward, params = jax_forward(directory, "flash", dtype)
        label = "difforge" if dtype == "float32" else "difforge_bf16"
        calls[label] = lambda f=forward, p=params: f(p, latents, timestep, text)
    base_forward, params = jax_forward(directory, "flash", "float32")
    for mode in MODES:
        quantized = quantization.quantizer(mode)(params)
        products = quantization.quantizes_products(mode)

        @jax.jit
        def forward(held, latents, timestep, text, products=products):
            weights = quantization.for_denoiser(held, products, np.float32)
            return base_forward(weights, latents, timestep, text)

        calls[f"difforge_{mode}"] = lambda f=forward, q=quantized: f(q, latents, timestep, text)
    return calls


def _torchao_calls(directory, torch_inputs) -> tuple[dict, str | None]:
    """label -> a call of diffusers' model quantized by torchao; (calls, why none)."""
    try:
        from torchao.quantization import (
            Int8DynamicActivationInt8WeightConfig,
            Int8WeightOnlyConfig,
            quantize_,
        )
    except ImportError as err:
        return {}, f"torchao is not installed ({err}): pip install -e '.[test]'"
    import torch
    from diffusers import WanTransformer3DModel

    calls = {}
    for label, config in (
        ("torchao_int8_weights", Int8WeightOnlyConfig()),
        ("torchao_int8_dynamic", Int8DynamicActivationInt8WeightConfig()),
    ):
        model = WanTransformer3DModel.from_pretrained(directory).eval()
        quantize_(model, config)

        def call(model=model):
            with torch.inference_mode():
                return model(**torch_inputs)[0]

        calls[label] = call
    return calls, None


def run(ctx: BenchContext) -> list[dict]:
    import torch

    from bench.common import set_torch_threads

    case = CASES[ctx.profile]
    config = case.config()
    directory = ctx.scratch(f"wan_{case.model_yaml.rsplit('/', 1)[-1]}")
    torch_model = diffusers_model("WanTransformer3DModel", config, directory).eval()
    latents, timestep, text = make_inputs(config, case)
    threads = set_torch_threads()
    torch_inputs = {
        "hidden_states": torch.from_numpy(latents),
        "timestep": torch.from_numpy(timestep),
        "encoder_hidden_states": torch.from_numpy(text),
        "return_dict": False,
    }

    def eager():
        with torch.inference_mode():
            return torch_model(**torch_inputs)[0]

    reference = eager().float().numpy()
    calls = _difforge_calls(directory, latents, timestep, text)
    calls["diffusers_eager"] = eager
    torchao, missing = _torchao_calls(directory, torch_inputs)
    calls.update(torchao)
    quality, firsts = {}, {}
    for label, call in calls.items():
        started = time.perf_counter()
        out = call()
        out = block(out) if not isinstance(out, torch.Tensor) else out.float().numpy()
        firsts[label] = time.perf_counter() - started
        quality[label] = psnr(reference, np.asarray(out, np.float32))
    timed = {
        label: (lambda c=call: block(c())) if label.startswith("difforge") else call
        for label, call in calls.items()
    }
    times = interleaved_times(timed, reps=ctx.reps, warmup=max(ctx.warmup - 1, 0))
    tokens = video_tokens(config, case.latent_shape)
    flops = wan.flops_per_forward(
        config, case.latent_shape[0], tokens // case.latent_shape[0], case.text_tokens
    )
    common = {"flops": flops, "items": tokens, "item_unit": "video tokens", "model": case.name}
    records = []
    for label, measured in times.items():
        info = {"psnr_db": round(quality[label], 2), "first_call_s": firsts[label]}
        if not label.startswith("difforge"):
            info["threads"] = threads
        if label == "difforge" and missing:
            info["note"] = missing
        records.append(timed_record(BENCH, case.name, label, measured, **common, **info))
    return records
