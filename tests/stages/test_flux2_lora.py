"""Flux.2 [klein] LoRAs through the stages, on a tiny diffusers-built ``Flux2KleinPipeline``
(tests/support/tiny_flux2.py), against diffusers' own ``load_lora_weights``.

- generate: a diffusers-format LoRA (``transformer.<module>.lora_A/B`` on every Linear) and an
  AI-Toolkit / ComfyUI one (``diffusion_model.`` + the original BFL names, fused qkv, every BFL
  Linear, alphas) render, as the config's ``model.loras`` and as per-line ``loras`` lists (one,
  both, none), equal to ``Flux2KleinPipeline`` with ``load_lora_weights`` + ``set_adapters`` at
  the same non-1 scales from the same latents, within 1e-4 on [0, 1] pixels (reached ~1e-6;
  the LoRAs move the render by ~0.1);
- train's LoRA mode, on text-to-image records and on edit-pair records (target + reference
  tokens): the loss falls (to ~0.7x in 30 steps), the default targets
  (``Flux2Family.lora_default_targets``) are what diffusers' train_dreambooth_lora_flux2_klein.py
  wraps by default, the base transformer is unchanged (the merged export is the base plus the
  exported deltas where they apply, ~1e-7, and bit for bit the base elsewhere), and
  ``lora/pytorch_lora_weights.safetensors`` loads in diffusers without a warning and renders,
  text-to-image at scale 1 and an edit at 0.8, as ``difforge generate`` renders with it (1e-4;
  reached ~1e-6 and ~9e-6).

The BFL file's ``final_layer.adaLN_modulation.1`` emits BFL's ``[shift, scale]``; diffusers'
LoRA converter maps it onto ``norm_out.linear`` (``[scale, shift]``) unswapped, so diffusers is
given that layer's halves swapped: what we apply for the original file (jaxcore/lora/flux2.py).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import numpy as np
import pytest

from jaxcore.artifacts import open_artifact
from jaxcore.lora import flux2 as flux2_lora
from jaxcore.models.flux2_transformer import Flux2TransformerConfig
from jaxcore.sampling import initial_latents
from pipelines import cli
from tests.support import lora_files as lf
from tests.support.tiny_flux2 import TRANSFORMER, build_flux2_pipeline, write_edit_pairs

REPO = Path(__file__).resolve().parents[2]
TOLERANCE = 1e-4  # on [0, 1] pixels
SIZE, STEPS, LENGTH, GUIDANCE = 16, 3, 32, 4.0
DIFFUSERS_SCALE, BFL_SCALE = 0.7, 0.6
T2I_STEPS, EDIT_STEPS = 30, 30
PAIRS, EDIT_SIZE = 8, 64  # Flux2KleinPipeline refuses references under 64 px
CONFIG = Flux2TransformerConfig(**TRANSFORMER)
ADALN = "final_layer.adaLN_modulation.1"
# diffusers' train_dreambooth_lora_flux2_klein.py target_modules when --lora_layers is unset
SCRIPT_DEFAULT_TARGETS = [
    "to_k",
    "to_q",
    "to_v",
    "to_out.0",
    "to_qkv_mlp_proj",
    *[f"single_transformer_blocks.{i}.attn.to_out" for i in range(24)],
]


@pytest.fixture(scope="module")
def klein_dir(tmp_path_factory) -> Path:
    return build_flux2_pipeline(tmp_path_factory.mktemp("klein"), seed=5)


@pytest.fixture(scope="module")
def lora_files(tmp_path_factory) -> dict[str, Path]:
    """``{"diffusers": file, "bfl": file ours reads, "bfl_theirs": the file diffusers reads}``.

    The BFL file has alphas; diffusers refuses an ``.alpha`` beside ``lora_A`` / ``lora_B``, so
    its copy has ``alpha / rank`` folded into ``lora_B`` (and the final adaLN swapped)."""
    folder = tmp_path_factory.mktemp("loras")
    on_every_linear = lf.random_layers(
        flux2_lora.linear_shapes(CONFIG), seed=11, alphas=False, std=0.1
    )
    bfl = lf.random_layers(lf.flux2_bfl_shapes(CONFIG), seed=12, alphas=True, std=0.1)
    folded = {
        name: dataclasses.replace(layer, up=layer.up * np.float32(layer.scale), alpha=None)
        for name, layer in bfl.items()
    }
    theirs = {**folded, ADALN: lf.swapped_halves(folded[ADALN])}
    return {
        "diffusers": lf.save_lora(
            folder / "diffusers.safetensors", lf.lora_keys(on_every_linear, "diffusers")
        ),
        "bfl": lf.save_lora(folder / "bfl.safetensors", lf.lora_keys(bfl, "comfyui-peft")),
        "bfl_theirs": lf.save_lora(
            folder / "bfl_theirs.safetensors", lf.lora_keys(theirs, "comfyui-peft")
        ),
    }


def _latents(seed: int, size: int) -> np.ndarray:
    """The patchified initial latents [24, h, w] of a seed at ``size`` px, as generate draws
    them."""
    return initial_latents(seed, (TRANSFORMER["in_channels"], size // 4, size // 4))


def _generate(model: Path, prompts: Path, out: Path, *extra: str, size: int = SIZE) -> int:
    return cli.main(
        [
            "generate",
            str(REPO / "configs/stages/generate.yml"),
            f"pretrained_model_name_or_path={model}",
            f"prompt_file={prompts}",
            f"output_dir={out}",
            f"height={size}",
            f"width={size}",
            "num_frames=1",
            f"num_inference_steps={STEPS}",
            f"sampling.max_sequence_length={LENGTH}",
            f"guidance_scale={GUIDANCE}",
            "save_arrays=true",
            *extra,
            "-q",
        ]
    )


def _write_prompts(path: Path, lines: list[dict]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _ours(out: Path, name: str) -> np.ndarray:
    return np.load(out / "outputs" / f"{name}.npy")[0]  # [F, H, W, 3] -> the frame


def _diffusers_render(
    pipe, loras, prompt: str, seed: int, size: int = SIZE, image: Path | None = None
) -> np.ndarray:
    """``pipe`` (a ``Flux2KleinPipeline``) [H, W, 3] with each ``(file, scale)`` of ``loras``
    loaded by ``load_lora_weights`` and weighted by ``set_adapters``, from the seed's
    latents, editing ``image`` if given; the LoRAs are unloaded again afterwards."""
    import PIL.Image
    import torch

    for i, (path, _) in enumerate(loras):
        pipe.load_lora_weights(str(path), adapter_name=f"l{i}")
    if loras:
        pipe.set_adapters([f"l{i}" for i in range(len(loras))], [s for _, s in loras])
    out = pipe(
        image=None if image is None else [PIL.Image.open(image).convert("RGB")],
        prompt=prompt,
        height=size,
        width=size,
        num_inference_steps=STEPS,
        guidance_scale=GUIDANCE,
        latents=torch.from_numpy(_latents(seed, size)[None]),
        max_sequence_length=LENGTH,
        output_type="np",
    )
    pipe.unload_lora_weights()
    return np.asarray(out.images[0])


def _worst(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))))


def test_generate_with_flux2_loras_matches_diffusers(klein_dir, lora_files, tmp_path):
    """The config's LoRA for a line without ``loras``, a line's own list (the community file,
    both files, none), each equal to diffusers with the same files at the same scales."""
    from diffusers import Flux2KleinPipeline

    diffusers_file, bfl_file = lora_files["diffusers"], lora_files["bfl"]
    as_diffusers = {"path": str(diffusers_file), "scale": DIFFUSERS_SCALE}
    as_bfl = {"path": str(bfl_file), "scale": BFL_SCALE}
    line = {"prompt": "a red fox", "seed": 1}  # one seed: the LoRA sets alone differ
    lines = [
        {"id": "config", **line},
        {"id": "bfl", **line, "loras": [as_bfl]},
        {"id": "both", **line, "loras": [as_diffusers, as_bfl]},
        {"id": "none", **line, "loras": []},
    ]
    prompts = _write_prompts(tmp_path / "prompts.jsonl", lines)
    out = tmp_path / "render"
    config_lora = f"model.loras=[{{path: {diffusers_file}, scale: {DIFFUSERS_SCALE}}}]"
    assert _generate(klein_dir, prompts, out, config_lora) == 0

    theirs_bfl = (lora_files["bfl_theirs"], BFL_SCALE)
    cases = {
        "config": [(diffusers_file, DIFFUSERS_SCALE)],
        "bfl": [theirs_bfl],
        "both": [(diffusers_file, DIFFUSERS_SCALE), theirs_bfl],
        "none": [],
    }
    pipe = Flux2KleinPipeline.from_pretrained(klein_dir)
    expected = {
        name: _diffusers_render(pipe, loras, line["prompt"], line["seed"])
        for name, loras in cases.items()
    }
    errors = {name: _worst(_ours(out, name), expected[name]) for name in cases}
    effects = {name: _worst(expected[name], expected["none"]) for name in cases if name != "none"}
    print("generate with Flux.2 LoRAs vs diffusers, max abs:", errors, "LoRA effect:", effects)
    assert all(image.std() > 0.05 for image in expected.values())  # none flat (saturated)
    assert max(errors.values()) <= TOLERANCE, errors
    assert min(effects.values()) > 1e-2, effects  # every LoRA set moves the render
    assert _worst(expected["both"], expected["bfl"]) > 1e-2  # the second file matters too
    summary = open_artifact(str(out), "generate").summary
    by_id = {p["id"]: p for p in summary["prompts"]}
    recorded = {name: [(e["path"], e["scale"]) for e in by_id[name]["loras"]] for name in cases}
    assert recorded == {
        "config": [(str(diffusers_file), DIFFUSERS_SCALE)],
        "bfl": [(str(bfl_file), BFL_SCALE)],
        "both": [(str(diffusers_file), DIFFUSERS_SCALE), (str(bfl_file), BFL_SCALE)],
        "none": [],
    }


# --- train's LoRA mode ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> Path:
    return write_edit_pairs(tmp_path_factory.mktemp("pairs") / "imgs", PAIRS, EDIT_SIZE, seed=2)


def _convert(pipeline: Path, source: Path, out: Path, size: int, *extra: str) -> Path:
    args = [
        "convert",
        str(REPO / "configs/stages/convert.yml"),
        f"source={source}",
        f"output_dir={out}",
        f"pretrained_model_name_or_path={pipeline}",
        f"height={size}",
        f"width={size}",
        f"max_sequence_length={LENGTH}",
        "eval_fraction=0.3",
        *extra,
        "-q",
    ]
    assert cli.main(args) == 0
    return out


@pytest.fixture(scope="module")
def t2i_data(klein_dir, pairs, tmp_path_factory) -> Path:
    """Text-to-image records of the edit pairs' targets and captions at SIZE px."""
    return _convert(klein_dir, pairs, tmp_path_factory.mktemp("t2i") / "convert", SIZE)


