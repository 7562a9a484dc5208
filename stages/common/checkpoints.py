"""orbax checkpoints of a training run: ``params``, ``opt_state`` and ``meta`` (step, model
config) items per step, restored onto *target* shardings so a checkpoint loads on any mesh.

Follows MaxDiffusion's layout idea (model state + the model config in the checkpoint, so a
checkpoint rebuilds its model alone), with orbax's CheckpointManager (async save, keep N,
only finished checkpoints are visible: a killed save leaves nothing that restores).
"""

from __future__ import annotations

import logging
import os

import jax
import orbax.checkpoint as ocp

from jaxcore import storage
from jaxcore.artifacts import ArtifactError

log = logging.getLogger(__name__)

ITEMS = ("params", "opt_state", "meta")


def _abstract(tree):
    """ShapeDtypeStructs carrying each leaf's current sharding (the restore target)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def manager(
    directory: str,
    *,
    max_to_keep: int | None = None,
    async_save: bool = True,
    read_only: bool = False,
) -> ocp.CheckpointManager:
    """A CheckpointManager over ``directory`` (local or gs://)."""
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep,
        enable_async_checkpointing=async_save,
        create=not read_only,
        read_only=read_only,
    )
    return ocp.CheckpointManager(_absolute(directory), options=options, item_names=ITEMS)


def _absolute(directory: str) -> str:
    """orbax (tensorstore's ocdbt) refuses relative local paths; gs:// URIs pass unchanged."""
    return directory if storage.is_gcs(directory) else os.path.abspath(directory)


def save(
    mngr: ocp.CheckpointManager, step: int, params, opt_state, meta: dict, *, force: bool = False
) -> bool:
    """Start saving step ``step`` (async); ``opt_state=None`` saves weights only."""
    items = {"params": ocp.args.StandardSave(params), "meta": ocp.args.JsonSave(meta)}
    if opt_state is not None:
        items["opt_state"] = ocp.args.StandardSave(opt_state)
    return mngr.save(step, args=ocp.args.Composite(**items), force=force)


def restore_state(mngr: ocp.CheckpointManager, step: int, params, opt_state):
    """Restore (params, opt_state, meta) of ``step`` onto the shardings of the given trees."""
    restored = mngr.restore(
        step,
        args=ocp.args.Composite(
            params=ocp.args.StandardRestore(_abstract(params)),
            opt_state=ocp.args.StandardRestore(_abstract(opt_state)),
            meta=ocp.args.JsonRestore(),
        ),
    )
    return restored["params"], restored["opt_state"], restored["meta"]


def restore_params(directory: str, step: int, module, mesh):
    """The params of checkpoint ``step`` in ``directory``, placed for ``module`` on ``mesh``."""
    from stages.train.model import abstract_params_with_shardings

    mngr = manager(directory, read_only=True)
    if step not in mngr.all_steps():
        raise ArtifactError(
            f"{directory}: no checkpoint at step {step} (have {sorted(mngr.all_steps())})"
        )
    target = abstract_params_with_shardings(module, mesh)
    restored = mngr.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore(target)))
    mngr.close()
    return restored["params"]


def read_meta(directory: str, step: int) -> dict:
    mngr = manager(directory, read_only=True)
    meta = mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    mngr.close()
    return dict(meta)
