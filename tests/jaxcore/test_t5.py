"""T5 encoder vs transformers' T5EncoderModel (random tiny models, fp32, same weights).

UMT5 is the same implementation with ``model_type="umt5"``; tests/jaxcore/test_umt5.py covers
it through the compatibility module, and one test here loads a UMT5 checkpoint through t5.
"""

import json

import jax
import numpy as np
import pytest
import torch
import transformers
from flax import linen as nn

from jaxcore import sharding, weights
from jaxcore.models import t5, umt5

# fp32 on CPU with highest matmul precision (conftest); reached 5.7e-6 max abs (odd-gated-gelu,
# 4 layers; the others 1.6e-6 to 2.5e-6) with |out| ~4.
ATOL = 2e-5

# T5 v1.1 layout (gated-gelu, tanh gelu), tiny.
TINY = dict(
    vocab_size=128,
    d_model=32,
    d_kv=8,
    d_ff=64,
    num_layers=2,
    num_heads=4,
    relative_attention_num_buckets=8,
    relative_attention_max_distance=16,
    feed_forward_proj="gated-gelu",
)
# Original T5 layout (non-gated relu MLP, the "wi" path) at odd sizes: 3 heads of 5, d_model 24,
# 3 layers sharing block_0's bias table, non-default eps.
ODD_RELU = dict(
    vocab_size=101,
    d_model=24,
    d_kv=5,
    d_ff=40,
    num_layers=3,
    num_heads=3,
    relative_attention_num_buckets=12,
    relative_attention_max_distance=20,
    feed_forward_proj="relu",
    layer_norm_epsilon=1e-5,
)
# Odd sizes with the gated MLP; plain (non-gated) exact gelu.
ODD_GATED = dict(ODD_RELU, feed_forward_proj="gated-gelu", num_layers=4, d_ff=36)
PLAIN_GELU = dict(TINY, feed_forward_proj="gelu", num_layers=1)

# google/t5-v1_1-xxl (Flux's text_encoder_2) and umt5-xxl as Wan 2.1 ships it.
T5_V1_1_XXL = dict(
    vocab_size=32128,
    d_model=4096,
    d_kv=64,
    d_ff=10240,
    num_layers=24,
    num_heads=64,
    relative_attention_num_buckets=32,
    relative_attention_max_distance=128,
    feed_forward_proj="gated-gelu",
    layer_norm_epsilon=1e-6,
)
UMT5_XXL_WAN = dict(T5_V1_1_XXL, vocab_size=256384)
# Parameter counts transformers reports on the meta device (the tied embedding counted once).
T5_V1_1_XXL_PARAMS = 4_762_310_656
UMT5_XXL_WAN_PARAMS = 5_680_910_336


def _perturb(model):
    """Every parameter moves off its init (layer norms are ones at init), so a wrong
    mapping cannot pass."""
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn_like(param))
    return model


def _save_reference(tmp_path, config_kwargs, seed=0, umt5_model=False):
    torch.manual_seed(seed)
    if umt5_model:
        model = transformers.UMT5EncoderModel(transformers.UMT5Config(**config_kwargs))
    else:
        model = transformers.T5EncoderModel(transformers.T5Config(**config_kwargs))
    _perturb(model.eval())
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


@pytest.mark.parametrize(
    "config_kwargs",
    [TINY, ODD_RELU, ODD_GATED, PLAIN_GELU],
    ids=["v1.1-gated-gelu", "odd-relu", "odd-gated-gelu", "plain-gelu"],
)
def test_matches_transformers_on_padded_batch(tmp_path, config_kwargs):
    model = _save_reference(tmp_path, config_kwargs)
    # Longer than max_distance, so the logarithmic buckets are exercised too.
    ids, mask = _padded_batch(config_kwargs["vocab_size"], [29, 7, 1], total=29)
    expected = _torch_hidden(model, ids, mask)

    module, params = t5.load_t5_encoder(tmp_path)
    assert module.config.model_type == "t5" and not module.config.per_layer_position_bias
    got = np.asarray(jax.jit(module.apply)({"params": params}, ids, mask))

    assert got.shape == expected.shape == (3, 29, config_kwargs["d_model"])
    err = np.abs(got - expected).max()
    assert err < ATOL, f"max abs error {err:.2e}"


