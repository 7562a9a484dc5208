"""Config of the ``train`` stage: a frozen dataclass with one section per component.

Key names follow MaxDiffusion where it has one (``per_device_batch_size``, ``learning_rate``,
``max_train_steps``, ``checkpoint_every``, ``eval_every``, ``weights_dtype``, ...). Bare leaf
keys resolve on the command line when unique (``learning_rate=1e-4``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal

from jaxcore import quantization
from jaxcore.compute import ComputeConfig
from jaxcore.sharding import MeshConfig
from stages.common.objective import ObjectiveSection

# the mutually exclusive model sources of ``model``
MODEL_SOURCES = ("pretrained_model_name_or_path", "model_config", "init_from")


@dataclasses.dataclass(frozen=True)
class ModelSection:
    """Where the denoiser comes from (its family follows from the source).

    Exactly one source: ``pretrained_model_name_or_path`` (a diffusers pipeline directory, or
    its denoiser directory; fine-tuning), ``model_config`` (a model YAML naming its ``family``
    and the denoiser's architecture; from scratch) or ``init_from`` (a previous train or
    evaluate artifact; its ``init_checkpoint``: "final", "best" or a step number).
    ``model_config_section`` picks the YAML section (default: the family's denoiser).
    ``expert``: for a two-expert pipeline (Wan 2.2 A14B), which expert to fine-tune: ``high``
    (``transformer``, timesteps at or above the boundary) or ``low`` (``transformer_2``);
    training then samples timesteps only in that expert's range.
    """

    pretrained_model_name_or_path: str | None = None
    model_config: str | None = None
    model_config_section: str | None = None
    init_from: str | None = None
    init_checkpoint: str = "final"
    expert: Literal["high", "low"] | None = None

    def __post_init__(self):
        sources = [k for k in MODEL_SOURCES if getattr(self, k)]
        if len(sources) != 1:
            raise ValueError(
                "set exactly one of model.pretrained_model_name_or_path, model.model_config, "
                f"model.init_from (got {sources or 'none'})"
            )
        if self.expert is not None and not self.pretrained_model_name_or_path:
            raise ValueError(
                "model.expert picks an expert of a two-expert pipeline: it needs "
                "model.pretrained_model_name_or_path"
            )
        if self.expert not in (None, "high", "low"):
            raise ValueError(f"model.expert must be 'high' or 'low', got {self.expert!r}")
        ic = self.init_checkpoint
        if ic not in ("final", "best") and not ic.isdigit():
            raise ValueError(f"init_checkpoint must be 'final', 'best' or a step, got {ic!r}")


@dataclasses.dataclass(frozen=True)
class DataSection:
    """Input pipeline. ``synthetic`` feeds random tensors: latents of ``synthetic_latent_shape``
    and the model family's conditioning for prompts of ``synthetic_text_length`` tokens."""

    dataset_type: Literal["tfrecord", "synthetic"] = "tfrecord"
    shuffle_buffer_size: int = 1024
    prefetch_batches: int = 2
    # A train split of at most this many MiB of tensors is read once and held on the devices;
    # each step's batch is then gathered there from a seeded per-epoch permutation (no tf.data
    # on the step's critical path: small data sets such as DreamBooth's or the demo's). 0: never.
    in_memory_max_mib: float = 64.0
    # The global batch is this many equal parts, each read from its own shards; fixed, it
    # makes the data order independent of the host count (a 2-host run equals a 1-host run
    # and resumes on any host count dividing it). None: one stream per host.
    data_streams: int | None = None
    synthetic_latent_shape: tuple[int, ...] = (4, 1, 8, 8)
    synthetic_text_length: int = 8
    synthetic_image_tokens: int = 8  # image cross-attention models (Wan 2.1 I2V) only
    # The share of rows whose caption tensors are swapped for the empty caption's (the convert
    # artifact's empty_prompt.safetensors), drawn per row and step: the model learns the
    # unconditional prediction classifier-free guidance subtracts (diffusers' training scripts'
    # --proportion_empty_prompts; SD 1.x, SD3 and Flux were trained with ~0.1). 0: off.
    proportion_empty_prompts: float = 0.0

    def __post_init__(self):
        if not 0.0 <= self.proportion_empty_prompts <= 1.0:
            raise ValueError(
                f"proportion_empty_prompts must be in [0, 1], got {self.proportion_empty_prompts}"
            )
        if self.in_memory_max_mib < 0:
            raise ValueError(
                f"in_memory_max_mib must be >= 0 (0 = never), got {self.in_memory_max_mib}"
            )
        if self.shuffle_buffer_size < 1:
            raise ValueError(f"shuffle_buffer_size must be >= 1, got {self.shuffle_buffer_size}")
        if not self.synthetic_latent_shape or min(self.synthetic_latent_shape) < 1:
            raise ValueError(
                f"synthetic_latent_shape must be positive sizes, got {self.synthetic_latent_shape}"
            )
        if self.data_streams is not None and self.data_streams < 1:
            raise ValueError(f"data_streams must be >= 1, got {self.data_streams}")
        if self.synthetic_image_tokens < 1:
            raise ValueError(
                f"synthetic_image_tokens must be >= 1, got {self.synthetic_image_tokens}"
            )
        if self.synthetic_text_length < 1:
            raise ValueError(
                f"synthetic_text_length must be >= 1, got {self.synthetic_text_length}"
            )


@dataclasses.dataclass(frozen=True)
class OptimizerSection:
    """optax AdamW with linear warm-up then constant or cosine decay, and global-norm clipping."""

    learning_rate: float = 1e-5
    lr_schedule: Literal["constant", "cosine"] = "constant"
    warmup_steps_fraction: float = 0.1
    end_learning_rate_fraction: float = 0.0
    adam_b1: float = 0.9
    adam_b2: float = 0.999
    adam_eps: float = 1e-8
    adam_weight_decay: float = 0.0
    max_grad_norm: float = 1.0

    def __post_init__(self):
        if self.learning_rate <= 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate}")
        if not 0.0 <= self.warmup_steps_fraction < 1.0:
            raise ValueError(
                f"warmup_steps_fraction must be in [0, 1), got {self.warmup_steps_fraction}"
            )
        if self.max_grad_norm < 0:
            raise ValueError(f"max_grad_norm must be >= 0 (0 = off), got {self.max_grad_norm}")


