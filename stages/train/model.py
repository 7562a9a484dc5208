"""Where the denoiser to train comes from — a diffusers checkpoint, a model YAML, or a previous
train artifact's checkpoint — and the way back out (diffusers-format export). The model family
follows from the source; everything model-specific is a call into the family."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import tempfile
from pathlib import Path

import jax

from jaxcore import families, storage, weights
from jaxcore.compute import ComputeConfig
from jaxcore.config import ConfigError
from jaxcore.layer_stack import LayerStack
from jaxcore.model_configs import read_model_yaml
from jaxcore.pipeline import resolve_pipeline_dir
from stages.common import checkpoints
from stages.common.errors import StageInputError
from stages.train.config import ModelSection

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Model:
    """The denoiser being trained: its family, module, params and where it came from."""

    family: families.Family
    module: object
    params: object
    provenance: dict


def denoiser_dir(path: str) -> tuple[families.Family, Path]:
    """(family, denoiser directory) of a diffusers pipeline or a bare denoiser directory."""
    try:
        local = resolve_pipeline_dir(path)
    except families.FamilyError as err:
        raise StageInputError(str(err)) from None
    if (local / "model_index.json").is_file():
        family = families.for_pipeline(local)
        return family, local / family.denoiser_component
    if (local / "config.json").is_file():
        return families.for_denoiser(local), local
    raise StageInputError(
        f"pretrained_model_name_or_path {path}: neither a diffusers pipeline (model_index.json) "
        "nor a denoiser directory (config.json)"
    )


def config_from_yaml(path: str, section: str | None):
    """(family, denoiser config) from a model YAML's ``family`` and denoiser section."""
    try:
        family, sections = read_model_yaml(path)
    except ConfigError as err:
        raise StageInputError(f"model_config {err}") from None
    name = section or family.denoiser_component
    if name not in sections:
        raise StageInputError(f"model_config {path} has no section {name!r}")
    return family, sections[name]


def build_model(section: ModelSection, compute: ComputeConfig, mesh, rng) -> Model:
    """The configured model source, placed on ``mesh``."""
    if section.expert is not None:
        return _expert_model(section, compute, mesh)
    if section.pretrained_model_name_or_path:
        family, directory = denoiser_dir(section.pretrained_model_name_or_path)
        module, params = family.load_denoiser(directory, compute, mesh)
        return Model(family, module, params, {"source": "pretrained", "path": str(directory)})
    if section.model_config:
        family, config = config_from_yaml(section.model_config, section.model_config_section)
        module, params = family.init_denoiser(config, rng, compute, mesh)
        return Model(family, module, params, {"source": "config", "path": section.model_config})
    source = checkpoints.resolve_checkpoint_source(section.init_from, section.init_checkpoint)
    family, module, params = checkpoints.restore_denoiser(source, compute, mesh)
    provenance = {"source": "train_artifact", "path": source.train.uri, "step": source.step}
    return Model(family, module, params, provenance)


def _expert_model(section: ModelSection, compute: ComputeConfig, mesh) -> Model:
    """One expert of a two-expert pipeline, with the timestep range it handles."""
    path = section.pretrained_model_name_or_path
    family, directory = denoiser_dir(path)
    pipeline_dir = directory.parent
    if not (pipeline_dir / "model_index.json").is_file():
        raise StageInputError(f"model.expert={section.expert}: {path} is not a pipeline directory")
    try:
        configs = family.component_configs(pipeline_dir)
        folder = pipeline_dir / family.expert_component(configs, section.expert)
        ratio = family.expert_boundary_ratio(configs)
    except families.FamilyError as err:
        raise StageInputError(f"{path}: {err}") from None
    module, params = family.load_denoiser(folder, compute, mesh)
    provenance = {
        "source": "pretrained",
        "path": str(folder),
        "expert": section.expert,
        "boundary_ratio": ratio,
        "timestep_range": expert_range(section.expert, ratio),
    }
    return Model(family, module, params, provenance)


def expert_range(expert: str, boundary_ratio: float) -> list[float]:
    """The training times ``[lo, hi)`` an expert handles: the high-noise expert predicts at
    ``t >= boundary``, the low-noise one below it (t = timestep / num_train_timesteps)."""
    return [boundary_ratio, 1.0] if expert == "high" else [0.0, boundary_ratio]


