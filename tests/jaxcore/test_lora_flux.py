"""Flux LoRA files -> per diffusers module deltas (:mod:`jaxcore.lora.flux`) vs diffusers.

Reference: diffusers 0.42 + peft loading each file into the tiny ``FluxPipeline`` of
tests/support/tiny_flux.py (``load_lora_weights``, ``fuse_lora(lora_scale=0.8)``); the fused
transformer weights minus the base weights are compared with ``0.8 * LoraLayer.delta()`` of our
conversion, module by module, and every other parameter must be unchanged. Tolerance: max abs
diff <= 1e-6 on deltas up to ~2 (reached: 2.1e-7, the float32 rounding of ``base + delta``;
1.0e-7 against diffusers' converter output; 2.2e-8 relative at real sizes, where the bound is
1e-6 of the largest probe value). Every file is random (distinct ranks 1-7 and alphas per layer)
and covers double blocks, single blocks, the embedders and the final layer.

Where diffusers does not load what a file holds, the test says so and checks that part another
way:

- diffusers format with per-module alphas: diffusers hands them to PEFT as ``alpha_pattern``
  keys that PEFT matches as name suffixes, so the top-level ``proj_out`` alpha also scales every
  single block's ``proj_out``; the test undoes exactly that on diffusers' side (we keep each
  module's own alpha).
- kohya / ComfyUI (BFL names): diffusers hard-codes Flux.1's [3072, 3072, 3072, 12288] split of
  the single blocks' ``linear1``, which the tiny model cannot take; ``linear1`` is compared with
  ``_convert_kohya_flux_lora_to_diffusers`` at real Flux.1 sizes (rank 2, and rank 4
  block-sparse; LoRA tensors only, deltas compared through random probes). diffusers converts the embedder and final-layer
  LoRAs to keys without the ``transformer.`` prefix, which ``load_lora_weights`` then drops
  silently; they are compared with that converter's output, whose final-layer tensors also
  ignore the file's alpha (sd-scripts scales every module by alpha / rank, and so do we).
- ComfyUI ``lora_A``/``lora_B`` with BFL names and diffusers-name keys with a
  ``diffusion_model.`` prefix or none: diffusers' Flux loader places nothing from them; they
  must convert exactly like the layout diffusers does load.
- kohya "mixture" (``lora_transformer_``): diffusers converts only the attention, embedder and
  output modules of that layout (the others get a module name without the layer); those go
  through diffusers, the rest must equal the diffusers-format conversion.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from jaxcore.lora import base, flux
from jaxcore.models.flux_transformer import FluxTransformerConfig
from tests.support import lora_files as lf

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

ATOL = 1e-6
LORA_SCALE = 0.8


# ----------------------------------------------------------------------------------------------
# Fixtures and helpers
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def flux_dir(tmp_path_factory) -> Path:
    from tests.support.tiny_flux import build_flux_pipeline

    return build_flux_pipeline(tmp_path_factory.mktemp("flux_lora"), seed=5)


@pytest.fixture(scope="module")
def config(flux_dir) -> FluxTransformerConfig:
    return FluxTransformerConfig.from_dict(
        json.loads((flux_dir / "transformer" / "config.json").read_text())
    )


def _torch_linear_shapes(model) -> dict[str, tuple[int, int]]:
    return {
        name: tuple(module.weight.shape)
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear)
    }


@pytest.fixture(scope="module")
def diffusers_shapes(flux_dir) -> dict[str, tuple[int, int]]:
    from diffusers import FluxTransformer2DModel

    return _torch_linear_shapes(FluxTransformer2DModel.from_pretrained(flux_dir / "transformer"))


def _diffusers_deltas(flux_dir: Path, lora: Path) -> dict[str, np.ndarray]:
    """``{module: fused weight - base weight}`` of every Linear diffusers changed when it loads
    and fuses ``lora`` at LORA_SCALE; asserts that no other parameter changed."""
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(flux_dir)
    before = {k: v.detach().clone() for k, v in pipe.transformer.state_dict().items()}
    pipe.load_lora_weights(str(lora))
    pipe.fuse_lora(lora_scale=LORA_SCALE)
    after = {
        k.replace(".base_layer.", "."): v.detach()
        for k, v in pipe.transformer.state_dict().items()
        if ".lora_" not in k
    }
    assert set(after) == set(before)
    deltas = {}
    for key, value in after.items():
        if torch.equal(value, before[key]):
            continue
        assert key.endswith(".weight"), f"diffusers changed {key}"
        deltas[key.removesuffix(".weight")] = (value.double() - before[key].double()).numpy()
    return deltas


def _ours(converted: base.Converted) -> dict[str, np.ndarray]:
    return {name: LORA_SCALE * layer.delta() for name, layer in converted.layers.items()}


def _max_diff(ours: dict[str, np.ndarray], theirs: dict[str, np.ndarray]) -> float:
    assert sorted(ours) == sorted(theirs)
    worst = 0.0
    for name, delta in ours.items():
        assert delta.shape == theirs[name].shape, name
        worst = max(worst, float(np.max(np.abs(delta - theirs[name]))))
    return worst


def _convert(path: Path, config) -> base.Converted:
    return flux.to_diffusers(base.read_lora_file(path), config, str(path))


def _same_layers(a: base.Converted, b: base.Converted) -> None:
    assert sorted(a.layers) == sorted(b.layers)
    for name, layer in a.layers.items():
        other = b.layers[name]
        np.testing.assert_array_equal(layer.down, other.down, err_msg=name)
        np.testing.assert_array_equal(layer.up, other.up, err_msg=name)
        assert layer.scale == other.scale, name


# ----------------------------------------------------------------------------------------------
# The model's Linear layers
# ----------------------------------------------------------------------------------------------


def test_linear_shapes_are_diffusers_linears(config, diffusers_shapes):
    assert flux.linear_shapes(config) == diffusers_shapes


@pytest.mark.parametrize("guidance_embeds", [True, False])
def test_linear_shapes_real_flux(guidance_embeds):
    """Flux.1-dev / -schnell sizes, diffusers' module built on the meta device."""
    from diffusers import FluxTransformer2DModel

    kw = dict(guidance_embeds=guidance_embeds, pooled_projection_dim=768, in_channels=64)
    with torch.device("meta"):
        model = FluxTransformer2DModel(**kw)
    assert flux.linear_shapes(FluxTransformerConfig(**kw)) == _torch_linear_shapes(model)


