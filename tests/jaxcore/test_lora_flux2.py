"""Flux.2 LoRA and LoKr files (:mod:`jaxcore.lora.flux2`) and LoRA training on the Flux.2
transformer vs diffusers + PEFT.

Reference: a tiny perturbed ``Flux2Transformer2DModel`` (dev-like TINY_DEV of
tests/jaxcore/test_flux2_transformer.py: guidance embedder, patch size 2, mlp_ratio 2.5) with the
file loaded as ``Flux2KleinPipeline.load_lora_weights`` does (``Flux2LoraLoaderMixin.
lora_state_dict`` -> ``transformer.load_lora_adapter(prefix="transformer", metadata=...)``),
run unfused (PEFT's LoRA layers) and fused (``fuse_lora(lora_scale=0.8)``). Ours: the file
through ``merge.load_lora`` (the family's ``lora_to_diffusers`` + the PEFT header) and
``LoraMerger`` over the family's ``lora_weight_map``, then our jitted transformer. Every file is
random (ranks 1-7, alphas, nonzero ``up``; LoKr factors shaped as PEFT factors them) on every
Linear its format can name; the LoRA moves the output by several percent (>= MIN_EFFECT), and
ours must match within REL_TOL = 1e-5 of max |output| (measured: 1.5e-7 to 2.9e-7).

Where diffusers does not load what a file holds, the test says so and checks it another way:

- ``final_layer.adaLN_modulation.1`` (BFL ``[shift, scale]`` rows): diffusers' LoRA converter
  maps it to ``norm_out.linear`` (``[scale, shift]``) without swapping; diffusers is given the
  file with that layer's halves swapped, which is what we apply for the original file.
- kohya files: diffusers drops the modulations, ``guidance_in`` and the final adaLN; the rest
  goes through diffusers, those layers must equal the AI-Toolkit conversion of the same LoRA.
- ``diffusion_model.`` + ``lora_down``/``lora_up`` (+ alpha): diffusers routes any
  ``lora_down`` file to its kohya converter, which drops these keys; they must convert like
  the ``lora_A``/``lora_B`` file diffusers does load, with ``alpha / rank`` folded into B.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.core import meta

from jaxcore.families.flux2 import Flux2Family
from jaxcore.lora import base, flux2, merge, training
from jaxcore.models import flux2_transformer as f2
from tests.jaxcore.test_flux2_transformer import (
    KLEIN_4B,
    TINY_DEV,
    _inputs,
    _rel_diff,
    _save_reference,
    _torch_call,
)
from tests.support import lora_files as lf
from tests.support.tiny_flux2 import TRANSFORMER as TINY_KLEIN_PIPELINE

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

REL_TOL = 1e-5
LORA_SCALE = 0.8  # fused runs: diffusers' fuse_lora(lora_scale) vs our merge scale
MIN_EFFECT = 0.02  # a LoRA must move the output by at least this (relative): no trivial pass
FAMILY = Flux2Family()


# ----------------------------------------------------------------------------------------------
# Fixtures and helpers
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("flux2_lora")
    _save_reference(directory, TINY_DEV, seed=3)
    return directory


@pytest.fixture(scope="module")
def ours(reference_dir):
    """(config, base params, jitted forward(params) on the shared inputs, module)."""
    module, params = f2.load_flux2_transformer(reference_dir)
    inputs = _model_inputs()
    forward = jax.jit(lambda p: module.apply({"params": p}, **inputs))
    return module.config, meta.unbox(params), forward, module


@pytest.fixture(scope="module")
def base_output(reference_dir) -> np.ndarray:
    from diffusers import Flux2Transformer2DModel

    model = Flux2Transformer2DModel.from_pretrained(reference_dir).eval()
    return _torch_call(model, **_model_inputs())[0].numpy()


def _model_inputs() -> dict:
    inputs = _inputs(TINY_DEV, 2, 5, 3, 4)
    return {k: v for k, v in inputs.items() if v is not None}


def _diffusers_output(reference_dir: Path, lora: Path, *, fuse: bool) -> np.ndarray:
    """diffusers' transformer output with ``lora`` loaded as ``load_lora_weights`` loads it;
    ``fuse``: merged into the weights at LORA_SCALE, else PEFT layers at scale 1."""
    from diffusers import Flux2Transformer2DModel
    from diffusers.loaders.lora_pipeline import Flux2LoraLoaderMixin

    model = Flux2Transformer2DModel.from_pretrained(reference_dir).eval()
    state, metadata = Flux2LoraLoaderMixin.lora_state_dict(
        str(lora.parent), weight_name=lora.name, return_lora_metadata=True
    )
    assert state, f"diffusers read nothing from {lora}"
    model.load_lora_adapter(state, prefix="transformer", metadata=metadata)
    if fuse:
        model.fuse_lora(lora_scale=LORA_SCALE)
    return _torch_call(model, **_model_inputs())[0].numpy()


def _our_output(ours, lora: Path, scale: float) -> tuple[np.ndarray, merge.LoadedLora]:
    config, params, forward, _ = ours
    loaded = merge.load_lora(str(lora), FAMILY, config)
    merged = merge.LoraMerger(params, FAMILY.lora_weight_map(config)).merged([(loaded, scale)])
    return np.asarray(forward(merged)), loaded


def _check_vs_diffusers(reference_dir, ours, base_output, ours_file, theirs_file=None) -> dict:
    """Ours (``ours_file``) vs diffusers (``theirs_file``, default the same) unfused at scale 1
    and fused at LORA_SCALE; returns the measured relative errors."""
    theirs_file = theirs_file or ours_file
    errors = {}
    for fuse, scale in ((False, 1.0), (True, LORA_SCALE)):
        expected = _diffusers_output(reference_dir, theirs_file, fuse=fuse)
        assert _rel_diff(base_output, expected) > MIN_EFFECT, "the LoRA barely moves the output"
        got, loaded = _our_output(ours, ours_file, scale)
        errors["fused" if fuse else "unfused"] = _rel_diff(got, expected)
    assert loaded.converted.unmatched == ()
    assert max(errors.values()) <= REL_TOL, errors
    return errors


def _save(path: Path, layers, layout: str, **kw) -> Path:
    return lf.save_lora(path, lf.lora_keys(layers, layout, **kw))


def _convert(state: dict, config) -> base.Converted:
    return flux2.to_diffusers(state, config, "test.safetensors")


def _deltas(converted: base.Converted) -> dict[str, np.ndarray]:
    return {name: layer.delta() for name, layer in converted.layers.items()}


def _assert_same_deltas(a: base.Converted, b: base.Converted, atol: float = 1e-6) -> float:
    ours, theirs = _deltas(a), _deltas(b)
    assert sorted(ours) == sorted(theirs)
    worst = max(float(np.max(np.abs(ours[k] - theirs[k]))) for k in ours)
    assert worst <= atol, worst
    return worst


def _torch_linears(model) -> dict[str, tuple[int, int]]:
    return {
        name: tuple(m.weight.shape)
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear)
    }


# ----------------------------------------------------------------------------------------------
# The model's Linear layers
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [TINY_DEV, TINY_KLEIN_PIPELINE, {"guidance_embeds": True}, KLEIN_4B],
    ids=["tiny-dev", "tiny-klein", "dev", "klein-4b"],
)
def test_linear_shapes_are_diffusers_linears(kwargs):
    """Our LoRA vocabulary is exactly diffusers' Linear layers (real sizes on the meta device);
    every BFL name feeds existing layers with matching widths."""
    from diffusers import Flux2Transformer2DModel

    with torch.device("meta"):
        model = Flux2Transformer2DModel(**kwargs)
    config = f2.Flux2TransformerConfig(**kwargs)
    shapes = flux2.linear_shapes(config)
    assert shapes == _torch_linears(model)
    bfl = lf.flux2_bfl_shapes(config)
    assert sorted(bfl) == sorted(flux2.bfl_names(config))
    for name, modules in flux2.bfl_names(config).items():
        assert bfl[name] == (sum(shapes[m][0] for m in modules), shapes[modules[0]][1]), name


def test_lora_weight_map_reaches_every_linear(ours):
    """Every LoRA target has a weight-map entry whose torch shape is the Linear's."""
    config, params, _, _ = ours
    index = {key: (path, t) for path, (key, t) in FAMILY.lora_weight_map(config).items()}
    for module, shape in flux2.linear_shapes(config).items():
        path, transform = index[f"{module}.weight"]
        assert merge._torch_shape(transform, merge._get(params, path).shape) == shape, module


