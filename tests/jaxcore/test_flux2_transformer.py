"""Flux.2 transformer vs diffusers Flux2Transformer2DModel (perturbed random-init tiny models, fp32).

Parity tolerance: max abs diff <= 1e-5 x max |reference| (outputs, and the cached reference keys
/ values), with position ids built by diffusers' own Flux.2 pipeline helpers on odd, non-square
latent grids. The reference runs with a correctly rounded float32 ``torch.exp`` (see
tests/jaxcore/test_flux_transformer.py: torch's CPU expf is one ulp off at a few timestep
frequencies, a platform artifact amplified by the x1000 timestep scale).

KV cache: diffusers' Klein KV path (``Flux2KV*AttnProcessor``, ``kv_cache_mode="extract"`` then
``"cached"``) against ours (``reference_tokens=`` in one call, :meth:`reference_kv` once and
``reference_kv=`` every step), and ours cached against ours uncached.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import numpy as np
import pytest
import torch
from flax import linen as nn

from jaxcore import weights
from jaxcore.models import flux2_transformer as f2
from tests.jaxcore.test_flux_transformer import _correctly_rounded_exp

REL_TOL = 1e-5

# Released transformer configs (diffusers config.json keys; the rest are diffusers' defaults).
# FLUX.2 dev = diffusers' Flux2Transformer2DModel defaults (its docstring; its single-file
# loader maps "flux-2-dev" to black-forest-labs/FLUX.2-dev with this class), guidance-distilled.
FLUX2_DEV: dict = {"guidance_embeds": True}
# FLUX.2 Klein 4B / 9B: black-forest-labs/FLUX.2-klein-{4B,9B} transformer/config.json as
# reproduced in public code found through the reference corpus (VincentGourbin/flux-2-swift-mlx
# Sources/Flux2Core/Configuration/Flux2Config.swift; 9B also as a full embedded config.json in
# a piFlow-style loader and DiffSynth's model_configs.py): Qwen3 text features of 3 layers
# (3 x 2560 / 3 x 4096), no guidance embedder.
KLEIN_4B = {
    "num_layers": 5,
    "num_single_layers": 20,
    "num_attention_heads": 24,
    "joint_attention_dim": 7680,
    "guidance_embeds": False,
}
KLEIN_9B = {
    "num_layers": 8,
    "num_single_layers": 24,
    "num_attention_heads": 32,
    "joint_attention_dim": 12288,
    "guidance_embeds": False,
}

# diffusers' counts on the meta device (the "4B" / "9B" / "32B" of the names)
RELEASED_COUNTS = {"klein-4b": 3_875_544_576, "klein-9b": 9_078_581_248, "dev": 32_223_281_152}

# Klein-like: no guidance embedder, 2 + 2 blocks
TINY_KLEIN = dict(
    in_channels=16,
    num_layers=2,
    num_single_layers=2,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=24,
    timestep_guidance_channels=32,
    axes_dims_rope=(4, 4, 4, 4),
    guidance_embeds=False,
)
# dev-like and odd: guidance embedder, 3 heads of 8, mlp_ratio 2.5, out_channels != in_channels,
# eps 1e-5, patch_size 2 (proj_out emits 4 * out_channels), another rope theta
TINY_DEV = dict(
    patch_size=2,
    in_channels=12,
    out_channels=6,
    num_layers=1,
    num_single_layers=2,
    attention_head_dim=8,
    num_attention_heads=3,
    joint_attention_dim=20,
    timestep_guidance_channels=16,
    mlp_ratio=2.5,
    axes_dims_rope=(2, 2, 2, 2),
    rope_theta=500,
    eps=1e-5,
    guidance_embeds=True,
)
# name: (config, batch, latent height, latent width, text length)
CASES = {"klein": (TINY_KLEIN, 2, 3, 5, 7), "dev": (TINY_DEV, 2, 5, 3, 4)}


def _save_reference(directory: Path, config: dict, seed: int = 0):
    """A random diffusers model with every parameter perturbed (norm weights are not 1), saved."""
    from diffusers import Flux2Transformer2DModel

    torch.manual_seed(seed)
    model = Flux2Transformer2DModel(**config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(directory)
    return model


def _pipeline_ids(batch: int, channels: int, height: int, width: int, text_len: int, refs=()):
    """(img_ids [B, H*W, 4], txt_ids [B, T, 4], ref_ids [1, R, 4] | None) from diffusers'
    Flux2KleinKVPipeline helpers; ``refs`` are the reference latents' (height, width)."""
    from diffusers.pipelines.flux2.pipeline_flux2_klein_kv import Flux2KleinKVPipeline as P

    img = P._prepare_latent_ids(torch.zeros(batch, channels, height, width)).float().numpy()
    txt = P._prepare_text_ids(torch.zeros(batch, text_len, 1)).float().numpy()
    ref = None
    if refs:
        latents = [torch.zeros(1, channels, h, w) for h, w in refs]
        ref = P._prepare_image_ids(latents).float().numpy()
    return img, txt, ref


