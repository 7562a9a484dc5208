"""generate with ``model.quantized_cache``: the first quantized run writes the denoisers'
quantized weights as an artifact, later runs load them from it without reading the float
weights and render the same pixels bit for bit; a rewritten weight file makes a new entry, a
two-expert model caches both experts, and asking for the cache without quantization is
refused by name."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from jaxcore.artifacts import open_artifact
from jaxcore.families.base import Family
from pipelines import cli
from pipelines.embedded.tiny import build_tiny_wan_pipeline
from tests.support.wan_variants import build_two_expert_pipeline

REPO = Path(__file__).resolve().parents[2]
PROMPTS = [
    {"id": "a", "prompt": "a red circle", "seed": 1},
    {"id": "b", "prompt": "blue", "seed": 2},
]


def _generate(model, prompts, out, *extra) -> int:
    return cli.main(
        [
            "generate",
            str(REPO / "configs/stages/generate.yml"),
            f"pretrained_model_name_or_path={model}",
            f"prompt_file={prompts}",
            f"output_dir={out}",
            "num_inference_steps=2",
            "height=16",
            "width=16",
            "num_frames=1",
            "guidance_scale=1.0",
            "save_arrays=true",
            "-q",
            *extra,
        ]
    )


@pytest.fixture
def prompts(tmp_path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return path


def _renders(out: Path) -> list[np.ndarray]:
    return [np.load(out / "outputs" / f"{p['id']}.npy") for p in PROMPTS]


def _no_float_loads(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the float denoiser weights were read")

    monkeypatch.setattr(Family, "load_denoiser", refuse)


@pytest.mark.parametrize("mode", ["int8", "fp8_weights"])
def test_the_first_run_writes_the_cache_and_later_runs_load_it(
    tmp_path, prompts, monkeypatch, mode
):
    model = build_tiny_wan_pipeline(tmp_path / "wan", seed=1, transformer_output_scale=20.0)
    cache = tmp_path / "quantized"
    settings = [f"quantization={mode}", f"model.quantized_cache={cache}"]
    assert _generate(model, prompts, tmp_path / "first", *settings) == 0
    entry = open_artifact(str(tmp_path / "first"), "generate").summary["model"]["quantized_weights"]
    assert Path(entry).parent == cache
    stored = open_artifact(entry, "quantize")
    assert stored.summary["quantization"] == mode
    assert {f["path"] for f in stored.files} == {"transformer.safetensors"}

    with monkeypatch.context() as patched:
        _no_float_loads(patched)
        assert _generate(model, prompts, tmp_path / "second", *settings) == 0
    for first, second in zip(
        _renders(tmp_path / "first"), _renders(tmp_path / "second"), strict=True
    ):
        np.testing.assert_array_equal(first, second)
    plain = tmp_path / "plain"
    assert _generate(model, prompts, plain, f"quantization={mode}") == 0  # no cache: the same
    np.testing.assert_array_equal(_renders(plain)[0], _renders(tmp_path / "second")[0])

    # weights rewritten in place: another entry, not the stale one
    weights = next((model / "transformer").glob("*.safetensors"))
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    assert _generate(model, prompts, tmp_path / "third", *settings) == 0
    third = open_artifact(str(tmp_path / "third"), "generate").summary["model"]["quantized_weights"]
    assert third != entry and len(list(cache.iterdir())) == 2


def test_a_two_expert_model_caches_both_experts(tmp_path, prompts, monkeypatch):
    model = build_two_expert_pipeline(tmp_path / "a14b", seed=2)
    settings = ["quantization=int8_weights", f"model.quantized_cache={tmp_path / 'q'}"]
    assert _generate(model, prompts, tmp_path / "first", *settings) == 0
    entry = open_artifact(str(tmp_path / "first"), "generate").summary["model"]["quantized_weights"]
    files = {f["path"] for f in open_artifact(entry, "quantize").files}
    assert files == {"transformer.safetensors", "transformer_2.safetensors"}
    with monkeypatch.context() as patched:
        _no_float_loads(patched)
        assert _generate(model, prompts, tmp_path / "second", *settings) == 0
    for first, second in zip(
        _renders(tmp_path / "first"), _renders(tmp_path / "second"), strict=True
    ):
        np.testing.assert_array_equal(first, second)


def test_the_cache_without_quantization_is_refused_by_name(tmp_path, prompts, capsys):
    out = tmp_path / "run"
    assert _generate(tmp_path / "no-model", prompts, out, f"model.quantized_cache={tmp_path}") == 2
    assert "model.quantized_cache keeps quantized denoiser weights" in capsys.readouterr().err
