"""Wan 2.1 transformer vs diffusers WanTransformer3DModel (random-init tiny models, fp32).

Parity tolerance: max abs diff <= 2e-5 on outputs of magnitude ~1-5 (reached: ~3e-6).
"""

from __future__ import annotations

import contextlib
import inspect
import io
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import yaml
from flax import linen as nn
from jax.ad_checkpoint import print_saved_residuals

from jaxcore import sharding, weights
from jaxcore.layer_stack import LayerStack
from jaxcore.models import wan_transformer as wt

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs" / "models"
PARITY_ATOL = 2e-5

TINY = dict(
    num_layers=2,
    attention_head_dim=16,
    num_attention_heads=2,
    in_channels=4,
    out_channels=4,
    text_dim=32,
    freq_dim=32,
    ffn_dim=64,
    patch_size=(1, 2, 2),
    rope_max_seq_len=32,
)
# Different heads / head dim (12: rope split 4/4/4), no cross-attn norm, out != in channels.
TINY_ODD = dict(
    num_layers=1,
    attention_head_dim=12,
    num_attention_heads=3,
    in_channels=4,
    out_channels=6,
    text_dim=24,
    freq_dim=16,
    ffn_dim=40,
    patch_size=(1, 2, 2),
    cross_attn_norm=False,
    rope_max_seq_len=16,
)
# Temporal patching (head dim 8: rope split 4/2/2).
TINY_T2 = dict(
    num_layers=1,
    attention_head_dim=8,
    num_attention_heads=4,
    in_channels=3,
    out_channels=3,
    text_dim=16,
    freq_dim=8,
    ffn_dim=48,
    patch_size=(2, 2, 1),
    rope_max_seq_len=16,
)