# ----------------------------------------------------------------------------------------------
# Formats vs diffusers' loader
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("alphas", [False, True], ids=["no_alpha", "alpha"])
def test_diffusers_format_vs_diffusers(flux_dir, config, diffusers_shapes, tmp_path, alphas):
    """PEFT / AI-Toolkit layout (``transformer.<module>.lora_A/B`` [+ ``.alpha``]) on every
    Linear of the model."""
    layers = lf.random_layers(diffusers_shapes, seed=1, alphas=alphas)
    path = lf.save_lora(tmp_path / "lora.safetensors", lf.lora_keys(layers, "diffusers"))
    converted = _convert(path, config)
    assert converted.format == "diffusers" and converted.unmatched == ()
    for name, layer in layers.items():
        assert converted.layers[name].scale == pytest.approx(layer.scale, rel=1e-7)
    theirs = _diffusers_deltas(flux_dir, path)
    if alphas:
        # diffusers passes per-module alphas to PEFT as ``alpha_pattern`` keys, which PEFT
        # matches as name suffixes: the top-level ``proj_out`` alpha also lands on every single
        # block's ``proj_out``. We keep each module's own alpha (as the file says).
        for i in range(config.num_single_layers):
            name = f"single_transformer_blocks.{i}.proj_out"
            theirs[name] *= layers[name].alpha / layers["proj_out"].alpha
    assert _max_diff(_ours(converted), theirs) <= ATOL