# ----------------------------------------------------------------------------------------------
# Formats vs diffusers' loader
# ----------------------------------------------------------------------------------------------


def test_diffusers_format_vs_diffusers(reference_dir, ours, base_output, tmp_path):
    """``transformer.<module>.lora_A/B`` on every Linear, distinct ranks, no header."""
    config = ours[0]
    layers = lf.random_layers(flux2.linear_shapes(config), seed=1, alphas=False)
    path = _save(tmp_path / "lora.safetensors", layers, "diffusers")
    errors = _check_vs_diffusers(reference_dir, ours, base_output, path)
    print("diffusers format:", errors)


def test_diffusers_saved_with_peft_header_vs_diffusers(reference_dir, ours, base_output, tmp_path):
    """A file written by ``save_lora_weights`` with its PEFT config (``lora_alpha`` != r, an
    ``alpha_pattern`` and a ``rank_pattern``): diffusers scales by it, and so do we."""
    from diffusers.loaders.lora_pipeline import Flux2LoraLoaderMixin

    config = ours[0]
    shapes = flux2.linear_shapes(config)
    layers = {
        name: lf.random_layer(*shape, 3, None, seed=i)
        for i, (name, shape) in enumerate(shapes.items())
    }
    layers["context_embedder"] = lf.random_layer(*shapes["context_embedder"], 5, None, seed=99)
    tensors = {
        k.removeprefix("transformer."): torch.from_numpy(v)
        for k, v in lf.lora_keys(layers, "diffusers").items()
    }
    header = {
        "r": 3,
        "lora_alpha": 4.5,
        "rank_pattern": {"context_embedder": 5},
        "alpha_pattern": {"x_embedder": 1.5},
        "target_modules": sorted(shapes),
    }
    Flux2LoraLoaderMixin.save_lora_weights(
        tmp_path, transformer_lora_layers=tensors, transformer_lora_adapter_metadata=header
    )
    path = tmp_path / base.LORA_FILE_NAME
    errors = _check_vs_diffusers(reference_dir, ours, base_output, path)
    _, loaded = _our_output(ours, path, 1.0)
    assert loaded.converted.layers["x_embedder"].scale == pytest.approx(1.5 / 3)
    assert loaded.converted.layers["context_embedder"].scale == pytest.approx(4.5 / 5)
    print("diffusers format + PEFT header:", errors)


