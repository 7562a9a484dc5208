"""Mesh shape resolution, logical-axis rules and parameter shardings (8 forced CPU devices)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from jax.sharding import PartitionSpec

from jaxcore import sharding
from jaxcore.sharding import MeshConfig, ShardingError, make_mesh, mesh_shape


def test_eight_forced_cpu_devices():
    assert jax.device_count() == 8


# --- mesh_shape -----------------------------------------------------------------------------


def test_default_puts_every_device_on_data():
    assert mesh_shape(MeshConfig(), 8) == {"data": 8, "fsdp": 1, "context": 1, "tensor": 1}


def test_minus_one_takes_the_remaining_devices():
    config = MeshConfig(ici_data_parallelism=1, ici_fsdp_parallelism=-1, ici_tensor_parallelism=2)
    assert mesh_shape(config, 8) == {"data": 1, "fsdp": 4, "context": 1, "tensor": 2}


def test_dcn_sizes_multiply_ici_sizes():
    # 2 slices of 4 devices: data across slices, fsdp inside each slice.
    config = MeshConfig(ici_data_parallelism=1, ici_fsdp_parallelism=-1, dcn_data_parallelism=-1)
    assert mesh_shape(config, 8, num_slices=2) == {"data": 2, "fsdp": 4, "context": 1, "tensor": 1}
    config = MeshConfig(ici_data_parallelism=2, ici_context_parallelism=2, dcn_data_parallelism=2)
    assert mesh_shape(config, 8, num_slices=2) == {"data": 4, "fsdp": 1, "context": 2, "tensor": 1}


@pytest.mark.parametrize(
    ("config", "num_slices", "message"),
    [
        (
            MeshConfig(ici_data_parallelism=-1, ici_fsdp_parallelism=-1),
            1,
            "only one of ici_data_parallelism, ici_fsdp_parallelism may be -1",
        ),
        (MeshConfig(ici_tensor_parallelism=0), 1, "ici_tensor_parallelism must be >= 1 or -1"),
        (MeshConfig(ici_context_parallelism=3), 1, "ici parallelism product 3 does not divide"),
        (
            MeshConfig(ici_data_parallelism=2, ici_tensor_parallelism=2),
            1,
            "ici mesh .* uses 4 devices but 8 are available",
        ),
        (MeshConfig(dcn_fsdp_parallelism=3), 2, "dcn parallelism product 3 does not divide"),
        (MeshConfig(), 3, "8 devices do not split into 3 slices"),
    ],
)
def test_bad_mesh_configs_name_the_parameter(config, num_slices, message):
    with pytest.raises(ShardingError, match=message):
        mesh_shape(config, 8, num_slices=num_slices)


def test_make_mesh_has_the_four_named_axes_in_order():
    mesh = make_mesh(
        MeshConfig(ici_data_parallelism=2, ici_fsdp_parallelism=2, ici_tensor_parallelism=2)
    )
    assert mesh.axis_names == sharding.MESH_AXES
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "context": 1, "tensor": 2}
    assert sorted(d.id for d in mesh.devices.flat) == list(range(8))
    sub = make_mesh(MeshConfig(ici_data_parallelism=-1), devices=jax.devices()[:4])
    assert dict(sub.shape)["data"] == 4


# --- rules ----------------------------------------------------------------------------------


def test_logical_to_spec_follows_the_rules():
    spec = sharding.logical_to_spec(("activation_batch", "activation_length", "activation_embed"))
    assert spec == PartitionSpec(("data", "fsdp"), "context", None)
    assert sharding.logical_to_spec(("embed", "mlp")) == PartitionSpec(
        ("fsdp", "context"), "tensor"
    )


def test_axis_rules_overrides_and_unknown_names():
    rules = dict(sharding.axis_rules([("activation_length", None), ("embed", ["fsdp", "data"])]))
    assert rules["activation_length"] is None
    assert rules["embed"] == ("fsdp", "data")
    assert rules["mlp"] == "tensor"  # untouched
    with pytest.raises(ShardingError, match="unknown logical axis 'activation_lenght'"):
        sharding.axis_rules([("activation_lenght", None)])


class _TinyModule(nn.Module):
    """A Dense kernel boxed with logical names, an unboxed bias and a replicated norm scale."""

    @nn.compact
    def __call__(self, x):
        kernel = self.param(
            "kernel", nn.with_logical_partitioning(nn.initializers.ones, ("embed", "mlp")), (8, 16)
        )
        bias = self.param("bias", nn.initializers.zeros, (16,))
        scale = self.param(
            "scale", nn.with_logical_partitioning(nn.initializers.ones, ("norm",)), (16,)
        )
        return (x @ kernel + bias) * scale


def test_param_shardings_on_a_flax_module():
    mesh = make_mesh(
        MeshConfig(ici_data_parallelism=2, ici_fsdp_parallelism=2, ici_tensor_parallelism=2)
    )
    abstract = jax.eval_shape(_TinyModule().init, jax.random.key(0), jnp.ones((4, 8)))
    shardings = sharding.param_shardings(mesh, abstract)["params"]
    assert shardings["kernel"].spec == PartitionSpec(("fsdp", "context"), "tensor")
    assert shardings["bias"].spec == PartitionSpec()
    assert shardings["scale"].spec == PartitionSpec(None)

    # The shardings place real parameters: each device holds a quarter-by-half tile.
    params = jax.device_put(
        nn.unbox(_TinyModule().init(jax.random.key(0), jnp.ones((4, 8)))), {"params": shardings}
    )
    kernel = params["params"]["kernel"]
    assert {s.data.shape for s in kernel.addressable_shards} == {(4, 8)}
    np.testing.assert_array_equal(np.asarray(kernel), np.ones((8, 16)))


def test_param_shardings_with_overridden_rules():
    mesh = make_mesh(
        MeshConfig(ici_data_parallelism=2, ici_fsdp_parallelism=2, ici_tensor_parallelism=2)
    )
    abstract = jax.eval_shape(_TinyModule().init, jax.random.key(0), jnp.ones((4, 8)))
    rules = sharding.axis_rules([("embed", None), ("mlp", ("fsdp", "tensor"))])
    kernel = sharding.param_shardings(mesh, abstract, rules)["params"]["kernel"]
    assert kernel.spec == PartitionSpec(None, ("fsdp", "tensor"))


def test_weights_shard_over_context_only_where_the_width_divides():
    """embed spans fsdp and context; the context axis is dropped from a dimension that
    fsdp x context does not divide (replicated over context: correct, only more memory), and
    the first axis is kept even where it does not divide, so a model that cannot shard over
    fsdp fails at placement instead of silently replicating."""
    mesh = make_mesh(
        MeshConfig(ici_data_parallelism=1, ici_fsdp_parallelism=2, ici_context_parallelism=4)
    )
    spec = PartitionSpec(("fsdp", "context"), "tensor")
    assert sharding.divisible_spec(mesh, spec, (16, 8)) == spec
    assert sharding.divisible_spec(mesh, spec, (6, 8)) == PartitionSpec("fsdp", "tensor")
    assert sharding.divisible_spec(mesh, spec, (3, 8)) == PartitionSpec("fsdp", "tensor")
    assert sharding.divisible_spec(mesh, PartitionSpec(None, "tensor"), (3, 5)) == PartitionSpec(
        None, "tensor"
    )

    def boxed(rows):
        init = nn.with_logical_partitioning(nn.initializers.ones, ("embed", "mlp"))
        return {"kernel": jax.eval_shape(lambda: init(jax.random.key(0), (rows, 16)))}

    assert sharding.param_shardings(mesh, boxed(6))["kernel"].spec == PartitionSpec(
        "fsdp", "tensor"
    )
    shardings = sharding.param_shardings(mesh, boxed(8))
    placed = jax.device_put({"kernel": np.ones((8, 16), np.float32)}, shardings)
    assert {s.data.shape for s in placed["kernel"].addressable_shards} == {(1, 16)}


# --- divisibility ---------------------------------------------------------------------------


def test_check_divisible_messages():
    mesh = make_mesh(
        MeshConfig(ici_data_parallelism=2, ici_fsdp_parallelism=2, ici_tensor_parallelism=2)
    )
    assert sharding.batch_axis_size(mesh) == 4
    sharding.check_divisible(mesh, batch=8, heads=4)  # fits: no error
    with pytest.raises(ShardingError, match=r"batch size 6 .* \(data x fsdp = 4\)"):
        sharding.check_divisible(mesh, batch=6)
    with pytest.raises(ShardingError, match="num_attention_heads 3 .* ici_tensor_parallelism 2"):
        sharding.check_divisible(mesh, heads=3)


def test_constrain_is_a_no_op_outside_a_mesh_and_shards_inside():
    x = jnp.arange(16.0).reshape(4, 4)
    np.testing.assert_array_equal(sharding.constrain(x, ("activation_batch", None)), x)

    mesh = make_mesh(MeshConfig(ici_data_parallelism=2, ici_fsdp_parallelism=4))

    @jax.jit
    def f(x):
        return sharding.constrain(x * 2, ("activation_batch", None))

    # jax.set_mesh, not the deprecated `with mesh:` (under which flax constraints are no-ops).
    with jax.set_mesh(mesh), nn.logical_axis_rules(sharding.LOGICAL_AXIS_RULES):
        y = f(jnp.arange(64.0).reshape(8, 8))
    assert y.sharding.spec == PartitionSpec(("data", "fsdp"))
    assert {s.data.shape for s in y.addressable_shards} == {(1, 8)}
    np.testing.assert_array_equal(np.asarray(y), np.arange(64.0).reshape(8, 8) * 2)


@pytest.mark.parametrize(
    "given, batch, want, moved",
    [
        # as MaxDiffusion's Wan 14B training (global batch 1 on 4 fsdp chips), on 8
        (MeshConfig(ici_data_parallelism=1, ici_fsdp_parallelism=8), 1, (1, 1, 8, 1), True),
        (MeshConfig(ici_data_parallelism=2, ici_fsdp_parallelism=4), 4, (2, 2, 2, 1), True),
        (MeshConfig(ici_fsdp_parallelism=-1, ici_data_parallelism=1), 2, (1, 2, 4, 1), True),
        (MeshConfig(ici_data_parallelism=1, ici_fsdp_parallelism=8), 8, (1, 8, 1, 1), False),
        # not even the data axis divides: left for check_divisible to name
        (MeshConfig(ici_data_parallelism=8), 4, (8, 1, 1, 1), False),
    ],
)
def test_a_batch_smaller_than_its_axes_folds_fsdp_into_context(given, batch, want, moved):
    folded, note = sharding.fold_batch_into_context(given, batch, 8)
    assert tuple(sharding.mesh_shape(folded, 8).values()) == want
    assert (note is not None) == moved
    if moved:
        assert f"global batch {batch}" in note
        assert batch % sharding.batch_axis_size(sharding.make_mesh(folded)) == 0


def test_param_shardings_inside_an_active_mesh():
    """Models are built inside ``mesh_context``; reading the boxed shapes there must not
    constrain them to the mesh (flax's unbox would, and abstract values cannot be)."""
    mesh = make_mesh(MeshConfig(ici_data_parallelism=1, ici_fsdp_parallelism=8))
    abstract = jax.eval_shape(_TinyModule().init, jax.random.key(0), jnp.ones((4, 8)))
    with sharding.mesh_context(mesh):
        kernel = sharding.param_shardings(mesh, abstract)["params"]["kernel"]
    assert kernel.spec == PartitionSpec(("fsdp", "context"), "tensor")