def _inputs(config: dict, batch: int, height: int, width: int, text_len: int) -> dict:
    """Pipeline-shaped inputs with distinct per-sample timesteps (and guidance if needed)."""
    rng = np.random.default_rng(1)
    img_ids, txt_ids, _ = _pipeline_ids(batch, 1, height, width, text_len)
    return dict(
        hidden_states=rng.standard_normal(
            (batch, height * width, config["in_channels"]), np.float32
        ),
        encoder_hidden_states=rng.standard_normal(
            (batch, text_len, config["joint_attention_dim"]), np.float32
        ),
        timestep=np.array([0.93, 0.21, 0.5][:batch], np.float32),
        img_ids=img_ids,
        txt_ids=txt_ids,
        guidance=np.array([4.0, 2.5, 1.0][:batch], np.float32)
        if config["guidance_embeds"]
        else None,
    )


def _torch_call(model, **kwargs):
    """The diffusers model on numpy inputs, as a tuple (``return_dict=False``)."""
    args = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in kwargs.items()}
    with torch.no_grad(), _correctly_rounded_exp():
        return model(**args, return_dict=False)


def _rel_diff(ours, expected) -> float:
    """max |ours - expected| / max |expected|."""
    ours, expected = np.asarray(ours, np.float64), np.asarray(expected, np.float64)
    assert ours.shape == expected.shape
    return float(np.max(np.abs(ours - expected)) / np.max(np.abs(expected)))


def _apply(module, params, inputs: dict, ids: str = "traced", **extra):
    """Jitted forward; ids "traced" are jit arguments, "host" closed over as numpy."""
    if ids == "traced":
        return jax.jit(functools.partial(module.apply, **extra))({"params": params}, **inputs)
    rest = {k: v for k, v in inputs.items() if k not in ("img_ids", "txt_ids")}
    ids_kw = dict(img_ids=inputs["img_ids"], txt_ids=inputs["txt_ids"])
    return jax.jit(functools.partial(module.apply, **ids_kw, **extra))({"params": params}, **rest)


# --- parity ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_diffusers(tmp_path, name):
    config, batch, height, width, text_len = CASES[name]
    reference = _save_reference(tmp_path, config)
    inputs = _inputs(config, batch, height, width, text_len)
    (expected,) = _torch_call(reference, **{k: v for k, v in inputs.items() if v is not None})

    module, params = f2.load_flux2_transformer(tmp_path)
    cfg = module.config
    assert expected.shape == (batch, height * width, cfg.proj_out_dim)
    for ids in ("host", "traced"):
        assert _rel_diff(_apply(module, params, inputs, ids), expected) <= REL_TOL, ids


@pytest.fixture(scope="module")
def klein(tmp_path_factory):
    """(diffusers model, our module, our params) of TINY_KLEIN, shared by the KV tests."""
    directory = tmp_path_factory.mktemp("flux2_klein")
    reference = _save_reference(directory, TINY_KLEIN)
    module, params = f2.load_flux2_transformer(directory)
    return reference, module, params


def _kv_inputs(batch: int = 2, height: int = 3, width: int = 5, text_len: int = 6):
    """Klein KV pipeline inputs: latents, text, and two reference images (2x3 and 3x3 latents)
    packed and id'd as prepare_image_latents does (t = 10, 20), one reference set per batch."""
    rng = np.random.default_rng(2)
    channels = TINY_KLEIN["in_channels"]
    img_ids, txt_ids, ref_ids = _pipeline_ids(batch, 1, height, width, text_len, [(2, 3), (3, 3)])
    refs = rng.standard_normal((1, ref_ids.shape[1], channels), np.float32)
    return dict(
        latents=rng.standard_normal((batch, height * width, channels), np.float32),
        text=rng.standard_normal((batch, text_len, TINY_KLEIN["joint_attention_dim"]), np.float32),
        img_ids=img_ids,
        txt_ids=txt_ids,
        refs=refs,
        ref_ids=ref_ids,
    )


def test_plain_reference_concatenation_matches_diffusers(klein):
    """Flux2KleinPipeline (non-KV): reference tokens appended to the latents, full attention."""
    reference, module, params = klein
    kv = _kv_inputs()
    batch = kv["latents"].shape[0]
    refs = np.repeat(kv["refs"], batch, axis=0)
    inputs = dict(
        hidden_states=np.concatenate([kv["latents"], refs], axis=1),
        encoder_hidden_states=kv["text"],
        timestep=np.array([0.7, 0.3], np.float32),
        img_ids=np.concatenate([kv["img_ids"], np.repeat(kv["ref_ids"], batch, 0)], axis=1),
        txt_ids=kv["txt_ids"],
    )
    (expected,) = _torch_call(reference, **inputs)
    assert _rel_diff(_apply(module, params, inputs, "host"), expected) <= REL_TOL


