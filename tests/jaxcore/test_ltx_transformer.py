"""LTX-Video transformer vs diffusers LTXVideoTransformer3DModel (random-init tiny models, fp32).

Parity tolerance: max abs diff <= 2e-5 on outputs of magnitude ~2-3 (reached: <= 8e-6), for
timesteps per sample and per token, padded caption masks, frame-rate RoPE scaling and the
condition pipeline's video_coords.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxcore import sharding
from jaxcore.models import ltx_transformer as lt

PARITY_ATOL = 2e-5
# A sample with no caption token attended: diffusers adds the bias -10000 to every score, which
# rounds the scores to float32's ulp at 1e4 (~1e-3) before the softmax; ours attends to all
# tokens with the exact scores. Reached 1.4e-4.
FULLY_MASKED_ATOL = 3e-4

# width D = 16: 16 % 6 = 4, so the first two channel pairs are not rotated; 2 RoPE frequencies
TINY = dict(
    in_channels=8,
    out_channels=8,
    num_layers=2,
    num_attention_heads=2,
    attention_head_dim=8,
    cross_attention_dim=16,
    caption_channels=24,
)
# every option at its non-default value: no q/k/v or output biases, affine block norms with
# another eps, erf GELU, out != in channels, 2 x 2 x 2 patches (they scale the RoPE grid);
# D = 24: all pairs rotated, 4 frequencies
OPTIONS = dict(
    in_channels=8,
    out_channels=6,
    patch_size=2,
    patch_size_t=2,
    num_layers=2,
    num_attention_heads=2,
    attention_head_dim=12,
    cross_attention_dim=24,
    caption_channels=20,
    activation_fn="gelu",
    norm_elementwise_affine=True,
    norm_eps=1e-5,
    attention_bias=False,
    attention_out_bias=False,
)
CONFIGS = {"tiny": TINY, "options": OPTIONS}
BATCH, GRID, TEXT_LEN = 2, (3, 5, 6), 7  # token grid F x H x W = 90 tokens
TOKENS = int(np.prod(GRID))


def _build_reference(config: dict, seed: int = 0):
    """A random diffusers model with every parameter perturbed (norm weights are not 1, biases
    not 0, so a mis-mapped parameter changes the output)."""
    from diffusers import LTXVideoTransformer3DModel

    torch.manual_seed(seed)
    model = LTXVideoTransformer3DModel(**config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    """{name: (directory saved with save_pretrained, the diffusers model)}."""
    out = {}
    for name, config in CONFIGS.items():
        directory = tmp_path_factory.mktemp(f"ltx_{name}")
        model = _build_reference(config)
        model.save_pretrained(directory)
        out[name] = (directory, model)
    return out


def _first_frame_timesteps(t: np.ndarray) -> np.ndarray:
    """Per-token timesteps [B, L] as LTXImageToVideoPipeline forms them (t * (1 - mask)): the
    first latent frame is the clean conditioning image (timestep 0)."""
    first_frame = np.zeros(GRID, np.float32)
    first_frame[0] = 1.0
    return (t[:, None] * (1.0 - first_frame.reshape(1, -1))).astype(np.float32)


def _inputs(config: dict, case: str):
    """(diffusers forward kwargs as numpy, static kwargs for ours, traced video_coords or None)."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((BATCH, TOKENS, config["in_channels"]), np.float32)
    text = rng.standard_normal((BATCH, TEXT_LEN, config["caption_channels"]), np.float32)
    t = np.array([999.0, 17.3], np.float32)
    mask = np.ones((BATCH, TEXT_LEN), np.float32)
    mask[0, 5:] = 0.0  # padded caption tokens
    mask[1, 2:] = 0.0
    grid = dict(num_frames=GRID[0], height=GRID[1], width=GRID[2])
    scale = lt.frame_rate_rope_scale(24)  # frame_rate != 25: t scale 1/3
    arrays = dict(
        hidden_states=x, encoder_hidden_states=text, timestep=t, encoder_attention_mask=mask
    )
    static = dict(grid, rope_interpolation_scale=scale)
    if case == "timestep-b1":
        arrays["timestep"] = t[:, None]
    elif case == "timestep-per-token":
        arrays["timestep"] = _first_frame_timesteps(t)
    elif case == "sample-fully-masked":
        mask[1] = 0.0  # diffusers' constant -10000 bias: the sample attends to every token
    elif case == "no-mask-unscaled":
        arrays["encoder_attention_mask"] = None
        static["rope_interpolation_scale"] = None
    elif case.startswith("video-coords"):
        arrays["timestep"] = _first_frame_timesteps(t)
        coords = lt.condition_video_coords(BATCH, *GRID, frame_rate=30)
        static = dict(video_coords=coords)
        if case == "video-coords-traced":
            return arrays, {}, coords
    return arrays, static, None