@dataclasses.dataclass(frozen=True)
class LoraSection:
    """LoRA training: ``rank > 0`` trains only low-rank adapters on the frozen denoiser.

    ``alpha``: the scale is ``alpha / rank`` (None: alpha = rank, scale 1); ``target_modules``:
    PEFT-style names of the Linear layers to adapt (a name or a dotted suffix of one; empty:
    the model family's defaults). The train artifact then holds the adapters in diffusers'
    layout, ``lora/pytorch_lora_weights.safetensors``, which ``load_lora_weights`` reads.
    """

    rank: int = 0
    alpha: float | None = None
    target_modules: tuple[str, ...] = ()

    def __post_init__(self):
        from jaxcore.lora.training import check_target_patterns

        if self.rank < 0:
            raise ValueError(f"rank must be >= 0 (0: full fine-tuning), got {self.rank}")
        if self.alpha is not None and self.alpha <= 0:
            raise ValueError(f"alpha must be > 0, got {self.alpha}")
        check_target_patterns(self.target_modules)

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return (self.alpha if self.alpha is not None else self.rank) / self.rank


@dataclasses.dataclass(frozen=True)
class ControlNetSection:
    """ControlNet training (diffusers' examples/controlnet/train_controlnet*.py): with
    ``enabled``, a ControlNet is trained beside the frozen denoiser (SD / SDXL) on the
    records' conditioning images (convert's ``dataset.conditioning_image_column``), and the
    train artifact holds it as ``controlnet/`` in diffusers' format.

    ``init``: ``"denoiser"`` (diffusers' ``ControlNetModel.from_unet``: the denoiser's encoder
    half copied, the residual convs zero) or a diffusers ControlNet folder to go on from.
    ``conditioning_embedding_out_channels``: the control-image embedding's widths of a
    ControlNet made from the UNet (one stride-2 step per entry after the first, so
    ``2 ** (len - 1)`` must be the VAE's downscale: 4 entries for SD's 8x).
    """

    enabled: bool = False
    init: str = "denoiser"
    conditioning_embedding_out_channels: tuple[int, ...] = (16, 32, 96, 256)

    def __post_init__(self):
        if not isinstance(self.enabled, bool):
            raise ValueError(f"controlnet.enabled must be true or false, got {self.enabled!r}")
        if not self.init:
            raise ValueError('controlnet.init must be "denoiser" or a ControlNet folder')
        channels = self.conditioning_embedding_out_channels
        if not channels or any(not isinstance(c, int) or c < 1 for c in channels):
            raise ValueError(
                "controlnet.conditioning_embedding_out_channels must be positive ints, got "
                f"{channels!r}"
            )
        object.__setattr__(self, "conditioning_embedding_out_channels", tuple(channels))


