"""LTX-2 audio-video transformer vs diffusers LTX2VideoTransformer3DModel (random-init tiny
models with every parameter perturbed, fp32).

Parity: both outputs within 1e-5 of their largest magnitude (max abs diff / max |diffusers|;
reached <= 2.8e-6 over every case, max abs diff 8.2e-6 on outputs of magnitude 1-3),
for every forward variant the LTX-2 pipelines use: per-sample and per-token timesteps, a separate
audio timestep, ``use_cross_timestep``, ``isolate_modalities`` (modality guidance), STG blocks
with and without a perturbation mask, coordinates given (numpy and traced) or built from the
grid, padded caption masks.
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

from jaxcore.models import ltx2_transformer as l2

RELATIVE_TOLERANCE = 1e-5

# video D = 2 x 8 = 16 (RoPE: 2 frequencies per axis, the first 2 pairs unrotated), audio
# Da = 3 x 4 = 12: different head counts, so the split layout's chunks differ per side
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
# LTX-2.0 as released: split RoPE; with the other options at non-defaults and STG switchable
SPLIT_OPTIONS = dict(
    TINY,
    num_layers=3,
    rope_type="split",
    norm_elementwise_affine=True,
    norm_eps=1e-5,
    activation_fn="gelu",
    attention_bias=False,
    attention_out_bias=False,
    ff_bias=False,
    perturbed_attn=True,
    pos_embed_max_pos=16,
    audio_pos_embed_max_pos=24,
    base_height=1024,
    base_width=1536,
)
# LTX-2.3: gated attention, prompt modulation from sigma, captions already at the model widths
LTX23 = dict(
    TINY,
    num_layers=3,
    rope_type="split",
    gated_attn=True,
    audio_gated_attn=True,
    cross_attn_mod=True,
    audio_cross_attn_mod=True,
    use_prompt_embeddings=False,
    perturbed_attn=True,
    ff_bias=False,
)
# LTX-2.5-like mixtures: one side modulated, static prompt tables, keyframe embedding, a
# cross-modal gate timestep scale of 1/2
MIXED = dict(
    TINY,
    cross_attn_mod=True,
    audio_gated_attn=True,
    use_prompt_adaln_single=False,
    use_keyframes_abs_pos_embedding=True,
    cross_attn_timestep_scale_multiplier=500,
    audio_ff_bias=False,
)
CONFIGS = {"tiny": TINY, "split_options": SPLIT_OPTIONS, "ltx23": LTX23, "mixed": MIXED}

BATCH, GRID, AUDIO_FRAMES, FPS = 2, (3, 4, 5), 7, 24000 / 1001  # odd frames, H != W
VIDEO_TOKENS = int(np.prod(GRID))
TEXT_LEN, AUDIO_TEXT_LEN = 6, 5


def _build_reference(config: dict, seed: int = 0):
    """A random diffusers model with every parameter perturbed (norm weights not 1, biases not
    0, tables not as initialised), so a mis-mapped parameter changes the output."""
    from diffusers import LTX2VideoTransformer3DModel

    torch.manual_seed(seed)
    model = LTX2VideoTransformer3DModel(**config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    """{name: (directory saved with save_pretrained, the diffusers model)}."""
    out = {}
    for name, config in CONFIGS.items():
        directory = tmp_path_factory.mktemp(f"ltx2_{name}")
        model = _build_reference(config)
        model.save_pretrained(directory)
        out[name] = (directory, model)
    return out


def _text_widths(config: dict) -> tuple[int, int]:
    if config.get("use_prompt_embeddings", True):
        return config["caption_channels"], config["caption_channels"]
    return config["cross_attention_dim"], config["audio_cross_attention_dim"]


def _inputs(config: dict, case: str):
    """(arrays: the forward's array inputs as numpy, static: Python-valued inputs, traced:
    names of arrays to pass traced under jit)."""
    rng = np.random.default_rng(1)
    text_width, audio_text_width = _text_widths(config)
    mask = np.ones((BATCH, TEXT_LEN), np.float32)
    mask[0, 4:] = 0.0  # padded caption tokens
    mask[1, 2:] = 0.0
    audio_mask = np.ones((BATCH, AUDIO_TEXT_LEN), np.float32)
    audio_mask[1, 3:] = 0.0
    t = np.array([937.5, 250.0], np.float32)
    arrays = dict(
        hidden_states=rng.standard_normal((BATCH, VIDEO_TOKENS, config["in_channels"]), np.float32),
        audio_hidden_states=rng.standard_normal(
            (BATCH, AUDIO_FRAMES, config["audio_in_channels"]), np.float32
        ),
        encoder_hidden_states=rng.standard_normal((BATCH, TEXT_LEN, text_width), np.float32),
        audio_encoder_hidden_states=rng.standard_normal(
            (BATCH, AUDIO_TEXT_LEN, audio_text_width), np.float32
        ),
        timestep=t,
        sigma=t,  # as LTX2Pipeline passes it
        encoder_attention_mask=mask,
        audio_encoder_attention_mask=audio_mask,
        video_coords=l2.video_coords(BATCH, *GRID, FPS),
        audio_coords=l2.audio_coords(BATCH, AUDIO_FRAMES),
    )
    static: dict = {}
    traced: tuple[str, ...] = ()
    if case == "cross-timestep":
        arrays["sigma"] = np.array([600.0, 80.0], np.float32)
        arrays["audio_sigma"] = np.array([410.0, 990.0], np.float32)
        static["use_cross_timestep"] = True
    elif case == "per-token-timestep":  # LTX2ImageToVideoPipeline: first frame clean
        first_frame = np.zeros(GRID, np.float32)
        first_frame[0] = 1.0
        arrays["timestep"] = (t[:, None] * (1 - first_frame.reshape(1, -1))).astype(np.float32)
        arrays["audio_timestep"] = t
    elif case == "isolate-modalities":
        static["isolate_modalities"] = True
    elif case == "stg":
        static["spatio_temporal_guidance_blocks"] = [1]
    elif case == "stg-mask":
        static["spatio_temporal_guidance_blocks"] = [0, 1]
        arrays["perturbation_mask"] = np.array([1.0, 0.0], np.float32)
    elif case == "grid-positions":
        del arrays["video_coords"], arrays["audio_coords"]
        static |= dict(num_frames=GRID[0], height=GRID[1], width=GRID[2], fps=FPS)
        static["audio_num_frames"] = AUDIO_FRAMES
    elif case == "traced-positions":
        traced = ("video_coords", "audio_coords")
    elif case == "no-masks":
        arrays["encoder_attention_mask"] = arrays["audio_encoder_attention_mask"] = None
    if config.get("use_keyframes_abs_pos_embedding"):
        keyframes = np.zeros((BATCH, VIDEO_TOKENS, 1), np.float32)
        keyframes[:, : GRID[1] * GRID[2]] = 1.0  # the first latent frame's tokens
        arrays["video_keyframes_mask"] = keyframes
    return arrays, static, traced


def _reference(model, arrays: dict, static: dict):
    kwargs = {k: None if v is None else torch.from_numpy(v) for k, v in arrays.items()}
    with torch.no_grad():
        video, audio = model(**kwargs, **static, return_dict=False)
    return video.numpy(), audio.numpy()


def _ours(module, params, arrays: dict, static: dict, traced: tuple[str, ...] = ()):
    closed = {k: v for k, v in arrays.items() if k not in traced}
    fn = functools.partial(module.apply, **static, **closed)
    passed = {k: arrays[k] for k in traced}
    video, audio = jax.jit(lambda p, a: fn(p, **a))({"params": params}, passed)
    return np.asarray(video), np.asarray(audio)


def _relative_error(got: np.ndarray, expected: np.ndarray) -> float:
    assert got.shape == expected.shape
    return float(np.abs(got - expected).max() / np.abs(expected).max())


def _assert_close(got, expected) -> None:
    for name, g, e in zip(("video", "audio"), got, expected, strict=True):
        error = _relative_error(g, e)
        assert error <= RELATIVE_TOLERANCE, f"{name}: max abs diff / max |ref| = {error:.2e}"


# Every variant on the plain config; on the others the variants their options change (each
# case compiles a forward: the list is what the options need, not the cross product)
CASES = {
    "tiny": [
        "plain",
        "cross-timestep",
        "per-token-timestep",
        "isolate-modalities",
        "stg",  # no perturbed_attn: diffusers ignores the STG blocks, and so do we
        "grid-positions",
        "traced-positions",
        "no-masks",
    ],
    "split_options": ["plain", "stg", "stg-mask", "isolate-modalities", "traced-positions"],
    "ltx23": ["plain", "cross-timestep", "per-token-timestep", "stg-mask"],
    "mixed": ["plain", "cross-timestep", "grid-positions"],
}
# variants that must move both outputs away from the plain forward's (diffusers' own outputs
# compared, so a switch that silently does nothing is caught)
CHANGES_OUTPUT = {
    "split_options": {"stg", "stg-mask", "isolate-modalities"},
    "ltx23": {"cross-timestep", "per-token-timestep", "stg-mask"},
    "mixed": {"cross-timestep"},
    "tiny": {"cross-timestep", "per-token-timestep", "isolate-modalities"},
}


@pytest.fixture(scope="module")
def loaded(checkpoints) -> dict:
    """{name: (module, params)} loaded with our loader from diffusers' save_pretrained folder."""
    return {
        name: l2.load_ltx2_transformer(directory) for name, (directory, _) in checkpoints.items()
    }