def _reference(model, arrays: dict, static: dict) -> np.ndarray:
    kwargs = {k: None if v is None else torch.from_numpy(v) for k, v in arrays.items()}
    for k, v in static.items():
        kwargs[k] = torch.from_numpy(v) if isinstance(v, np.ndarray) else v
    with torch.no_grad():
        return model(**kwargs).sample.numpy()


def _ours(module, params, arrays: dict, static: dict, traced_coords) -> np.ndarray:
    if traced_coords is None:
        fn = jax.jit(functools.partial(module.apply, **static))
        return np.asarray(fn({"params": params}, **arrays))
    fn = jax.jit(lambda p, a, c: module.apply(p, **a, video_coords=c))
    return np.asarray(fn({"params": params}, arrays, traced_coords))


CASES = [
    "timestep-per-sample",
    "timestep-b1",
    "timestep-per-token",
    "sample-fully-masked",
    "no-mask-unscaled",
    "video-coords",
    "video-coords-traced",
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_diffusers(checkpoints, name, case):
    """Our loader on diffusers' save_pretrained output, against diffusers' forward: batch 2,
    a 3 x 5 x 6 token grid, captions with padded tokens. Max abs diff <= 2e-5 (reached <= 8e-6
    on outputs up to ~3); traced video_coords (RoPE tables in the graph, coordinates divided
    through a reciprocal on XLA CPU) reach the same."""
    directory, model = checkpoints[name]
    config = CONFIGS[name]
    arrays, static, traced_coords = _inputs(config, case)
    coords = {} if traced_coords is None else {"video_coords": traced_coords}
    expected = _reference(model, arrays, {**static, **coords})

    module, params = lt.load_ltx_transformer(directory)
    got = _ours(module, params, arrays, static, traced_coords)

    assert got.shape == expected.shape == (BATCH, TOKENS, module.config.out_channels)
    atol = FULLY_MASKED_ATOL if case == "sample-fully-masked" else PARITY_ATOL
    np.testing.assert_allclose(got, expected, rtol=0, atol=atol)


def test_scan_layers_and_bf16(checkpoints):
    """scan_layers runs the same blocks (one lax.scan): equal to the unrolled model to float
    rounding (atol 1e-6); bf16 weights and activations stay within bf16 accuracy of float32
    (3% of the output scale)."""
    directory, _ = checkpoints["tiny"]
    arrays, static, _ = _inputs(TINY, "timestep-per-token")
    unrolled, params = lt.load_ltx_transformer(directory)
    scanned, _ = lt.load_ltx_transformer(directory, scan_layers=True)
    full = _ours(unrolled, params, arrays, static, None)
    np.testing.assert_allclose(_ours(scanned, params, arrays, static, None), full, atol=1e-6)

    m16, p16 = lt.load_ltx_transformer(directory, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(p16))
    half = jax.jit(functools.partial(m16.apply, **static))({"params": p16}, **arrays)
    assert half.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(half, np.float32), full, atol=0.03 * np.abs(full).max())


@pytest.mark.parametrize("case", ["timestep-per-sample", "video-coords"])
def test_loads_onto_a_mesh(checkpoints, case):
    """Parameters land on the shardings their logical names ask for, and the model runs there
    (fsdp x context x tensor = 2 x 2 x 2: the RoPE and q/k norms span the width the tensor axis
    splits by heads; per-token timesteps and per-sample coordinate tables are split over the
    context axis) equal to the unsharded model (atol 1e-5)."""
    directory, _ = checkpoints["tiny"]
    mesh = sharding.make_mesh(
        sharding.MeshConfig(
            ici_data_parallelism=1,
            ici_fsdp_parallelism=2,
            ici_context_parallelism=2,
            ici_tensor_parallelism=2,
        )
    )
    module, params = lt.load_ltx_transformer(directory, mesh=mesh)
    q_kernel = params["transformer_blocks_0"]["attn1"]["to_q"]["kernel"]
    assert q_kernel.sharding.spec == jax.sharding.PartitionSpec(("fsdp", "context"), "tensor")
    plain, plain_params = lt.load_ltx_transformer(directory)
    arrays, static, _ = _inputs(TINY, case)
    expected = _ours(plain, plain_params, arrays, static, None)
    with sharding.mesh_context(mesh):
        got = _ours(module, params, arrays, static, None)
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5)


