"""The model-family interface: everything model-specific the stages need, behind one class.

A family (Wan, Flux, ...) is a small subclass of :class:`Family` in ``jaxcore/families/<name>.py``
registered in the static table of :mod:`jaxcore.families`. The stages (convert, train,
evaluate, generate) call only this interface; the sampling loop (:mod:`jaxcore.sampling`) and
the training objectives (:mod:`jaxcore.flow_matching`, :mod:`jaxcore.ddpm_objective`) are
shared and written once.

What a family tells the stages:

- **recognition and loading**: the diffusers ``model_index.json`` ``_class_name`` values it
  loads (:attr:`Family.pipeline_classes`) and the denoiser's ``config.json`` class names
  (:attr:`Family.denoiser_classes`); :meth:`Family.load_pipeline` loads every component.
- **conditioning**: the named tensors its encoders produce (:meth:`Family.conditioning_specs`,
  name/shape/dtype) — what convert writes into records and train/evaluate read back — and the
  encoders themselves (:meth:`Family.load_encoders`: media -> latents, captions -> tensors).
- **media <-> latents**: which sizes it can encode (:meth:`Family.geometry`), the latent shape
  (:meth:`Family.latent_shape`), encode (in :class:`Encoders`) and decode (:meth:`Family.decode`).
- **sound** (LTX-2): a family that renders an audio track beside the frames decodes it in
  :meth:`Family.decode_audio` (default: none); generate muxes it into the MP4 and writes a WAV.
- **the denoiser**: config, build, init, load, shard (``abstract_params``) and export to
  diffusers format through the functions of its model module (:class:`DenoiserModel`, data);
  apply to ``(latents, timestep, conditioning)``, FLOPs.
- **sampling defaults**: scheduler and shift from the pipeline's scheduler config, and how the
  user's guidance settings become a CFG scale and the denoiser's own inputs
  (:meth:`Family.guidance`).
- **image conditioning** (image-to-video): which image inputs a pipeline takes
  (:meth:`Family.image_inputs`), how they become conditioning tensors
  (:meth:`Family.encode_images`), what the loop's result needs before decoding
  (:meth:`Family.finish_latents`), and what the loop computes from them once per render
  rather than every step (:meth:`Family.loop_conditioning`: Flux.2 [klein] KV's reference
  keys and values).
- **two experts** (Wan 2.2 A14B): :meth:`Family.load_pipeline` may give the pipeline a second
  denoiser and the timestep where it takes over (:class:`jaxcore.pipeline.SecondExpert`).
- **the training target**: :attr:`Family.objective` ("flow_matching" for the flow families;
  "epsilon" / "v_prediction" for UNet families, where it depends on the pipeline's scheduler
  config: :meth:`Family.pipeline_objective`), and where its loss counts
  (:meth:`Family.loss_mask`: LTX-Video's image-to-video records leave their clean first frame
  out).
- **size and negative conditioning** (SDXL): tensors that depend on the render size and join
  both CFG branches (:meth:`Family.size_conditioning`), and how the negative branch's encoded
  prompts are finished (:meth:`Family.negative_conditioning`).
- **stochastic samplers and guidance rescale**: :meth:`Family.make_seeded_schedule` hands the
  batch's seeds to samplers that draw noise every step; :meth:`Family.with_guidance_rescale`
  accepts diffusers' ``guidance_rescale`` where the family's pipelines have it.

Timesteps at this interface are always on the scheduler's scale, ``[0, num_train_timesteps]``
(Wan's convention); a family whose denoiser wants another (Flux: ``t / 1000``) converts inside
:meth:`Family.apply`.
"""

from __future__ import annotations

import abc
import dataclasses
import json
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxcore import quantization, sharding, weights
from jaxcore.compute import ComputeConfig
from jaxcore.family_types import (  # noqa: F401 - the interface's names, re-exported
    MICRO_CONDITIONING,
    FamilyError,
    Geometry,
    Guidance,
    ImageInputs,
    TensorSpec,
)
from jaxcore.flow_matching import MAXDIFFUSION_SIGMA_MIN
from jaxcore.pipeline import Pipeline

LATENTS_FIELD = "latents"  # the prompt-file field of a render's initial latents (a .npy)