@pytest.mark.parametrize(
    ("name", "case"), [(name, case) for name, cases in CASES.items() for case in cases]
)
def test_matches_diffusers(checkpoints, loaded, name, case):
    """Our loader on diffusers' save_pretrained output, against diffusers' forward: batch 2, a
    3 x 4 x 5 latent grid at 23.976 fps, 7 audio frames, padded captions of two lengths. Both
    outputs within 1e-5 of their scale (reached 2.8e-6: max abs diff 8.2e-6 on outputs of
    magnitude 1-3)."""
    _, model = checkpoints[name]
    arrays, static, traced = _inputs(CONFIGS[name], case)
    expected = _reference(model, arrays, static)
    module, params = loaded[name]
    _assert_close(_ours(module, params, arrays, static, traced), expected)
    if case in CHANGES_OUTPUT.get(name, ()):
        plain = _reference(model, *_inputs(CONFIGS[name], "plain")[:2])
        for p, e in zip(plain, expected, strict=True):
            assert _relative_error(e, p) > 1e-3, f"{case} does not change the output"
    if name == "tiny" and case == "stg":  # perturbed_attn off: STG blocks change nothing
        plain = _reference(model, *_inputs(TINY, "plain")[:2])
        for p, e in zip(plain, expected, strict=True):
            np.testing.assert_array_equal(e, p)