@pytest.mark.parametrize(
    "prefix, suffixes",
    [
        ("diffusion_model.", None),
        ("", None),
        ("transformer.", (".lora.down.weight", ".lora.up.weight")),
        ("transformer.", (".lora_down.weight", ".lora_up.weight")),
        ("transformer.", (".lora_linear_layer.down.weight", ".lora_linear_layer.up.weight")),
    ],
)
def test_diffusers_names_other_layouts(config, diffusers_shapes, tmp_path, prefix, suffixes):
    """Other prefixes / older suffixes for diffusers module names convert like the layout
    diffusers loads (checked against it above)."""
    layers = lf.random_layers(diffusers_shapes, seed=2)
    sd = lf.lora_keys(layers, "diffusers", prefix=prefix, suffixes=suffixes)
    reference = flux.to_diffusers(lf.lora_keys(layers, "diffusers"), config, "reference")
    converted = _convert(lf.save_lora(tmp_path / "lora.safetensors", sd), config)
    assert converted.unmatched == ()
    _same_layers(converted, reference)


def _bfl_layers(config, seed: int, sparse: bool = True) -> dict[str, lf.RandomLayer]:
    """Random LoRA on every BFL Linear; block 0's txt qkv block-sparse (sd-scripts split_qkv)."""
    layers = lf.random_layers(lf.bfl_shapes(config), seed=seed)
    if sparse:
        d = config.hidden_dim
        txt = lf.random_layer(3 * d, d, 6, alpha=5.0, seed=seed + 100)
        layers["double_blocks.0.txt_attn.qkv"] = lf.block_sparse(txt, [d, d, d])
    return layers


# diffusers module -> BFL module of the layers diffusers' load_lora_weights drops
_DROPPED_BY_DIFFUSERS = {
    "x_embedder": "img_in",
    "context_embedder": "txt_in",
    "time_text_embed.timestep_embedder.linear_1": "time_in.in_layer",
    "time_text_embed.timestep_embedder.linear_2": "time_in.out_layer",
    "time_text_embed.text_embedder.linear_1": "vector_in.in_layer",
    "time_text_embed.text_embedder.linear_2": "vector_in.out_layer",
    "time_text_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
    "time_text_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
    "proj_out": "final_layer.linear",
    "norm_out.linear": "final_layer.adaLN_modulation.1",
}


@pytest.mark.parametrize("layout", ["kohya", "comfyui"])
def test_bfl_names_vs_diffusers(flux_dir, config, tmp_path, layout):
    """kohya (``lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight``) and ComfyUI
    (``diffusion_model.double_blocks.0.img_attn.qkv.lora_down.weight``) with alphas."""
    from diffusers.loaders.lora_conversion_utils import _convert_kohya_flux_lora_to_diffusers

    layers = _bfl_layers(config, seed=3)
    converted = flux.to_diffusers(lf.lora_keys(layers, layout), config, layout)
    assert converted.format == layout and converted.unmatched == ()
    ours = _ours(converted)

    # through the pipeline: everything but linear1 (hard-coded split) ...
    no_linear1 = {k: v for k, v in layers.items() if not k.endswith(".linear1")}
    path = lf.save_lora(tmp_path / "lora.safetensors", lf.lora_keys(no_linear1, layout))
    theirs = _diffusers_deltas(flux_dir, path)
    # ... of which diffusers drops the embedders and the final layer
    assert not set(theirs) & set(_DROPPED_BY_DIFFUSERS)
    assert _max_diff({k: ours[k] for k in theirs}, theirs) <= ATOL

    # the dropped layers: diffusers' conversion (unprefixed names, final layer without alpha)
    dropped = {k: v for k, v in layers.items() if k in _DROPPED_BY_DIFFUSERS.values()}
    state = {k: torch.from_numpy(v) for k, v in lf.lora_keys(dropped, "kohya").items()}
    state = _convert_kohya_flux_lora_to_diffusers(state)
    assert not any(k.startswith("transformer.") for k in state)
    for module, bfl in _DROPPED_BY_DIFFUSERS.items():
        a, b = state[f"{module}.lora_A.weight"], state[f"{module}.lora_B.weight"]
        delta = LORA_SCALE * (b.double() @ a.double()).numpy()
        if bfl.startswith("final_layer"):
            delta *= layers[bfl].scale  # the alpha diffusers' converter drops
        assert np.max(np.abs(ours[module] - delta)) <= ATOL, module

    # the remaining keys (linear1) are covered at real size in test_linear1_real_flux_sizes
    assert set(ours) == set(theirs) | set(_DROPPED_BY_DIFFUSERS) | {
        f"single_transformer_blocks.{i}.{m}"
        for i in range(config.num_single_layers)
        for m in ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")
    }
    # the sparse qkv was cut into rank blocks (same delta, a third of the rank each)
    assert converted.layers["transformer_blocks.0.attn.add_q_proj"].rank == 2