def _bfl_layers(config, seed: int, *, alphas: bool) -> dict[str, lf.RandomLayer]:
    """A random LoRA on every BFL Linear; block 0's txt qkv block-sparse (sd-scripts
    split_qkv), so it splits into its rank blocks."""
    layers = lf.random_layers(lf.flux2_bfl_shapes(config), seed=seed, alphas=alphas)
    d = config.hidden_dim
    txt = lf.random_layer(3 * d, d, 6, alpha=5.0 if alphas else None, seed=seed + 100)
    layers["double_blocks.0.txt_attn.qkv"] = lf.block_sparse(txt, [d, d, d])
    return layers


def _for_diffusers(layers: dict) -> dict:
    """What diffusers must be given to apply what we apply (its unswapped final adaLN)."""
    name = "final_layer.adaLN_modulation.1"
    return {**layers, name: lf.swapped_halves(layers[name])}


@pytest.mark.parametrize("prefix", ["diffusion_model.", "base_model.model."])
def test_bfl_names_vs_diffusers(reference_dir, ours, base_output, tmp_path, prefix):
    """AI-Toolkit / ComfyUI (``diffusion_model.``) and PEFT (``base_model.model.``) files with
    the original BFL names and ``lora_A``/``lora_B`` on every BFL Linear (fused qkv split)."""
    config = ours[0]
    layers = _bfl_layers(config, seed=2, alphas=False)
    path = _save(tmp_path / "ours.safetensors", layers, "comfyui-peft", prefix=prefix)
    theirs = _save(
        tmp_path / "theirs.safetensors", _for_diffusers(layers), "comfyui-peft", prefix=prefix
    )
    errors = _check_vs_diffusers(reference_dir, ours, base_output, path, theirs)
    converted = _convert(base.read_lora_file(path), config)
    assert converted.format == ("ai-toolkit" if prefix == "diffusion_model." else "peft")
    assert sorted(converted.layers) == sorted(flux2.linear_shapes(config))
    assert converted.layers["transformer_blocks.0.attn.add_q_proj"].rank == 2  # block-sparse
    print(prefix, errors)


