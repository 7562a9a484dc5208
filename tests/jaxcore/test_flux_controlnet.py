"""Flux ControlNet vs diffusers FluxControlNetModel / FluxMultiControlNetModel, and the
FluxTransformer's ControlNet residual inputs vs FluxTransformer2DModel (tiny random-init
models, every parameter perturbed so the zero-initialised control layers are not zero, fp32).

Parity tolerance: max abs diff <= PARITY_RTOL * max |reference output| over all returned
samples (or prediction), with PARITY_RTOL = 1e-5 (outputs of magnitude 1 to 4). Reached on
CPU: ControlNet alone 3.0e-7 to 4.2e-7 (plain, union, hint), two nets / one union net under two
conditions 6.0e-7, transformer with residuals 7.2e-7 to 9.5e-7, ControlNet into transformer
1.1e-6 (all 1.9e-7 to 4.0e-7 of the output scale).

The reference runs with a correctly rounded float32 ``torch.exp`` (see test_flux_transformer).
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import numpy as np
import pytest
import torch

from jaxcore.models import flux_controlnet as fc
from jaxcore.models import flux_transformer as ft
from tests.jaxcore.test_flux_transformer import _correctly_rounded_exp
from tests.jaxcore.test_flux_transformer import _inputs as _transformer_inputs

PARITY_RTOL = 1e-5

# shared by every tiny model here: D = 2 heads x 16, so any ControlNet feeds the transformer
_SHARED = dict(
    patch_size=1,
    in_channels=16,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=32,
    pooled_projection_dim=16,
    axes_dims_rope=(4, 6, 6),
)
# 4 double / 5 single blocks: a 3-layer ControlNet spreads its samples 2 blocks each
# (ceil(4 / 3) = 2, the last sample used once), a 2-single-layer one 3 blocks each
TRANSFORMER = dict(_SHARED, num_layers=4, num_single_layers=5, guidance_embeds=True)
CONTROLNETS = {
    "plain": dict(_SHARED, num_layers=3, num_single_layers=2, guidance_embeds=True),
    "union": dict(_SHARED, num_layers=1, num_single_layers=3, guidance_embeds=False, num_mode=4),
    # pixel control image through input_hint_block; no single blocks (diffusers returns None)
    "hint": dict(
        _SHARED,
        num_layers=2,
        num_single_layers=0,
        guidance_embeds=True,
        conditioning_embedding_channels=16,
    ),
}
# InstantX/FLUX.1-dev-Controlnet-Union's config.json
INSTANTX_UNION = {
    "_class_name": "FluxControlNetModel",
    "attention_head_dim": 128,
    "axes_dims_rope": [16, 56, 56],
    "guidance_embeds": True,
    "in_channels": 64,
    "joint_attention_dim": 4096,
    "num_attention_heads": 24,
    "num_layers": 5,
    "num_mode": 10,
    "num_single_layers": 10,
    "patch_size": 1,
    "pooled_projection_dim": 768,
}
BATCH, HEIGHT, WIDTH, TEXT_LEN = 2, 4, 6, 5  # latent 4 x 6: 6 image tokens


def _perturbed(model, seed: int):
    """Every parameter moved off its init (zero control layers, unit norms), so a mis-mapped
    parameter changes the output."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def _save_controlnet(directory: Path, config: dict, seed: int):
    from diffusers import FluxControlNetModel

    torch.manual_seed(seed)
    model = _perturbed(FluxControlNetModel(**config), seed)
    model.save_pretrained(directory)
    return model


