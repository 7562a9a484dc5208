"""Wan 2.1 I2V / FLF2V and Wan 2.2 TI2V transformer vs diffusers WanTransformer3DModel.

Random-init tiny diffusers models, saved with ``save_pretrained`` and loaded by
``load_wan_transformer``; fp32 outputs compared at max abs diff <= 2e-5 on outputs of
magnitude ~2-3.5 (reached: <= 8e-7).

diffusers' ``WanAttnProcessor`` takes the last 512 tokens of the concatenated (image, text)
context as the text, whatever the number of image tokens, so the image-conditioned cases use
512 text tokens (what Wan's pipelines always pass); ours splits at the image token count.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import yaml
from flax import linen as nn

from jaxcore import sharding, weights
from jaxcore.models import wan_transformer as wt

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs" / "models"
PARITY_ATOL = 2e-5
TEXT_LEN_I2V = 512  # the text length diffusers' I2V cross-attention assumes

Z = 4  # latent channels of the tiny VAE: I2V input = latents + 4 mask channels + image latents
I2V = dict(
    num_layers=2,
    attention_head_dim=8,
    num_attention_heads=2,
    in_channels=2 * Z + 4,
    out_channels=Z,
    text_dim=16,
    freq_dim=16,
    ffn_dim=32,
    patch_size=(1, 2, 2),
    cross_attn_norm=True,
    image_dim=12,
    added_kv_proj_dim=16,  # = the model width, as 5120 in Wan 2.1 I2V 14B
    rope_max_seq_len=16,
)
# FLF2V: two images of 3 tokens each (257 each in the real model, pos_embed_seq_len 514)
FLF2V = dict(I2V, pos_embed_seq_len=2 * 3)
# Wan 2.2 TI2V: no image branch; the first frame's tokens get timestep 0
TI2V = dict(
    num_layers=2,
    attention_head_dim=8,
    num_attention_heads=2,
    in_channels=6,
    out_channels=6,
    text_dim=16,
    freq_dim=16,
    ffn_dim=32,
    patch_size=(1, 2, 2),
    rope_max_seq_len=16,
)
# 3 heads x 12 (rope split 4/4/4), out != in channels, no cross-attn norm, image conditioning
ODD = dict(
    num_layers=1,
    attention_head_dim=12,
    num_attention_heads=3,
    in_channels=7,
    out_channels=5,
    text_dim=24,
    freq_dim=16,
    ffn_dim=40,
    patch_size=(1, 2, 2),
    cross_attn_norm=False,
    image_dim=10,
    added_kv_proj_dim=36,
    rope_max_seq_len=16,
)


def _save_reference(directory: Path, config: dict, seed: int = 0):
    """A random diffusers model with every parameter perturbed (norm weights are not 1, biases
    and FLF2V's pos_embed not 0, so a mis-mapped parameter changes the output), saved."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    model = WanTransformer3DModel(**config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(directory)
    return model


def _per_token_timesteps(batch: int, grid: tuple[int, int, int], ts: list[float]) -> np.ndarray:
    """[B, L]: 0 on the first latent frame's tokens, ts[b] elsewhere (Wan 2.2 TI2V's mask)."""
    f, h, w = grid
    frame_mask = np.ones((f, h, w), np.float32)
    frame_mask[0] = 0.0
    return np.stack([frame_mask.reshape(-1) * np.float32(t) for t in ts[:batch]])


def _inputs(config, batch, frames, height, width, text_len, *, per_token=False, image_len=0):
    """(video, timestep, text, image or None) as float32 numpy arrays."""
    rng = np.random.default_rng(1)
    video = rng.standard_normal((batch, config["in_channels"], frames, height, width), np.float32)
    ts = [999.0, 17.3, 500.0, 250.5]
    if per_token:
        grid = wt.patch_grid(video.shape, tuple(config["patch_size"]))
        timestep = _per_token_timesteps(batch, grid, ts)
    else:
        timestep = np.array(ts[:batch], np.float32)
    text = rng.standard_normal((batch, text_len, config["text_dim"]), np.float32)
    image = None
    if config.get("image_dim"):
        rows = 2 * batch if config.get("pos_embed_seq_len") else batch
        image = rng.standard_normal((rows, image_len, config["image_dim"]), np.float32)
    return video, timestep, text, image


def _reference_output(model, video, timestep, text, image) -> np.ndarray:
    tensors = [torch.from_numpy(a) for a in (video, timestep, text)]
    image = None if image is None else torch.from_numpy(image)
    with torch.no_grad():
        return model(*tensors, encoder_hidden_states_image=image).sample.numpy()


# (config, batch, frames, height, width, text length, per-token timesteps, image tokens)
CASES = {
    "i2v": (I2V, 2, 3, 4, 6, TEXT_LEN_I2V, False, 5),
    "flf2v": (dict(FLF2V, num_layers=1), 2, 2, 4, 4, TEXT_LEN_I2V, False, 3),
    "ti2v-per-token-batch2": (TI2V, 2, 3, 4, 6, 7, True, 0),
    "ti2v-per-token-batch1": (TI2V, 1, 2, 6, 4, 5, True, 0),
    "odd-heads-i2v-per-token": (ODD, 1, 2, 4, 6, TEXT_LEN_I2V, True, 4),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_diffusers(tmp_path, case):
    config, batch, frames, height, width, text_len, per_token, image_len = CASES[case]
    reference = _save_reference(tmp_path, config)
    video, timestep, text, image = _inputs(
        config, batch, frames, height, width, text_len, per_token=per_token, image_len=image_len
    )
    expected = _reference_output(reference, video, timestep, text, image)

    module, params = wt.load_wan_transformer(tmp_path)
    got = jax.jit(module.apply)({"params": params}, video, timestep, text, image)

    assert got.shape == expected.shape == (batch, config["out_channels"], frames, height, width)
    np.testing.assert_allclose(np.asarray(got), expected, rtol=0, atol=PARITY_ATOL)
    if config.get("pos_embed_seq_len"):  # the regrouped layout [B, 2S, image_dim] too
        grouped = image.reshape(batch, -1, image.shape[-1])
        same = jax.jit(module.apply)({"params": params}, video, timestep, text, grouped)
        np.testing.assert_array_equal(np.asarray(same), np.asarray(got))


@pytest.mark.slow
def test_per_token_timesteps_take_effect():
    """A [B, L] timestep with constant rows gives the [B] result; setting the first frame's
    tokens to t = 0 changes it (the per-token path is not reduced to one timestep a sample)."""
    config = wt.WanTransformerConfig(**TI2V)
    module, params = wt.init_wan_transformer(config, jax.random.key(0))
    video, _, text, _ = _inputs(TI2V, 2, 2, 4, 4, 3)
    tokens = 2 * 2 * 2
    per_sample = np.array([300.0, 700.0], np.float32)
    constant = np.repeat(per_sample[:, None], tokens, axis=1)
    apply = jax.jit(module.apply)
    a = np.asarray(apply({"params": params}, video, per_sample, text))
    b = np.asarray(apply({"params": params}, video, constant, text))
    np.testing.assert_allclose(b, a, rtol=0, atol=1e-5)
    masked = constant.copy()
    masked[:, : tokens // 2] = 0.0  # first latent frame at t = 0
    c = np.asarray(apply({"params": params}, video, masked, text))
    assert np.abs(c - a).max() > 1e-3


# --- loading ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def i2v_checkpoint(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("wan_i2v")
    _save_reference(directory, dict(I2V, num_layers=1))
    return directory


def test_ignores_norm_added_q_like_diffusers(i2v_checkpoint, tmp_path):
    """diffusers skips ``norm_added_q`` keys on load (_keys_to_ignore_on_load_unexpected)."""
    from safetensors.numpy import save_file

    tensors = weights.SafetensorsReader(i2v_checkpoint).as_dict()
    tensors["blocks.0.attn2.norm_added_q.weight"] = np.ones(16, np.float32)
    tensors["blocks.0.attn2.surprise.weight"] = np.ones(16, np.float32)
    (tmp_path / "ok").mkdir()
    (tmp_path / "ok" / "config.json").write_text((i2v_checkpoint / "config.json").read_text())
    kept = {k: v for k, v in tensors.items() if "surprise" not in k}
    save_file(kept, str(tmp_path / "ok" / "diffusion_pytorch_model.safetensors"))
    wt.load_wan_transformer(tmp_path / "ok")

    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text((i2v_checkpoint / "config.json").read_text())
    save_file(tensors, str(tmp_path / "bad" / "diffusion_pytorch_model.safetensors"))
    with pytest.raises(weights.WeightsError, match=r"unexpected keys.*surprise") as err:
        wt.load_wan_transformer(tmp_path / "bad")
    assert "attn2.norm_added_q" not in str(err.value)


def test_missing_image_key_is_named(i2v_checkpoint, tmp_path):
    from safetensors.numpy import save_file

    tensors = weights.SafetensorsReader(i2v_checkpoint).as_dict()
    del tensors["blocks.0.attn2.add_v_proj.bias"]
    (tmp_path / "config.json").write_text((i2v_checkpoint / "config.json").read_text())
    save_file(tensors, str(tmp_path / "diffusion_pytorch_model.safetensors"))
    with pytest.raises(weights.WeightsError, match=r"blocks\.0\.attn2\.add_v_proj\.bias"):
        wt.load_wan_transformer(tmp_path)


@pytest.mark.parametrize("config", [I2V, FLF2V, ODD], ids=["i2v", "flf2v", "odd"])
def test_weight_map_covers_every_parameter(config):
    cfg = wt.WanTransformerConfig.from_dict(config)
    abstract = nn.meta.unbox(wt.abstract_params(wt.WanTransformer(cfg)))
    assert set(weights._flatten(abstract)) == set(wt.weight_map(cfg))
    # and every diffusers parameter has a source in it
    from diffusers import WanTransformer3DModel

    with torch.device("meta"):
        names = {n for n, _ in WanTransformer3DModel(**config).named_parameters()}
    assert names == {src for src, _ in wt.weight_map(cfg).values()}


def test_image_params_are_placed_by_their_logical_axes():
    """The new parameters carry the logical axes of their text-side counterparts."""
    mesh = sharding.make_mesh(
        sharding.MeshConfig(
            ici_data_parallelism=2, ici_fsdp_parallelism=2, ici_tensor_parallelism=2
        )
    )
    config = wt.WanTransformerConfig.from_dict(dict(FLF2V, num_layers=1))
    boxed = wt.abstract_params(wt.WanTransformer(config))
    specs = jax.tree.map(lambda s: s.spec, sharding.param_shardings(mesh, boxed))
    spec = jax.sharding.PartitionSpec
    attn2, image = specs["blocks_0"]["attn2"], specs["condition_embedder"]["image_embedder"]
    assert (
        attn2["add_k_proj"]["kernel"]
        == attn2["to_k"]["kernel"]
        == spec(("fsdp", "context"), "tensor")
    )
    assert attn2["add_v_proj"]["bias"] == attn2["to_v"]["bias"] == spec("tensor")
    assert attn2["norm_added_k"]["scale"] == attn2["norm_k"]["scale"] == spec(None)
    assert image["ff"]["linear_1"]["kernel"] == spec(None, "tensor")
    assert image["ff"]["linear_2"]["kernel"] == spec("tensor", ("fsdp", "context"))
    assert image["norm1"]["scale"] == image["norm2"]["bias"] == spec(None)
    assert image["pos_embed"] == spec(None, None, None)
    pos_embed = nn.meta.unbox(boxed)["condition_embedder"]["image_embedder"]["pos_embed"]
    assert pos_embed.shape == (1, FLF2V["pos_embed_seq_len"], FLF2V["image_dim"])


@pytest.mark.slow
def test_sharded_matches_unsharded():
    """I2V + per-token timesteps on a data x fsdp x tensor mesh equals the plain run."""
    mesh = sharding.make_mesh(
        sharding.MeshConfig(
            ici_data_parallelism=2, ici_fsdp_parallelism=2, ici_tensor_parallelism=2
        )
    )
    config = wt.WanTransformerConfig.from_dict(dict(I2V, num_layers=1))
    _, plain = wt.init_wan_transformer(config, jax.random.key(0))
    module, placed = wt.init_wan_transformer(config, jax.random.key(0), mesh=mesh)
    inputs = _inputs(I2V, 4, 2, 4, 4, 6, per_token=True, image_len=5)
    expected = jax.jit(wt.WanTransformer(config).apply)({"params": plain}, *inputs)
    with sharding.mesh_context(mesh):
        got = jax.jit(module.apply)({"params": placed}, *inputs)
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=0, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["ulysses", "ring"])
def test_context_parallel_matches_unsharded(backend):
    """Per-token modulation and the image attention with the tokens split over ``context``."""
    mesh = sharding.make_mesh(
        sharding.MeshConfig(ici_data_parallelism=2, ici_context_parallelism=4)
    )
    odd4 = dict(ODD, num_attention_heads=4, added_kv_proj_dim=48)  # heads split 4 ways
    config = wt.WanTransformerConfig.from_dict(odd4)
    _, params = wt.init_wan_transformer(config, jax.random.key(0))
    inputs = _inputs(odd4, 2, 3, 4, 6, 5, per_token=True, image_len=3)
    expected = jax.jit(wt.WanTransformer(config).apply)({"params": params}, *inputs)
    module = wt.WanTransformer(config, attention=backend, mesh=mesh)
    with sharding.mesh_context(mesh):
        got = jax.jit(module.apply)({"params": params}, *inputs)
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=0, atol=1e-5)


@pytest.mark.slow
def test_remat_with_image_and_per_token_timesteps():
    config = wt.WanTransformerConfig.from_dict(I2V)
    plain, params = wt.init_wan_transformer(config, jax.random.key(0))
    remat = wt.WanTransformer(config, remat_policy="full")
    inputs = _inputs(I2V, 1, 2, 4, 4, 3, per_token=True, image_len=2)

    def grads(module):
        def loss(p):
            return jnp.mean(module.apply({"params": p}, *inputs) ** 2)

        return jax.jit(jax.grad(loss))(params)

    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), grads(remat), grads(plain)
    )


