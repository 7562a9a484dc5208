"""Checkpoints: orbax save/restore of a training run, and checkpoints named through artifacts.

A train run keeps ``params``, ``opt_state`` and ``meta`` (step, family, model config) items per
step, restored onto *target* shardings so a checkpoint loads on any mesh. Consumers (train's
``init_from``, evaluate, generate) name a checkpoint through a train or evaluate artifact
(:func:`resolve_checkpoint_source`) and rebuild its denoiser from the artifact alone
(:func:`restore_denoiser`): the family and model config travel in the train manifest.

Follows MaxDiffusion's layout idea (model state + the model config in the checkpoint, so a
checkpoint rebuilds its model alone), with orbax's CheckpointManager (async save, keep N,
only finished checkpoints are visible: a killed save leaves nothing that restores).
"""

from __future__ import annotations

import dataclasses
import logging
import os

import jax
import orbax.checkpoint as ocp
from flax import linen as nn

from jaxcore import families, sharding, storage
from jaxcore.artifacts import (
    ArtifactError,
    Manifest,
    check_files,
    open_artifact,
    read_manifest,
    relocate,
)
from jaxcore.compute import ComputeConfig
from stages.common import records
from stages.common.errors import StageInputError

log = logging.getLogger(__name__)

ITEMS = ("params", "opt_state", "meta")


def abstract_placed(tree):
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
            params=ocp.args.StandardRestore(abstract_placed(params)),
            opt_state=ocp.args.StandardRestore(abstract_placed(opt_state)),
            meta=ocp.args.JsonRestore(),
        ),
    )
    return restored["params"], restored["opt_state"], restored["meta"]


def param_shardings(family, module, mesh, rules=None):
    """Unboxed NamedShardings of the denoiser's ``params`` under the logical-axis rules."""
    return nn.meta.unbox(sharding.param_shardings(mesh, family.abstract_params(module), rules))


def abstract_params_with_shardings(family, module, mesh):
    """ShapeDtypeStructs (with target shardings) of the params, for orbax restore."""
    shapes = nn.meta.unbox(family.abstract_params(module))
    return jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, module.param_dtype, sharding=sh),
        shapes,
        param_shardings(family, module, mesh),
    )


def restore_params(directory: str, step: int, family, module, mesh):
    """The params of checkpoint ``step`` in ``directory``, placed for ``module`` on ``mesh``."""
    return restore_tree(directory, step, abstract_params_with_shardings(family, module, mesh))


def restore_tree(directory: str, step: int, target):
    """The ``params`` item of checkpoint ``step``, restored onto ``target``'s structure,
    shapes and shardings (ShapeDtypeStructs)."""
    mngr = manager(directory, read_only=True)
    if step not in mngr.all_steps():
        raise ArtifactError(
            f"{directory}: no checkpoint at step {step} (have {sorted(mngr.all_steps())})"
        )
    restored = mngr.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore(target)))
    mngr.close()
    return restored["params"]


def read_meta(directory: str, step: int) -> dict:
    mngr = manager(directory, read_only=True)
    meta = mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    mngr.close()
    return dict(meta)


# --- checkpoints named through artifacts ------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CheckpointSource:
    """A checkpoint named through artifacts: the train artifact and the step to restore.

    ``inputs`` are the artifacts it came through (for the consumer's manifest)."""

    train: Manifest
    step: int
    inputs: dict

    @property
    def family(self):
        return family_of(self.train)

    @property
    def directory(self) -> str:
        return checkpoint_dir(self.train)


def checkpoint_dir(train_manifest: Manifest) -> str:
    """Where a train artifact keeps its orbax checkpoints."""
    return storage.join(train_manifest.uri, train_manifest.summary["checkpoint_dir"])


def resolve_checkpoint_source(uri: str, which: str) -> CheckpointSource:
    """A train artifact (``which``: "final", "best" or a step) or an evaluate artifact (its
    best checkpoint, as evaluation named it; "final"/a step then refer to its train artifact).
    """
    manifest = read_manifest(uri)
    if manifest is None:
        open_artifact(uri, "train")  # raises, naming the missing manifest
    check_files(manifest)
    if manifest.stage == "evaluate":
        train = open_artifact(relocate(manifest, manifest.summary["train_artifact"]), "train")
        if which == "best":
            step = int(manifest.summary["best_checkpoint_step"])
            resolve_init_step(train, str(step))  # the checkpoint must still exist
        else:
            step = resolve_init_step(train, which)
        return CheckpointSource(train, step, {"evaluation": manifest, "model": train})
    if manifest.stage != "train":
        raise StageInputError(
            f"{uri} is a {manifest.stage!r} artifact; expected a train or evaluate artifact"
        )
    return CheckpointSource(manifest, resolve_init_step(manifest, which), {"model": manifest})


