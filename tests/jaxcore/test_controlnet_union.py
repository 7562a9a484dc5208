"""ControlNetUnionModel (SDXL ControlNet++ "union") vs diffusers' ControlNetUnionModel and
MultiControlNetUnionModel.

A tiny random diffusers ControlNetUnionModel in the SDXL layout (text_time), every parameter
perturbed by 0.1 * randn (diffusers zero-initialises the residual convs and
``spatial_ch_projs``: unperturbed, nothing would be compared), saved with ``save_pretrained``
and loaded by our loader. Batch 2, so the fusion transformer's attention (which runs across
the batch in diffusers, see the module docstring) mixes two samples. Tolerance: 1e-5 max abs
relative to each tensor's largest |value| where that is > 1 (fp32 on CPU, as
test_controlnet.py).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
from diffusers import ControlNetUnionModel as TorchUnion
from diffusers.models.controlnets.multicontrolnet_union import MultiControlNetUnionModel

from jaxcore.models import controlnet_union as cu
from jaxcore.models import unet_2d_condition as unet
from tests.jaxcore.test_controlnet import _max_err, _perturbed
from tests.jaxcore.test_unet_2d_condition import FAST_COMPILE, _correctly_rounded_exp

ATOL = 1e-5  # max abs, relative to the tensor's largest value where that is > 1
# Reached (fp32 CPU, FAST_COMPILE; |mid| up to 10-25): one image 6.5e-7 / 7.8e-7 (rows),
# two images 6.7e-7 (with and without guess mode), MultiControlNetUnion 6.2e-7.

_CD, _D = unet.CROSS_DOWN, unet.DOWN

TINY = {
    "block_out_channels": [32, 64],
    "down_block_types": [_D, _CD],
    "layers_per_block": 1,
    "transformer_layers_per_block": [1, 2],
    "attention_head_dim": [2, 4],
    "use_linear_projection": True,
    "cross_attention_dim": 32,
    "addition_embed_type": "text_time",
    "addition_time_embed_dim": 8,
    "projection_class_embeddings_input_dim": 16 + 6 * 8,
    "norm_num_groups": 8,
    "conditioning_embedding_out_channels": [8, 16, 16, 32],
    "num_control_type": 5,
    "num_trans_channel": 32,
    "num_trans_head": 4,
    "num_trans_layer": 2,
    "num_proj_channel": 32,
}
BATCH, HEIGHT, WIDTH, TEXT_LEN = 2, 8, 12, 6
IMAGE_FACTOR = 8


@pytest.fixture(scope="module")
def net(tmp_path_factory):
    """(torch model, our module, our params, jitted forward), built once."""
    directory = tmp_path_factory.mktemp("controlnet_union")
    model = _perturbed(TorchUnion, TINY)
    model.save_pretrained(directory, safe_serialization=True)
    module, params = cu.load_controlnet_union(directory)
    forward = jax.jit(lambda p, *a: module.apply({"params": p}, *a), compiler_options=FAST_COMPILE)
    return model, module, params, forward


def _inputs(types: tuple[int, ...], seed: int = 0) -> dict:
    """Shared inputs plus one control image per entry of ``types`` (its control type)."""
    rng = np.random.default_rng(seed)
    size = (HEIGHT * IMAGE_FACTOR, WIDTH * IMAGE_FACTOR)
    control_type = np.zeros((BATCH, TINY["num_control_type"]), np.float32)
    control_type[:, list(types)] = 1.0
    return {
        "sample": rng.standard_normal((BATCH, 4, HEIGHT, WIDTH), "f4"),
        "timestep": np.asarray([981.0, 10.5], np.float32),
        "context": rng.standard_normal((BATCH, TEXT_LEN, TINY["cross_attention_dim"]), "f4"),
        "images": [rng.uniform(0, 1, (BATCH, 3, *size)).astype(np.float32) for _ in types],
        "control_type": control_type,
        "idx": list(types),
        "text_embeds": rng.standard_normal((BATCH, 16), np.float32),
        "time_ids": np.tile(np.array([[512, 768, 0, 8, 512, 768]], np.float32), (BATCH, 1)),
    }


def _added(x: dict) -> dict:
    """diffusers' added_cond_kwargs (SDXL text_time)."""
    return {
        "text_embeds": torch.from_numpy(x["text_embeds"]),
        "time_ids": torch.from_numpy(x["time_ids"]),
    }


def _torch_residuals(model, x: dict, scales: list[float], guess: bool):
    """diffusers' residuals as numpy (one scale per image, one guess flag per call)."""
    with torch.no_grad(), _correctly_rounded_exp():
        down, mid = model(
            torch.from_numpy(x["sample"]),
            torch.from_numpy(x["timestep"]),
            torch.from_numpy(x["context"]),
            [torch.from_numpy(i) for i in x["images"]],
            torch.from_numpy(x["control_type"]),
            x["idx"],
            conditioning_scale=scales,
            guess_mode=guess,
            added_cond_kwargs=_added(x),
            return_dict=False,
        )
    return [d.numpy() for d in down], mid.numpy()


