"""LTX-2 LoRA files (:mod:`jaxcore.lora.ltx2`) and LoRA training export on the LTX-2
transformer vs diffusers + PEFT.

Reference: a tiny perturbed ``LTX2VideoTransformer3DModel`` (TINY of
tests/jaxcore/test_ltx2_transformer.py with gated attention and LTX-2.3's prompt modulation
switched on, so every kind of Linear exists: caption projections, prompt ``adaln``s, gate
logits) with the file loaded as ``LTX2Pipeline.load_lora_weights`` loads it (on a pipeline-like
object holding the transformer: ``LTX2LoraLoaderMixin.lora_state_dict`` -> its converter ->
``transformer.load_lora_adapter``), run unfused (PEFT's LoRA layers, scale 1) and fused
(``fuse_lora(lora_scale=0.8)``). Ours: the file through ``merge.load_lora`` (the hooks proposed
for the family + the PEFT header) and ``LoraMerger`` over the transformer's weight map, then our
jitted transformer. Files are random (ranks 1-7, nonzero ``up``) on every Linear of the model:
video, audio and cross-modal attentions, both feed-forwards, embedders and modulations. A LoRA
must move both outputs by > MIN_EFFECT (measured: 26% to 91%), and ours must match diffusers'
video and audio outputs within REL_TOL = 1e-5 of their max magnitude (measured: 1.2e-6 to
3.5e-6; the base model without a LoRA 1.5e-6).

What diffusers does not load is proven against what it does: ``.alpha`` keys and
``lora_down`` / ``lora_up`` pairs (its loader refuses or drops them) must convert to the same
deltas as the ``lora_A`` / ``lora_B`` file with ``alpha / rank`` folded into B.
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest
from flax.core import meta

from jaxcore.families.ltx2 import LTX2Family
from jaxcore.lora import base, ltx2, merge, training
from jaxcore.models import ltx2_transformer as l2
from tests.support import lora_files as lf

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

REL_TOL = 1e-5
LORA_SCALE = 0.8  # fused runs: diffusers' fuse_lora(lora_scale) vs our merge scale
MIN_EFFECT = 0.02  # a LoRA must move each output by at least this (relative): no trivial pass

# the smallest config of tests/jaxcore/test_ltx2_transformer.py (video D = 2 x 8, audio
# Da = 3 x 4), copied
TINY = dict(
    in_channels=8,
    out_channels=6,
    num_attention_heads=2,
    attention_head_dim=8,
    cross_attention_dim=16,
    audio_in_channels=6,
    audio_out_channels=5,
    audio_num_attention_heads=3,
    audio_attention_head_dim=4,
    audio_cross_attention_dim=12,
    num_layers=2,
    caption_channels=20,
)
# every Linear kind: gate logits on all six attentions, prompt modulation from sigma
CONFIG = dict(
    TINY, gated_attn=True, audio_gated_attn=True, cross_attn_mod=True, audio_cross_attn_mod=True
)
# LTX-2.3-like (captions at the model widths: no caption projection) and a one-sided mixture
LTX23 = dict(CONFIG, use_prompt_embeddings=False, rope_type="split", ff_bias=False)
MIXED = dict(TINY, cross_attn_mod=True, audio_gated_attn=True, use_prompt_adaln_single=False)

BATCH, GRID, AUDIO_FRAMES, FPS = 2, (2, 3, 4), 5, 24.0
TEXT_LEN = 6


FAMILY = LTX2Family()  # the hooks merge.load_lora and the LoraMerger call


# ----------------------------------------------------------------------------------------------
# Fixtures and helpers
# ----------------------------------------------------------------------------------------------


def _inputs() -> dict[str, np.ndarray]:
    """The forward's inputs (as LTX2Pipeline passes them): batch 2, a 2 x 3 x 4 latent grid,
    5 audio frames, a padded caption."""
    rng = np.random.default_rng(1)
    mask = np.ones((BATCH, TEXT_LEN), np.float32)
    mask[1, 3:] = 0.0
    t = np.array([900.0, 300.0], np.float32)
    text = (BATCH, TEXT_LEN, CONFIG["caption_channels"])
    video = (BATCH, int(np.prod(GRID)), CONFIG["in_channels"])
    audio = (BATCH, AUDIO_FRAMES, CONFIG["audio_in_channels"])
    return dict(
        hidden_states=rng.standard_normal(video, np.float32),
        audio_hidden_states=rng.standard_normal(audio, np.float32),
        encoder_hidden_states=rng.standard_normal(text, np.float32),
        audio_encoder_hidden_states=rng.standard_normal(text, np.float32),
        timestep=t,
        sigma=t,  # as LTX2Pipeline passes it
        encoder_attention_mask=mask,
        audio_encoder_attention_mask=mask,
        video_coords=l2.video_coords(BATCH, *GRID, FPS),
        audio_coords=l2.audio_coords(BATCH, AUDIO_FRAMES),
    )


def _torch_forward(model) -> tuple[np.ndarray, np.ndarray]:
    kwargs = {k: torch.from_numpy(v) for k, v in _inputs().items()}
    with torch.no_grad():
        video, audio = model(**kwargs, return_dict=False)
    return video.numpy(), audio.numpy()


def _relative_error(got, expected) -> float:
    """max |got - expected| / max |expected| over both outputs (the worse of the two)."""
    return max(
        float(np.abs(g - e).max() / np.abs(e).max()) for g, e in zip(got, expected, strict=True)
    )


def _change(a, b) -> float:
    """How much the smaller-moved of the two outputs moved."""
    return min(float(np.abs(x - y).max() / np.abs(y).max()) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory) -> Path:
    """A random diffusers model with every parameter perturbed, saved with save_pretrained."""
    from diffusers import LTX2VideoTransformer3DModel

    torch.manual_seed(5)
    model = LTX2VideoTransformer3DModel(**CONFIG).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    directory = tmp_path_factory.mktemp("ltx2_lora")
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def ours(reference_dir):
    """(config, base params, jitted forward(params) -> (video, audio) on the shared inputs)."""
    module, params = l2.load_ltx2_transformer(reference_dir)
    inputs = _inputs()
    forward = jax.jit(lambda p: module.apply({"params": p}, **inputs))
    return module.config, meta.unbox(params), forward


@pytest.fixture(scope="module")
def base_output(reference_dir):
    from diffusers import LTX2VideoTransformer3DModel

    return _torch_forward(LTX2VideoTransformer3DModel.from_pretrained(reference_dir).eval())


def _pipeline_like(reference_dir: Path):
    """A fresh diffusers transformer inside the smallest object ``LTX2LoraLoaderMixin``'s
    ``load_lora_weights`` / ``fuse_lora`` run on (a pipeline's transformer and components)."""
    from diffusers import LTX2VideoTransformer3DModel
    from diffusers.loaders.lora_pipeline import LTX2LoraLoaderMixin

    class PipelineLike(LTX2LoraLoaderMixin):
        hf_device_map = None

        def __init__(self, transformer):
            self.transformer = transformer
            self.components = {"transformer": transformer}

    return PipelineLike(LTX2VideoTransformer3DModel.from_pretrained(reference_dir).eval())


def _diffusers_output(reference_dir: Path, lora: Path, *, fuse: bool):
    """diffusers' (video, audio) with ``lora`` loaded by ``load_lora_weights``; ``fuse``:
    merged into the weights at LORA_SCALE, else PEFT layers at scale 1."""
    pipe = _pipeline_like(reference_dir)
    pipe.load_lora_weights(str(lora.parent), weight_name=lora.name)
    if fuse:
        pipe.fuse_lora(components=["transformer"], lora_scale=LORA_SCALE)
    return _torch_forward(pipe.transformer)


def _our_output(ours, lora: Path, scale: float):
    config, params, forward = ours
    loaded = merge.load_lora(str(lora), FAMILY, config)
    merged = merge.LoraMerger(params, FAMILY.lora_weight_map(config)).merged([(loaded, scale)])
    return tuple(map(np.asarray, forward(merged))), loaded


def _check_vs_diffusers(reference_dir, ours, base_output, lora: Path) -> dict[str, float]:
    """Ours vs diffusers on ``lora``, unfused at scale 1 and fused at LORA_SCALE; returns the
    measured relative errors (and the LoRA's effect)."""
    measured = {}
    for fuse, scale in ((False, 1.0), (True, LORA_SCALE)):
        expected = _diffusers_output(reference_dir, lora, fuse=fuse)
        effect = _change(expected, base_output)
        assert effect > MIN_EFFECT, f"the LoRA barely moves the output ({effect:.2e})"
        got, loaded = _our_output(ours, lora, scale)
        assert loaded.converted.unmatched == ()
        measured["fused" if fuse else "unfused"] = _relative_error(got, expected)
        measured["effect_fused" if fuse else "effect"] = effect
    assert max(measured["fused"], measured["unfused"]) <= REL_TOL, measured
    return measured


def _convert(state: dict, config) -> base.Converted:
    return ltx2.to_diffusers(state, config, "test.safetensors")


def _deltas(converted: base.Converted) -> dict[str, np.ndarray]:
    return {name: layer.delta() for name, layer in converted.layers.items()}


def _torch_linears(model) -> dict[str, tuple[int, int]]:
    return {
        name: tuple(m.weight.shape)
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear)
    }