def test_without_mask_matches(tmp_path):
    model = _save_reference(tmp_path, TINY, seed=1)
    ids, mask = _padded_batch(128, [11, 11], total=11, seed=1)
    with torch.no_grad():
        expected = model(torch.from_numpy(ids).long()).last_hidden_state.numpy()
    module, params = t5.load_t5_encoder(tmp_path)
    got = np.asarray(jax.jit(module.apply)({"params": params}, ids))
    assert np.abs(got - expected).max() < ATOL


def test_only_the_first_block_has_a_bias_table(tmp_path):
    _save_reference(tmp_path, ODD_RELU)
    keys = weights.SafetensorsReader(tmp_path).keys()
    assert [k for k in keys if "relative_attention_bias" in k] == [
        "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
    ]
    _, params = t5.load_t5_encoder(tmp_path)
    assert "relative_attention_bias" in params["block_0"]["attention"]
    for i in range(1, ODD_RELU["num_layers"]):
        assert "relative_attention_bias" not in params[f"block_{i}"]["attention"]


def test_loads_a_umt5_checkpoint_by_model_type(tmp_path):
    """model_type "umt5" in config.json switches to one table per block."""
    model = _save_reference(tmp_path, dict(ODD_GATED, num_layers=2), umt5_model=True)
    ids, mask = _padded_batch(101, [13, 4], total=13)
    expected = _torch_hidden(model, ids, mask)
    module, params = t5.load_t5_encoder(tmp_path)
    assert module.config.per_layer_position_bias
    assert "relative_attention_bias" in params["block_1"]["attention"]
    got = np.asarray(jax.jit(module.apply)({"params": params}, ids, mask))
    assert np.abs(got - expected).max() < ATOL


def test_umt5_shim_refuses_a_t5_checkpoint(tmp_path):
    _save_reference(tmp_path, TINY)
    with pytest.raises(umt5.UMT5ConfigError, match="model_type"):
        umt5.load_umt5(tmp_path)


@pytest.mark.parametrize(
    "num_buckets,max_distance,length", [(8, 16, 40), (12, 20, 33), (32, 128, 512)]
)
def test_relative_position_buckets_match_reference(num_buckets, max_distance, length):
    pos = torch.arange(length)
    expected = transformers.models.t5.modeling_t5.T5Attention._relative_position_bucket(
        pos[None, :] - pos[:, None],
        bidirectional=True,
        num_buckets=num_buckets,
        max_distance=max_distance,
    ).numpy()
    got = t5.relative_position_buckets(length, num_buckets, max_distance)
    np.testing.assert_array_equal(got, expected)


def test_config_from_saved_json(tmp_path):
    _save_reference(tmp_path, ODD_RELU)
    raw = json.loads((tmp_path / "config.json").read_text())
    config = t5.T5Config.from_dict(raw)
    assert config == t5.T5Config(**ODD_RELU)
    assert config.activation_name == "relu" and not config.is_gated


def test_absent_keys_take_the_defaults_of_the_model_type():
    """As transformers: T5Config defaults to t5-small (relu), UMT5Config to umt5-small."""
    assert t5.T5Config.from_dict({}) == t5.T5Config()
    assert t5.T5Config().feed_forward_proj == transformers.T5Config().feed_forward_proj
    umt5_config = t5.T5Config.from_dict({"model_type": "umt5"})
    reference = transformers.UMT5Config()
    for name in t5.T5_DEFAULTS:
        assert getattr(umt5_config, name) == getattr(reference, name), name
    for name in t5.T5_DEFAULTS:
        assert getattr(t5.T5Config(), name) == getattr(transformers.T5Config(), name), name
    # The compatibility class keeps its UMT5 defaults.
    assert umt5.UMT5Config.from_dict({}) == umt5.UMT5Config()
    assert _architecture(umt5.UMT5Config()) == _architecture(umt5_config)


def _architecture(config):
    return {name: getattr(config, name) for name in (*t5.T5_DEFAULTS, "model_type")}


