"""Flux.2 [klein] text-to-image and multi-reference editing as a family: the twin of diffusers'
``Flux2KleinPipeline``.

Reference: ``diffusers/pipelines/flux2/pipeline_flux2_klein.py`` (``Flux2KleinPipeline.__call__``)
and ``pipelines/flux2/image_processor.py`` (diffusers 0.42):

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
  outputs are kept; the plain concatenation path of :mod:`jaxcore.models.flux2_transformer`
  (the KV-cache layout is ``Flux2KleinKVPipeline``'s, another function);
- guidance: CFG ``neg + guidance_scale * (cond - neg)`` when ``guidance_scale > 1`` unless the
  pipeline ``is_distilled`` (model_index.json), which turns it off as diffusers does. diffusers
  encodes the empty prompt as the negative; here a prompt's negative prompt is encoded instead
  (``""``, the default, is diffusers' negative exactly);
- the flow-match Euler scheduler with sigmas ``linspace(1, 1/N, N)`` and, under dynamic
  shifting, ``mu = compute_empirical_mu(image_seq_len, N)``;
- decode: denormalise, unpatchify, VAE decode, ``image / 2 + 0.5`` clamped.

Conditioning tensors: ``encoder_hidden_states`` and, with reference images, ``reference_<i>``
``[B, 4c, h_i, w_i]`` per reference image ``i`` (its latents in the layout of ``latents``; the
shapes give the ids, so the RoPE tables are built from host ids, as the latents' are). All rows
of one batch take the same number of references of the same sizes (one token layout).

``text_encoder_out_layers`` is a pipeline setting (:class:`Flux2PipelineOptions`): a model
YAML's ``pipeline:`` section or ``load_pipeline(..., text_encoder_out_layers=(...))``; it fixes
the prompt embedding (and so the pipeline's prompt memo), hence once per loaded pipeline.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from jaxcore import sharding, weights
from jaxcore.families import flow_match
from jaxcore.families.base import (
    DenoiserModel,
    Family,
    FamilyError,
    Geometry,
    Guidance,
    ImageInputs,
    TensorSpec,
    decoded_frames,
    read_model_index,
)
from jaxcore.models import autoencoder_kl_flux2 as flux2_vae
from jaxcore.models import flux2_transformer, qwen3
from jaxcore.text import load_tokenizer

TEXT = "encoder_hidden_states"
REFERENCE = "reference_"  # reference_0, reference_1, ...: one per reference image
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
    """Pipeline-level settings: ``is_distilled`` (model_index.json; CFG off) and the Qwen3
    hidden states the prompt embedding stacks (``__call__``'s ``text_encoder_out_layers``)."""

    is_distilled: bool = False
    text_encoder_out_layers: tuple[int, ...] = qwen3.KLEIN_LAYERS

    def __post_init__(self):
        """Refuse a non-bool ``is_distilled`` or a layer list that is no list of ints."""
        if not isinstance(self.is_distilled, bool):
            raise ValueError(f"is_distilled must be true or false, got {self.is_distilled!r}")
        layers = tuple(self.text_encoder_out_layers)
        if not layers or any(isinstance(k, bool) or not isinstance(k, int) for k in layers):
            raise ValueError(
                f"text_encoder_out_layers must be a non-empty list of ints, got {list(layers)}"
            )
        object.__setattr__(self, "text_encoder_out_layers", layers)

    @classmethod
    def from_index(cls, index: Mapping) -> Flux2PipelineOptions:
        """The options model_index.json holds (``is_distilled``; the layers are a call's)."""
        return cls(is_distilled=index.get("is_distilled", False))

    def to_dict(self) -> dict:
        """The options as a model YAML's ``pipeline:`` section."""
        layers = list(self.text_encoder_out_layers)
        return {**dataclasses.asdict(self), "text_encoder_out_layers": layers}

    @classmethod
    def from_dict(cls, data: Mapping) -> Flux2PipelineOptions:
        """A model YAML's ``pipeline:`` section; unknown keys are errors naming them."""
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ValueError(f"unknown pipeline option(s) {unknown}; known: {known}")
        return cls(**data)


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


def reference_names(conditioning: Mapping) -> list[str]:
    """The reference images' conditioning names in image order."""
    names = [n for n in conditioning if n.startswith(REFERENCE)]
    return sorted(names, key=lambda n: int(n[len(REFERENCE) :]))


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


def preprocess_reference(image, multiple: int) -> np.ndarray:
    """A reference image as the pipeline prepares it: resized down to 1024 x 1024 pixels of
    area when larger (``_resize_to_target_area``, LANCZOS), then centre-cropped to multiples
    of ``multiple`` (``preprocess(..., resize_mode="crop")``: Flux2ImageProcessor crops, it
    does not resize), RGB, -> ``[3, H, W]`` float32 in [-1, 1]."""
    import PIL.Image

    check_reference(image)
    width, height = image.size
    if width * height > MAX_REFERENCE_AREA:
        scale = math.sqrt(MAX_REFERENCE_AREA / (width * height))
        width, height = int(width * scale), int(height * scale)
        image = image.resize((width, height), PIL.Image.Resampling.LANCZOS)
    crop_w, crop_h = (width // multiple) * multiple, (height // multiple) * multiple
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


class Flux2Family(Family):
    name = "flux2"
    description = "Flux.2 [klein] text-to-image and reference editing (Flux2KleinPipeline)"
    pipeline_classes = ("Flux2KleinPipeline",)
    denoiser_classes = ("Flux2Transformer2DModel",)
    denoiser_component = "transformer"
    objective = "flow_matching"
    # the options load_pipeline takes beside the common ones (stages refuse others by name)
    load_options = ("text_encoder_out_layers",)

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

    def optional_config_classes(self) -> dict[str, type]:
        return {"pipeline": Flux2PipelineOptions}

    def check_model_index(self, index: Mapping, where: str) -> None:
        try:
            Flux2PipelineOptions.from_index(index)
        except ValueError as err:
            raise FamilyError(f"{where}: {err}") from None

    def component_configs(self, directory) -> dict:
        """The transformer, VAE and Qwen3 configs, and model_index.json's options as
        ``pipeline``."""
        directory = Path(directory)
        index = read_model_index(directory)
        self.check_model_index(index, str(directory / "model_index.json"))
        configs = super().component_configs(directory)
        configs["pipeline"] = Flux2PipelineOptions.from_index(index)
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
        the components before any weight is read."""
        layers = options.pop("text_encoder_out_layers", None)
        if layers is None:
            return super().load_pipeline(directory, compute, mesh, rules, **options)
        configs = self.component_configs(directory)
        try:
            chosen = dataclasses.replace(configs["pipeline"], text_encoder_out_layers=layers)
        except (TypeError, ValueError) as err:
            raise FamilyError(f"{directory}: {err}") from None
        self.check_configs({**configs, "pipeline": chosen}, str(directory))
        pipe = super().load_pipeline(directory, compute, mesh, rules, **options)
        pipe.configs["pipeline"] = chosen
        return pipe

    # --- the denoiser -----------------------------------------------------------------------
    def apply(self, module, params, latents, timestep, conditioning, run_stack=None):
        """Pack ``latents [B, 4c, h, w]`` (and the reference images' after them), run the
        transformer at ``timestep / 1000``, keep the noise tokens' outputs, unpack."""
        if run_stack is not None:
            raise FamilyError("step caching is not supported for the flux2 family yet")
        _, _, h, w = latents.shape
        text = conditioning[TEXT]
        tokens = [flux2_vae.pack_latents(latents.astype(module.dtype))]
        ids = [grid_ids(0, h, w)]
        for i, name in enumerate(reference_names(conditioning)):
            reference = conditioning[name]
            tokens.append(flux2_vae.pack_latents(reference.astype(module.dtype)))
            ids.append(grid_ids(REFERENCE_TIME_STEP * (i + 1), *reference.shape[2:]))
        out = module.apply(
            {"params": params},
            jnp.concatenate(tokens, axis=1),
            text.astype(module.dtype),
            timestep.astype(jnp.float32) / 1000.0,
            np.concatenate(ids),
            text_ids(text.shape[1]),
            None,
        )
        return flux2_vae.unpack_latents(out[:, : h * w], h, w)

    def flops_per_forward(self, config, batch, latent_shape, conditioning_shapes):
        text_tokens = conditioning_shapes[TEXT][0]
        image_tokens = self.tokens_per_example(config, latent_shape)
        image_tokens += sum(
            int(np.prod(s[1:])) for n, s in conditioning_shapes.items() if n.startswith(REFERENCE)
        )
        return flops(config, batch, image_tokens, text_tokens)

    def attention_flops_per_forward(self, config, batch, latent_shape, conditioning_shapes):
        image_tokens = self.tokens_per_example(config, latent_shape)
        return attention_flops(config, batch, image_tokens, conditioning_shapes[TEXT][0])

    def tokens_per_example(self, config, latent_shape):
        _, h, w = latent_shape
        return h * w

    def check_heads(self, config, mesh) -> None:
        sharding.check_divisible(mesh, heads=config.num_attention_heads)

    # --- conditioning and latents -----------------------------------------------------------
    def conditioning_specs(self, denoiser_config, text_length, latent_shape, image_tokens=None):
        del latent_shape, image_tokens
        return (TensorSpec(TEXT, (text_length, denoiser_config.joint_attention_dim)),)

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
        """Not yet: training records are a later step of issue 50."""
        raise FamilyError(
            "convert (training records) is not supported for the flux2 family yet; it renders "
            "with generate / the Pipeline API"
        )

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
        return ImageInputs(image="optional", max_images=MAX_REFERENCES)

    def encode_images(self, pipe, images, height, width, num_frames):
        """Per row ``(references, None)``, references one PIL image or a list of 1-4 ->
        ``reference_<i> [B, 4c, h_i, w_i]`` (VAE posterior mode, patchified, normalised);
        rows without references give nothing, and a batch cannot mix the two."""
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
        out = {}
        for i in range(len(prepared[0])):
            pixels = jnp.asarray(np.stack([row[i] for row in prepared]), vae.dtype)
            posterior = flux2_vae.encode(vae, params, pixels)
            z = posterior.mean.astype(jnp.float32)  # the mode: "argmax"
            latents = flux2_vae.to_model_latents(z, pipe.components["latent_bn"])
            out[f"{REFERENCE}{i}"] = np.asarray(latents, np.float32)
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
        return {
            "height": size,
            "width": size,
            "num_frames": 1,
            "num_inference_steps": 50,
            "guidance_scale": 4.0,
            "max_sequence_length": qwen3.KLEIN_MAX_SEQUENCE_LENGTH,
        }

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
        """CFG at ``guidance_scale`` (> 1), off for a distilled pipeline as in diffusers."""
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
        if configs["pipeline"].is_distilled:
            return Guidance(cfg_scale=1.0)  # diffusers ignores guidance_scale (with a warning)
        return Guidance(cfg_scale=float(guidance_scale))


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