def _original(layers: dict) -> dict:
    """``layers`` under their original LTX-2 names."""
    return {lf.ltx2_original_name(name): layer for name, layer in layers.items()}


# ----------------------------------------------------------------------------------------------
# The model's Linear layers
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs", [CONFIG, TINY, LTX23, MIXED, {}], ids=["all-kinds", "tiny", "ltx23", "mixed", "19b"]
)
def test_linear_shapes_are_diffusers_linears(kwargs):
    """Our LoRA vocabulary is exactly diffusers' Linear layers, shapes included (the 19B
    default config too, built on the meta device)."""
    from diffusers import LTX2VideoTransformer3DModel

    with torch.device("meta"):
        model = LTX2VideoTransformer3DModel(**kwargs)
    assert ltx2.linear_shapes(l2.LTX2VideoTransformerConfig(**kwargs)) == _torch_linears(model)


def test_base_model_matches_diffusers(ours, base_output):
    """The model every LoRA test starts from: ours = diffusers' without a LoRA (this compiles
    the forward the other tests reuse)."""
    _, params, forward = ours
    error = _relative_error(tuple(map(np.asarray, forward(params))), base_output)
    assert error <= REL_TOL
    print("base model: rel", error)


def test_lora_weight_map_reaches_every_linear(ours):
    """Every LoRA target has a weight-map entry whose torch shape is the Linear's."""
    config, params, _ = ours
    index = {key: (path, t) for path, (key, t) in FAMILY.lora_weight_map(config).items()}
    for module, shape in ltx2.linear_shapes(config).items():
        path, transform = index[f"{module}.weight"]
        assert merge._torch_shape(transform, merge._get(params, path).shape) == shape, module


