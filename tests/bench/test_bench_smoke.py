"""Smoke tests of the benchmarks: each runs at its tiniest size with one repetition and must
return well-formed records (no timing assertions: numbers are for bench/results, not tests)."""

import importlib
import math

import pytest

from bench import run as bench_run
from bench.common import BenchContext, check_record, timed_record, value_record

FAST = (
    "matmul",
    "transformer",
    "flux",
    "flux2_kv",
    "ltx",
    "unet",
    "vae",
    "maxdiffusion",
    "quantization",
)
SLOW = (
    "train_step",
    "generate",
    "step_cache",
    "convert",
    "compile_cache",
    "compile_layers",
    "memory",
    "tpu_compile",
)


@pytest.fixture
def ctx(tmp_path):
    return BenchContext(profile="smoke", reps=1, warmup=1, workdir=tmp_path)


def _check_all(records, module_name):
    assert records, f"{module_name} returned no records"
    for record in records:
        check_record(record)
        for key, value in record.items():
            if isinstance(value, float) and key != "value":
                assert math.isfinite(value), f"{module_name}: {key} is {value}"


@pytest.mark.parametrize("name", [*FAST, *(pytest.param(n, marks=pytest.mark.slow) for n in SLOW)])
def test_benchmark_smoke(name, ctx):
    records = importlib.import_module(bench_run.BENCHMARKS[name]).run(ctx)
    _check_all(records, name)
    if name in ("transformer", "flux", "ltx"):
        for impl in ("difforge", "difforge_dot_product"):
            ours = next(r for r in records if r["impl"] == impl)
            assert ours["max_abs_diff_vs_diffusers"] < 1e-4  # same weights, same computation
    if name == "quantization":  # every mode and torchao's two, each with its PSNR
        impls = {r["impl"]: r["psnr_db"] for r in records}
        assert {"difforge_int8", "torchao_int8_weights", "torchao_int8_dynamic"} <= set(impls)
        assert impls["difforge"] > 80 and 15 < impls["difforge_int8"] < impls["difforge"]


def test_every_benchmark_has_a_test():
    assert set(bench_run.BENCHMARKS) == set(FAST) | set(SLOW)


def test_check_record_names_the_bad_key():
    good = timed_record("b", "c", "difforge", [1.0, 2.0, 3.0], flops=6e9)
    check_record(good)
    assert good["median_s"] == 2.0 and good["gflop_per_s"] == pytest.approx(3.0)
    with pytest.raises(ValueError, match="'impl'"):
        check_record({**good, "impl": ""})
    with pytest.raises(ValueError, match="median_s"):
        check_record({k: v for k, v in good.items() if k != "median_s"})
    with pytest.raises(ValueError, match="'value'"):
        check_record(value_record("b", "c", "x", float("nan"), "bytes") | {"value": "big"})


def test_derived_fractions_ratios_and_table():
    records = [
        timed_record("matmul", "n", "xla", [2.0], flops=100e9, dtype="fp32"),
        timed_record("matmul", "n", "numpy", [1.0], flops=100e9, dtype="fp32"),
        timed_record("matmul", "n-bf16", "torch", [0.5], flops=100e9, dtype="bf16"),
        timed_record("fwd", "S", "difforge", [2.0], flops=100e9),
        timed_record("fwd", "S", "diffusers_eager", [8.0], flops=100e9),
        value_record("memory_load", "m", "difforge", 1.1, "x weight bytes"),
    ]
    from bench.matmul import mark_limits

    mark_limits(records)
    assert records[1]["role"] == "limit" and records[2]["role"] == "limit_bf16"  # the fastest
    bench_run.add_derived(records)
    fwd, eager = records[3], records[4]
    assert fwd["frac_of_limit"] == pytest.approx(0.5)  # numpy's 100 GFLOP/s, not XLA's 50
    assert fwd["frac_of_bf16_limit"] == pytest.approx(0.25)
    assert eager["vs_difforge"] == pytest.approx(4.0)
    facts = {"date": "d", "backend": "cpu", "cpu_threads": 2, "load_average_at_start": None}
    table = bench_run.markdown_table(records, facts)
    assert "| fwd | S | diffusers_eager | 8.00 s |" in table and "4.00x" in table
    assert "50%" in table
    assert "Host allocator: not recorded" in table
    table = bench_run.markdown_table(records, {**facts, "host_allocator": "tcmalloc"})
    assert "Host allocator: tcmalloc (every peer runs in this process" in table


def test_bad_profile_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="profile"):
        BenchContext(tmp_path, profile="huge")


def _fake_run(seen: list):
    """A stand-in for the benchmarks: writes a model file into the scratch folder, as they do."""

    def run_benchmarks(names, ctx):
        (ctx.scratch("model") / "weights.safetensors").write_bytes(b"x" * 64)
        seen.append(ctx.workdir)
        return [value_record("memory_load", "c", "difforge", 1.0, "x weight bytes")]

    return run_benchmarks


@pytest.mark.parametrize("keep", [False, True])
def test_scratch_folder_is_removed_unless_named(keep, tmp_path, monkeypatch):
    # A full run writes ~2 GiB of models into its scratch folder; left in /tmp, a few runs
    # filled the disk (a CI install then failed with ENOSPC).
    import tempfile

    from jaxcore import host_memory

    seen: list = []
    monkeypatch.setattr(bench_run, "run_benchmarks", _fake_run(seen))
    monkeypatch.setattr(host_memory, "keep_freed_host_memory", lambda: False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    argv = ["--out", str(tmp_path / "results")]
    if keep:
        argv += ["--workdir", str(tmp_path / "kept")]
    assert bench_run.main(argv) == 0
    assert (tmp_path / "results" / "latest.json").exists()
    (workdir,) = seen
    if keep:
        assert workdir == tmp_path / "kept"
        assert (workdir / "model" / "weights.safetensors").exists()
    else:
        assert workdir.parent == tmp_path and workdir.name.endswith("-bench")
        assert not workdir.exists()
