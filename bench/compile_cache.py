"""Benchmark 6: start-up cost with JAX's persistent compilation cache.

Two fresh subprocesses run the same script against one empty cache folder
(``jax_compilation_cache_dir``, as the stages' ``jax_cache_dir`` sets it): the first compiles
and fills the cache, the second should load the executable. Each reports the wall time from
interpreter start to the first result and the seconds of the first (compiling) call.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from bench.common import BenchContext, run_json_script, value_record

BENCH = "compile_cache"
CASES = {"smoke": "tiny", "quick": "S", "full": "S"}

# Runs in a fresh interpreter: import, init the model, time the first forward.
SCRIPT = textwrap.dedent(
    """
    import json, sys, time
    started = time.perf_counter()
    import jax
    jax.config.update("jax_compilation_cache_dir", sys.argv[1])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    import numpy as np
    from bench.transformer import CASES
    from jaxcore.models import wan_transformer as wan
    case = {c.name: c for c in CASES["full"]}[sys.argv[2]]
    config = case.config()
    module, params = wan.init_wan_transformer(config, jax.random.key(0))
    forward = jax.jit(lambda p, x, t, c: module.apply({"params": p}, x, t, c))
    x = np.zeros(case.latent_shape, np.float32)
    t = np.full((case.latent_shape[0],), 500.0, np.float32)
    c = np.zeros((case.latent_shape[0], case.text_tokens, config.text_dim), np.float32)
    jax.block_until_ready(params)
    ready = time.perf_counter()
    forward(params, x, t, c).block_until_ready()
    first = time.perf_counter() - ready
    second_started = time.perf_counter()
    forward(params, x, t, c).block_until_ready()
    run_s = time.perf_counter() - second_started
    print(json.dumps({"startup_s": time.perf_counter() - started - run_s,
                      "first_call_s": first, "run_s": run_s}))
    """
)


def _run_fresh(cache_dir: Path, case: str) -> dict:
    return run_json_script(SCRIPT, str(cache_dir), case, what="compile-cache")


def run(ctx: BenchContext) -> list[dict]:
    case = CASES[ctx.profile]
    cache_dir = ctx.scratch(f"jax_cache_{case}")
    cold = _run_fresh(cache_dir, case)
    warm = _run_fresh(cache_dir, case)
    entries = sum(1 for p in cache_dir.rglob("*") if p.is_file())
    common = {"cache_entries": entries}
    return [
        value_record(
            BENCH,
            case,
            "cold_cache",
            cold["startup_s"],
            "startup s",
            first_call_s=cold["first_call_s"],
            **common,
        ),
        value_record(
            BENCH,
            case,
            "warm_cache",
            warm["startup_s"],
            "startup s",
            first_call_s=warm["first_call_s"],
            speedup=cold["startup_s"] / warm["startup_s"],
            **common,
        ),
    ]