# ----------------------------------------------------------------------------------------------
# Formats vs diffusers' loader
# ----------------------------------------------------------------------------------------------


def test_diffusers_format_vs_diffusers(reference_dir, ours, base_output, tmp_path):
    """``transformer.<module>.lora_A/B`` on every Linear, distinct ranks, no header."""
    config = ours[0]
    layers = lf.random_layers(ltx2.linear_shapes(config), seed=1, alphas=False)
    path = lf.save_lora(tmp_path / "lora.safetensors", lf.lora_keys(layers, "diffusers"))
    measured = _check_vs_diffusers(reference_dir, ours, base_output, path)
    assert _convert(base.read_lora_file(path), config).format == "diffusers"
    print("diffusers format:", measured)


def test_diffusers_saved_with_peft_header_vs_diffusers(reference_dir, ours, base_output, tmp_path):
    """A file written by ``LTX2Pipeline.save_lora_weights`` with its PEFT config
    (``lora_alpha`` != r, an ``alpha_pattern`` and a ``rank_pattern``): diffusers scales by it,
    and so do we."""
    from diffusers.loaders.lora_pipeline import LTX2LoraLoaderMixin

    config = ours[0]
    shapes = ltx2.linear_shapes(config)
    layers = {
        name: lf.random_layer(*shape, 3, None, seed=i)
        for i, (name, shape) in enumerate(shapes.items())
    }
    wide = "audio_proj_in"
    layers[wide] = lf.random_layer(*shapes[wide], 5, None, seed=99)
    tensors = {
        k.removeprefix("transformer."): torch.from_numpy(v)
        for k, v in lf.lora_keys(layers, "diffusers").items()
    }
    header = {
        "r": 3,
        "lora_alpha": 4.5,
        "rank_pattern": {wide: 5},
        "alpha_pattern": {"video_to_audio_attn.to_k": 1.5},
        "target_modules": sorted(shapes),
    }
    LTX2LoraLoaderMixin.save_lora_weights(
        tmp_path, transformer_lora_layers=tensors, transformer_lora_adapter_metadata=header
    )
    path = tmp_path / base.LORA_FILE_NAME
    measured = _check_vs_diffusers(reference_dir, ours, base_output, path)
    _, loaded = _our_output(ours, path, 1.0)
    layers_ = loaded.converted.layers
    assert layers_["transformer_blocks.1.video_to_audio_attn.to_k"].scale == pytest.approx(0.5)
    assert layers_[wide].scale == pytest.approx(4.5 / 5)
    assert layers_["transformer_blocks.1.audio_attn1.to_q"].scale == pytest.approx(1.5)
    print("diffusers format + PEFT header:", measured)