# --- pure helpers ---------------------------------------------------------------------------


@pytest.mark.parametrize("dim", [16, 20, 24, 36, 96])
def test_rope_tables_match_diffusers(dim):
    """Tiny widths: diffusers' float32 tables to one float32 ulp (atol 1.2e-7), for grids with
    and without a scale, patches, and per-token video_coords (host tables); a traced scale or
    traced coords (tables in the graph) to 1e-6."""
    from diffusers.models.transformers.transformer_ltx import LTXVideoRotaryPosEmbed

    cases = [
        ((3, 5, 6), lt.frame_rate_rope_scale(24), (1, 1)),
        ((3, 5, 6), None, (1, 1)),
        ((4, 7, 5), lt.frame_rate_rope_scale(30), (2, 2)),
    ]
    for grid, scale, patch in cases:
        rope = LTXVideoRotaryPosEmbed(dim, patch_size=patch[1], patch_size_t=patch[0])
        cos_ref, sin_ref = rope(torch.zeros(1, 1, dim), *grid, scale)
        cos, sin = lt.rope_cos_sin(dim, grid=grid, rope_interpolation_scale=scale, patch_size=patch)
        # diffusers repeats each angle for the two members of a pair
        np.testing.assert_allclose(cos, cos_ref[0, :, 0::2].numpy(), rtol=0, atol=1.2e-7)
        np.testing.assert_allclose(sin, sin_ref[0, :, 0::2].numpy(), rtol=0, atol=1.2e-7)
        if scale is not None:  # a traced scale (e.g. the frame rate under jit): in the graph
            traced = jax.jit(
                lambda s, grid=grid, patch=patch: lt.rope_cos_sin(
                    dim, grid=grid, rope_interpolation_scale=s, patch_size=patch
                )
            )(scale)
            np.testing.assert_allclose(traced[0], cos, rtol=0, atol=1e-6)
            np.testing.assert_allclose(traced[1], sin, rtol=0, atol=1e-6)

    coords = lt.condition_video_coords(2, 4, 3, 5, frame_rate=24, frame_index=3)
    rope = LTXVideoRotaryPosEmbed(dim)
    cos_ref, sin_ref = (
        t[..., 0::2].numpy()
        for t in rope(torch.zeros(2, 1, dim), video_coords=torch.tensor(coords))
    )
    cos, sin = lt.rope_cos_sin(dim, video_coords=coords)
    np.testing.assert_allclose(cos, cos_ref, rtol=0, atol=1.2e-7)
    np.testing.assert_allclose(sin, sin_ref, rtol=0, atol=1.2e-7)
    cos, sin = jax.jit(lambda c: lt.rope_cos_sin(dim, video_coords=c))(coords)
    np.testing.assert_allclose(cos, cos_ref, rtol=0, atol=1e-6)
    np.testing.assert_allclose(sin, sin_ref, rtol=0, atol=1e-6)


def test_rope_tables_real_widths_close_to_diffusers():
    """The 2B (D = 2048) and 13B (D = 4096) widths on a 768 x 512, 121-frame latent grid at 24
    fps: torch's CPU pow rounds a few of the 341 / 682 frequencies the other way (1 ulp of up to
    1.6e4), which moves those pairs' angles by up to ~1e-3 rad. atol 5e-4 (reached 2.4e-4)."""
    from diffusers.models.transformers.transformer_ltx import LTXVideoRotaryPosEmbed

    grid, scale = (16, 16, 24), lt.frame_rate_rope_scale(24)
    for dim in (2048, 4096):
        cos_ref, sin_ref = LTXVideoRotaryPosEmbed(dim)(torch.zeros(1, 1, dim), *grid, scale)
        cos, sin = lt.rope_cos_sin(dim, grid=grid, rope_interpolation_scale=scale)
        np.testing.assert_allclose(cos, cos_ref[0, :, 0::2].numpy(), rtol=0, atol=5e-4)
        np.testing.assert_allclose(sin, sin_ref[0, :, 0::2].numpy(), rtol=0, atol=5e-4)