def _save_reference(directory: Path, config: dict, seed: int = 0):
    """A random diffusers model with every parameter perturbed (norm weights are not 1, biases
    not 0, so a mis-mapped parameter changes the output), saved as safetensors."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    model = WanTransformer3DModel(**config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(directory)
    return model


def _inputs(config: dict, batch: int, frames: int, height: int, width: int, text_len: int):
    rng = np.random.default_rng(1)
    video = rng.standard_normal((batch, config["in_channels"], frames, height, width), np.float32)
    timestep = np.array([999.0, 17.3, 500.0, 250.5][:batch], np.float32)
    text = rng.standard_normal((batch, text_len, config["text_dim"]), np.float32)
    return video, timestep, text


def _reference_output(model, video, timestep, text) -> np.ndarray:
    with torch.no_grad():
        out = model(torch.from_numpy(video), torch.from_numpy(timestep), torch.from_numpy(text))
    return out.sample.numpy()


@pytest.mark.parametrize(
    ("config", "shape"),
    [
        (TINY, (2, 3, 8, 8, 7)),  # batch, frames, height, width, text length
        (TINY_ODD, (1, 5, 6, 10, 5)),
        (TINY_T2, (2, 4, 4, 6, 3)),
    ],
    ids=["tiny", "odd-heads-nonsquare-no-xnorm", "temporal-patch"],
)
def test_matches_diffusers(tmp_path, config, shape):
    reference = _save_reference(tmp_path, config)
    video, timestep, text = _inputs(config, *shape)
    expected = _reference_output(reference, video, timestep, text)

    module, params = wt.load_wan_transformer(tmp_path)
    got = jax.jit(module.apply)({"params": params}, video, timestep, text)

    assert got.shape == expected.shape == (shape[0], config["out_channels"], *shape[1:4])
    np.testing.assert_allclose(np.asarray(got), expected, rtol=0, atol=PARITY_ATOL)


def test_bf16_close_to_fp32(tiny_checkpoint):
    """bf16 weights and activations: same function within bf16 accuracy (reached ~0.5%)."""
    m32, p32 = wt.load_wan_transformer(tiny_checkpoint)
    m16, p16 = wt.load_wan_transformer(
        tiny_checkpoint, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16
    )
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(p16))
    video, timestep, text = _inputs(TINY, 1, 2, 4, 4, 3)
    full = np.asarray(jax.jit(m32.apply)({"params": p32}, video, timestep, text))
    half = jax.jit(m16.apply)({"params": p16}, video, timestep, text)
    assert half.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(half, np.float32), full, atol=0.03 * np.abs(full).max())


def test_rope_tables_match_diffusers():
    from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed

    # Wan 2.1's head dim; a 480p-like grid so positions reach far into the tables
    head_dim, patch, grid = 128, (1, 2, 2), (21, 30, 52)
    rope = WanRotaryPosEmbed(head_dim, patch, max_seq_len=1024)
    cos_ref, sin_ref = rope(torch.zeros(1, 1, grid[0], grid[1] * 2, grid[2] * 2))
    cos, sin = wt.rope_cos_sin(grid, head_dim, max_seq_len=1024)
    # diffusers repeats each angle for the two members of a pair
    np.testing.assert_array_equal(cos, cos_ref[0, :, 0, 0::2].numpy())
    np.testing.assert_array_equal(sin, sin_ref[0, :, 0, 1::2].numpy())


def test_timestep_embedding_matches_diffusers():
    """Cos half first, same frequencies. At t ~ 1000 the float32 argument t*f itself is only
    good to half a float32 ulp of 1000 (3e-5), and torch's float32 exp differs from a
    correctly rounded one by an ulp, so large timesteps get a 1e-4 tolerance, small ones 1e-6."""
    from diffusers.models.embeddings import get_timestep_embedding

    for t, atol in (
        (np.array([0.0, 0.25, 1.5, 7.0], np.float32), 1e-6),
        (np.array([500.0, 999.0, 1000.0], np.float32), 1e-4),
    ):
        for dim in (64, 256):  # 256: Wan 2.1's freq_dim
            ref = get_timestep_embedding(
                torch.from_numpy(t), dim, flip_sin_to_cos=True, downscale_freq_shift=0
            )
            got = np.asarray(wt.timestep_embedding(t, dim))
            np.testing.assert_allclose(got, ref.numpy(), rtol=0, atol=atol)


# --- loading errors -----------------------------------------------------------------------


def _copy_checkpoint(src: Path, dst: Path, tensors: dict):
    from safetensors.numpy import save_file

    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    save_file(tensors, str(dst / "diffusion_pytorch_model.safetensors"))


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("wan_tiny")
    _save_reference(directory, dict(TINY, num_layers=1))
    return directory


def test_wrong_shape_names_the_parameter(tiny_checkpoint, tmp_path):
    tensors = weights.SafetensorsReader(tiny_checkpoint).as_dict()
    tensors["blocks.0.attn1.to_q.weight"] = np.zeros((32, 16), np.float32)
    _copy_checkpoint(tiny_checkpoint, tmp_path / "bad", tensors)
    with pytest.raises(weights.WeightsError, match="blocks_0/attn1/to_q/kernel") as err:
        wt.load_wan_transformer(tmp_path / "bad")
    assert "blocks.0.attn1.to_q.weight" in str(err.value)


def test_missing_key_is_named(tiny_checkpoint, tmp_path):
    tensors = weights.SafetensorsReader(tiny_checkpoint).as_dict()
    del tensors["blocks.0.ffn.net.2.bias"]
    _copy_checkpoint(tiny_checkpoint, tmp_path / "bad", tensors)
    with pytest.raises(weights.WeightsError, match=r"missing keys.*blocks\.0\.ffn\.net\.2\.bias"):
        wt.load_wan_transformer(tmp_path / "bad")


def test_a_half_copied_weights_file_is_named_before_loading(tiny_checkpoint, tmp_path):
    """Half a diffusion_pytorch_model.safetensors (an interrupted download) is refused naming
    the file, not met as a reshape error inside the loader."""
    (tmp_path / "config.json").write_text((tiny_checkpoint / "config.json").read_text())
    raw = (tiny_checkpoint / "diffusion_pytorch_model.safetensors").read_bytes()
    (tmp_path / "diffusion_pytorch_model.safetensors").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(
        weights.WeightsError, match="diffusion_pytorch_model.safetensors: .*truncated"
    ):
        wt.load_wan_transformer(tmp_path)


def test_pickle_only_directory_is_refused(tiny_checkpoint, tmp_path):
    (tmp_path / "config.json").write_text((tiny_checkpoint / "config.json").read_text())
    torch.save({"x": torch.zeros(1)}, tmp_path / "diffusion_pytorch_model.bin")
    with pytest.raises(weights.WeightsError, match="pickle"):
        wt.load_wan_transformer(tmp_path)


def test_loads_onto_a_mesh(tiny_checkpoint):
    """Parameters land on the shardings their logical names ask for, and the model runs there."""
    mesh = sharding.make_mesh(
        sharding.MeshConfig(
            ici_data_parallelism=2, ici_fsdp_parallelism=2, ici_tensor_parallelism=2
        )
    )
    module, params = wt.load_wan_transformer(tiny_checkpoint, mesh=mesh)
    q_kernel = params["blocks_0"]["attn1"]["to_q"]["kernel"]
    assert q_kernel.sharding.spec == jax.sharding.PartitionSpec(("fsdp", "context"), "tensor")
    assert params["blocks_0"]["ffn"]["proj_out"][
        "kernel"
    ].sharding.spec == jax.sharding.PartitionSpec("tensor", ("fsdp", "context"))

    _, plain = wt.load_wan_transformer(tiny_checkpoint)
    video, timestep, text = _inputs(TINY, 4, 2, 4, 4, 3)  # batch 4 = data x fsdp
    expected = jax.jit(wt.WanTransformer(module.config).apply)(
        {"params": plain}, video, timestep, text
    )
    with sharding.mesh_context(mesh):
        got = jax.jit(module.apply)({"params": params}, video, timestep, text)
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=1e-5)

    # the blocks scanned over their stacked (still fsdp x tensor sharded) weights: the same
    scanned = wt.WanTransformer(module.config, mesh=mesh, scan_layers=True)
    with sharding.mesh_context(mesh):
        got = jax.jit(scanned.apply)({"params": params}, video, timestep, text)
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=1e-5)


@pytest.mark.parametrize("remat_policy", ["none", "full"])
def test_scan_layers_equals_the_unrolled_blocks(tmp_path, remat_policy):
    """scan_layers runs the same blocks with the same parameters (one lax.scan over a stack of
    them): forward, parameter gradients (per block, under the per-layer names) and a step-cache
    block range equal the unrolled model's; the compiled forward holds one block, not three."""
    config = dict(TINY, num_layers=3)
    _save_reference(tmp_path, config)
    unrolled, params = wt.load_wan_transformer(tmp_path, remat_policy=remat_policy)
    scanned, scanned_params = wt.load_wan_transformer(
        tmp_path, remat_policy=remat_policy, scan_layers=True
    )
    assert jax.tree.structure(scanned_params) == jax.tree.structure(params)
    video, timestep, text = _inputs(TINY, 2, 3, 8, 8, 7)

    def loss(module, p):
        return jnp.mean(module.apply({"params": p}, video, timestep, text) ** 2)

    want, want_grads = jax.jit(jax.value_and_grad(lambda p: loss(unrolled, p)))(params)
    got, got_grads = jax.jit(jax.value_and_grad(lambda p: loss(scanned, p)))(params)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
    for path, grad in jax.tree_util.tree_leaves_with_path(want_grads):
        other = got_grads
        for key in path:
            other = other[key.key]
        np.testing.assert_allclose(np.asarray(other), np.asarray(grad), rtol=1e-5, atol=1e-7)

    # a block range, as step caching runs it (blocks 1..2 only, then the rest of the model)
    def partial(module):
        def run_stack(streams, run_blocks, num_blocks):
            return run_blocks(streams, 1, num_blocks), None

        out, _ = module.apply({"params": params}, video, timestep, text, run_stack=run_stack)
        return out

    np.testing.assert_allclose(
        np.asarray(jax.jit(lambda: partial(scanned))()),
        np.asarray(jax.jit(lambda: partial(unrolled))()),
        rtol=0,
        atol=1e-6,
    )

    def dots(module):
        hlo = jax.jit(module.apply).lower({"params": params}, video, timestep, text).as_text()
        return hlo.count("dot_general")

    assert dots(scanned) < dots(unrolled)

    # the stacked layout a scanned train run holds (jaxcore.layer_stack): same loss, and its
    # gradient is one stack per leaf kind, equal to the per-layer gradients
    layers = LayerStack.of(scanned, params)
    assert layers == LayerStack((("blocks", 3),))
    stacked = layers.stack(params)
    got, got_grads = jax.jit(jax.value_and_grad(lambda p: loss(scanned, p)))(stacked)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
    assert got_grads["blocks_stacked"]["attn1"]["to_q"]["kernel"].shape[0] == 3
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
        layers.unstack(got_grads),
        want_grads,
    )