@pytest.fixture(scope="module")
def edit_data(klein_dir, pairs, tmp_path_factory) -> Path:
    """Edit-pair records (their sources as references) at EDIT_SIZE px."""
    out = tmp_path_factory.mktemp("edit") / "convert"
    column = "dataset.reference_image_column=source_image"
    return _convert(klein_dir, pairs, out, EDIT_SIZE, column)


def _train(data: Path, pipeline: Path, out: Path, steps: int) -> dict:
    """train's LoRA mode with the family's default targets (no ``lora.target_modules``), rank
    4, alpha 8 (scale 2), the merged transformer exported beside the adapters; the train
    artifact's ``lora`` entry."""
    args = [
        "train",
        str(REPO / "configs/stages/train.yml"),
        f"data={data}",
        f"output_dir={out}",
        "dataset_type=tfrecord",
        "model.model_config=null",
        f"model.pretrained_model_name_or_path={pipeline}",
        "lora.rank=4",
        "lora.alpha=8",
        "learning_rate=1e-2",
        "per_device_batch_size=1",
        f"max_train_steps={steps}",
        f"checkpoint_every={steps}",
        "export_diffusers=true",
        "-q",
    ]
    assert cli.main(args) == 0
    lora = open_artifact(str(out), "train").summary["lora"]
    assert (lora["rank"], lora["scale"]) == (4, 2.0)
    assert lora["file"] == "lora/pytorch_lora_weights.safetensors"
    return lora