# --- config and input errors --------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"added_kv_proj_dim": 32}, "added_kv_proj_dim=32 must equal the model width"),
        ({"added_kv_proj_dim": None}, "image_dim=12 needs added_kv_proj_dim"),
        ({"image_dim": None}, "added_kv_proj_dim=16 needs image_dim"),
        ({"pos_embed_seq_len": 5}, "pos_embed_seq_len=5 must be a positive even"),
        (
            {"image_dim": None, "added_kv_proj_dim": None, "pos_embed_seq_len": 6},
            "pos_embed_seq_len=6 needs image conditioning",
        ),
    ],
)
def test_config_errors_name_the_key(change, message):
    with pytest.raises(wt.WanConfigError, match=message):
        wt.WanTransformerConfig.from_dict({**I2V, **change})


def test_bad_inputs_are_named():
    def run(config, *args):  # shape checks fire while tracing; nothing is computed
        module = wt.WanTransformer(wt.WanTransformerConfig.from_dict(config))
        params = nn.meta.unbox(wt.abstract_params(module))
        return jax.eval_shape(module.apply, {"params": params}, *args)

    video, timestep, text, image = _inputs(I2V, 1, 1, 4, 4, 3, image_len=2)
    assert run(I2V, video, timestep, text, image).shape == (1, Z, 1, 4, 4)
    with pytest.raises(ValueError, match="encoder_hidden_states_image is required"):
        run(I2V, video, timestep, text)
    with pytest.raises(ValueError, match="encoder_hidden_states_image must be"):
        run(I2V, video, timestep, text, image[..., :5])
    with pytest.raises(ValueError, match=r"timestep must be .*\[1, 4\]"):
        run(I2V, video, np.zeros((1, 5), np.float32), text, image)

    t2v_video, t2v_t, t2v_text, _ = _inputs(TI2V, 1, 1, 4, 4, 3)
    with pytest.raises(ValueError, match="no image conditioning"):
        run(TI2V, t2v_video, t2v_t, t2v_text, image)

    flf_video, flf_t, flf_text, flf_image = _inputs(FLF2V, 1, 1, 4, 4, 3, image_len=3)
    assert flf_image.shape == (2, 3, 12)
    assert run(FLF2V, flf_video, flf_t, flf_text, flf_image).shape == (1, Z, 1, 4, 4)
    grouped = flf_image.reshape(1, 6, 12)
    assert run(FLF2V, flf_video, flf_t, flf_text, grouped).shape == (1, Z, 1, 4, 4)
    with pytest.raises(ValueError, match=r"\[2B=2, pos_embed_seq_len/2=3"):
        run(FLF2V, flf_video, flf_t, flf_text, flf_image[:1])
    with pytest.raises(ValueError, match=r"\[2B=2, pos_embed_seq_len/2=3"):
        run(FLF2V, flf_video, flf_t, flf_text, flf_image[:, :2])