def resolve_init_step(train_manifest: Manifest, which: str) -> int:
    """'final', 'best' (from the train summary) or an explicit step listed in the artifact."""
    summary = train_manifest.summary
    steps = [int(s) for s in summary.get("checkpoints", [])]
    if which == "final":
        step = summary.get("final_step")
    elif which == "best":
        step = summary.get("best_checkpoint_step")
        if step is None:
            raise StageInputError(
                f"checkpoint=best: {train_manifest.uri} has no best_checkpoint_step "
                "(it ran without eval_every); use 'final' or a step"
            )
    else:
        step = int(which)
    if step is None or int(step) not in steps:
        raise StageInputError(
            f"checkpoint={which}: {train_manifest.uri} keeps checkpoints {steps}, not step {step}"
        )
    return int(step)


def family_of(train_manifest: Manifest):
    """The model family a train artifact's checkpoints belong to."""
    name = train_manifest.summary.get("family")
    if not isinstance(name, str):
        raise StageInputError(f"{train_manifest.uri}: the train manifest names no model 'family'")
    return families.get(name)


def denoiser_of(train_manifest: Manifest, compute: ComputeConfig, mesh):
    """(family, module) of a train artifact's checkpoints, built from its manifest alone."""
    family = family_of(train_manifest)
    config = family.denoiser_config(
        train_manifest.summary["model_config"], f"{train_manifest.uri} model_config"
    )
    return family, family.make_denoiser(config, compute, mesh)


class DenoiserRestorer:
    """The denoiser of a train artifact, and its parameters at any of its checkpoints.

    A LoRA run's checkpoints hold only its adapters: the base it trained on is rebuilt once
    from the train artifact's ``model_source`` and each checkpoint's adapters are merged into
    it (the same numbers the run trained against). A ControlNet run's checkpoints hold only
    the ControlNet: its denoiser is the frozen base, rebuilt the same way, and
    :meth:`scoring_model` / :meth:`scored_params` give the denoiser with the checkpoint's
    ControlNet, as the run's loss saw them.
    """

    def __init__(self, train: Manifest, compute: ComputeConfig, mesh):
        self.train, self.compute, self.mesh = train, compute, mesh
        self.family, self.module = denoiser_of(train, compute, mesh)
        self.lora = train.summary.get("lora")
        self.controlnet = train.summary.get("controlnet")
        self._base = None
        self._net = None

    def params(self, step: int):
        """The denoiser parameters of checkpoint ``step``, placed on the mesh (a ControlNet
        run: the frozen denoiser, the same at every step)."""
        source = CheckpointSource(self.train, step, {})
        if self.lora is None and self.controlnet is None:
            return restore_params(source.directory, step, self.family, self.module, self.mesh)
        if self._base is None:
            self._base = _restore_base(
                self.train, self.family, self.module, self.compute, self.mesh
            )
        if self.controlnet is not None:
            return self._base
        return _merge_adapters(source, self.lora, self.family, self.module, self._base, self.mesh)

    def scoring_model(self, param_shardings):
        """(family, module, parameter shardings) the loss runs: the denoiser's, or with a
        ControlNet run's ControlNet (:class:`ControlledFamily`, :class:`jaxcore.control.
        Controlled`), as the run's loss ran them."""
        if self.controlnet is None:
            return self.family, self.module, param_shardings
        from jaxcore import control

        module, _, shardings = self._controlnet()
        controlled = control.Controlled(self.module, (module,))
        both = {"denoiser": param_shardings, "controlnets": (shardings,)}
        return ControlledFamily(self.family), controlled, both

    def scored_params(self, step: int):
        """The parameters :meth:`scoring_model`'s module takes at checkpoint ``step``."""
        denoiser = self.params(step)
        if self.controlnet is None:
            return denoiser
        _, target, _ = self._controlnet()
        net = restore_tree(checkpoint_dir(self.train), step, target)
        return {"denoiser": denoiser, "controlnets": (net,)}

    def _controlnet(self):
        """(module, restore target, shardings) of the run's ControlNet, rebuilt from the
        train manifest's ``controlnet.config`` by the family."""
        if self._net is None:
            self._net = controlnet_template(
                self.train, self.family, self.module, self.compute, self.mesh
            )
        return self._net


def controlnet_template(train: Manifest, family, denoiser, compute: ComputeConfig, mesh):
    """(module, ShapeDtypeStructs placed by the logical axis rules, their shardings) of the
    ControlNet a ControlNet run trained, as recorded in its manifest."""
    config = (train.summary.get("controlnet") or {}).get("config")
    if not isinstance(config, dict):
        raise StageInputError(f"{train.uri}: the train manifest's controlnet has no 'config'")
    try:
        module, shapes, boxed = family.controlnet_template(
            denoiser, config, family.denoiser_kwargs(compute)
        )
    except families.FamilyError as err:
        raise StageInputError(f"{train.uri} controlnet: {err}") from None
    shardings = nn.meta.unbox(sharding.param_shardings(mesh, boxed))
    target = jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings
    )
    return module, target, shardings


