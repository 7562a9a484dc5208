"""generate stage, end to end on a tiny random-init pipeline (fp32, CPU, 8 virtual devices).

- Parity: ``difforge generate`` with initial latents given per prompt (.npy through .jsonl)
  reproduces diffusers' ``WanPipeline(latents=..., output_type="np")``, with and without
  guidance, within 1e-4 on [0, 1] pixels (reached ~2e-6).
- Batch size 1 vs 4 and 1 vs 8 devices give the same pixels within 1e-5.
- A kill -9 halfway through 40 prompts, then a rerun, renders only the rest and ends equal to
  an uninterrupted run (slow tier).
- Local folder and gs:// (local GCS server).
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxcore import storage
from jaxcore.artifacts import open_artifact
from jaxcore.families import load_pipeline
from jaxcore.sampling import initial_latents
from jaxcore.sharding import make_mesh
from pipelines import cli
from pipelines.embedded.tiny import build_tiny_wan_pipeline
from tests.support.encoder_calls import record_encoder_calls

REPO = Path(__file__).resolve().parents[2]
TOLERANCE = 1e-4
INVARIANCE_TOLERANCE = 1e-5
STEPS = 3
# (id, prompt, negative, guidance, frames, seed of the given latents)
CASES = [
    ("plain-image", "a red circle", "", 1.0, 1, 10),
    ("plain-video", "blue square moving left", "", 1.0, 5, 11),
    ("cfg-image", "green star", "dark background", 4.0, 1, 12),
    ("cfg-video", "gold ring spinning", "gray", 4.0, 5, 13),
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return build_tiny_wan_pipeline(
        tmp_path_factory.mktemp("tiny_wan"), seed=1, transformer_output_scale=20.0
    )


def _latents(frames: int, seed: int) -> np.ndarray:
    return initial_latents(seed, (4, (frames - 1) // 2 + 1, 8, 8))


@pytest.fixture(scope="module")
def prompt_folder(tmp_path_factory) -> Path:
    """A .jsonl with per-prompt latents (relative .npy paths) and settings."""
    folder = tmp_path_factory.mktemp("prompts")
    (folder / "noise").mkdir()
    lines = []
    for case_id, prompt, negative, guidance, frames, seed in CASES:
        np.save(folder / "noise" / f"{case_id}.npy", _latents(frames, seed)[None])
        lines.append(
            json.dumps(
                {
                    "id": case_id,
                    "prompt": prompt,
                    "negative_prompt": negative,
                    "guidance_scale": guidance,
                    "num_frames": frames,
                    "latents": f"noise/{case_id}.npy",
                }
            )
        )
    (folder / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    return folder


@pytest.fixture(scope="module")
def reference(tiny_dir) -> dict[str, np.ndarray]:
    """diffusers WanPipeline frames [F, H, W, 3] per case, from the same latents."""
    import torch
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(tiny_dir)
    out = {}
    for case_id, prompt, negative, guidance, frames, seed in CASES:
        out[case_id] = pipe(
            prompt=prompt,
            negative_prompt=negative,
            height=16,
            width=16,
            num_frames=frames,
            num_inference_steps=STEPS,
            guidance_scale=guidance,
            latents=torch.from_numpy(_latents(frames, seed)[None]),
            output_type="np",
        ).frames[0]
    return out


def _generate(model: Path, prompt_file: str, output_dir: str, *extra: str) -> int:
    return cli.main(
        [
            "generate",
            str(REPO / "configs/stages/generate.yml"),
            f"pretrained_model_name_or_path={model}",
            f"prompt_file={prompt_file}",
            f"output_dir={output_dir}",
            f"num_inference_steps={STEPS}",
            "save_arrays=true",
            "-q",
            *extra,
        ]
    )


def _array(root: str, name: str) -> np.ndarray:
    return np.load(io.BytesIO(storage.read_bytes(storage.join(root, f"outputs/{name}.npy"))))


def _check_run(root: str, reference: dict[str, np.ndarray]) -> None:
    manifest = open_artifact(root, "generate")
    summary = manifest.summary
    assert summary["num_prompts"] == len(CASES)
    assert [p["id"] for p in summary["prompts"]] == [c[0] for c in CASES]
    for entry in summary["prompts"]:
        ours = _array(root, entry["name"])
        np.testing.assert_allclose(ours, reference[entry["id"]], atol=TOLERANCE, rtol=0)
        frames = entry["params"]["num_frames"]
        assert entry["output"].endswith(".png" if frames == 1 else ".mp4")
        assert entry["output"] in {f["path"] for f in manifest.files}
    html = storage.read_text(storage.join(root, "index.html"))
    assert "gold ring spinning" in html and "cfg-video.mp4" in html
    sheet = storage.read_bytes(storage.join(root, "contact_sheet.png"))
    assert sheet.startswith(b"\x89PNG")


def test_generate_matches_diffusers_locally(tiny_dir, prompt_folder, reference, tmp_path):
    out = str(tmp_path / "run")
    assert _generate(tiny_dir, str(prompt_folder / "prompts.jsonl"), out) == 0
    _check_run(out, reference)
    # The reference is not trivially matched: guidance and prompts change the pixels.
    assert np.abs(reference["cfg-image"] - reference["plain-image"]).max() > 1e-3
    # A rerun finds the finished artifact and renders nothing.
    before = (Path(out) / "manifest.json").read_bytes()
    assert _generate(tiny_dir, str(prompt_folder / "prompts.jsonl"), out) == 0
    assert (Path(out) / "manifest.json").read_bytes() == before


def test_generate_with_int8_kernels_records_the_mode_and_stays_near_diffusers(
    tiny_dir, prompt_folder, reference, tmp_path, capsys
):
    """compute.quantization=int8_weights: the manifest's config says so, and every render is
    within 0.05 of diffusers' float one on [0, 1] pixels (measured: 0.007-0.015; the tiny
    model's output is scaled 20x) but not equal. The quality gate (cache.compare_dense)
    renders the float model beside it: each record's PSNR is the one against diffusers' float
    render (within 0.05 dB: the float render is diffusers' within 1e-4), and a floor the
    quantized model cannot meet fails the run with nothing committed. Train refuses the key."""
    from stages.generate import quality

    out = str(tmp_path / "int8")
    prompts = str(prompt_folder / "prompts.jsonl")
    gate = ["cache.compare_dense=true", "cache.min_psnr=20"]
    assert _generate(tiny_dir, prompts, out, "quantization=int8_weights", *gate) == 0
    manifest = open_artifact(out, "generate")
    assert manifest.config["compute"]["quantization"] == "int8_weights"
    differences = [
        np.abs(_array(out, entry["name"]) - reference[entry["id"]]).max()
        for entry in manifest.summary["prompts"]
    ]
    assert 0 < max(differences) < 0.05, differences
    gate_report = manifest.summary["cache"]["quality"]
    assert gate_report["compared"] == "int8_weights" and gate_report["below_floor"] == []
    for entry in manifest.summary["prompts"]:
        record = json.loads(storage.read_text(storage.join(out, f"records/{entry['name']}.json")))
        measured = quality.psnr(reference[entry["id"]], _array(out, entry["name"]))
        assert abs(record["cache"]["psnr"] - measured) < 0.05, (entry["id"], record["cache"])
        assert record["quantization"] == "int8_weights"
        assert record["cache"]["dense_output"].endswith(".dense.png")
    assert "int8_weights vs dense" in storage.read_text(storage.join(out, "index.html"))
    failing = str(tmp_path / "floor")
    floor = ["cache.compare_dense=true", "cache.min_psnr=200"]
    assert _generate(tiny_dir, prompts, failing, "quantization=int8_weights", *floor) == 2
    assert not storage.exists(storage.join(failing, "manifest.json"))
    train = ["train", str(REPO / "configs/stages/train.yml"), f"output_dir={tmp_path / 't'}"]
    assert cli.main([*train, "quantization=int8_weights"]) != 0
    assert "compute.quantization=int8_weights: train runs its products" in capsys.readouterr().err


@pytest.mark.gcs
def test_generate_to_gcs(tiny_dir, prompt_folder, reference, gcs_root):
    prompts_uri = storage.join(gcs_root, "in/prompts.jsonl")
    storage.upload_file(prompt_folder / "prompts.jsonl", prompts_uri)
    for case in CASES:
        name = f"noise/{case[0]}.npy"
        storage.upload_file(prompt_folder / name, storage.join(gcs_root, "in", name))
    out = storage.join(gcs_root, "run")
    assert _generate(tiny_dir, prompts_uri, out) == 0
    _check_run(out, reference)


def test_bad_prompt_file_fails_before_loading_the_model(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": "x", "steps": 3}\n')
    out = tmp_path / "run"
    assert _generate(tmp_path / "no-model-here", str(bad), str(out)) == 2
    assert "bad.jsonl line 2: unknown field(s) ['steps']" in capsys.readouterr().err
    assert not out.exists()


def test_a_line_too_big_for_the_machine_is_refused_before_loading(
    tiny_dir, tmp_path, capsys, monkeypatch
):
    """65536x65536 at 81 frames (the issue's line: numpy's 'Unable to allocate 246. GiB' once
    the model had loaded) is refused up front, naming the line and the memory it needs."""
    from stages.generate import model

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(model, "load", no_load)
    prompts = tmp_path / "big.jsonl"
    prompts.write_text(
        '{"prompt": "fine"}\n'
        '{"prompt": "huge", "height": 65536, "width": 65536, "num_frames": 81}\n'
    )
    out = tmp_path / "run"
    assert _generate(tiny_dir, str(prompts), str(out)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert (
        "big.jsonl line 2 (id '00001'): a 65536x65536, 81 frame(s) render needs at least" in err[0]
    )
    assert "GiB of host memory" in err[0] or "GiB on one device" in err[0]
    assert not (out / "manifest.json").exists()


def test_the_memory_floor_counts_latents_and_frames(tiny_dir):
    """The floor is what a render cannot do without; it refuses only what cannot fit."""
    from jaxcore.config import load_config
    from stages.common.errors import StageInputError
    from stages.generate import model, render
    from stages.generate.config import GenerateConfig, SamplingSection
    from stages.generate.prompts import parse_prompts

    defaults = SamplingSection(num_inference_steps=2, guidance_scale=4.0)
    config = load_config(
        GenerateConfig,
        REPO / "configs/stages/generate.yml",
        [f"pretrained_model_name_or_path={tiny_dir}", "prompt_file=p.txt", "output_dir=o"],
    )
    source = model.describe(config)
    line = '{"prompt": "x", "height": 64, "width": 32, "num_frames": 5}'
    spec = parse_prompts("p.jsonl", [line], defaults)[0]
    latent = source.latent_shape(64, 32, 5)
    on_device, on_host = render.render_bytes_floor(spec, source.latent_shape)
    assert on_device == 3 * 4 * int(np.prod(latent)) + 4 * 64 * 32 * 5 * 3
    assert on_host == 5 * 64 * 32 * 5 * 3
    render.check_memory(
        [spec], source.latent_shape, "p.jsonl", host_bytes=on_host, device_bytes=on_device
    )
    with pytest.raises(StageInputError, match="p.jsonl line 1 .* GiB of host memory"):
        render.check_memory([spec], source.latent_shape, "p.jsonl", host_bytes=on_host - 1)
    with pytest.raises(StageInputError, match="p.jsonl line 1 .* GiB on one device"):
        render.check_memory([spec], source.latent_shape, "p.jsonl", device_bytes=on_device - 1)


def _render(pipe, specs, batch_size: int) -> dict[str, np.ndarray]:
    from stages.generate import render

    results = {}

    def keep(spec, video, seconds, size, extra):
        results[spec.id] = video
        return {}

    batches = render.plan_batches(specs, batch_size, pipe.batch_ways)
    render.render_batches(pipe, batches, scheduler="unipc", max_sequence_length=64, on_result=keep)
    return results


def test_same_pixels_for_any_batch_size_and_device_count(tiny_dir):
    from stages.generate.config import SamplingSection
    from stages.generate.prompts import parse_prompts

    defaults = SamplingSection(
        height=16, width=16, num_frames=1, num_inference_steps=2, guidance_scale=4.0
    )
    specs = parse_prompts("p.txt", ["red", "blue circle", "a green star", "gold"], defaults)
    specs = [s.__class__(**{**s.__dict__, "flow_shift": 3.0}) for s in specs]
    one_device = load_pipeline(tiny_dir, mesh=make_mesh(devices=jax.devices()[:1]))
    eight = load_pipeline(tiny_dir, mesh=make_mesh())
    assert (one_device.batch_ways, eight.batch_ways) == (1, 8)
    runs = {
        "1 device, batch 1": _render(one_device, specs, 1),
        "1 device, batch 4": _render(one_device, specs, 4),
        "8 devices, batch 4": _render(eight, specs, 4),
    }
    base = runs.pop("1 device, batch 1")
    assert np.abs(base["00000"] - base["00001"]).max() > 1e-3  # prompts differ
    for label, result in runs.items():
        for spec in specs:
            np.testing.assert_allclose(
                result[spec.id], base[spec.id], atol=INVARIANCE_TOLERANCE, rtol=0, err_msg=label
            )


def test_prompts_of_the_next_batches_are_encoded_together(tiny_dir, monkeypatch):
    """20 prompts with CFG, batch 1: two encoder calls of at most ENCODE_BATCH texts (15
    prompts + the negative, then 5 + the negative: once per group, so a run resumed in the
    second group encodes it as this one did), and the same pixels as encoding each batch on
    its own."""
    from jaxcore.pipeline import ENCODE_BATCH
    from stages.generate.config import SamplingSection
    from stages.generate.prompts import parse_prompts

    defaults = SamplingSection(
        height=16, width=16, num_frames=1, num_inference_steps=2, guidance_scale=4.0
    )
    specs = parse_prompts("p.txt", [f"red circle {i}" for i in range(20)], defaults)
    pipe = load_pipeline(tiny_dir, mesh=make_mesh(devices=jax.devices()[:1]))
    encode = pipe.family.encode_prompts
    calls = record_encoder_calls(pipe, monkeypatch)
    together = _render(pipe, specs, 1)
    assert ENCODE_BATCH == 16
    assert [len(c) for c in calls] == [16, 8]  # 16 texts, then 6 padded to 8 rows
    assert sorted(calls[0]) == sorted(["", *(f"red circle {i}" for i in range(15))])
    assert sorted(set(calls[1])) == sorted(["", *(f"red circle {i}" for i in range(15, 20))])
    assert [sum(text == "" for text in c) for c in calls] == [1, 1]

    monkeypatch.setattr(pipe.family, "encode_prompts", encode)
    alone = {}
    for spec in specs[:3]:  # a fresh memo per batch: each batch encodes its own texts
        pipe.encodings = type(pipe.encodings)()
        alone.update(_render(pipe, [spec], 1))
    for spec in specs[:3]:
        np.testing.assert_allclose(
            together[spec.id], alone[spec.id], atol=INVARIANCE_TOLERANCE, rtol=0
        )


def test_kill_and_resume_renders_only_the_rest(tiny_dir, tmp_path):
    """SIGTERM (preemption): the batch in flight finishes, exit 75, no manifest; SIGKILL of
    the rerun: every visible file is complete; the last rerun renders only the rest."""
    # Enough prompts that the renders after each stop outlast the poll-and-signal gap: the tiny
    # model renders ~30 prompts/s here, and 40 could all finish between a poll and the kill.
    count = 120
    prompts = tmp_path / "prompts.txt"
    words = ["red", "blue", "green", "gold", "circle", "star", "ring", "square"]
    prompts.write_text("\n".join(f"{words[i % 8]} {words[(i * 3) % 8]} {i}" for i in range(count)))
    killed = tmp_path / "killed"
    common = [
        f"pretrained_model_name_or_path={tiny_dir}",
        f"prompt_file={prompts}",
        "num_inference_steps=2",
        "guidance_scale=1",
        "save_arrays=true",
    ]
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=1 --xla_backend_optimization_level=0",
    }
    records = killed / "records"

    def start_and_stop(sig, at_least: int) -> int:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pipelines.cli", "generate", "configs/stages/generate.yml"]
            + [f"output_dir={killed}", *common, "-q"],
            cwd=REPO,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 600
        while not (records.is_dir() and len(list(records.glob("*.json"))) >= at_least):
            assert proc.poll() is None, "the generate subprocess ended before it was stopped"
            assert time.monotonic() < deadline, "no progress within 10 minutes"
            time.sleep(0.2)
        proc.send_signal(sig)
        return proc.wait(timeout=300)

    assert start_and_stop(signal.SIGTERM, 5) == 75  # EXIT_PREEMPTED: retry me
    after_term = len(list(records.glob("*.json")))
    assert 5 <= after_term < count and not (killed / "manifest.json").exists()
    assert not list(killed.rglob("*.partial"))  # the batch in flight was finished, not cut
    assert start_and_stop(signal.SIGKILL, after_term + 5) == -signal.SIGKILL
    done_before = len(list(records.glob("*.json")))
    assert after_term + 5 <= done_before < count and not (killed / "manifest.json").exists()
    for png in (killed / "outputs").glob("*.png"):  # every visible file is complete
        from PIL import Image

        Image.open(png).load()

    argv = ["generate", "configs/stages/generate.yml", *common]
    assert cli.main([*argv, f"output_dir={killed}", "-q"]) == 0
    summary = open_artifact(str(killed), "generate").summary
    assert summary["rendered_this_run"] == count - done_before
    assert summary["reused"] == done_before
    assert not list(killed.rglob("*.partial"))

    fresh = tmp_path / "fresh"
    assert cli.main([*argv, f"output_dir={fresh}", "-q"]) == 0
    fresh_files = sorted(p.relative_to(fresh).as_posix() for p in fresh.rglob("*.npy"))
    assert fresh_files == sorted(p.relative_to(killed).as_posix() for p in killed.rglob("*.npy"))
    assert len(fresh_files) == count
    for rel in fresh_files:
        np.testing.assert_allclose(
            np.load(killed / rel), np.load(fresh / rel), atol=INVARIANCE_TOLERANCE, rtol=0
        )


def test_text_length_defaults_to_the_pipelines_own(tmp_path):
    """sampling.max_sequence_length unset: the family's pipeline default (LTX-Video's 128, as
    diffusers' LTXPipeline; 512 for the others), an explicit value kept."""
    from jaxcore.config import load_config
    from stages.generate import run as generate_run
    from stages.generate.config import GenerateConfig

    class Source:
        def __init__(self, defaults):
            self.defaults = defaults

        def sampling_defaults(self):
            return self.defaults

    required = ["pretrained_model_name_or_path=x", "prompt_file=p.txt", f"output_dir={tmp_path}"]

    def length(source, *extra):
        config = load_config(
            GenerateConfig, REPO / "configs/stages/generate.yml", [*required, *extra]
        )
        return generate_run._with_text_length(config, source).sampling.max_sequence_length

    assert length(Source({})) == 512
    assert length(Source({"max_sequence_length": 128})) == 128
    assert length(Source({"max_sequence_length": 128}), "max_sequence_length=64") == 64