@dataclasses.dataclass(frozen=True)
class PriorPreservationSection:
    """DreamBooth's prior preservation (diffusers' ``--with_prior_preservation``): ``data``, a
    convert artifact of class images captioned with the class prompt (e.g. converted from a
    ``generate`` artifact of the base model), is read beside the instance data; each step
    trains on a batch of each, and the loss is ``instance loss + prior_loss_weight * class
    loss``. None: off."""

    data: str | None = None
    prior_loss_weight: float = 1.0

    def __post_init__(self):
        if self.prior_loss_weight < 0:
            raise ValueError(f"prior_loss_weight must be >= 0, got {self.prior_loss_weight}")

    @property
    def enabled(self) -> bool:
        return bool(self.data)


@dataclasses.dataclass(frozen=True)
class CheckpointSection:
    """orbax checkpoints inside the artifact (``checkpoints/<step>``)."""

    checkpoint_every: int = 100
    max_to_keep: int = 3
    enable_async_checkpointing: bool = True
    save_optimizer: bool = True

    def __post_init__(self):
        if self.checkpoint_every < 1:
            raise ValueError(f"checkpoint_every must be >= 1, got {self.checkpoint_every}")
        if self.max_to_keep < 1:
            raise ValueError(f"max_to_keep must be >= 1, got {self.max_to_keep}")


@dataclasses.dataclass(frozen=True)
class MetricsSection:
    """Logging cadence, MFU reference and the optional profiler window."""

    log_every: int = 1
    # an INFO progress line (step, loss, step time, tokens/s, ETA), and metrics.jsonl
    # flushed, at most this often (and at the first and last step); 0 = every logged step
    progress_every_s: float = 30.0
    peak_flops_per_device: float | None = None  # FLOP/s; None = measured (CPU) or table
    enable_profiler: bool = False
    profiler_start_step: int = 2
    profiler_num_steps: int = 2

    def __post_init__(self):
        if self.log_every < 1:
            raise ValueError(f"log_every must be >= 1, got {self.log_every}")
        if self.progress_every_s < 0:
            raise ValueError(f"progress_every_s must be >= 0, got {self.progress_every_s}")