# --- config -------------------------------------------------------------------------------


def test_config_from_diffusers_json(tiny_checkpoint):
    raw = json.loads((tiny_checkpoint / "config.json").read_text())
    config = wt.WanTransformerConfig.from_dict(raw)
    assert config.patch_size == (1, 2, 2) and config.hidden_dim == 32
    assert wt.WanTransformerConfig.from_dict(config.to_dict()) == config


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_heads": 4}, "num_heads"),
        ({"image_dim": 1280}, "image_dim"),
        ({"added_kv_proj_dim": 5120}, "added_kv_proj_dim"),
        ({"qk_norm": "rms_norm"}, "qk_norm"),
        ({"patch_size": [1, 2]}, "patch_size"),
    ],
)
def test_config_errors_name_the_key(change, message):
    with pytest.raises(wt.WanConfigError, match=message):
        wt.WanTransformerConfig.from_dict({**TINY, **change})


def test_bad_input_shapes_are_named():
    config = wt.WanTransformerConfig.from_dict(TINY)
    module = wt.WanTransformer(config)
    params = nn.meta.unbox(wt.abstract_params(module))
    video, timestep, text = _inputs(TINY, 1, 1, 4, 4, 2)

    def run(*args):  # shape checks fire while tracing; nothing is computed
        return jax.eval_shape(module.apply, {"params": params}, *args)

    assert run(video, timestep, text).shape == video.shape
    with pytest.raises(ValueError, match="height=5 is not divisible"):
        run(np.zeros((1, 4, 1, 5, 4), np.float32), timestep, text)
    with pytest.raises(ValueError, match="encoder_hidden_states"):
        run(video, timestep, text[..., :8])
    with pytest.raises(ValueError, match="timestep"):
        run(video, timestep[None], text)
    with pytest.raises(ValueError, match="rope_max_seq_len"):
        wt.rope_cos_sin((40, 1, 1), 16, max_seq_len=32)


