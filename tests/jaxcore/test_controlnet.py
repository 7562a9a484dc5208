"""ControlNetModel (SD 1.x / 2.x / SDXL) vs diffusers' ControlNetModel, and the UNet taking its
residuals vs diffusers' UNet2DConditionModel taking the same.

Tiny random diffusers ControlNets with every parameter perturbed (diffusers zero-initialises the
residual convs: unperturbed, every residual would be 0 and nothing would be compared), saved with
``save_pretrained`` and loaded by our loader. Tolerance: 1e-5 max abs relative to the largest
|value| of each tensor (fp32 on CPU, the UNet tests' bound; reached values at ATOL).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
from diffusers import ControlNetModel as TorchControlNet
from diffusers import UNet2DConditionModel as TorchUNet

from jaxcore.models import controlnet
from jaxcore.models import unet_2d_condition as unet
from tests.jaxcore.test_unet_2d_condition import FAST_COMPILE, _correctly_rounded_exp

ATOL = 1e-5  # max abs, relative to the tensor's largest value where that is > 1
# Reached (fp32 CPU): see test_residuals_match_diffusers

_CD, _D = unet.CROSS_DOWN, unet.DOWN

TINY = {
    # SD 1.x layout, conv projections
    "sd": {
        "block_out_channels": [32, 64],
        "down_block_types": [_CD, _CD],
        "layers_per_block": 1,
        "attention_head_dim": 4,
        "cross_attention_dim": 16,
        "norm_num_groups": 8,
        "conditioning_embedding_out_channels": [8, 16, 16, 32],
    },
    # SDXL layout: plain first level, text_time, linear projections, deeper transformer
    "sdxl": {
        "block_out_channels": [32, 64],
        "down_block_types": [_D, _CD],
        "layers_per_block": 2,
        "transformer_layers_per_block": [1, 2],
        "attention_head_dim": [2, 4],
        "use_linear_projection": True,
        "cross_attention_dim": 32,
        "addition_embed_type": "text_time",
        "addition_time_embed_dim": 8,
        "projection_class_embeddings_input_dim": 16 + 6 * 8,
        "norm_num_groups": 8,
        "conditioning_embedding_out_channels": [8, 16, 16, 32],
    },
    # bgr channel order, single-channel control, 3 levels, a 3-step embedding, mish
    "odd": {
        "in_channels": 3,
        "conditioning_channels": 1,
        "controlnet_conditioning_channel_order": "bgr",
        "block_out_channels": [16, 24, 32],
        "down_block_types": [_CD, _D, _CD],
        "layers_per_block": 1,
        "attention_head_dim": [2, 3, 4],
        "cross_attention_dim": 24,
        "act_fn": "mish",
        "downsample_padding": 0,
        "norm_num_groups": 8,
        "conditioning_embedding_out_channels": [8, 16, 24],
        "flip_sin_to_cos": False,
        "freq_shift": 1,
    },
}
# (batch, latent height, width, text length) per config; the control image is 8x (4x for odd)
INPUTS = {"sd": (2, 16, 16, 5), "sdxl": (2, 16, 24, 6), "odd": (2, 12, 20, 5)}


def _perturbed(cls, config: dict, seed: int = 0):
    torch.manual_seed(seed)
    model = cls(**config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn_like(param))
    return model


@pytest.fixture(scope="module")
def nets(tmp_path_factory):
    cache = {}

    def get(name):
        if name not in cache:
            directory = tmp_path_factory.mktemp(f"controlnet_{name}")
            model = _perturbed(TorchControlNet, TINY[name])
            model.save_pretrained(directory, safe_serialization=True)
            module, params = controlnet.load_controlnet(directory)
            forward = jax.jit(
                lambda p, *a, m=module: m.apply({"params": p}, *a), compiler_options=FAST_COMPILE
            )
            cache[name] = (model, module, params, forward)
        return cache[name]

    return get


def _inputs(name: str, seed: int = 0) -> dict:
    cfg = TINY[name]
    batch, height, width, text_len = INPUTS[name]
    factor = 2 ** (len(cfg["conditioning_embedding_out_channels"]) - 1)
    rng = np.random.default_rng(seed)
    out = {
        "sample": rng.standard_normal((batch, cfg.get("in_channels", 4), height, width), "f4"),
        "timestep": np.asarray([981.0, 10.5][:batch], np.float32),
        "context": rng.standard_normal((batch, text_len, cfg["cross_attention_dim"]), "f4"),
        "image": rng.uniform(
            0, 1, (batch, cfg.get("conditioning_channels", 3), height * factor, width * factor)
        ).astype(np.float32),
        "text_embeds": None,
        "time_ids": None,
    }
    if cfg.get("addition_embed_type") == "text_time":
        out["text_embeds"] = rng.standard_normal((batch, 16), np.float32)
        out["time_ids"] = np.tile(np.array([[512, 768, 0, 8, 512, 768]], np.float32), (batch, 1))
    return out


def _torch_residuals(model, x: dict, scale: float, guess: bool):
    added = None
    if x["text_embeds"] is not None:
        added = {
            "text_embeds": torch.from_numpy(x["text_embeds"]),
            "time_ids": torch.from_numpy(x["time_ids"]),
        }
    with torch.no_grad(), _correctly_rounded_exp():
        down, mid = model(
            torch.from_numpy(x["sample"]),
            torch.from_numpy(x["timestep"]),
            torch.from_numpy(x["context"]),
            torch.from_numpy(x["image"]),
            conditioning_scale=scale,
            guess_mode=guess,
            added_cond_kwargs=added,
            return_dict=False,
        )
    return [d.numpy() for d in down], mid.numpy()


def _ours(forward, params, x: dict, scale, guess):
    return forward(
        params,
        x["sample"],
        x["timestep"],
        x["context"],
        x["image"],
        scale,
        x["text_embeds"],
        x["time_ids"],
        guess,
    )


def _max_err(got, expected) -> float:
    """The largest difference, relative to the largest reference value where that is > 1."""
    worst = 0.0
    for g, e in zip(got, expected, strict=True):
        assert np.shape(g) == e.shape, (np.shape(g), e.shape)
        diff = float(np.abs(np.asarray(g) - e).max())
        worst = max(worst, diff / max(1.0, float(np.abs(e).max())))
    return worst


@pytest.mark.parametrize("name", sorted(TINY))
def test_residuals_match_diffusers(nets, name):
    model, _, params, forward = nets(name)
    x = _inputs(name)
    down_ref, mid_ref = _torch_residuals(model, x, 0.7, False)

    down, mid = _ours(forward, params, x, np.float32(0.7), False)

    assert (
        len(down)
        == len(down_ref)
        == controlnet.ControlNetConfig.from_dict(model.config).num_down_residuals
    )
    assert _max_err([*down, mid], [*down_ref, mid_ref]) < ATOL
    assert np.abs(mid_ref).max() > 1.0  # not a degenerate comparison


def test_guess_mode_and_per_row_scales(nets):
    """Row 0 in guess mode at scale 0.5, row 1 plain at scale 1.3: each row equals diffusers'
    call with that row's settings (diffusers takes one setting per call)."""
    model, _, params, forward = nets("sd")
    x = _inputs("sd")
    scales, guess = np.asarray([0.5, 1.3], np.float32), np.asarray([True, False])

    down, mid = _ours(forward, params, x, scales, guess)

    for row, (scale, g) in enumerate(zip(scales, guess, strict=True)):
        down_ref, mid_ref = _torch_residuals(model, x, float(scale), bool(g))
        got = [np.asarray(d)[row] for d in (*down, mid)]
        assert _max_err(got, [r[row] for r in (*down_ref, mid_ref)]) < ATOL
    # guess mode really ramps: the first residual is 10x smaller relative to the last
    ratio = np.abs(np.asarray(down[0])[0]).mean() / np.abs(np.asarray(down[0])[1]).mean()
    assert ratio < 0.5