def test_scan_and_remat_equal_the_loop(checkpoints):
    """scan_layers (runs of like blocks as one lax.scan: blocks 0-1 scanned, the STG block 2
    alone) under a full remat policy computes the same outputs as the plain loop (atol 1e-6)."""
    directory, _ = checkpoints["split_options"]
    arrays, static, _ = _inputs(SPLIT_OPTIONS, "stg-mask")
    static["spatio_temporal_guidance_blocks"] = [2]
    loop, params = l2.load_ltx2_transformer(directory)
    scanned, _ = l2.load_ltx2_transformer(directory, scan_layers=True, remat_policy="full")
    expected = _ours(loop, params, arrays, static)
    for g, e in zip(_ours(scanned, params, arrays, static), expected, strict=True):
        np.testing.assert_allclose(g, e, rtol=0, atol=1e-6)


@pytest.mark.parametrize("scan_layers", [False, True])
def test_layer_perturbation_equals_diffusers_stg_blocks(checkpoints, scan_layers):
    """``layer_perturbation`` (per row and block, traced) against diffusers' static STG blocks:
    row 0 perturbed at block 1 (diffusers' blocks [1] with perturbation_mask [0, 1]), row 1 at
    none, within 1e-5 as the other variants, looped and scanned; and a row of 0 at blocks
    {0, 2} equals diffusers' blocks [0, 2] (every row perturbed)."""
    directory, model = checkpoints["split_options"]
    arrays, _, _ = _inputs(SPLIT_OPTIONS, "plain")
    layers = SPLIT_OPTIONS["num_layers"]
    module, params = l2.load_ltx2_transformer(directory, scan_layers=scan_layers)
    weights = np.ones((BATCH, layers), np.float32)
    weights[0, 1] = 0.0
    expected = _reference(
        model,
        dict(arrays, perturbation_mask=np.array([0.0, 1.0], np.float32)),
        {"spatio_temporal_guidance_blocks": [1]},
    )
    got = _ours(
        module, params, dict(arrays, layer_perturbation=weights), {}, ("layer_perturbation",)
    )
    _assert_close(got, expected)
    plain = _reference(model, arrays, {})
    assert _relative_error(expected[0][:1], plain[0][:1]) > 1e-3  # row 0 perturbed
    np.testing.assert_allclose(got[0][1:], plain[0][1:], rtol=0, atol=1e-5)  # row 1 not

    both = np.ones((BATCH, layers), np.float32)
    both[:, [0, 2]] = 0.0
    expected = _reference(model, arrays, {"spatio_temporal_guidance_blocks": [0, 2]})
    got = _ours(module, params, dict(arrays, layer_perturbation=both), {}, ("layer_perturbation",))
    _assert_close(got, expected)


