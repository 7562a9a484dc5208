"""bench.compare: two runs side by side, difforge's medians and its ratio to the reference."""

import json

import pytest

from bench import compare


def _record(bench, case, impl, median_s, unit="s"):
    return {"bench": bench, "case": case, "impl": impl, "median_s": median_s, "unit": unit}


def test_rows_pair_difforge_medians_and_reference_ratios():
    a = [
        _record("transformer_forward", "S", "difforge", 0.4),
        _record("transformer_forward", "S", "diffusers_eager", 0.5),
        _record("train_step", "S", "difforge", 2.0),
        _record("train_step", "S", "pytorch eager", 2.0),
        _record("convert", "tiny", "difforge_beam", 1.0),
        _record("memory_load", "274MiB", "difforge", 1.1, unit="x"),  # not a time
        _record("vae_encode", "only-in-a", "difforge", 1.0),
    ]
    b = [
        _record("transformer_forward", "S", "difforge", 0.2),
        _record("transformer_forward", "S", "diffusers_eager", 0.6),
        _record("train_step", "S", "difforge", 2.5),
        _record("convert", "tiny", "difforge_beam", 0.5),
        _record("memory_load", "274MiB", "difforge", 1.0, unit="x"),
    ]
    table = {(row["bench"], row["case"]): row for row in compare.rows(a, b)}
    assert set(table) == {("transformer_forward", "S"), ("train_step", "S"), ("convert", "tiny")}
    forward = table["transformer_forward", "S"]
    assert forward["a_over_b"] == pytest.approx(2.0)
    assert forward["a_vs_reference"] == pytest.approx(1.25)
    assert forward["b_vs_reference"] == pytest.approx(3.0)
    step = table["train_step", "S"]
    assert step["a_over_b"] == pytest.approx(0.8)
    assert step["a_vs_reference"] == pytest.approx(1.0) and step["b_vs_reference"] is None
    assert table["convert", "tiny"]["a_vs_reference"] is None


def test_main_prints_one_line_per_row_with_the_runs_jax_versions(tmp_path, capsys):
    for name, jax_version, median in (("a", "0.10.2", 0.3), ("b", "0.12.1", 0.2)):
        run = {
            "machine": {"jax": jax_version},
            "results": [_record("flux_forward", "S", "difforge", median)],
        }
        (tmp_path / f"{name}.json").write_text(json.dumps(run))
    assert compare.main([str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "jax 0.10.2" in lines[0] and "jax 0.12.1" in lines[0]
    assert lines[2].startswith("| flux_forward | S |") and "1.50x" in lines[2]
