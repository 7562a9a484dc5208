"""LTX-Video LoRA files (diffusers/PEFT, original LTX-Video names under ``diffusion_model.``)
-> diffusers module LoRAs (``jaxcore.lora.ltx.to_diffusers``), checked against diffusers.

- Two PEFT LoRAs (every Linear of the tiny transformer of tests/support/tiny_ltx.py, random
  ranks 1..4; the second on every other Linear) at scales 0.8 and 0.5: the pipeline's
  ``apply_loras`` and a render (CFG 3, 3 steps, 32 x 32 x 9) equal diffusers' ``LTXPipeline``
  with ``load_lora_weights`` + ``set_adapters`` from the same latents, within 1e-4 on [0, 1]
  pixels; reached 2.4e-6 (the LoRAs move the pixels by 0.19 on average, 1.0 at most); un-merging
  (``apply_loras([])``) renders the base bit for bit.
- The same factors written with the original names under ``diffusion_model.``
  (``patchify_proj``, ``adaln_single.*``; ``lora_down`` / ``lora_up`` too) convert to the same
  layers bit for bit; diffusers loads the layers it names alike (blocks, caption projection,
  proj_out) from that file into the same fused deltas, within 1e-6 (reached 6.0e-8).
- Strict loading names a key that places nowhere; a LoRA of another model (a wider transformer)
  fails naming the file, the layer and both shapes.

The diffusers -> original name rules are written out here on their own (from LTX-Video's
``Transformer3DModel`` names), not imported from the code under test.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from jaxcore import weights
from jaxcore.families import load_pipeline
from jaxcore.lora import ltx
from jaxcore.lora.base import LoraError, read_lora_file
from jaxcore.models.ltx_transformer import LTXVideoTransformerConfig
from jaxcore.sampling import initial_latents
from tests.jaxcore.test_ltx_pipeline import SEEDS, _diffusers_t2v, _ours, _settings
from tests.stages.test_lora_render import write_peft_lora
from tests.support.tiny_ltx import TRANSFORMER, build_ltx_pipeline

TOLERANCE = 1e-4
FUSED_TOLERANCE = 1e-6
SCALES = (0.8, 0.5)
WHERE = "LoRA test.safetensors"
SIZE = (32, 32, 9)
NEGATIVE = ["dark background", "green"]

_ORIGINAL = (  # diffusers module prefix -> original LTX-Video name
    ("proj_in", "patchify_proj"),
    ("time_embed.", "adaln_single."),
)


def original_name(module: str) -> str:
    for theirs, ours in _ORIGINAL:
        if module.startswith(theirs):
            return ours + module.removeprefix(theirs)
    return module


def _non_diffusers(tensors: dict, naming=("lora_A", "lora_B")) -> dict:
    """A diffusers/PEFT file's tensors with the original names under ``diffusion_model.``."""
    out = {}
    for key, value in tensors.items():
        module, part = re.fullmatch(r"transformer\.(.+)\.(lora_[AB])\.weight", key).groups()
        part = naming[0] if part == "lora_A" else naming[1]
        out[f"diffusion_model.{original_name(module)}.{part}.weight"] = value
    return out


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return build_ltx_pipeline(tmp_path_factory.mktemp("ltx_lora"), seed=1)


@pytest.fixture(scope="module")
def config(tiny_dir) -> LTXVideoTransformerConfig:
    return LTXVideoTransformerConfig.from_dict(weights.read_config(tiny_dir / "transformer"))