@pytest.mark.parametrize("layout", ["kohya", "comfyui"])
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "split_qkv"])
def test_linear1_real_flux_sizes(layout, sparse):
    """Single-block ``linear1`` at Flux.1 sizes (D = 3072, mlp 12288) vs diffusers' kohya
    converter (its hard-coded split fits only these sizes), rank 2 (dense) / 4 (block-sparse);
    deltas compared as ``delta @ x`` on 8 random probes (the deltas are 21504 x 3072)."""
    from diffusers.loaders.lora_conversion_utils import _convert_kohya_flux_lora_to_diffusers

    config = FluxTransformerConfig(num_layers=1, num_single_layers=1)
    d = config.hidden_dim
    rows = [d, d, d, config.mlp_dim]
    rank = 4 if sparse else 2
    layer = lf.random_layer(sum(rows), d, rank, alpha=3.0, seed=4)
    if sparse:
        layer = lf.block_sparse(layer, rows)
    sd = lf.lora_keys({"single_blocks.0.linear1": layer}, layout)
    converted = flux.to_diffusers(sd, config, layout)
    assert converted.unmatched == ()

    kohya = lf.lora_keys({"single_blocks.0.linear1": layer}, "kohya")
    theirs = _convert_kohya_flux_lora_to_diffusers(
        {k: torch.from_numpy(v) for k, v in kohya.items()}
    )
    probes = np.random.default_rng(0).standard_normal((d, 8))
    names = [f"single_transformer_blocks.0.{m}" for m in ("attn.to_q", "attn.to_k", "attn.to_v")]
    names.append("single_transformer_blocks.0.proj_mlp")
    assert list(converted.layers) == names
    for name in names:
        ours = converted.layers[name]
        a = theirs[f"transformer.{name}.lora_A.weight"].double().numpy()
        b = theirs[f"transformer.{name}.lora_B.weight"].double().numpy()
        expected = b @ (a @ probes)
        got = ours.scale * (ours.up.astype(np.float64) @ (ours.down.astype(np.float64) @ probes))
        assert np.max(np.abs(got - expected)) <= ATOL * max(1.0, np.max(np.abs(expected))), name
        assert ours.rank == (1 if sparse else 2)


def test_comfyui_peft_names_like_kohya(config):
    """ComfyUI / PEFT saves of the BFL model (``diffusion_model.`` or ``base_model.model.`` +
    BFL names, ``lora_A``/``lora_B``): diffusers' Flux loader does not read them."""
    layers = _bfl_layers(config, seed=6)
    reference = flux.to_diffusers(lf.lora_keys(layers, "kohya"), config, "kohya")
    for prefix in ("diffusion_model.", "base_model.model."):
        sd = lf.lora_keys(layers, "comfyui-peft", prefix=prefix)
        converted = flux.to_diffusers(sd, config, "peft")
        assert converted.unmatched == ()
        _same_layers(converted, reference)


# modules diffusers' mixture converter names correctly (attention, embedders, output)
def _mixture_supported(name: str) -> bool:
    return ".attn." in name or not name.startswith(("transformer_blocks", "single_transformer"))


