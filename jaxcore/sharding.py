"""Device mesh and logical-axis sharding rules: the one place where they live.

Models annotate only *logical* axis names (``nn.with_logical_partitioning`` for parameters,
``nn.with_logical_constraint`` / :func:`constrain` for activations). This module maps those
names to the physical mesh axes ``data``, ``fsdp``, ``context`` and ``tensor``. The mapping is
data (``LOGICAL_AXIS_RULES``), overridable from config, never code spread across models.

Mesh sizes use MaxDiffusion's names: ``ici_*_parallelism`` inside a slice and ``dcn_*`` across
slices; ``-1`` means "the rest of the devices".
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Sequence

import jax
import numpy as np
from flax import linen as nn
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES: tuple[str, ...] = ("data", "fsdp", "context", "tensor")

# Logical name -> mesh axis (or tuple of axes, or None = replicated).
# Activations use the ``activation_*`` names, parameters the plain ones.
LOGICAL_AXIS_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    # activations
    ("activation_batch", ("data", "fsdp")),
    ("activation_length", "context"),
    ("activation_kv_length", None),
    ("activation_heads", "tensor"),
    ("activation_kv", None),
    ("activation_embed", None),
    ("activation_mlp", "tensor"),
    ("activation_channels", None),
    ("activation_frames", None),
    ("activation_height", None),
    ("activation_width", None),
    # parameters. ``embed`` spans fsdp AND context (ZeRO-3 over both, as MaxText's and
    # MaxDiffusion's Wan rules do): context parallelism exists for sequences too long for one
    # chip, and those runs are the ones whose replicated weights do not fit (Wan 14B train at
    # global batch 1 on a v5p-8: 49 GiB per chip sharded over context, not fitting replicated;
    # A14B generate on a tpu7x-8: 41.5 GiB vs 113 GiB). With context 1 nothing changes.
    ("embed", ("fsdp", "context")),
    ("heads", "tensor"),
    ("kv", None),
    ("mlp", "tensor"),
    ("vocab", None),
    ("norm", None),
    ("conv_in", None),
    ("conv_out", None),
    ("conv_spatial", None),
    ("relpos_buckets", None),
    ("modulation", None),
)


class ShardingError(ValueError):
    """A mesh or sharding request that cannot be satisfied; the message names the axis."""


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Mesh shape, MaxDiffusion names. -1 in one ici field = all remaining devices."""

    ici_data_parallelism: int = -1
    ici_fsdp_parallelism: int = 1
    ici_context_parallelism: int = 1
    ici_tensor_parallelism: int = 1
    dcn_data_parallelism: int = -1
    dcn_fsdp_parallelism: int = 1
    dcn_context_parallelism: int = 1
    dcn_tensor_parallelism: int = 1

    @classmethod
    def implied_by_overrides(cls, given, current) -> dict:
        """An axis set to -1 on the command line takes the "remaining devices" role from the
        YAML's -1 axis of the same kind (ici or dcn), which becomes 1: MaxDiffusion users type
        ``ici_fsdp_parallelism=-1`` over a YAML whose data axis is -1. Two -1 axes given on
        the command line still conflict (:func:`mesh_shape` names them)."""
        implied = {}
        for kind in ("ici", "dcn"):
            names = [f"{kind}_{axis}_parallelism" for axis in MESH_AXES]
            if not any(given.get((name,)) == -1 for name in names):
                continue
            for name in names:
                if (name,) not in given and current.get(name) == -1:
                    implied[(name,)] = 1
        return implied


def _fill_auto(sizes: Sequence[int], total: int, what: str) -> list[int]:
    sizes = list(sizes)
    autos = [i for i, s in enumerate(sizes) if s == -1]
    if len(autos) > 1:
        names = ", ".join(f"{what}_{MESH_AXES[i]}_parallelism" for i in autos)
        raise ShardingError(f"only one of {names} may be -1")
    for i, s in enumerate(sizes):
        if s == 0 or s < -1:
            raise ShardingError(f"{what}_{MESH_AXES[i]}_parallelism must be >= 1 or -1, got {s}")
    known = math.prod(s for s in sizes if s != -1)
    if autos:
        if total % known:
            raise ShardingError(
                f"{what} parallelism product {known} does not divide the {total} devices"
            )
        sizes[autos[0]] = total // known
    if math.prod(sizes) != total:
        raise ShardingError(
            f"{what} mesh {dict(zip(MESH_AXES, sizes, strict=True))} uses {math.prod(sizes)} "
            f"devices but {total} are available"
        )
    return sizes


def _sizes(config: MeshConfig, kind: str) -> list[int]:
    """The config's ``ici`` or ``dcn`` sizes in MESH_AXES order (-1 unresolved)."""
    return [getattr(config, f"{kind}_{axis}_parallelism") for axis in MESH_AXES]