def test_diffusers_block_names_under_diffusion_model_vs_diffusers(
    reference_dir, ours, base_output, tmp_path
):
    """``diffusion_model.`` files that name the blocks by diffusers' names (double blocks under
    the ``sformer_blocks.`` alias) and the rest by BFL names."""
    config = ours[0]
    block_shapes = {
        name.replace("transformer_blocks.", "sformer_blocks.", 1)
        if name.startswith("transformer_blocks.")
        else name: shape
        for name, shape in flux2.linear_shapes(config).items()
        if "transformer_blocks." in name
    }
    others = {
        name: shape
        for name, shape in lf.flux2_bfl_shapes(config).items()
        if not name.startswith(("double_blocks.", "single_blocks."))
    }
    layers = lf.random_layers({**block_shapes, **others}, seed=3, alphas=False)
    path = _save(tmp_path / "ours.safetensors", layers, "comfyui-peft")
    theirs = _save(tmp_path / "theirs.safetensors", _for_diffusers(layers), "comfyui-peft")
    errors = _check_vs_diffusers(reference_dir, ours, base_output, path, theirs)
    print("diffusers block names:", errors)


# the BFL layers diffusers' kohya converter drops (with a warning)
_KOHYA_DROPPED = (
    "double_stream_modulation_img.lin",
    "double_stream_modulation_txt.lin",
    "single_stream_modulation.lin",
    "guidance_in.in_layer",
    "guidance_in.out_layer",
    "final_layer.adaLN_modulation.1",
)


def test_kohya_vs_diffusers(reference_dir, ours, base_output, tmp_path):
    """``lora_unet_`` + underscored BFL names, ``lora_down``/``lora_up`` and alphas (scale
    alpha / rank, also of the split qkv parts and a block-sparse qkv)."""
    config = ours[0]
    layers = _bfl_layers(config, seed=4, alphas=True)
    kept = {k: v for k, v in layers.items() if k not in _KOHYA_DROPPED}
    path = _save(tmp_path / "lora.safetensors", kept, "kohya")
    errors = _check_vs_diffusers(reference_dir, ours, base_output, path)
    print("kohya:", errors)


def test_kohya_layers_diffusers_drops_convert_like_ai_toolkit(ours):
    """The layers diffusers' kohya converter drops convert as the same LoRA in AI-Toolkit
    layout (proven against diffusers above), alphas applied."""
    config = ours[0]
    layers = _bfl_layers(config, seed=5, alphas=True)
    kohya = _convert(lf.lora_keys(layers, "kohya"), config)
    toolkit = _convert(lf.lora_keys(layers, "comfyui-peft"), config)
    assert kohya.format == "kohya" and kohya.unmatched == ()
    for name in kohya.layers:
        np.testing.assert_array_equal(kohya.layers[name].up, toolkit.layers[name].up, name)
        assert kohya.layers[name].scale == toolkit.layers[name].scale, name
    assert kohya.layers["norm_out.linear"].scale == pytest.approx(
        layers["final_layer.adaLN_modulation.1"].scale
    )


def test_lora_down_up_under_diffusion_model_fold_alpha(ours):
    """``diffusion_model.`` + ``lora_down``/``lora_up`` + alpha (diffusers' converter reads
    them, its router never calls it) = the ``lora_A``/``lora_B`` file with alpha / rank folded
    into B."""
    config = ours[0]
    layers = _bfl_layers(config, seed=6, alphas=True)
    folded = {
        k: lf.RandomLayer(v.down, (v.up * np.float32(v.scale)).astype(np.float32), None)
        for k, v in layers.items()
    }
    ours_ = _convert(lf.lora_keys(layers, "comfyui"), config)
    assert ours_.unmatched == ()
    worst = _assert_same_deltas(ours_, _convert(lf.lora_keys(folded, "comfyui-peft"), config))
    print("lora_down/up + alpha vs folded lora_A/B: max abs", worst)


