"""A loaded diffusion pipeline of any family: its components and the three inference phases.

:class:`Pipeline` holds what :meth:`Family.load_pipeline` loaded (the denoiser, the family's
other components, the component configs, the scheduler config) and runs

1. :meth:`Pipeline.conditioning`: prompts (and negative prompts, where CFG is on) -> the
   family's conditioning tensors, with each prompt's embedded guidance inputs and, for
   image-to-video models, its conditioning images;
2. :meth:`Pipeline.sample`: the shared jitted denoising loop (:mod:`jaxcore.sampling`), with the
   second expert of a two-expert model (:class:`SecondExpert`) where there is one;
3. :meth:`Pipeline.decode`: latents -> frames ``[B, F, H, W, 3]`` in [0, 1] (and, for a family
   that renders sound, :meth:`Pipeline.decode_audio`: latents -> waveforms).

Everything model-specific is a call into ``self.family``; nothing here knows a model.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxcore import control, quantization, sampling, schedulers, sharding, step_cache, storage
from jaxcore.family_types import FamilyError, Geometry, Guidance, ImageInputs

# What a Hugging Face snapshot of a pipeline needs (no pickles, no code).
HUB_ALLOW_PATTERNS = [
    "model_index.json",
    "*/config.json",
    "*/*.safetensors",
    "*/*.safetensors.index.json",
    "scheduler/scheduler_config.json",
    "tokenizer*/*.json",
    "tokenizer*/*.model",
    "tokenizer*/*.txt",
]


@dataclasses.dataclass
class SecondExpert:
    """The low-noise expert of a two-expert pipeline (Wan 2.2 A14B's ``transformer_2``).

    It predicts while the scheduler timestep is below ``boundary`` (diffusers:
    ``boundary_ratio * num_train_timesteps``); the first denoiser predicts at and above it.
    ``placement``: ``"device"`` keeps both experts' weights on the devices (the switch is a
    branch inside the one jitted loop); ``"host"`` keeps whichever expert is idle in host
    memory and swaps the weights at the boundary (half the device memory for weights, two
    host-to-device copies and one host sync per render).
    """

    denoiser: Any
    params: Any
    boundary: float
    placement: str = "device"


def _for_expert(loaded, expert: str) -> list:
    """``(LoRA file, scale)`` of the loaded ``(file, scale, expert)`` uses for one expert."""
    return [(file, scale) for file, scale, target in loaded if target == expert]


def to_host(params):
    """(host copy, shardings) of a placed parameter tree (the device copy is released)."""
    shardings = jax.tree.map(lambda a: a.sharding, params)
    host = jax.device_get(params)
    jax.tree.map(lambda a: a.delete(), params)
    return host, shardings


@dataclasses.dataclass
class FloatWeights:
    """The float weights quantized denoisers were made from (``compute.quantization``), kept
    so a LoRA set merges into them before re-quantizing, and so the quality gate
    (``cache.compare_dense``) renders the unquantized model beside the quantized one.

    ``placement``: ``"host"`` (host memory; each use puts them back on the devices for the
    duration: what LoRA sets need) or ``"device"`` (they stay beside the quantized ones: what
    the comparison needs every batch). ``active``: the float weights with the LoRA set merged
    now (``{expert: params}``; empty: the base), for the comparison."""

    high: Any
    low: Any = None
    placement: str = "device"
    shardings: tuple = (None, None)
    active: dict = dataclasses.field(default_factory=dict, repr=False)

    @classmethod
    def keep(cls, high, low, placement: str) -> FloatWeights:
        """Keep these (placed) float trees where ``placement`` says. Host: copied off the
        devices, where the float kernels go once the caller drops its trees (not deleted
        here: the leaves quantizing left alone, biases and norms, are shared with the
        quantized tree)."""
        if placement not in ("host", "device"):
            raise ValueError(f"keep_float must be 'host' or 'device', got {placement!r}")
        if placement == "device":
            return cls(high, low, placement)

        def where(tree):
            return None if tree is None else jax.tree.map(lambda a: a.sharding, tree)

        return cls(*jax.device_get((high, low)), placement, (where(high), where(low)))

    def base(self, expert: str):
        """One expert's float weights where they are kept (shapes for LoRA plans)."""
        return self.high if expert == "high" else self.low

    def on_device(self, expert: str):
        """One expert's float weights on the devices (put there when kept on the host)."""
        tree = self.base(expert)
        if self.placement == "host":
            tree = jax.device_put(tree, self.shardings[0 if expert == "high" else 1])
        return tree

    def current(self, expert: str):
        """One expert's float weights with the LoRA set merged now, on the devices."""
        return self.active.get(expert) or self.on_device(expert)


# Texts per text-encoder call at most. Encoders at small batch are bound by reading their
# weights (the S bench's 88M-parameter UMT5: 59 ms for 2 texts, 61 ms for 4), so encoding many
# prompts in one call costs little more than one.
ENCODE_BATCH = 16


