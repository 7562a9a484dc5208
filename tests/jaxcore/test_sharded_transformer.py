"""The tiny Wan transformer sharded over 8 CPU devices equals the unsharded dot_product run.

Parameters are placed with ``sharding.param_shardings``, inputs with the batch sharding, and
the forward pass is jitted under ``jax.set_mesh(mesh)`` + ``nn.logical_axis_rules`` (the
deprecated ``with mesh:`` leaves flax's sharding constraints as no-ops).

Tolerance: fp32, max abs diff <= ``ATOL = 1e-5`` on outputs of magnitude ~1 (reached ~1e-6).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from jax.sharding import NamedSharding, PartitionSpec

from jaxcore import sharding
from jaxcore.models import wan_transformer as wt
from jaxcore.sharding import MeshConfig, ShardingError, make_mesh

ATOL = 1e-5
BATCH = 8  # divisible by every batch split below (up to fsdp = 8)
# 4 heads: split by tensor 2, or whole heads for each of 4 ulysses context shards.
CONFIG = wt.WanTransformerConfig(
    num_layers=2,
    attention_head_dim=8,
    num_attention_heads=4,
    in_channels=4,
    out_channels=4,
    text_dim=16,
    freq_dim=16,
    ffn_dim=48,
    patch_size=(1, 2, 2),
    rope_max_seq_len=16,
)
# 3 x 3 x 2 = 18 video tokens and 5 text tokens: neither divides by a context size of 4,
# so the backends pad (and mask) inside.
VIDEO_SHAPE = (BATCH, 4, 3, 6, 4)
TEXT_LEN = 5

MESHES = {
    "dp2_fsdp2_tp2": MeshConfig(
        ici_data_parallelism=2, ici_fsdp_parallelism=2, ici_tensor_parallelism=2
    ),
    "fsdp8": MeshConfig(ici_data_parallelism=1, ici_fsdp_parallelism=8),
    "dp2_context4": MeshConfig(ici_data_parallelism=2, ici_context_parallelism=4),
}
# (mesh, attention backend, an HLO op that proves the sharded path ran)
CASES = [
    ("dp2_fsdp2_tp2", "dot_product", "all-reduce"),
    ("dp2_fsdp2_tp2", "flash", "all-reduce"),
    ("fsdp8", "dot_product", "all-gather"),
    ("dp2_context4", "ulysses", "all-to-all"),
    ("dp2_context4", "ring", "collective-permute"),
]


@pytest.fixture(scope="module")
def inputs():
    rng = np.random.default_rng(0)
    video = jnp.asarray(rng.normal(size=VIDEO_SHAPE), jnp.float32)
    timestep = jnp.asarray(rng.uniform(0, 1000, size=(BATCH,)), jnp.float32)
    text = jnp.asarray(rng.normal(size=(BATCH, TEXT_LEN, CONFIG.text_dim)), jnp.float32)
    return video, timestep, text


@pytest.fixture(scope="module")
def params():
    _, params = wt.init_wan_transformer(CONFIG, jax.random.key(0))
    return params


@pytest.fixture(scope="module")
def expected(params, inputs):
    module = wt.WanTransformer(CONFIG)
    return np.asarray(jax.jit(module.apply)({"params": params}, *inputs))


def _place(mesh, module, params, inputs):
    """Params on their logical shardings, inputs split over the batch axes."""
    shardings = nn.meta.unbox(sharding.param_shardings(mesh, wt.abstract_params(module)))
    placed = jax.device_put(params, shardings)
    batch = NamedSharding(mesh, sharding.logical_to_spec(("activation_batch",)))
    return placed, jax.device_put(inputs, batch)


def _sharded_apply(mesh, module, params, inputs):
    """Compile and run under the mesh and rules; returns (output, compiled HLO text)."""
    with jax.set_mesh(mesh), nn.logical_axis_rules(sharding.LOGICAL_AXIS_RULES):
        compiled = jax.jit(module.apply).lower({"params": params}, *inputs).compile()
        out = compiled({"params": params}, *inputs)
    return out, compiled.as_text()


@pytest.mark.parametrize(("mesh_name", "backend", "collective"), CASES)
def test_sharded_transformer_equals_unsharded(
    mesh_name, backend, collective, params, inputs, expected
):
    mesh = make_mesh(MESHES[mesh_name])
    module = wt.WanTransformer(CONFIG, attention=backend, mesh=mesh)
    placed_params, placed_inputs = _place(mesh, module, params, inputs)
    q_kernel = placed_params["blocks_0"]["attn1"]["to_q"]["kernel"]
    assert q_kernel.sharding.spec == PartitionSpec(("fsdp", "context"), "tensor")

    out, hlo = _sharded_apply(mesh, module, placed_params, placed_inputs)
    assert collective in hlo, f"no {collective} in the compiled program: not sharded?"
    assert out.sharding.num_devices == 8
    assert out.shape == expected.shape
    diff = float(np.max(np.abs(np.asarray(out) - expected)))
    assert diff < ATOL, f"{mesh_name}/{backend}: max abs diff {diff}"


def test_flash_unsharded_equals_dot_product(params, inputs, expected):
    module = wt.WanTransformer(CONFIG, attention="flash")
    out = jax.jit(module.apply)({"params": params}, *inputs)
    assert float(np.max(np.abs(np.asarray(out) - expected))) < ATOL


def _init_shapes(module, batch: int):
    """Trace init on a batch of ``batch`` one-frame 4x4 videos (shape checks fire here)."""
    video = jnp.zeros((batch, CONFIG.in_channels, 1, 4, 4))
    text = jnp.zeros((batch, 3, CONFIG.text_dim))
    return jax.eval_shape(module.init, jax.random.key(0), video, jnp.zeros(batch), text)


def test_loading_helpers_work_with_a_mesh_and_a_sharded_backend():
    """abstract_params traces with a batch of 1: the backends must not refuse it."""
    mesh = make_mesh(MESHES["dp2_context4"])
    module = wt.WanTransformer(CONFIG, attention="ring", mesh=mesh)
    boxed = wt.abstract_params(module)
    assert boxed["blocks_0"]["attn1"]["to_q"]["kernel"].value.shape == (32, 32)


def test_ulysses_heads_not_divisible_by_context_is_a_sharding_error():
    config = wt.WanTransformerConfig(**{**CONFIG.to_dict(), "num_attention_heads": 2})
    mesh = make_mesh(MESHES["dp2_context4"])
    module = wt.WanTransformer(config, attention="ulysses", mesh=mesh)
    with pytest.raises(ShardingError, match="num_attention_heads .* ici_context_parallelism 4"):
        _init_shapes(module, 2)


@pytest.mark.parametrize(
    ("heads", "batch", "message"),
    [(3, 4, "num_attention_heads 3 .* ici_tensor_parallelism 2"), (4, 2, "batch size 2")],
)
def test_model_refuses_sizes_that_do_not_divide_the_mesh(heads, batch, message):
    config = wt.WanTransformerConfig(**{**CONFIG.to_dict(), "num_attention_heads": heads})
    mesh = make_mesh(MESHES["dp2_fsdp2_tp2"])
    module = wt.WanTransformer(config, attention="dot_product", mesh=mesh)
    with pytest.raises(ShardingError, match=message):
        _init_shapes(module, batch)