def test_diffusers_converter_output_equals_ours(ours):
    """Key by key, our conversion of an AI-Toolkit file equals diffusers'
    ``_convert_non_diffusers_flux2_lora_to_diffusers``, up to the final adaLN's halves, which it
    leaves in BFL's [shift, scale] order."""
    from diffusers.loaders.lora_conversion_utils import (
        _convert_non_diffusers_flux2_lora_to_diffusers,
    )

    config = ours[0]
    layers = _bfl_layers(config, seed=7, alphas=False)
    state = lf.lora_keys(layers, "comfyui-peft")
    theirs = _convert_non_diffusers_flux2_lora_to_diffusers(
        {k: torch.from_numpy(v) for k, v in state.items()}
    )
    converted = _convert(lf.lora_keys(layers, "comfyui-peft"), config)
    half = config.hidden_dim
    for name, layer in converted.layers.items():
        down = theirs[f"transformer.{name}.lora_A.weight"].numpy()
        up = theirs[f"transformer.{name}.lora_B.weight"].numpy()
        delta = up.astype(np.float64) @ down
        if name == "norm_out.linear":
            delta = np.concatenate([delta[half:], delta[:half]])
        np.testing.assert_allclose(layer.delta(), delta, rtol=0, atol=1e-6, err_msg=name)


# ----------------------------------------------------------------------------------------------
# LoKr
# ----------------------------------------------------------------------------------------------


def _lokr_layers(config, layout: str, seed: int) -> dict[str, lf.RandomLokr]:
    """A random LoKr on every Linear ``layout`` can name (its module names), alphas where
    diffusers takes them."""
    if layout == "diffusion_model.":
        shapes = lf.flux2_bfl_shapes(config)
    else:
        shapes = flux2.linear_shapes(config)
        if layout == "lycoris_":
            shapes = {k: v for k, v in shapes.items() if "transformer_blocks." in k}
    return lf.random_lokr_layers(shapes, seed, alphas=layout != "transformer.")


@pytest.mark.parametrize("layout", ["transformer.", "diffusion_model.", "lycoris_", ""])
def test_lokr_vs_diffusers(reference_dir, ours, base_output, tmp_path, layout):
    """LoKr files (``lokr_w1`` full, ``lokr_w2`` decomposed or full as PEFT factors them) in
    the four layouts diffusers loads for Flux.2: PEFT (``transformer.``), AI-Toolkit BFL names
    (diffusers fuses the model's q/k/v for the fused qkv factors; alphas baked), LyCORIS
    (underscored diffusers block names) and bare diffusers names (SimpleTuner)."""
    config = ours[0]
    layers = _lokr_layers(config, layout, seed=11)
    underscored = layout == "lycoris_"
    path = lf.save_lora(
        tmp_path / "ours.safetensors", lf.lokr_keys(layers, layout, underscored=underscored)
    )
    theirs = path
    if layout == "diffusion_model.":
        name = "final_layer.adaLN_modulation.1"
        swapped = {**layers, name: lf.swapped_lokr_halves(layers[name])}
        theirs = lf.save_lora(tmp_path / "theirs.safetensors", lf.lokr_keys(swapped, layout))
    errors = _check_vs_diffusers(reference_dir, ours, base_output, path, theirs)
    converted = _convert(base.read_lora_file(path), config)
    assert converted.format.endswith("-lokr"), converted.format
    print(f"LoKr {layout or 'bare'}:", errors)


@pytest.mark.parametrize("alphas", [False, True], ids=["no_alpha", "alpha"])
@pytest.mark.parametrize("decompose_w1", [False, True], ids=["w1", "w1_ab"])
def test_lokr_deltas_are_the_kronecker_products(ours, alphas, decompose_w1):
    """Every layer's delta is ``scale * kron(w1, w2)`` (float64 reference), with LyCORIS'
    scale: ``alpha / rank`` of the decomposed factor, none when both factors are full; the
    fused BFL qkv splits into its q, k, v rows."""
    config = ours[0]
    shapes = lf.flux2_bfl_shapes(config)
    layers = lf.random_lokr_layers(shapes, 12, alphas=alphas, decompose_w1=decompose_w1, rank=3)
    full = {"final_layer.linear": shapes["final_layer.linear"]}  # [24, 24] = [4 x 6, 4 x 6]
    layers |= lf.random_lokr_layers(full, 13, rank=6, alphas=alphas)  # 6 >= max(6, 6) / 2
    assert {"lokr_w1", "lokr_w2"} == set(layers["final_layer.linear"].factors)
    converted = _convert(lf.lokr_keys(layers, "diffusion_model."), config)
    assert converted.unmatched == ()
    names = flux2.bfl_names(config)
    worst = 0.0
    for bfl, layer in layers.items():
        expected = layer.delta()
        if bfl == "final_layer.adaLN_modulation.1":
            half = expected.shape[0] // 2
            expected = np.concatenate([expected[half:], expected[:half]])
        ours_ = np.concatenate([converted.layers[m].delta() for m in names[bfl]])
        worst = max(worst, float(np.max(np.abs(ours_ - expected))))
    assert converted.layers["proj_out"].scale == 1.0  # both factors full: alpha not applied
    for bfl, layer in layers.items():  # RandomLokr.scale: LyCORIS' rule, written separately
        for module in names[bfl]:
            assert converted.layers[module].scale == pytest.approx(layer.scale, rel=1e-7), module
    assert layers["double_blocks.0.img_mlp.0"].scale != 1.0 or not alphas  # w2 decomposed
    assert worst <= 1e-6, worst