@pytest.fixture(scope="module")
def lora_pair(tiny_dir, tmp_path_factory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("ltx_loras")
    return (
        write_peft_lora(folder / "a.safetensors", tiny_dir, seed=1),
        write_peft_lora(folder / "b.safetensors", tiny_dir, seed=2, every=2),
    )


def _linear_shapes(directory: Path) -> dict[str, tuple[int, int]]:
    file = weights.SafetensorsFile(directory / "transformer/diffusion_pytorch_model.safetensors")
    shapes = {}
    for key in file.keys():  # noqa: SIM118 (not a dict)
        value = file.get(key)
        if key.endswith(".weight") and value.ndim == 2:
            shapes[key.removesuffix(".weight")] = tuple(value.shape)
    return shapes


def _save(tensors: dict, path: Path) -> Path:
    weights.save_safetensors(tensors, path)
    return path


def _ones() -> np.ndarray:
    return np.ones((2, 16), np.float32)


def _assert_same_layers(a, b) -> None:
    assert set(a.layers) == set(b.layers)
    for module, layer in a.layers.items():
        other = b.layers[module]
        np.testing.assert_array_equal(layer.down, other.down, err_msg=module)
        np.testing.assert_array_equal(layer.up, other.up, err_msg=module)
        assert layer.scale == other.scale, module


def test_the_table_names_every_linear_of_the_model(tiny_dir, config):
    table = ltx.linear_modules(config)
    assert set(table.values()) == set(_linear_shapes(tiny_dir))
    assert all(original_name(theirs) == ours for ours, theirs in table.items())


def test_two_peft_loras_render_as_diffusers(tiny_dir, lora_pair):
    from diffusers import LTXPipeline

    ours_pipe = load_pipeline(tiny_dir)
    micro = _settings(25, 0.05, 0.0)
    _, base = _ours(ours_pipe, SIZE, 3.0, 0.0, micro, NEGATIVE)
    used = ours_pipe.apply_loras(
        [(str(path), s) for path, s in zip(lora_pair, SCALES, strict=True)]
    )
    assert [u["scale"] for u in used] == list(SCALES)
    assert ours_pipe.lora_files[str(lora_pair[0])].converted.format == "diffusers"
    _, ours = _ours(ours_pipe, SIZE, 3.0, 0.0, micro, NEGATIVE)

    torch_pipe = LTXPipeline.from_pretrained(tiny_dir)
    for name, path in zip(("l0", "l1"), lora_pair, strict=True):
        torch_pipe.load_lora_weights(str(path), adapter_name=name)
    torch_pipe.set_adapters(["l0", "l1"], list(SCALES))
    latents = np.stack([initial_latents(s, ours_pipe.latent_shape(*SIZE)) for s in SEEDS])
    reference = _diffusers_t2v(torch_pipe, latents, SIZE, 3.0, 0.0, micro[0], NEGATIVE)
    assert ours.shape == reference.shape == (2, SIZE[2], SIZE[0], SIZE[1], 3)
    np.testing.assert_allclose(ours, reference, atol=TOLERANCE, rtol=0)
    assert np.abs(ours - base).max() > 1e-2  # the LoRAs matter

    ours_pipe.apply_loras([])
    _, unmerged = _ours(ours_pipe, SIZE, 3.0, 0.0, micro, NEGATIVE)
    np.testing.assert_array_equal(unmerged, base)


def test_non_diffusers_form_converts_to_the_same_layers(config, lora_pair):
    peft = read_lora_file(lora_pair[0])
    reference = ltx.to_diffusers(peft, config, WHERE)
    assert reference.format == "diffusers" and reference.unmatched == ()
    assert {"proj_in", "time_embed.linear"} <= set(reference.layers)
    for naming in (("lora_A", "lora_B"), ("lora_down", "lora_up")):
        tensors = _non_diffusers(peft, naming)
        assert f"diffusion_model.patchify_proj.{naming[0]}.weight" in tensors
        converted = ltx.to_diffusers(tensors, config, WHERE)
        assert converted.format == "comfyui" and converted.unmatched == ()
        _assert_same_layers(reference, converted)
    # no prefix (original or diffusers names), 1x1-conv factors, diffusers names under the prefix
    for tensors in (
        {k.removeprefix("diffusion_model."): v for k, v in _non_diffusers(peft).items()},
        {k.removeprefix("transformer."): v for k, v in peft.items()},
        {k: v[..., None, None] for k, v in peft.items()},
        {k.replace("transformer.", "diffusion_model.", 1): v for k, v in peft.items()},
    ):
        converted = ltx.to_diffusers(tensors, config, WHERE)
        assert converted.unmatched == ()
        _assert_same_layers(reference, converted)


def test_non_diffusers_form_matches_diffusers_fused(tiny_dir, config, lora_pair, tmp_path):
    """diffusers' converter swaps the prefix and renames nothing, so it loads the layers named
    alike in both vocabularies: those, fused at 0.8, equal our deltas."""
    from diffusers import LTXPipeline

    tensors = {
        k: v
        for k, v in _non_diffusers(read_lora_file(lora_pair[1])).items()
        if not k.startswith(("diffusion_model.patchify_proj", "diffusion_model.adaln_single"))
    }
    path = _save(tensors, tmp_path / "comfy.safetensors")
    converted = ltx.to_diffusers(read_lora_file(path), config, WHERE)
    assert converted.format == "comfyui" and converted.unmatched == ()

    pipe = LTXPipeline.from_pretrained(tiny_dir)
    base = {k: v.detach().clone().numpy() for k, v in pipe.transformer.state_dict().items()}
    pipe.load_lora_weights(str(path))
    pipe.fuse_lora(lora_scale=SCALES[0])
    fused = {
        k.replace(".base_layer.", "."): v.detach().numpy()
        for k, v in pipe.transformer.state_dict().items()
        if "lora_" not in k
    }
    assert set(fused) == set(base)
    worst = 0.0
    for key, value in fused.items():
        layer = converted.layers.get(key.removesuffix(".weight"))
        ours = 0.0 if layer is None else layer.delta() * np.float32(SCALES[0])
        worst = max(worst, float(np.abs(value - base[key] - ours).max()))
    assert worst <= FUSED_TOLERANCE


def test_alphas_scale_by_rank(config, lora_pair):
    peft = read_lora_file(lora_pair[0])
    tensors = _non_diffusers(peft, ("lora_down", "lora_up"))
    tensors["diffusion_model.adaln_single.linear.alpha"] = np.float32(6.0)
    tensors["diffusion_model.transformer_blocks.1.ff.net.2.alpha"] = np.float32(1.0)
    converted = ltx.to_diffusers(tensors, config, WHERE)
    for module, alpha in (("time_embed.linear", 6.0), ("transformer_blocks.1.ff.net.2", 1.0)):
        layer = converted.layers[module]
        assert layer.scale == alpha / layer.rank
    assert converted.layers["proj_out"].scale == 1.0


def test_unmatched_lists_what_has_no_place(config, lora_pair):
    placed = read_lora_file(lora_pair[1])
    one = _ones()
    others = {
        "text_encoder.encoder.block.0.layer.0.SelfAttention.q.lora_A.weight": one,
        "transformer.transformer_blocks.0.attn1.to_qq.lora_A.weight": one,
        "transformer.transformer_blocks.5.attn1.to_q.lora_A.weight": one,
        "diffusion_model.transformer_blocks.0.attn1.q_norm.lora_A.weight": one,
        "transformer.patchify_proj.lora_A.weight": one,  # original name, diffusers prefix
        "transformer.transformer_blocks.0.attn1.to_q.lora_B.bias": np.ones(16, np.float32),
        "diffusion_model.transformer_blocks.0.attn1.to_k.dora_scale": np.ones((16, 1)),
        "diffusion_model.transformer_blocks.0.ff.net.2.diff": np.ones((16, 64), np.float32),
        "base_model.model.proj_out.lora_A.weight": one,
    }
    bare = next(
        m for m in ltx.linear_modules(config) if f"transformer.{m}.lora_A.weight" not in placed
    )
    others[f"diffusion_model.{bare}.alpha"] = np.float32(4.0)  # an alpha without its pair
    converted = ltx.to_diffusers({**placed, **others}, config, WHERE)
    assert set(converted.layers) == {k.split(".lora_")[0][len("transformer.") :] for k in placed}
    assert converted.unmatched == tuple(sorted(others))
    first = {k: v for k, v in placed.items() if k.startswith("transformer.transformer_blocks.0.")}
    rest = _non_diffusers({k: v for k, v in placed.items() if k not in first})
    mixed = ltx.to_diffusers({**first, **rest}, config, WHERE)
    assert mixed.format == "comfyui+diffusers" and mixed.unmatched == ()
    _assert_same_layers(mixed, ltx.to_diffusers(placed, config, WHERE))


def test_malformed_layers_are_errors(config, lora_pair):
    tensors = read_lora_file(lora_pair[0])
    name = "transformer.transformer_blocks.1.attn1.to_v"
    rank = tensors[f"{name}.lora_A.weight"].shape[0]
    bad = {**tensors, f"{name}.lora_B.weight": np.ones((16, rank + 1), np.float32)}
    with pytest.raises(LoraError, match=rf"{WHERE}: rank mismatch: {name}\.lora_A\.weight"):
        ltx.to_diffusers(bad, config, WHERE)
    half = {k: v for k, v in tensors.items() if k != f"{name}.lora_B.weight"}
    with pytest.raises(LoraError, match=rf"{name}\.lora_A\.weight has no matching lora_up"):
        ltx.to_diffusers(half, config, WHERE)
    twice = {**tensors, "diffusion_model.transformer_blocks.1.attn1.to_v.lora_down.weight": _ones()}
    with pytest.raises(LoraError, match="same layer transformer_blocks.1.attn1.to_v"):
        ltx.to_diffusers(twice, config, WHERE)


def test_strict_names_the_key_and_another_models_lora_names_both(tiny_dir, lora_pair, tmp_path):
    from diffusers import LTXVideoTransformer3DModel

    pipe = load_pipeline(tiny_dir)
    tensors = read_lora_file(lora_pair[1])
    stray = "transformer.transformer_blocks.0.attn1.to_qq.lora_A.weight"
    extra = _save({**tensors, stray: _ones()}, tmp_path / "extra.safetensors")
    with pytest.raises(LoraError, match=rf"LoRA {extra}: 1 key\(s\) match no layer: {stray}"):
        pipe.check_loras([[(str(extra), 1.0)]])
    pipe.check_loras([[(str(extra), 1.0)]], strict=False)  # skipped with a warning

    other = tmp_path / "other"
    wider = LTXVideoTransformer3DModel(**{**TRANSFORMER, "attention_head_dim": 16})
    wider.save_pretrained(other / "transformer")
    foreign = write_peft_lora(tmp_path / "foreign.safetensors", other, seed=3)
    with pytest.raises(
        LoraError,
        match=rf"LoRA {foreign}: \S+ is \[\d+, \d+\] \(rank \d\), but the model's \S+\.weight "
        r"is \[\d+, \d+\] \(a LoRA for another model\?\)",
    ):
        pipe.check_loras([[(str(foreign), 1.0)]])