def check_control_features(features, where: str) -> None:
    """A ControlNet run scores records holding the conditioning images' pixels."""
    if records.CONDITIONING_PIXELS not in features:
        raise StageInputError(
            f"{where}: the records hold no {records.CONDITIONING_PIXELS!r}, which a ControlNet "
            "run's checkpoints are scored on: convert the data with "
            "dataset.conditioning_image_column set"
        )


def control_conditioning(conditioning: dict) -> dict:
    """The records' conditioning with the control keys (:mod:`jaxcore.control`) made from
    ``conditioning_pixels [B, H, W, 3]`` (0..255): one ControlNet, its image in [0, 1] as
    ``[B, 1, 3, H, W]``, scale 1, guess mode and switch-off false (ControlNet training's
    settings; train's loss uses it too)."""
    import jax.numpy as jnp

    from jaxcore import control

    pixels = conditioning[records.CONDITIONING_PIXELS].astype(jnp.float32)
    rows = pixels.shape[0]
    out = {k: v for k, v in conditioning.items() if k != records.CONDITIONING_PIXELS}
    out[control.CONTROL_IMAGE] = jnp.transpose(pixels / 255.0, (0, 3, 1, 2))[:, None]
    out[control.CONTROL_SCALE] = jnp.ones((rows, 1), jnp.float32)
    out[control.CONTROL_GUESS] = jnp.zeros((rows,), bool)
    out[control.CONTROL_OFF] = jnp.zeros((rows,), bool)
    return out


class ControlledFamily:
    """The model family as the objective sees it for a ControlNet run's checkpoints: the
    family's, but ``apply`` turns the records' conditioning pixels into control inputs first
    (the module is a :class:`jaxcore.control.Controlled`); as training's loss does."""

    def __init__(self, family):
        self._family = family

    def __getattr__(self, name):
        return getattr(self._family, name)

    def apply(self, module, params, latents, timestep, conditioning, run_stack=None):
        conditioning = control_conditioning(dict(conditioning))
        return self._family.apply(module, params, latents, timestep, conditioning, run_stack)


def restore_denoiser(source: CheckpointSource, compute: ComputeConfig, mesh):
    """(family, module, params) of the named checkpoint, placed on ``mesh`` (LoRA runs: the
    rebuilt base plus the checkpoint's adapters, see :class:`DenoiserRestorer`)."""
    restorer = DenoiserRestorer(source.train, compute, mesh)
    return restorer.family, restorer.module, restorer.params(source.step)


def _restore_base(train: Manifest, family, module, compute: ComputeConfig, mesh):
    """The denoiser a LoRA or ControlNet run trained on, rebuilt as the run built it."""
    import jax

    origin = train.summary.get("model_source") or {}
    kind = origin.get("source")
    if kind == "pretrained":
        _, params = family.load_denoiser(origin["path"], compute, mesh)
        return params
    if kind == "config":  # random init from the run's seed: the same numbers on any mesh
        _, params = family.init_denoiser(
            module.config, jax.random.key(int(origin["seed"])), compute, mesh
        )
        return params
    if kind == "train_artifact":
        parent_uri = relocate(train, origin["path"])
        parent = CheckpointSource(open_artifact(parent_uri, "train"), int(origin["step"]), {})
        return restore_denoiser(parent, compute, mesh)[2]
    raise StageInputError(f"{train.uri}: cannot rebuild the run's base model from {origin}")


def _merge_adapters(source: CheckpointSource, lora: dict, family, module, base, mesh):
    """Restore a LoRA run's adapters at ``source.step`` and merge them into ``base``."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from jaxcore.lora.base import Converted
    from jaxcore.lora.merge import LoadedLora, LoraMerger
    from jaxcore.lora.training import adapter_layers, find_targets, init_adapters

    abstract = nn.meta.unbox(family.abstract_params(module))
    weight_map = family.lora_weight_map(module.config)
    targets = find_targets(weight_map, abstract, lora["targets"])
    replicated = NamedSharding(mesh, PartitionSpec())
    shapes = jax.eval_shape(lambda: init_adapters(targets, int(lora["rank"]), jax.random.key(0)))
    target_tree = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=replicated), shapes
    )
    adapters = restore_tree(source.directory, source.step, target_tree)
    layers = adapter_layers(adapters, targets, float(lora["scale"]))
    loaded = LoadedLora(source.train.uri, "", Converted(layers, (), "difforge"))
    return LoraMerger(base, weight_map).merged([(loaded, 1.0)])
