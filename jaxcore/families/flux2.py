"""Flux.2 [klein] text-to-image and multi-reference editing as a family: the twin of diffusers'
``Flux2KleinPipeline`` and ``Flux2KleinKVPipeline`` (reference K/V cache).

Reference: ``diffusers/pipelines/flux2/pipeline_flux2_klein.py`` (``Flux2KleinPipeline.__call__``),
``pipeline_flux2_klein_kv.py`` and ``pipelines/flux2/image_processor.py`` (diffusers 0.42):

- prompts -> Qwen3's hidden states ``text_encoder_out_layers`` (default ``(9, 18, 27)``)
  stacked per token (``encoder_hidden_states [max_sequence_length, K * D]``), each prompt one
  chat-template user message padded to ``max_sequence_length`` (:func:`qwen3.prompt_embeds`);
  text ids ``(0, 0, 0, l)``;
- latents: the patchified, BatchNorm-normalised VAE latents ``[4c, H/16, W/16]`` (channel
  ``c * 4 + dy * 2 + dx``) exactly as ``prepare_latents`` makes them before packing; the
  denoiser packs them row-major (``[h * w, 4c]``) with ids ``(0, row, col, 0)`` and takes
  ``timestep / 1000``;
- reference images (editing): each resized to <= 1024 x 1024 pixels (LANCZOS, only when
  larger), floored to a multiple of 16 and centre-cropped to it, VAE-encoded (posterior *mode*,
  the pipeline's ``sample_mode="argmax"``), patchified and normalised like the latents. Their
  tokens are appended after the noise tokens (``cat([latents, refs])``, full attention, the
  step's timestep) with ids ``(10 * (i + 1), row, col, 0)``, and only the first ``h * w``
  outputs are kept; the plain concatenation path of :mod:`jaxcore.models.flux2_transformer`;
- ``Flux2KleinKVPipeline`` (the same preprocessing and ids) attends another way: the noise and
  text queries see the reference keys, the reference queries only their own, the reference
  tokens modulated at the fixed timestep 0 (diffusers' ``ref_fixed_timestep``). So every layer's
  reference K/V depend on the weights and the references alone: diffusers computes them in its
  first step ("extract") and reuses them ("cached"); here they are computed once per render,
  in the jitted loop before its first step (:meth:`Flux2Family.loop_conditioning`: the same
  values, so the same render), and every step's call takes them. That pipeline has no CFG
  (``guidance_scale`` is ignored, as for a distilled one) and defaults to 4 steps;
- guidance: CFG ``neg + guidance_scale * (cond - neg)`` when ``guidance_scale > 1`` unless the
  pipeline ``is_distilled`` (model_index.json), which turns it off as diffusers does. diffusers
  encodes the empty prompt as the negative; here a prompt's negative prompt is encoded instead
  (``""``, the default, is diffusers' negative exactly);
- the flow-match Euler scheduler with sigmas ``linspace(1, 1/N, N)`` and, under dynamic
  shifting, ``mu = compute_empirical_mu(image_seq_len, N)``;
- decode: denormalise, unpatchify, VAE decode, ``image / 2 + 0.5`` clamped.

Conditioning tensors: ``encoder_hidden_states`` and, with reference images, ``reference_<i>``
``[B, 4c, h_i, w_i]`` per reference image ``i`` (its latents in the layout of ``latents``; the
shapes give the ids, so the RoPE tables are built from host ids, as the latents' are), named
``kv_reference_<i>`` for the KV render; inside its loop they become ``kv_cache`` (the
transformer's :class:`~jaxcore.models.flux2_transformer.ReferenceKV`). An :meth:`apply` given
``kv_reference_<i>`` itself (no cache) computes their K/V in the call: the same function,
uncached. All rows of one batch take the same number of references of the same sizes (one
token layout).

``text_encoder_out_layers`` is a pipeline setting (:class:`Flux2PipelineOptions`): a model
YAML's ``pipeline:`` section or ``load_pipeline(..., text_encoder_out_layers=(...))``; it fixes
the prompt embedding (and so the pipeline's prompt memo), hence once per loaded pipeline.
``reference_kv`` likewise: true for a ``Flux2KleinKVPipeline`` folder, false for a
``Flux2KleinPipeline`` one, and ``load_pipeline(..., reference_kv=...)`` chooses the other as
diffusers lets either class load either folder (``Flux2KleinKVPipeline.from_pretrained`` of a
Klein folder: the same components).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from jaxcore import sharding, weights
from jaxcore.compute import ComputeConfig
from jaxcore.families import flow_match
from jaxcore.families.base import (
    DenoiserModel,
    Encoders,
    Family,
    FamilyError,
    Geometry,
    Guidance,
    ImageInputs,
    TensorSpec,
    decoded_frames,
)
from jaxcore.family_types import options_from_dict
from jaxcore.models import autoencoder_kl_flux2 as flux2_vae
from jaxcore.models import flux2_transformer, qwen3
from jaxcore.text import load_tokenizer

TEXT = "encoder_hidden_states"
GUIDANCE = "guidance"  # FLUX.2 [dev]'s embedded guidance scale (Guidance.embedded)
REFERENCE = "reference_"  # reference_0, reference_1, ...: one per reference image
KV_REFERENCE = "kv_reference_"  # the same, for the KV render (Flux2KleinKVPipeline)
KV_CACHE = "kv_cache"  # inside the KV render's loop: the references' per-layer K/V
KV_PIPELINE = "Flux2KleinKVPipeline"
KV_DEFAULT_STEPS = 4  # Flux2KleinKVPipeline.__call__'s num_inference_steps
REF_FIXED_TIMESTEP = 0.0  # the KV path modulates the reference tokens at this sigma
MAX_REFERENCES = 4  # FLUX.2 [klein] edits with up to four reference images
REFERENCE_TIME_STEP = 10  # _prepare_image_ids' scale: reference i has t = 10 * (i + 1)
MAX_REFERENCE_AREA = 1024 * 1024  # larger references are resized down to this area
MIN_REFERENCE_SIDE = 64  # Flux2ImageProcessor.check_image_input's limits
MAX_REFERENCE_ASPECT = 8
PACK = 2  # the pipeline patchifies the VAE latents 2x2
DEFAULT_SAMPLE_SIZE = 128  # Flux2KleinPipeline.default_sample_size (in VAE latent pixels)

# FLUX.2 [klein]'s scheduler (dynamic shifting): the scheduler of a model YAML, which names none.
REFERENCE_SCHEDULER_CONFIG: dict[str, object] = {
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "max_image_seq_len": 4096,
    "max_shift": 1.15,
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
}


@dataclasses.dataclass(frozen=True)
class Flux2PipelineOptions:
    """Pipeline-level settings: ``is_distilled`` (model_index.json; CFG off), the Qwen3
    hidden states the prompt embedding stacks (``__call__``'s ``text_encoder_out_layers``) and
    ``reference_kv``: render as ``Flux2KleinKVPipeline`` (model_index.json's class)."""

    is_distilled: bool = False
    text_encoder_out_layers: tuple[int, ...] = qwen3.KLEIN_LAYERS
    reference_kv: bool = False

    def __post_init__(self):
        """Refuse a non-bool ``is_distilled`` / ``reference_kv`` or a layer list that is no
        list of ints."""
        for key in ("is_distilled", "reference_kv"):
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"{key} must be true or false, got {getattr(self, key)!r}")
        layers = tuple(self.text_encoder_out_layers)
        if not layers or any(isinstance(k, bool) or not isinstance(k, int) for k in layers):
            raise ValueError(
                f"text_encoder_out_layers must be a non-empty list of ints, got {list(layers)}"
            )
        object.__setattr__(self, "text_encoder_out_layers", layers)

    @classmethod
    def from_index(cls, index: Mapping) -> Flux2PipelineOptions:
        """The options model_index.json holds (``is_distilled``, and the pipeline class:
        ``reference_kv``; the layers are a call's)."""
        return cls(
            is_distilled=index.get("is_distilled", False),
            reference_kv=index.get("_class_name") == KV_PIPELINE,
        )

    def to_dict(self) -> dict:
        """The options as a model YAML's ``pipeline:`` section."""
        layers = list(self.text_encoder_out_layers)
        return {**dataclasses.asdict(self), "text_encoder_out_layers": layers}

    @classmethod
    def from_dict(cls, data: Mapping) -> Flux2PipelineOptions:
        """A model YAML's ``pipeline:`` section; unknown keys are errors naming them."""
        return options_from_dict(cls, data)


# --- ids and FLOPs -------------------------------------------------------------------------------


def grid_ids(t: int, height: int, width: int) -> np.ndarray:
    """``(t, row, col, 0)`` per token of a row-major ``height x width`` grid, ``[h * w, 4]``
    (the pipeline's ``_prepare_latent_ids`` / ``_prepare_image_ids``)."""
    rows, cols = np.meshgrid(np.arange(height), np.arange(width), indexing="ij")
    n = height * width
    return np.stack([np.full(n, t), rows.ravel(), cols.ravel(), np.zeros(n)], axis=-1).astype(
        np.float32
    )


def text_ids(length: int) -> np.ndarray:
    """``(0, 0, 0, l)`` per text token, ``[length, 4]`` (``_prepare_text_ids``)."""
    ids = np.zeros((length, 4), np.float32)
    ids[:, 3] = np.arange(length)
    return ids


def reference_names(conditioning: Mapping, prefix: str = REFERENCE) -> list[str]:
    """The reference images' conditioning names in image order (``prefix``: ``reference_``,
    or ``kv_reference_`` for the KV render's)."""
    names = [n for n in conditioning if n.startswith(prefix)]
    return sorted(names, key=lambda n: int(n[len(prefix) :]))


def packed_references(conditioning: Mapping, names: Sequence[str], dtype):
    """(tokens ``[B, R, 4c]``, ids ``[R, 4]``) of the named reference latents, concatenated
    in image order with ids ``(10 * (i + 1), row, col, 0)`` (``prepare_image_latents``)."""
    tokens, ids = [], []
    for i, name in enumerate(names):
        reference = conditioning[name]
        tokens.append(flux2_vae.pack_latents(reference.astype(dtype)))
        ids.append(grid_ids(REFERENCE_TIME_STEP * (i + 1), *reference.shape[2:]))
    return jnp.concatenate(tokens, axis=1), np.concatenate(ids)


def compute_empirical_mu(image_seq_len: int, num_steps: int) -> float:
    """diffusers' ``compute_empirical_mu`` (Flux.2's ``mu``, from the noise tokens and the
    step count), the same float64 operations in the same order."""
    a1, b1 = 8.73809524e-05, 1.89833333
    a2, b2 = 0.00016927, 0.45666666
    if image_seq_len > 4300:
        return float(a2 * image_seq_len + b2)
    m_200 = a2 * image_seq_len + b2
    m_10 = a1 * image_seq_len + b1
    a = (m_200 - m_10) / 190.0
    b = m_200 - 200.0 * a
    return float(a * num_steps + b)


def flops(config, batch: int, image_tokens: int, text_tokens: int) -> int:
    """Matmul FLOPs of one transformer forward over ``image_tokens`` (noise and reference)
    and ``text_tokens``: projections, SwiGLU MLPs and attention's scores and values."""
    d, f, n = config.hidden_dim, config.mlp_dim, image_tokens + text_tokens
    double = n * (4 * d * d + 3 * d * f) + 2 * n * n * d
    single = n * (d * (3 * d + 2 * f) + (d + f) * d) + 2 * n * n * d
    edges = image_tokens * d * (config.in_channels + config.proj_out_dim)
    edges += text_tokens * config.joint_attention_dim * d
    total = config.num_layers * double + config.num_single_layers * single + edges
    return 2 * batch * total


def attention_flops(config, batch: int, image_tokens: int, text_tokens: int) -> int:
    """The part of :func:`flops` in QK^T and PV."""
    n = image_tokens + text_tokens
    blocks = config.num_layers + config.num_single_layers
    return 2 * batch * blocks * 2 * n * n * config.hidden_dim


# --- reference images ----------------------------------------------------------------------------


def check_reference(image) -> None:
    """``Flux2ImageProcessor.check_image_input``: a PIL image, sides >= 64, aspect <= 8."""
    import PIL.Image

    if not isinstance(image, PIL.Image.Image):
        raise FamilyError(f"a reference image must be a PIL image, got {type(image).__name__}")
    width, height = image.size
    if width < MIN_REFERENCE_SIDE or height < MIN_REFERENCE_SIDE:
        raise FamilyError(
            f"reference image too small: {width}x{height}; both sides must be at least "
            f"{MIN_REFERENCE_SIDE}px"
        )
    if max(width / height, height / width) > MAX_REFERENCE_ASPECT:
        raise FamilyError(
            f"reference image aspect ratio too extreme: {width}x{height} (at most "
            f"{MAX_REFERENCE_ASPECT}:1)"
        )


def reference_size(width: int, height: int, multiple: int) -> tuple[int, int]:
    """(width, height) of a reference as the pipeline prepares it: resized down to 1024 x 1024
    pixels of area when larger (``_resize_to_target_area``), then cropped to multiples of
    ``multiple``."""
    width, height = _area_capped(width, height)
    return (width // multiple) * multiple, (height // multiple) * multiple


def _area_capped(width: int, height: int) -> tuple[int, int]:
    """``_resize_if_exceeds_area``'s size: scaled down to 1024 x 1024 pixels of area when
    larger (truncated as ``_resize_to_target_area`` truncates)."""
    if width * height <= MAX_REFERENCE_AREA:
        return width, height
    scale = math.sqrt(MAX_REFERENCE_AREA / (width * height))
    return int(width * scale), int(height * scale)


def preprocess_reference(image, multiple: int) -> np.ndarray:
    """A reference image as the pipeline prepares it: resized down to 1024 x 1024 pixels of
    area when larger (``_resize_to_target_area``, LANCZOS), then centre-cropped to multiples
    of ``multiple`` (``preprocess(..., resize_mode="crop")``: Flux2ImageProcessor crops, it
    does not resize), RGB, -> ``[3, H, W]`` float32 in [-1, 1]."""
    import PIL.Image

    check_reference(image)
    width, height = image.size
    crop_w, crop_h = reference_size(width, height, multiple)
    if (width, height) != _area_capped(width, height):
        width, height = _area_capped(width, height)
        image = image.resize((width, height), PIL.Image.Resampling.LANCZOS)
    left, top = (width - crop_w) // 2, (height - crop_h) // 2
    image = image.crop((left, top, left + crop_w, top + crop_h)).convert("RGB")
    pixels = np.asarray(image).astype(np.float32) / 255.0
    return np.transpose(pixels * 2.0 - 1.0, (2, 0, 1))


def _reference_rows(images: Sequence) -> list[list]:
    """Per row its reference images (the first slot: one PIL image or a list of them; the
    ``last_image`` slot is refused), checked to be 0..4 per row."""
    rows = []
    for image, last_image in images:
        if last_image is not None:
            raise FamilyError("Flux.2 [klein] takes reference images, no 'last_image'")
        refs = [] if image is None else list(image) if isinstance(image, list | tuple) else [image]
        if len(refs) > MAX_REFERENCES:
            raise FamilyError(f"{len(refs)} reference images; at most {MAX_REFERENCES}")
        rows.append(refs)
    return rows


def _prepared_rows(rows: list[list], multiple: int) -> list[list[np.ndarray]]:
    """Every row's references preprocessed; rows must agree on count and sizes, as one batch
    runs one token layout (the references' tokens and ids)."""
    prepared = [[preprocess_reference(image, multiple) for image in row] for row in rows]
    layouts = {tuple(p.shape for p in row) for row in prepared}
    if len(layouts) > 1:
        raise FamilyError(
            "the rows of one batch must take the same number of reference images of the same "
            f"(cropped) sizes; got layouts {sorted(layouts)}"
        )
    return prepared


def reference_features(configs: Mapping, height: int, width: int) -> tuple[TensorSpec, ...]:
    """The edit-pair records' reference latents for references of ``height x width`` pixels:
    ``reference_0 [4c, h, w]`` at the size :func:`preprocess_reference` makes of them (found by
    preprocessing a blank image of that size: the pipeline's own arithmetic, and its refusals)."""
    import PIL.Image

    multiple = configs["vae"].spatial_compression * PACK
    _, h, w = preprocess_reference(PIL.Image.new("RGB", (width, height)), multiple).shape
    channels = configs["vae"].bn_channels
    return (TensorSpec(f"{REFERENCE}0", (channels, h // multiple, w // multiple)),)


def _reference_feature_problems(denoiser_config, features: Mapping[str, TensorSpec]) -> list[str]:
    """What keeps the records' ``reference_<i>`` features from being the denoiser's reference
    latents: names other than reference_0..reference_{n-1}, more than four, or latents of
    another channel count than the noise latents."""
    names = reference_names(features)
    expected = [f"{REFERENCE}{i}" for i in range(len(names))]
    problems = []
    if names != expected:
        problems.append(f"reference features {names} must be named {expected}")
    if len(names) > MAX_REFERENCES:
        problems.append(f"{len(names)} reference features; at most {MAX_REFERENCES}")
    for name in names:
        shape = tuple(features[name].shape)
        if len(shape) != 3 or shape[0] != denoiser_config.in_channels:
            problems.append(
                f"{name!r} has shape {list(shape)}, the denoiser takes reference latents "
                f"[{denoiser_config.in_channels}, h, w]"
            )
    return problems


class Flux2Encoders(Encoders):
    """The VAE encoder, Qwen3 and its tokenizer of a Flux2KleinPipeline directory (convert).

    Media -> the latents ``prepare_latents`` and :meth:`Flux2Family.encode_images` make:
    the VAE posterior *mode* (the pipeline's ``sample_mode="argmax"``; deterministic records),
    2x2 patchify, BatchNorm normalisation; captions -> Qwen3's stacked hidden states at the
    pipeline's ``text_encoder_out_layers``, as :meth:`Flux2Family.encode_prompts`; an edit
    pair's reference image -> ``reference_0``, preprocessed (:func:`preprocess_reference`) and
    encoded as :meth:`Flux2Family.encode_images` encodes a reference.
    """

    def __init__(
        self,
        directory: Path,
        compute: ComputeConfig,
        max_sequence_length: int,
        batch_size: int,
        configs: Mapping,
    ):
        self.batch_size = batch_size
        self.max_sequence_length = max_sequence_length
        self.layers = configs["pipeline"].text_encoder_out_layers
        self.multiple = configs["vae"].spatial_compression * PACK
        try:
            self.vae, self.vae_params = flux2_vae.load_autoencoder_kl_flux2(
                directory / "vae",
                encoder_only=True,
                dtype=compute.dtype,
                param_dtype=compute.param_dtype,
                attention=compute.attention,
            )
            self.bn = flux2_vae.load_latent_bn(directory / "vae", configs["vae"])
            self.text_encoder = qwen3.load_qwen3(
                directory / "text_encoder", dtype=compute.dtype, param_dtype=compute.param_dtype
            )
        except (ValueError, weights.WeightsError) as err:
            raise FamilyError(f"{directory}: {err}") from None
        self.tokenizer = load_tokenizer(directory / "tokenizer")

    def _latents(self, images: np.ndarray) -> np.ndarray:
        """``[batch_size, 3, H, W]`` in [-1, 1] -> normalised patchified latents, float32."""
        posterior = flux2_vae.encode(self.vae, self.vae_params, jnp.asarray(images, self.vae.dtype))
        z = posterior.mean.astype(jnp.float32)  # the mode: "argmax"
        return np.asarray(flux2_vae.to_model_latents(z, self.bn), np.float32)

    def encode_media(self, videos: np.ndarray) -> np.ndarray:
        images, count = self._padded_images(videos, "Flux.2")
        return self._latents(images)[:count]

    def encode_text(self, captions: Sequence[str]) -> dict[str, np.ndarray]:
        padded, count = self._padded(list(captions), "captions")
        module, params = self.text_encoder
        embeds = qwen3.prompt_embeds(
            self.tokenizer, module, params, padded, self.max_sequence_length, self.layers
        )
        return {TEXT: embeds[:count]}

    def encode_references(self, images: Sequence[np.ndarray]) -> dict[str, np.ndarray]:
        """Edit pairs: one reference image per row, ``[H, W, 3]`` uint8 -> ``{reference_0:
        [B, 4c, h, w]}``, as :meth:`Flux2Family.encode_images` makes it of the same image."""
        import PIL.Image

        prepared = [
            preprocess_reference(PIL.Image.fromarray(np.asarray(image, np.uint8)), self.multiple)
            for image in images
        ]
        padded, count = self._padded(prepared, "reference images")
        return {f"{REFERENCE}0": self._latents(np.stack(padded))[:count]}


class Flux2Family(Family):
    name = "flux2"
    description = (
        "Flux.2 [klein] text-to-image and reference editing (Flux2KleinPipeline, "
        "Flux2KleinKVPipeline)"
    )
    pipeline_classes = ("Flux2KleinPipeline", KV_PIPELINE)
    pipeline_options = Flux2PipelineOptions  # is_distilled, the text layers, reference KV
    denoiser_classes = ("Flux2Transformer2DModel",)
    denoiser_component = "transformer"
    objective = "flow_matching"
    # the options load_pipeline takes beside the common ones (stages refuse others by name)
    load_options = ("text_encoder_out_layers", "reference_kv")
    # diffusers' train_dreambooth_lora_flux2_klein.py default; suffix matching makes
    # "attn.to_out" the single blocks' fused output only (the double blocks' is "to_out.0")
    lora_default_targets = ("to_k", "to_q", "to_v", "to_out.0", "to_qkv_mlp_proj", "attn.to_out")

    denoiser_model = DenoiserModel(
        kind=flux2_transformer.KIND,
        weight_map=flux2_transformer.weight_map,
        config_error=flux2_transformer.Flux2ConfigError,
    )

    def component_config_classes(self) -> dict[str, type]:
        return {
            "transformer": flux2_transformer.Flux2TransformerConfig,
            "vae": flux2_vae.AutoencoderKLFlux2Config,
            "text_encoder": qwen3.Qwen3Config,
        }

    def component_configs(self, directory) -> dict:
        """The transformer, VAE and Qwen3 configs, and model_index.json's options as
        ``pipeline``."""
        configs = super().component_configs(directory)
        self.check_configs(configs, str(directory))
        return configs

    def check_configs(self, configs, where) -> None:
        """The components must make one Klein pipeline (each check where its configs are)."""
        problems = _config_problems(configs)
        if problems:
            raise FamilyError(f"{where}: " + "; ".join(problems))

    def load_pipeline(self, directory, compute, mesh=None, rules=None, **options):
        """:meth:`Family.load_pipeline`; ``text_encoder_out_layers``: the Qwen3 hidden states
        the prompt embedding stacks (default: the pipeline's ``(9, 18, 27)``), checked against
        the components before any weight is read; ``reference_kv``: render as
        ``Flux2KleinKVPipeline`` (true) or ``Flux2KleinPipeline`` (false) whatever class the
        folder names (default: its own), as diffusers loads either folder as either class."""
        given = {key: options.pop(key, None) for key in self.load_options}
        given = {key: value for key, value in given.items() if value is not None}
        if not given:
            return super().load_pipeline(directory, compute, mesh, rules, **options)
        configs = self.component_configs(directory)
        try:
            chosen = dataclasses.replace(configs["pipeline"], **given)
        except (TypeError, ValueError) as err:
            raise FamilyError(f"{directory}: {err}") from None
        self.check_configs({**configs, "pipeline": chosen}, str(directory))
        pipe = super().load_pipeline(directory, compute, mesh, rules, **options)
        pipe.configs["pipeline"] = chosen
        return pipe

    # --- the denoiser -----------------------------------------------------------------------
    def apply(self, module, params, latents, timestep, conditioning, run_stack=None):
        """Pack ``latents [B, 4c, h, w]`` (and the reference images' after them), run the
        transformer at ``timestep / 1000``, keep the noise tokens' outputs, unpack. The KV
        render's references join every layer's keys instead: their cached K/V (``kv_cache``,
        :meth:`loop_conditioning`), or, given their latents (``kv_reference_<i>``), K/V the
        call computes itself (the same function, uncached).

        ``run_stack`` (step caching, :mod:`jaxcore.step_cache`): the block stack runs through it
        on the streams (image [+ reference tokens], text) and the result is ``(latents,
        extra)``; the cached residuals cover the reference tokens of the non-KV render too, as
        diffusers' hooks (whose first stream is the transformer's ``hidden_states``) keep them."""
        _, _, h, w = latents.shape
        text = conditioning[TEXT]
        tokens = flux2_vae.pack_latents(latents.astype(module.dtype))
        ids = grid_ids(0, h, w)
        names = reference_names(conditioning)
        if names:
            references, reference_ids = packed_references(conditioning, names, module.dtype)
            tokens = jnp.concatenate([tokens, references], axis=1)
            ids = np.concatenate([ids, reference_ids])
        out = module.apply(
            {"params": params},
            tokens,
            text.astype(module.dtype),
            timestep.astype(jnp.float32) / 1000.0,
            ids,
            text_ids(text.shape[1]),
            conditioning.get(GUIDANCE),  # FLUX.2 [dev]'s embedded guidance [B] (flux2_dev)
            **_kv_arguments(conditioning, module.dtype),
            run_stack=run_stack,
        )
        if run_stack is None:
            return flux2_vae.unpack_latents(out[:, : h * w], h, w)
        out, extra = out
        return flux2_vae.unpack_latents(out[:, : h * w], h, w), extra

    def loop_conditioning(self, module, params, conditioning):
        """The KV render's reference latents -> every layer's reference K/V (``kv_cache``),
        once per render: they depend on the weights and the references alone (reference
        queries see reference keys only, at the fixed timestep, and Klein has no guidance
        embedding), so they are the cache diffusers' first ("extract") step makes, and every
        step then runs as its "cached" steps do. Anything else as is."""
        names = reference_names(conditioning, KV_REFERENCE)
        if not names:
            return conditioning
        tokens, ids = packed_references(conditioning, names, module.dtype)
        cache = module.apply(
            {"params": params}, tokens, ids, None, REF_FIXED_TIMESTEP, method="reference_kv"
        )
        kept = {name: value for name, value in conditioning.items() if name not in names}
        return {**kept, KV_CACHE: cache}

    def flops_per_forward(self, config, batch, latent_shape, conditioning_shapes):
        image_tokens = self._image_and_reference_tokens(config, latent_shape, conditioning_shapes)
        return flops(config, batch, image_tokens, conditioning_shapes[TEXT][0])

    def attention_flops_per_forward(self, config, batch, latent_shape, conditioning_shapes):
        image_tokens = self._image_and_reference_tokens(config, latent_shape, conditioning_shapes)
        return attention_flops(config, batch, image_tokens, conditioning_shapes[TEXT][0])

    def _image_and_reference_tokens(self, config, latent_shape, conditioning_shapes) -> int:
        """The noise tokens and the reference images' (an edit pair's joint sequence)."""
        references = sum(
            int(np.prod(s[1:])) for n, s in conditioning_shapes.items() if n.startswith(REFERENCE)
        )
        return self.tokens_per_example(config, latent_shape) + references

    def tokens_per_example(self, config, latent_shape):
        _, h, w = latent_shape
        return h * w

    def lora_to_diffusers(self, state_dict, denoiser_config, where: str):
        """diffusers/PEFT, AI-Toolkit / ComfyUI (BFL names), PEFT and kohya Flux.2 LoRAs, and
        PEFT / AI-Toolkit / LyCORIS / bare LoKr files, as exact LoRAs (:mod:`jaxcore.lora.flux2`)."""
        from jaxcore.lora import flux2

        return flux2.to_diffusers(state_dict, denoiser_config, where)

    def lora_weight_map(self, denoiser_config) -> Mapping:
        """The transformer's own weight map: it names every Linear by its diffusers module
        (fused ``to_qkv_mlp_proj`` included) and the SwiGLU ``linear_in`` reshape is
        invertible, so a LoRA delta merges through it as the checkpoint weight loads."""
        return flux2_transformer.weight_map(denoiser_config)

    def check_heads(self, config, mesh) -> None:
        sharding.check_divisible(mesh, heads=config.num_attention_heads)

    # --- conditioning and latents -----------------------------------------------------------
    def conditioning_specs(self, denoiser_config, text_length, latent_shape, image_tokens=None):
        """Qwen3's stacked states; the reference latents of edit pairs are optional (text-to-
        image records have none), checked by :meth:`check_features` when present."""
        del latent_shape, image_tokens
        return (TensorSpec(TEXT, (text_length, denoiser_config.joint_attention_dim)),)

    def check_features(self, denoiser_config, features, where):
        """:meth:`Family.check_features`, and an edit pair's ``reference_<i>`` latents must be
        what :meth:`apply` packs after the noise tokens."""
        super().check_features(denoiser_config, features, where)
        problems = _reference_feature_problems(denoiser_config, features)
        if problems:
            raise FamilyError(
                f"{where}: records do not fit the {self.name} model: " + "; ".join(problems)
            )

    def reference_features(self, directory, height: int, width: int) -> tuple[TensorSpec, ...]:
        """Edit-pair records (convert's reference image column): the reference latents one
        reference image of ``height x width`` pixels adds to a record (:func:`reference_features`);
        sizes the pipeline refuses as a reference are FamilyErrors."""
        return reference_features(self.component_configs(directory), height, width)

    def latent_channels(self, denoiser_config) -> int:
        return denoiser_config.in_channels  # the patchified latents' 4c

    def geometry(self, configs) -> Geometry:
        return Geometry(
            spatial_multiple=configs["vae"].spatial_compression * PACK, temporal_multiple=0
        )

    def latent_shape(self, configs, height, width, num_frames):
        vae = configs["vae"]
        s = vae.spatial_compression * PACK
        return (vae.bn_channels, height // s, width // s)

    def load_encoders(self, directory, compute, max_sequence_length, batch_size):
        configs = self.component_configs(directory)
        return Flux2Encoders(Path(directory), compute, max_sequence_length, batch_size, configs)

    def latent_normalization(self, configs) -> dict:
        return {
            "latent_sampling": "mode",
            "formula": "patchify 2x2, then (z - bn.running_mean) / sqrt(bn.running_var + eps)",
            "batch_norm_eps": configs["vae"].batch_norm_eps,
        }

    # --- inference --------------------------------------------------------------------------
    def default_scheduler_config(self) -> dict:
        return dict(REFERENCE_SCHEDULER_CONFIG)

    def load_components(self, directory, configs, compute, mesh, rules, denoiser):
        """The VAE (and its latent BatchNorm statistics), Qwen3 and its tokenizer."""
        del denoiser  # checked against the others in check_configs
        try:
            vae = flux2_vae.load_autoencoder_kl_flux2(
                directory / "vae",
                dtype=compute.dtype,
                param_dtype=compute.param_dtype,
                attention=compute.attention,
                mesh=mesh,
                rules=rules,
            )
            bn = flux2_vae.load_latent_bn(directory / "vae", configs["vae"])
            # the text encoder outside the mesh: its params are replicated, nothing is lost
            encoder = qwen3.load_qwen3(
                directory / "text_encoder", dtype=compute.dtype, param_dtype=compute.param_dtype
            )
        except (ValueError, weights.WeightsError) as err:
            raise FamilyError(f"{directory}: {err}") from None
        tokenizer = load_tokenizer(directory / "tokenizer")
        return {
            "components": {
                "vae": vae,
                "latent_bn": bn,
                "text_encoder": encoder,
                "tokenizer": tokenizer,
            }
        }

    def encode_prompts(self, pipe, prompts, max_sequence_length):
        """Qwen3's stacked hidden states at the pipeline's ``text_encoder_out_layers``."""
        module, params = pipe.components["text_encoder"]
        layers = pipe.configs["pipeline"].text_encoder_out_layers
        embeds = qwen3.prompt_embeds(
            pipe.components["tokenizer"], module, params, list(prompts), max_sequence_length, layers
        )
        return {TEXT: embeds}

    def image_inputs(self, configs) -> ImageInputs:
        return ImageInputs(image="optional", max_images=MAX_REFERENCES, size_from_image=True)

    def size_from_image(self, configs, width, height):
        """The pipeline's fallback size: its first reference as preprocessed (area capped,
        cropped to the latent multiple)."""
        width, height = reference_size(width, height, self.geometry(configs).spatial_multiple)
        return height, width

    def encode_images(self, pipe, images, height, width, num_frames, settings=None):
        """Per row ``(references, None)``, references one PIL image or a list of 1-4 ->
        ``reference_<i> [B, 4c, h_i, w_i]`` (VAE posterior mode, patchified, normalised;
        ``kv_reference_<i>`` for the KV render); rows without references give nothing, and a
        batch cannot mix the two."""
        del settings
        del height, width, num_frames  # the references keep their own (cropped) sizes
        rows = _reference_rows(images)
        if not any(rows):
            return {}
        if not all(rows):
            raise FamilyError(
                "a batch cannot mix prompts with and without reference images (one token layout)"
            )
        multiple = pipe.configs["vae"].spatial_compression * PACK
        prepared = _prepared_rows(rows, multiple)
        vae, params = pipe.components["vae"]
        prefix = KV_REFERENCE if _options(pipe.configs).reference_kv else REFERENCE
        out = {}
        for i in range(len(prepared[0])):
            pixels = jnp.asarray(np.stack([row[i] for row in prepared]), vae.dtype)
            posterior = flux2_vae.encode(vae, params, pixels)
            z = posterior.mean.astype(jnp.float32)  # the mode: "argmax"
            latents = flux2_vae.to_model_latents(z, pipe.components["latent_bn"])
            out[f"{prefix}{i}"] = np.asarray(latents, np.float32)
        return out

    def decode(self, pipe, latents, conditioning=None):
        """Denormalise (the VAE's bn statistics), unpatchify, decode, to [0, 1] frames."""
        del conditioning  # decoding takes no per-prompt settings
        vae, params = pipe.components["vae"]
        x = jnp.asarray(latents, jnp.float32)
        z = flux2_vae.from_model_latents(x, pipe.components["latent_bn"])
        return decoded_frames(flux2_vae.decode(vae, params, z.astype(vae.dtype)))

    def sampling_defaults(self, configs) -> dict:
        # Flux2KleinPipeline.__call__'s defaults (it takes the size of the first reference
        # image when none is given; here the size is always given)
        size = DEFAULT_SAMPLE_SIZE * configs["vae"].spatial_compression
        defaults = {
            "height": size,
            "width": size,
            "num_frames": 1,
            "num_inference_steps": 50,
            "guidance_scale": 4.0,
            "max_sequence_length": qwen3.KLEIN_MAX_SEQUENCE_LENGTH,
        }
        if _options(configs).reference_kv:  # Flux2KleinKVPipeline: 4 steps, no guidance_scale
            defaults.update(num_inference_steps=KV_DEFAULT_STEPS, guidance_scale=1.0)
        return defaults

    def default_scheduler(self, scheduler_config) -> str:
        return flow_match.scheduler_name(scheduler_config, "Flux.2")

    def make_schedule(self, pipe, scheduler, num_inference_steps, shift, latent_shape):
        """Flow-match Euler with the pipeline's sigmas and its empirical ``mu``."""
        _, _, h, w = latent_shape
        # the noise tokens only: references do not count (the pipeline's latents.shape[1])
        mu = compute_empirical_mu(h * w, num_inference_steps)
        return flow_match.image_schedule(pipe, scheduler, num_inference_steps, shift, mu, "Flux.2")

    def guidance(
        self,
        configs,
        *,
        guidance_scale: float,
        true_cfg_scale: float,
        guidance_scale_2: float | None = None,
    ) -> Guidance:
        """CFG at ``guidance_scale`` (> 1), off for a distilled pipeline as in diffusers, and
        for the KV render (Flux2KleinKVPipeline, distilled by its own default, has no CFG)."""
        if guidance_scale_2 is not None:
            raise FamilyError(
                f"guidance_scale_2={guidance_scale_2}: Flux.2 has one denoiser; guidance_scale_2 "
                "is the second expert's scale of two-expert models (Wan 2.2 A14B)"
            )
        if float(true_cfg_scale) != 1.0:
            raise FamilyError(
                f"true_cfg_scale={true_cfg_scale}: Flux2KleinPipeline has no true_cfg_scale; "
                "its CFG scale is guidance_scale"
            )
        options = _options(configs)
        if options.is_distilled or options.reference_kv:
            return Guidance(cfg_scale=1.0)  # diffusers ignores guidance_scale (with a warning)
        return Guidance(cfg_scale=float(guidance_scale))


def _options(configs: Mapping) -> Flux2PipelineOptions:
    """The pipeline options of these configs (the defaults where a model YAML has none)."""
    return configs.get("pipeline") or Flux2PipelineOptions()


def _kv_arguments(conditioning: Mapping, dtype) -> dict:
    """The transformer's reference keywords of a KV render's conditioning: its cache
    (``reference_kv``), or its reference latents, whose K/V the call then computes at the fixed
    reference timestep (``reference_tokens``, diffusers' "extract" call); none otherwise."""
    if KV_CACHE in conditioning:
        return {"reference_kv": conditioning[KV_CACHE]}
    names = reference_names(conditioning, KV_REFERENCE)
    if not names:
        return {}
    tokens, ids = packed_references(conditioning, names, dtype)
    return {"reference_tokens": tokens, "reference_ids": ids, "ref_timestep": REF_FIXED_TIMESTEP}


def _config_problems(configs: Mapping) -> list[str]:
    """What keeps these configs from making one Flux2KleinPipeline."""
    transformer, vae = configs.get("transformer"), configs.get("vae")
    encoder, options = configs.get("text_encoder"), configs.get("pipeline")
    problems = []
    if transformer is not None:
        if transformer.guidance_embeds:
            problems.append(
                "transformer guidance_embeds=true is FLUX.2 dev (Flux2Pipeline); "
                "Flux2KleinPipeline passes no guidance"
            )
        if transformer.proj_out_dim != transformer.in_channels:
            problems.append(
                f"transformer emits {transformer.proj_out_dim} channels per token but takes "
                f"in_channels={transformer.in_channels}"
            )
    if transformer is not None and vae is not None and transformer.in_channels != vae.bn_channels:
        problems.append(
            f"transformer in_channels {transformer.in_channels} != 4 x the vae's "
            f"latent_channels {vae.latent_channels}"
        )
    if encoder is not None:
        layers = (options or Flux2PipelineOptions()).text_encoder_out_layers
        if min(layers) < 0 or max(layers) > encoder.num_hidden_layers:
            problems.append(
                f"text_encoder_out_layers {list(layers)} must be in 0..{encoder.num_hidden_layers}"
                " (the text encoder's hidden states)"
            )
        width = len(layers) * encoder.hidden_size
        if transformer is not None and width != transformer.joint_attention_dim:
            problems.append(
                f"{len(layers)} text encoder layers x hidden_size {encoder.hidden_size} = {width}"
                f" != the transformer's joint_attention_dim {transformer.joint_attention_dim}"
            )
    return problems