# ----------------------------------------------------------------------------------------------
# Malformed files
# ----------------------------------------------------------------------------------------------


def _one_layer(config, **kw) -> dict[str, np.ndarray]:
    d = config.hidden_dim
    layer = lf.random_layer(d, d, 2, alpha=kw.pop("alpha", None), seed=0)
    return lf.lora_keys({"transformer_blocks.0.attn.to_q": layer}, "diffusers", **kw)


def test_malformed_files_name_the_key(ours, tmp_path):
    config = ours[0]
    key = "transformer.transformer_blocks.0.attn.to_q"
    state = _one_layer(config)
    with pytest.raises(base.LoraError, match=rf"{key}.lora_A.weight has no LoRA up"):
        _convert({k: v for k, v in state.items() if "lora_B" not in k}, config)
    bad_rank = {**state, f"{key}.lora_B.weight": np.ones((config.hidden_dim, 3), np.float32)}
    with pytest.raises(base.LoraError, match=rf"{key}.lora_B.weight.*rank 3.*rank 2"):
        _convert(bad_rank, config)
    wide = {**state, f"{key}.lora_A.weight": np.ones((2, 7), np.float32)}
    with pytest.raises(base.LoraError, match=rf"{key}.lora_A.weight.*reads 7 features"):
        _convert(wide, config)
    qkv = "diffusion_model.double_blocks.0.img_attn.qkv"
    short = {f"{qkv}.lora_A.weight": np.ones((2, 24), np.float32)}
    short[f"{qkv}.lora_B.weight"] = np.ones((48, 2), np.float32)
    with pytest.raises(base.LoraError, match=rf"{qkv}.lora_B.weight.*48 rows.*72 rows split"):
        _convert(short, config)
    alpha = {**state, f"{key}.alpha": np.ones(2, np.float32)}
    with pytest.raises(base.LoraError, match=rf"{key}.alpha: alpha has shape"):
        _convert(alpha, config)
    twice = {**state, **{k.replace("lora_A", "lora_down"): v for k, v in state.items()}}
    twice = {k.replace("transformer.", "diffusion_model.", 1): v for k, v in twice.items()}
    with pytest.raises(base.LoraError, match="lora_down.weight and .*lora_A.weight are both"):
        _convert(twice, config)
    both = {**state, **lf.lora_keys(_bfl_layers(config, 8, alphas=False), "comfyui-peft")}
    with pytest.raises(base.LoraError, match="are both LoRAs of transformer_blocks.0.attn.to_q"):
        _convert(both, config)
    lokr = {"diffusion_model.double_blocks.0.img_attn.qkv.lokr_w1": np.ones((8, 4), np.float32)}
    with pytest.raises(base.LoraError, match=r"needs lokr_w2 .*beside .*img_attn.qkv.lokr_w1"):
        _convert(lokr, config)
    lokr["diffusion_model.double_blocks.0.img_attn.qkv.lokr_w2_a"] = np.ones((9, 2), np.float32)
    with pytest.raises(base.LoraError, match=r"qkv.lokr_w2_a has no matching lokr_w2_a / "):
        _convert(lokr, config)
    lokr["diffusion_model.double_blocks.0.img_attn.qkv.lokr_w2_b"] = np.ones((2, 5), np.float32)
    with pytest.raises(base.LoraError, match=r"qkv.lokr_w1: the LoKr factors .* \[72, 20\] delta"):
        _convert(lokr, config)