def _loss_falls(out: Path, window: int, factor: float) -> None:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in sorted(rows, key=lambda r: r["step"])]
    first, last = np.mean(losses[:window]), np.mean(losses[-window:])
    print(f"LoRA loss: first {window} {first:.4f}, last {window} {last:.4f}")
    assert last < factor * first, (first, last)


def _script_default_targets(klein_dir: Path) -> list[str]:
    """The modules PEFT wraps in the tiny Klein transformer with the script's default
    ``LoraConfig(target_modules=...)`` (its ``transformer.add_adapter``)."""
    from diffusers import Flux2Transformer2DModel
    from peft import LoraConfig

    transformer = Flux2Transformer2DModel.from_pretrained(klein_dir / "transformer")
    transformer.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=SCRIPT_DEFAULT_TARGETS))
    return sorted(name for name, module in transformer.named_modules() if hasattr(module, "lora_A"))


def _assert_base_unchanged(klein_dir: Path, out: Path, targets: list[str]) -> None:
    """The merged export is the base plus the exported (trained) delta at every target, and
    bit for bit the base everywhere else: training moved the adapters alone."""
    from safetensors.numpy import load_file

    exported = load_file(out / "lora" / "pytorch_lora_weights.safetensors")
    assert sorted(exported) == sorted(
        f"transformer.{m}.lora_{ab}.weight" for m in targets for ab in "AB"
    )
    base = load_file(klein_dir / "transformer" / "diffusion_pytorch_model.safetensors")
    merged = load_file(out / "transformer" / "diffusion_pytorch_model.safetensors")
    assert sorted(merged) == sorted(base)
    worst = 0.0
    for key, weight in base.items():
        module = key.removesuffix(".weight")
        if module not in targets:
            np.testing.assert_array_equal(merged[key], weight, err_msg=key)
            continue
        up, down = (exported[f"transformer.{module}.lora_{ab}.weight"] for ab in "BA")
        assert np.abs(up).max() > 0, module  # every adapter trained
        delta = up.astype(np.float64) @ down.astype(np.float64)
        worst = max(worst, float(np.abs(merged[key] - (weight + delta)).max()))
    print(f"merged export - (base + exported delta), max abs: {worst:.2e}")
    assert worst < 1e-6


