"""Config of the ``generate`` stage: a frozen dataclass with one section per component.

Key names follow MaxDiffusion where it has one (``pretrained_model_name_or_path``,
``num_inference_steps``, ``guidance_scale``, ``flow_shift``, ``height``, ``width``,
``num_frames``, ``fps``, ``seed``, ``per_device_batch_size``, and in ``compute``:
``attention``, ``weights_dtype``, ``activations_dtype``). Bare leaf keys resolve on the command line when
unique (``guidance_scale=1``). Per-prompt values in a ``.jsonl`` prompt file override the
``sampling`` section for that prompt only.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from jaxcore.compute import ComputeConfig
from jaxcore.sharding import MeshConfig
from jaxcore.step_cache import CacheConfig


@dataclasses.dataclass(frozen=True)
class SamplingSection:
    """Defaults for every prompt (a ``.jsonl`` line may override each of them).

    ``None`` means the pipeline's own default, as its diffusers pipeline has it (Wan:
    480x832, 81 frames, 50 steps, guidance 5; the shift and scheduler of its
    scheduler_config.json). Sizes are checked against the model (VAE compression, patch size)
    before anything renders.
    """

    height: int | None = None
    width: int | None = None
    num_frames: int | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    # the second expert's scale of two-expert models (Wan 2.2 A14B); None: guidance_scale
    guidance_scale_2: float | None = None
    true_cfg_scale: float = 1.0  # Flux's true CFG (with the negative prompt) when > 1
    flow_shift: float | None = None  # None: the pipeline's scheduler_config.json value
    # None: the pipeline's scheduler; else a name of jaxcore.schedulers.ALL_SCHEDULERS (the
    # family says which it samples with: flow samplers for Wan/Flux, classic ones for SD)
    scheduler: str | None = None
    # settings over the pipeline's scheduler_config.json, as diffusers'
    # SchedulerClass.from_config(config, **scheduler_config) takes them (SDXL-Lightning:
    # timestep_spacing=trailing); each scheduler checks its keys and values
    scheduler_config: dict[str, Any] = dataclasses.field(default_factory=dict)
    # diffusers' guidance_rescale (0 = off; SD / SDXL, LTX-2): None: the pipeline's own (LTX-2's
    # 0.7, else 0); families without it refuse a nonzero value
    guidance_rescale: float | None = None
    # LTX-Video's render settings (families without them refuse a value): the frame rate its
    # RoPE is scaled for, the timestep its VAE decodes at and the share of noise mixed into the
    # latents before (a fraction in [0, 1]); None: the pipeline's own (25; 0; decode_timestep)
    frame_rate: float | None = None
    decode_timestep: float | None = None
    decode_noise_scale: float | None = None
    negative_prompt: str = ""
    seed: int = 0
    # text tokens per prompt; None: the pipeline's own (DEFAULT_MAX_SEQUENCE_LENGTH, or the
    # family's sampling default: LTX-Video's 128)
    max_sequence_length: int | None = None

    def __post_init__(self):
        for key in ("height", "width", "num_frames", "num_inference_steps"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ValueError(f"{key} must be >= 1, got {value}")
        if self.flow_shift is not None and self.flow_shift <= 0:
            raise ValueError(f"flow_shift must be > 0, got {self.flow_shift}")
        if self.max_sequence_length is not None and self.max_sequence_length < 1:
            raise ValueError(f"max_sequence_length must be >= 1, got {self.max_sequence_length}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        from jaxcore.schedulers import ALL_SCHEDULERS

        if self.scheduler is not None and self.scheduler not in ALL_SCHEDULERS:
            raise ValueError(
                f"scheduler must be one of {list(ALL_SCHEDULERS)} (or null), got {self.scheduler!r}"
            )
        if self.guidance_rescale is not None and not 0.0 <= self.guidance_rescale <= 1.0:
            raise ValueError(f"guidance_rescale must be in [0, 1], got {self.guidance_rescale}")
        if self.frame_rate is not None and not self.frame_rate > 0:
            raise ValueError(f"frame_rate must be > 0, got {self.frame_rate}")
        if self.decode_timestep is not None and not self.decode_timestep >= 0:
            raise ValueError(f"decode_timestep must be >= 0, got {self.decode_timestep}")
        if self.decode_noise_scale is not None and not 0.0 <= self.decode_noise_scale <= 1.0:
            raise ValueError(f"decode_noise_scale must be in [0, 1], got {self.decode_noise_scale}")
        for key, value in self.scheduler_config.items():
            if not isinstance(key, str) or key.startswith("_"):
                raise ValueError(
                    f"scheduler_config.{key}: metadata keys (_class_name, ...) cannot be set; "
                    "choose the scheduler with scheduler="
                )
            if not isinstance(value, str | int | float | bool | list | None):
                raise ValueError(f"scheduler_config.{key}={value!r}: expected a JSON value")


@dataclasses.dataclass(frozen=True)
class ControlSection:
    """Defaults of every prompt line's ControlNet fields (a line's own value wins; unset:
    diffusers' defaults 1, 0, 1, false, no preprocessing). See
    :mod:`stages.generate.control_inputs` for the fields."""

    controlnet_conditioning_scale: float | tuple[float, ...] | None = None
    control_guidance_start: float | tuple[float, ...] | None = None
    control_guidance_end: float | tuple[float, ...] | None = None
    guess_mode: bool | None = None
    # {"kind": "canny", "low": ..., "high": ...} for every control image (jaxcore.control_preprocess)
    control_preprocess: dict[str, Any] | None = None

    def __post_init__(self):
        self.preprocess_spec  # noqa: B018 - validated now, not at the first line

    @property
    def preprocess_spec(self):
        from jaxcore.control_preprocess import ControlPreprocess

        if self.control_preprocess is None:
            return None
        return ControlPreprocess.from_dict(self.control_preprocess, "control.control_preprocess")


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """One LoRA: a ``.safetensors`` file, a folder holding one, ``gs://`` or a hub id; and the
    multiplier of its delta (on top of the file's own alpha / rank)."""

    path: str
    scale: float = 1.0
    # a two-expert model's (Wan 2.2 A14B) "high" (transformer) or "low" (transformer_2) expert
    expert: Literal["high", "low"] = "high"

    def __post_init__(self):
        if not self.path:
            raise ValueError("a LoRA needs a path")
        if self.expert not in ("high", "low"):
            raise ValueError(f"a LoRA's expert must be 'high' or 'low', got {self.expert!r}")


@dataclasses.dataclass(frozen=True)
class ModelSection:
    """Which checkpoint of a train artifact renders, and the LoRAs every prompt gets. The
    source is ``pretrained_model_name_or_path`` (top level); how models compute is
    ``compute``."""

    checkpoint: str = "best"  # for a train artifact: "best", "final" or a step number
    # For a train artifact: the diffusers pipeline that supplies the other components (VAE,
    # text encoders, tokenizers, scheduler; default: the pipeline the run was fine-tuned from).
    base_pipeline: str | None = None
    # LoRAs merged into the denoiser for every prompt without its own ``loras`` list.
    loras: tuple[LoraSpec, ...] = ()
    # A LoRA key that names no layer of the model: an error (true) or a warning (false).
    lora_strict: bool = True
    # With compute.quantization: a folder (local or gs://) where the quantized denoiser
    # weights are kept as an artifact per model and mode, written by the first run that
    # lacks them and loaded by every later one (stages.generate.quantized_cache)
    quantized_cache: str | None = None
    # ControlNets beside the denoiser: diffusers ControlNetModel / ControlNetUnionModel /
    # FluxControlNetModel folders (local or gs://), one or a list; unset: the pipeline's own
    # controlnet component, if it has one
    controlnet: str | tuple[str, ...] | None = None
    # The text encoder's hidden states the prompt embedding stacks, for a family whose
    # pipelines take them (Flux.2 [klein]'s text_encoder_out_layers); unset: the pipeline's own
    text_encoder_out_layers: tuple[int, ...] | None = None

    def __post_init__(self):
        ck = self.checkpoint
        if ck not in ("best", "final") and not ck.isdigit():
            raise ValueError(f"checkpoint must be 'best', 'final' or a step, got {ck!r}")
        layers = self.text_encoder_out_layers
        if layers is not None and (
            not layers or any(isinstance(v, bool) or not isinstance(v, int) for v in layers)
        ):
            raise ValueError(
                f"text_encoder_out_layers must be a non-empty list of ints, got {layers!r}"
            )


DEFAULT_FPS = 16  # an MP4's rate when neither the config nor the model's frame_rate sets one


@dataclasses.dataclass(frozen=True)
class OutputSection:
    """What each prompt leaves behind, and the run's gallery."""

    # the MP4s' frames per second; None: the prompt's frame_rate where its model takes one
    # (LTX-Video, LTX-2: the rate its motion and sound are made for), else DEFAULT_FPS
    fps: float | None = None
    save_arrays: bool = False  # also write <name>.npy: float32 [F, H, W, 3] in [0, 1]
    writer_threads: int = 4
    contact_sheet_columns: int = 8
    thumbnail_size: int = 160

    def __post_init__(self):
        if self.fps is not None and not self.fps > 0:
            raise ValueError(f"fps must be > 0, got {self.fps}")
        if self.writer_threads < 1:
            raise ValueError(f"writer_threads must be >= 1, got {self.writer_threads}")
        if self.contact_sheet_columns < 1:
            raise ValueError(
                f"contact_sheet_columns must be >= 1, got {self.contact_sheet_columns}"
            )
        if self.thumbnail_size < 8:
            raise ValueError(f"thumbnail_size must be >= 8, got {self.thumbnail_size}")


# diffusers' max_sequence_length default of the Wan and Flux pipelines (SD's CLIP takes 77
# whatever is asked); a family whose pipelines default to another names it in its
# sampling_defaults
DEFAULT_MAX_SEQUENCE_LENGTH = 512


@dataclasses.dataclass(frozen=True)
class GenerateConfig:
    """``difforge generate``: render every prompt of ``prompt_file`` into ``output_dir``.

    ``pretrained_model_name_or_path``: a diffusers pipeline directory of a supported family
    (local or gs://), a Hugging Face repo id (from the local cache; nothing is downloaded at
    run time), or a ``train`` / ``evaluate`` artifact (its ``model.checkpoint``).
    ``per_device_batch_size``: prompts per device per batch; the global batch is this times the
    data-parallel ways of the mesh (at least 1), padded up to a multiple of those ways.
    """

    pretrained_model_name_or_path: str = ""
    prompt_file: str = ""
    output_dir: str = ""
    run_name: str = ""
    per_device_batch_size: float = 1.0
    sampling: SamplingSection = dataclasses.field(default_factory=SamplingSection)
    model: ModelSection = dataclasses.field(default_factory=ModelSection)
    compute: ComputeConfig = dataclasses.field(default_factory=ComputeConfig)
    output: OutputSection = dataclasses.field(default_factory=OutputSection)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    # step caching (First-Block-Cache, MagCache, calibration) and its quality gate
    cache: CacheConfig = dataclasses.field(default_factory=CacheConfig)
    # defaults of the prompt lines' ControlNet fields
    control: ControlSection = dataclasses.field(default_factory=ControlSection)

    def __post_init__(self):
        for key in ("pretrained_model_name_or_path", "prompt_file", "output_dir"):
            if not getattr(self, key):
                raise ValueError(f"{key} is required (set it in the YAML or as {key}=...)")
        if self.per_device_batch_size <= 0:
            raise ValueError(f"per_device_batch_size must be > 0, got {self.per_device_batch_size}")
        if self.model.quantized_cache and self.compute.quantization == "none":
            raise ValueError(
                "model.quantized_cache keeps quantized denoiser weights: set "
                "compute.quantization (int8_weights, fp8_weights, int8 or fp8)"
            )
        if self.cache.compare_dense and not self.compares:
            raise ValueError(
                "cache.compare_dense compares a cached or quantized render with the dense float "
                "one: set cache.kind or compute.quantization"
            )

    @property
    def compares(self) -> bool:
        """Whether the quality gate has something to compare: a step cache or quantization."""
        return self.cache.enabled or self.compute.quantization != "none"