@pytest.mark.parametrize("names", ["original", "diffusers"])
def test_diffusion_model_prefix_vs_diffusers(reference_dir, ours, base_output, tmp_path, names):
    """LTX-2 trainer / ComfyUI files: ``diffusion_model.`` + ``lora_A/B`` on every Linear, with
    the original LTX-2 names (``patchify_proj``, ``adaln_single``, ``av_ca_*_adaln_single``,
    ``prompt_adaln_single``, ...) or the diffusers names, which diffusers accepts there too."""
    config = ours[0]
    layers = lf.random_layers(ltx2.linear_shapes(config), seed=2, alphas=False)
    if names == "original":
        layers = _original(layers)
        assert "patchify_proj" in layers and "av_ca_v2a_gate_adaln_single.linear" in layers
    path = lf.save_lora(tmp_path / "lora.safetensors", lf.lora_keys(layers, "comfyui-peft"))
    measured = _check_vs_diffusers(reference_dir, ours, base_output, path)
    converted = _convert(base.read_lora_file(path), config)
    assert converted.format == "comfyui"
    assert sorted(converted.layers) == sorted(ltx2.linear_shapes(config))
    print(f"diffusion_model. + {names} names:", measured)


def test_diffusers_converter_output_equals_ours(ours):
    """Key by key, our conversion of an original-names file equals diffusers'
    ``_convert_non_diffusers_ltx2_lora_to_diffusers`` (every Linear, exactly)."""
    from diffusers.loaders.lora_conversion_utils import (
        _convert_non_diffusers_ltx2_lora_to_diffusers,
    )

    config = ours[0]
    layers = _original(lf.random_layers(ltx2.linear_shapes(config), seed=3, alphas=False))
    state = lf.lora_keys(layers, "comfyui-peft")
    theirs = _convert_non_diffusers_ltx2_lora_to_diffusers(
        {k: torch.from_numpy(v) for k, v in state.items()}
    )
    converted = _convert(state, config)
    expected = {k.removeprefix("transformer.") for k in theirs}
    assert {f"{m}.lora_{p}.weight" for m in converted.layers for p in "AB"} == expected
    for name, layer in converted.layers.items():
        np.testing.assert_array_equal(
            layer.down, theirs[f"transformer.{name}.lora_A.weight"].numpy()
        )
        np.testing.assert_array_equal(layer.up, theirs[f"transformer.{name}.lora_B.weight"].numpy())
        assert layer.scale == 1.0


def _named(layers: dict, layout: str) -> dict:
    """``layers`` under the names ``layout`` writes: original ones under ``diffusion_model.``."""
    return layers if layout == "diffusers" else _original(layers)


@pytest.mark.parametrize("layout", ["comfyui", "comfyui-peft", "diffusers"])
def test_alphas_and_lora_down_up_equal_folded_lora_a_b(ours, layout):
    """``.alpha`` keys (and ``lora_down`` / ``lora_up`` pairs) that diffusers' LTX-2 loader
    refuses: the same deltas as the ``lora_A`` / ``lora_B`` file (proven against diffusers
    above) with ``alpha / rank`` folded into B; a file mixing both prefixes reads per key."""
    config = ours[0]
    layers = lf.random_layers(ltx2.linear_shapes(config), seed=4, alphas=True)
    folded = {name: lf.folded_alpha(layer) for name, layer in layers.items()}
    converted = _convert(lf.lora_keys(_named(layers, layout), layout), config)
    reference = _convert(lf.lora_keys(_named(folded, "comfyui-peft"), "comfyui-peft"), config)
    assert converted.unmatched == () and sorted(converted.layers) == sorted(layers)
    assert all(converted.layers[k].scale == pytest.approx(v.scale) for k, v in layers.items())
    ours_, theirs = _deltas(converted), _deltas(reference)
    worst = max(float(np.abs(ours_[k] - theirs[k]).max()) for k in ours_)
    assert worst <= 1e-6, worst
    names = list(layers)
    half = {k: layers[k] for k in names[::2]}
    rest = {k: layers[k] for k in names[1::2]}
    other = "comfyui" if layout == "diffusers" else "diffusers"
    state = {
        **lf.lora_keys(_named(half, layout), layout),
        **lf.lora_keys(_named(rest, other), other),
    }
    mixed = _convert(state, config)
    assert mixed.format == "comfyui+diffusers" and mixed.unmatched == ()
    worst_mixed = max(float(np.abs(mixed.layers[k].delta() - ours_[k]).max()) for k in ours_)
    assert worst_mixed == 0.0
    print(f"{layout} + alphas vs folded lora_A/B: max abs", worst)