class Encoders(abc.ABC):
    """The encoders convert runs: media -> normalised latents, captions -> named tensors.

    Every call takes at most ``batch_size`` rows and pads to it, so any batch reuses one
    compiled program. An ordinary object (weak-referenceable, as Beam's model cache needs).
    """

    batch_size: int

    @abc.abstractmethod
    def encode_media(self, videos: np.ndarray) -> np.ndarray:
        """``[B, 3, F, H, W]`` in [-1, 1] -> normalised latents ``[B, *latent_shape]`` float32."""

    @abc.abstractmethod
    def encode_text(self, captions: Sequence[str]) -> dict[str, np.ndarray]:
        """Captions -> ``{conditioning name: [B, *shape]}`` float32."""

    def _check_batch(self, count: int, what: str) -> int:
        """``count`` (rows of ``what``), checked to fit one call of ``batch_size`` rows."""
        if not 1 <= count <= self.batch_size:
            raise ValueError(f"{count} {what} do not fit in encoder batch_size={self.batch_size}")
        return count

    def _padded(self, rows, what: str):
        """``rows`` repeated up to ``batch_size`` (one compiled program), and their count."""
        count = self._check_batch(len(rows), what)
        return list(rows) + [rows[-1]] * (self.batch_size - count), count

    def _padded_images(self, videos: np.ndarray, model: str) -> tuple[np.ndarray, int]:
        """An image model's media, one-frame clips ``[B, 3, 1, H, W]`` (convert hands every
        family its media as videos) -> the images ``[batch_size, 3, H, W]`` float32 padded as
        :meth:`_padded` pads rows, and ``B``; ``model`` names the model in the error."""
        videos = np.asarray(videos, np.float32)
        if videos.ndim != 5 or videos.shape[2] != 1:
            raise ValueError(
                f"{model} encodes images: videos must be [B, 3, 1, H, W], got {videos.shape}"
            )
        padded, count = self._padded(list(videos[:, :, 0]), "images")
        return np.stack(padded), count

    def encode_references(self, images: Sequence[np.ndarray]) -> dict[str, np.ndarray]:
        """Edit pairs: one reference image per row -> the reference latents a record holds
        (a family whose :meth:`Family.reference_features` gives any)."""
        raise NotImplementedError(f"{type(self).__name__} encodes no reference images")

    def encode_media_with_sound(self, videos: np.ndarray, sounds: Sequence) -> np.ndarray:
        """Clips with their sounds (convert's ``dataset.audio_column``; each sound has
        ``waveform`` ``[channels, samples]`` and ``sample_rate``) -> latents, as
        :meth:`encode_media` (a family whose :meth:`Family.records_sound` is True)."""
        raise NotImplementedError(f"{type(self).__name__} encodes no sound")

    def encode_media_conditioning(self, videos: np.ndarray) -> dict[str, np.ndarray]:
        """``[B, 3, F, H, W]`` in [-1, 1] -> the conditioning a record takes from its own
        media (image-to-video: the first frame), ``{name: [B, *shape]}``. Default: none."""
        del videos
        return {}


@dataclasses.dataclass(frozen=True)
class DenoiserModel:
    """A family's denoiser: its model file's :class:`jaxcore.weights.ModelKind` (``KIND``:
    module, load, init, abstract params), the diffusers weight map and the error ``load``
    raises for a config.json it refuses; what the :class:`Family` denoiser methods call, with
    :meth:`Family.denoiser_kwargs`.

    Attributes:
      kind: ``jaxcore/models/<model>.py``'s ``KIND``.
      weight_map: ``weight_map(config)``, diffusers weight key -> our parameter.
      config_error: what ``kind.load`` raises for a config.json it refuses.
    """

    kind: weights.ModelKind
    weight_map: Callable[[Any], Mapping]
    config_error: type[Exception]