@dataclasses.dataclass(frozen=True)
class EvalSection:
    """Periodic eval on the data artifact's eval split (same scoring as ``evaluate``)."""

    eval_every: int = 0  # 0 = never during training
    eval_batch_size: int = 8
    eval_seed: int = 0
    max_eval_records: int | None = None


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """``difforge train configs/stages/train.yml data=<convert artifact> output_dir=...``."""

    output_dir: str
    model: ModelSection
    data: str | None = None  # a convert artifact (required unless dataset_type=synthetic)
    run_name: str = "train"
    seed: int = 0
    max_train_steps: int = 100
    per_device_batch_size: float = 1.0
    export_diffusers: bool = False
    jax_cache_dir: str | None = None
    compute: ComputeConfig = dataclasses.field(default_factory=ComputeConfig)
    lora: LoraSection = dataclasses.field(default_factory=LoraSection)
    controlnet: ControlNetSection = dataclasses.field(default_factory=ControlNetSection)
    input: DataSection = dataclasses.field(default_factory=DataSection)
    prior_preservation: PriorPreservationSection = dataclasses.field(
        default_factory=PriorPreservationSection
    )
    optimizer: OptimizerSection = dataclasses.field(default_factory=OptimizerSection)
    objective: ObjectiveSection = dataclasses.field(default_factory=ObjectiveSection)
    checkpointing: CheckpointSection = dataclasses.field(default_factory=CheckpointSection)
    metrics: MetricsSection = dataclasses.field(default_factory=MetricsSection)
    evaluation: EvalSection = dataclasses.field(default_factory=EvalSection)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)

    @classmethod
    def implied_by_overrides(cls, given: Mapping[tuple[str, ...], Any], current=None) -> dict:
        """What the command line means beyond its keys: a model source given there replaces
        the YAML's (two given there still conflict), and ``data=`` means records unless
        ``dataset_type`` is given too."""
        del current
        implied = {}
        sources = [("model", key) for key in MODEL_SOURCES]
        if any(path in given for path in sources):
            implied.update({path: None for path in sources if path not in given})
        if given.get(("data",)) and ("input", "dataset_type") not in given:
            implied[("input", "dataset_type")] = "tfrecord"
        return implied

    def __post_init__(self):
        if self.max_train_steps < 1:
            raise ValueError(f"max_train_steps must be >= 1, got {self.max_train_steps}")
        if self.compute.quantization not in quantization.TRAINABLE:
            raise ValueError(
                f"compute.quantization={self.compute.quantization}: train runs its products in "
                "fp8 (quantization=fp8: e4m3 forward, e5m2 gradients, float weights) or not at "
                "all; the other modes are for generate and evaluate"
            )
        if self.per_device_batch_size <= 0:
            raise ValueError(f"per_device_batch_size must be > 0, got {self.per_device_batch_size}")
        if self.input.dataset_type == "tfrecord" and not self.data:
            raise ValueError("data (a convert artifact) is required unless dataset_type=synthetic")
        if self.evaluation.eval_every and not self.data:
            raise ValueError("eval_every needs data (a convert artifact with an eval split)")
        if self.controlnet.enabled:
            self._check_controlnet()
        if self.prior_preservation.enabled and self.input.dataset_type != "tfrecord":
            raise ValueError(
                "prior_preservation.data needs instance records too: set data= (dataset_type "
                "tfrecord)"
            )

    def _check_controlnet(self) -> None:
        """What a ControlNet run cannot be combined with, by name."""
        if self.lora.enabled:
            raise ValueError(
                "controlnet.enabled with lora.rank > 0: ControlNet training trains the whole "
                "ControlNet (the denoiser frozen); LoRA on a ControlNet is not supported"
            )
        if self.export_diffusers:
            raise ValueError(
                "controlnet.enabled with export_diffusers: the denoiser is frozen in a "
                "ControlNet run; the ControlNet is exported as controlnet/ anyway"
            )
        if self.input.dataset_type != "tfrecord":
            raise ValueError(
                "controlnet.enabled needs records with conditioning images (dataset_type "
                "tfrecord, converted with dataset.conditioning_image_column)"
            )


def global_batch_size(per_device_batch_size: float, num_devices: int) -> int:
    """MaxDiffusion: ``per_device_batch_size`` may be fractional; the product must be whole."""
    total = per_device_batch_size * num_devices
    if abs(total - round(total)) > 1e-9 or round(total) < 1:
        raise ValueError(
            f"per_device_batch_size={per_device_batch_size} x {num_devices} devices = {total} "
            "is not a whole global batch"
        )
    return int(round(total))


def batch_mesh(config, num_devices: int, num_slices: int = 1):
    """(the mesh config this run's global batch trains on, a note or None): a global batch
    smaller than the batch axes splits its tokens over the fsdp ways it cannot fill
    (:func:`jaxcore.sharding.fold_batch_into_context`). ``config``: a TrainConfig, or anything
    with its ``per_device_batch_size`` and ``mesh`` (``difforge fit``'s config)."""
    from jaxcore import sharding

    batch = global_batch_size(config.per_device_batch_size, num_devices)
    return sharding.fold_batch_into_context(config.mesh, batch, num_devices, num_slices)