def _yaml(name: str) -> dict:
    return yaml.safe_load((CONFIG_DIR / name).read_text())


def _meta_param_count(section: dict) -> int:
    """Exact diffusers parameter count, built on the meta device (no memory)."""
    from diffusers import WanTransformer3DModel

    with torch.device("meta"):
        model = WanTransformer3DModel(**section)
    return sum(p.numel() for p in model.parameters())


# Exact diffusers counts (verified by building WanTransformer3DModel on the meta device); the
# A14B YAMLs count one expert.
PUBLISHED_COUNTS = {
    "wan2.1_t2v_1.3b.yml": 1_418_996_800,
    "wan2.1_t2v_14b.yml": 14_288_491_584,
    "wan2.2_t2v_a14b.yml": 14_288_491_584,
    "wan2.2_i2v_a14b.yml": 14_288_901_184,
}


@pytest.mark.parametrize(("name", "published"), sorted(PUBLISHED_COUNTS.items()))
def test_published_param_counts(name, published):
    section = _yaml(name)["transformer"]
    config = wt.WanTransformerConfig.from_dict(section)
    assert wt.count_params(config) == _meta_param_count(section) == published


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIG_DIR.glob("wan*.yml")))
def test_every_model_yaml_is_valid(name):
    """Each section matches its reference class's config names; the transformer counts agree."""
    from diffusers import AutoencoderKLWan
    from transformers import UMT5Config

    doc = _yaml(name)
    assert doc.pop("family") == "wan"
    required = {"transformer", "vae", "text_encoder"}
    assert required <= set(doc) <= required | {"transformer_2", "image_encoder", "pipeline"}
    config = wt.WanTransformerConfig.from_dict(doc["transformer"])
    if name not in PUBLISHED_COUNTS:  # those are checked by test_published_param_counts
        assert wt.count_params(config) == _meta_param_count(doc["transformer"])
    if "transformer_2" in doc:  # the second expert has the first's architecture
        assert doc["transformer_2"] == doc["transformer"]

    vae_args = set(inspect.signature(AutoencoderKLWan.__init__).parameters)
    assert set(doc["vae"]) <= vae_args, set(doc["vae"]) - vae_args
    vae = doc["vae"]
    assert len(vae["temperal_downsample"]) == len(vae["dim_mult"]) - 1
    assert len(vae["latents_mean"]) == len(vae["latents_std"]) == vae["z_dim"]
    # text-to-video / TI2V take the latents; image-to-video also the mask and the image latents
    assert vae["z_dim"] == config.out_channels
    assert config.in_channels in (vae["z_dim"], 2 * vae["z_dim"] + 4)

    defaults = UMT5Config()
    unknown = [k for k in doc["text_encoder"] if not hasattr(defaults, k)]
    assert not unknown, unknown
    assert doc["text_encoder"]["d_model"] == config.text_dim