class Family(abc.ABC):
    """One model line (see the module docstring). Subclasses are stateless singletons."""

    name: str = ""
    description: str = ""
    pipeline_classes: tuple[str, ...] = ()  # model_index.json _class_name values
    denoiser_classes: tuple[str, ...] = ()  # the denoiser's config.json _class_name values
    denoiser_component: str = "transformer"  # its folder in a pipeline / section in a YAML
    objective: str = "flow_matching"
    # flow matching's noise left at t = 0 in training, x_t = (1 - s) x0 + s noise with
    # s = (1 - t) sigma_min + t: MaxDiffusion's Wan trainer's, every family's but LTX-2's
    # (ltx-trainer: s = t)
    training_sigma_min: float = MAXDIFFUSION_SIGMA_MIN
    # PEFT-style target_modules a LoRA trains when the config names none
    lora_default_targets: tuple[str, ...] = ()
    # the ControlNet pipelines take the render size from the first control image when none
    # is given (StableDiffusion(XL)ControlNetPipeline; Flux's use its default size)
    size_from_control_image: bool = False
    # the denoiser's model functions (every family sets its own)
    denoiser_model: DenoiserModel
    # the options model_index.json holds beyond the components (a class with from_index(index),
    # from_dict / to_dict: the configs' ``pipeline`` entry, a model YAML's ``pipeline:``
    # section); None: the family has none
    pipeline_options: type | None = None

    # --- recognition, components -----------------------------------------------------------
    def __hash__(self) -> int:  # singletons; hashable so jitted functions can be cached on them
        return hash(type(self))

    def __eq__(self, other) -> bool:
        return type(self) is type(other)

    def __repr__(self) -> str:
        return f"<family {self.name}>"

    @abc.abstractmethod
    def component_config_classes(self) -> dict[str, type]:
        """{component name: its config dataclass} (sections of a model YAML, folders of a
        pipeline). Each class has ``from_dict(config.json dict)`` and ``to_dict()``."""

    def optional_config_classes(self) -> dict[str, type]:
        """Sections a model YAML may add to :meth:`component_config_classes` (components only
        some pipelines of the family have, pipeline-level options). Default: the
        :attr:`pipeline_options` as ``pipeline``, where the family has them."""
        return {} if self.pipeline_options is None else {"pipeline": self.pipeline_options}

    def expert_component(self, configs: Mapping[str, Any], expert: str) -> str:
        """The component holding one expert (``high`` / ``low``) of a two-expert pipeline with
        these configs; an error naming the pipeline's shape when it has no such expert."""
        del configs
        raise FamilyError(f"the {self.name} family has no experts (model.expert={expert})")

    def default_scheduler_config(self) -> dict:
        """The scheduler config of the family's reference pipeline (diffusers'
        ``scheduler_config.json``), for a model known from a YAML, which names none; the
        default: none (each sampler's own defaults)."""
        return {}

    def second_expert_component(self, configs: Mapping[str, Any]) -> str | None:
        """The component of a two-expert pipeline's second (low-noise) denoiser, None for a
        pipeline with one denoiser (the default)."""
        del configs
        return None

    def expert_boundary_ratio(self, configs: Mapping[str, Any]) -> float:
        """Where the experts split, as a fraction of the training timesteps."""
        raise FamilyError(f"the {self.name} family has no experts")

    def check_model_index(self, index: Mapping, where: str) -> None:
        """Refuse a ``model_index.json`` this family recognises but cannot run (naming the key).

        The default accepts every index whose ``_class_name`` the family lists and, where the
        family has :attr:`pipeline_options`, that its options read."""
        if self.pipeline_options is None:
            return
        try:
            self.pipeline_options.from_index(index)
        except ValueError as err:
            raise FamilyError(f"{where}: {err}") from None

    def check_configs(self, configs: Mapping[str, Any], where: str) -> None:
        """Refuse component configs that do not make one of the family's models (e.g. a model
        YAML's sections that disagree). The default accepts any."""
        del configs, where

    def component_configs(self, directory: str | os.PathLike) -> dict[str, Any]:
        """Validated configs of a pipeline directory's components (no weights are read), and
        its :attr:`pipeline_options` from ``model_index.json`` as ``pipeline`` (checked first)
        where the family has them."""
        directory = Path(directory)
        out = {}
        if self.pipeline_options is not None:
            index = read_model_index(directory)
            self.check_model_index(index, str(directory / "model_index.json"))
            out["pipeline"] = self.pipeline_options.from_index(index)
        for component, cls in self.component_config_classes().items():
            path = directory / component / "config.json"
            if not path.is_file():
                raise FamilyError(f"{directory}: no {component}/config.json ({self.name} pipeline)")
            out[component] = _from_dict(cls, weights.read_config(path.parent), path)
        return out

    # --- the denoiser -----------------------------------------------------------------------
    def denoiser_config(self, data: Mapping[str, Any], where: str = "config") -> Any:
        """The denoiser's config from a config.json dict, a YAML section or a checkpoint."""
        cls = self.component_config_classes()[self.denoiser_component]
        return _from_dict(cls, data, where)

    def denoiser_kwargs(self, compute: ComputeConfig) -> dict:
        """The keywords the denoiser module and its init / load functions take from
        ``compute``; the default: all of ``compute.denoiser_kwargs``."""
        return compute.denoiser_kwargs

    def make_denoiser(self, config, compute: ComputeConfig, mesh=None):
        """The denoiser module (no parameters)."""
        return self.denoiser_model.kind.module(config, mesh=mesh, **self.denoiser_kwargs(compute))

    def abstract_params(self, module) -> Mapping:
        """The ``params`` collection as boxed ShapeDtypeStructs (logical partitioning kept)."""
        return self.denoiser_model.kind.abstract_params(module)

    def init_denoiser(self, config, rng, compute: ComputeConfig, mesh=None, rules=None):
        """(module, params) randomly initialised, already placed on ``mesh``."""
        kwargs = self.denoiser_kwargs(compute)
        return self.denoiser_model.kind.init(config, rng, mesh=mesh, rules=rules, **kwargs)

    def load_denoiser(
        self, directory, compute: ComputeConfig, mesh=None, rules=None, quantize: bool = False
    ):
        """(module, params) from a diffusers denoiser directory (config.json + safetensors).
        ``quantize``: each kernel quantized as ``compute.quantization`` says as it is placed
        (:func:`jaxcore.quantization.on_load`), so the float weights are never all on the
        devices at once."""
        kwargs = self.denoiser_kwargs(compute)
        finish = quantization.on_load(compute.quantization) if quantize else None
        try:
            return self.denoiser_model.kind.load(
                directory, mesh=mesh, rules=rules, finish=finish, **kwargs
            )
        except self.denoiser_model.config_error as err:
            raise FamilyError(f"{directory}/config.json: {err}") from None

    @abc.abstractmethod
    def apply(
        self, module, params, latents, timestep, conditioning: Mapping[str, Any], run_stack=None
    ):
        """The denoiser's prediction for ``latents [B, *latent_shape]`` at ``timestep [B]``
        (scheduler scale, 0..1000) given the conditioning tensors by name.

        ``run_stack`` (step caching, :mod:`jaxcore.step_cache`): the denoiser runs its block
        stack through ``run_stack(streams, run_blocks, num_blocks) -> (streams, extra)``
        (``streams``: a tuple of activations, the first the one caches measure;
        ``run_blocks(streams, start, stop)`` runs blocks ``start..stop-1``) and the call
        returns ``(prediction, extra)``. A family whose denoiser cannot do this raises
        FamilyError when given one."""

    def export_denoiser(self, module, params) -> tuple[dict[str, np.ndarray], dict]:
        """(diffusers state dict, config.json dict) of a trained denoiser; the config names the
        first of :attr:`denoiser_classes`."""
        state = weights.export_state_dict(params, self.denoiser_model.weight_map(module.config))
        return state, {"_class_name": self.denoiser_classes[0], **module.config.to_dict()}

    @abc.abstractmethod
    def flops_per_forward(self, config, batch: int, latent_shape, conditioning_shapes) -> int:
        """Matmul FLOPs of one denoiser forward (for MFU); training is 3x this."""

    def attention_flops_per_forward(
        self, config, batch: int, latent_shape, conditioning_shapes
    ) -> int | None:
        """The part of :meth:`flops_per_forward` in the self-attention's scores and values
        (QK^T and PV), which a TPU runs inside the splash kernel, where the compiler's cost
        model does not see (:mod:`jaxcore.aot`); None: not known for this family."""
        return None

    @abc.abstractmethod
    def tokens_per_example(self, config, latent_shape) -> int:
        """Sequence positions the denoiser processes per example (for tokens/s)."""

    def timestep_tokens(self, config, latent_shape) -> int:
        """The token count a token-shifted timestep sampler reads (``shifted_logit_normal``):
        :meth:`tokens_per_example`; LTX-2's video tokens alone, as ltx-trainer's."""
        return self.tokens_per_example(config, latent_shape)

    def lora_to_diffusers(self, state_dict: Mapping, denoiser_config, where: str):
        """A LoRA file's tensors -> ``jaxcore.lora.base.Converted`` for this family's denoiser
        (the formats the family's LoRAs come in). The default: the family takes no LoRA."""
        raise FamilyError(f"{where}: LoRAs are not supported for the {self.name} family")

    def lora_weight_map(self, denoiser_config) -> Mapping:
        """The denoiser's weight map (diffusers key -> our parameter) LoRA deltas merge through
        (whether the family takes LoRAs at all is :meth:`lora_to_diffusers`'s to say)."""
        return self.denoiser_model.weight_map(denoiser_config)

    @abc.abstractmethod
    def check_heads(self, config, mesh) -> None:
        """Raise ShardingError when the denoiser's heads do not split over the mesh."""

    # --- conditioning and latents -----------------------------------------------------------
    @abc.abstractmethod
    def conditioning_specs(
        self, denoiser_config, text_length: int, latent_shape, image_tokens: int | None = None
    ) -> tuple[TensorSpec, ...]:
        """The conditioning tensors the denoiser takes per example (record features besides
        ``latents``) for prompts padded to ``text_length`` tokens, latents of
        ``latent_shape`` and, where the denoiser attends to an image, ``image_tokens``."""

    def image_tokens(self, configs: Mapping[str, Any]) -> int | None:
        """Tokens of the pipeline's image encoder per conditioning image (None: none)."""
        del configs
        return None

    @abc.abstractmethod
    def geometry(self, configs: Mapping[str, Any]) -> Geometry:
        """Which sizes the components (from :meth:`component_configs`) encode and render."""

    @abc.abstractmethod
    def latent_shape(self, configs: Mapping[str, Any], height, width, num_frames) -> tuple:
        """Per-example latent shape for a ``num_frames x height x width`` clip."""

    def render_latent_shape(
        self, configs: Mapping[str, Any], height, width, num_frames, settings: Mapping
    ) -> tuple:
        """Per-example latent shape of a render whose prompt has these family ``settings``
        (its micro-conditioning: the family render settings generate resolves). Default:
        :meth:`latent_shape`'s; LTX-2's sound is as long as ``num_frames / frame_rate``."""
        del settings
        return self.latent_shape(configs, height, width, num_frames)

    def latent_inputs(
        self, configs: Mapping[str, Any], shape, settings: Mapping | None = None
    ) -> dict[str, tuple[int, ...]]:
        """The arrays a prompt may give as its initial latents, by prompt-file field, each with
        its per-example shape (``shape``: :meth:`render_latent_shape`'s for the prompt's
        ``settings``). Default: ``latents`` of that shape alone; a family whose latents join
        several arrays names each (LTX-2: the video's ``latents`` and the ``audio_latents``)."""
        del configs, settings
        return {LATENTS_FIELD: tuple(int(n) for n in shape)}

    def initial_latents(
        self,
        configs: Mapping[str, Any],
        shape,
        seed: int,
        given: Mapping[str, np.ndarray],
        settings: Mapping | None = None,
    ) -> np.ndarray:
        """One prompt's initial latents of per-example ``shape`` (float32): the arrays it gives
        (``given``: some of :meth:`latent_inputs`, shapes already checked), the rest drawn from
        its ``seed`` alone (numpy's PCG64, :mod:`jaxcore.sampling`), with its family
        ``settings`` (LTX-2's ``noise_scale`` noises the given arrays). Default: the prompt's
        ``latents``, else :func:`jaxcore.sampling.initial_latents` of ``shape``."""
        from jaxcore.sampling import initial_latents

        del configs, settings
        if LATENTS_FIELD in given:
            return np.asarray(given[LATENTS_FIELD], np.float32)
        return initial_latents(seed, shape)

    def record_features(
        self, directory, height: int, width: int, num_frames: int, max_sequence_length: int
    ) -> tuple[TensorSpec, ...]:
        """What convert writes per example: ``latents`` then the conditioning (configs only)."""
        configs = self.component_configs(directory)
        self.geometry(configs).check(height, width, num_frames, where=str(directory))
        latents = TensorSpec(
            "latents", tuple(self.latent_shape(configs, height, width, num_frames))
        )
        denoiser = configs[self.denoiser_component]
        conditioning = self.conditioning_specs(
            denoiser, max_sequence_length, latents.shape, self.image_tokens(configs)
        )
        return (latents, *conditioning)

    def records_sound(self) -> bool:
        """Whether convert pairs every clip with its sound (``dataset.audio_column``; its
        Encoders then implement ``encode_media_with_sound``). Default: no."""
        return False

    def reference_features(self, directory, height: int, width: int) -> tuple[TensorSpec, ...]:
        """Edit pairs: the reference latents one reference image of ``height x width`` adds to
        a record (its Encoders then implement ``encode_references``)."""
        raise FamilyError(
            f"the {self.name} family's pipelines take no reference images (edit pairs)"
        )

    def check_features(self, denoiser_config, features: Mapping[str, TensorSpec], where: str):
        """Records must carry what the denoiser takes: the conditioning names and widths
        (the text length may differ) and latents with the denoiser's channel count."""
        latents = features.get("latents")
        if latents is None:
            raise FamilyError(f"{where}: records do not fit the {self.name} model: no 'latents'")
        expected = {
            s.name: s
            for s in self.conditioning_specs(
                denoiser_config,
                _rows(features, TEXT_FEATURE) or 1,
                latents.shape,
                _rows(features, IMAGE_TOKENS_FEATURE),
            )
        }
        problems = []
        for name, spec in expected.items():
            got = features.get(name)
            if got is None:
                problems.append(
                    f"no {name!r} feature (the {self.name} denoiser needs {spec.shape})"
                )
            elif tuple(got.shape) != tuple(spec.shape):
                problems.append(
                    f"{name!r} has shape {list(got.shape)}, the denoiser needs {list(spec.shape)}"
                )
        channels = self.latent_channels(denoiser_config)
        if latents.shape[0] != channels:
            problems.append(
                f"'latents' {list(latents.shape)} have {latents.shape[0]} channels, the denoiser "
                f"takes {channels}"
            )
        if problems:
            raise FamilyError(
                f"{where}: records do not fit the {self.name} model: " + "; ".join(problems)
            )

    @abc.abstractmethod
    def latent_channels(self, denoiser_config) -> int:
        """Channels of the latents the denoiser takes (the records' ``latents`` axis 0)."""

    @abc.abstractmethod
    def load_encoders(
        self, directory, compute: ComputeConfig, max_sequence_length: int, batch_size: int
    ) -> Encoders:
        """The VAE encoder and text encoders of a pipeline directory, for convert."""

    def latent_normalization(self, configs: Mapping[str, Any]) -> dict:
        """How the records' latents were normalised (recorded in the convert manifest)."""
        return {}

    # --- inference --------------------------------------------------------------------------
    def load_pipeline(
        self,
        directory,
        compute: ComputeConfig,
        mesh=None,
        rules=None,
        denoiser=None,
        keep_float: str | None = None,
        **options,
    ) -> Pipeline:
        """Every component of a pipeline directory -> :class:`jaxcore.pipeline.Pipeline`.

        ``denoiser``: ``(module, params)`` that replace the directory's (e.g. a trained
        checkpoint); its weights are then not read from the directory. The same skeleton for
        every family: the component configs, the denoiser (read unless given), the family's
        check of the configs, then :meth:`load_components` for everything else; ``options``
        go to that hook (Wan's ``second_denoiser``). ``keep_float``: with
        ``compute.quantization``, where the float weights stay beside the quantized ones
        (``"host"``: for LoRA sets; ``"device"``: for the quality gate's unquantized render;
        None: dropped), see :class:`jaxcore.pipeline.FloatWeights`."""
        directory = Path(directory)
        rules = tuple(rules) if rules is not None else sharding.LOGICAL_AXIS_RULES
        configs = self.component_configs(directory)
        _check_quantizable(compute, self.second_expert_component(configs))
        # quantized as they load, unless the float weights are to be kept beside
        load_compute = compute
        if keep_float is not None:
            load_compute = dataclasses.replace(compute, quantization="none")
        if denoiser is None:
            denoiser = self.load_denoiser(
                directory / self.denoiser_component, load_compute, mesh, rules, quantize=True
            )
        module, params = denoiser
        configs[self.denoiser_component] = module.config
        self.check_configs(configs, str(directory))
        controlnet = options.pop("controlnet", None)
        fields = self.load_components(
            directory, configs, load_compute, mesh, rules, denoiser, **options
        )
        params, fields = _quantized(params, fields, compute, keep_float)
        nets = self.load_controlnets(directory, module.config, compute, mesh, rules, controlnet)
        if nets is not None:
            fields["controlnets"] = nets
        return Pipeline(
            family=self,
            denoiser=module,
            configs=configs,
            scheduler_config=read_scheduler_config(directory),
            mesh=mesh,
            rules=rules,
            source=str(directory),
            **{"denoiser_params": params, **fields},
        )

    def load_controlnets(self, directory: Path, denoiser_config, compute, mesh, rules, given):
        """The pipeline's ControlNets (:class:`jaxcore.control.ControlNets`) or None: ``given``
        (``load_pipeline(..., controlnet=<folder or list of folders>)``) or else the
        pipeline folder's own ``controlnet`` component. Default: this family takes none."""
        del denoiser_config, compute, mesh, rules
        from jaxcore import control

        if control.chosen_folders(directory, given):
            raise FamilyError(f"the {self.name} family takes no ControlNet ({directory})")
        return None

    def control_conditioning(self, pipe, controls, height: int, width: int, positive):
        """(conditional, negative) ControlNet tensors for a batch, one
        :class:`jaxcore.control.ControlInput` per row; ``positive``: the batch's conditional
        conditioning so far (its text). Default: this family takes no ControlNet."""
        del pipe, controls, height, width, positive
        raise FamilyError(f"the {self.name} family takes no ControlNet")

    def controlnet_for_training(self, denoiser, denoiser_params, rng, init, options, **control):
        """``(module, params, boxed abstract params, provenance)`` of a ControlNet to train
        beside the frozen denoiser (``init``: ``"denoiser"`` = made from it, or a folder).
        Default: this family trains no ControlNet."""
        del denoiser, denoiser_params, rng, init, options, control
        raise FamilyError(f"the {self.name} family has no ControlNet training")

    def controlnet_export(self, module, params) -> tuple[dict, dict]:
        """(diffusers state dict, config.json) of a trained ControlNet."""
        del module, params
        raise FamilyError(f"the {self.name} family has no ControlNet training")

    def controlnet_template(self, denoiser, config: Mapping, options: Mapping):
        """``(module, abstract params, boxed abstract params)`` of a trained ControlNet whose
        config (its ``config.to_dict()``, as a train manifest records it) is ``config``: what
        its checkpoints restore onto, no weights made. Default: no ControlNet training."""
        del denoiser, config, options
        raise FamilyError(f"the {self.name} family has no ControlNet training")

    @abc.abstractmethod
    def load_components(
        self, directory: Path, configs, compute: ComputeConfig, mesh, rules, denoiser, **options
    ) -> dict:
        """:meth:`load_pipeline`'s hook: ``{"components": {name: ...}}`` (VAE, text encoders,
        tokenizers, ...) and any other :class:`jaxcore.pipeline.Pipeline` field the family
        sets (a second expert; ``denoiser_params`` when the weights wait on the host).
        ``configs`` hold the denoiser's config; ``denoiser`` is ``(module, params)``."""

    @abc.abstractmethod
    def encode_prompts(self, pipe, prompts: Sequence[str], max_sequence_length: int):
        """Prompts -> ``{conditioning name: [B, ...]}`` float32 on the host."""

    @abc.abstractmethod
    def decode(self, pipe, latents, conditioning: Mapping[str, Any] | None = None):
        """Latents -> video ``[B, F, H, W, 3]`` float32 in [0, 1] (diffusers ``output_type="np"``).
        ``conditioning``: the rows' conditioning tensors (:meth:`Pipeline.conditioning`'s
        first), for a family whose decoding follows per-prompt settings (LTX-Video's decode
        timestep and noise); None: the pipeline's defaults."""

    def decode_audio(self, pipe, latents, conditioning: Mapping[str, Any] | None = None):
        """The sound track a render carries beside its frames (LTX-2 renders video and audio
        together): ``(waveform [B, channels, samples] float32 in [-1, 1], sample rate in Hz)``
        from the same latents and conditioning :meth:`decode` takes, or None (the default):
        the family renders no sound, and generate writes frames only."""
        del pipe, latents, conditioning
        return None

    @abc.abstractmethod
    def sampling_defaults(self, configs: Mapping[str, Any]) -> dict[str, Any]:
        """What the diffusers pipeline renders when not told otherwise: ``height``, ``width``,
        ``num_frames``, ``num_inference_steps``, ``guidance_scale``."""

    @abc.abstractmethod
    def default_scheduler(self, scheduler_config: Mapping) -> str:
        """The jaxcore scheduler name the pipeline's scheduler_config.json stands for."""

    def default_shift(self, scheduler_config: Mapping) -> float:
        """The static shift of the pipeline's scheduler (``flow_shift`` / ``shift``), else 1."""
        value = scheduler_config.get("flow_shift", scheduler_config.get("shift", 1.0))
        return float(value or 1.0)

    @abc.abstractmethod
    def make_schedule(self, pipe, scheduler: str, num_inference_steps: int, shift, latent_shape):
        """(scheduler state, step_fn) for one sampling run (see :mod:`jaxcore.schedulers`)."""

    def make_seeded_schedule(
        self,
        pipe,
        scheduler: str,
        num_inference_steps: int,
        shift,
        latent_shape,
        seeds: Sequence[int] | None = None,
    ):
        """:meth:`make_schedule` for a batch whose rows have these ``seeds`` (one per row, or
        None): what :meth:`jaxcore.pipeline.Pipeline.sample` calls. Samplers that draw noise
        every step (Euler ancestral, ...) take it from the seeds. The default ignores them (the
        family's samplers are deterministic)."""
        del seeds
        return self.make_schedule(pipe, scheduler, num_inference_steps, shift, latent_shape)

    def pipeline_objective(self, pipe) -> str:
        """The training target of a loaded pipeline's denoiser; the default is
        :attr:`objective` (UNet families read the scheduler config's ``prediction_type``)."""
        del pipe
        return self.objective

    @abc.abstractmethod
    def guidance(
        self,
        configs,
        *,
        guidance_scale: float,
        true_cfg_scale: float,
        guidance_scale_2: float | None = None,
    ) -> Guidance:
        """The user's guidance settings -> this family's :class:`Guidance` for a pipeline with
        these component configs; a setting the family does not have is an error naming it."""

    def with_settings_guidance(self, configs, guidance: Guidance, settings: Mapping) -> Guidance:
        """``guidance`` for a prompt whose family settings (its micro-conditioning) are
        ``settings``; the default: unchanged. A family whose settings can switch CFG on (LTX-2:
        an audio guidance scale > 1 with the video's at 1, as diffusers) says so here."""
        del configs, settings
        return guidance

    def with_guidance_rescale(self, configs, guidance: Guidance, guidance_rescale: float):
        """``guidance`` with diffusers' ``guidance_rescale`` (not 0). The default refuses it:
        the family's diffusers pipelines have no such option."""
        del configs, guidance
        raise FamilyError(
            f"guidance_rescale={guidance_rescale}: the {self.name} family's diffusers pipelines "
            "have no guidance_rescale (Stable Diffusion's option); leave it 0"
        )

    # --- size and negative conditioning (defaults: none, as encoded) ----------------------------
    def size_conditioning(
        self,
        configs: Mapping[str, Any],
        height: int | None,
        width: int | None,
        micro: Sequence[Mapping[str, tuple[int, int]]],
        num_frames: int | None = None,
    ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """(conditional, negative) tensors ``{name: [batch, ...]}`` that depend on the render
        size (SDXL's ``time_ids``); ``height``, ``width`` and ``num_frames`` are None when the
        caller did not give the size. ``micro``: per row, the SDXL micro-conditioning values
        the prompt set (:data:`MICRO_CONDITIONING`; empty = the defaults), or a family's render
        settings. Default: none, and values refused."""
        del configs, height, width, num_frames
        given = sorted({name for row in micro for name in row})
        if given:
            raise FamilyError(
                f"{given}: SDXL's size / crop micro-conditioning; the {self.name} family's "
                "pipelines have none"
            )
        return {}, {}

    def negative_conditioning(
        self, pipe, negative_prompts: Sequence[str], uncond: dict[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        """The negative branch's conditioning from its encoded ``negative_prompts`` (SDXL zeroes
        the rows of empty ones). Default: as encoded."""
        del pipe, negative_prompts
        return uncond

    # --- image conditioning and experts (defaults: text-only, one denoiser) ---------------------
    def image_inputs(self, configs: Mapping[str, Any]) -> ImageInputs:
        """The conditioning images a pipeline with these component configs takes."""
        del configs
        return ImageInputs()

    def size_from_image(self, configs: Mapping[str, Any], width: int, height: int):
        """(height, width) of a render sized by its first image, for a family whose
        :class:`ImageInputs` has ``size_from_image``."""
        raise FamilyError(f"the {self.name} family takes no render size from an image")

    def encode_images(
        self,
        pipe,
        images: Sequence,
        height: int,
        width: int,
        num_frames: int,
        settings: Sequence[Mapping] | None = None,
    ) -> dict[str, np.ndarray]:
        """Per row ``(image, last_image)`` (PIL images or None) -> conditioning tensors
        ``{name: [B, ...]}`` that join both the conditional and the negative branch;
        ``settings``: per row the prompt's family settings (LTX-2's ``image_crf``), None when
        the caller has none."""
        del pipe, height, width, num_frames, settings
        if any(image is not None or last is not None for image, last in images):
            raise FamilyError(f"the {self.name} family takes no conditioning image")
        return {}

    def start_latents(self, latents, conditioning: Mapping[str, Any]):
        """The initial latents (``[B, ...]``, the prompts' noise) -> what the sampling loop
        starts from, which may have another shape (:meth:`finish_latents` maps it back).
        Default: as is. LTXConditionPipeline blends conditions in and adds frames."""
        del conditioning
        return latents

    def finish_latents(self, latents, conditioning: Mapping[str, Any]):
        """The sampling loop's result -> the latents to decode (jittable). Default: as is."""
        del conditioning
        return latents

    def loop_conditioning(self, module, params, conditioning: Mapping[str, Any]):
        """The conditioning every :meth:`apply` of one render takes, made from the render's
        conditioning once, inside the jitted sampling loop before its first step (jittable;
        ``module`` and ``params``: the denoiser as :meth:`apply` gets it). What depends on the
        weights and the conditioning but not on the step or the latents is computed here once
        instead of at every step (Flux.2 [klein] KV: the reference images' per-layer keys and
        values). Each CFG branch that runs is prepared on its own; a two-expert loop prepares
        with the first denoiser. Default: as is."""
        del module, params
        return conditioning

    def loss_mask(self, latents_shape, conditioning: Mapping[str, Any]):
        """Training: where the loss counts, an array broadcastable to ``latents_shape`` (0 on
        elements the conditioning fixes, e.g. a clean first frame), the per-sample loss then
        the mean over those elements; None (the default): everywhere. Jittable."""
        del latents_shape, conditioning
        return None

    def loss_weights(self, latents_shape, conditioning: Mapping[str, Any]):
        """Training: per-element weights broadcastable to ``latents_shape`` whose weighted sum
        of squared errors *is* the per-sample loss (no mean taken after; LTX-2: each modality's
        mean, summed, as ltx-trainer sums them), or None (the default): :meth:`loss_mask`'s
        mean. Jittable."""
        del latents_shape, conditioning
        return None


# --- helpers ----------------------------------------------------------------------------------


def _from_dict(cls, data: Mapping, where) -> Any:
    try:
        return cls.from_dict(data)
    except (ValueError, TypeError, KeyError) as err:
        raise FamilyError(f"{where}: {err}") from None


def decoded_frames(pixels: jax.Array) -> jax.Array:
    """A VAE's decoded pixels in [-1, 1], ``[B, 3, F, H, W]`` (video) or ``[B, 3, H, W]``
    (image), -> what :meth:`Family.decode` returns: frames ``[B, F, H, W, 3]`` float32 in
    [0, 1] (diffusers' postprocessing, ``x / 2 + 0.5`` clamped)."""
    if pixels.ndim == 4:
        pixels = pixels[:, :, None]
    frames = jnp.clip(pixels.astype(jnp.float32) / 2 + 0.5, 0.0, 1.0)
    return jnp.moveaxis(frames, 1, -1)


# the variable-length sequences of records (their lengths are the records', not the model's)
TEXT_FEATURE = "encoder_hidden_states"
IMAGE_TOKENS_FEATURE = "image_embeds"


def _rows(features: Mapping[str, TensorSpec], name: str) -> int | None:
    """The leading size of a record feature (a sequence length), None when absent."""
    spec = features.get(name)
    return int(spec.shape[0]) if spec is not None and spec.shape else None


def read_json(path: str | os.PathLike, what: str = "file") -> dict:
    """A JSON file as a dict; a missing or broken file is a FamilyError naming it."""
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise FamilyError(f"{path} does not exist (expected {what})") from None
    except json.JSONDecodeError as err:
        raise FamilyError(f"{path}: invalid JSON: {err}") from None


def read_model_index(directory: str | os.PathLike) -> dict:
    return read_json(Path(directory) / "model_index.json", "a diffusers pipeline directory")


def read_scheduler_config(directory: str | os.PathLike) -> dict:
    path = Path(directory) / "scheduler" / "scheduler_config.json"
    return read_json(path, "the pipeline's scheduler config")


def _check_quantizable(compute: ComputeConfig, second_expert: str | None) -> None:
    """Refuse, before anything more loads, a quantization this pipeline cannot take."""
    if compute.quantization != "none" and compute.idle_expert == "host" and second_expert:
        raise FamilyError(
            f"compute.quantization={compute.quantization} with compute.idle_expert=host is not "
            "supported: quantized experts are small enough to stay on the devices "
            "(idle_expert=device)"
        )


def _quantized(
    params, fields: dict, compute: ComputeConfig, keep_float: str | None
) -> tuple[Any, dict]:
    """The denoiser's params and a second expert's quantized as ``compute.quantization`` says
    (:mod:`jaxcore.quantization`), once, where they were loaded; ``fields`` gain the mode and,
    when ``keep_float`` names a placement, the float weights (:class:`FloatWeights`)."""
    from jaxcore.pipeline import FloatWeights

    if compute.quantization == "none":
        return params, fields

    def quantize(tree):  # what was loaded quantized already stays as it is
        if quantization.is_quantized(tree):
            return tree
        return quantization.quantizer(compute.quantization)(tree)

    second = fields.get("second_expert")
    floats = (params, second.params if second is not None else None)
    if second is not None:
        second.params = quantize(second.params)
    fields = {**fields, "quantization": compute.quantization}
    if keep_float is not None:
        fields["float_weights"] = FloatWeights.keep(*floats, keep_float)
    return quantize(params), fields