def _diffusers_kv_steps(reference, kv: dict, timesteps):
    """diffusers' Klein KV steps: extract at timesteps[0] (-> output, cache), then cached."""
    from diffusers.models.transformers.transformer_flux2 import (
        Flux2KVAttnProcessor,
        Flux2KVParallelSelfAttnProcessor,
    )

    for block in reference.transformer_blocks:  # as Flux2KleinKVPipeline._set_kv_attn_processors
        block.attn.set_processor(Flux2KVAttnProcessor())
    for block in reference.single_transformer_blocks:
        block.attn.set_processor(Flux2KVParallelSelfAttnProcessor())
    batch = kv["latents"].shape[0]
    refs = np.repeat(kv["refs"], batch, axis=0)
    common = dict(encoder_hidden_states=kv["text"], txt_ids=kv["txt_ids"])
    first, cache = _torch_call(
        reference,
        hidden_states=np.concatenate([refs, kv["latents"]], axis=1),
        img_ids=np.concatenate([np.repeat(kv["ref_ids"], batch, 0), kv["img_ids"]], axis=1),
        timestep=np.full(batch, timesteps[0], np.float32),
        kv_cache_mode="extract",
        num_ref_tokens=refs.shape[1],
        **common,
    )
    (later,) = _torch_call(
        reference,
        hidden_states=kv["latents"],
        img_ids=kv["img_ids"],
        timestep=np.full(batch, timesteps[1], np.float32),
        kv_cache=cache,
        kv_cache_mode="cached",
        **common,
    )
    return first.numpy(), cache, later.numpy()


def test_kv_cache_matches_diffusers_and_the_uncached_call(klein):
    """Cache entries, the extract step and a cached step equal diffusers'; cached = uncached."""
    reference, module, params = klein
    kv = _kv_inputs()
    timesteps = (0.9, 0.4)
    first, cache, later = _diffusers_kv_steps(reference, kv, timesteps)
    batch = kv["latents"].shape[0]
    apply = jax.jit(module.apply)

    # the cache, once, for one reference set (broadcast over the batch)
    ours_kv = jax.jit(functools.partial(module.apply, method="reference_kv"))(
        {"params": params}, kv["refs"], kv["ref_ids"]
    )
    torch_layers = [*cache.double_block_caches, *cache.single_block_caches]
    for (k, v), layer in zip((*ours_kv.double, *ours_kv.single), torch_layers, strict=True):
        assert _rel_diff(np.repeat(k, batch, 0), layer.k_ref.numpy()) <= REL_TOL
        assert _rel_diff(np.repeat(v, batch, 0), layer.v_ref.numpy()) <= REL_TOL

    def step(t, **extra):
        timestep = np.full(batch, t, np.float32)
        return apply(
            {"params": params},
            kv["latents"],
            kv["text"],
            timestep,
            kv["img_ids"],
            kv["txt_ids"],
            **extra,
        )

    uncached = [
        step(t, reference_tokens=kv["refs"], reference_ids=kv["ref_ids"]) for t in timesteps
    ]
    cached = [step(t, reference_kv=ours_kv) for t in timesteps]
    assert _rel_diff(uncached[0], first) <= REL_TOL  # diffusers' extract step
    assert _rel_diff(cached[1], later) <= REL_TOL  # diffusers' cached step
    for a, b in zip(cached, uncached, strict=True):
        assert _rel_diff(a, b) <= REL_TOL
    # the cache is not the plain concatenation: reference tokens attend to themselves only
    plain = _apply(
        module,
        params,
        dict(
            hidden_states=np.concatenate([kv["latents"], np.repeat(kv["refs"], batch, 0)], 1),
            encoder_hidden_states=kv["text"],
            timestep=np.full(batch, timesteps[1], np.float32),
            img_ids=np.concatenate([kv["img_ids"], np.repeat(kv["ref_ids"], batch, 0)], 1),
            txt_ids=kv["txt_ids"],
        ),
    )[:, : kv["latents"].shape[1]]
    assert _rel_diff(plain, cached[1]) > 1e-3