def export_diffusers(model: Model, params, uri: str) -> None:
    """Write ``uri`` as a diffusers denoiser directory (config.json + safetensors)."""
    state, config = model.family.export_denoiser(model.module, params)
    with tempfile.TemporaryDirectory() as tmp:
        local = Path(tmp)
        weights.save_safetensors(state, local / "diffusion_pytorch_model.safetensors")
        (local / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for name in ("diffusion_pytorch_model.safetensors", "config.json"):
            storage.upload_file(local / name, storage.join(uri, name))


@dataclasses.dataclass
class Trainable:
    """What the optimiser updates, and how the denoiser's parameters follow from it.

    Full fine-tuning: ``params`` are the denoiser's, nothing is frozen; with
    ``compute.scan_layers`` its repeated blocks are held stacked (``layers``,
    :mod:`jaxcore.layer_stack`), so the optimizer updates one leaf per kind of parameter at any
    depth, and :meth:`checkpoint_state` / :meth:`from_checkpoint` convert at the run's edges.
    LoRA: ``params`` are the adapters (:mod:`jaxcore.lora.training`), ``frozen`` the base
    denoiser, and the parameters the loss sees are ``base + scale * up @ down`` at every target.
    ControlNet: ``params`` are the ControlNet's, ``frozen`` the UNet, ``controlnet`` its module;
    the loss sees :class:`jaxcore.control.Controlled`'s ``{"denoiser", "controlnets"}``.
    """

    params: object
    shardings: object
    frozen: object = dataclasses.field(default_factory=dict)
    frozen_shardings: object = dataclasses.field(default_factory=dict)
    targets: dict | None = None
    scale: float = 1.0
    layers: LayerStack | None = None  # the stacked block groups of a scanned full fine-tune
    controlnet: object = None  # the ControlNet module of a ControlNet run

    @property
    def is_lora(self) -> bool:
        return self.targets is not None

    def checkpoint_state(self, params, opt_state):
        """(params, opt_state) in the per-layer layout checkpoints hold (new arrays where the
        run holds stacks; ``opt_state`` may be None)."""
        if self.layers is None:
            return params, opt_state
        return self._per_layer(params, opt_state)

    @functools.cached_property
    def _per_layer(self):
        """The jitted conversion to the per-layer layout (built once: every save calls it)."""
        layers = self.layers

        def per_layer(params, opt_state):
            state = None if opt_state is None else layers.unstack_state(opt_state, params)
            return layers.unstack(params), state

        return jax.jit(per_layer)

    def checkpoint_template(self, params, opt_state):
        """Trees shaped and placed as :meth:`checkpoint_state`'s result (ShapeDtypeStructs where
        the run holds stacks): what a checkpoint restores onto."""
        if self.layers is None:
            return params, opt_state
        params, opt_state = checkpoints.abstract_placed((params, opt_state))
        return self.layers.unstack(params), self.layers.unstack_state(opt_state, params)

    def from_checkpoint(self, params, opt_state, opt_shardings):
        """(params, opt_state) of a checkpoint (per-layer layout) in the run's layout, placed
        on ``self.shardings`` and ``opt_shardings``."""
        if self.layers is None:
            return params, opt_state
        layers = self.layers

        def stacked(params, opt_state):
            return layers.stack(params), layers.stack_state(opt_state, params)

        return jax.jit(stacked, out_shardings=(self.shardings, opt_shardings))(params, opt_state)

    def denoiser_params(self, params):
        """The denoiser's parameters (per-layer layout) for ``params``; full fine-tuning."""
        if self.layers is None:
            return params
        return self._unstack(params)

    @functools.cached_property
    def checkpoint_shardings(self):
        """The per-layer shardings of ``params`` (those of the stacks, unstacked)."""
        return self.shardings if self.layers is None else self.layers.unstack(self.shardings)

    @functools.cached_property
    def _unstack(self):
        return jax.jit(self.layers.unstack, out_shardings=self.checkpoint_shardings)

    def effective(self, params, frozen):
        """The denoiser parameters for ``params`` (traceable); a ControlNet run: the UNet's
        and the ControlNet's, as :class:`jaxcore.control.Controlled` takes them."""
        if self.controlnet is not None:
            return {"denoiser": frozen, "controlnets": (params,)}
        if self.targets is None:
            return params
        from jaxcore.lora.training import merge_traced

        return merge_traced(frozen, params, self.targets, self.scale)


def make_controlnet_trainable(built: Model, section, compute, mesh, rng) -> Trainable:
    """A ControlNet (:mod:`stages.train.controlnet`) trained beside the frozen UNet."""
    from stages.train import controlnet

    net = controlnet.build_controlnet(built, section, compute, mesh, rng)
    return Trainable(
        params=net.params,
        shardings=net.shardings,
        frozen=built.params,
        frozen_shardings=checkpoints.param_shardings(built.family, built.module, mesh),
        controlnet=net.module,
    )


def make_trainable(built: Model, lora, mesh, rng) -> Trainable:
    """Full fine-tuning, or adapters on the frozen base when ``lora.rank > 0``."""
    from flax import linen as nn
    from jax.sharding import NamedSharding, PartitionSpec

    from jaxcore.lora.training import find_targets, init_adapters

    base_shardings = checkpoints.param_shardings(built.family, built.module, mesh)
    if not lora.enabled:
        layers = LayerStack.of(built.module, built.params)
        if layers is None:
            return Trainable(built.params, base_shardings)
        shardings = layers.stack(base_shardings)
        params = jax.jit(layers.stack, out_shardings=shardings)(built.params)
        built.params = None  # the run holds one copy of the weights: the stacks
        return Trainable(params, shardings, layers=layers)
    family, config = built.family, built.module.config
    patterns = lora.target_modules or family.lora_default_targets
    abstract = nn.meta.unbox(family.abstract_params(built.module))
    targets = find_targets(family.lora_weight_map(config), abstract, patterns)
    replicated = NamedSharding(mesh, PartitionSpec())
    adapters = jax.device_put(init_adapters(targets, lora.rank, rng), replicated)
    return Trainable(
        params=adapters,
        shardings=jax.tree.map(lambda _: replicated, adapters),
        frozen=built.params,
        frozen_shardings=base_shardings,
        targets=targets,
        scale=lora.scale,
    )


def export_lora(trainable: Trainable, params, family, uri: str) -> str:
    """Write the adapters as ``<uri>/pytorch_lora_weights.safetensors`` (diffusers/PEFT)."""
    from jaxcore.lora.base import LORA_FILE_NAME
    from jaxcore.lora.training import adapter_layers, export_peft

    layers = adapter_layers(params, trainable.targets, trainable.scale)
    tensors = export_peft(layers, family.denoiser_component)
    with tempfile.TemporaryDirectory() as tmp:
        local = Path(tmp) / LORA_FILE_NAME
        weights.save_safetensors(tensors, local, {"format": "pt"})
        storage.upload_file(local, storage.join(uri, LORA_FILE_NAME))
    return LORA_FILE_NAME
