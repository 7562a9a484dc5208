"""UMT5 encoder vs transformers' UMT5EncoderModel (random tiny models, fp32, same weights)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from jaxcore import sharding, weights
from jaxcore.models import umt5

# fp32 on CPU with highest matmul precision (conftest); reached 1.4e-6 max abs (|out| ~3).
ATOL = 2e-5

TINY = dict(
    vocab_size=128,
    d_model=32,
    d_kv=8,
    d_ff=64,
    num_layers=2,
    num_heads=4,
    relative_attention_num_buckets=8,
    relative_attention_max_distance=16,
)
# Different depth and buckets, explicit gated-gelu (tanh gelu), non-default eps.
TINY_3L = dict(
    TINY,
    num_layers=3,
    relative_attention_num_buckets=12,
    relative_attention_max_distance=20,
    feed_forward_proj="gated-gelu",
    layer_norm_epsilon=1e-5,
)
# Non-gated relu MLP (the "wi" path).
TINY_RELU = dict(TINY, feed_forward_proj="relu", num_layers=1)


def _save_reference(tmp_path, config_kwargs, seed=0):
    torch.manual_seed(seed)
    model = transformers.UMT5EncoderModel(transformers.UMT5Config(**config_kwargs)).eval()
    # Random-init layer norms are ones; perturb them so a wrong mapping cannot pass.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "layer_norm" in name:
                param.add_(0.1 * torch.randn_like(param))
    model.save_pretrained(tmp_path)
    return model


def _padded_batch(vocab_size, lengths, total, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(2, vocab_size, size=(len(lengths), total)).astype(np.int32)
    mask = (np.arange(total)[None, :] < np.asarray(lengths)[:, None]).astype(np.int32)
    ids = np.where(mask > 0, ids, 0)
    return ids, mask


def _torch_hidden(model, ids, mask):
    with torch.no_grad():
        out = model(torch.from_numpy(ids).long(), torch.from_numpy(mask).long())
    return out.last_hidden_state.numpy()


@pytest.mark.parametrize("config_kwargs", [TINY, TINY_3L, TINY_RELU], ids=["2l", "3l", "relu"])
def test_matches_transformers_on_padded_batch(tmp_path, config_kwargs):
    model = _save_reference(tmp_path, config_kwargs)
    ids, mask = _padded_batch(config_kwargs["vocab_size"], [23, 7, 1], total=23)
    expected = _torch_hidden(model, ids, mask)

    module, params = umt5.load_umt5(tmp_path)
    got = np.asarray(jax.jit(module.apply)({"params": params}, ids, mask))

    assert got.shape == expected.shape == (3, 23, config_kwargs["d_model"])
    err = np.abs(got - expected).max()
    assert err < ATOL, f"max abs error {err:.2e}"
    # The padded positions are computed too (and matter only to the mask semantics).
    assert np.abs(got[1, 7:] - expected[1, 7:]).max() < ATOL


def test_mask_changes_output(tmp_path):
    """Guards against a mask that is silently ignored."""
    _save_reference(tmp_path, TINY)
    module, params = umt5.load_umt5(tmp_path)
    ids, mask = _padded_batch(128, [10], total=10)
    short = mask.copy()
    short[:, 5:] = 0
    apply = jax.jit(module.apply)
    full = apply({"params": params}, ids, mask)
    masked = apply({"params": params}, ids, short)
    assert np.abs(np.asarray(full[:, :5] - masked[:, :5])).max() > 1e-3


@pytest.mark.parametrize(
    "num_buckets,max_distance,length", [(8, 16, 40), (12, 20, 33), (32, 128, 512)]
)
def test_relative_position_buckets_match_reference(num_buckets, max_distance, length):
    config = transformers.UMT5Config(
        relative_attention_num_buckets=num_buckets, relative_attention_max_distance=max_distance
    )
    attention = transformers.models.umt5.modeling_umt5.UMT5Attention(
        config, has_relative_attention_bias=True
    )
    pos = torch.arange(length)
    expected = attention._relative_position_bucket(pos[None, :] - pos[:, None]).numpy()
    got = umt5.relative_position_buckets(length, num_buckets, max_distance)
    np.testing.assert_array_equal(got, expected)
    assert got.max() == num_buckets - 1 and got.min() == 0


def test_tied_embedding_under_either_key(tmp_path):
    model = _save_reference(tmp_path, TINY)
    ids, mask = _padded_batch(128, [9, 4], total=9)
    expected = _torch_hidden(model, ids, mask)
    # Rewrite the checkpoint with the encoder's name for the tied embedding only.
    tensors = weights.SafetensorsReader(tmp_path).as_dict()
    tensors["encoder.embed_tokens.weight"] = np.array(tensors.pop("shared.weight"))
    (tmp_path / "model.safetensors").unlink()
    weights.save_safetensors(tensors, tmp_path / "model.safetensors")
    module, params = umt5.load_umt5(tmp_path)
    got = np.asarray(jax.jit(module.apply)({"params": params}, ids, mask))
    assert np.abs(got - expected).max() < ATOL


def test_missing_embedding_is_named(tmp_path):
    _save_reference(tmp_path, TINY)
    tensors = weights.SafetensorsReader(tmp_path).as_dict()
    tensors = {k: np.array(v) for k, v in tensors.items() if k != "shared.weight"}
    (tmp_path / "model.safetensors").unlink()
    weights.save_safetensors(tensors, tmp_path / "model.safetensors")
    with pytest.raises(weights.WeightsError, match="shared.weight"):
        umt5.load_umt5(tmp_path)


def test_config_from_saved_json(tmp_path):
    _save_reference(tmp_path, TINY_3L)
    raw = json.loads((tmp_path / "config.json").read_text())
    config = umt5.UMT5Config.from_dict(raw)
    assert config.num_layers == 3 and config.relative_attention_num_buckets == 12
    assert config.activation_name == "gelu_new" and config.is_gated


def test_unknown_config_key_is_named():
    with pytest.raises(umt5.UMT5ConfigError, match="'num_expertz'"):
        umt5.UMT5Config.from_dict({**TINY, "num_expertz": 4})


def test_inconsistent_or_unsupported_config_is_an_error():
    with pytest.raises(umt5.UMT5ConfigError, match="dense_act_fn"):
        umt5.UMT5Config.from_dict({**TINY, "dense_act_fn": "relu"})
    with pytest.raises(umt5.UMT5ConfigError, match="is_decoder"):
        umt5.UMT5Config.from_dict({**TINY, "is_decoder": True})
    with pytest.raises(umt5.UMT5ConfigError, match="feed_forward_proj"):
        umt5.UMT5Config(feed_forward_proj="gated-swish-x")
    with pytest.raises(umt5.UMT5ConfigError, match="relative_attention_max_distance"):
        umt5.UMT5Config(relative_attention_num_buckets=32, relative_attention_max_distance=8)


def test_init_and_logical_axes():
    config = umt5.UMT5Config(**TINY)
    module, params = umt5.init_umt5(config, jax.random.key(1))
    out = jax.jit(module.apply)({"params": params}, jnp.ones((2, 5), jnp.int32), jnp.ones((2, 5)))
    assert out.shape == (2, 5, 32) and bool(jnp.isfinite(out).all())
    flat = weights._flatten(params)
    assert set(flat) == set(umt5.weight_map(config))
    abstract = umt5.abstract_variables(module)
    specs = jax.tree.leaves(
        jax.tree.map(
            lambda x: x.names,
            abstract["params"],
            is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec) or hasattr(x, "names"),
        )
    )
    known = {name for name, _ in sharding.LOGICAL_AXIS_RULES}
    assert set(specs) <= known


def test_sharded_load_matches_unsharded(tmp_path):
    """fsdp=2 x tensor=2 x data=2 on the 8 forced CPU devices gives the same output."""
    model = _save_reference(tmp_path, TINY)
    ids, mask = _padded_batch(128, [12, 3], total=12)
    expected = _torch_hidden(model, ids, mask)
    mesh = sharding.make_mesh(
        sharding.MeshConfig(
            ici_data_parallelism=2, ici_fsdp_parallelism=2, ici_tensor_parallelism=2
        )
    )
    module, params = umt5.load_umt5(tmp_path, mesh=mesh)
    q_kernel = params["block_0"]["attention"]["q"]["kernel"]
    assert q_kernel.sharding.spec == jax.sharding.PartitionSpec(("fsdp", "context"), "tensor", None)
    with sharding.mesh_context(mesh):  # activation constraints live, unlike under `with mesh:`
        got = np.asarray(jax.jit(module.apply)({"params": params}, ids, mask))
    assert np.abs(got - expected).max() < ATOL


def test_bfloat16_runs_close(tmp_path):
    model = _save_reference(tmp_path, TINY)
    ids, mask = _padded_batch(128, [8, 5], total=8)
    expected = _torch_hidden(model, ids, mask)
    module, params = umt5.load_umt5(tmp_path, dtype=jnp.bfloat16)
    got = jax.jit(module.apply)({"params": params}, ids, mask)
    assert got.dtype == jnp.bfloat16
    rel = np.abs(np.asarray(got, np.float32) - expected).max() / np.abs(expected).max()
    assert rel < 5e-2, f"bf16 relative error {rel:.2e}"