# PEFT targets every "proj_out" for the top-level one and warns that the single blocks' got no
# weights from the file (their LoRA stays zero, which the test checks)
@pytest.mark.filterwarnings("ignore:While injecting the PEFT adapters:RuntimeWarning")
def test_kohya_mixture_vs_diffusers(flux_dir, config, diffusers_shapes, tmp_path):
    """``lora_transformer_<diffusers name with _>.lora_down/up`` + alpha on every Linear."""
    layers = lf.random_layers(diffusers_shapes, seed=7)
    converted = flux.to_diffusers(lf.lora_keys(layers, "kohya-mixture"), config, "mixture")
    assert converted.format == "kohya-mixture" and converted.unmatched == ()
    _same_layers(converted, flux.to_diffusers(lf.lora_keys(layers, "diffusers"), config, "d"))

    supported = {k: v for k, v in layers.items() if _mixture_supported(k)}
    assert len(supported) < len(layers)
    path = lf.save_lora(tmp_path / "lora.safetensors", lf.lora_keys(supported, "kohya-mixture"))
    theirs = _diffusers_deltas(flux_dir, path)
    assert set(theirs) == set(supported)
    assert _max_diff({k: v for k, v in _ours(converted).items() if k in theirs}, theirs) <= ATOL


@pytest.mark.parametrize("prefix", ["", "diffusion_model."])
def test_xlabs_vs_diffusers(flux_dir, config, tmp_path, prefix):
    """XLabs processor LoRAs (``double_blocks.0.processor.qkv_lora1.down.weight``, single
    blocks' ``qkv_lora`` / ``proj_lora``), no alpha."""
    layers = lf.random_layers(lf.xlabs_shapes(config), seed=8, alphas=False)
    path = lf.save_lora(tmp_path / "lora.safetensors", lf.lora_keys(layers, "xlabs", prefix=prefix))
    converted = _convert(path, config)
    assert converted.format == "xlabs" and converted.unmatched == ()
    n_single = sum(k.startswith("single_transformer_blocks.") for k in converted.layers)
    assert n_single == 4 * config.num_single_layers  # q, k, v and proj_out of every block
    assert _max_diff(_ours(converted), _diffusers_deltas(flux_dir, path)) <= ATOL


# ----------------------------------------------------------------------------------------------
# What is not placed, and what is refused
# ----------------------------------------------------------------------------------------------


def test_unmatched_keys_are_listed(config):
    d = config.hidden_dim
    rng = np.random.default_rng(9)

    def pair(stem: str, out: int, inp: int, down=".lora_down.weight", up=".lora_up.weight"):
        return {
            stem + down: rng.standard_normal((2, inp)),
            stem + up: rng.standard_normal((out, 2)),
        }

    good = pair("lora_unet_double_blocks_0_img_attn_proj", d, d)
    foreign = {
        **pair("lora_te1_text_model_encoder_layers_0_self_attn_q_proj", 24, 24),
        **pair(
            "text_encoder.text_model.encoder.layers.0.mlp.fc1",
            48,
            24,
            ".lora_A.weight",
            ".lora_B.weight",
        ),
        **pair("text_encoders.clip_l.transformer.text_model.encoder.layers.0.mlp.fc1", 48, 24),
        **pair(f"lora_unet_double_blocks_{config.num_layers}_img_attn_qkv", 3 * d, d),
        **pair("transformer.no_such_module", d, d, ".lora_A.weight", ".lora_B.weight"),
        "lora_te1_text_model_encoder_layers_0_self_attn_q_proj.alpha": np.float32(2.0),
        "lora_unet_double_blocks_0_img_attn_proj.diff_b": rng.standard_normal(d),
        "diffusion_model.double_blocks.0.img_attn.norm.query_norm.diff": rng.standard_normal(16),
        "lora_unet_double_blocks_0_img_mlp_0.alpha": np.float32(4.0),  # no weights with it
    }
    converted = flux.to_diffusers({**good, **foreign}, config, "mixed.safetensors")
    assert list(converted.layers) == ["transformer_blocks.0.attn.to_out.0"]
    assert converted.unmatched == tuple(sorted(foreign))
    assert converted.format == "kohya"