def test_global_pool_conditions(tmp_path):
    config = {**TINY["sd"], "global_pool_conditions": True}
    model = _perturbed(TorchControlNet, config, seed=1)
    model.save_pretrained(tmp_path, safe_serialization=True)
    module, params = controlnet.load_controlnet(tmp_path)
    x = _inputs("sd", seed=1)
    down_ref, mid_ref = _torch_residuals(model, x, 0.9, True)

    down, mid = _ours(jax.jit(lambda p, *a: module.apply({"params": p}, *a)), params, x, 0.9, True)

    assert mid.shape[2:] == (1, 1)
    assert _max_err([*down, mid], [*down_ref, mid_ref]) < ATOL


def test_unet_with_residuals_matches_diffusers(nets, tmp_path):
    """The SDXL-like ControlNet's residuals into a matching UNet, ours vs diffusers'."""
    model, _, params, forward = nets("sdxl")
    x = _inputs("sdxl")
    unet_config = {
        k: v for k, v in TINY["sdxl"].items() if k != "conditioning_embedding_out_channels"
    }
    unet_config["up_block_types"] = [unet.CROSS_UP, unet.UP]
    torch_unet = _perturbed(TorchUNet, unet_config, seed=2)
    torch_unet.save_pretrained(tmp_path, safe_serialization=True)
    module, unet_params = unet.load_unet_2d_condition(tmp_path)
    down_ref, mid_ref = _torch_residuals(model, x, 0.8, False)
    added = {
        "text_embeds": torch.from_numpy(x["text_embeds"]),
        "time_ids": torch.from_numpy(x["time_ids"]),
    }
    with torch.no_grad(), _correctly_rounded_exp():
        expected = torch_unet(
            torch.from_numpy(x["sample"]),
            torch.from_numpy(x["timestep"]),
            torch.from_numpy(x["context"]),
            added_cond_kwargs=added,
            down_block_additional_residuals=[torch.from_numpy(d) for d in down_ref],
            mid_block_additional_residual=torch.from_numpy(mid_ref),
        ).sample.numpy()
    down, mid = _ours(forward, params, x, np.float32(0.8), False)

    got = module.apply(
        {"params": unet_params},
        x["sample"],
        x["timestep"],
        x["context"],
        x["text_embeds"],
        x["time_ids"],
        down,
        mid,
    )

    assert _max_err([got], [expected]) < ATOL
    plain = module.apply(
        {"params": unet_params}, x["sample"], x["timestep"], x["context"], *added_np(x)
    )
    assert np.abs(np.asarray(plain) - expected).max() > 1e-2  # the residuals changed it


