"""Benchmark: compile seconds of the training step as the transformer gets deeper, its blocks
unrolled against ``compute.scan_layers`` (one ``lax.scan`` over the blocks' stacked weights,
:func:`jaxcore.compute.run_blocks`), and what the scan costs per step.

For each depth of the case (bench size S at 8 and 40 layers; ``quick``: the demo DiT at 4 and
20; ``smoke``: the tiny model at 2 and 6), the train stage's own step
(:func:`bench.train_step.build_step`: loss, backward, AdamW, clipping) is lowered and compiled
ahead of time, unrolled and scanned; the seconds of ``lower`` + ``compile`` are the figures
(``growth`` = deeper / shallower); so are those of the denoiser's own forward + backward
(``jax.grad`` of a mean-square loss, from abstract parameters). Scanned, both hold the blocks'
parameters stacked, as a scanned train run does (:mod:`jaxcore.layer_stack`), so the
optimizer's updates are one per kind of leaf too. At the shallower depth both compiled steps
then run alternately, call by call (the unrolled step is the ``difforge`` row, the default; the
scanned row's ``vs_difforge`` = its median / the unrolled one's: > 1 means the scan is slower).
Each compile runs in this process after the others; XLA caches nothing across them (every
program differs).
"""

from __future__ import annotations

import dataclasses
import logging
import time

import jax
import jax.numpy as jnp

from bench.common import BenchContext, interleaved_times, timed_record, value_record
from bench.train_step import DEMO, build_step, step_inputs
from bench.transformer import BENCH_S, TINY, ForwardCase
from jaxcore import sharding
from jaxcore.compute import ComputeConfig
from jaxcore.layer_stack import LayerStack
from jaxcore.models import wan_transformer as wan

log = logging.getLogger(__name__)

BENCH = "compile_layers"
# (case, shallow depth, deep depth)
CASES = {"smoke": (TINY, 2, 6), "quick": (DEMO, 4, 20), "full": (BENCH_S, 8, 40)}
IMPLS = {"unrolled": False, "scan_layers": True}


def _at_depth(case: ForwardCase, layers: int) -> ForwardCase:
    overrides = dict(case.overrides, num_layers=layers)
    return dataclasses.replace(
        case, name=f"{case.name} x{layers}", overrides=tuple(overrides.items())
    )


def _compiled_step(case: ForwardCase, scan_layers: bool):
    """(seconds to lower and compile the train step, a function running one compiled step)."""
    config = case.config()
    features, batch = step_inputs(case, config)
    step, params, opt_state = build_step(config, features, ComputeConfig(scan_layers=scan_layers))
    state = {"params": params, "opt_state": opt_state}
    started = time.perf_counter()
    with sharding.mesh_context(step.mesh):
        compiled = step.fn.lower(params, opt_state, {}, batch, {}, jnp.int32(0)).compile()
    seconds = time.perf_counter() - started

    def one_step():
        # params and opt_state are donated: carry the new ones forward every call.
        with sharding.mesh_context(step.mesh):
            new_params, new_opt, metrics = compiled(
                state["params"], state["opt_state"], {}, batch, {}, jnp.int32(0)
            )
        jax.block_until_ready(metrics["loss"])
        state.update(params=new_params, opt_state=new_opt)

    return seconds, one_step


def _grad_compile_seconds(case: ForwardCase, scan_layers: bool) -> float:
    """Seconds to lower and compile the denoiser's forward + backward alone."""
    config = case.config()
    module = wan.WanTransformer(
        config, attention=ComputeConfig().attention, scan_layers=scan_layers
    )
    batch = case.latent_shape[0]
    params = wan.abstract_params(module)
    layers = LayerStack.of(module, params)  # scanned: the stacked layout a train run holds
    args = (
        params if layers is None else layers.stack(params),
        jax.ShapeDtypeStruct(case.latent_shape, jnp.float32),
        jax.ShapeDtypeStruct((batch,), jnp.float32),
        jax.ShapeDtypeStruct((batch, case.text_tokens, config.text_dim), jnp.float32),
    )

    def loss(params, video, timestep, text):
        return jnp.mean(module.apply({"params": params}, video, timestep, text) ** 2)

    started = time.perf_counter()
    jax.jit(jax.grad(loss)).lower(*args).compile()
    return time.perf_counter() - started


def run(ctx: BenchContext) -> list[dict]:
    case, shallow, deep = CASES[ctx.profile]
    out, compile_s, grad_s, steps = [], {}, {}, {}
    for layers in (shallow, deep):
        at_depth = _at_depth(case, layers)
        for impl, scan in IMPLS.items():
            log.info("compile_layers: %s, %s", at_depth.name, impl)
            seconds, one_step = _compiled_step(at_depth, scan)
            compile_s[impl, layers] = seconds
            grad_s[impl, layers] = _grad_compile_seconds(at_depth, scan)
            if layers == shallow:
                steps[impl] = one_step
            del one_step
    programs = {
        "train step": (compile_s, "lower + compile of the train step"),
        "fwd+bwd": (grad_s, "lower + compile of the denoiser's forward + backward"),
    }
    for program, (seconds, what) in programs.items():
        for impl in IMPLS:
            for layers in (shallow, deep):
                extra = {"layers": layers, "what": what}
                if layers == deep:
                    extra["growth"] = seconds[impl, deep] / seconds[impl, shallow]
                if impl == "scan_layers":
                    extra["vs_unrolled"] = seconds["unrolled", layers] / seconds[impl, layers]
                out.append(
                    value_record(
                        BENCH,
                        f"{case.name} x{layers} {program}",
                        impl,
                        seconds[impl, layers],
                        "compile s",
                        **extra,
                    )
                )
    for fn in steps.values():
        fn()  # warm-up (first run of the compiled executable)
    times = interleaved_times(steps, reps=max(ctx.reps, 3), warmup=0)
    for impl in IMPLS:
        out.append(
            timed_record(
                BENCH,
                f"{case.name} x{shallow} step",
                "difforge" if impl == "unrolled" else impl,
                times[impl],
                timing="alternating call by call",
            )
        )
    return out
