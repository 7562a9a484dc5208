"""The LTX-2 transformer's analytic FLOP count (``ltx2_transformer.flops_per_forward`` /
``attention_flops_per_forward``, and the ``ltx2`` family's per-call count that ``difforge fit``
and the train loop's MFU use), proven three ways:

- against diffusers' own model: torch's ``FlopCounterMode`` over ``LTX2VideoTransformer3DModel``
  (attention on SDPA's math path, so QK^T / PV are counted as ``bmm``), the blocks' FLOPs as
  the count at 2 layers minus the count at 0 (the embeddings, captions and heads cancel):
  equal, integer for integer, and the ``bmm`` share equal to the attention count;
- against our JAX forward: every ``dot_general`` of its jaxpr, the same difference: equal;
- against XLA's cost analysis of the compiled forward at a size where products dominate
  (within 10%: XLA also counts the embeddings, the heads and the elementwise work);

and at the released 19B config: the count equals 2 x tokens x kernel size summed over the
real blocks' kernels (each kernel with the tokens that pass through it) plus the attention's
scores and values, and sits at a stated share of the rule of thumb 2 x params x tokens.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import numpy as np
import pytest
import torch
from flax import linen as nn

from jaxcore.families import ltx2 as ltx2_family
from jaxcore.model_configs import read_model_yaml
from jaxcore.models import ltx2_transformer as l2
from tests.jaxcore.test_ltx2_transformer import (
    AUDIO_FRAMES,
    AUDIO_TEXT_LEN,
    BATCH,
    CONFIGS,
    TEXT_LEN,
    VIDEO_TOKENS,
    _build_reference,
    _inputs,
)

LAYERS = 2  # the blocks' FLOPs: the count at LAYERS layers minus the count at none


def _config(name: str, num_layers: int = LAYERS) -> dict:
    return dict(CONFIGS[name], num_layers=num_layers)


def _analytic(name: str, cross_modal: bool = True) -> tuple[int, int]:
    """(all FLOPs, attention FLOPs) of the blocks at the shared test inputs' sizes."""
    config = l2.LTX2VideoTransformerConfig.from_dict(_config(name))
    sizes = (BATCH, VIDEO_TOKENS, AUDIO_FRAMES, TEXT_LEN, AUDIO_TEXT_LEN, cross_modal)
    return (
        l2.flops_per_forward(config, *sizes),
        l2.attention_flops_per_forward(config, *sizes),
    )


# --- against diffusers -------------------------------------------------------------------------