# --- real configs -------------------------------------------------------------------------

_REAL = dict(
    patch_size=[1, 2, 2],
    attention_head_dim=128,
    text_dim=4096,
    freq_dim=256,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
    rope_max_seq_len=1024,
)
# diffusers' scripts/convert_wan_to_diffusers.py: "Wan-I2V-14B-480p" / "-720p" (same
# transformer), "Wan-FLF2V-14B-720P", "Wan2.2-TI2V-5B"
WAN21_I2V_14B = dict(
    _REAL,
    num_attention_heads=40,
    in_channels=36,
    out_channels=16,
    ffn_dim=13824,
    num_layers=40,
    image_dim=1280,
    added_kv_proj_dim=5120,
)
WAN21_FLF2V_14B = dict(WAN21_I2V_14B, pos_embed_seq_len=257 * 2)
WAN22_TI2V_5B = dict(
    _REAL, num_attention_heads=24, in_channels=48, out_channels=48, ffn_dim=14336, num_layers=30
)
# Exact diffusers counts (verified by building WanTransformer3DModel on the meta device).
REAL_COUNTS = [
    ("wan2.1_i2v_14b", WAN21_I2V_14B, 16_394_878_784),
    ("wan2.2_ti2v_5b", WAN22_TI2V_5B, 4_999_787_712),
    pytest.param("wan2.1_flf2v_14b", WAN21_FLF2V_14B, 16_395_536_704, marks=pytest.mark.slow),
]


