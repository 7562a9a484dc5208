"""CLIP text encoder vs transformers' CLIPTextModel / CLIPTextModelWithProjection.

Random tiny models with every parameter perturbed, saved with save_pretrained, loaded by our
loader, compared in fp32: last_hidden_state, pooler_output, every hidden state, text_embeds.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from jaxcore import sharding, weights
from jaxcore.models import clip_text

# fp32 on CPU with highest matmul precision (conftest); reached 1.9e-6 max abs over every
# output (|out| ~3.5): last_hidden_state, pooler_output, hidden_states, text_embeds.
ATOL = 1e-5

# The legacy convention: eos_token_id 2 -> pool at the largest token id (Flux's CLIP-L config).
TINY_QUICK_GELU = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    projection_dim=20,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=16,
    hidden_act="quick_gelu",
    bos_token_id=0,
    eos_token_id=2,
    pad_token_id=1,
)
# Odd sizes (3 heads of 8, hidden 24), exact gelu, the "first eos_token_id" convention with the
# eos id below other ids (so argmax and first-eos pick different positions) and pad == eos.
ODD_GELU = dict(
    vocab_size=97,
    hidden_size=24,
    intermediate_size=40,
    projection_dim=13,
    num_hidden_layers=3,
    num_attention_heads=3,
    max_position_embeddings=16,
    hidden_act="gelu",
    layer_norm_eps=1e-6,
    bos_token_id=95,
    eos_token_id=7,
    pad_token_id=7,
)

# Real text towers (config.json values), for parameter counts.
# openai/clip-vit-large-patch14 text (Flux text_encoder, SD 1.x), a CLIPTextModel.
CLIP_L = dict(
    vocab_size=49408,
    hidden_size=768,
    intermediate_size=3072,
    projection_dim=768,
    num_hidden_layers=12,
    num_attention_heads=12,
    max_position_embeddings=77,
    hidden_act="quick_gelu",
    layer_norm_eps=1e-5,
    bos_token_id=0,
    eos_token_id=2,
    pad_token_id=1,
)
# OpenCLIP ViT-bigG-14 text (SDXL text_encoder_2), a CLIPTextModelWithProjection.
OPENCLIP_BIGG = dict(
    CLIP_L,
    hidden_size=1280,
    intermediate_size=5120,
    projection_dim=1280,
    num_hidden_layers=32,
    num_attention_heads=20,
    hidden_act="gelu",
)
# OpenCLIP ViT-H-14 text as SD 2.x ships it (23 of its 24 layers), a CLIPTextModel.
OPENCLIP_VIT_H = dict(
    CLIP_L,
    hidden_size=1024,
    intermediate_size=4096,
    projection_dim=1024,
    num_hidden_layers=23,
    num_attention_heads=16,
    hidden_act="gelu",
)
# Parameter counts transformers reports on the meta device.
REAL_PARAMS = {
    ("clip-l", False): 123_060_480,
    ("clip-l", True): 123_650_304,
    ("openclip-bigg", True): 694_659_840,
    ("openclip-vit-h", False): 340_387_840,
    ("openclip-vit-h", True): 341_436_416,
}
REAL_CONFIGS = {"clip-l": CLIP_L, "openclip-bigg": OPENCLIP_BIGG, "openclip-vit-h": OPENCLIP_VIT_H}


def _reference_class(with_projection):
    if with_projection:
        return transformers.CLIPTextModelWithProjection
    return transformers.CLIPTextModel


def _save_reference(tmp_path, config_kwargs, with_projection, seed=0):
    torch.manual_seed(seed)
    config = transformers.CLIPTextConfig(**config_kwargs)
    model = _reference_class(with_projection)(config).eval()
    # Every parameter off its init (layer norms are ones/zeros, biases zeros at init).
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn_like(param))
    model.save_pretrained(tmp_path)
    return model


def _batch(config_kwargs, lengths, total, seed=0, left_pad=False):
    """bos, random tokens, eos, then pads; attention mask 1 on bos..eos.

    The random tokens may exceed the eos id, and a large id is placed after the eos of the
    first row, so the legacy (argmax) and first-eos conventions pick different positions.
    """
    rng = np.random.default_rng(seed)
    c = config_kwargs
    ids = np.full((len(lengths), total), c["pad_token_id"], np.int32)
    mask = np.zeros((len(lengths), total), np.int32)
    for row, n in enumerate(lengths):
        tokens = rng.integers(8, c["vocab_size"] - 2, size=n - 2)
        seq = np.concatenate([[c["bos_token_id"]], tokens, [c["eos_token_id"]]])
        start = total - n if left_pad else 0
        ids[row, start : start + n] = seq
        mask[row, start : start + n] = 1
    if not left_pad and lengths[0] < total:
        ids[0, lengths[0]] = c["vocab_size"] - 1  # a masked token with the largest id
    return ids, mask


def _torch_outputs(model, ids, mask):
    """{last_hidden_state, pooler_output, hidden_states, text_embeds} as numpy."""
    kwargs = {"attention_mask": torch.from_numpy(mask).long()} if mask is not None else {}
    ids_t = torch.from_numpy(ids).long()
    text_model = getattr(model, "text_model", model)
    with torch.no_grad():
        out = text_model(ids_t, output_hidden_states=True, **kwargs)
        result = {
            "last_hidden_state": out.last_hidden_state.numpy(),
            "pooler_output": out.pooler_output.numpy(),
            "hidden_states": [h.numpy() for h in out.hidden_states],
            "text_embeds": None,
        }
        if text_model is not model:
            projected = model(ids_t, **kwargs)
            np.testing.assert_array_equal(
                projected.last_hidden_state.numpy(), result["last_hidden_state"]
            )
            result["text_embeds"] = projected.text_embeds.numpy()
    return result


def _max_errors(got, expected):
    errors = {
        "last_hidden_state": np.abs(
            np.asarray(got.last_hidden_state) - expected["last_hidden_state"]
        ).max(),
        "pooler_output": np.abs(np.asarray(got.pooler_output) - expected["pooler_output"]).max(),
    }
    assert len(got.hidden_states) == len(expected["hidden_states"])
    for i, (g, e) in enumerate(zip(got.hidden_states, expected["hidden_states"], strict=True)):
        errors[f"hidden_states[{i}]"] = np.abs(np.asarray(g) - e).max()
    if expected["text_embeds"] is None:
        assert got.text_embeds is None
    else:
        errors["text_embeds"] = np.abs(np.asarray(got.text_embeds) - expected["text_embeds"]).max()
    return errors


def _assert_matches(got, expected):
    errors = _max_errors(got, expected)
    worst = max(errors, key=errors.get)
    assert errors[worst] <= ATOL, f"{worst}: max abs error {errors[worst]:.2e} ({errors})"


CASES = [
    (TINY_QUICK_GELU, False, True),
    (TINY_QUICK_GELU, True, False),
    (ODD_GELU, True, True),
    (ODD_GELU, False, False),
]


@pytest.mark.parametrize(
    "config_kwargs,with_projection,use_mask",
    CASES,
    ids=["quick-gelu-legacy-eos-mask", "quick-gelu-proj-nomask", "odd-gelu-proj-mask", "odd-gelu"],
)
def test_matches_transformers(tmp_path, config_kwargs, with_projection, use_mask):
    model = _save_reference(tmp_path, config_kwargs, with_projection)
    ids, mask = _batch(config_kwargs, [6, 11], total=12)
    expected = _torch_outputs(model, ids, mask if use_mask else None)

    module, params = clip_text.load_clip_text(tmp_path)
    assert module.with_projection == with_projection
    apply = jax.jit(module.apply)
    got = apply({"params": params}, ids, mask) if use_mask else apply({"params": params}, ids)

    assert got.last_hidden_state.shape == (2, 12, config_kwargs["hidden_size"])
    assert len(got.hidden_states) == config_kwargs["num_hidden_layers"] + 1
    _assert_matches(got, expected)


def test_the_two_eos_conventions_pool_different_positions():
    """Same weights, same ids: eos_token_id 2 pools at argmax(ids), another at the first eos."""
    ids, mask = _batch(ODD_GELU, [6, 11], total=12)
    legacy = clip_text.pooled_positions(jnp.asarray(ids), 2)
    first_eos = clip_text.pooled_positions(jnp.asarray(ids), ODD_GELU["eos_token_id"])
    np.testing.assert_array_equal(first_eos, [5, 10])
    np.testing.assert_array_equal(legacy, np.argmax(ids, axis=-1))
    assert (legacy != first_eos).any()
    # A row without the eos token pools at position 0, as transformers does.
    no_eos = np.full((1, 4), 9, np.int32)
    assert int(clip_text.pooled_positions(jnp.asarray(no_eos), 7)[0]) == 0


def test_left_padding_matches_sdpa(tmp_path):
    """Left padding leaves the first queries with no visible key: zero attention output."""
    model = _save_reference(tmp_path, ODD_GELU, with_projection=True, seed=2)
    ids, mask = _batch(ODD_GELU, [5, 9], total=9, seed=2, left_pad=True)
    expected = _torch_outputs(model, ids, mask)
    module, params = clip_text.load_clip_text(tmp_path)
    _assert_matches(jax.jit(module.apply)({"params": params}, ids, mask), expected)


def test_mask_changes_output_and_padding_does_not_leak(tmp_path):
    _save_reference(tmp_path, TINY_QUICK_GELU, with_projection=False)
    module, params = clip_text.load_clip_text(tmp_path)
    apply = jax.jit(module.apply)
    ids, mask = _batch(TINY_QUICK_GELU, [6], total=10)
    other = ids.copy()
    other[:, 6:] = 50  # different padding tokens, masked
    a = apply({"params": params}, ids, mask).last_hidden_state
    b = apply({"params": params}, other, mask).last_hidden_state
    np.testing.assert_allclose(np.asarray(a[:, :6]), np.asarray(b[:, :6]), atol=0, rtol=0)
    unmasked = apply({"params": params}, other).last_hidden_state
    assert np.abs(np.asarray(unmasked[:, 7:] - b[:, 7:])).max() > 1e-3


def test_projection_is_a_loader_choice(tmp_path):
    model = _save_reference(tmp_path, TINY_QUICK_GELU, with_projection=True)
    ids, mask = _batch(TINY_QUICK_GELU, [7, 4], total=8)
    expected = _torch_outputs(model, ids, mask)
    module, params = clip_text.load_clip_text(tmp_path, with_projection=False)
    assert not module.with_projection and "text_projection" not in params
    got = jax.jit(module.apply)({"params": params}, ids, mask)
    _assert_matches(got, {**expected, "text_embeds": None})

    plain = tmp_path / "plain"
    _save_reference(plain, TINY_QUICK_GELU, with_projection=False)
    with pytest.raises(weights.WeightsError, match="text_projection.weight"):
        clip_text.load_clip_text(plain, with_projection=True)


def test_hub_layout_with_position_ids_buffer(tmp_path):
    """Hub CLIPTextModel checkpoints use the "text_model." prefix (transformers 5 saves it
    bare); those written before transformers 4.31 also hold the position_ids buffer."""
    model = _save_reference(tmp_path, TINY_QUICK_GELU, with_projection=False)
    tensors = weights.SafetensorsReader(tmp_path).as_dict()
    assert "final_layer_norm.weight" in tensors
    tensors = {f"text_model.{k}": np.array(v) for k, v in tensors.items()}
    tensors["text_model.embeddings.position_ids"] = np.arange(16, dtype=np.int64)[None]
    (tmp_path / "model.safetensors").unlink()
    weights.save_safetensors(tensors, tmp_path / "model.safetensors")
    ids, mask = _batch(TINY_QUICK_GELU, [5, 8], total=8)
    module, params = clip_text.load_clip_text(tmp_path)
    got = jax.jit(module.apply)({"params": params}, ids, mask)
    _assert_matches(got, _torch_outputs(model, ids, mask))


def test_config_from_saved_json(tmp_path):
    _save_reference(tmp_path, ODD_GELU, with_projection=True)
    raw = json.loads((tmp_path / "config.json").read_text())
    config = clip_text.CLIPTextConfig.from_dict(raw)
    assert config == clip_text.CLIPTextConfig(**ODD_GELU)
    assert config.head_dim == 8 and not config.legacy_pooling
    reference = transformers.CLIPTextConfig()
    defaults = clip_text.CLIPTextConfig()
    for name in ("vocab_size", "hidden_size", "projection_dim", "hidden_act", "eos_token_id"):
        assert getattr(defaults, name) == getattr(reference, name), name


def test_bad_config_is_named():
    error = clip_text.CLIPTextConfigError
    with pytest.raises(error, match="'num_expertz'"):
        clip_text.CLIPTextConfig.from_dict({**CLIP_L, "num_expertz": 4})
    with pytest.raises(error, match="text_config"):
        clip_text.CLIPTextConfig.from_dict({"model_type": "clip", "text_config": CLIP_L})
    with pytest.raises(error, match="eos_token_id"):
        clip_text.CLIPTextConfig.from_dict({**CLIP_L, "eos_token_id": [2, 3]})
    with pytest.raises(error, match="num_attention_heads"):
        clip_text.CLIPTextConfig(hidden_size=30, num_attention_heads=4)
    with pytest.raises(error, match="hidden_act"):
        clip_text.CLIPTextConfig(hidden_act="gelu_10")


def test_too_long_input_is_an_error():
    module = clip_text.CLIPTextEncoder(clip_text.CLIPTextConfig(**TINY_QUICK_GELU))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        jax.eval_shape(module.init, jax.random.key(0), jnp.ones((1, 17), jnp.int32))


def test_init_weight_map_logical_axes_and_export(tmp_path):
    config = clip_text.CLIPTextConfig(**ODD_GELU)
    module, params = clip_text.init_clip_text(config, jax.random.key(1), with_projection=True)
    assert set(weights._flatten(params)) == set(clip_text.weight_map(config, True))
    abstract = clip_text.abstract_variables(module)
    names = jax.tree.leaves(
        jax.tree.map(lambda x: x.names, abstract["params"], is_leaf=lambda x: hasattr(x, "names"))
    )
    assert set(names) - {None} <= {name for name, _ in sharding.LOGICAL_AXIS_RULES}

    # Exported with weight_map, the params load into transformers and agree.
    tensors = weights.export_state_dict(params, clip_text.weight_map(config, True))
    reference = transformers.CLIPTextModelWithProjection(transformers.CLIPTextConfig(**ODD_GELU))
    reference.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in tensors.items()})
    ids, mask = _batch(ODD_GELU, [9, 4], total=10)
    got = jax.jit(module.apply)({"params": params}, ids, mask)
    _assert_matches(got, _torch_outputs(reference.eval(), ids, mask))


def test_sharded_load_matches_unsharded(tmp_path):
    """fsdp=2 x tensor=2 x data=2 on the 8 forced CPU devices gives the same outputs."""
    model = _save_reference(tmp_path, TINY_QUICK_GELU, with_projection=True)
    ids, mask = _batch(TINY_QUICK_GELU, [9, 3], total=10)
    expected = _torch_outputs(model, ids, mask)
    mesh = sharding.make_mesh(
        sharding.MeshConfig(
            ici_data_parallelism=2, ici_fsdp_parallelism=2, ici_tensor_parallelism=2
        )
    )
    module, params = clip_text.load_clip_text(tmp_path, mesh=mesh)
    q_kernel = params["block_0"]["attention"]["q"]["kernel"]
    assert q_kernel.sharding.spec == jax.sharding.PartitionSpec(("fsdp", "context"), "tensor", None)
    with sharding.mesh_context(mesh):
        got = jax.jit(module.apply)({"params": params}, ids, mask)
    _assert_matches(got, expected)


def test_bfloat16_runs_close(tmp_path):
    model = _save_reference(tmp_path, TINY_QUICK_GELU, with_projection=True)
    ids, mask = _batch(TINY_QUICK_GELU, [9, 3], total=10)
    expected = _torch_outputs(model, ids, mask)
    module, params = clip_text.load_clip_text(tmp_path, dtype=jnp.bfloat16)
    got = jax.jit(module.apply)({"params": params}, ids, mask)
    assert got.last_hidden_state.dtype == jnp.bfloat16
    for name in ("last_hidden_state", "text_embeds"):
        value = np.asarray(getattr(got, name), np.float32)
        rel = np.abs(value - expected[name]).max() / np.abs(expected[name]).max()
        assert rel < 5e-2, f"{name}: bf16 relative error {rel:.2e}"


@pytest.mark.parametrize("name,with_projection", sorted(REAL_PARAMS), ids=str)
def test_real_config_parameter_count_matches_transformers(name, with_projection):
    config_kwargs = REAL_CONFIGS[name]
    with torch.device("meta"):
        reference = _reference_class(with_projection)(transformers.CLIPTextConfig(**config_kwargs))
    expected = sum(p.numel() for p in reference.parameters())
    ours = clip_text.count_params(clip_text.CLIPTextConfig(**config_kwargs), with_projection)
    assert ours == expected == REAL_PARAMS[(name, with_projection)]