def _assert_diffusers_renders_alike(klein_dir, out, line, size, scale, folder, caplog):
    """diffusers loads the export without a warning, and its render with it at ``scale``
    equals ``difforge generate``'s with ``model.loras`` from the same latents."""
    from diffusers import Flux2KleinPipeline

    image = line.get("image")
    prompts = _write_prompts(folder / "p.jsonl", [line])
    render = folder / "render"
    lora = f"model.loras=[{{path: {out / 'lora'}, scale: {scale}}}]"
    assert _generate(klein_dir, prompts, render, lora, size=size) == 0
    pipe = Flux2KleinPipeline.from_pretrained(klein_dir)
    plain = _diffusers_render(pipe, [], line["prompt"], line["seed"], size, image)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        pipe.load_lora_weights(str(out / "lora"), adapter_name="trained")
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not warnings, warnings
    pipe.set_adapters(["trained"], [scale])
    expected = _diffusers_render(pipe, [], line["prompt"], line["seed"], size, image)
    error, effect = _worst(_ours(render, line["id"]), expected), _worst(expected, plain)
    print(f"trained LoRA render vs diffusers, max abs: {error:.2e} (LoRA effect {effect:.3f})")
    assert expected.std() > 0.05  # not a flat (saturated) image
    assert effect > 1e-3  # the trained LoRA changes the render
    assert error <= TOLERANCE


def test_lora_training_on_text_to_image_records(klein_dir, t2i_data, tmp_path, caplog):
    """The loss falls; the family's default targets are the script's; the base is unchanged;
    diffusers renders with the export as generate does (at scale 1)."""
    out = tmp_path / "train"
    lora = _train(t2i_data, klein_dir, out, T2I_STEPS)
    assert lora["targets"] == _script_default_targets(klein_dir)
    _loss_falls(out, 10, 0.8)
    _assert_base_unchanged(klein_dir, out, lora["targets"])
    line = {"id": "p", "prompt": "make it red", "seed": 7}
    _assert_diffusers_renders_alike(klein_dir, out, line, SIZE, 1.0, tmp_path, caplog)


def test_lora_training_on_edit_pairs(klein_dir, pairs, edit_data, tmp_path, caplog):
    """The same on edit-pair records (target + reference tokens): the edit of a source image
    with the trained LoRA at a non-1 scale renders as diffusers' does with the export."""
    out = tmp_path / "train"
    lora = _train(edit_data, klein_dir, out, EDIT_STEPS)
    _loss_falls(out, 10, 0.8)
    _assert_base_unchanged(klein_dir, out, lora["targets"])
    row = json.loads((pairs / "metadata.jsonl").read_text().splitlines()[0])
    line = {"id": "edit", "prompt": row["text"], "seed": 8, "image": row["source_image"]}
    _assert_diffusers_renders_alike(klein_dir, out, line, EDIT_SIZE, 0.8, tmp_path, caplog)
