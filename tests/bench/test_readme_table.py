"""bench/readme.py: the README's benchmark table comes from one run's results, ratios included."""

from __future__ import annotations

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