def _inputs(config: dict, seed: int = 2) -> dict:
    """FluxPipeline-shaped transformer inputs plus a control image: packed latents, or pixels
    (8x the token grid) with an input_hint_block, and per-sample modes for a union model."""
    inputs = _transformer_inputs(config, BATCH, HEIGHT, WIDTH, TEXT_LEN)
    rng = np.random.default_rng(seed)
    if config.get("conditioning_embedding_channels"):
        shape = (BATCH, 3, HEIGHT // 2 * 8, WIDTH // 2 * 8)
        inputs["controlnet_cond"] = rng.uniform(-1, 1, shape).astype(np.float32)
    else:
        latents = rng.standard_normal((BATCH, config["in_channels"] // 4, HEIGHT, WIDTH))
        inputs["controlnet_cond"] = np.asarray(ft.pack_latents(latents.astype(np.float32)))
    num_mode = config.get("num_mode")
    inputs["controlnet_mode"] = rng.integers(0, num_mode, BATCH) if num_mode else None
    inputs["conditioning_scale"] = 0.7
    return inputs


def _torch(inputs: dict) -> dict:
    out = {}
    for key, value in inputs.items():
        if key == "controlnet_mode":
            value = None if value is None else torch.from_numpy(value).long()[:, None]
        elif isinstance(value, np.ndarray):
            value = torch.from_numpy(value)
        if value is not None:
            out[key] = value
    return out


def _reference_samples(model, inputs: dict):
    with torch.no_grad(), _correctly_rounded_exp():
        out = model(**_torch(inputs), return_dict=False)
    return tuple(None if s is None else tuple(t.numpy() for t in s) for s in out)


def _compare(got, expected, what: str) -> float:
    """Max abs diff over both sample groups, asserted <= PARITY_RTOL * max |expected|."""
    diffs, scale = [0.0], 0.0
    for group_got, group_expected in zip(got, expected, strict=True):
        assert (group_got is None) == (group_expected is None), what
        if group_expected is None:
            continue
        assert len(group_got) == len(group_expected), what
        for a, b in zip(group_got, group_expected, strict=True):
            assert a.shape == b.shape, (what, a.shape, b.shape)
            diffs.append(float(np.max(np.abs(np.asarray(a) - b))))
            scale = max(scale, float(np.max(np.abs(b))))
    diff = max(diffs)
    assert diff <= PARITY_RTOL * scale, f"{what}: max abs diff {diff:.2e}, scale {scale:.2f}"
    return diff


@pytest.fixture(scope="module")
def controlnets(tmp_path_factory) -> dict:
    """name: (diffusers model, our module, our params)."""
    loaded = {}
    for seed, (name, config) in enumerate(sorted(CONTROLNETS.items())):
        directory = tmp_path_factory.mktemp(f"flux_controlnet_{name}")
        reference = _save_controlnet(directory, config, seed)
        module, params = fc.load_flux_controlnet(directory)
        loaded[name] = (reference, module, params)
    return loaded


@pytest.fixture(scope="module")
def transformer(tmp_path_factory):
    """(diffusers FluxTransformer2DModel, our module, our params)."""
    from diffusers import FluxTransformer2DModel

    directory = tmp_path_factory.mktemp("flux_transformer")
    torch.manual_seed(10)
    reference = _perturbed(FluxTransformer2DModel(**TRANSFORMER), 10)
    reference.save_pretrained(directory)
    module, params = ft.load_flux_transformer(directory)
    return reference, module, params


# --- the ControlNet ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(CONTROLNETS))
def test_controlnet_matches_diffusers(controlnets, name):
    """Union (mode token), guidance on / off, pixel hint encoder; ids traced as jit arguments
    (plain) or closed over as numpy (the exact host RoPE tables, the others)."""
    reference, module, params = controlnets[name]
    inputs = _inputs(CONTROLNETS[name])
    expected = _reference_samples(reference, inputs)
    if name == "plain":
        got = jax.jit(module.apply)({"params": params}, **inputs)
    else:
        ids = {k: inputs.pop(k) for k in ("img_ids", "txt_ids")}
        got = jax.jit(functools.partial(module.apply, **ids))({"params": params}, **inputs)
    _compare(got, expected, name)


def test_controlnet_input_errors(controlnets):
    _, module, params = controlnets["union"]
    inputs = _inputs(CONTROLNETS["union"])
    with pytest.raises(ValueError, match="controlnet_mode is required"):
        module.apply({"params": params}, **dict(inputs, controlnet_mode=None))
    bad_cond = inputs["controlnet_cond"][:, :-1]
    with pytest.raises(ValueError, match="controlnet_cond must be"):
        module.apply({"params": params}, **dict(inputs, controlnet_cond=bad_cond))


def test_config_from_dict_and_errors():
    config = fc.FluxControlNetConfig.from_dict(INSTANTX_UNION)
    assert config.union and config.num_mode == 10 and config.axes_dims_rope == (16, 56, 56)
    assert fc.FluxControlNetConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ft.FluxConfigError, match="unknown"):
        fc.FluxControlNetConfig.from_dict(dict(INSTANTX_UNION, out_channels=64))
    with pytest.raises(ft.FluxConfigError, match="conditioning_embedding_channels"):
        fc.FluxControlNetConfig(in_channels=64, conditioning_embedding_channels=16)
    with pytest.raises(ft.FluxConfigError, match="axes_dims_rope"):
        fc.FluxControlNetConfig(attention_head_dim=64)


def test_param_count_matches_diffusers_instantx_union():
    from diffusers import FluxControlNetModel

    config = fc.FluxControlNetConfig.from_dict(INSTANTX_UNION)
    kwargs = {k: v for k, v in INSTANTX_UNION.items() if not k.startswith("_")}
    with torch.device("meta"):
        reference = FluxControlNetModel(**kwargs)
    expected = sum(p.numel() for p in reference.parameters())
    assert fc.count_params(config) == expected == 3_301_956_608
    # every parameter of the abstract tree has a checkpoint name, and no two share one
    paths = jax.tree_util.tree_flatten_with_path(fc.abstract_params(fc.FluxControlNetModel(config)))
    names = fc.weight_map(config)
    assert len(names) == len(paths[0]) == len(set(v[0] for v in names.values()))


# --- the transformer's residual inputs ---------------------------------------------------------

# name: (number of double samples or None, number of single samples or None, repeat)
RESIDUAL_CASES = {
    "spread": (3, 2, False),
    "repeat": (3, 2, True),  # XLabs: block i takes sample i % 3
    "single_only": (None, 5, False),
    "double_only_many": (6, None, False),  # more samples than blocks: the first 4 used
}


def _residuals(count, seed: int):
    if count is None:
        return None
    rng = np.random.default_rng(seed)
    dim = TRANSFORMER["num_attention_heads"] * TRANSFORMER["attention_head_dim"]
    shape = (BATCH, HEIGHT // 2 * (WIDTH // 2), dim)
    return tuple(rng.standard_normal(shape).astype(np.float32) for _ in range(count))


def _reference_prediction(reference, inputs: dict, blocks, singles, repeat: bool):
    def as_torch(samples):
        return None if samples is None else [torch.from_numpy(s) for s in samples]

    with torch.no_grad(), _correctly_rounded_exp():
        return reference(
            **_torch(inputs),
            controlnet_block_samples=as_torch(blocks),
            controlnet_single_block_samples=as_torch(singles),
            controlnet_blocks_repeat=repeat,
        ).sample.numpy()


def _assert_close(got, expected, what: str) -> float:
    diff = float(np.max(np.abs(np.asarray(got) - expected)))
    scale = float(np.max(np.abs(expected)))
    assert diff <= PARITY_RTOL * scale, f"{what}: max abs diff {diff:.2e}, scale {scale:.2f}"
    return diff


@pytest.mark.parametrize("name", sorted(RESIDUAL_CASES))
def test_transformer_residuals_match_diffusers(transformer, name):
    reference, module, params = transformer
    n_blocks, n_singles, repeat = RESIDUAL_CASES[name]
    blocks, singles = _residuals(n_blocks, 3), _residuals(n_singles, 4)
    inputs = _transformer_inputs(TRANSFORMER, BATCH, HEIGHT, WIDTH, TEXT_LEN)
    expected = _reference_prediction(reference, inputs, blocks, singles, repeat)
    without = _reference_prediction(reference, inputs, None, None, False)
    assert np.max(np.abs(expected - without)) > 0.1  # the residuals matter

    fn = functools.partial(module.apply, controlnet_blocks_repeat=repeat)
    got = jax.jit(fn)(
        {"params": params},
        **inputs,
        controlnet_block_samples=blocks,
        controlnet_single_block_samples=singles,
    )
    _assert_close(got, expected, name)


def test_control_sample_index():
    assert ft.control_sample_index(19, 5) == [i // 4 for i in range(19)]
    assert ft.control_sample_index(4, 3) == [0, 0, 1, 1]
    assert ft.control_sample_index(5, 3, repeat=True) == [0, 1, 2, 0, 1]
    assert ft.control_sample_index(2, 5) == [0, 1]
    with pytest.raises(ValueError, match="at least one"):
        ft.control_sample_index(3, 0)


def test_residuals_under_scan_and_run_stack(transformer):
    """scan_layers (segments between residuals each a scan) and a run_stack that runs the
    stack in two calls split inside the double blocks give the unrolled result."""
    _, module, params = transformer
    scanned = ft.FluxTransformer(module.config, scan_layers=True)
    inputs = _transformer_inputs(TRANSFORMER, BATCH, HEIGHT, WIDTH, TEXT_LEN)
    controls = dict(
        controlnet_block_samples=_residuals(2, 5),
        controlnet_single_block_samples=_residuals(1, 6),
    )

    def run_in_two(streams, run_blocks, num_blocks):
        return run_blocks(run_blocks(streams, 0, 3), 3, num_blocks), None

    plain = jax.jit(module.apply)({"params": params}, **inputs, **controls)
    in_scan = jax.jit(scanned.apply)({"params": params}, **inputs, **controls)
    split = functools.partial(module.apply, run_stack=run_in_two)
    in_two = jax.jit(split)({"params": params}, **inputs, **controls)[0]
    np.testing.assert_allclose(np.asarray(in_scan), np.asarray(plain), rtol=0, atol=1e-6)
    np.testing.assert_allclose(np.asarray(in_two), np.asarray(plain), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match=r"controlnet_block_samples\[0\] must be"):
        bad = (controls["controlnet_block_samples"][0][:, :-1],)
        module.apply({"params": params}, **inputs, controlnet_block_samples=bad)


def test_controlnet_into_transformer_matches_diffusers(controlnets, transformer):
    """The ControlNet's samples fed to the transformer, ours end to end vs diffusers'."""
    cn_reference, cn_module, cn_params = controlnets["plain"]
    reference, module, params = transformer
    inputs = _inputs(CONTROLNETS["plain"])
    blocks, singles = _reference_samples(cn_reference, inputs)
    control_keys = ("controlnet_cond", "controlnet_mode", "conditioning_scale")
    base = {k: v for k, v in inputs.items() if k not in control_keys}
    expected = _reference_prediction(reference, base, blocks, singles, False)

    def ours(p_cn, p_tf):
        samples = cn_module.apply({"params": p_cn}, **inputs)
        return module.apply(
            {"params": p_tf}, **base, **dict(zip(_CONTROL_ARGS, samples, strict=True))
        )

    _assert_close(jax.jit(ours)(cn_params, params), expected, "controlnet -> transformer")


_CONTROL_ARGS = ("controlnet_block_samples", "controlnet_single_block_samples")


# --- several ControlNets -----------------------------------------------------------------------


def _multi_inputs(names: list[str], seeds: list[int]) -> tuple[dict, dict]:
    """(shared inputs, per-run lists controlnet_cond / controlnet_mode / conditioning_scale)."""
    runs = [_inputs(CONTROLNETS[n], seed) for n, seed in zip(names, seeds, strict=True)]
    per_run = {
        "controlnet_cond": [r["controlnet_cond"] for r in runs],
        # diffusers indexes mode[:, None] for every net: a non-union net gets one it ignores
        "controlnet_mode": [
            np.array([1, 3]) if r["controlnet_mode"] is None else r["controlnet_mode"] for r in runs
        ],
        "conditioning_scale": [0.7, 1.3][: len(runs)],
    }
    shared = {k: v for k, v in runs[0].items() if k not in per_run}
    return shared, per_run


@pytest.mark.parametrize(
    "names",
    [["plain", "hint"], ["union", "union"]],
    ids=["two_nets", "one_union_net_two_conditions"],
)
def test_multi_controlnet_matches_diffusers(controlnets, names):
    from diffusers.models.controlnets.controlnet_flux import FluxMultiControlNetModel

    nets = list(dict.fromkeys(names))  # one union net runs once per condition
    shared, per_run = _multi_inputs(names, [7, 8])
    reference = FluxMultiControlNetModel([controlnets[n][0] for n in nets])
    torch_runs = {
        "controlnet_cond": [torch.from_numpy(c) for c in per_run["controlnet_cond"]],
        "controlnet_mode": [torch.from_numpy(m).long() for m in per_run["controlnet_mode"]],
        "conditioning_scale": per_run["conditioning_scale"],
    }
    with torch.no_grad(), _correctly_rounded_exp():
        out = reference(**_torch(shared), **torch_runs, return_dict=False)
    expected = tuple(None if s is None else tuple(t.numpy() for t in s) for s in out)

    multi = fc.MultiFluxControlNet(tuple(controlnets[n][1] for n in nets))
    params = [controlnets[n][2] for n in nets]
    got = jax.jit(lambda p: multi(p, **shared, **per_run))(params)
    _compare(got, expected, "+".join(names))