def _ours(forward, params, x: dict, scale, guess):
    """Our residuals, the images stacked to [B, K, 3, 8H, 8W]."""
    return forward(
        params,
        x["sample"],
        x["timestep"],
        x["context"],
        np.stack(x["images"], axis=1),
        x["control_type"],
        np.asarray(x["idx"], np.int32),
        scale,
        x["text_embeds"],
        x["time_ids"],
        guess,
    )


def test_single_control_matches_diffusers(net):
    """One image: the residuals scaled as ControlNetModel's (per-row scales and guess mode
    only touch the output scaling, so each row is diffusers' call with that row's settings)."""
    model, _, params, forward = net
    x = _inputs((2,))
    scale_bk = np.asarray([[0.7], [1.4]], np.float32)
    guess_b = np.asarray([False, True])

    down, mid = _ours(forward, params, x, scale_bk, guess_b)

    for row in range(BATCH):
        down_ref, mid_ref = _torch_residuals(
            model, x, [float(scale_bk[row, 0])], bool(guess_b[row])
        )
        got = [np.asarray(r)[row] for r in (*down, mid)]
        assert _max_err(got, [r[row] for r in (*down_ref, mid_ref)]) < ATOL
    assert np.abs(mid_ref).max() > 1.0  # not a degenerate comparison
    assert len(down) == cu.ControlNetUnionConfig.from_dict(model.config).num_down_residuals


@pytest.mark.parametrize("guess", [False, True])
def test_two_controls_match_diffusers(net, guess):
    """Two images of two types at different scales: each image's embedding and token scaled
    inside, the residuals unscaled (guess mode: only its ramp)."""
    model, _, params, forward = net
    x = _inputs((1, 4), seed=1)
    scales = [0.6, 1.3]
    down_ref, mid_ref = _torch_residuals(model, x, scales, guess)

    down, mid = _ours(forward, params, x, np.tile(np.float32(scales), (BATCH, 1)), guess)

    assert _max_err([*down, mid], [*down_ref, mid_ref]) < ATOL
    assert np.abs(mid_ref).max() > 1.0


def test_list_inputs_and_per_sample_type_indices(net):
    """A list of images, a [K] scale list and [B, K] indices equal to the stacked forms."""
    _, module, params, forward = net
    x = _inputs((1, 4), seed=2)
    stacked = _ours(forward, params, x, np.float32([[0.6, 1.3]] * BATCH), False)

    listed = module.apply(
        {"params": params},
        x["sample"],
        x["timestep"],
        x["context"],
        x["images"],
        x["control_type"],
        np.asarray([[1, 4]] * BATCH, np.int32),
        [0.6, 1.3],
        x["text_embeds"],
        x["time_ids"],
    )

    # eager vs the jitted (LLVM -O0) forward: equal up to fp32 rounding
    expected = [np.asarray(r) for r in jax.tree.leaves(stacked)]
    assert _max_err(jax.tree.leaves(listed), expected) < ATOL


def test_multi_controlnet_union_matches_diffusers(net):
    """MultiControlNetUnionModel over the same net twice (two images in the first call, one
    in the second): residuals scaled per net, not per image."""
    model, module, params, _ = net
    first, second = _inputs((0, 3), seed=3), _inputs((2,), seed=4)
    with torch.no_grad(), _correctly_rounded_exp():
        down_ref, mid_ref = MultiControlNetUnionModel([model, model])(
            torch.from_numpy(first["sample"]),
            torch.from_numpy(first["timestep"]),
            torch.from_numpy(first["context"]),
            [[torch.from_numpy(i) for i in x["images"]] for x in (first, second)],
            [torch.from_numpy(x["control_type"]) for x in (first, second)],
            [first["idx"], second["idx"]],
            [0.5, 0.8],
            added_cond_kwargs=_added(first),
            return_dict=False,
        )
    nets = [(module, params, x["images"], x["control_type"], x["idx"]) for x in (first, second)]
    run = jax.jit(
        lambda p, *a: cu.multi_controlnet_union(
            [(m, p, *rest) for m, _, *rest in nets],
            *a,
            conditioning_scales=[0.5, 0.8],
            text_embeds=first["text_embeds"],
            time_ids=first["time_ids"],
        ),
        compiler_options=FAST_COMPILE,
    )

    down, mid = run(params, first["sample"], first["timestep"], first["context"])

    expected = [r.numpy() for r in (*down_ref, mid_ref)]
    assert _max_err([*down, mid], expected) < ATOL