def test_schnell_has_no_guidance_layers(config):
    """A dev LoRA's guidance embedder on a model without one is unmatched, not an error."""
    no_guidance = FluxTransformerConfig(**{**config.to_dict(), "guidance_embeds": False})
    layers = lf.random_layers({"guidance_in.in_layer": (config.hidden_dim, 256)}, seed=10)
    sd = lf.lora_keys(layers, "kohya")
    assert flux.to_diffusers(sd, no_guidance, "x").unmatched == tuple(sorted(sd))
    assert list(flux.to_diffusers(sd, config, "x").layers) == [
        "time_text_embed.guidance_embedder.linear_1"
    ]


def _bad(config, name: str, out: int, inp: int, rank_up: int = 2, layout: str = "kohya"):
    """A rank-2 LoRA of ``name`` whose up has ``rank_up`` columns."""
    layer = lf.random_layer(out, inp, 2, alpha=1.0, seed=11)
    up = np.random.default_rng(12).standard_normal((out, rank_up)).astype(np.float32)
    return lf.lora_keys({name: lf.RandomLayer(layer.down, up, layer.alpha)}, layout)


def test_wrong_sizes_name_the_key(config):
    """A real Flux.1 LoRA on the tiny model: linear1's rows do not split at the config's
    sizes; a qkv reads another width."""
    sd = _bad(config, "single_blocks.0.linear1", 3 * 3072 + 12288, config.hidden_dim)
    match = r"other\.safetensors: lora_unet_single_blocks_0_linear1\.lora_up\.weight: .*21504 rows"
    with pytest.raises(base.LoraError, match=match + r".*\[32, 32, 32, 128\]"):
        flux.to_diffusers(sd, config, "other.safetensors")
    sd = _bad(config, "double_blocks.0.img_attn.qkv", 3 * 32, 3072, layout="comfyui")
    match = r"x: diffusion_model\.double_blocks\.0\.img_attn\.qkv\.lora_down\.weight: .*reads 3072"
    with pytest.raises(base.LoraError, match=match):
        flux.to_diffusers(sd, config, "x")


@pytest.mark.parametrize(
    "make, match",
    [
        (
            lambda c: {
                k: v for k, v in _bad(c, "final_layer.linear", 16, 32).items() if "up" not in k
            },
            r"w: lora_unet_final_layer_linear\.lora_down\.weight has no LoRA up",
        ),
        (
            lambda c: _bad(c, "final_layer.linear", 16, 32, rank_up=3),
            r"w: lora_unet_final_layer_linear\.lora_up\.weight: up \(16, 3\) has rank 3 but",
        ),
        (
            lambda c: _bad(c, "final_layer.linear", 15, 32),
            r"w: lora_unet_final_layer_linear\.lora_up\.weight: .*15 rows .*needs 16 rows",
        ),
        (
            lambda c: {
                **_bad(c, "final_layer.linear", 16, 32),
                **_bad(c, "proj_out", 16, 32, layout="diffusers"),
            },
            r"w: .*proj_out.* are both LoRAs of proj_out",
        ),
        (
            lambda c: {
                **_bad(c, "img_in", 32, 16),
                "lora_unet_img_in.lora_A.weight": np.ones((2, 16), np.float32),
            },
            r"w: lora_unet_img_in\.lora_A\.weight and lora_unet_img_in\.lora_down\.weight are both the LoRA down",
        ),
    ],
    ids=["no_up", "rank", "rows", "two_sources", "two_downs"],
)
def test_malformed_layers_name_the_key(config, make, match):
    with pytest.raises(base.LoraError, match=match):
        flux.to_diffusers(make(config), config, "w")


def test_pickle_lora_file_is_refused(tmp_path):
    path = tmp_path / "pytorch_lora_weights.bin"
    path.write_bytes(b"not read")
    with pytest.raises(base.LoraError, match=r"pytorch_lora_weights\.bin: a pickle"):
        base.read_lora_file(path)