def _resolved(config: MeshConfig, num_devices: int, num_slices: int):
    """({axis: dcn size}, {axis: ici size}) with every -1 resolved."""
    if num_devices % num_slices:
        raise ShardingError(f"{num_devices} devices do not split into {num_slices} slices")
    dcn = _fill_auto(_sizes(config, "dcn"), num_slices, "dcn")
    ici = _fill_auto(_sizes(config, "ici"), num_devices // num_slices, "ici")
    return dict(zip(MESH_AXES, dcn, strict=True)), dict(zip(MESH_AXES, ici, strict=True))


def mesh_shape(config: MeshConfig, num_devices: int, num_slices: int = 1) -> dict[str, int]:
    """Resolve -1 entries; returns {axis: size} with the product equal to num_devices."""
    dcn, ici = _resolved(config, num_devices, num_slices)
    return {axis: dcn[axis] * ici[axis] for axis in MESH_AXES}


def fold_batch_into_context(
    config: MeshConfig, global_batch: int, num_devices: int, num_slices: int = 1
) -> tuple[MeshConfig, str | None]:
    """The mesh for a global batch smaller than its batch axes: the fsdp ways the batch cannot
    fill split the sequence instead (they become context ways), as a fractional
    ``per_device_batch_size`` asks (MaxDiffusion's Wan 14B training: 0.25 on 4 fsdp chips).

    The weights stay sharded over the same chips (``embed`` spans fsdp and context) and each
    chip holds a quarter of the tokens rather than a padded copy of the one example. Returns
    the config unchanged (and no note) where the batch divides data x fsdp, or where it does
    not even divide the data axis (``check_divisible`` names that); else the new config and a
    note saying what moved. Only the ici fsdp axis folds: a dcn fsdp axis would put a ring
    attention across slices."""
    dcn, ici = _resolved(config, num_devices, num_slices)
    data, fsdp = dcn["data"] * ici["data"], dcn["fsdp"] * ici["fsdp"]
    if global_batch % (data * fsdp) == 0 or global_batch % (data * dcn["fsdp"]):
        return config, None
    ici_fsdp = ici["fsdp"]
    kept = math.gcd(global_batch // (data * dcn["fsdp"]), ici_fsdp)
    folded = dataclasses.replace(
        config,
        ici_data_parallelism=ici["data"],
        ici_fsdp_parallelism=kept,
        ici_context_parallelism=ici["context"] * (ici_fsdp // kept),
        ici_tensor_parallelism=ici["tensor"],
    )
    note = (
        f"global batch {global_batch} does not fill data x fsdp = {data * fsdp}: ici fsdp "
        f"{ici_fsdp} runs as fsdp {kept} x context {ici_fsdp // kept} (weights still sharded "
        "over those chips, the tokens split over the context ways)"
    )
    return folded, note


def slice_count(devices: Sequence[jax.Device]) -> int:
    """How many slices (multislice: DCN-connected) ``devices`` span."""
    return 1 + max(getattr(d, "slice_index", 0) or 0 for d in devices)


def make_mesh(
    config: MeshConfig | None = None, devices: Sequence[jax.Device] | None = None
) -> Mesh:
    """Build the 4-axis mesh (data, fsdp, context, tensor) over ``devices`` (default: all)."""
    config = config or MeshConfig()
    devices = list(devices) if devices is not None else jax.devices()
    num_slices = slice_count(devices)
    shape = mesh_shape(config, len(devices), num_slices)
    if num_slices > 1:
        from jax.experimental import mesh_utils

        dcn = mesh_shape(
            dataclasses.replace(
                config,
                ici_data_parallelism=1,
                ici_fsdp_parallelism=1,
                ici_context_parallelism=1,
                ici_tensor_parallelism=1,
            ),
            num_slices,
            num_slices,
        )
        ici = [shape[a] // dcn[a] for a in MESH_AXES]
        grid = mesh_utils.create_hybrid_device_mesh(ici, [dcn[a] for a in MESH_AXES], devices)
    else:
        from jax.experimental import mesh_utils

        sizes = [shape[a] for a in MESH_AXES]
        try:  # orders devices along the physical interconnect on TPU
            grid = mesh_utils.create_device_mesh(sizes, devices)
        except (ValueError, NotImplementedError, AssertionError):
            grid = np.asarray(devices).reshape(sizes)
    return Mesh(grid, MESH_AXES)


def axis_rules(overrides: Sequence[tuple[str, object]] = ()) -> tuple[tuple[str, object], ...]:
    """The rules with config overrides applied (an override replaces the rule of that name)."""
    known = {name for name, _ in LOGICAL_AXIS_RULES}
    replaced = dict(LOGICAL_AXIS_RULES)
    for name, target in overrides:
        if name not in known:
            raise ShardingError(f"unknown logical axis {name!r}; known: {sorted(known)}")
        replaced[name] = tuple(target) if isinstance(target, list) else target
    return tuple(replaced.items())


def logical_to_spec(logical: Sequence[str | None], rules=None) -> PartitionSpec:
    """Logical axis names -> PartitionSpec under the rules."""
    return nn.logical_to_mesh_axes(tuple(logical), rules or LOGICAL_AXIS_RULES)


def logical_sharding(mesh: Mesh, logical: Sequence[str | None], rules=None) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(logical, rules))


def param_shardings(mesh: Mesh, abstract_variables, rules=None):
    """NamedShardings for a pytree produced by ``jax.eval_shape(model.init, ...)``.

    Leaves boxed with ``nn.Partitioned`` (from ``nn.with_logical_partitioning``) get their
    logical spec mapped; unboxed leaves are replicated. A dimension split over several mesh
    axes keeps the longest leading run of them whose product divides its size (see
    :func:`divisible_spec`).
    """
    specs = nn.get_partition_spec(abstract_variables)
    mesh_specs = nn.logical_to_mesh(specs, rules or LOGICAL_AXIS_RULES)

    def place(spec, leaf):
        if spec is None:
            return NamedSharding(mesh, PartitionSpec())
        return NamedSharding(mesh, divisible_spec(mesh, spec, leaf.shape))

    # the boxed values as they are: nn.meta.unbox would constrain them to the active mesh
    shapes = jax.tree.map(
        lambda x: x.value if isinstance(x, nn.meta.AxisMetadata) else x,
        abstract_variables,
        is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata),
    )
    return jax.tree.map(
        place,
        mesh_specs,
        shapes,
        is_leaf=lambda x: isinstance(x, PartitionSpec) or x is None,
    )


def divisible_spec(mesh: Mesh, spec: PartitionSpec, shape: Sequence[int]) -> PartitionSpec:
    """``spec`` with each dimension's mesh axes after the first cut to the longest leading run
    whose product divides that dimension's size.

    ``embed`` spans fsdp and context; a width that fsdp divides but fsdp x context does not
    (a tiny test model, a 3-way context) is sharded over fsdp and replicated over context,
    which is correct and only costs memory. The first axis is always kept: a size it does not
    divide fails at placement as before, rather than silently replicating a large model."""
    entries = []
    for size, axes in zip(shape, spec, strict=False):
        names = (axes,) if isinstance(axes, str) else tuple(axes or ())
        kept = list(names[:1])
        for name in names[1:]:
            if size % math.prod(mesh.shape[a] for a in (*kept, name)):
                break
            kept.append(name)
        entries.append(
            axes if len(kept) == len(names) else kept[0] if len(kept) == 1 else tuple(kept)
        )
    return PartitionSpec(*entries, *tuple(spec)[len(entries) :])


def logical_axis_size(mesh, logical: str, rules=None) -> int:
    """How many ways the logical axis ``logical`` is split on ``mesh`` (a Mesh or the abstract
    mesh being traced for) under the rules; mesh axes the mesh lacks count 1."""
    spec = logical_to_spec((logical,), rules)[0]
    axes = (spec,) if isinstance(spec, str) else tuple(spec or ())
    return math.prod(dict(mesh.shape).get(a, 1) for a in axes)


def batch_axis_size(mesh: Mesh, rules=None) -> int:
    """How many ways the activation batch is split on this mesh."""
    return logical_axis_size(mesh, "activation_batch", rules)


def check_divisible(mesh: Mesh, *, batch: int | None = None, heads: int | None = None) -> None:
    """Raise a ShardingError naming the parameter when a size does not split over the mesh."""
    if batch is not None:
        ways = batch_axis_size(mesh)
        if batch % ways:
            raise ShardingError(
                f"batch size {batch} is not divisible by the batch axes (data x fsdp = {ways})"
            )
    if heads is not None:
        ways = mesh.shape["tensor"]
        if heads % ways:
            raise ShardingError(
                f"num_attention_heads {heads} is not divisible by ici_tensor_parallelism {ways}"
            )


def constrain(x: jax.Array, logical: Sequence[str | None]) -> jax.Array:
    """Activation sharding hint by logical names; a no-op outside a mesh / rules context."""
    return nn.with_logical_constraint(x, tuple(logical))


@contextlib.contextmanager
def mesh_context(mesh: Mesh | None, rules=None):
    """Activate ``mesh`` and the logical axis rules together.

    Use this, not ``with mesh:`` — under jax >= 0.10 the latter is deprecated and flax's
    logical sharding constraints silently become no-ops inside it.
    """
    with contextlib.ExitStack() as stack:
        if mesh is not None:
            stack.enter_context(jax.set_mesh(mesh))
        stack.enter_context(nn.logical_axis_rules(rules or LOGICAL_AXIS_RULES))
        yield
