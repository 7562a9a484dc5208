"""Where the transformer to train comes from: a diffusers checkpoint, a config, or a previous
train artifact's checkpoint; and the way back out (diffusers-format export)."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxcore import storage, weights
from jaxcore.artifacts import Manifest, open_artifact, read_manifest
from jaxcore.config import read_yaml
from jaxcore.models import wan_transformer as wan
from stages.errors import StageInputError
from stages.train.config import ModelSection

log = logging.getLogger(__name__)

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def transformer_dir(path: str) -> Path:
    """A diffusers pipeline directory (its ``transformer/``) or a transformer directory."""
    local = storage.local_copy(path)
    if (local / "transformer" / "config.json").is_file():
        return local / "transformer"
    if (local / "config.json").is_file():
        return local
    raise StageInputError(
        f"pretrained_model_name_or_path {path}: neither it nor its transformer/ holds a "
        "config.json (expected a diffusers pipeline or WanTransformer3DModel directory)"
    )


def config_from_yaml(path: str, section: str) -> wan.WanTransformerConfig:
    data = read_yaml(path)
    if section not in data:
        raise StageInputError(f"model_config {path} has no section {section!r}")
    try:
        return wan.WanTransformerConfig.from_dict(data[section])
    except (ValueError, TypeError) as err:
        raise StageInputError(f"model_config {path} section {section!r}: {err}") from None


def make_module(
    config: wan.WanTransformerConfig, section: ModelSection, mesh
) -> wan.WanTransformer:
    return wan.WanTransformer(
        config,
        dtype=DTYPES[section.activations_dtype],
        param_dtype=DTYPES[section.weights_dtype],
        attention=section.attention,
        mesh=mesh,
        remat_policy=section.remat_policy,
    )


def param_target_shardings(module: wan.WanTransformer, mesh, rules=None):
    """Unboxed NamedShardings of the ``params`` collection under the logical-axis rules."""
    from flax import linen as nn

    from jaxcore import sharding

    return nn.meta.unbox(sharding.param_shardings(mesh, wan.abstract_params(module), rules))


def abstract_params_with_shardings(module, mesh):
    """ShapeDtypeStructs (with target shardings) of the params, for orbax restore."""
    from flax import linen as nn

    boxed = wan.abstract_params(module)
    shapes = nn.meta.unbox(boxed)
    shards = param_target_shardings(module, mesh)
    return jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, module.param_dtype, sharding=sh),
        shapes,
        shards,
    )


@dataclasses.dataclass(frozen=True)
class CheckpointSource:
    """A checkpoint named through artifacts: the train artifact and the step to restore.

    ``inputs`` are the artifacts it came through (for the consumer's manifest)."""

    train: Manifest
    step: int
    inputs: dict


def resolve_checkpoint_source(uri: str, which: str) -> CheckpointSource:
    """A train artifact (``which``: "final", "best" or a step) or an evaluate artifact (its
    best checkpoint, as evaluation named it; "final"/a step then refer to its train artifact).
    """
    manifest = read_manifest(uri)
    if manifest is None:
        open_artifact(uri, "train")  # raises, naming the missing manifest
    if manifest.stage == "evaluate":
        train = open_artifact(manifest.summary["train_artifact"], "train")
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


def resolve_init_step(train_manifest, which: str) -> int:
    """'final', 'best' (from the train summary) or an explicit step listed in the artifact."""
    summary = train_manifest.summary
    steps = [int(s) for s in summary.get("checkpoints", [])]
    if which == "final":
        step = summary.get("final_step")
    elif which == "best":
        step = summary.get("best_checkpoint_step")
        if step is None:
            raise StageInputError(
                f"init_checkpoint=best: {train_manifest.uri} has no best_checkpoint_step "
                "(it ran without eval_every); use 'final' or a step"
            )
    else:
        step = int(which)
    if step is None or int(step) not in steps:
        raise StageInputError(
            f"init_checkpoint={which}: {train_manifest.uri} keeps checkpoints {steps}, "
            f"not step {step}"
        )
    return int(step)


def build_model(section: ModelSection, mesh, rng) -> tuple[wan.WanTransformer, dict, dict]:
    """(module, params placed on the mesh, provenance) for the configured model source."""
    if section.pretrained_model_name_or_path:
        directory = transformer_dir(section.pretrained_model_name_or_path)
        try:
            module, params = wan.load_wan_transformer(
                directory,
                dtype=DTYPES[section.activations_dtype],
                param_dtype=DTYPES[section.weights_dtype],
                attention=section.attention,
                mesh=mesh,
                remat_policy=section.remat_policy,
            )
        except wan.WanConfigError as err:
            raise StageInputError(f"{directory}/config.json: {err}") from None
        return module, params, {"source": "pretrained", "path": str(directory)}
    if section.model_config:
        config = config_from_yaml(section.model_config, section.model_config_section)
        module, params = wan.init_wan_transformer(
            config,
            rng,
            dtype=DTYPES[section.activations_dtype],
            param_dtype=DTYPES[section.weights_dtype],
            attention=section.attention,
            mesh=mesh,
            remat_policy=section.remat_policy,
        )
        return module, params, {"source": "config", "path": section.model_config}
    from stages.train import checkpointing

    source = resolve_checkpoint_source(section.init_from, section.init_checkpoint)
    manifest, step = source.train, source.step
    config = wan.WanTransformerConfig.from_dict(manifest.summary["model_config"])
    module = make_module(config, section, mesh)
    params = checkpointing.restore_params(
        storage.join(manifest.uri, manifest.summary["checkpoint_dir"]), step, module, mesh
    )
    return module, params, {"source": "train_artifact", "path": manifest.uri, "step": step}


def export_diffusers(module: wan.WanTransformer, params: dict, uri: str) -> None:
    """Write ``uri`` as a diffusers WanTransformer3DModel directory (config + safetensors)."""
    import tempfile

    state = weights.export_state_dict(params, wan.weight_map(module.config))
    config = {"_class_name": "WanTransformer3DModel", **module.config.to_dict()}
    with tempfile.TemporaryDirectory() as tmp:
        local = Path(tmp)
        weights.save_safetensors(state, local / "diffusion_pytorch_model.safetensors")
        (local / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for name in ("diffusion_pytorch_model.safetensors", "config.json"):
            storage.upload_file(local / name, storage.join(uri, name))