def test_weight_map_names_union_parameters():
    """The union parts map to diffusers' (torch MultiheadAttention's bare) names."""
    config = cu.ControlNetUnionConfig.from_dict(TINY)
    keys = {key for key, _ in cu.weight_map(config).values()}
    for key in (
        "task_embedding",
        "transformer_layes.1.attn.in_proj_weight",
        "transformer_layes.1.attn.in_proj_bias",
        "transformer_layes.0.attn.out_proj.weight",
        "transformer_layes.0.ln_1.weight",
        "transformer_layes.0.mlp.c_fc.bias",
        "spatial_ch_projs.weight",
        "control_add_embedding.linear_2.weight",
        "controlnet_cond_embedding.blocks.5.weight",
    ):
        assert key in keys


# xinsir/controlnet-union-sdxl-1.0 (the SDXL ControlNet layout); promax has 8 control types
REAL = {
    "down_block_types": [_D, _CD, _CD],
    "block_out_channels": [320, 640, 1280],
    "attention_head_dim": [5, 10, 20],
    "transformer_layers_per_block": [1, 2, 10],
    "cross_attention_dim": 2048,
    "use_linear_projection": True,
    "addition_embed_type": "text_time",
    "addition_time_embed_dim": 256,
    "projection_class_embeddings_input_dim": 2816,
}


@pytest.mark.parametrize("num_control_type", [6, 8])
def test_parameter_count_matches_diffusers(num_control_type):
    """The released sizes: xinsir's (6 types) and promax (8), counted on the meta device."""
    with torch.device("meta"):
        reference = TorchUnion(**REAL, num_control_type=num_control_type)
    expected = sum(p.numel() for p in reference.parameters())
    config = cu.ControlNetUnionConfig.from_dict(dict(reference.config))

    assert cu.count_params(config) == expected
    assert expected > 1_200_000_000  # ~1.26B


def test_config_errors_name_the_key():
    """Unknown and unsupported keys are refused by name."""
    with pytest.raises(cu.ControlNetUnionConfigError, match="num_control_types"):
        cu.ControlNetUnionConfig.from_dict({**TINY, "num_control_types": 6})
    with pytest.raises(cu.ControlNetUnionConfigError, match="mid_block_type"):
        cu.ControlNetUnionConfig.from_dict({**TINY, "mid_block_type": unet.MID})
    with pytest.raises(cu.ControlNetUnionConfigError, match="channel_order"):
        cu.ControlNetUnionConfig.from_dict({**TINY, "controlnet_conditioning_channel_order": "bgr"})
    with pytest.raises(cu.ControlNetUnionConfigError, match="num_trans_channel"):
        cu.ControlNetUnionConfig.from_dict({**TINY, "num_trans_channel": 48})
    with pytest.raises(cu.ControlNetUnionConfigError, match="num_trans_head"):
        cu.ControlNetUnionConfig.from_dict({**TINY, "num_trans_head": 5})
    with pytest.raises(cu.ControlNetUnionConfigError, match="addition_time_embed_dim"):
        cu.ControlNetUnionConfig.from_dict(
            {**TINY, "addition_embed_type": None, "addition_time_embed_dim": None}
        )


def test_config_round_trips_to_diffusers(net):
    """to_dict builds the same diffusers model."""
    model = net[0]
    config = cu.ControlNetUnionConfig.from_dict(dict(model.config))
    rebuilt = TorchUnion(**config.to_dict())
    assert sum(p.numel() for p in rebuilt.parameters()) == sum(
        p.numel() for p in model.parameters()
    )


def test_per_sample_attention_equals_diffusers_one_prompt_calls(net):
    """attend_across_batch=False (what the pipelines use): each row equals diffusers' call on
    that row alone, so a render does not depend on the prompts batched beside it."""
    model, module, params, _ = net
    x = _inputs((1, 3), seed=4)
    alone = module.clone(attend_across_batch=False)
    down, mid = jax.jit(lambda p, *a: alone.apply({"params": p}, *a))(
        params,
        x["sample"],
        x["timestep"],
        x["context"],
        np.stack(x["images"], axis=1),
        x["control_type"],
        np.asarray(x["idx"], np.int32),
        np.asarray([0.8, 1.2], np.float32),
        x["text_embeds"],
        x["time_ids"],
        False,
    )
    for row in range(BATCH):
        one = {k: (v[row : row + 1] if isinstance(v, np.ndarray) else v) for k, v in x.items()}
        one["images"] = [image[row : row + 1] for image in x["images"]]
        down_ref, mid_ref = _torch_residuals(model, one, [0.8, 1.2], False)
        got = [np.asarray(r)[row : row + 1] for r in (*down, mid)]
        assert _max_err(got, [*down_ref, mid_ref]) < ATOL