def test_wan21_vae_section_is_the_published_vae():
    """The 1.3B/14B VAE sections equal AutoencoderKLWan's defaults (the Wan 2.1 VAE)."""
    from diffusers import AutoencoderKLWan

    defaults = {
        k: p.default for k, p in inspect.signature(AutoencoderKLWan.__init__).parameters.items()
    }
    for name in ("wan2.1_t2v_1.3b.yml", "wan2.1_t2v_14b.yml"):
        for key, value in _yaml(name)["vae"].items():
            assert value == defaults[key], (name, key)


# --- FLOPs --------------------------------------------------------------------------------


@pytest.mark.usefixtures("xla_dots")  # XLA counts no custom call's FLOPs
def test_flops_formula_matches_xla_count():
    """The analytic matmul FLOPs agree with XLA's count of the compiled forward (within 10%:
    XLA also counts elementwise ops, embeddings and the head, which the formula leaves out)."""
    config = wt.WanTransformerConfig.from_dict(
        dict(TINY, num_attention_heads=4, attention_head_dim=32, ffn_dim=512, text_dim=128)
    )
    module = wt.WanTransformer(config)
    video = jax.ShapeDtypeStruct((1, 4, 4, 16, 16), jnp.float32)  # 256 tokens
    timestep = jax.ShapeDtypeStruct((1,), jnp.float32)
    text = jax.ShapeDtypeStruct((1, 64, 128), jnp.float32)
    params = jax.eval_shape(lambda: wt.init_wan_transformer(config, jax.random.key(0))[1])
    compiled = jax.jit(module.apply).lower({"params": params}, video, timestep, text).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    formula = wt.flops_per_forward(config, batch=1, video_tokens=256, text_tokens=64)
    assert formula == pytest.approx(cost["flops"], rel=0.10)


# --- remat --------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["full", pytest.param("dots_saveable", marks=pytest.mark.slow)])
def test_remat_same_output_and_gradients(tiny_checkpoint, policy):
    plain, params = wt.load_wan_transformer(tiny_checkpoint)
    remat = wt.WanTransformer(plain.config, remat_policy=policy)
    video, timestep, text = _inputs(TINY, 1, 2, 4, 4, 3)

    def loss(module):
        def fn(p):
            return jnp.mean(module.apply({"params": p}, video, timestep, text) ** 2)

        return jax.jit(jax.value_and_grad(fn))(params)

    def jaxpr(module):
        return str(
            jax.make_jaxpr(lambda p: module.apply({"params": p}, video, timestep, text))(params)
        )

    assert "remat" in jaxpr(remat) and "remat" not in jaxpr(plain)  # the block is checkpointed
    (loss_plain, grad_plain), (loss_remat, grad_remat) = loss(plain), loss(remat)
    np.testing.assert_allclose(loss_remat, loss_plain, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), grad_remat, grad_plain)
    assert any(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(grad_plain))


def _saved_residuals(fn, *args) -> list[str]:
    """What jax keeps from ``fn``'s forward for its backward, one line each."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_saved_residuals(fn, *args)
    return out.getvalue().splitlines()


def test_offload_policy_moves_each_block_input_to_the_host(tmp_path):
    """offload_block_inputs keeps each block's input in pinned host memory and nothing else
    from the blocks (full remat keeps nothing on the host); the gradients are the plain
    model's."""
    _save_reference(tmp_path, dict(TINY, num_layers=2))
    plain, params = wt.load_wan_transformer(tmp_path)
    video, timestep, text = _inputs(TINY, 1, 2, 4, 4, 3)

    def loss(module):
        return lambda p: jnp.mean(module.apply({"params": p}, video, timestep, text) ** 2)

    offload = wt.WanTransformer(plain.config, remat_policy="offload_block_inputs")
    on_host = [line for line in _saved_residuals(loss(offload), params) if "<host>" in line]
    dim = TINY["num_attention_heads"] * TINY["attention_head_dim"]
    assert [line.split()[0] for line in on_host] == [f"f32<host>[1,8,{dim}]"] * 2  # 8 tokens
    full = wt.WanTransformer(plain.config, remat_policy="full")
    assert not any("<host>" in line for line in _saved_residuals(loss(full), params))

    grad_plain = jax.jit(jax.grad(loss(plain)))(params)
    grad_offload = jax.jit(jax.grad(loss(offload)))(params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), grad_offload, grad_plain)


