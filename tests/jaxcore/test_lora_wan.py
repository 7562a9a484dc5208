"""Wan LoRA files (diffusers/PEFT, ComfyUI / original Wan names, musubi-tuner) -> diffusers
module LoRAs (``jaxcore.lora.wan.to_diffusers``), checked against diffusers' own loader.

Each format's file (random factors, ranks 1..5 varying by layer, on attention, cross-attention,
FFN, the condition embedder and the head) is loaded into the tiny random-init ``WanPipeline``
with ``load_lora_weights`` + ``fuse_lora(lora_scale=0.8)``; the fused transformer's weights
minus the base weights must equal our ``layer.delta() * 0.8`` for every Linear (zero where we
have no layer) and every other parameter must be unchanged. Tolerance 1e-6 absolute; reached:
6.0e-8 without alphas and 2.4e-7 with them, on deltas up to 2.8 (float32 rounding: diffusers
folds alpha / rank into the two factors, we multiply their product).

Where diffusers cannot load a file for a reason of its own, the part is checked otherwise:
alphas outside the blocks and musubi layers outside the blocks (diffusers raises on both) are
checked against the ComfyUI conversion of the same factors, which is checked against diffusers.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from jaxcore import weights
from jaxcore.lora import wan
from jaxcore.lora.base import LoraError, read_lora_file
from jaxcore.models.wan_transformer import WanTransformerConfig
from pipelines.embedded.tiny import build_tiny_wan_pipeline
from tests.support import lora_wan_files as files

TOLERANCE = 1e-6
SCALE = 0.8
WHERE = "LoRA test.safetensors"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return build_tiny_wan_pipeline(tmp_path_factory.mktemp("wan_lora"), seed=3)


@pytest.fixture(scope="module")
def config(tiny_dir) -> WanTransformerConfig:
    return WanTransformerConfig.from_dict(weights.read_config(tiny_dir / "transformer"))


@pytest.fixture(scope="module")
def shapes(tiny_dir) -> dict[str, tuple[int, int]]:
    return files.linear_shapes(tiny_dir)


def _fused_deltas(tiny_dir: Path, lora: Path, *, prefix: str | None = "transformer") -> dict:
    """{transformer state-dict key: fused - base} after diffusers loads and fuses ``lora``.

    ``prefix=None``: keys without the ``transformer.`` prefix, which ``load_lora_weights``
    skips, are loaded with the transformer's own ``load_lora_adapter(prefix=None)``.
    """
    pytest.importorskip("peft")
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(tiny_dir)
    base = {k: v.detach().clone() for k, v in pipe.transformer.state_dict().items()}
    if prefix is None:
        pipe.transformer.load_lora_adapter(str(lora), prefix=None)
    else:
        pipe.load_lora_weights(str(lora))
    pipe.fuse_lora(lora_scale=SCALE)
    fused = {}
    for key, value in pipe.transformer.state_dict().items():
        if "lora_" in key:
            continue
        fused[key.replace(".base_layer.", ".")] = value.detach().numpy()
    assert set(fused) == set(base)
    return {key: fused[key] - base[key].numpy() for key in base}


def _max_error(converted, deltas: dict, skip: tuple[str, ...] = ()) -> float:
    """Largest |diffusers delta - ours * SCALE| over every parameter (ours: zero without a
    layer), leaving out the keys in ``skip``."""
    assert set(converted.layers) <= {k.removesuffix(".weight") for k in deltas}
    worst = 0.0
    for key, theirs in deltas.items():
        if key in skip:
            continue
        layer = converted.layers.get(key.removesuffix(".weight"))
        ours = np.zeros_like(theirs) if layer is None else layer.delta() * np.float32(SCALE)
        assert ours.shape == theirs.shape, key
        worst = max(worst, float(np.max(np.abs(ours - theirs), initial=0.0)))
    return worst


def _assert_same_layers(a, b) -> None:
    assert set(a.layers) == set(b.layers)
    for module, layer in a.layers.items():
        other = b.layers[module]
        np.testing.assert_array_equal(layer.down, other.down, err_msg=module)
        np.testing.assert_array_equal(layer.up, other.up, err_msg=module)
        assert layer.scale == other.scale, module


# --- the module table ---------------------------------------------------------------------------


def test_the_table_names_every_linear_of_the_model(config, shapes):
    table = wan.linear_modules(config)
    assert set(table.values()) == set(shapes)
    assert all(files.original_name(theirs) == ours for ours, theirs in table.items())


# --- each format vs diffusers -------------------------------------------------------------------


def test_diffusers_format_matches_diffusers(tiny_dir, config, shapes, tmp_path):
    factors = files.random_factors(shapes, seed=1)
    path = files.save(files.diffusers_tensors(factors), tmp_path / "peft.safetensors")
    converted = wan.to_diffusers(read_lora_file(path), config, WHERE)
    assert converted.format == "diffusers" and converted.unmatched == ()
    assert set(converted.layers) == set(shapes)
    assert {m: layer.rank for m, layer in converted.layers.items()} == {
        m: f.down.shape[0] for m, f in factors.items()
    }
    assert _max_error(converted, _fused_deltas(tiny_dir, path)) <= TOLERANCE


def test_diffusers_format_without_prefix_matches_diffusers(tiny_dir, config, shapes, tmp_path):
    """``load_lora_weights`` ignores keys without ``transformer.``; we take them, as
    ``WanTransformer3DModel.load_lora_adapter(prefix=None)`` does."""
    factors = files.random_factors(shapes, seed=2)
    path = files.save(files.diffusers_tensors(factors, prefix=""), tmp_path / "bare.safetensors")
    converted = wan.to_diffusers(read_lora_file(path), config, WHERE)
    assert converted.format == "diffusers" and converted.unmatched == ()
    assert set(converted.layers) == set(shapes)
    assert _max_error(converted, _fused_deltas(tiny_dir, path, prefix=None)) <= TOLERANCE


@pytest.mark.parametrize("naming", [("lora_A", "lora_B"), ("lora_down", "lora_up")])
def test_comfyui_format_matches_diffusers(tiny_dir, config, shapes, tmp_path, naming):
    """Original Wan names under ``diffusion_model.``; alphas on the block layers (diffusers
    raises on alphas elsewhere: see test_alphas_apply_on_every_layer)."""
    factors = files.random_factors(shapes, seed=3, alphas="blocks")
    path = files.save(files.comfyui_tensors(factors, naming), tmp_path / "comfy.safetensors")
    converted = wan.to_diffusers(read_lora_file(path), config, WHERE)
    assert converted.format == "comfyui" and converted.unmatched == ()
    assert set(converted.layers) == set(shapes)
    for module, layer in converted.layers.items():
        assert layer.scale == pytest.approx(factors[module].scale, rel=1e-7), module
    assert any(layer.scale != 1.0 for layer in converted.layers.values())
    assert _max_error(converted, _fused_deltas(tiny_dir, path)) <= TOLERANCE


def test_musubi_format_matches_diffusers(tiny_dir, config, shapes, tmp_path):
    """diffusers' musubi converter needs every block layer with an alpha and nothing else; the
    file is that (layers outside the blocks: test_formats_agree)."""
    blocks = [m for m in shapes if files.is_block_module(m)]
    factors = files.random_factors(shapes, seed=4, alphas="all", modules=blocks)
    path = files.save(files.musubi_tensors(factors), tmp_path / "musubi.safetensors")
    converted = wan.to_diffusers(read_lora_file(path), config, WHERE)
    assert converted.format == "musubi" and converted.unmatched == ()
    assert set(converted.layers) == set(blocks)
    assert _max_error(converted, _fused_deltas(tiny_dir, path)) <= TOLERANCE


def test_full_delta_of_the_head_matches_diffusers(tiny_dir, config, shapes, tmp_path):
    """``head.head.diff`` (lightx2v distill LoRAs) is applied exactly, as diffusers does with
    an identity factor; its bias delta ``head.head.diff_b`` is reported in ``unmatched`` (our
    LoRA layers carry no bias), where diffusers adds it to ``proj_out.bias``."""
    rng = np.random.default_rng(5)
    factors = files.random_factors(shapes, seed=5, alphas="blocks", modules=["blocks.0.ffn.net.2"])
    tensors = files.comfyui_tensors(factors)
    out_features, in_features = shapes["proj_out"]
    diff = (0.1 * rng.standard_normal((out_features, in_features))).astype(np.float32)
    diff_b = (0.1 * rng.standard_normal(out_features)).astype(np.float32)
    tensors["diffusion_model.head.head.diff"] = diff
    tensors["diffusion_model.head.head.diff_b"] = diff_b
    path = files.save(tensors, tmp_path / "distill.safetensors")

    converted = wan.to_diffusers(read_lora_file(path), config, WHERE)
    assert converted.unmatched == ("diffusion_model.head.head.diff_b",)
    assert set(converted.layers) == {"blocks.0.ffn.net.2", "proj_out"}
    np.testing.assert_array_equal(converted.layers["proj_out"].delta(), diff)

    deltas = _fused_deltas(tiny_dir, path)
    np.testing.assert_allclose(deltas["proj_out.bias"], SCALE * diff_b, atol=TOLERANCE, rtol=0)
    assert _max_error(converted, deltas, skip=("proj_out.bias",)) <= TOLERANCE


# --- what diffusers does not load -------------------------------------------------------------


def test_formats_agree(config, shapes):
    """One set of factors with an alpha on every layer (blocks, condition embedder, head) gives
    the same layers, bit for bit, in all three layouts: outside the blocks diffusers refuses
    alphas (ComfyUI) and any layer (musubi), so these are checked against the ComfyUI form."""
    factors = files.random_factors(shapes, seed=6, alphas="all")
    comfy = wan.to_diffusers(files.comfyui_tensors(factors), config, WHERE)
    for tensors in (
        files.musubi_tensors(factors),
        files.diffusers_tensors(factors),
        files.comfyui_tensors(factors, ("lora_A", "lora_B")),
        {k.removeprefix("diffusion_model."): v for k, v in files.comfyui_tensors(factors).items()},
    ):
        other = wan.to_diffusers(tensors, config, WHERE)
        assert other.unmatched == ()
        _assert_same_layers(comfy, other)
    assert wan.to_diffusers(files.musubi_tensors(factors), config, WHERE).format == "musubi"


def test_alphas_apply_on_every_layer(config, shapes):
    factors = files.random_factors(shapes, seed=7, alphas="all")
    converted = wan.to_diffusers(files.comfyui_tensors(factors), config, WHERE)
    for module, f in factors.items():
        layer = converted.layers[module]
        assert layer.scale == f.alpha / f.down.shape[0], module
        np.testing.assert_allclose(
            layer.delta(), f.alpha / f.down.shape[0] * f.up @ f.down, rtol=1e-5, atol=1e-7
        )


def test_full_deltas_are_exact_and_add_to_a_lora(config, shapes):
    """``.diff`` on any Linear is a LoRA of rank min(out, in) reproducing it bit for bit (wide
    and tall layers); with a LoRA on the same layer the two add up."""
    rng = np.random.default_rng(8)
    tensors, diffs = {}, {}
    for module in ("blocks.0.attn1.to_q", "blocks.1.ffn.net.0.proj", "blocks.1.ffn.net.2"):
        diffs[module] = rng.standard_normal(shapes[module]).astype(np.float32)
        tensors[f"diffusion_model.{files.original_name(module)}.diff"] = diffs[module]
    converted = wan.to_diffusers(tensors, config, WHERE)
    for module, diff in diffs.items():
        layer = converted.layers[module]
        assert layer.rank == min(diff.shape)
        np.testing.assert_array_equal(layer.delta(), diff)

    factors = files.random_factors(shapes, seed=8, alphas="all", modules=["blocks.0.attn1.to_q"])
    f = factors["blocks.0.attn1.to_q"]
    both = wan.to_diffusers({**tensors, **files.comfyui_tensors(factors)}, config, WHERE)
    layer = both.layers["blocks.0.attn1.to_q"]
    assert layer.rank == f.down.shape[0] + min(f.up.shape[0], f.down.shape[1])
    expected = diffs["blocks.0.attn1.to_q"] + f.scale * f.up @ f.down
    np.testing.assert_allclose(layer.delta(), expected, rtol=0, atol=1e-6)


def test_unmatched_lists_what_has_no_place(config, shapes):
    factors = files.random_factors(shapes, seed=9, modules=["blocks.0.attn2.to_k", "proj_out"])
    placed = files.comfyui_tensors(factors)
    one = np.ones((2, 32), np.float32)
    others = {
        # text encoders, in the diffusers, kohya and ComfyUI layouts
        "text_encoder.encoder.block.0.layer.0.SelfAttention.q.lora_A.weight": one,
        "lora_te_encoder_block_0_layer_0_SelfAttention_q.lora_down.weight": one,
        "text_encoders.umt5xxl.encoder.block.0.layer.0.SelfAttention.q.lora_A.weight": one,
        # unknown modules, and a block the 2-block model lacks
        "diffusion_model.blocks.0.self_attn.norm_q.lora_A.weight": one,
        "transformer.blocks.0.attn1.to_qkv.lora_A.weight": one,
        "diffusion_model.blocks.7.self_attn.q.lora_A.weight": one,
        "lora_unet_blocks_0_self_attn_qq.lora_down.weight": one,
        # Wan I2V image conditioning
        "diffusion_model.blocks.0.cross_attn.k_img.lora_A.weight": one,
        "diffusion_model.blocks.0.cross_attn.v_img.lora_B.weight": one,
        "diffusion_model.img_emb.proj.1.lora_down.weight": one,
        "lora_unet_blocks_0_cross_attn_k_img.lora_down.weight": one,
        # the Conv3d patch embedding
        "diffusion_model.patch_embedding.lora_down.weight": np.ones((2, 4, 1, 2, 2), np.float32),
        "transformer.patch_embedding.lora_A.weight": np.ones((2, 4, 1, 2, 2), np.float32),
        "diffusion_model.patch_embedding.diff": np.ones((32, 4, 1, 2, 2), np.float32),
        # bias and norm deltas, DoRA magnitudes, an alpha without its pair
        "diffusion_model.blocks.0.self_attn.q.diff_b": np.ones(32, np.float32),
        "transformer.blocks.0.attn1.to_q.lora_B.bias": np.ones(32, np.float32),
        "diffusion_model.blocks.0.norm3.diff": np.ones(32, np.float32),
        "diffusion_model.blocks.0.cross_attn.k.dora_scale": np.ones((32, 1), np.float32),
        "diffusion_model.blocks.1.self_attn.q.alpha": np.float32(4.0),
        # not a LoRA tensor at all
        "diffusion_model.blocks.0.self_attn.q.weight": np.ones((32, 32), np.float32),
    }
    converted = wan.to_diffusers({**placed, **others}, config, WHERE)
    assert set(converted.layers) == {"blocks.0.attn2.to_k", "proj_out"}
    assert converted.unmatched == tuple(sorted(others))
    assert converted.format == "comfyui"

    mixed = wan.to_diffusers(
        {
            **placed,
            **files.musubi_tensors(files.random_factors(shapes, 1, modules=["blocks.1.ffn.net.2"])),
        },
        config,
        WHERE,
    )
    assert mixed.format == "comfyui+musubi"
    assert wan.to_diffusers(others, config, WHERE).layers == {}


# --- malformed files ----------------------------------------------------------------------------


def _one_layer(shapes):
    f = files.random_factors(shapes, seed=10, alphas="all", modules=["blocks.1.attn1.to_v"])
    return files.comfyui_tensors(f), "diffusion_model.blocks.1.self_attn.v"


def test_rank_mismatch_is_an_error_naming_the_key(config, shapes):
    tensors, name = _one_layer(shapes)
    tensors[f"{name}.lora_up.weight"] = np.ones((32, 7), np.float32)
    with pytest.raises(LoraError, match=rf"{WHERE}: rank mismatch: {name}\.lora_down\.weight"):
        wan.to_diffusers(tensors, config, WHERE)


@pytest.mark.parametrize("part", ["lora_down", "lora_up"])
def test_half_a_pair_is_an_error_naming_the_key(config, shapes, part):
    tensors, name = _one_layer(shapes)
    del tensors[f"{name}.{part}.weight"]
    kept = "lora_up" if part == "lora_down" else "lora_down"
    with pytest.raises(LoraError, match=rf"{WHERE}: {name}\.{kept}\.weight has no matching"):
        wan.to_diffusers(tensors, config, WHERE)


def test_other_malformed_layers_are_errors(config, shapes):
    tensors, name = _one_layer(shapes)
    bad = {**tensors, f"{name}.lora_down.weight": np.ones((2, 32, 3), np.float32)}
    with pytest.raises(LoraError, match=rf"{name}\.lora_down\.weight has shape \[2, 32, 3\]"):
        wan.to_diffusers(bad, config, WHERE)
    bad = {**tensors, f"{name}.alpha": np.ones(2, np.float32)}
    with pytest.raises(LoraError, match=rf"{name}\.alpha has 2 values"):
        wan.to_diffusers(bad, config, WHERE)
    twice = {**tensors, "transformer.blocks.1.attn1.to_v.lora_A.weight": np.ones((2, 32))}
    with pytest.raises(LoraError, match="same layer blocks.1.attn1.to_v"):
        wan.to_diffusers(twice, config, WHERE)
    # a Linear's factor saved as a 1x1 convolution is squeezed, not refused
    conv = {k: v[..., None, None] if v.ndim == 2 else v for k, v in tensors.items()}
    _assert_same_layers(
        wan.to_diffusers(conv, config, WHERE), wan.to_diffusers(tensors, config, WHERE)
    )
