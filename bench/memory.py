"""Benchmark 7: memory.

(a) Peak resident memory while loading a model directory, in a fresh subprocess: the peak
    RSS (``VmHWM``; ``ru_maxrss`` where /proc is absent) after ``load_*`` minus the peak after
    the imports, divided by the
    safetensors bytes. Goal < 1.3 (no second full copy). diffusers' ``from_pretrained`` of the
    same directory is measured the same way for reference.
(b) XLA temp memory of ``flash`` attention against ``dot_product`` over several sequence
    lengths (``jit(...).lower(...).compile().memory_analysis()``): flash should grow linearly,
    dot_product quadratically. The growth exponent log(temp ratio) / log(length ratio) is
    reported.
"""

from __future__ import annotations

import dataclasses
import json
import math
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp

from bench.common import BenchContext, run_json_script, value_record
from jaxcore import attention, weights
from jaxcore.model_configs import load_model_yaml
from jaxcore.models import wan_transformer as wan

REPO = Path(__file__).resolve().parent.parent
LOAD_BENCH, ATTN_BENCH = "memory_load", "memory_attention"
# Bench S (D=512, ffn 2048) with more layers: the weights (not the runtime) dominate the RSS.
LOAD_LAYERS = {"smoke": 2, "quick": 16, "full": 16}
ATTN_LENGTHS = {"smoke": (256, 512), "quick": (1024, 4096), "full": (1024, 2048, 4096, 8192)}
ATTN_HEADS, ATTN_HEAD_DIM = 8, 64

LOAD_SCRIPT = textwrap.dedent(
    """
    import json, resource, sys
    which, directory = sys.argv[1], sys.argv[2]
    import jax, numpy, torch
    from jaxcore.models import wan_transformer
    from diffusers import WanTransformer3DModel
    def peak():
        # VmHWM belongs to this process image; ru_maxrss would carry the parent's peak
        # across fork + exec.
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    baseline = peak()
    if which == "difforge":
        module, params = wan_transformer.load_wan_transformer(directory)
        jax.block_until_ready(params)
    else:
        model = WanTransformer3DModel.from_pretrained(directory)
    print(json.dumps({"baseline": baseline, "peak": peak()}))
    """
)


def write_load_model(ctx: BenchContext) -> tuple[Path, int]:
    """A random-init transformer directory (config.json + safetensors); (path, weight bytes)."""
    layers = LOAD_LAYERS[ctx.profile]
    yaml = (
        "configs/models/wan_tiny.yml"
        if ctx.profile == "smoke"
        else "configs/models/wan_bench_s.yml"
    )
    base = load_model_yaml(REPO / yaml, ("transformer",))["transformer"]
    config = dataclasses.replace(base, num_layers=layers)
    directory = ctx.scratch(f"load_{ctx.profile}")
    path = directory / "diffusion_pytorch_model.safetensors"
    if not path.exists():
        _, params = wan.init_wan_transformer(config, jax.random.key(0))
        tensors = weights.export_state_dict(params, wan.weight_map(config))
        del params
        weights.save_safetensors(tensors, path, {"format": "pt"})
        meta = {"_class_name": "WanTransformer3DModel", **config.to_dict()}
        (directory / "config.json").write_text(json.dumps(meta))
    return directory, path.stat().st_size


def measure_load(which: str, directory: Path) -> dict:
    return run_json_script(LOAD_SCRIPT, which, str(directory), what=f"memory-load ({which})")


def load_records(ctx: BenchContext) -> list[dict]:
    directory, weight_bytes = write_load_model(ctx)
    out = []
    for which in ("difforge", "diffusers"):
        rss = measure_load(which, directory)
        grown = rss["peak"] - rss["baseline"]
        out.append(
            value_record(
                LOAD_BENCH,
                f"{weight_bytes / 2**20:.0f}MiB",
                which,
                grown / weight_bytes,
                "x weight bytes",
                peak_growth_bytes=grown,
                weight_bytes=weight_bytes,
                baseline_rss_bytes=rss["baseline"],
                goal="< 1.3",
            )
        )
    return out


def attention_temp_bytes(backend: str, length: int) -> int:
    """XLA temp buffer bytes of one self-attention call [1, L, H, D] (compiled, not run)."""
    spec = jax.ShapeDtypeStruct((1, length, ATTN_HEADS, ATTN_HEAD_DIM), jnp.float32)
    fn = jax.jit(lambda q, k, v: attention.attention(q, k, v, backend=backend))
    analysis = fn.lower(spec, spec, spec).compile().memory_analysis()
    return int(analysis.temp_size_in_bytes)


def attention_records(ctx: BenchContext) -> list[dict]:
    lengths = ATTN_LENGTHS[ctx.profile]
    out = []
    for backend in ("flash", "dot_product"):
        temps = [attention_temp_bytes(backend, n) for n in lengths]
        exponent = math.log(max(temps[-1], 1) / max(temps[0], 1)) / math.log(
            lengths[-1] / lengths[0]
        )
        for n, temp in zip(lengths, temps, strict=True):
            out.append(
                value_record(
                    ATTN_BENCH,
                    f"L={n}",
                    backend,
                    temp,
                    "temp bytes",
                    heads=ATTN_HEADS,
                    head_dim=ATTN_HEAD_DIM,
                    growth_exponent=exponent,
                )
            )
    return out


def run(ctx: BenchContext) -> list[dict]:
    return attention_records(ctx) + load_records(ctx)
