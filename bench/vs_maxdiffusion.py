"""Benchmark: difforge against MaxDiffusion's Wan transformer (JAX), in turn call by call.

Cases S and M (``bench.transformer``'s shapes; float32): the forward (difforge's default flash
attention against MaxDiffusion's ``dot_product``, its CPU attention: its flash is a TPU
kernel) and the training step (difforge's whole train step, forward + backward + AdamW,
against MaxDiffusion's forward + backward alone, the issue's comparison).

MaxDiffusion is not on PyPI and needs Python >= 3.12, so it runs in an interpreter of its own
as a subprocess (``bench/maxdiffusion_worker.py``): set ``DIFFORGE_MAXDIFFUSION_PYTHON`` to
that interpreter (with jax, flax and MaxDiffusion's other imports installed) and
``DIFFORGE_MAXDIFFUSION_SRC`` to its ``src`` folder. Without them every row says
``skipped``. The worker answers one call at a time over a pipe, so its calls interleave with
ours (:func:`bench.common.interleaved_times`); a round trip adds well under a millisecond.
Weights are random on both sides (the same architecture and shapes, so the same FLOPs); the
outputs are not compared.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import jax

from bench.common import BenchContext, block, interleaved_times, timed_record, value_record
from bench.train_step import _difforge_step, _step_flops_and_tokens
from bench.transformer import BENCH_M, BENCH_S, TINY, ForwardCase, make_inputs, video_tokens
from jaxcore.models import wan_transformer as wan

BENCH = "maxdiffusion"
PYTHON_ENV = "DIFFORGE_MAXDIFFUSION_PYTHON"
SRC_ENV = "DIFFORGE_MAXDIFFUSION_SRC"
SKIPPED = f"skipped: set {PYTHON_ENV} and {SRC_ENV} (MaxDiffusion is not on PyPI)"
WORKER = Path(__file__).resolve().parent / "maxdiffusion_worker.py"
CASES = {"smoke": (TINY,), "quick": (BENCH_S,), "full": (BENCH_S, BENCH_M)}


def worker_case(case: ForwardCase) -> dict:
    """The WanModel keyword arguments and inputs of ``case`` (same architecture as ours)."""
    config = case.config()
    return {
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


class Worker:
    """MaxDiffusion's model in its subprocess; ``call("forward")`` runs one call there."""

    def __init__(self, python: str, src: str, case: ForwardCase):
        env = {**os.environ, "PYTHONPATH": src, "JAX_PLATFORMS": "cpu"}
        self._process = subprocess.Popen(
            # -P: not this folder first on the path (it holds modules named like MaxDiffusion's)
            [python, "-P", str(WORKER), json.dumps(worker_case(case))],
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

    def call(self, command: str) -> None:
        self._process.stdin.write(command + "\n")
        self._process.stdin.flush()
        if self._process.stdout.readline().strip() != "done":
            raise RuntimeError(f"the MaxDiffusion worker failed a {command} call")

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
    module, params = wan.init_wan_transformer(config, jax.random.key(0), attention="flash")
    latents, timestep, text = make_inputs(config, case)
    forward = jax.jit(lambda p, x, t, c: module.apply({"params": p}, x, t, c))
    return lambda: block(forward(params, latents, timestep, text))


def run_case(ctx: BenchContext, case: ForwardCase, python: str, src: str) -> list[dict]:
    config = case.config()
    tokens = video_tokens(config, case.latent_shape)
    forward_flops = wan.flops_per_forward(
        config, case.latent_shape[0], tokens // case.latent_shape[0], case.text_tokens
    )
    step_flops, _ = _step_flops_and_tokens(case)
    worker = Worker(python, src, case)
    try:
        ours_forward = _difforge_forward(case)
        started = time.perf_counter()
        ours_forward()
        forward_first = time.perf_counter() - started
        ours_step, _ = _difforge_step(case)
        started = time.perf_counter()
        ours_step()
        step_first = time.perf_counter() - started
        times = interleaved_times(
            {
                "forward": ours_forward,
                "maxdiffusion_forward": lambda: worker.call("forward"),
                "step": ours_step,
                "maxdiffusion_backward": lambda: worker.call("backward"),
            },
            reps=ctx.reps,
            warmup=ctx.warmup,
        )
    finally:
        worker.close()
    ready = worker.ready
    # (bench, impl, times key, flops, first call, what it is)
    rows = (
        ("maxdiffusion_forward", "difforge", "forward", forward_flops, forward_first,
         {"attention": "flash"}),
        ("maxdiffusion_forward", "maxdiffusion", "maxdiffusion_forward", forward_flops,
         ready["forward_first_call_s"], {"attention": "dot_product", "scan_layers": True}),
        ("maxdiffusion_train", "difforge", "step", step_flops, step_first,
         {"what": "forward + backward + AdamW (the train stage's step)"}),
        ("maxdiffusion_train", "maxdiffusion", "maxdiffusion_backward", step_flops,
         ready["backward_first_call_s"],
         {"what": "forward + backward (gradient of an MSE), no optimizer"}),
    )  # fmt: skip
    return [
        timed_record(
            bench,
            case.name,
            impl,
            times[key],
            flops=flops,
            first_call_s=first,
            items=tokens,
            item_unit="video tokens",
            **({"maxdiffusion_jax": ready["jax"]} if impl == "maxdiffusion" else {}),
            **extra,
        )
        for bench, impl, key, flops, first, extra in rows
    ]


def run(ctx: BenchContext) -> list[dict]:
    python, src = os.environ.get(PYTHON_ENV), os.environ.get(SRC_ENV)
    cases = CASES[ctx.profile]
    if not python or not src:
        return [
            value_record(BENCH, case.name, "maxdiffusion", float("nan"), "skipped", skipped=SKIPPED)
            for case in cases
        ]
    return [record for case in cases for record in run_case(ctx, case, python, src)]
