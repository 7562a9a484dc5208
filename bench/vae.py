"""Benchmark 3: Wan VAE encode and decode, difforge vs diffusers ``AutoencoderKLWan``.

Same weights (diffusers model saved with ``save_pretrained``, read by ``load_wan_vae``); both
sides chunk the same way (first frame, then 4 frames per encoder call; one latent frame per
decoder call) and the outputs are compared (``max_abs_diff``). The two are timed alternately,
call by call, so that load from other processes hits both alike; the difforge record carries
``vs_diffusers`` (diffusers' median / difforge's: > 1 means difforge is faster), also logged.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from pathlib import Path

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
from jaxcore.models import wan_vae

log = logging.getLogger(__name__)

BENCH_ENCODE, BENCH_DECODE = "vae_encode", "vae_decode"
REPO = Path(__file__).resolve().parent.parent


@dataclasses.dataclass(frozen=True)
class VAECase:
    name: str
    model_yaml: str
    video_shape: tuple[int, int, int, int, int]  # [B, 3, 1 + 4k, H, W]

    def config(self) -> wan_vae.WanVAEConfig:
        return load_model_yaml(REPO / self.model_yaml, ("vae",))["vae"]


WAN_VAE = "configs/models/wan_bench_s.yml"  # the Wan 2.1 VAE architecture (base_dim 96)
CASES = {
    "smoke": (VAECase("tiny-5x16x16", "configs/models/wan_tiny.yml", (1, 3, 5, 16, 16)),),
    "quick": (VAECase("wan-5x64x64", WAN_VAE, (1, 3, 5, 64, 64)),),
    "full": (
        VAECase("wan-5x64x64", WAN_VAE, (1, 3, 5, 64, 64)),
        VAECase("wan-9x128x128", WAN_VAE, (1, 3, 9, 128, 128)),
    ),
}
ACCELERATOR_CASES = {
    **CASES,
    "full": (
        VAECase("wan-17x256x256", WAN_VAE, (1, 3, 17, 256, 256)),
        VAECase("wan-81x480x832", WAN_VAE, (1, 3, 81, 480, 832)),
    ),
}


def cases_for(ctx: BenchContext) -> tuple[VAECase, ...]:
    return (ACCELERATOR_CASES if ctx.on_accelerator else CASES)[ctx.profile]


def run_case(ctx: BenchContext, case: VAECase) -> list[dict]:
    import torch

    config = case.config()
    threads = set_torch_threads()
    directory = ctx.scratch(f"vae_{case.name}")
    torch_vae = diffusers_model("AutoencoderKLWan", config, directory)
    module, params = wan_vae.load_wan_vae(directory)
    video = np.random.default_rng(0).uniform(-1, 1, case.video_shape).astype(np.float32)
    pixels = int(np.prod(case.video_shape[2:]))
    common = {
        "items": case.video_shape[0] * case.video_shape[2],
        "item_unit": "frames",
        "pixels": pixels,
    }

    def jax_encode():
        return block(wan_vae.encode(module, params, video).mean)

    started = time.perf_counter()
    mean = np.array(jax_encode())
    encode_first = time.perf_counter() - started

    def jax_decode():
        return block(wan_vae.decode(module, params, mean))

    started = time.perf_counter()
    decoded = np.asarray(jax_decode())
    decode_first = time.perf_counter() - started

    def torch_encode():
        with torch.inference_mode():
            return torch_vae.encode(torch.from_numpy(video)).latent_dist.mean

    def torch_decode():
        with torch.inference_mode():
            return torch_vae.decode(torch.from_numpy(mean)).sample

    encode_diff = float(np.max(np.abs(torch_encode().numpy() - mean)))
    decode_diff = float(np.max(np.abs(torch_decode().numpy() - decoded)))

    out = []
    for bench, ours, theirs, first, diff in (
        (BENCH_ENCODE, jax_encode, torch_encode, encode_first, encode_diff),
        (BENCH_DECODE, jax_decode, torch_decode, decode_first, decode_diff),
    ):
        # The first call (compile included) is done; the torch side has run once too.
        times = interleaved_times(
            {"difforge": ours, "diffusers": theirs}, reps=ctx.reps, warmup=max(ctx.warmup - 1, 0)
        )
        our_times, their_times = times["difforge"], times["diffusers"]
        ratio = statistics.median(their_times) / statistics.median(our_times)
        log.info(
            "%s %s: difforge %.0f ms, diffusers %.0f ms -> %.2fx diffusers "
            "(max abs diff %.1e, first call %.1f s)",
            bench,
            case.name,
            1e3 * statistics.median(our_times),
            1e3 * statistics.median(their_times),
            ratio,
            diff,
            first,
        )
        out.append(
            timed_record(
                bench,
                case.name,
                "difforge",
                our_times,
                **common,
                first_call_s=first,
                max_abs_diff_vs_diffusers=diff,
                vs_diffusers=ratio,
            )
        )
        out.append(
            timed_record(
                bench, case.name, "diffusers_eager", their_times, **common, threads=threads
            )
        )
    return out


def run(ctx: BenchContext) -> list[dict]:
    out = []
    for case in cases_for(ctx):
        log.info("vae: case %s", case.name)
        out += run_case(ctx, case)
    return out