def _diffusers_counts(config: dict, case: str) -> tuple[int, int]:
    """(all FLOPs, bmm FLOPs) torch counts in one forward of diffusers' model; SDPA on its
    math path, whose QK^T and PV are bmm (the fused CPU kernel is not counted at all)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    model = _build_reference(config)
    arrays, static, _ = _inputs(config, case)
    kwargs = {k: None if v is None else torch.from_numpy(v) for k, v in arrays.items()}
    with FlopCounterMode(display=False) as counter, torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        model(**kwargs, **static, return_dict=False)
    by_op = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    return counter.get_total_flops(), by_op.get("aten.bmm", 0)


@pytest.mark.parametrize(
    ("name", "case"),
    [
        ("tiny", "plain"),
        ("ltx23", "plain"),  # gated attention, prompt modulation, captions at model width
        ("mixed", "plain"),  # one side gated, the other modulated
        ("tiny", "isolate-modalities"),  # no audio<->video attention
    ],
)
def test_block_flops_equal_diffusers_flop_counter(name, case):
    with_blocks = _diffusers_counts(_config(name), case)
    without = _diffusers_counts(_config(name, 0), case)
    flops, attention = _analytic(name, cross_modal=case != "isolate-modalities")
    assert with_blocks[0] - without[0] == flops
    assert with_blocks[1] - without[1] == attention
    assert 0 < attention < flops


# --- against our own forward -------------------------------------------------------------------


def _dot_flops(jaxpr) -> int:
    """2 x (lhs size) x (rhs free size) over every dot_general, sub-jaxprs included (a scan's
    body times its length)."""
    total = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            lhs, rhs = (v.aval.shape for v in eqn.invars)
            (_, rhs_contract), (_, rhs_batch) = eqn.params["dimension_numbers"]
            free = [n for i, n in enumerate(rhs) if i not in (*rhs_contract, *rhs_batch)]
            total += 2 * math.prod(lhs) * math.prod(free)
        repeats = eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    total += repeats * _dot_flops(inner)
    return total


def _jax_dot_flops(config: dict, case: str) -> int:
    module = l2.LTX2VideoTransformer(l2.LTX2VideoTransformerConfig.from_dict(config))
    params = nn.meta.unbox(l2.abstract_params(module))
    arrays, static, _ = _inputs(config, case)
    fn = functools.partial(module.apply, **static, **arrays)
    return _dot_flops(jax.make_jaxpr(lambda p: fn({"params": p}))(params).jaxpr)


@pytest.mark.usefixtures("xla_dots")  # the dense layers as dot_general, not MKL's GEMM call
@pytest.mark.parametrize("name", ["tiny", "ltx23"])
def test_block_flops_equal_the_jax_forwards_products(name):
    blocks = _jax_dot_flops(_config(name), "plain") - _jax_dot_flops(_config(name, 0), "plain")
    assert blocks == _analytic(name)[0]


@pytest.mark.usefixtures("xla_dots")  # XLA counts no custom call's FLOPs
def test_flops_formula_matches_xla_count():
    """The whole forward compiled (embeddings, captions and heads included): the blocks'
    count within 10% of XLA's (reached 4.5% below it: XLA also counts norms, GELU, softmax,
    RoPE, the modulations and the outside layers), at widths and lengths where products
    dominate."""
    config = l2.LTX2VideoTransformerConfig.from_dict(
        dict(
            CONFIGS["tiny"],
            num_attention_heads=4,
            attention_head_dim=32,
            cross_attention_dim=128,
            audio_num_attention_heads=4,
            audio_attention_head_dim=16,
            audio_cross_attention_dim=64,
            caption_channels=64,
            num_layers=2,
        )
    )
    module = l2.LTX2VideoTransformer(config)
    params = nn.meta.unbox(l2.abstract_params(module))
    video, audio, text = 256, 32, 64
    f32 = np.float32
    inputs = (
        jax.ShapeDtypeStruct((1, video, config.in_channels), f32),
        jax.ShapeDtypeStruct((1, audio, config.audio_in_channels), f32),
        jax.ShapeDtypeStruct((1, text, config.caption_channels), f32),
        jax.ShapeDtypeStruct((1, text, config.caption_channels), f32),
        jax.ShapeDtypeStruct((1,), f32),
    )

    def forward(p, v, a, t, at, timestep):
        return module.apply(
            {"params": p},
            v,
            a,
            t,
            at,
            timestep,
            sigma=timestep,
            num_frames=4,
            height=8,
            width=8,
            audio_num_frames=audio,
        )

    cost = jax.jit(forward).lower(params, *inputs).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    formula = l2.flops_per_forward(config, 1, video, audio, text)
    assert formula == pytest.approx(cost["flops"], rel=0.10)


# --- the released 19B config -------------------------------------------------------------------


@functools.cache
def _released():
    family, configs = read_model_yaml("configs/models/ltx2_19b.yml")
    return family, configs


def _tokens_through(path: str, video: int, audio: int, text: int) -> int:
    """The tokens that pass through a block kernel, from its module names: queries through
    to_q / to_out / the gates, keys through to_k / to_v, each stream's own FFN."""
    module, layer = path.split("/")[1:3]
    keys = layer in ("to_k", "to_v")
    by_module = {
        "attn1": (video, video),
        "audio_attn1": (audio, audio),
        "attn2": (video, text),
        "audio_attn2": (audio, text),
        "audio_to_video_attn": (video, audio),
        "video_to_audio_attn": (audio, video),
        "ff": (video, video),
        "audio_ff": (audio, audio),
    }
    return by_module[module][1 if keys else 0]


@pytest.mark.slow  # the 19B parameter tree's shapes: 18 s quiet, ~50 s under load (2 cores)
def test_released_19b_count_is_its_kernels_times_their_tokens():
    """At 768 x 512, 121 frames (6144 video tokens, 126 audio tokens, 1024 caption tokens):
    the count equals 2 x tokens x size over every kernel of the real blocks (the widths read
    from the 19B parameter tree, not from the formula) plus the scores and values; it is 84%
    of 2 x params x (video + audio tokens): the rule of thumb overcounts the caption keys and
    values (they see 1024 caption tokens, not 6270), the timestep, caption and in/out layers
    (they see one row or the captions) and the audio weights (126 tokens), and leaves out
    the attention (18% of the count)."""
    family, configs = _released()
    config = configs["transformer"]
    shape = family.latent_shape(configs, 512, 768, 121)
    specs = {s.name: s.shape for s in family.conditioning_specs(config, 1024, shape)}
    joint = ltx2_family._layout_of(config, (1, *shape))
    video, audio, text = joint.video_tokens, joint.audio_frames, 1024
    assert (video, audio) == (6144, 126)

    params = nn.meta.unbox(l2.abstract_params(l2.LTX2VideoTransformer(config)))
    kernels = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        name = "/".join(k.key for k in path)
        if name.startswith("transformer_blocks_") and name.endswith("/kernel"):
            kernels += 2 * _tokens_through(name, video, audio, text) * leaf.size
    attention = family.attention_flops_per_forward(config, 1, shape, specs)
    flops = family.flops_per_forward(config, 1, shape, specs)
    assert flops == kernels + attention
    assert attention / flops == pytest.approx(0.178, abs=0.005)
    rule_of_thumb = 2 * l2.count_params(config) * (video + audio)
    assert flops / rule_of_thumb == pytest.approx(0.839, abs=0.005)