def test_factors_saved_as_1x1_convolutions_read_as_matrices(ours):
    """``[r, in, 1, 1]`` / ``[out, r, 1, 1]`` factors are the same layer as their matrices."""
    config = ours[0]
    state = _one_layer(alpha=5.0)
    as_conv = {k: v.reshape(*v.shape, 1, 1) if v.ndim == 2 else v for k, v in state.items()}
    conv, plain = _convert(as_conv, config), _convert(state, config)
    np.testing.assert_array_equal(conv.layers[Q].delta(), plain.layers[Q].delta())
    assert conv.layers[Q].scale == plain.layers[Q].scale == 2.5


# ----------------------------------------------------------------------------------------------
# Malformed files and unknown keys
# ----------------------------------------------------------------------------------------------

Q = "transformer_blocks.0.audio_to_video_attn.to_q"  # [Da, D] = [12, 16]


def _one_layer(**kw) -> dict[str, np.ndarray]:
    layer = lf.random_layer(12, 16, 2, alpha=kw.pop("alpha", None), seed=0)
    return lf.lora_keys({Q: layer}, "diffusers", **kw)


def test_malformed_files_name_the_key(ours):
    config = ours[0]
    key = f"transformer.{Q}"
    state = _one_layer()
    with pytest.raises(base.LoraError, match=rf"{key}.lora_A.weight has no LoRA up for {key}$"):
        _convert({k: v for k, v in state.items() if "lora_B" not in k}, config)
    bad_rank = {**state, f"{key}.lora_B.weight": np.ones((12, 3), np.float32)}
    with pytest.raises(base.LoraError, match=rf"{key}.lora_A.weight.*rank 2.*{key}.lora_B"):
        _convert(bad_rank, config)
    narrow = {**state, f"{key}.lora_A.weight": np.ones((2, 12), np.float32)}
    with pytest.raises(base.LoraError, match=rf"{key}.lora_A.weight: down .*reads 12 .*reads 16"):
        _convert(narrow, config)
    tall = {**state, f"{key}.lora_B.weight": np.ones((16, 2), np.float32)}
    with pytest.raises(base.LoraError, match=rf"{key}.lora_B.weight: up .*16 rows.*has 12"):
        _convert(tall, config)
    alpha = {**state, f"{key}.alpha": np.ones(2, np.float32)}
    with pytest.raises(base.LoraError, match=rf"{key}.alpha has 2 values"):
        _convert(alpha, config)
    cube = {**state, f"{key}.lora_A.weight": np.ones((2, 16, 3), np.float32)}
    with pytest.raises(base.LoraError, match=rf"{key}.lora_A.weight has shape \[2, 16, 3\]"):
        _convert(cube, config)
    twice = {**state, f"{key}.lora_down.weight": state[f"{key}.lora_A.weight"]}
    with pytest.raises(base.LoraError, match=rf"{key}.lora_down.weight and .*lora_A.weight are"):
        _convert(twice, config)
    both = {**state, **{k.replace("transformer.", "diffusion_model."): v for k, v in state.items()}}
    with pytest.raises(base.LoraError, match=rf"transformer.{Q} are both LoRAs of {Q}"):
        _convert(both, config)