def added_np(x):
    return x["text_embeds"], x["time_ids"]


def test_guess_mode_ramp_is_torch_logspace():
    for count in (4, 10, 13):
        ramp = controlnet.guess_mode_ramp(count)
        expected = torch.logspace(-1, 0, count).numpy()
        np.testing.assert_allclose(ramp, expected, rtol=2e-7)


# The released configs (lllyasviel/sd-controlnet-canny, diffusers/controlnet-canny-sdxl-1.0)
REAL = {
    "sd15_canny": {"cross_attention_dim": 768},
    "sdxl_canny": {
        "down_block_types": [_D, _CD, _CD],
        "block_out_channels": [320, 640, 1280],
        "attention_head_dim": [5, 10, 20],
        "transformer_layers_per_block": [1, 2, 10],
        "cross_attention_dim": 2048,
        "use_linear_projection": True,
        "addition_embed_type": "text_time",
        "addition_time_embed_dim": 256,
        "projection_class_embeddings_input_dim": 2816,
    },
}


@pytest.mark.parametrize("name", sorted(REAL))
def test_parameter_count_matches_diffusers(name):
    with torch.device("meta"):
        reference = TorchControlNet(**REAL[name])
    expected = sum(p.numel() for p in reference.parameters())
    config = controlnet.ControlNetConfig.from_dict(dict(reference.config))

    assert controlnet.count_params(config) == expected
    assert expected > 300_000_000  # the real sizes: 361M (SD 1.5), 1.25B (SDXL)


def test_config_refuses_unknown_and_unsupported_keys():
    with pytest.raises(controlnet.ControlNetConfigError, match="up_block_types"):
        controlnet.ControlNetConfig.from_dict({**TINY["sd"], "up_block_types": [_CD, _CD]})
    with pytest.raises(controlnet.ControlNetConfigError, match="channel_order"):
        controlnet.ControlNetConfig.from_dict(
            {**TINY["sd"], "controlnet_conditioning_channel_order": "rbg"}
        )
    with pytest.raises(unet.UNet2DConditionConfigError, match="class_embed_type"):
        controlnet.ControlNetConfig.from_dict({**TINY["sd"], "class_embed_type": "timestep"})


def test_config_round_trips_to_diffusers(nets):
    model = nets("odd")[0]
    config = controlnet.ControlNetConfig.from_dict(dict(model.config))
    rebuilt = TorchControlNet(**config.to_dict())
    assert sum(p.numel() for p in rebuilt.parameters()) == sum(
        p.numel() for p in model.parameters()
    )
