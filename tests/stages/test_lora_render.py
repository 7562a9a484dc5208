"""LoRAs in bulk rendering: ``difforge generate`` with two LoRAs at once (config-level and
per-prompt) reproduces diffusers' pipelines with ``load_lora_weights`` + ``set_adapters`` on the
same files, within 1e-4 on [0, 1] pixels, for Wan and Flux (reached 2.4e-7 and 9.7e-6 with both
LoRAs at 0.8); switching LoRA sets re-merges from
the base weights (no reload, no recompilation); un-merging returns the base bit for bit; bad
files fail before anything renders with one line naming the file.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from jaxcore import weights
from jaxcore.artifacts import open_artifact
from jaxcore.families import load_pipeline
from jaxcore.sampling import initial_latents
from pipelines import cli
from pipelines.embedded.tiny import build_tiny_wan_pipeline
from tests.support.tiny_flux import build_flux_pipeline

REPO = Path(__file__).resolve().parents[2]
TOLERANCE = 1e-4
SCALE = 0.8


def write_peft_lora(path: Path, directory: Path, seed: int, every: int = 1) -> Path:
    """A diffusers/PEFT LoRA (``transformer.<module>.lora_A/B.weight``) on every ``every``-th
    Linear of the pipeline's denoiser, random ranks 1..4, as diffusers' save_lora_weights
    writes them (no alphas: scale 1)."""
    from safetensors.numpy import load_file

    state = load_file(directory / "transformer" / "diffusion_pytorch_model.safetensors")
    rng = np.random.default_rng(seed)
    tensors = {}
    linears = sorted(k for k, v in state.items() if k.endswith(".weight") and v.ndim == 2)
    for i, key in enumerate(linears[::every]):
        out_features, in_features = state[key].shape
        rank = 1 + (i % 4)
        module = key.removesuffix(".weight")
        tensors[f"transformer.{module}.lora_A.weight"] = (
            rng.standard_normal((rank, in_features)).astype(np.float32) * 0.3
        )
        tensors[f"transformer.{module}.lora_B.weight"] = (
            rng.standard_normal((out_features, rank)).astype(np.float32) * 0.3
        )
    weights.save_safetensors(tensors, path)
    return path


@pytest.fixture(scope="module")
def wan_dir(tmp_path_factory) -> Path:
    return build_tiny_wan_pipeline(
        tmp_path_factory.mktemp("wan"), seed=1, transformer_output_scale=20.0
    )


@pytest.fixture(scope="module")
def flux_dir(tmp_path_factory) -> Path:
    return build_flux_pipeline(tmp_path_factory.mktemp("flux"), seed=7)


def _lora_pair(directory: Path, folder: Path) -> tuple[Path, Path]:
    folder.mkdir(exist_ok=True)
    return (
        write_peft_lora(folder / "a.safetensors", directory, seed=1),
        write_peft_lora(folder / "b.safetensors", directory, seed=2, every=2),
    )


def _generate(model, prompt_file, out, *extra) -> int:
    return cli.main(
        [
            "generate",
            str(REPO / "configs/stages/generate.yml"),
            f"pretrained_model_name_or_path={model}",
            f"prompt_file={prompt_file}",
            f"output_dir={out}",
            "num_inference_steps=3",
            "max_sequence_length=32",
            "height=16",
            "width=16",
            "num_frames=1",
            "save_arrays=true",
            *extra,
            "-q",
        ]
    )


def _prompt_file(folder: Path, latent_shape, loras_per_prompt) -> Path:
    lines = []
    for i, (prompt, loras) in enumerate(loras_per_prompt):
        np.save(folder / f"z{i}.npy", initial_latents(10 + i, latent_shape))
        line = {"id": f"p{i}", "prompt": prompt, "latents": f"z{i}.npy"}
        if loras is not None:
            line["loras"] = loras
        lines.append(json.dumps(line))
    path = folder / "prompts.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def _diffusers_render(pipeline_cls, directory, loras, prompt, latents, **kwargs) -> np.ndarray:
    import torch

    pipe = pipeline_cls.from_pretrained(directory)
    for i, path in enumerate(loras):
        pipe.load_lora_weights(str(path), adapter_name=f"l{i}")
    if loras:
        pipe.set_adapters([f"l{i}" for i in range(len(loras))], [SCALE] * len(loras))
    out = pipe(
        prompt=prompt,
        height=16,
        width=16,
        num_inference_steps=3,
        latents=torch.from_numpy(latents),
        max_sequence_length=32,
        output_type="np",
        **kwargs,
    )
    return np.asarray(out.frames[0] if hasattr(out, "frames") else out.images[0])


def test_wan_two_loras_match_diffusers(wan_dir, tmp_path):
    from diffusers import WanPipeline

    a, b = _lora_pair(wan_dir, tmp_path / "loras")
    both = [{"path": str(a), "scale": SCALE}, {"path": str(b), "scale": SCALE}]
    shape = (4, 1, 8, 8)
    prompts = _prompt_file(
        tmp_path, shape, [("a red circle", None), ("a red circle", [both[0]]), ("blue", [])]
    )
    out = tmp_path / "run"
    loras = f"model.loras=[{{path: {a}, scale: {SCALE}}}, {{path: {b}, scale: {SCALE}}}]"
    assert _generate(wan_dir, prompts, out, loras, "guidance_scale=1") == 0

    kwargs = dict(guidance_scale=1.0, num_frames=1)
    cases = {"p0": [a, b], "p1": [a], "p2": []}
    for i, (name, files) in enumerate(cases.items()):
        latents = initial_latents(10 + i, shape)[None]
        prompt = "blue" if name == "p2" else "a red circle"
        expected = _diffusers_render(WanPipeline, wan_dir, files, prompt, latents, **kwargs)
        ours = np.load(out / "outputs" / f"{name}.npy")
        np.testing.assert_allclose(ours, expected, atol=TOLERANCE, rtol=0, err_msg=name)
    ours = [np.load(out / "outputs" / f"p{i}.npy") for i in range(2)]
    assert np.abs(ours[0] - ours[1]).max() > 1e-3  # the second LoRA matters
    summary = open_artifact(str(out), "generate").summary
    assert [entry["path"] for entry in summary["prompts"][0]["loras"]] == [str(a), str(b)]
    assert all(len(entry["sha256"]) == 64 for entry in summary["loras"])


def test_flux_two_loras_match_diffusers(flux_dir, tmp_path):
    from diffusers import FluxPipeline

    from jaxcore.models.flux_transformer import pack_latents

    a, b = _lora_pair(flux_dir, tmp_path / "loras")
    shape = (4, 8, 8)
    both = [{"path": str(a), "scale": SCALE}, {"path": str(b), "scale": SCALE}]
    prompts = _prompt_file(tmp_path, shape, [("a red circle", both), ("a red circle", [])])
    out = tmp_path / "run"
    assert _generate(flux_dir, prompts, out, "guidance_scale=3.5") == 0
    for i, files in enumerate(([a, b], [])):
        latents = np.asarray(pack_latents(initial_latents(10 + i, shape)[None]))
        expected = _diffusers_render(
            FluxPipeline, flux_dir, files, "a red circle", latents, guidance_scale=3.5
        )
        ours = np.load(out / "outputs" / f"p{i}.npy")[0]
        np.testing.assert_allclose(ours, expected, atol=TOLERANCE, rtol=0, err_msg=f"p{i}")
    assert np.abs(np.load(out / "outputs/p0.npy") - np.load(out / "outputs/p1.npy")).max() > 1e-3


def test_loras_in_a_quantized_run_merge_before_quantizing(wan_dir, tmp_path):
    """generate with compute.quantization=int8_weights and per-prompt LoRA sets: each render is
    within 0.05 of the float run's with the same LoRAs (int8 weights of the merged model), and
    the LoRA set still changes the render."""
    a, b = _lora_pair(wan_dir, tmp_path / "loras")
    both = [{"path": str(a), "scale": SCALE}, {"path": str(b), "scale": SCALE}]
    prompts = _prompt_file(tmp_path, (4, 1, 8, 8), [("a red", both), ("a red", [])])
    runs = {}
    for mode in ("none", "int8_weights"):
        out = tmp_path / mode
        assert _generate(wan_dir, prompts, out, f"quantization={mode}", "guidance_scale=1") == 0
        runs[mode] = [np.load(out / "outputs" / f"p{i}.npy") for i in range(2)]
    for name, ours, full in zip(("p0", "p1"), runs["int8_weights"], runs["none"], strict=True):
        assert 0 < np.abs(ours - full).max() < 0.05, name
    assert np.abs(runs["int8_weights"][0] - runs["int8_weights"][1]).max() > 1e-2


def test_switching_sets_remerges_from_the_base_and_unmerging_is_exact(wan_dir, tmp_path):
    a, b = _lora_pair(wan_dir, tmp_path / "loras")
    pipe = load_pipeline(wan_dir)
    base = {k: np.array(v) for k, v in _flat(pipe.denoiser_params).items()}
    pipe.apply_loras([(a, 0.8), (b, 0.5)])
    merged = _flat(pipe.denoiser_params)
    changed = [k for k in base if not np.array_equal(np.asarray(merged[k]), base[k])]
    assert changed and all(np.asarray(merged[k]).dtype == base[k].dtype for k in base)
    assert {k: v.sharding for k, v in merged.items()} == {
        k: v.sharding for k, v in _flat(pipe.base_denoiser_params).items()
    }
    pipe.apply_loras([(a, 0.8)])  # another set: merged from the base, not on top
    only_a = pipe.denoiser_params
    fresh = load_pipeline(wan_dir)
    fresh.apply_loras([(a, 0.8)])
    for k, v in _flat(fresh.denoiser_params).items():
        np.testing.assert_array_equal(np.asarray(_flat(only_a)[k]), np.asarray(v), err_msg=k)
    pipe.apply_loras([])
    for k, v in _flat(pipe.denoiser_params).items():
        np.testing.assert_array_equal(np.asarray(v), base[k], err_msg=k)  # bit-identical


def test_switching_sets_does_not_recompile(wan_dir, tmp_path):
    from jaxcore import sampling, step_cache

    a, b = _lora_pair(wan_dir, tmp_path / "loras")
    pipe = load_pipeline(wan_dir)
    cond = pipe.encode_prompts(["a red circle"], 16)
    latents = initial_latents(0, pipe.latent_shape(16, 16, 1))[None]
    _, step_fn = pipe.family.make_schedule(pipe, "unipc", 2, 3.0, latents.shape)
    # the cached program Pipeline.sample uses (no CFG, no step cache, batched CFG)
    jitted = sampling.denoise_fn(
        pipe.family, pipe.denoiser, step_fn, False, None, step_cache.NO_CACHE, True
    )
    pipe.apply_loras([(a, 0.8)])
    pipe.sample(latents, cond, num_inference_steps=2)
    compiled = jitted._cache_size()  # (other tests may have compiled other shapes before)
    assert compiled >= 1
    for loras in ([(a, 0.8), (b, 0.5)], [], [(b, 1.0)]):
        pipe.apply_loras(loras)
        pipe.sample(latents, cond, num_inference_steps=2)
    assert jitted._cache_size() == compiled  # the same program for every LoRA set


def test_unmatched_keys_fail_strictly_and_warn_otherwise(wan_dir, tmp_path, caplog):
    from jaxcore.lora.base import LoraError

    lora = write_peft_lora(tmp_path / "a.safetensors", wan_dir, seed=5)
    file = weights.SafetensorsFile(lora)
    tensors = {k: np.array(file.get(k)) for k in file.keys()}  # noqa: SIM118
    tensors["transformer.blocks.9.attn1.to_q.lora_A.weight"] = np.zeros((1, 32), np.float32)
    tensors["transformer.blocks.9.attn1.to_q.lora_B.weight"] = np.zeros((32, 1), np.float32)
    weights.save_safetensors(tensors, lora)
    pipe = load_pipeline(wan_dir)
    with pytest.raises(LoraError, match=r"a.safetensors: 2 key\(s\) match no layer: .*blocks.9"):
        pipe.apply_loras([(lora, 1.0)])
    pipe.apply_loras([(lora, 1.0)], strict=False)
    assert "2 key(s) match no layer" in caplog.text and "lora_strict=false" in caplog.text
    assert pipe.active_loras == ((str(lora), 1.0, "high"),)


def _flat(tree, prefix=()):
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out |= _flat(v, (*prefix, k))
        else:
            out["/".join((*prefix, k))] = v
    return out


@pytest.mark.parametrize("problem", ["pickle", "other_model", "rank_mismatch"])
def test_bad_lora_files_fail_before_rendering(wan_dir, flux_dir, tmp_path, capsys, problem):
    if problem == "pickle":
        import torch

        bad = tmp_path / "lora.bin"
        torch.save({"x": torch.zeros(1)}, bad)
        expected = "lora.bin: a pickle checkpoint"
    elif problem == "other_model":
        bad = write_peft_lora(tmp_path / "flux_lora.safetensors", flux_dir, seed=3)
        expected = "flux_lora.safetensors"
    else:
        bad = write_peft_lora(tmp_path / "wan_lora.safetensors", wan_dir, seed=4)
        file = weights.SafetensorsFile(bad)
        tensors = {k: np.array(file.get(k)) for k in file.keys()}  # noqa: SIM118
        key = next(k for k in tensors if k.endswith("lora_B.weight"))
        tensors[key] = np.concatenate([tensors[key], tensors[key]], axis=1)  # rank 2r vs r
        weights.save_safetensors(tensors, bad)
        expected = "wan_lora.safetensors"
    (tmp_path / "p.txt").write_text("a red circle\n")
    out = tmp_path / "run"
    rc = _generate(wan_dir, tmp_path / "p.txt", out, f"model.loras=[{{path: {bad}}}]")
    err = capsys.readouterr().err
    assert rc == 2 and expected in err and len(err.strip().splitlines()) == 1, err
    assert not (out / "records").exists() or not list((out / "records").glob("*.json"))


def test_a_diffusers_saved_lora_keeps_its_alpha(wan_dir, tmp_path):
    """diffusers' save_lora_weights keeps the PEFT config (lora_alpha != r) in the file header,
    not in tensors: the render must use alpha / r as diffusers does."""
    import torch
    from diffusers import WanPipeline
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    torch.manual_seed(0)
    pipe = WanPipeline.from_pretrained(wan_dir)
    config = LoraConfig(
        r=2,
        lora_alpha=6,
        target_modules=["to_q", "to_k", "to_v", "to_out.0"],
        init_lora_weights=False,
    )
    pipe.transformer.add_adapter(config)
    folder = tmp_path / "saved"
    WanPipeline.save_lora_weights(
        folder,
        transformer_lora_layers=get_peft_model_state_dict(pipe.transformer),
        transformer_lora_adapter_metadata=config.to_dict(),
    )
    shape = (4, 1, 8, 8)
    prompts = _prompt_file(tmp_path, shape, [("a red circle", [{"path": str(folder)}])])
    out = tmp_path / "run"
    assert _generate(wan_dir, prompts, out, "guidance_scale=1") == 0
    latents = initial_latents(10, shape)[None]
    reference = WanPipeline.from_pretrained(wan_dir)
    reference.load_lora_weights(str(folder))
    expected = reference(
        prompt="a red circle",
        height=16,
        width=16,
        num_frames=1,
        num_inference_steps=3,
        guidance_scale=1.0,
        latents=torch.from_numpy(latents),
        max_sequence_length=32,
        output_type="np",
    ).frames[0]
    np.testing.assert_allclose(np.load(out / "outputs/p0.npy"), expected, atol=TOLERANCE, rtol=0)