def test_latent_layout_helpers_match_the_pipelines():
    """pack / unpack (= LTXPipeline._pack_latents / _unpack_latents, patch sizes 1 and 2),
    frame_rate_rope_scale and condition_video_coords (= LTXConditionPipeline's ids, scaled, then
    the frame coordinate over the frame rate), exactly."""
    from diffusers import LTXConditionPipeline, LTXPipeline

    latents = np.random.default_rng(0).standard_normal((2, 3, 4, 6, 8), np.float32)
    for p, pt in ((1, 1), (2, 2), (2, 1)):
        want = LTXPipeline._pack_latents(torch.from_numpy(latents), p, pt).numpy()
        packed = lt.pack_latents(jnp.asarray(latents), p, pt)
        np.testing.assert_array_equal(packed, want)
        grid = (4 // pt, 6 // p, 8 // p)
        back = LTXPipeline._unpack_latents(torch.from_numpy(want), *grid, p, pt).numpy()
        np.testing.assert_array_equal(lt.unpack_latents(packed, *grid, p, pt), back)
        np.testing.assert_array_equal(back, latents)

    assert lt.frame_rate_rope_scale(24) == (8 / 24, 32, 32)
    ids = LTXConditionPipeline._prepare_video_ids(2, 4, 3, 5)
    coords = LTXConditionPipeline._scale_video_ids(ids, 32, 8, frame_index=3).float()
    coords[:, 0] = coords[:, 0] * (1.0 / 24)
    got = lt.condition_video_coords(2, 4, 3, 5, frame_rate=24, frame_index=3)
    np.testing.assert_array_equal(got, coords.numpy())


# --- parameters and config ------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CONFIGS))
def test_parameter_count_and_keys_match_diffusers(name):
    """Our abstract parameters count as many elements as diffusers' model, and the weight map
    names each of its state_dict keys exactly once."""
    from diffusers import LTXVideoTransformer3DModel

    with torch.device("meta"):
        model = LTXVideoTransformer3DModel(**CONFIGS[name])
    config = lt.LTXVideoTransformerConfig.from_dict(CONFIGS[name])
    assert lt.count_params(config) == sum(p.numel() for p in model.parameters())
    keys = [key for key, _ in lt.weight_map(config).values()]
    assert sorted(keys) == sorted(model.state_dict())


def test_config_from_diffusers_json(checkpoints):
    directory, _ = checkpoints["options"]
    config = lt.LTXVideoTransformerConfig.from_dict(
        json.loads((Path(directory) / "config.json").read_text())
    )
    assert (config.hidden_dim, config.out_channels, config.patch_size) == (24, 6, 2)
    assert not config.attention_bias and config.norm_elementwise_affine
    assert lt.LTXVideoTransformerConfig.from_dict(config.to_dict()) == config
    assert lt.LTXVideoTransformerConfig.from_dict({"out_channels": None}).out_channels == 128


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_heads": 4}, "num_heads"),  # not a key of the config
        ({"qk_norm": "rms_norm"}, "qk_norm"),
        ({"activation_fn": "geglu"}, "activation_fn"),
        ({"cross_attention_dim": 32}, "cross_attention_dim"),
        ({"norm_eps": 0.0}, "norm_eps"),
        ({"patch_size": 0}, "patch_size"),
    ],
)
def test_bad_config_names_the_key(change, message):
    with pytest.raises(lt.LTXConfigError, match=message):
        lt.LTXVideoTransformerConfig.from_dict({**TINY, **change})


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"timestep": np.zeros((BATCH, 5), np.float32)}, "timestep"),
        ({"encoder_attention_mask": np.ones((BATCH, 1, TEXT_LEN), np.float32)}, "mask"),
        ({"num_frames": 4}, "num_frames x height x width"),
        ({"num_frames": None}, "num_frames, height and width"),
        ({"video_coords": np.zeros((BATCH, 3, TOKENS), np.float32)}, "rope_interpolation_scale"),
        ({"hidden_states": np.zeros((BATCH, TOKENS, 4), np.float32)}, "hidden_states"),
    ],
)
def test_bad_inputs_name_the_argument(checkpoints, change, message):
    directory, _ = checkpoints["tiny"]
    module, params = lt.load_ltx_transformer(directory)
    arrays, static, _ = _inputs(TINY, "timestep-per-sample")
    kwargs = {**arrays, **static, **change}
    with pytest.raises(ValueError, match=message):
        module.apply({"params": params}, **kwargs)