@pytest.mark.parametrize(
    "key",
    [
        "transformer.transformer_blocks.5.attn.to_q.lora_A.weight",  # no such block
        "diffusion_model.double_blocks.0.img_mod.lin.lora_A.weight",  # a Flux.1 name
        "diffusion_model.x_embedder.lora_A.weight",  # diffusers name, not a block
        "lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_down.weight",  # text encoder
        "transformer.proj_out.lora_down.weight",  # kohya suffix under transformer.
        "transformer.proj_out.lora_B.bias",
    ],
)
def test_unknown_keys_are_refused_by_name(ours, tmp_path, key):
    """Keys no rule places are returned as unmatched, and the merger refuses them by name."""
    config, params, _, _ = ours
    state = {**_one_layer(config), key: np.ones((2, 2), np.float32)}
    converted = _convert(state, config)
    assert converted.unmatched == (key,)
    assert list(converted.layers) == ["transformer_blocks.0.attn.to_q"]
    path = lf.save_lora(tmp_path / "lora.safetensors", state)
    loaded = merge.load_lora(str(path), FAMILY, config)
    with pytest.raises(base.LoraError, match=rf"1 key\(s\) match no layer: {key}"):
        merge.LoraMerger(params, FAMILY.lora_weight_map(config)).plan([(loaded, 1.0)])


# ----------------------------------------------------------------------------------------------
# Training and export
# ----------------------------------------------------------------------------------------------

TRAIN_TARGETS = (
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
    "ff.linear_in",
    "ff.linear_out",
    "ff_context.linear_in",
    "ff_context.linear_out",
    "attn.to_qkv_mlp_proj",
    "attn.to_out",
)


def _train_step(module, base_params, targets, inputs, target_out, scale):
    def loss_fn(adapters):
        params = training.merge_traced(base_params, adapters, targets, scale)
        out = module.apply({"params": params}, **inputs)
        return jnp.mean((out - target_out) ** 2)

    @jax.jit
    def step(adapters):
        loss, grads = jax.value_and_grad(loss_fn)(adapters)
        return loss, jax.tree.map(lambda a, g: a - 10.0 * g, adapters, grads)

    return step


def test_train_step_changes_only_adapters_and_exports_to_diffusers(
    reference_dir, ours, base_output, tmp_path
):
    """Two SGD steps through ``merge_traced`` on the family's ``lora_weight_map``: the base
    params are untouched, every adapter's ``up`` leaves 0, the loss falls, and the exported
    ``pytorch_lora_weights.safetensors`` loaded by diffusers gives our adapted output."""
    config, params, forward, module = ours
    inputs = _model_inputs()
    targets = training.find_targets(FAMILY.lora_weight_map(config), params, TRAIN_TARGETS)
    assert set(targets) == {m for m in flux2.linear_shapes(config) if "transformer_blocks." in m}
    adapters = training.init_adapters(targets, 2, jax.random.key(0))
    before = jax.tree.map(np.asarray, params)
    target_out = jnp.asarray(base_output) + 0.5
    scale = 1.5
    step = _train_step(module, params, targets, inputs, target_out, scale)
    loss0, adapters1 = step(adapters)
    loss1, adapters2 = step(adapters1)
    assert float(loss1) < float(loss0)
    jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.asarray, params))
    for name in targets:
        start, first, second = (training._leaf(a, name) for a in (adapters, adapters1, adapters2))
        assert np.any(np.asarray(first["up"]) != 0), name
        # up = 0 at step 0 gives down no gradient (as in PEFT); down moves from step 1 on
        np.testing.assert_array_equal(first["down"], start["down"])
        assert np.any(np.asarray(second["down"]) != np.asarray(first["down"])), name
    adapters = adapters2
    adapted = np.asarray(forward(training.merge_traced(params, adapters, targets, scale)))
    assert _rel_diff(base_output, adapted) > 1e-3

    layers = training.adapter_layers(adapters, targets, scale)
    tensors = training.export_peft(layers, FAMILY.denoiser_component)
    path = lf.save_lora(tmp_path / base.LORA_FILE_NAME, tensors)
    theirs = _diffusers_output(reference_dir, path, fuse=False)
    error = _rel_diff(adapted, theirs)
    assert error <= REL_TOL
    ours_again, _ = _our_output(ours, path, 1.0)  # and our own loader reads it back
    assert _rel_diff(ours_again, adapted) <= REL_TOL
    print("train step exported: rel", error)