def _render_shapes(family, configs, specs, settings: dict) -> dict:
    """The denoiser's conditioning shapes of a render of one prompt with ``settings``."""
    sized, _ = family.size_conditioning(configs, 512, 768, [settings])
    return {**specs, **{k: np.shape(v)[1:] for k, v in sized.items()}}


def test_family_counts_the_guidance_passes_and_tokens():
    """One denoiser call: one transformer pass; a render with modality guidance runs a
    second, isolated one (no cross-modal attention), one with STG a whole perturbed pass, on
    every row of the call; training conditioning (no CFG branch) runs neither."""
    family, configs = _released()
    config = configs["transformer"]
    shape = family.latent_shape(configs, 512, 768, 121)
    specs = {s.name: s.shape for s in family.conditioning_specs(config, 1024, shape)}
    render = _render_shapes(family, configs, specs, {})
    modality = _render_shapes(family, configs, specs, {"modality_scale": 3.0})
    sizes = (6144, 126, 1024, 1024)
    one = l2.flops_per_forward(config, 2, *sizes)
    isolated = l2.flops_per_forward(config, 2, *sizes, cross_modal=False)
    assert family.flops_per_forward(config, 2, shape, specs) == one
    assert family.flops_per_forward(config, 2, shape, render) == one
    assert family.flops_per_forward(config, 2, shape, modality) == one + isolated
    # the two cross-modal attentions are 10.4% of a pass at this size (their video-side
    # projections: q and out of audio->video, k and v of video->audio, 4 x 2 s D Da)
    assert isolated / one == pytest.approx(0.896, abs=0.005)
    attention = family.attention_flops_per_forward(config, 2, shape, modality)
    assert attention == l2.attention_flops_per_forward(
        config, 2, *sizes
    ) + l2.attention_flops_per_forward(config, 2, *sizes, cross_modal=False)
    assert family.tokens_per_example(config, shape) == 6144 + 126

    # STG: a model with perturbed_attn (LTX-2.3; the released 2.0 has none, so its render
    # skips the pass, whose output would equal the conditional one)
    stg = {"stg_scale": 1.0, "spatio_temporal_guidance_blocks": [28]}
    assert ltx2_family.STG_LAYERS not in _render_shapes(family, configs, specs, stg)
    perturbing = dataclasses.replace(config, perturbed_attn=True)
    both = {**configs, "transformer": perturbing}
    shapes = _render_shapes(family, both, specs, {**stg, "modality_scale": 3.0})
    assert ltx2_family.STG_LAYERS in shapes
    assert family.flops_per_forward(perturbing, 2, shape, shapes) == 2 * one + isolated


def test_fit_counts_a_default_renders_passes():
    """``difforge fit``'s generate program (pipelines/deploy.py) renders what a generate run
    renders by default: the family's per-prompt settings as generate resolves them (LTX-2's
    modality guidance 3: the isolated pass beside CFG's two rows), and a config's
    ``guidance_scale=1`` still runs CFG when the audio's default scale is above 1."""
    from pathlib import Path

    from jaxcore import sharding
    from jaxcore.config import load_config
    from pipelines import deploy
    from stages.generate.config import GenerateConfig

    repo = Path(__file__).resolve().parents[2]
    model = deploy.fit_model(str(repo / "configs/models/ltx2_19b.yml"))
    mesh = sharding.make_mesh(sharding.MeshConfig(), devices=jax.devices()[:1])

    def program(*overrides):
        config = load_config(
            GenerateConfig,
            repo / "configs/stages/generate.yml",
            [
                "sampling.height=512",
                "sampling.width=768",
                "sampling.num_frames=121",
                "sampling.num_inference_steps=2",
                "sampling.max_sequence_length=1024",
                *overrides,
            ],
        )
        return deploy.generate_program(config, model, mesh)

    config = model.configs["transformer"]
    sizes = (6144, 126, 1024, 1024)
    one = l2.flops_per_forward(config, 1, *sizes)
    isolated = l2.flops_per_forward(config, 1, *sizes, cross_modal=False)
    default = program()
    assert default.details["cfg"]
    assert default.model_flops == 2 * 2 * (one + isolated)  # 2 steps x CFG's 2 rows
    unguided = program("sampling.guidance_scale=1")  # the audio's 7 keeps CFG on
    assert unguided.details["cfg"] and unguided.model_flops == default.model_flops
