"""``python -m bench.run`` (``make bench``): every benchmark in one process, side by side.

Order matters: the matmul limit is measured first, then each benchmark; all figures get the
fraction of the limit (``frac_of_limit`` = GFLOP/s / limit GFLOP/s; for the training step
this is the MFU) and, within a (bench, case), the ratio to difforge
(``vs_difforge`` = other's median / difforge's median: > 1 means difforge is faster).
Results: ``bench/results/latest.json`` (records + machine facts) and ``latest.md`` (a table).

    python -m bench.run                 # all, sizes by jax.default_backend()
    python -m bench.run --quick         # smaller sizes, fewer repetitions
    python -m bench.run --only transformer --only matmul
    python -m bench.run --workdir /data/bench   # keep the model folders it writes, reuse them

Without ``--workdir`` the scratch folder (model directories, datasets, renders: ~2 GiB for a
full run) is a temporary one, removed when the run ends (on an error or Ctrl-C too).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib
import json
import logging
import os
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path

log = logging.getLogger("bench")

RESULTS_DIR = Path(__file__).resolve().parent / "results"
# name -> module; matmul first (the limit every other figure is divided by).
BENCHMARKS = {
    "matmul": "bench.matmul",
    "transformer": "bench.transformer",
    "flux": "bench.flux",
    "flux2_kv": "bench.flux2_kv",
    "ltx": "bench.ltx",
    "unet": "bench.unet",
    "train_step": "bench.train_step",
    "vae": "bench.vae",
    "generate": "bench.generate",
    "step_cache": "bench.step_cache",
    "quantization": "bench.quantization",
    "convert": "bench.convert",
    "compile_cache": "bench.compile_cache",
    "compile_layers": "bench.compile_layers",
    "memory": "bench.memory",
    "tpu_compile": "bench.tpu_compile",
    "maxdiffusion": "bench.vs_maxdiffusion",
}
GOALS = {
    "transformer_forward": "difforge >= 1.0x diffusers eager and torch.compile (fp32, S and M); "
    ">= 1.0x diffusers eager in bf16",
    "flux_forward": "difforge >= 1.0x diffusers eager",
    "flux2_kv": "Flux.2 [klein] KV render (reference K/V once per render) faster than the "
    "non-KV render of the same model and references (speedup > 1)",
    "ltx_forward": "difforge >= 1.0x diffusers eager and torch.compile (fp32)",
    "unet_forward": "difforge >= 1.0x diffusers eager and torch.compile (fp32)",
    "train_step": "difforge >= 1.0x PyTorch eager and torch.compile (diffusers' model, torch "
    "AdamW; fp32 and bf16 mixed, S and M); MFU >= 0.70",
    "vae_encode / vae_decode": "difforge >= 1.0x diffusers eager",
    "generate": "S: seconds per prompt <= diffusers' WanPipeline; share of wall time outside "
    "device compute < 0.10",
    "step_cache": "MagCache (diffusers' defaults) >= 1.8x fewer block-stack evaluations at PSNR >= 30 dB",
    "quantization": "int8_weights / int8 PSNR against float32 diffusers within 3 dB of torchao's "
    "int8 weight-only / int8 dynamic (difforge also quantizes convolution kernels, which "
    "torchao leaves in float); CPU times are reported beside, not judged",
    "convert": "records/s of the whole Beam run >= 0.5x the bare encoders' items/s",
    "compile_layers": "with compute.scan_layers, compile seconds of the train step do not grow "
    "with depth (growth from the shallow to the 5x deeper model ~1x)",
    "memory_load": "peak RSS growth < 1.3 x weight bytes",
    "memory_attention": "flash temp memory grows linearly (exponent ~1)",
    "tpu_compile": "every config fits its TPU slice's HBM (5% headroom), known without a TPU",
    "maxdiffusion": "forward >= 1.3x MaxDiffusion's; train step >= 1.2x its forward + backward "
    "(S and M, fp32); VAE encode / decode >= 1.0x (needs a MaxDiffusion checkout, see "
    "bench/vs_maxdiffusion.py)",
}


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--only",
        action="append",
        choices=sorted(BENCHMARKS),
        default=None,
        help="run only this benchmark (repeatable); matmul always runs",
    )
    parser.add_argument("--quick", action="store_true", help="smaller sizes, 2 repetitions")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions (default 3)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="results folder")
    parser.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="scratch folder for the model directories and data the benchmarks write; kept and "
        "reused by the next run (default: a temporary folder, removed at the end)",
    )
    return parser.parse_args(argv)


def machine_facts() -> dict:
    import jax

    try:
        load = os.getloadavg()
    except OSError:
        load = None
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()[:8]],
        "device_count": jax.device_count(),
        "cpu_threads": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "load_average_at_start": load,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "jax": jax.__version__,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }


def _limit(records: list[dict], role: str) -> float | None:
    """GFLOP/s of the matmul record holding ``role`` (the fastest GEMM of its dtype)."""
    found = next((r for r in records if r["bench"] == "matmul" and r.get("role") == role), None)
    return found["gflop_per_s"] if found and "gflop_per_s" in found else None


def add_derived(records: list[dict]) -> None:
    """Fractions of the fp32 and bf16 GEMM limits (the fastest library's, see bench.matmul)
    for every FLOP-counted record; ratios to difforge."""
    limit, limit_bf16 = _limit(records, "limit"), _limit(records, "limit_bf16")
    ours = {(r["bench"], r["case"]): r for r in records if r["impl"] == "difforge"}
    for record in records:
        if limit and "gflop_per_s" in record:
            record["frac_of_limit"] = record["gflop_per_s"] / limit
        if limit_bf16 and "gflop_per_s" in record:
            record["frac_of_bf16_limit"] = record["gflop_per_s"] / limit_bf16
        base = ours.get((record["bench"], record["case"]))
        if base is not None and record is not base and "median_s" in record:
            record["vs_difforge"] = record["median_s"] / base["median_s"]


def _fmt_seconds(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


def _fmt_value(record: dict) -> str:
    if record["unit"] == "s" and "median_s" in record:
        return _fmt_seconds(record["median_s"])
    value, unit = record["value"], record["unit"]
    if unit == "bytes per chip":
        return f"{value / 2**30:.2f} GiB/chip"
    if unit in ("skipped", "timed out", "unsupported"):  # tpu_compile rows that compiled nothing
        return unit
    if "bytes" in unit and unit != "x weight bytes":
        return f"{value / 2**20:.1f} MiB"
    if unit in ("s", "startup s"):
        return _fmt_seconds(value)
    return f"{value:.3g} {unit}"


def _note(record: dict) -> str:
    notes = []
    if "max_abs_diff_vs_diffusers" in record:
        notes.append(f"max abs diff {record['max_abs_diff_vs_diffusers']:.1e}")
    if "items_per_s" in record:
        notes.append(f"{record['items_per_s']:.3g} {record['item_unit']}/s")
    if "first_call_s" in record:
        notes.append(f"first call {_fmt_seconds(record['first_call_s'])}")
    for key in ("growth_exponent", "speedup", "outside_compute_share", "encoder_items_per_s"):
        if key in record:
            notes.append(f"{key} {record[key]:.3g}")
    if record.get("role"):
        notes.append(record["role"])
    if "fits" in record:  # tpu_compile
        notes.append(f"{'fits' if record['fits'] else 'DOES NOT FIT'} {record['slice']}")
        if record.get("est_seconds"):
            mfu = record.get("mfu_estimate")
            notes.append(
                f"est. {_fmt_seconds(record['est_seconds'])}" + (f" (MFU {mfu:.0%})" if mfu else "")
            )
        if record.get("maxdiffusion_published"):
            notes.append(f"MaxDiffusion published {record['maxdiffusion_published']}")
        if record.get("xla_flops"):
            notes.append(f"{record['xla_flops'] / 1e12:.3g} TFLOP/chip (XLA)")
        counts = ", ".join(f"{k} {v}" for k, v in record.get("collectives", {}).items() if v)
        notes.append(f"collectives: {counts or 'none'}")
        notes.append(f"compile {record.get('compile_seconds', 0):.0f} s")
    for key in ("skipped", "refusal", "timed_out_after_s", "unsupported"):
        if record.get(key):
            notes.append(f"{key}: {record[key]}")
    if record.get("error"):
        notes.append(f"ERROR {record['error']}")
    return "; ".join(notes)


def markdown_table(records: list[dict], facts: dict) -> str:
    """One row per record: value, spread, GFLOP/s, fraction of the limit, ratio to difforge."""
    lines = [
        f"# difforge benchmarks ({facts['date']}, backend {facts['backend']}, "
        f"{facts['cpu_threads']} CPU threads, load average at start {facts['load_average_at_start']})",
        "",
        f"Host allocator: {facts.get('host_allocator', 'not recorded')} (every peer runs in this "
        "process, so all share it; see jaxcore/host_memory.py).",
        "",
        "`vs difforge` = other's median / difforge's median (> 1: difforge is faster; < 1: "
        "difforge is SLOWER). `% limit` = GFLOP/s over the machine's fastest fp32 GEMM among "
        "XLA, torch, numpy and MKL (MFU for train_step); `% bf16 limit` = over the fastest bf16-in / "
        "fp32-accumulate GEMM (XLA, torch). The matmul rows marked `limit` set them.",
        "",
        "| bench | case | impl | median / value | spread (min-max) | GFLOP/s | % limit | "
        "% bf16 limit | vs difforge | notes |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        spread = (
            f"{_fmt_seconds(r['min_s'])} - {_fmt_seconds(r['max_s'])} (n={r['reps']})"
            if "min_s" in r
            else ""
        )
        gflops = f"{r['gflop_per_s']:.1f}" if "gflop_per_s" in r else ""
        frac = f"{100 * r['frac_of_limit']:.0f}%" if "frac_of_limit" in r else ""
        frac_bf16 = f"{100 * r['frac_of_bf16_limit']:.0f}%" if "frac_of_bf16_limit" in r else ""
        ratio = ""
        if "vs_difforge" in r:
            ratio = f"{r['vs_difforge']:.2f}x" + (
                " (difforge SLOWER)" if r["vs_difforge"] < 1 else ""
            )
        lines.append(
            f"| {r['bench']} | {r['case']} | {r['impl']} | {_fmt_value(r)} | {spread} | "
            f"{gflops} | {frac} | {frac_bf16} | {ratio} | {_note(r)} |"
        )
    lines += ["", "Goals:", *(f"- {k}: {v}" for k, v in GOALS.items()), ""]
    return "\n".join(lines)


def run_benchmarks(names: list[str], ctx) -> list[dict]:
    """Run each benchmark; a failure becomes an error record, not a lost run."""
    from bench.common import check_record

    records: list[dict] = []
    for name in names:
        started = time.perf_counter()
        log.info("bench %s ...", name)
        try:
            module = importlib.import_module(BENCHMARKS[name])
            produced = module.run(ctx)
            for record in produced:
                check_record(record)
            records += produced
        except Exception as err:  # noqa: BLE001 - keep the other benchmarks' numbers
            log.error("bench %s failed:\n%s", name, traceback.format_exc())
            records.append(
                {
                    "bench": name,
                    "case": "-",
                    "impl": "-",
                    "unit": "error",
                    "value": float("nan"),
                    "error": f"{type(err).__name__}: {err}",
                }
            )
        log.info("bench %s done in %.0f s", name, time.perf_counter() - started)
    return records


def main(argv=None) -> int:
    from jaxcore.host_memory import keep_freed_host_memory, reexec_with_tcmalloc, tcmalloc_active

    # as the difforge command does: the figures are what its stages get (every peer in this
    # process shares the allocator)
    if argv is None:
        reexec_with_tcmalloc()
    host_memory_kept = keep_freed_host_memory()
    allocator = (
        "tcmalloc"
        if tcmalloc_active()
        else "glibc, freed memory kept"
        if host_memory_kept
        else "glibc"
    )
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = parse_args(argv)
    from bench.common import BenchContext

    profile = "quick" if args.quick else "full"
    with contextlib.ExitStack() as scratch:
        if args.workdir is None:
            workdir = Path(scratch.enter_context(tempfile.TemporaryDirectory(suffix="-bench")))
        else:
            workdir = args.workdir
            workdir.mkdir(parents=True, exist_ok=True)
        reps = args.reps or (2 if args.quick else 3)
        ctx = BenchContext(workdir, profile=profile, reps=reps)
        facts = machine_facts()
        facts["host_memory_kept"], facts["host_allocator"] = host_memory_kept, allocator
        return run_and_report(args, ctx, facts)


def run_and_report(args, ctx, facts: dict) -> int:
    """Run the selected benchmarks in ``ctx``, write ``latest.json`` / ``latest.md``, print the
    table; exit status 1 when a benchmark failed."""
    names = (
        list(BENCHMARKS) if not args.only else ["matmul", *[n for n in args.only if n != "matmul"]]
    )
    started = time.perf_counter()
    records = run_benchmarks(names, ctx)
    add_derived(records)
    facts["total_seconds"] = time.perf_counter() - started
    facts["profile"], facts["reps"] = ctx.profile, ctx.reps
    with contextlib.suppress(OSError):
        facts["load_average_at_end"] = os.getloadavg()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "latest.json").write_text(
        json.dumps({"machine": facts, "results": records}, indent=1) + "\n"
    )
    table = markdown_table(records, facts)
    (args.out / "latest.md").write_text(table)
    print(table)
    return 1 if any(r.get("error") for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