def test_init_from_scratch_on_a_mesh():
    """init_wan_transformer creates every parameter already on its logical sharding."""
    mesh = sharding.make_mesh(
        sharding.MeshConfig(
            ici_data_parallelism=1, ici_fsdp_parallelism=4, ici_tensor_parallelism=2
        )
    )
    config = wt.WanTransformerConfig.from_dict(dict(TINY, num_layers=1))
    _, params = wt.init_wan_transformer(config, jax.random.key(0), mesh=mesh)
    spec = jax.sharding.PartitionSpec
    assert params["blocks_0"]["ffn"]["proj_in"]["kernel"].sharding.spec == spec(
        ("fsdp", "context"), "tensor"
    )
    assert params["patch_embedding"]["kernel"].sharding.spec == spec(
        None, None, None, None, ("fsdp", "context")
    )
    assert params["blocks_0"]["attn1"]["norm_q"]["scale"].sharding.spec == spec(None)
    table = np.asarray(params["blocks_0"]["scale_shift_table"])
    assert table.shape == (1, 6, 32) and 0.05 < table.std() < 0.4  # randn / sqrt(D), as diffusers
    assert wt.count_params(config) == sum(x.size for x in jax.tree.leaves(params))


def test_unknown_remat_policy():
    config = wt.WanTransformerConfig.from_dict(TINY)
    module = wt.WanTransformer(config, remat_policy="sometimes")
    with pytest.raises(ValueError, match="remat_policy"):
        wt.abstract_params(module)


def test_weight_map_covers_every_parameter():
    for extra in ({}, {"cross_attn_norm": False}):
        config = wt.WanTransformerConfig.from_dict({**TINY, **extra})
        abstract = nn.meta.unbox(wt.abstract_params(wt.WanTransformer(config)))
        paths = set(weights._flatten(abstract))
        assert paths == set(wt.weight_map(config))


@pytest.mark.parametrize(
    ("name", "boundary", "image"),
    [
        ("wan2.2_t2v_a14b.yml", 0.875, "none"),
        ("wan2.2_i2v_a14b.yml", 0.9, "required"),
        ("wan2.1_i2v_14b_480p.yml", None, "required"),
        ("wan2.2_ti2v_5b.yml", None, "optional"),
    ],
)
def test_variant_yamls_describe_their_pipelines(name, boundary, image):
    """The pipeline section says what model_index.json says for the published model; the
    sections agree as one Wan variant (checked when the YAML is read)."""
    from jaxcore.model_configs import read_model_yaml

    family, configs = read_model_yaml(CONFIG_DIR / name)
    assert configs["pipeline"].boundary_ratio == boundary
    assert ("transformer_2" in configs) == (boundary is not None)
    assert family.image_inputs(configs).image == image


def test_wan21_i2v_image_encoder_is_clip_vit_h():
    """The image_encoder section builds transformers' CLIPVisionModel with the published
    OpenCLIP ViT-H/14 count, and makes 257 tokens per image."""
    from transformers import CLIPVisionConfig as HFConfig
    from transformers import CLIPVisionModel

    from jaxcore import families

    section = _yaml("wan2.1_i2v_14b_480p.yml")["image_encoder"]
    with torch.device("meta"):
        model = CLIPVisionModel(HFConfig(**section))
    assert sum(p.numel() for p in model.parameters()) == 630_766_080
    family = families.get("wan")
    from jaxcore.model_configs import read_model_yaml

    _, configs = read_model_yaml(CONFIG_DIR / "wan2.1_i2v_14b_480p.yml")
    assert family.image_tokens(configs) == 257


def test_a_yaml_whose_sections_disagree_is_refused(tmp_path):
    from jaxcore.model_configs import ConfigError, read_model_yaml

    doc = _yaml("wan2.2_t2v_a14b.yml")
    del doc["pipeline"]["boundary_ratio"]
    path = tmp_path / "bad.yml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(ConfigError, match="bad.yml: a transformer_2 goes with"):
        read_model_yaml(path)
    doc = _yaml("wan2.2_i2v_a14b.yml")
    del doc["pipeline"], doc["transformer_2"]
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(ConfigError, match="in a WanPipeline"):
        read_model_yaml(path)