def test_scan_and_remat_equal_the_plain_loop(klein):
    """scan_layers (one lax.scan per block kind) and a remat policy: same output and gradient."""
    _, module, params = klein
    inputs = _inputs(TINY_KLEIN, 2, 3, 5, 4)
    config = module.config

    def loss(variant, p):
        return variant.apply({"params": p}, **inputs).sum()

    plain_value, plain_grad = jax.jit(jax.value_and_grad(functools.partial(loss, module)))(params)
    variant = f2.Flux2Transformer(config, remat_policy="full", scan_layers=True)
    value, grad = jax.jit(jax.value_and_grad(functools.partial(loss, variant)))(params)
    assert abs(float(value - plain_value)) <= 1e-5 * abs(float(plain_value))
    for a, b in zip(jax.tree.leaves(grad), jax.tree.leaves(plain_grad), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * float(np.abs(b).max()))


# --- weights, configs, counts ---------------------------------------------------------------


@pytest.mark.parametrize("config", [TINY_KLEIN, TINY_DEV], ids=["klein", "dev"])
def test_weight_map_covers_every_parameter(config):
    cfg = f2.Flux2TransformerConfig.from_dict(config)
    abstract = nn.meta.unbox(f2.abstract_params(f2.Flux2Transformer(cfg)))
    assert set(weights._flatten(abstract)) == set(f2.weight_map(cfg))


def test_export_round_trips_the_checkpoint(tmp_path):
    _save_reference(tmp_path, TINY_DEV)
    module, params = f2.load_flux2_transformer(tmp_path)
    exported = weights.export_state_dict(params, f2.weight_map(module.config))
    original = weights.SafetensorsReader(tmp_path).as_dict()
    assert set(exported) == set(original)
    for key, value in original.items():
        np.testing.assert_array_equal(exported[key], value, err_msg=key)


def test_config_keys_are_checked_by_name():
    from diffusers import Flux2Transformer2DModel

    saved = dict(Flux2Transformer2DModel(**TINY_KLEIN).config)  # every __init__ key, as saved
    cfg = f2.Flux2TransformerConfig.from_dict(saved)
    assert cfg.out_channels == TINY_KLEIN["in_channels"] and cfg.mlp_dim == 96
    with pytest.raises(f2.Flux2ConfigError, match="pooled_projection_dim"):
        f2.Flux2TransformerConfig.from_dict({**saved, "pooled_projection_dim": 768})
    with pytest.raises(f2.Flux2ConfigError, match="axes_dims_rope"):
        f2.Flux2TransformerConfig.from_dict({**saved, "axes_dims_rope": [4, 4, 4, 2]})


@pytest.mark.parametrize(
    ("name", "config"), [("klein-4b", KLEIN_4B), ("klein-9b", KLEIN_9B), ("dev", FLUX2_DEV)]
)
def test_released_param_counts(name, config):
    """count_params (eval_shape, nothing allocated) = diffusers on the meta device."""
    from diffusers import Flux2Transformer2DModel

    with torch.device("meta"):
        reference = Flux2Transformer2DModel(**config)
    meta_count = sum(p.numel() for p in reference.parameters())
    ours = f2.count_params(f2.Flux2TransformerConfig.from_dict(config))
    assert ours == meta_count == RELEASED_COUNTS[name]


def test_bad_inputs_are_named():
    cfg = f2.Flux2TransformerConfig.from_dict(TINY_DEV)
    module = f2.Flux2Transformer(cfg)
    params = nn.meta.unbox(f2.abstract_params(module))
    good = _inputs(TINY_DEV, 2, 3, 3, 4)

    def run(**changes):  # shape checks fire while tracing; nothing is computed
        return jax.eval_shape(
            functools.partial(module.apply, **{**good, **changes}), {"params": params}
        )

    assert run().shape == (2, 9, 24)
    cases = [
        ({"hidden_states": good["hidden_states"][..., :8]}, "hidden_states"),
        ({"encoder_hidden_states": good["encoder_hidden_states"][:1]}, "encoder_hidden_states"),
        ({"timestep": good["timestep"][:1]}, "timestep"),
        ({"img_ids": good["img_ids"][..., :3]}, r"img_ids must be \[9, >= 4\]"),
        ({"txt_ids": good["txt_ids"][:, :2]}, r"txt_ids must be \[4, >= 4\]"),
        ({"guidance": None}, "guidance is required"),
        ({"guidance": good["guidance"][:1]}, "guidance must be"),
    ]
    for changes, message in cases:
        with pytest.raises(ValueError, match=message):
            run(**changes)
    klein = f2.Flux2Transformer(f2.Flux2TransformerConfig.from_dict(TINY_KLEIN))
    inputs = {**_inputs(TINY_KLEIN, 1, 3, 3, 2), "guidance": np.ones(1, np.float32)}
    with pytest.raises(ValueError, match="guidance_embeds=False"):
        jax.eval_shape(
            functools.partial(klein.apply, **inputs),
            {"params": nn.meta.unbox(f2.abstract_params(klein))},
        )