def test_bad_config_is_named():
    with pytest.raises(t5.T5ConfigError, match="'num_expertz'"):
        t5.T5Config.from_dict({**TINY, "num_expertz": 4})
    with pytest.raises(t5.T5ConfigError, match="model_type"):
        t5.T5Config.from_dict({**TINY, "model_type": "bart"})
    with pytest.raises(t5.T5ConfigError, match="model_type"):
        t5.T5Config(model_type="mt6")
    with pytest.raises(t5.T5ConfigError, match="is_gated_act"):
        t5.T5Config.from_dict({**TINY, "is_gated_act": False})


def test_weight_map_logical_axes_and_count():
    """Shapes only (eval_shape): the param tree equals the weight map for both variants."""
    for model_type in ("t5", "umt5"):
        config = t5.T5Config(**ODD_RELU, model_type=model_type)
        abstract = t5.abstract_variables(t5.T5Encoder(config))
        flat = weights._flatten(nn.meta.unbox(abstract)["params"])
        assert set(flat) == set(t5.weight_map(config))
        names = jax.tree.leaves(
            jax.tree.map(
                lambda x: x.names, abstract["params"], is_leaf=lambda x: hasattr(x, "names")
            )
        )
        assert set(names) <= {name for name, _ in sharding.LOGICAL_AXIS_RULES}
        tables = config.num_layers if model_type == "umt5" else 1
        embedding_and_final_norm = 101 * 24 + 24
        per_block = 4 * 24 * 15 + 2 * 24 * 40 + 2 * 24  # q k v o, wi wo, two norms
        assert t5.count_params(config) == (
            embedding_and_final_norm + tables * 12 * 3 + 3 * per_block
        )


def test_init_and_export_round_trip_into_transformers(tmp_path):
    """Random-init params written back with weight_map load into T5EncoderModel and agree."""
    config = t5.T5Config(**TINY)
    module, params = t5.init_t5_encoder(config, jax.random.key(3))
    tensors = weights.export_state_dict(params, t5.weight_map(config))
    model = transformers.T5EncoderModel(transformers.T5Config(**TINY)).eval()
    state = {k: torch.from_numpy(np.array(v)) for k, v in tensors.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert missing == ["encoder.embed_tokens.weight"] and not unexpected  # the tied twin
    ids, mask = _padded_batch(128, [9, 5], total=9)
    expected = _torch_hidden(model, ids, mask)
    got = np.asarray(jax.jit(module.apply)({"params": params}, ids, mask))
    assert np.abs(got - expected).max() < ATOL


def test_sharded_load_matches_unsharded(tmp_path):
    """fsdp=2 x tensor=2 x data=2 on the 8 forced CPU devices gives the same output."""
    config_kwargs = dict(TINY, num_heads=4)
    model = _save_reference(tmp_path, config_kwargs)
    ids, mask = _padded_batch(128, [12, 3], total=12)
    expected = _torch_hidden(model, ids, mask)
    mesh = sharding.make_mesh(
        sharding.MeshConfig(
            ici_data_parallelism=2, ici_fsdp_parallelism=2, ici_tensor_parallelism=2
        )
    )
    module, params = t5.load_t5_encoder(tmp_path, mesh=mesh)
    assert params["block_1"]["mlp"]["wi_0"]["kernel"].sharding.spec == jax.sharding.PartitionSpec(
        ("fsdp", "context"), "tensor"
    )
    with sharding.mesh_context(mesh):
        got = np.asarray(jax.jit(module.apply)({"params": params}, ids, mask))
    assert np.abs(got - expected).max() < ATOL


def _meta_param_count(model_class, config):
    with torch.device("meta"):
        model = model_class(config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    "config_kwargs,model_type,expected",
    [(T5_V1_1_XXL, "t5", T5_V1_1_XXL_PARAMS), (UMT5_XXL_WAN, "umt5", UMT5_XXL_WAN_PARAMS)],
    ids=["t5-v1_1-xxl", "umt5-xxl"],
)
def test_real_config_parameter_count_matches_transformers(config_kwargs, model_type, expected):
    if model_type == "t5":
        reference = _meta_param_count(
            transformers.T5EncoderModel, transformers.T5Config(**config_kwargs)
        )
    else:
        reference = _meta_param_count(
            transformers.UMT5EncoderModel, transformers.UMT5Config(**config_kwargs)
        )
    ours = t5.count_params(t5.T5Config(**config_kwargs, model_type=model_type))
    assert ours == reference == expected