class PromptEncodings:
    """The most recent ``capacity`` prompt encodings, ``(text, max_sequence_length)`` ->
    ``{conditioning name: row}``. A row does not depend on the texts encoded beside it (each
    family's text encoders see one text per row; Wan pads the batch to its longest text, which
    changes nothing but the float rounding order), nor on LoRAs (they merge into denoisers).
    """

    def __init__(self, capacity: int = 2 * ENCODE_BATCH):
        self.capacity = capacity
        self._rows: collections.OrderedDict = collections.OrderedDict()

    def __contains__(self, key) -> bool:
        return key in self._rows

    def get(self, key) -> dict | None:
        row = self._rows.get(key)
        if row is not None:
            self._rows.move_to_end(key)
        return row

    def put(self, key, row: dict) -> None:
        self._rows[key] = row
        self._rows.move_to_end(key)
        while len(self._rows) > self.capacity:
            self._rows.popitem(last=False)


def _row_bucket(count: int) -> int:
    """Rows an encoder call runs on: the next power of two, so a run compiles few shapes."""
    return 1 << max(0, count - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class _LoopInputs:
    """What :meth:`Pipeline.sample_with_stats` hands the denoising loop, placed like the batch
    (the step cache's inputs travel beside it: the two-expert paths take none)."""

    latents: jax.Array  # [B, ...] float32, already times init_noise_sigma
    cond: dict[str, jax.Array]
    uncond: dict[str, jax.Array]  # cond itself when none was given (no row uses CFG)
    cfg_on: jax.Array  # [B] bool: CFG applies to the row
    scales: jax.Array  # [B] the first expert's CFG scale
    scales_2: jax.Array  # [B] the second expert's
    state: Any  # the scheduler state
    step_fn: schedulers.StepFn
    use_cfg: bool  # any row uses CFG: the program computes the negative branch
    batched_cfg: bool  # both CFG branches in one call of 2B rows
    rescale: jax.Array | None  # [B] guidance_rescale, None: none compiled

    def program(
        self, family, denoiser, second_denoiser=None, cache=step_cache.NO_CACHE, quantized=False
    ):
        """The jitted loop (:func:`jaxcore.sampling.denoise_fn`) of ``denoiser`` (and a second
        expert's) with this render's sampler and CFG settings; ``quantized``: its products run
        quantized (``compute.quantization=int8`` / ``fp8``)."""
        return sampling.denoise_fn(
            family,
            denoiser,
            self.step_fn,
            self.use_cfg,
            second_denoiser,
            cache,
            self.batched_cfg,
            quantized,
        )


@dataclasses.dataclass
class Pipeline:
    """Loaded components of one pipeline directory (see the module docstring)."""

    family: Any  # jaxcore.families.base.Family
    denoiser: Any  # the denoiser module
    denoiser_params: Any
    components: dict[str, Any]  # family-specific: modules, params, tokenizers
    configs: dict[str, Any]  # component name -> validated config
    scheduler_config: dict
    mesh: jax.sharding.Mesh | None = None
    rules: tuple = sharding.LOGICAL_AXIS_RULES
    source: str = ""
    # LoRA state (apply_loras): the weights without LoRAs, the files read, the set merged now
    base_denoiser_params: Any = dataclasses.field(default=None, repr=False)
    lora_files: dict = dataclasses.field(default_factory=dict, repr=False)
    active_loras: tuple = ()
    base_second_params: Any = dataclasses.field(default=None, repr=False)
    second_expert: SecondExpert | None = None
    # placement="host": (host copy, shardings) of each expert's weights
    _host_experts: tuple | None = dataclasses.field(default=None, repr=False)
    # compute.quantization: the mode, and the float weights kept beside (load_pipeline's
    # keep_float; None: not kept, so no LoRAs and no comparison)
    quantization: str = "none"
    float_weights: FloatWeights | None = dataclasses.field(default=None, repr=False)
    # recent prompt encodings (encode_prompts, prefetch_prompts)
    encodings: PromptEncodings = dataclasses.field(default_factory=PromptEncodings, repr=False)
    # ControlNets called before every denoiser call (jaxcore.control); None: none
    controlnets: control.ControlNets | None = dataclasses.field(default=None, repr=False)

    # shapes and defaults ----------------------------------------------------------------------
    @property
    def geometry(self) -> Geometry:
        return self.family.geometry(self.configs)

    def latent_shape(
        self, height: int, width: int, num_frames: int, settings: Mapping | None = None
    ) -> tuple[int, ...]:
        """Per-sample latent shape for a render of ``num_frames`` x ``height`` x ``width``
        (with a prompt's family ``settings``: LTX-2's ``frame_rate`` sets its sound's length)."""
        shape = self.family.render_latent_shape(
            self.configs, height, width, num_frames, dict(settings or {})
        )
        return tuple(shape)

    @property
    def default_shift(self) -> float:
        return self.family.default_shift(self.scheduler_config)

    @property
    def default_scheduler(self) -> str:
        return self.family.default_scheduler(self.scheduler_config)

    @property
    def image_inputs(self) -> ImageInputs:
        """The conditioning images this pipeline takes (none for text-to-video models)."""
        return self.family.image_inputs(self.configs)

    @property
    def batch_ways(self) -> int:
        """How many ways a batch is split over the mesh (batches must be a multiple)."""
        return 1 if self.mesh is None else sharding.batch_axis_size(self.mesh, self.rules)

    def apply_loras(self, loras: Sequence[tuple], *, strict: bool = True) -> list:
        """Make each expert ``base + sum(scale x LoRA)`` for these ``(path, scale[, expert])``
        uses (``expert``: ``"high"``, the default, is the denoiser, diffusers' ``transformer``;
        ``"low"`` is a two-expert pipeline's ``transformer_2``, as diffusers'
        ``load_lora_weights(..., load_into_transformer_2=True)``).

        Merged from the base weights each time the set changes (files are read once, nothing
        recompiles: shapes, dtypes and shardings stay); an empty set restores the base
        weights exactly. Returns ``[{path, scale, sha256}]`` for records and manifests.
        """
        wanted = self._lora_uses(loras)
        if wanted and self.second_expert is not None and self.second_expert.placement == "host":
            raise FamilyError(
                "LoRAs are not supported with compute.idle_expert=host (the weights they merge "
                "into live on the host); use idle_expert=device"
            )
        if wanted != self.active_loras:
            loaded = self._loaded(wanted)
            self.denoiser_params = self._merged(self.base_denoiser_params, loaded, "high", strict)
            if self.second_expert is not None:
                self.second_expert.params = self._merged(
                    self.base_second_params, loaded, "low", strict
                )
            self.active_loras = wanted
        return [
            {"path": p, "scale": s, "sha256": self.lora_files[p].checksum} for p, s, _ in wanted
        ]

    def check_loras(self, lora_sets, *, strict: bool = True) -> None:
        """Read every LoRA of these sets and check it fits the expert it goes to, merging
        nothing (so a bad file fails before anything renders)."""
        for loras in lora_sets:
            wanted = self._lora_uses(loras)
            if wanted:
                loaded = self._loaded(wanted)  # first: it keeps the base weights
                for expert, base in (
                    ("high", self.base_denoiser_params),
                    ("low", self.base_second_params),
                ):
                    files = _for_expert(loaded, expert)
                    if files:
                        if self.float_weights is not None:  # quantized: plan on float shapes
                            base = self.float_weights.base(expert)
                        self._lora_merger(base).plan(files, strict=strict)

    def _lora_uses(self, loras) -> tuple[tuple[str, float, str], ...]:
        """``(path, scale)`` / ``(path, scale, expert)`` -> checked ``(path, scale, expert)``."""
        if loras and self.quantization != "none" and self.float_weights is None:
            raise FamilyError(
                f"LoRA {loras[0][0]}: LoRAs merge into the float weights, and this pipeline "
                f"(compute.quantization={self.quantization}) was loaded without them: load it "
                "with keep_float='host' (generate does so when a prompt names a LoRA)"
            )
        uses = []
        for path, scale, *rest in loras:
            expert = rest[0] if rest else "high"
            if expert not in ("high", "low"):
                raise FamilyError(f"LoRA {path}: expert must be 'high' or 'low', got {expert!r}")
            if expert == "low" and self.second_expert is None:
                raise FamilyError(
                    f"LoRA {path}: expert=low needs a two-expert pipeline; "
                    f"{self.source or 'this pipeline'} has one denoiser"
                )
            uses.append((str(path), float(scale), expert))
        return tuple(uses)

    def _merged(self, base, loaded, expert: str, strict: bool):
        """``base`` with one expert's LoRAs merged. Quantized: merged into the float weights,
        then quantized again by the program that quantized them on load (same shapes, so the
        denoising programs do not recompile); no LoRA: the quantized base as loaded."""
        files = _for_expert(loaded, expert)
        if self.float_weights is not None:
            self.float_weights.active.pop(expert, None)
            if not files:
                return base
            merged = self._lora_merger(self.float_weights.on_device(expert)).merged(
                files, strict=strict
            )
            if self.float_weights.placement == "device":
                self.float_weights.active[expert] = merged
            return quantization.quantizer(self.quantization)(merged)
        return self._lora_merger(base).merged(files, strict=strict) if files else base

    @contextlib.contextmanager
    def float_reference(self):
        """The denoisers with their float weights (the LoRA set merged now) for the duration:
        the unquantized render the quality gate compares a quantized one with."""
        if self.float_weights is None:
            raise FamilyError(
                f"compute.quantization={self.quantization}: the float weights were not kept "
                "(load_pipeline(..., keep_float='device')), so there is nothing to compare with"
            )
        quantized = self.denoiser_params, self.second_expert and self.second_expert.params
        self.denoiser_params = self.float_weights.current("high")
        if self.second_expert is not None:
            self.second_expert.params = self.float_weights.current("low")
        try:
            yield self
        finally:
            self.denoiser_params = quantized[0]
            if self.second_expert is not None:
                self.second_expert.params = quantized[1]

    def _loaded(self, wanted):
        from jaxcore.lora.merge import load_lora

        if self.base_denoiser_params is None:
            self.base_denoiser_params = self.denoiser_params
        if self.second_expert is not None and self.base_second_params is None:
            self.base_second_params = self.second_expert.params
        for path, _, _ in wanted:
            if path not in self.lora_files:
                self.lora_files[path] = load_lora(path, self.family, self.denoiser.config)
        return [(self.lora_files[p], s, e) for p, s, e in wanted]

    def _lora_merger(self, base):
        from jaxcore.lora.merge import LoraMerger

        # both experts of a two-expert model share one architecture (checked on load)
        weight_map = self.family.lora_weight_map(self.denoiser.config)
        return LoraMerger(base, weight_map)

    # placement --------------------------------------------------------------------------------
    def context(self):
        """Mesh + logical rules active while tracing, so activation constraints apply."""
        stack = contextlib.ExitStack()
        if self.mesh is not None:
            stack.enter_context(sharding.mesh_context(self.mesh, self.rules))
        return stack

    def shard_batch(self, x) -> jax.Array:
        """Place a host batch (this process's rows) with its leading axis over the batch axes."""
        if isinstance(x, jax.Array):
            return x
        if self.mesh is None:
            return jnp.asarray(x)
        logical = ("activation_batch",) + (None,) * (np.ndim(x) - 1)
        target = sharding.logical_sharding(self.mesh, logical, self.rules)
        return jax.make_array_from_process_local_data(target, np.asarray(x))

    # phases -----------------------------------------------------------------------------------
    def guidance(
        self,
        guidance_scale: float,
        true_cfg_scale: float = 1.0,
        guidance_scale_2: float | None = None,
        guidance_rescale: float = 0.0,
        settings: Mapping | None = None,
    ) -> Guidance:
        """The family's :class:`Guidance` for these settings; ``guidance_rescale`` (diffusers'
        SD / SDXL option, 0 = off) is refused by families whose pipelines lack it; ``settings``:
        the prompt's family settings (micro-conditioning), which may switch CFG on."""
        guidance = self.family.guidance(
            self.configs,
            guidance_scale=guidance_scale,
            true_cfg_scale=true_cfg_scale,
            guidance_scale_2=guidance_scale_2,
        )
        if guidance_rescale:
            guidance = self.family.with_guidance_rescale(self.configs, guidance, guidance_rescale)
        if settings:
            guidance = self.family.with_settings_guidance(self.configs, guidance, settings)
        return guidance

    def encode_prompts(self, prompts: Sequence[str], max_sequence_length: int) -> dict:
        """``{conditioning name: [B, ...]}`` float32 on the host. Texts encoded recently
        (:attr:`encodings`, :meth:`prefetch_prompts`) are not encoded again."""
        texts = list(prompts)
        if not texts:
            return self.family.encode_prompts(self, texts, max_sequence_length)
        rows = self._encode_texts(texts, max_sequence_length)
        return {name: np.stack([rows[t][name] for t in texts]) for name in rows[texts[0]]}

    def prefetch_prompts(
        self, prompts: Sequence[str], max_sequence_length: int, *, fresh: bool = False
    ) -> None:
        """Encode the texts not encoded recently (``fresh``: all of them, in one set of calls
        whatever was encoded before), :data:`ENCODE_BATCH` per encoder call, so the
        :meth:`encode_prompts` calls that follow find them (a bulk render encodes the prompts
        of its next batches together: one read of the encoders' weights for many prompts).

        A row's float rounding depends on the texts encoded beside it, so ``fresh`` makes a
        row depend only on the given texts: a resumed render encodes as an uninterrupted one."""
        self._encode_texts(list(prompts), max_sequence_length, fresh=fresh)

    def missing_encodings(self, prompts: Sequence[str], max_sequence_length: int) -> list[str]:
        """The distinct texts among ``prompts`` without a recent encoding, in order."""
        return [t for t in dict.fromkeys(prompts) if (t, max_sequence_length) not in self.encodings]

    def _encode_texts(
        self, texts: list[str], max_sequence_length: int, fresh: bool = False
    ) -> dict[str, dict]:
        """text -> its encoded row for every distinct text, encoding the missing ones (all of
        them when ``fresh``)."""
        rows, missing = {}, []
        for text in dict.fromkeys(texts):
            row = None if fresh else self.encodings.get((text, max_sequence_length))
            if row is None:
                missing.append(text)
            else:
                rows[text] = row
        for start in range(0, len(missing), ENCODE_BATCH):
            chunk = missing[start : start + ENCODE_BATCH]
            padded = chunk + [chunk[-1]] * (_row_bucket(len(chunk)) - len(chunk))
            encoded = self.family.encode_prompts(self, padded, max_sequence_length)
            for i, text in enumerate(chunk):
                # copies: a row must not keep its whole batch alive in the memo
                rows[text] = {name: np.array(v[i]) for name, v in encoded.items()}
                self.encodings.put((text, max_sequence_length), rows[text])
        return rows

    def conditioning(
        self,
        prompts: Sequence[str],
        negative_prompts: Sequence[str],
        guidances: Sequence[Guidance],
        max_sequence_length: int,
        images: Sequence | None = None,
        size: tuple[int, int, int] | None = None,
        micro_conditioning: Sequence[Mapping[str, tuple[int, int]]] | None = None,
        controls: Sequence[control.ControlInput] | None = None,
    ) -> tuple[dict, dict | None, np.ndarray]:
        """(cond, uncond or None, cfg scales) for one batch of prompts.

        The scales are ``[B]``, or ``[B, 2]`` (first expert, second expert) for a two-expert
        pipeline. The negative prompts are encoded only when some prompt uses CFG; each
        prompt's embedded guidance inputs (``Guidance.embedded``) join both conditionings as
        ``[B]`` arrays. ``images``: per prompt ``(image, last_image)`` (PIL images or None) for
        image-to-video models, with ``size`` = (height, width, num_frames) of the render; their
        tensors join both conditionings (diffusers gives the negative branch the same image).
        The family's size conditioning (:meth:`Family.size_conditioning`, SDXL's ``time_ids``)
        joins both too, with ``micro_conditioning`` per prompt (SDXL's ``original_size``,
        ``crops_coords_top_left``, ``target_size`` and their ``negative_*`` twins; None = the
        defaults); the negative branch goes through :meth:`Family.negative_conditioning`
        (SDXL zeroes empty negative prompts). ``controls``: per prompt its
        :class:`jaxcore.control.ControlInput`, required iff the pipeline has ControlNets.
        """
        prompts = list(prompts)
        if len(guidances) != len(prompts) or len(negative_prompts) != len(prompts):
            raise ValueError("prompts, negative_prompts and guidances must have the same length")
        use_cfg = any(g.uses_cfg for g in guidances)
        texts = prompts + (list(negative_prompts) if use_cfg else [])
        encoded = self.encode_prompts(texts, max_sequence_length)
        cond = {k: v[: len(prompts)] for k, v in encoded.items()}
        uncond = None
        if use_cfg:
            uncond = {k: v[len(prompts) :] for k, v in encoded.items()}
            uncond = self.family.negative_conditioning(self, list(negative_prompts), uncond)
        for name in sorted({n for g in guidances for n in g.embedded}):
            values = np.asarray([g.embedded[name] for g in guidances], np.float32)
            cond[name] = values
            if uncond is not None:
                uncond[name] = values
        images = list(images) if images is not None else [(None, None)] * len(prompts)
        if len(images) != len(prompts):
            raise ValueError("images must have one (image, last_image) pair per prompt")
        height, width = size[:2] if size is not None else (None, None)
        micro = list(micro_conditioning) if micro_conditioning is not None else [{}] * len(prompts)
        if len(micro) != len(prompts):
            raise ValueError("micro_conditioning must have one mapping per prompt")
        encoded_images = self.family.encode_images(self, images, *(size or (0, 0, 0)), micro)
        frames = size[2] if size is not None else None
        sized, sized_negative = self.family.size_conditioning(
            self.configs, height, width, micro, frames
        )
        cond.update(encoded_images, **sized)
        if uncond is not None:
            uncond.update(encoded_images, **sized_negative)
        self._control_conditioning(controls, len(prompts), size, cond, uncond)
        scales = np.asarray([g.cfg_scale for g in guidances], np.float32)
        if self.second_expert is not None:
            second = [g.cfg_scale if g.cfg_scale_2 is None else g.cfg_scale_2 for g in guidances]
            scales = np.stack([scales, np.asarray(second, np.float32)], axis=1)
        return cond, uncond, scales

    def _control_conditioning(self, controls, rows: int, size, cond: dict, uncond) -> None:
        """The ControlNets' inputs join both branches (the family's ``control_conditioning``)."""
        if self.controlnets is None:
            if controls is not None and any(c is not None for c in controls):
                raise FamilyError(
                    f"{self.source or 'this pipeline'} has no ControlNet, but control inputs "
                    "were given (load one with controlnet=...)"
                )
            return
        if controls is None or len(controls) != rows or any(c is None for c in controls):
            raise FamilyError(
                f"{self.source or 'this pipeline'} has {len(self.controlnets)} ControlNet(s): "
                "every prompt needs its control image(s)"
            )
        if size is None:
            raise ValueError("control images need the render size (size=(height, width, frames))")
        got, got_negative = self.family.control_conditioning(self, controls, *size[:2], cond)
        cond.update(got)
        if uncond is not None:
            uncond.update(got_negative)

    def sample(
        self,
        latents,
        cond: Mapping[str, Any],
        uncond: Mapping[str, Any] | None = None,
        *,
        num_inference_steps: int,
        cfg_scale: float | Sequence[float] = 1.0,
        shift: float | None = None,
        scheduler: str | None = None,
        batched_cfg: bool = True,
        guidance_rescale: float | Sequence[float] = 0.0,
        seeds: Sequence[int] | None = None,
        timesteps: Sequence[float] | None = None,
    ) -> jax.Array:
        """Run the whole denoising loop (one jitted call); returns the final latents.

        ``latents``: standard-normal initial noise; it is multiplied by the scheduler's
        ``init_noise_sigma`` here (as diffusers' ``prepare_latents`` does).
        ``cfg_scale`` may be one value or one per sample, or ``[B, 2]`` (first, second expert)
        for a two-expert pipeline (one column: both experts use it). CFG runs when any first
        scale is > 1 (then ``uncond`` is required) and applies only to samples whose first
        scale is > 1. ``shift`` and ``scheduler`` default to the pipeline's scheduler config.
        ``batched_cfg``: both CFG branches in one denoiser call of 2B rows (else two calls).
        ``guidance_rescale``: one value or one per sample (``Guidance.guidance_rescale``);
        applied after CFG where > 0. ``seeds``: one per row (this process's rows), the per-step
        noise of stochastic schedulers (Euler ancestral, ...); required by those only.
        ``timesteps``: a custom timestep list (diffusers' ``timesteps=``; ``num_inference_steps``
        its length), for a family that takes one (LTX-Video's ``LTXConditionPipeline``).
        """
        x, _ = self.sample_with_stats(
            latents,
            cond,
            uncond,
            num_inference_steps=num_inference_steps,
            cfg_scale=cfg_scale,
            shift=shift,
            scheduler=scheduler,
            batched_cfg=batched_cfg,
            guidance_rescale=guidance_rescale,
            seeds=seeds,
            timesteps=timesteps,
        )
        return x

    def sample_with_stats(
        self,
        latents,
        cond: Mapping[str, Any],
        uncond: Mapping[str, Any] | None = None,
        *,
        num_inference_steps: int,
        cfg_scale: float | Sequence[float] = 1.0,
        shift: float | None = None,
        scheduler: str | None = None,
        batched_cfg: bool = True,
        cache: step_cache.CachePlan = step_cache.NO_CACHE,
        cache_schedule=None,
        guidance_rescale: float | Sequence[float] = 0.0,
        seeds: Sequence[int] | None = None,
        timesteps: Sequence[float] | None = None,
    ) -> tuple[jax.Array, dict]:
        """:meth:`sample` with step caching (:mod:`jaxcore.step_cache`): ``cache`` the method,
        ``cache_schedule`` MagCache's ``[num_inference_steps]`` bool compute mask. Returns
        ``(latents, stats)``: per sample ``block_stack_runs`` and ``block_stack_skips`` ``[B]``
        (both CFG branches counted) and, when calibrating, ``ratios`` ``[B, steps]`` of the
        conditional branch (the negative one's as ``negative_ratios`` with CFG); arrays
        sharded like the batch; empty without a cache."""
        # this process's rows (all rows on one host); the scales are per local row too
        rows = latents.shape[0]
        latents = self.shard_batch(self.family.start_latents(latents, cond))
        scales, scales_2 = _per_row_scales(cfg_scale, rows)
        # one compiled program for every host: generate groups a batch by CFG on/off, so the
        # hosts of a multi-host job agree on this
        use_cfg = bool((scales > 1.0).any())
        if use_cfg and uncond is None:
            raise ValueError("a cfg_scale > 1 needs the negative conditioning (uncond)")
        if seeds is not None and len(seeds) != rows:
            raise ValueError(f"{len(seeds)} seeds for a batch of {rows} rows")
        # custom timesteps reach only a family whose make_seeded_schedule takes them (LTX)
        custom = {} if timesteps is None else {"timesteps": tuple(float(t) for t in timesteps)}
        state, step_fn = self.family.make_seeded_schedule(
            self,
            scheduler or self.default_scheduler,
            num_inference_steps,
            self.default_shift if shift is None else float(shift),
            latents.shape,
            seeds=None if seeds is None else [int(s) for s in seeds],
            **custom,
        )
        cond, uncond = self._placed_conditioning(cond, uncond, int(state.timesteps.shape[0]))
        latents = latents.astype(jnp.float32)
        sigma = schedulers.init_noise_sigma(state)
        if not isinstance(sigma, float) or sigma != 1.0:  # the flow samplers leave it as is
            latents = latents * jnp.asarray(sigma, jnp.float32)
        rescales = np.broadcast_to(np.asarray(guidance_rescale, np.float32), (rows,))
        # None compiles no rescaling at all (the program of every family without it)
        rescale = self.shard_batch(np.array(rescales)) if use_cfg and (rescales > 0).any() else None
        # CFG on or off per sample follows the first scale for both experts (diffusers'
        # do_classifier_free_guidance reads guidance_scale only)
        cfg_on = self.shard_batch(np.asarray(scales > 1.0))
        scales, scales_2 = self.shard_batch(np.array(scales)), self.shard_batch(np.array(scales_2))
        self._check_cache(cache)
        cache_in = _cache_input(cache, cache_schedule, int(state.timesteps.shape[0]))
        loop = _LoopInputs(
            latents=latents,
            cond=cond,
            uncond=uncond,
            cfg_on=cfg_on,
            scales=scales,
            scales_2=scales_2,
            state=state,
            step_fn=step_fn,
            use_cfg=use_cfg,
            batched_cfg=batched_cfg,
            rescale=rescale,
        )
        with self.context():
            x, cache_out = self._denoise(loop, cache, cache_in)
            x = self.family.finish_latents(x, cond)
        return x, _cache_stats(cache_out, use_cfg, batched_cfg)

    def _placed_conditioning(self, cond, uncond, steps: int) -> tuple[dict, dict]:
        """Both branches placed like the batch (``uncond``: ``cond`` itself when None), the
        ControlNets' guidance window turned into a per-step scale table
        (:func:`jaxcore.control.per_step`)."""
        placed = {k: self.shard_batch(v) for k, v in control.per_step(cond, steps).items()}
        if uncond is None:
            return placed, placed
        negative = {k: self.shard_batch(v) for k, v in control.per_step(uncond, steps).items()}
        return placed, negative

    def _check_cache(self, cache: step_cache.CachePlan) -> None:
        if cache.enabled and self.second_expert is not None:
            raise ValueError("step caching is not supported for two-expert pipelines yet")
        if cache.enabled and self.controlnets is not None:
            raise ValueError("step caching is not supported with ControlNets")

    def _denoise(self, loop: _LoopInputs, cache: step_cache.CachePlan, cache_in: dict | None):
        """The whole loop on one denoiser, on both experts in one program, or (experts that
        take turns on the devices) in two; (latents, the cache's output or None)."""
        expert = self.second_expert
        if expert is not None and expert.placement != "device":
            return self._sample_swapping(loop), None
        second_module = None if expert is None else expert.denoiser
        quantized = quantization.quantizes_products(self.quantization)
        module, params = control.controlled(self.denoiser, self.denoiser_params, self.controlnets)
        fn = loop.program(self.family, module, second_module, cache, quantized)
        second = None
        if expert is not None:
            second = (expert.params, jnp.float32(expert.boundary), loop.scales_2)
        steps = int(loop.state.timesteps.shape[0])
        args = (loop.cond, loop.uncond, loop.cfg_on, loop.scales, loop.state, 0, steps, second)
        x, _, cache_out = fn(params, loop.latents, *args, cache_in, loop.rescale)
        return x, cache_out

    def _sample_swapping(self, loop: _LoopInputs):
        """Two experts, one on the devices at a time: the first for the steps at or above the
        boundary, then (its weights released) the second for the rest."""
        expert, x, state = self.second_expert, loop.latents, loop.state
        split = sampling.first_expert_steps(state.timesteps, expert.boundary)
        steps = int(state.timesteps.shape[0])
        phases = (
            (self.denoiser, 0, 0, split, loop.scales),
            (expert.denoiser, 1, split, steps, loop.scales_2),
        )
        for module, which, start, stop, scale in phases:
            if start == stop:
                continue
            host, shardings = self.host_experts()[which]
            params = jax.device_put(host, shardings)
            fn = loop.program(self.family, module)
            args = (loop.cond, loop.uncond, loop.cfg_on, scale, state, start, stop, None, None)
            x, state, _ = fn(params, x, *args, loop.rescale)
            jax.block_until_ready(x)  # the weights may go only once the steps are done
            del params
        return x

    def host_experts(self) -> tuple:
        """``((host params, shardings) of the first expert, ... of the second)``: the weights
        ``placement="host"`` swaps in, taken off the devices on first use."""
        if self._host_experts is None:
            first = to_host(self.denoiser_params)
            second = to_host(self.second_expert.params)
            self._host_experts = (first, second)
            self.denoiser_params = self.second_expert.params = None
        return self._host_experts

    def decode(self, latents, conditioning: Mapping[str, Any] | None = None) -> jax.Array:
        """Latents -> frames ``[B, F, H, W, 3]`` float32 in [0, 1]; ``conditioning``: the
        rows' conditioning (:meth:`conditioning`'s first), whose per-prompt decode settings
        a family may read (None: the pipeline's defaults)."""
        with self.context():
            return self.family.decode(self, latents, conditioning)

    def decode_audio(
        self, latents, conditioning: Mapping[str, Any] | None = None
    ) -> tuple[jax.Array, int] | None:
        """The render's sound beside :meth:`decode`'s frames: ``(waveform [B, channels,
        samples] float32 in [-1, 1], sample rate in Hz)``, or None for a family without sound
        (:meth:`jaxcore.families.base.Family.decode_audio`)."""
        with self.context():
            return self.family.decode_audio(self, latents, conditioning)

    def __call__(
        self,
        prompts: Sequence[str],
        *,
        negative_prompts: Sequence[str] | None = None,
        seeds: Sequence[int] | None = None,
        height: int,
        width: int,
        num_frames: int = 1,
        num_inference_steps: int,
        guidance_scale: float,
        true_cfg_scale: float = 1.0,
        guidance_scale_2: float | None = None,
        guidance_rescale: float = 0.0,
        images: Sequence | None = None,
        shift: float | None = None,
        scheduler: str | None = None,
        max_sequence_length: int = 512,
        controls: Sequence[control.ControlInput] | None = None,
    ) -> np.ndarray:
        """Convenience: prompts -> float frames ``[B, F, H, W, 3]`` (batch must fit the mesh).

        ``images``: per prompt ``(image, last_image)`` for image-to-video models; ``controls``:
        per prompt its ControlNet inputs (pipelines with ControlNets)."""
        prompts = list(prompts)
        seeds = list(seeds) if seeds is not None else list(range(len(prompts)))
        self.geometry.check(height, width, num_frames)
        shape = self.latent_shape(height, width, num_frames)
        latents = np.stack([sampling.initial_latents(s, shape) for s in seeds])
        guidance = self.guidance(guidance_scale, true_cfg_scale, guidance_scale_2, guidance_rescale)
        negatives = list(negative_prompts or [""] * len(prompts))
        cond, uncond, scales = self.conditioning(
            prompts,
            negatives,
            [guidance] * len(prompts),
            max_sequence_length,
            images=images,
            size=(height, width, num_frames),
            controls=controls,
        )
        z = self.sample(
            latents,
            cond,
            uncond,
            num_inference_steps=num_inference_steps,
            cfg_scale=scales,
            shift=shift,
            scheduler=scheduler,
            guidance_rescale=guidance.guidance_rescale,
            seeds=seeds,
        )
        return np.asarray(self.decode(z, cond))


def _cache_stats(cache_out, use_cfg: bool, batched_cfg: bool) -> dict:
    """Per sample counters (and calibration ratios) from the loop's cache state, as arrays
    whose leading axis is the batch (sharded like it: a process reads its own rows)."""
    if cache_out is None:
        return {}
    cstate = cache_out["state"]
    if use_cfg and not batched_cfg:
        runs = cstate[0]["computed"] + cstate[1]["computed"]
        skips = cstate[0]["skipped"] + cstate[1]["skipped"]
    elif use_cfg:
        runs = sum(jnp.split(cstate["computed"], 2))
        skips = sum(jnp.split(cstate["skipped"], 2))
    else:
        runs, skips = cstate["computed"], cstate["skipped"]
    stats = {"block_stack_runs": runs, "block_stack_skips": skips}
    if cache_out["ratios"] is not None:
        ratios = cache_out["ratios"].T  # [rows, steps]
        if use_cfg:
            stats["ratios"], stats["negative_ratios"] = jnp.split(ratios, 2)
        else:
            stats["ratios"] = ratios
    return stats


def _per_row_scales(cfg_scale, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """(first expert's, second expert's) CFG scale per row: one number, one per row, or a
    ``[rows, 2]`` pair per row."""
    given = np.asarray(cfg_scale, np.float32)
    scales, scales_2 = (given[:, 0], given[:, 1]) if given.ndim == 2 else (given, given)
    return np.broadcast_to(scales, (rows,)), np.broadcast_to(scales_2, (rows,))


def _cache_input(cache: step_cache.CachePlan, cache_schedule, steps: int) -> dict | None:
    """The loop's ``cache_in`` (None without a cache); MagCache needs its compute schedule."""
    if not cache.enabled:
        return None
    schedule = None if cache_schedule is None else jnp.asarray(cache_schedule, bool)
    if cache.kind == "magcache" and (schedule is None or schedule.shape != (steps,)):
        raise ValueError(f"magcache needs a [{steps}] compute schedule")
    return {"state": None, "schedule": schedule}


def resolve_pipeline_dir(path_or_uri_or_repo_id: str | os.PathLike) -> Path:
    """A local pipeline directory for a local path, a ``gs://`` URI or a Hugging Face repo id.

    gs:// trees are copied into the local cache once; repo ids are resolved with
    ``huggingface_hub.snapshot_download`` limited to json/safetensors/tokenizer files (it reads
    the local cache when offline; nothing with code or pickles is fetched).
    """
    source = str(path_or_uri_or_repo_id)
    if storage.is_gcs(source):
        return storage.local_copy(source)
    local = Path(source).expanduser()
    if local.exists():
        return local
    if source.count("/") == 1 and not source.startswith((".", "/", "~")):
        from huggingface_hub import snapshot_download

        try:
            return Path(snapshot_download(source, allow_patterns=HUB_ALLOW_PATTERNS))
        except Exception as err:  # offline and not cached, unknown repo, ...
            raise FamilyError(
                f"pretrained_model_name_or_path {source}: not a local path, and the Hugging "
                f"Face snapshot could not be resolved ({type(err).__name__}: {err})"
            ) from None
    raise FamilyError(f"pretrained_model_name_or_path {source} does not exist")
