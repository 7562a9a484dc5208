"""Shared pieces of the benchmarks: the context, timing, result records, thread settings.

A result record is a flat dict (JSON-ready) with at least ``bench``, ``case``, ``impl`` and
``unit``; timed records carry ``median_s``, ``min_s``, ``max_s``, ``reps`` and, where the work
is countable, ``flops`` / ``items`` so :mod:`bench.run` can add rates, the fraction of the
machine's limit and ratios between implementations measured in the same run.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

# Profiles: "smoke" (tests: tiniest sizes, 1 rep), "quick" (--quick), "full" (make bench).
PROFILES = ("smoke", "quick", "full")
REQUIRED_KEYS = ("bench", "case", "impl", "unit")
TIMED_KEYS = ("median_s", "min_s", "max_s", "reps")


@dataclasses.dataclass(frozen=True)
class BenchContext:
    """What every benchmark function receives.

    ``profile`` picks sizes (with ``backend``: accelerators get Wan 2.1 1.3B shapes);
    ``reps`` timed repetitions after ``warmup`` untimed ones; ``workdir`` a scratch folder the
    benchmark may fill (model directories it writes itself), owned by the caller, who removes
    it (:func:`bench.run.main` does unless told to keep it).
    """

    workdir: Path
    profile: str = "full"
    reps: int = 3
    warmup: int = 1
    backend: str = dataclasses.field(default_factory=jax.default_backend)

    def __post_init__(self):
        if self.profile not in PROFILES:
            raise ValueError(f"profile must be one of {PROFILES}, got {self.profile!r}")
        if self.reps < 1 or self.warmup < 0:
            raise ValueError(f"reps must be >= 1 and warmup >= 0, got {self.reps}, {self.warmup}")

    @property
    def on_accelerator(self) -> bool:
        return self.backend in ("gpu", "tpu", "cuda", "rocm")

    def scratch(self, name: str) -> Path:
        path = Path(self.workdir) / name
        path.mkdir(parents=True, exist_ok=True)
        return path


def diffusers_model(class_name: str, config, directory: Path, seed: int = 0):
    """diffusers' ``class_name`` built from ``config.to_dict()`` after ``torch.manual_seed(seed)``
    (random init, eval mode), written to ``directory`` with ``save_pretrained`` unless already
    there (our loaders read the same weights from it); returns the model."""
    import diffusers
    import torch

    torch.manual_seed(seed)
    model = getattr(diffusers, class_name)(**config.to_dict()).eval()
    if not (directory / "config.json").exists():
        model.save_pretrained(directory)
    return model


def cpu_threads() -> int:
    """Cores this process may use: what XLA's CPU thread pool sizes itself to."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def set_torch_threads() -> int:
    """Give torch the same thread count as XLA, so ratios compare like with like."""
    import torch

    threads = cpu_threads()
    torch.set_num_threads(threads)
    return threads


def time_calls(fn: Callable[[], Any], *, reps: int, warmup: int = 1) -> tuple[list[float], float]:
    """(timed seconds of ``reps`` calls, seconds of the first warm-up call).

    ``fn`` must block until its work is done (``jax.block_until_ready`` / a torch result on
    the host). The first warm-up includes compilation; it is returned, not mixed in.
    """
    first = 0.0
    for i in range(warmup):
        started = time.perf_counter()
        fn()
        if i == 0:
            first = time.perf_counter() - started
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return times, first


def interleaved_times(
    calls: dict[str, Callable[[], Any]], *, reps: int, warmup: int = 0
) -> dict[str, list[float]]:
    """Seconds per call of each of ``calls``, called in turn round by round (after ``warmup``
    rounds), so a drift of this VM's speed during the run (20-30% within an hour was seen)
    reaches every side alike instead of reading as a ratio. Each call must block until its
    work is done; compile before (a first call) so no round includes a compilation."""
    for _ in range(warmup):
        for fn in calls.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(reps):
        for name, fn in calls.items():
            started = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - started)
    return times


def timed_record(
    bench: str,
    case: str,
    impl: str,
    times: list[float],
    *,
    flops: float | None = None,
    items: float | None = None,
    item_unit: str | None = None,
    **extra: Any,
) -> dict:
    """A record of repeated timings: median and min/max, plus the work done per call.

    ``flops`` per call (for GFLOP/s and the fraction of the limit); ``items`` per call and
    their ``item_unit`` (tokens, prompts, records) for a throughput.
    """
    if not times:
        raise ValueError(f"{bench}/{case}/{impl}: no timings")
    median = statistics.median(times)
    record = {
        "bench": bench,
        "case": case,
        "impl": impl,
        "unit": "s",
        "median_s": median,
        "min_s": min(times),
        "max_s": max(times),
        "reps": len(times),
    }
    if flops is not None:
        record["flops"] = float(flops)
        record["gflop_per_s"] = flops / median / 1e9
    if items is not None:
        record["items"] = float(items)
        record["item_unit"] = item_unit or "items"
        record["items_per_s"] = items / median
    record.update(extra)
    return record


def value_record(bench: str, case: str, impl: str, value: float, unit: str, **extra: Any) -> dict:
    """A record of one measured quantity (bytes, a ratio) rather than a timing."""
    return {"bench": bench, "case": case, "impl": impl, "unit": unit, "value": value, **extra}


def check_record(record: dict) -> None:
    """Raise ValueError naming the key when a record is malformed (used by run and tests)."""
    where = f"{record.get('bench')}/{record.get('case')}/{record.get('impl')}"
    for key in REQUIRED_KEYS:
        if not isinstance(record.get(key), str) or not record[key]:
            raise ValueError(f"result {where}: {key!r} must be a non-empty string")
    if record["unit"] == "s":
        for key in TIMED_KEYS:
            if key not in record:
                raise ValueError(f"result {where}: timed record lacks {key!r}")
        if not 0 <= record["min_s"] <= record["median_s"] <= record["max_s"]:
            raise ValueError(f"result {where}: expected min_s <= median_s <= max_s")
    elif not isinstance(record.get("value"), int | float):
        raise ValueError(f"result {where}: value record lacks a numeric 'value'")


def block(tree):
    """Wait for every array in a pytree (JAX dispatch is asynchronous)."""
    return jax.block_until_ready(tree)


def run_json_script(script: str, *args: str, what: str) -> dict:
    """Run ``python -c script args`` in a fresh process (from the repo root); the last stdout
    line is its JSON result. A failure raises with ``what`` and the end of its stderr."""
    import json
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", script, *args],
        cwd=Path(__file__).resolve().parent.parent,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode:
        raise RuntimeError(f"{what} subprocess failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])