@pytest.mark.parametrize(
    "key",
    [
        "transformer.transformer_blocks.2.attn1.to_q.lora_A.weight",  # no such block
        "transformer.patchify_proj.lora_A.weight",  # an original name under transformer.
        "diffusion_model.transformer_blocks.0.attn1.q_norm.lora_A.weight",  # a norm
        "text_embedding_projection.aggregate_embed.lora_A.weight",  # the text connectors'
        "connectors.text_proj_in.lora_A.weight",
        # the original checkpoint's text connector, a separate model in diffusers
        "diffusion_model.video_embeddings_connector.transformer_1d_blocks.0.attn1.to_q.lora_A.weight",
        "transformer_blocks.0.attn1.to_q.lora_A.weight",  # no prefix
        "transformer.proj_out.lora_B.bias",  # a bias delta
        "diffusion_model.proj_out.dora_scale",
        "diffusion_model.proj_out.lokr_w1",
        "diffusion_model.audio_ff.net.2.alpha",  # an alpha alone
    ],
)
def test_unknown_keys_are_refused_by_name(ours, tmp_path, key):
    """Keys no rule places are returned as unmatched, and the merger refuses them by name."""
    config, params, _ = ours
    state = {**_one_layer(), key: np.ones((2, 2), np.float32)}
    converted = _convert(state, config)
    assert converted.unmatched == (key,)
    assert list(converted.layers) == [Q]
    path = lf.save_lora(tmp_path / "lora.safetensors", state)
    loaded = merge.load_lora(str(path), FAMILY, config)
    with pytest.raises(base.LoraError, match=rf"1 key\(s\) match no layer: {key}"):
        merge.LoraMerger(params, FAMILY.lora_weight_map(config)).plan([(loaded, 1.0)])


# ----------------------------------------------------------------------------------------------
# Training export and the family
# ----------------------------------------------------------------------------------------------

# PEFT suffix matching stops at a dot: "ff.net.2" is not audio_ff's
FEED_FORWARDS = ("ff.net.0.proj", "ff.net.2", "audio_ff.net.0.proj", "audio_ff.net.2")
TRAIN_TARGETS = (*LTX2Family.lora_default_targets, *FEED_FORWARDS)


def test_training_export_loads_in_diffusers(reference_dir, ours, base_output, tmp_path):
    """Adapters on the default targets (q/k/v/out of all six attentions) and both
    feed-forwards, ``up`` set nonzero as after training, merged in the traced way the training
    step merges them: ``export_peft``'s file loaded by diffusers gives our adapted outputs, and
    our own loader reads it back."""
    config, params, forward = ours
    targets = training.find_targets(FAMILY.lora_weight_map(config), params, TRAIN_TARGETS)
    attentions = [
        "attn1",
        "attn2",
        "audio_attn1",
        "audio_attn2",
        "audio_to_video_attn",
        "video_to_audio_attn",
    ]
    expected = {
        f"transformer_blocks.{i}.{a}.{p}"
        for i in range(config.num_layers)
        for a in attentions
        for p in ("to_q", "to_k", "to_v", "to_out.0")
    }
    expected |= {
        f"transformer_blocks.{i}.{f}.{p}"
        for i in range(config.num_layers)
        for f in ("ff", "audio_ff")
        for p in ("net.0.proj", "net.2")
    }
    assert set(targets) == expected
    adapters = training.init_adapters(targets, 3, jax.random.key(0))
    rng = np.random.default_rng(6)
    adapters = jax.tree.map(
        lambda a: a + 0.3 * rng.standard_normal(a.shape).astype(np.float32), adapters
    )
    scale = 1.5
    adapted = tuple(
        map(np.asarray, forward(training.merge_traced(params, adapters, targets, scale)))
    )
    assert _change(adapted, base_output) > MIN_EFFECT
    tensors = training.export_peft(training.adapter_layers(adapters, targets, scale), "transformer")
    path = lf.save_lora(tmp_path / base.LORA_FILE_NAME, tensors)
    error = _relative_error(adapted, _diffusers_output(reference_dir, path, fuse=False))
    assert error <= REL_TOL
    again, _ = _our_output(ours, path, 1.0)
    assert _relative_error(again, adapted) <= REL_TOL
    print("training export: rel", error)


def test_the_family_hooks_are_this_loader():
    """The ltx2 family's LoRA hooks (what generate and train call) are the loader proven here."""
    from jaxcore.families.base import Family

    assert LTX2Family.lora_to_diffusers is not Family.lora_to_diffusers
    family = LTX2Family()
    config = l2.LTX2VideoTransformerConfig(**CONFIG)
    state = _one_layer(alpha=3.0)
    theirs, ours_ = family.lora_to_diffusers(state, config, "x"), _convert(state, config)
    assert (theirs.format, theirs.unmatched) == (ours_.format, ours_.unmatched)
    assert _deltas(theirs).keys() == _deltas(ours_).keys()
    for name, delta in _deltas(theirs).items():
        np.testing.assert_array_equal(delta, _deltas(ours_)[name])
    assert family.lora_weight_map(config).keys() == l2.weight_map(config).keys()