def _meta_param_count(config: dict) -> int:
    from diffusers import WanTransformer3DModel

    with torch.device("meta"):
        model = WanTransformer3DModel(**config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(("name", "config", "published"), REAL_COUNTS)
def test_real_param_counts(name, config, published):
    ours = wt.count_params(wt.WanTransformerConfig.from_dict(config))
    assert ours == _meta_param_count(config) == published


def test_ti2v_yaml_is_the_converted_config():
    doc = yaml.safe_load((CONFIG_DIR / "wan2.2_ti2v_5b.yml").read_text())
    assert wt.WanTransformerConfig.from_dict(doc["transformer"]) == (
        wt.WanTransformerConfig.from_dict(WAN22_TI2V_5B)
    )


# --- FLOPs --------------------------------------------------------------------------------


@pytest.mark.usefixtures("xla_dots")  # XLA counts no custom call's FLOPs
def test_flops_formula_counts_the_image_attention():
    """The analytic matmul FLOPs agree with XLA's count of the compiled I2V forward (10%)."""
    config = wt.WanTransformerConfig.from_dict(
        dict(
            I2V,
            num_attention_heads=4,
            attention_head_dim=32,
            ffn_dim=512,
            text_dim=128,
            added_kv_proj_dim=128,
            image_dim=64,
        )
    )
    module = wt.WanTransformer(config)
    video = jax.ShapeDtypeStruct((1, config.in_channels, 4, 16, 16), jnp.float32)  # 256 tokens
    timestep = jax.ShapeDtypeStruct((1,), jnp.float32)
    text = jax.ShapeDtypeStruct((1, 64, 128), jnp.float32)
    image = jax.ShapeDtypeStruct((1, 256, 64), jnp.float32)
    params = nn.meta.unbox(wt.abstract_params(module))
    compiled = jax.jit(module.apply).lower({"params": params}, video, timestep, text, image)
    cost = compiled.compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    formula = wt.flops_per_forward(config, 1, video_tokens=256, text_tokens=64, image_tokens=256)
    without = wt.flops_per_forward(config, 1, video_tokens=256, text_tokens=64)
    assert formula == pytest.approx(cost["flops"], rel=0.10)
    assert without != pytest.approx(cost["flops"], rel=0.10)  # the image term is needed
