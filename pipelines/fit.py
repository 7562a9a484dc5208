"""``difforge fit``: does a stage's step fit a TPU slice, and how long would it take?

    difforge fit train model=configs/models/wan2.1_t2v_1.3b.yml slice=v6e-8 height=480 \\
        width=832 num_frames=81 per_device_batch_size=1 ici_fsdp_parallelism=8 --json
    difforge fit generate model=configs/models/wan2.1_t2v_14b.yml slice=tpu7x-8 height=720 \\
        width=1280 num_frames=81 num_inference_steps=50 ici_data_parallelism=2 \\
        ici_context_parallelism=4

compiles the stage's real step (the train stage's step with AdamW and donated buffers; the
generate stage's whole denoising loop) for the slice ahead of time with libtpu (no TPU needed,
:mod:`jaxcore.aot`) and prints the report: per-chip HBM by kind against the limit, whether it
fits, FLOPs, collectives, and the estimated time of one train step or one render with the
implied MFU (:func:`jaxcore.aot.estimate_seconds`). ``--json`` prints it as one JSON object.
``difforge deploy`` checks its steps with the same programs (:func:`pipelines.deploy.fit_check`).

The shapes come from the command line (the pipeline's defaults where a generate size is unset);
the mesh and compute settings are the stages' own keys (``ici_fsdp_parallelism``,
``remat_policy``, ``attention``, ``weights_dtype``, ...), so a fit command is the run's command.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Literal

from jaxcore.compute import ComputeConfig
from jaxcore.config import ConfigError, to_dict
from jaxcore.sharding import MeshConfig


@dataclasses.dataclass(frozen=True)
class FitConfig:
    """``stage``: which step to compile; ``model``: a model YAML, a local diffusers pipeline
    folder or ``tiny[:family]``; ``slice``: a TPU slice (``jaxcore.aot.TOPOLOGIES``).

    Train: a batch of ``per_device_batch_size`` x chips latents of ``height`` x ``width`` x
    ``num_frames`` (fractions: MaxDiffusion's 0.25 on 4 chips is a global batch of 1) with
    ``text_length`` text tokens; ``expert`` picks a two-expert model's denoiser. Generate: the
    pipeline's defaults for any size, step count or guidance left unset. ``headroom``: the share
    of HBM kept free; ``attention_efficiency``: the share of bf16 peak the splash kernel is
    taken to reach (the cost model cannot see inside it); ``out``: also write the report there.
    """

    stage: Literal["train", "generate"]
    model: str
    slice: str = "v5p-8"
    num_slices: int = 1
    height: int | None = None
    width: int | None = None
    num_frames: int | None = None
    per_device_batch_size: float = 1.0
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    text_length: int = 512
    expert: Literal["high", "low"] | None = None
    headroom: float = 0.05
    attention_efficiency: float = 0.5  # jaxcore.aot.DEFAULT_ATTENTION_EFFICIENCY
    json: bool = False
    out: str = ""
    # compiled for TPU: bf16 weights and activations as MaxDiffusion runs on TPU, and each
    # block rematerialised in training (the stage configs' float32 / no-remat defaults are the
    # CPU's); compute.* or bare keys (remat_policy=none) set others
    compute: ComputeConfig = dataclasses.field(
        default_factory=lambda: ComputeConfig(
            weights_dtype="bfloat16", activations_dtype="bfloat16", remat_policy="full"
        )
    )
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)

    def __post_init__(self):
        from jaxcore import aot

        if self.slice not in aot.TOPOLOGIES:
            raise ValueError(
                f"slice: unknown TPU slice {self.slice!r}; known: {sorted(aot.TOPOLOGIES)}"
            )
        for key in ("height", "width", "num_frames", "num_inference_steps"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ValueError(f"{key} must be >= 1, got {value}")
        if self.num_slices < 1 or self.text_length < 1:
            raise ValueError("num_slices and text_length must be >= 1")
        if self.per_device_batch_size <= 0:
            raise ValueError(f"per_device_batch_size must be > 0, got {self.per_device_batch_size}")
        if not 0 <= self.headroom < 1:
            raise ValueError(f"headroom must be in [0, 1), got {self.headroom}")
        if not 0 < self.attention_efficiency <= 1:
            raise ValueError(
                f"attention_efficiency must be in (0, 1], got {self.attention_efficiency}"
            )
        if self.stage == "generate" and self.expert is not None:
            raise ValueError("expert: a train setting (generate runs both experts)")


def _size(cfg: FitConfig, model, key: str) -> int:
    value = getattr(cfg, key)
    if value is None:
        value = model.family.sampling_defaults(model.configs)[key]
    return int(value)


def train_config(cfg: FitConfig, model):
    """The train stage's config for the fit: full fine-tuning of ``model`` with the fit's
    batch, compute and mesh (the optimizer and objective are the stage's defaults)."""
    from jaxcore.config import from_dict
    from stages.train.config import TrainConfig

    return from_dict(
        TrainConfig,
        {
            "output_dir": "unused-by-fit",
            "model": {"model_config": model.source, "expert": cfg.expert},
            "per_device_batch_size": cfg.per_device_batch_size,
            "input": {"dataset_type": "synthetic"},
            "compute": to_dict(cfg.compute),
            "mesh": to_dict(cfg.mesh),
        },
    )


def latent_shape(cfg: FitConfig, model) -> tuple[int, ...]:
    """The latents of one example at the fit's size."""
    sizes = (_size(cfg, model, key) for key in ("height", "width", "num_frames"))
    return tuple(model.family.latent_shape(model.configs, *sizes))


def generate_config(cfg: FitConfig, model):
    from jaxcore.config import from_dict
    from stages.generate.config import GenerateConfig

    sampling = {
        key: getattr(cfg, key)
        for key in ("height", "width", "num_frames", "num_inference_steps", "guidance_scale")
    }
    return from_dict(
        GenerateConfig,
        {
            "pretrained_model_name_or_path": model.source,
            "prompt_file": "unused-by-fit",
            "output_dir": "unused-by-fit",
            "per_device_batch_size": cfg.per_device_batch_size,
            "sampling": {**sampling, "max_sequence_length": cfg.text_length},
            "compute": to_dict(cfg.compute),
            "mesh": to_dict(cfg.mesh),
        },
    )


def program(cfg: FitConfig, mesh):
    """The step's :class:`jaxcore.aot.Program` on ``mesh``."""
    from pipelines import deploy

    model = deploy.fit_model(cfg.model)
    if cfg.stage == "generate":
        return deploy.generate_program(generate_config(cfg, model), model, mesh)
    config = train_config(cfg, model)
    # an image-conditioned model's image tokens: CLIP's 257 where its configs do not say
    features = deploy.batch_features(config, model, latent_shape(cfg, model), cfg.text_length, 257)
    return deploy.train_program(config, model, mesh, features)


def build(cfg: FitConfig):
    """(the step's program, its slice); a step that cannot be built on that mesh (sizes that do
    not split, unknown heads) is a ConfigError naming the stage and slice."""
    from jaxcore import aot, families, sharding
    from stages.common.errors import StageInputError
    from stages.train.config import batch_mesh

    slice_ = aot.topology(cfg.slice)
    try:
        mesh_config, folded = cfg.mesh, None
        if cfg.stage == "train":  # as the train stage will (it reads the same two keys)
            mesh_config, folded = batch_mesh(cfg, slice_.chips * cfg.num_slices, cfg.num_slices)
        mesh = aot.topology_mesh(slice_, mesh_config, cfg.num_slices)
        built = program(cfg, mesh)
        if folded:
            built = dataclasses.replace(built, details={**built.details, "mesh_note": folded})
        return built, slice_
    except (sharding.ShardingError, families.FamilyError, StageInputError, ValueError) as err:
        raise ConfigError(f"fit {cfg.stage} on {cfg.slice}: {err}") from None


def compile_report(cfg: FitConfig, built, slice_):
    """Compile what :func:`build` made, with the fit's headroom and attention efficiency."""
    from jaxcore import aot

    return aot.compile_program(
        built, slice_, headroom=cfg.headroom, attention_efficiency=cfg.attention_efficiency
    )


def run(cfg: FitConfig, *, force: bool = False):
    """Compile, print the report (or its JSON), write it to ``out`` when set. Returns None
    (nothing is an artifact); a step that does not fit is a report, not an error."""
    del force
    from jaxcore import aot

    if not aot.libtpu_available():
        raise ConfigError(f"difforge fit needs libtpu, the TPU compiler: {aot.INSTALL_HINT}")
    built, slice_ = build(cfg)
    if not cfg.json:
        print(
            f"fit {cfg.stage} of {cfg.model} on {cfg.slice}: compiling ahead of time "
            "(minutes for billion-parameter models)",
            file=sys.stderr,
        )
    report = compile_report(cfg, built, slice_)
    text = json.dumps(report.to_dict(), default=str)
    if cfg.out:
        from jaxcore import storage

        storage.write_text(cfg.out, text + "\n")
    if cfg.json:
        print(text)
    else:
        print(report.summary())
        print(f"  per chip: {report.breakdown()}")
        if report.details.get("mesh_note"):
            print(f"  mesh: {report.details['mesh_note']}")
        if report.estimate is not None and report.estimate.note:
            print(f"  estimate: {report.estimate.note}")
    return None