def test_loads_onto_a_mesh(tmp_path):
    """A checkpoint loaded onto a fsdp x context x tensor = 2 x 2 x 2 mesh: parameters land on
    the shardings their logical names ask for, and the sharded model (both streams' heads split
    by the tensor axis, per-token timesteps) matches diffusers within 1e-5 as on one device."""
    from jaxcore import sharding

    config = dict(
        TINY,
        num_layers=1,
        audio_num_attention_heads=2,
        audio_attention_head_dim=6,
        rope_type="split",
    )
    model = _build_reference(config)
    model.save_pretrained(tmp_path)
    mesh = sharding.make_mesh(
        sharding.MeshConfig(
            ici_data_parallelism=1,
            ici_fsdp_parallelism=2,
            ici_context_parallelism=2,
            ici_tensor_parallelism=2,
        )
    )
    module, params = l2.load_ltx2_transformer(tmp_path, mesh=mesh)
    q_kernel = params["transformer_blocks_0"]["audio_to_video_attn"]["to_q"]["kernel"]
    assert q_kernel.sharding.spec == jax.sharding.PartitionSpec(("fsdp", "context"), "tensor")
    arrays, static, _ = _inputs(config, "per-token-timestep")
    with sharding.mesh_context(mesh):
        got = _ours(module, params, arrays, static)
    _assert_close(got, _reference(model, arrays, static))


