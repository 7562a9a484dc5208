"""generate with step caching: calibrate -> MagCache from the calibration artifact with the
quality gate (PSNR / SSIM against the dense render, report, grid, floor), First-Block-Cache
counters in records and manifest, resume fingerprints. The skip decisions themselves are
proven against diffusers in tests/jaxcore/test_step_cache.py; here the stage is checked to
render exactly what the library renders for the same settings."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest

from jaxcore import step_cache, storage
from jaxcore.artifacts import open_artifact
from jaxcore.families import load_pipeline
from jaxcore.sampling import initial_latents
from pipelines import cli
from pipelines.embedded.tiny import build_tiny_wan_pipeline

REPO = Path(__file__).resolve().parents[2]
STEPS = 8
PROMPTS = [
    {"id": "a", "prompt": "a red circle", "seed": 1},
    {"id": "b", "prompt": "blue square", "seed": 2, "guidance_scale": 4.0},
    {"id": "c", "prompt": "green star", "seed": 3},
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return build_tiny_wan_pipeline(
        tmp_path_factory.mktemp("tiny_wan"), seed=1, transformer_output_scale=20.0
    )


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return str(path)


def _cli(stage: str, model, prompts: str, out, *extra: str) -> int:
    return cli.main(
        [
            stage,
            str(REPO / "configs/stages/generate.yml"),
            f"pretrained_model_name_or_path={model}",
            f"prompt_file={prompts}",
            f"output_dir={out}",
            f"num_inference_steps={STEPS}",
            "height=16",
            "width=16",
            "num_frames=1",
            "guidance_scale=1.0",
            "save_arrays=true",
            "-q",
            *extra,
        ]
    )


def _array(root, name: str) -> np.ndarray:
    return np.load(io.BytesIO(storage.read_bytes(storage.join(str(root), f"outputs/{name}.npy"))))


@pytest.fixture(scope="module")
def calibration(tiny_dir, prompt_file, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("runs") / "calibration"
    assert _cli("calibrate", tiny_dir, prompt_file, out) == 0
    return out


def test_calibrate_writes_ratios_per_setting(calibration):
    summary = open_artifact(str(calibration), "generate").summary
    (entry,) = summary["magcache_calibration"]
    assert entry["num_inference_steps"] == STEPS and entry["prompts"] == 3
    assert entry["scheduler"] == "unipc" and len(entry["ratios"]) == STEPS
    assert entry["ratios"][0] == 1.0 and "negative_ratios" in entry  # prompt b used CFG
    records = [json.loads(p.read_text()) for p in sorted((calibration / "records").glob("*.json"))]
    per_prompt = np.mean([r["cache"]["ratios"] for r in records], axis=0)
    np.testing.assert_allclose(entry["ratios"], per_prompt, atol=1e-6)
    assert all(r["cache"]["block_stack_skips"] == 0 for r in records)  # dense: nothing skipped


def test_magcache_from_calibration_with_quality_gate(calibration, tiny_dir, prompt_file, tmp_path):
    out = tmp_path / "cached"
    settings = [
        "cache.kind=magcache",
        f"cache.calibration={calibration}",
        "cache.threshold=0.5",
        "cache.retention_ratio=0.25",
        "cache.compare_dense=true",
        "cache.min_psnr=5",
    ]
    assert _cli("generate", tiny_dir, prompt_file, out, *settings) == 0
    summary = open_artifact(str(out), "generate").summary
    cache = summary["cache"]
    assert cache["block_stack_skips"] > 0 and cache["evaluation_ratio"] > 1.0
    quality = cache["quality"]
    assert quality["below_floor"] == [] and quality["min_psnr"] >= 5
    assert (out / "cache_report.json").is_file() and (out / "cache_comparison.png").is_file()
    assert "Step cache vs dense" in (out / "index.html").read_text()
    # the stage renders exactly what the library renders with the same schedule
    ratios = open_artifact(str(calibration), "generate").summary["magcache_calibration"][0]
    config = step_cache.CacheConfig(
        "magcache", threshold=0.5, retention_ratio=0.25, mag_ratios=tuple(ratios["ratios"])
    )
    schedule = step_cache.schedule_for(config, config.mag_ratios, STEPS)
    pipe = load_pipeline(tiny_dir)
    spec = PROMPTS[0]
    record = json.loads((out / "records" / f"{spec['id']}.json").read_text())
    latents = initial_latents(record["params"]["seed"], pipe.latent_shape(16, 16, 1))[None]
    cond = pipe.encode_prompts([spec["prompt"]], 512)
    z, stats = pipe.sample_with_stats(
        latents,
        cond,
        num_inference_steps=STEPS,
        cache=step_cache.plan_of(config),
        cache_schedule=schedule,
    )
    np.testing.assert_allclose(_array(out, "a")[0], np.asarray(pipe.decode(z))[0, 0], atol=1e-5)
    assert record["cache"]["block_stack_runs"] == int(schedule.sum())
    dense = np.asarray(storage.read_bytes(str(out / record["cache"]["dense_output"])))
    assert dense.size and record["cache"]["psnr"] < 200  # a real comparison, not identity

    # a floor the cache cannot meet fails the run after writing the report; nothing commits
    failing = tmp_path / "failing"
    args = [*settings[:-1], "cache.min_psnr=200"]
    assert _cli("generate", tiny_dir, prompt_file, failing, *args) == 2
    assert not (failing / "manifest.json").exists() and (failing / "cache_report.json").is_file()


def test_first_block_counts_and_resume_fingerprints(tiny_dir, prompt_file, tmp_path, capsys):
    out = tmp_path / "fbc"
    settings = ["cache.kind=first_block", "cache.threshold=0.95"]
    assert _cli("generate", tiny_dir, prompt_file, out, *settings) == 0
    summary = open_artifact(str(out), "generate").summary
    records = {p.stem: json.loads(p.read_text()) for p in (out / "records").glob("*.json")}
    branches = {"a": 1, "b": 2, "c": 1}
    for name, record in records.items():
        c = record["cache"]
        assert c["kind"] == "first_block"
        assert c["block_stack_runs"] + c["block_stack_skips"] == branches[name] * STEPS
    assert summary["cache"]["block_stack_skips"] == sum(
        r["cache"]["block_stack_skips"] for r in records.values()
    )
    before = (out / "manifest.json").read_bytes()
    assert _cli("generate", tiny_dir, prompt_file, out, *settings) == 0
    assert (out / "manifest.json").read_bytes() == before  # same settings: nothing redone
    # another threshold changes the pixels: every prompt is rendered again (with --force)
    assert _cli("generate", tiny_dir, prompt_file, out, "cache.kind=first_block", "--force") == 0
    again = open_artifact(str(out), "generate").summary
    assert again["rendered_this_run"] == len(PROMPTS)


def test_bad_cache_settings_are_named_before_rendering(tiny_dir, prompt_file, tmp_path, capsys):
    out = tmp_path / "bad"
    assert _cli("generate", tiny_dir, prompt_file, out, "cache.kind=magcache") == 2
    assert "mag_ratios" in capsys.readouterr().err
    missing = tmp_path / "nothing"
    args = ["cache.kind=magcache", f"cache.calibration={missing}"]
    assert _cli("generate", tiny_dir, prompt_file, out, *args) == 2
    assert "cache.calibration" in capsys.readouterr().err
    assert _cli("calibrate", tiny_dir, prompt_file, out, "cache.kind=first_block") == 2
    assert "calibrate" in capsys.readouterr().err
    assert not out.exists()


def test_psnr_and_ssim_equal_scikit_image():
    from skimage.metrics import peak_signal_noise_ratio, structural_similarity

    from stages.generate import quality

    rng = np.random.default_rng(0)
    for shape in [(32, 32, 3), (16, 24, 3), (2, 40, 36, 3)]:
        a = rng.uniform(0, 1, shape)
        b = np.clip(a + rng.normal(0, 0.05, shape), 0, 1)
        assert quality.psnr(a, b) == pytest.approx(peak_signal_noise_ratio(a, b, data_range=1))
        frames = (a, b) if a.ndim == 3 else (a[None], b[None])
        expected = np.mean(
            [
                structural_similarity(
                    x, y, gaussian_weights=True, sigma=1.5, use_sample_covariance=False,
                    data_range=1, channel_axis=-1,
                )
                for x, y in zip(frames[0].reshape(-1, *shape[-3:]), frames[1].reshape(-1, *shape[-3:]), strict=True)
            ]
        )  # fmt: skip
        assert quality.ssim(a, b) == pytest.approx(expected, abs=1e-12)
    assert quality.psnr(a, a) == float("inf") and quality.ssim(a, a) == pytest.approx(1.0)
