"""Benchmark: difforge against MaxDiffusion's Wan transformer and Wan VAE (JAX), in turn call
by call.

``bench.transformer``'s shapes S and M. Forward: float32 at S and M and bfloat16 (weights and
activations) at S, difforge's default flash attention against MaxDiffusion's ``dot_product``
(its ``flash`` setting runs that too below its ``flash_min_seq_length`` of 4,096 tokens).
Training: difforge's whole train step (forward + backward + AdamW) against MaxDiffusion's
forward + backward alone, the issue's comparison, float32 and bf16-mixed (float32 weights,
bfloat16 activations: MaxDiffusion's ``weights_dtype`` / ``activations_dtype``) at S and M.
VAE: ``bench.vae``'s cases, encode and decode in float32, each side through its own chunked
encode / decode with its frame cache (the same chunks on both sides: the first frame, then 4
per encoder call; one latent frame per decoder call).

MaxDiffusion is not on PyPI and needs Python >= 3.12, so it runs in an interpreter of its own
as a subprocess (``bench/maxdiffusion_worker.py``): set ``DIFFORGE_MAXDIFFUSION_PYTHON`` to
that interpreter (``make maxdiffusion-venv``) and ``DIFFORGE_MAXDIFFUSION_SRC`` to its ``src``
folder. Without them every row says ``skipped``. The worker answers one call at a time over a
pipe, so its calls interleave with ours (:func:`bench.common.interleaved_times`); a round trip
adds well under a millisecond. Weights are random on both sides (the same architecture and
shapes, so the same FLOPs); the outputs are not compared.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import BenchContext, block, interleaved_times, timed_record, value_record
from bench.train_step import BENCH_M_MIXED, BENCH_S_MIXED, _difforge_step, _step_flops_and_tokens
from bench.transformer import (
    BENCH_M,
    BENCH_S,
    BENCH_S_BF16,
    TINY,
    ForwardCase,
    make_inputs,
    video_tokens,
)
from bench.vae import CASES as VAE_CASES
from bench.vae import VAECase
from jaxcore import families
from jaxcore.models import wan_transformer as wan
from jaxcore.models import wan_vae

BENCH = "maxdiffusion"
FORWARD, TRAIN = "forward", "train"
ENCODE, DECODE = "encode", "decode"  # the VAE's modes
PYTHON_ENV = "DIFFORGE_MAXDIFFUSION_PYTHON"
SRC_ENV = "DIFFORGE_MAXDIFFUSION_SRC"
SKIPPED = f"skipped: set {PYTHON_ENV} and {SRC_ENV} (MaxDiffusion is not on PyPI)"
WORKER = Path(__file__).resolve().parent / "maxdiffusion_worker.py"
CASES = {
    "smoke": ((TINY, FORWARD), (TINY, TRAIN)),
    "quick": ((BENCH_S, FORWARD), (BENCH_S, TRAIN)),
    "full": (
        (BENCH_S, FORWARD),
        (BENCH_M, FORWARD),
        (BENCH_S_BF16, FORWARD),
        (BENCH_S, TRAIN),
        (BENCH_M, TRAIN),
        (BENCH_S_MIXED, TRAIN),
        (BENCH_M_MIXED, TRAIN),
    ),
}
for _profile, _vae_cases in VAE_CASES.items():
    CASES[_profile] += tuple((case, mode) for case in _vae_cases for mode in (ENCODE, DECODE))


def dtypes(case: ForwardCase, mode: str) -> tuple[str, str]:
    """(activations, weights) dtype names: a bfloat16 forward case is bf16 throughout, a
    bfloat16 train case keeps float32 weights (the train stage's mixed precision)."""
    if case.dtype == "float32":
        return "float32", "float32"
    return case.dtype, (case.dtype if mode == FORWARD else "float32")


def worker_case(case: ForwardCase | VAECase, mode: str) -> dict:
    """What the worker builds and calls for ``case`` in ``mode`` (our architecture)."""
    if mode in (ENCODE, DECODE):
        return vae_worker_case(case, mode)
    config = case.config()
    activations, weights = dtypes(case, mode)
    return {
        "mode": mode,
        "dtype": activations,
        "weights_dtype": weights,
        "config": {
            "patch_size": list(config.patch_size),
            "num_attention_heads": config.num_attention_heads,
            "attention_head_dim": config.attention_head_dim,
            "in_channels": config.in_channels,
            "out_channels": config.out_channels,
            "text_dim": config.text_dim,
            "freq_dim": config.freq_dim,
            "ffn_dim": config.ffn_dim,
            "num_layers": config.num_layers,
            "cross_attn_norm": config.cross_attn_norm,
            "qk_norm": config.qk_norm,
            "eps": config.eps,
            "rope_max_seq_len": config.rope_max_seq_len,
            "attention": "dot_product",
            "scan_layers": True,  # MaxDiffusion's Wan configs' setting
        },
        "latent_shape": list(case.latent_shape),
        "text_tokens": case.text_tokens,
    }


def vae_latent_shape(case: VAECase) -> tuple[int, ...]:
    """[B, z_dim, F, H, W] of the latents ``case``'s video encodes to (the Wan family's
    ``latent_shape``): what both sides decode."""
    batch, _, frames, height, width = case.video_shape
    configs = {"vae": case.config()}
    return (batch, *families.get("wan").latent_shape(configs, height, width, frames))


def vae_worker_case(case: VAECase, mode: str) -> dict:
    """The AutoencoderKLWan keyword arguments, video shape and latent shape of ``case``
    (float32)."""
    config = case.config()
    names = (
        "base_dim", "z_dim", "dim_mult", "num_res_blocks", "attn_scales",
        "temperal_downsample", "dropout", "latents_mean", "latents_std",
    )  # fmt: skip
    if config.is_residual or config.decoder_base_dim is not None or config.patch_size:
        raise ValueError(f"{case.name}: MaxDiffusion's AutoencoderKLWan is the Wan 2.1 VAE only")
    return {
        "mode": mode,
        "dtype": "float32",
        "config": {
            name: list(value) if isinstance(value, tuple) else value
            for name, value in ((name, getattr(config, name)) for name in names)
        },
        "video_shape": list(case.video_shape),
        "latent_shape": list(vae_latent_shape(case)),
    }


class Worker:
    """MaxDiffusion's model in its subprocess; ``call()`` runs one call of its mode there."""

    def __init__(self, python: str, src: str, case: ForwardCase | VAECase, mode: str):
        env = {**os.environ, "PYTHONPATH": src, "JAX_PLATFORMS": "cpu"}
        self._process = subprocess.Popen(
            # -P: not this folder first on the path (it holds modules named like MaxDiffusion's)
            [python, "-P", str(WORKER), json.dumps(worker_case(case, mode))],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        line = self._process.stdout.readline()
        if not line.startswith("ready "):
            self.close()
            raise RuntimeError(f"the MaxDiffusion worker did not start (got {line!r})")
        self.ready = json.loads(line.removeprefix("ready "))

    def call(self) -> None:
        self._process.stdin.write("call\n")
        self._process.stdin.flush()
        if self._process.stdout.readline().strip() != "done":
            raise RuntimeError("the MaxDiffusion worker failed a call")

    def close(self) -> None:
        if self._process.poll() is None:
            try:
                self._process.stdin.write("quit\n")
                self._process.stdin.close()
                self._process.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self._process.kill()


def _difforge_forward(case: ForwardCase):
    config = case.config()
    kind = jnp.dtype(case.dtype)
    module, params = wan.init_wan_transformer(
        config, jax.random.key(0), dtype=kind, param_dtype=kind, attention="flash"
    )
    latents, timestep, text = make_inputs(config, case)
    forward = jax.jit(
        lambda p, x, t, c: module.apply({"params": p}, x.astype(kind), t, c.astype(kind))
    )
    return lambda: block(forward(params, latents, timestep, text))


def _difforge_vae(case: VAECase, mode: str):
    """Our Wan VAE (random weights) encoding ``case``'s video, or decoding latents of the
    shape it encodes to: a no-argument call."""
    module, params = wan_vae.init_wan_vae(case.config(), jax.random.key(0))
    rng = np.random.default_rng(0)
    video = jnp.asarray(rng.uniform(-1, 1, case.video_shape).astype(np.float32))
    if mode == ENCODE:
        return lambda: block(wan_vae.encode(module, params, video).mean)
    z = jnp.asarray(rng.standard_normal(vae_latent_shape(case), dtype=np.float32))
    return lambda: block(wan_vae.decode(module, params, z))


def _timed_in_turn(ctx: BenchContext, ours, worker: Worker) -> tuple[dict, float]:
    """({"difforge": times, "maxdiffusion": times}, our first call's seconds): ``ours()`` builds
    our no-argument call (inside the ``try``, so that a failure there closes the worker too),
    which runs once, then both are timed in turn; the worker is closed either way."""
    try:
        call = ours()
        started = time.perf_counter()
        call()
        first = time.perf_counter() - started
        times = interleaved_times(
            {"difforge": call, "maxdiffusion": worker.call}, reps=ctx.reps, warmup=ctx.warmup
        )
    finally:
        worker.close()
    return times, first


def run_vae_case(ctx: BenchContext, case: VAECase, mode: str, python: str, src: str) -> list[dict]:
    """Two records of the VAE ``case`` in ``mode`` (encode or decode), timed in turn."""
    worker = Worker(python, src, case, mode)
    times, first = _timed_in_turn(ctx, lambda: _difforge_vae(case, mode), worker)
    bench = f"maxdiffusion_vae_{mode}"
    common = {
        "items": case.video_shape[0] * case.video_shape[2],
        "item_unit": "frames",
        "pixels": int(np.prod(case.video_shape[2:])),
    }
    return [
        timed_record(bench, case.name, "difforge", times["difforge"], first_call_s=first, **common),
        timed_record(
            bench, case.name, "maxdiffusion", times["maxdiffusion"],
            first_call_s=worker.ready["first_call_s"], maxdiffusion_jax=worker.ready["jax"],
            **common,
        ),
    ]  # fmt: skip


def run_case(ctx: BenchContext, case: ForwardCase, mode: str, python: str, src: str) -> list[dict]:
    """Two records of ``case`` in ``mode``, ``difforge`` and ``maxdiffusion``, timed in turn;
    ``bench.run`` adds the ratio (``vs_difforge``)."""
    if mode in (ENCODE, DECODE):
        return run_vae_case(ctx, case, mode, python, src)
    config = case.config()
    tokens = video_tokens(config, case.latent_shape)
    if mode == FORWARD:
        flops = wan.flops_per_forward(
            config, case.latent_shape[0], tokens // case.latent_shape[0], case.text_tokens
        )
    else:
        flops, _ = _step_flops_and_tokens(case)
    worker = Worker(python, src, case, mode)
    ours = (lambda: _difforge_forward(case)) if mode == FORWARD else lambda: _difforge_step(case)[0]
    times, first = _timed_in_turn(ctx, ours, worker)
    bench = f"maxdiffusion_{mode}"
    activations, weights = dtypes(case, mode)
    what = {
        FORWARD: ("flash attention", "dot_product attention, scan_layers"),
        TRAIN: ("forward + backward + AdamW (the train stage's step)", "forward + backward"),
    }[mode]
    common = {
        "flops": flops,
        "items": tokens,
        "item_unit": "video tokens",
        "activations_dtype": activations,
        "weights_dtype": weights,
    }
    return [
        timed_record(
            bench, case.name, "difforge", times["difforge"], first_call_s=first, what=what[0],
            **common,
        ),
        timed_record(
            bench, case.name, "maxdiffusion", times["maxdiffusion"],
            first_call_s=worker.ready["first_call_s"], what=what[1],
            maxdiffusion_jax=worker.ready["jax"], **common,
        ),
    ]  # fmt: skip


def run(ctx: BenchContext) -> list[dict]:
    python, src = os.environ.get(PYTHON_ENV), os.environ.get(SRC_ENV)
    cases = CASES[ctx.profile]
    if not python or not src:
        return [
            value_record(
                BENCH, f"{case.name} {mode}", "maxdiffusion", float("nan"), "skipped",
                skipped=SKIPPED,
            )
            for case, mode in cases
        ]  # fmt: skip
    return [record for case, mode in cases for record in run_case(ctx, case, mode, python, src)]
