"""bench/readme.py: docs/benchmarks.md's tables come from one run's results, ratios included."""

from __future__ import annotations

import json

import pytest

from bench import readme


def record(bench, case, impl, median_s, **extra):
    return {"bench": bench, "case": case, "impl": impl, "unit": "s", "median_s": median_s, **extra}


def test_table_quotes_the_run_and_judges_each_goal():
    run = {
        "results": [
            record("transformer_forward", "S", "difforge", 0.5, frac_of_limit=0.6),
            record("transformer_forward", "S", "diffusers_eager", 0.4),
            record("transformer_forward", "S", "diffusers_compile", 0.6),
            record("transformer_forward", "S-bf16", "difforge", 0.2, frac_of_bf16_limit=0.5),
            record("transformer_forward", "S-bf16", "diffusers_eager", 0.25),
            record("train_step", "S-bf16-mixed", "difforge", 1.0),
            record("train_step", "S-bf16-mixed", "pytorch eager", 1.5),
            record("train_step", "M", "difforge", 4.0),
            record("train_step", "M", "pytorch eager", 4.4),
            record("train_step", "M", "pytorch compile", 3.6),
        ]
    }
    lines = readme.table(run).splitlines()
    assert lines[0].startswith("| what | difforge | reference |")
    s_row = next(line for line in lines if "Wan DiT forward, S |" in line)
    assert "500.0 ms (60% of the fp32 limit)" in s_row
    assert "0.80x (**not met**) eager" in s_row and "1.20x (met) compile" in s_row
    bf16_row = next(line for line in lines if "S-bf16 |" in line)
    assert "(50% of the bf16 limit)" in bf16_row and "1.25x (met)" in bf16_row
    train = next(line for line in lines if "S-bf16-mixed" in line)
    assert "autocast bf16" in train and "1.50x (met) eager" in train and "compile" not in train
    m_train = next(line for line in lines if "AdamW), M |" in line)
    assert "`torch.compile` 3.60 s" in m_train
    assert "1.10x (met) eager" in m_train and "0.90x (**not met**) compile" in m_train
    # benchmarks the run skipped leave no row
    assert not any("Flux" in line or "convert" in line for line in lines)


def test_maxdiffusion_rows_judge_against_their_own_goals():
    run = {
        "results": [
            record("maxdiffusion_forward", "S", "difforge", 0.5),
            record("maxdiffusion_forward", "S", "maxdiffusion", 0.6),  # 1.2x: under 1.3x
            record("maxdiffusion_train", "M-bf16-mixed", "difforge", 2.0),
            record("maxdiffusion_train", "M-bf16-mixed", "maxdiffusion", 2.5),  # 1.25x: over 1.2x
            record("maxdiffusion_vae_decode", "wan-5x64x64", "difforge", 1.0),
            record("maxdiffusion_vae_decode", "wan-5x64x64", "maxdiffusion", 0.9),  # 0.9x: slower
        ]
    }
    lines = readme.table(run).splitlines()
    forward = next(line for line in lines if "forward vs MaxDiffusion, S" in line)
    assert "1.20x (**not met**)" in forward and "`dot_product`" in forward
    train = next(line for line in lines if "forward + backward, M-bf16-mixed" in line)
    assert "1.25x (met)" in train and "fwd + bwd + AdamW" in train
    vae = next(line for line in lines if "VAE decode vs MaxDiffusion, wan-5x64x64" in line)
    assert "0.90x (**not met**)" in vae
    assert not any("MaxDiffusion, M" in line or "backward, S" in line for line in lines)
    assert not any("encode vs MaxDiffusion" in line for line in lines)


def test_write_replaces_only_the_named_table(tmp_path, monkeypatch):
    doc = tmp_path / "benchmarks.md"
    latest_start, latest_end = readme.markers("latest")
    other_start, other_end = readme.markers("maxdiffusion")
    before = f"# Benchmarks\n\n{latest_start}\nold table\n{latest_end}\n\ntext\n"
    kept = f"{other_start}\nother table\n{other_end}\n"
    doc.write_text(before + kept)
    run = {"results": [record("transformer_forward", "S", "difforge", 0.5)]}
    results = tmp_path / "latest.json"
    results.write_text(json.dumps(run))
    monkeypatch.setattr(readme, "DOC", doc)
    assert readme.main([str(results), "--write"]) == 0
    text = doc.read_text()
    assert f"{latest_start}\n{readme.table(run)}\n{latest_end}\n\ntext\n" in text
    assert "old table" not in text and text.endswith(kept)
    assert text.startswith("# Benchmarks\n\n")


def test_write_refuses_a_document_without_the_markers(tmp_path):
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n")
    with pytest.raises(ValueError, match="bench table: latest"):
        readme.write_table(doc, "latest", "| a |")
    assert doc.read_text() == "# Benchmarks\n"


def test_the_docs_carry_the_tables_of_the_stored_runs():
    """docs/benchmarks.md quotes bench/results/{latest,maxdiffusion}.json as --write puts them."""
    doc = readme.DOC.read_text()
    for name in ("latest", "maxdiffusion"):
        start, end = readme.markers(name)
        quoted = doc.split(start, 1)[1].split(end, 1)[0].strip()
        run = json.loads((readme.RESULTS_DIR / f"{name}.json").read_text())
        fix = f"python -m bench.readme bench/results/{name}.json --write"
        assert quoted == readme.table(run), f"{name}: the docs quote another run; {fix}"