def test_bf16_stays_close_to_float32(loaded):
    """bf16 weights and activations stay within bf16 accuracy of float32 (max 3%, mean 0.5%
    of the output scale; reached max 1.2%, mean 0.28%)."""
    module, params = loaded["split_options"]
    arrays, static, _ = _inputs(SPLIT_OPTIONS, "per-token-timestep")
    expected = _ours(module, params, arrays, static)
    half = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
    m16 = module.clone(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    for h, e in zip(_ours(m16, half, arrays, static), expected, strict=True):
        assert h.dtype == jnp.bfloat16
        error = np.abs(h.astype(np.float32) - e) / np.abs(e).max()
        assert error.max() <= 0.03 and error.mean() <= 0.005


# --- pure helpers ---------------------------------------------------------------------------


@pytest.mark.parametrize("rope_type", ["interleaved", "split"])
def test_rope_tables_match_diffusers(rope_type):
    """Host tables (numpy coords) and graph tables (traced coords) against
    LTX2AudioVideoRotaryPosEmbed in double precision, at tiny and real widths (video 4096 with
    32 heads, audio and cross-modal 2048): the float32 angles are formed as torch forms them,
    so only cos/sin rounding differs (atol 1e-6 on the host; the graph's float32 cos/sin of
    angles up to 1.6e4 rad, 2e-6)."""
    from diffusers.models.transformers.transformer_ltx2 import LTX2AudioVideoRotaryPosEmbed

    vcoords = l2.video_coords(2, 5, 6, 7, 25.0)
    acoords = l2.audio_coords(2, 11)
    cases = [
        ("video", 16, 2, vcoords, {}),
        ("video", 4096, 32, vcoords, {}),
        ("audio", 12, 3, acoords, {}),
        ("audio", 2048, 32, acoords, {}),
        ("video", 2048, 32, vcoords[:, :1], dict(base_num_frames=20)),
    ]
    for modality, dim, heads, coords, extra in cases:
        rope = LTX2AudioVideoRotaryPosEmbed(
            dim, modality=modality, rope_type=rope_type, num_attention_heads=heads, **extra
        )
        ref = [t.numpy() for t in rope(torch.from_numpy(coords))]
        if rope_type == "interleaved":
            ref = [t[..., 0::2] for t in ref]
        else:
            ref = [t.transpose(0, 2, 1, 3) for t in ref]  # [B, H, L, r] -> [B, L, H, r]
        bases = (20, 2048, 2048)[: coords.shape[1]] if modality == "video" else (20,)
        spec = l2.RopeSpec(dim, bases, heads, rope_type, 10000.0, True)
        host = l2.rope_tables(coords, spec)
        graph = jax.jit(lambda c, spec=spec: l2.rope_tables(c, spec))(coords)
        for h, g, r in zip(host, graph, ref, strict=True):
            np.testing.assert_allclose(h, r, rtol=0, atol=1e-6)
            np.testing.assert_allclose(g, r, rtol=0, atol=2e-6)


def test_rope_frequencies_are_torchs():
    """The float64 frequency table equals diffusers' bit for bit (torch's linspace rounds its
    second half through a fused multiply-add; so does ours)."""
    for count in (2, 6, 341, 682, 1024):
        ls = torch.linspace(0.0, 1.0, count, dtype=torch.float64)
        want = (torch.pow(10000.0, ls) * torch.pi / 2.0).to(torch.float32).numpy()
        np.testing.assert_array_equal(l2.rope_frequencies(count, 10000.0), want)


def test_coordinates_and_packing_match_the_pipeline():
    """video_coords / audio_coords equal prepare_video_coords / prepare_audio_coords exactly
    (patch sizes 1 and 2, a fractional fps, a shifted audio window); audio packing equals
    LTX2Pipeline's; the latent audio length follows the pipeline's formula."""
    from diffusers import LTX2Pipeline
    from diffusers.models.transformers.transformer_ltx2 import LTX2AudioVideoRotaryPosEmbed

    for patch, patch_t in ((1, 1), (2, 2)):
        rope = LTX2AudioVideoRotaryPosEmbed(64, patch_size=patch, patch_size_t=patch_t)
        want = rope.prepare_video_coords(2, 5, 6, 8, "cpu", fps=FPS).numpy()
        got = l2.video_coords(2, 5, 6, 8, FPS, patch_size=patch, patch_size_t=patch_t)
        np.testing.assert_array_equal(got, want)
    rope = LTX2AudioVideoRotaryPosEmbed(64, modality="audio", scale_factors=[4])
    for shift in (0, 3):
        want = rope.prepare_audio_coords(2, 9, "cpu", shift=shift).numpy()
        np.testing.assert_array_equal(l2.audio_coords(2, 9, shift=shift), want)

    latents = np.random.default_rng(0).standard_normal((2, 8, 9, 16), np.float32)
    packed = LTX2Pipeline._pack_audio_latents(torch.from_numpy(latents)).numpy()
    np.testing.assert_array_equal(l2.pack_audio_latents(jnp.asarray(latents)), packed)
    back = LTX2Pipeline._unpack_audio_latents(torch.from_numpy(packed), 9, 16).numpy()
    np.testing.assert_array_equal(l2.unpack_audio_latents(jnp.asarray(packed), 16), back)
    assert l2.audio_num_frames(121, 24.0) == round(121 / 24.0 * 16000 / 160 / 4.0) == 126


# --- parameters and config ------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CONFIGS))
def test_parameter_count_and_keys_match_diffusers(name):
    """Our abstract parameters count as many elements as diffusers' model, and the weight map
    names each of its state_dict keys exactly once."""
    from diffusers import LTX2VideoTransformer3DModel

    with torch.device("meta"):
        model = LTX2VideoTransformer3DModel(**CONFIGS[name])
    config = l2.LTX2VideoTransformerConfig.from_dict(CONFIGS[name])
    assert l2.count_params(config) == sum(p.numel() for p in model.parameters())
    keys = [key for key, _ in l2.weight_map(config).values()]
    assert sorted(keys) == sorted(model.state_dict())


# The released LTX-2.0 19B transformer: diffusers' class defaults with the split RoPE, as
# diffusers' scripts/convert_ltx2_to_diffusers.py (get_ltx2_transformer_config) writes it.
LTX2_19B = dict(rope_type="split")
# LTX-2.3 (22B class): gated attention, prompt modulation, captions projected by the connectors
LTX23_REAL = dict(
    rope_type="split",
    gated_attn=True,
    audio_gated_attn=True,
    cross_attn_mod=True,
    audio_cross_attn_mod=True,
    use_prompt_embeddings=False,
)


def test_real_parameter_count_matches_diffusers():
    """LTX-2.0 19B: diffusers' parameter count on the meta device equals ours from abstract
    shapes (eval_shape of the whole 48-block model: nothing allocated)."""
    from diffusers import LTX2VideoTransformer3DModel

    with torch.device("meta"):
        model = LTX2VideoTransformer3DModel(**LTX2_19B)
    expected = sum(p.numel() for p in model.parameters())
    assert l2.count_params(l2.LTX2VideoTransformerConfig.from_dict(LTX2_19B)) == expected
    assert 18e9 < expected < 20e9


def test_ltx23_parameter_count_matches_diffusers():
    """LTX-2.3 at its real widths: the stem (0 blocks) and one block counted from abstract
    shapes, then stem + 48 x block (the blocks are identical), equal to diffusers' 48-block
    model on the meta device."""
    from diffusers import LTX2VideoTransformer3DModel

    with torch.device("meta"):
        model = LTX2VideoTransformer3DModel(**LTX23_REAL)
    expected = sum(p.numel() for p in model.parameters())

    def count(layers: int) -> int:
        config = dict(LTX23_REAL, num_layers=layers)
        return l2.count_params(l2.LTX2VideoTransformerConfig.from_dict(config))

    stem = count(0)
    assert stem + 48 * (count(1) - stem) == expected


def test_config_from_diffusers_json(checkpoints):
    directory, _ = checkpoints["split_options"]
    config = l2.LTX2VideoTransformerConfig.from_dict(
        json.loads((Path(directory) / "config.json").read_text())
    )
    assert (config.hidden_dim, config.audio_hidden_dim, config.rope_type) == (16, 12, "split")
    assert config.vae_scale_factors == (8, 32, 32)
    assert l2.LTX2VideoTransformerConfig.from_dict(config.to_dict()) == config
    assert (
        l2.LTX2VideoTransformerConfig.from_dict({"audio_out_channels": None}).audio_out_channels
        == 128
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_heads": 4}, "num_heads"),  # not a key of the config
        ({"qk_norm": "rms_norm"}, "qk_norm"),
        ({"rope_type": "rotary"}, "rope_type"),
        ({"activation_fn": "geglu"}, "activation_fn"),
        ({"cross_attention_dim": 32}, "cross_attention_dim"),
        ({"audio_cross_attention_dim": 16}, "audio_cross_attention_dim"),
        ({"norm_eps": 0.0}, "norm_eps"),
        ({"audio_patch_size_t": 0}, "audio_patch_size_t"),
    ],
)
def test_bad_config_names_the_key(change, message):
    with pytest.raises(l2.LTX2ConfigError, match=message):
        l2.LTX2VideoTransformerConfig.from_dict({**TINY, **change})


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"timestep": np.zeros((BATCH, 5), np.float32)}, "timestep"),
        ({"audio_timestep": np.zeros((BATCH, VIDEO_TOKENS), np.float32)}, "audio_timestep"),
        ({"encoder_attention_mask": np.ones((BATCH, 1, TEXT_LEN), np.float32)}, "mask"),
        ({"video_coords": np.zeros((BATCH, 3, 7, 2), np.float32)}, "video_coords"),
        ({"audio_coords": None}, "audio_num_frames"),
        ({"video_coords": None, "num_frames": 4, "height": 4, "width": 5}, "num_frames"),
        ({"spatio_temporal_guidance_blocks": [2]}, "spatio_temporal_guidance_blocks"),
        ({"use_cross_timestep": True, "sigma": None}, "sigma"),
        ({"hidden_states": np.zeros((BATCH, VIDEO_TOKENS, 4), np.float32)}, "hidden_states"),
        ({"audio_encoder_hidden_states": np.zeros((BATCH, 3, 7), np.float32)}, "audio_encoder"),
    ],
)
def test_bad_inputs_name_the_argument(loaded, change, message):
    module, params = loaded["tiny"]
    arrays, static, _ = _inputs(TINY, "plain")
    with pytest.raises(ValueError, match=message):
        module.apply({"params": params}, **{**arrays, **static, **change})
