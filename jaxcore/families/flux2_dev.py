"""FLUX.2 [dev] text-to-image and multi-reference editing as a family: the twin of diffusers'
``Flux2Pipeline``, written as what differs from FLUX.2 [klein] (:mod:`jaxcore.families.flux2`).

Reference: ``diffusers/pipelines/flux2/pipeline_flux2.py`` (``Flux2Pipeline.__call__``,
diffusers 0.42). As Klein's: the transformer class (``Flux2Transformer2DModel``), the VAE and its
patchified BatchNorm-normalised latents, the packing and ids, the reference images (the same
preprocessing, tokens after the noise tokens with ids ``(10 * (i + 1), row, col, 0)``), the
flow-match Euler schedule with ``mu = compute_empirical_mu(image_seq_len, N)`` and the decode.
What differs:

- prompts -> the hidden states ``text_encoder_out_layers`` (default ``(10, 20, 30)``) of
  Mistral-3's language model (``Mistral3ForConditionalGeneration``; Mistral-Small-3.2 24B in the
  released model) stacked per token, each prompt a system turn (the pipeline's
  ``SYSTEM_MESSAGE``) and a user turn through the ``tokenizer`` folder's chat template, padded
  to ``max_sequence_length`` (:func:`jaxcore.models.mistral3.prompt_embeds`);
- guidance: embedded, not CFG. The transformer has a guidance embedder (``guidance_embeds``
  true, required here; Klein's family refuses it) and every step takes ``guidance =
  full([B], guidance_scale)`` (default 4.0), joined to the conditioning as ``guidance`` and
  passed on by :meth:`Flux2Family.apply`. No negative prompt, no second pass;
- ``caption_upsample_temperature`` (the pipeline rewriting prompts by generating with Mistral's
  LM head, which is never loaded) is refused by name; so are Klein's ``is_distilled`` and the
  KV render (``reference_kv``), which ``Flux2Pipeline`` does not have.

``text_encoder_out_layers`` is the one pipeline setting (:class:`Flux2DevPipelineOptions`): a
model YAML's ``pipeline:`` section or ``load_pipeline(..., text_encoder_out_layers=(...))``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import ClassVar

import jax.numpy as jnp

from jaxcore import weights
from jaxcore.compute import ComputeConfig
from jaxcore.families import flux2
from jaxcore.families.base import Family, FamilyError, Guidance, read_model_index
from jaxcore.family_types import options_from_dict
from jaxcore.models import autoencoder_kl_flux2 as flux2_vae
from jaxcore.models import mistral3
from jaxcore.text import TokenizerNotFoundError

PIPELINE = "Flux2Pipeline"
CAPTION_UPSAMPLING = "caption_upsample_temperature"
DEFAULT_GUIDANCE_SCALE = 4.0  # Flux2Pipeline.__call__'s guidance_scale
DEFAULT_STEPS = 50


# diffusers' options Flux2Pipeline lacks or that are not supported, and why (refused by name)
REFUSED_OPTIONS = {
    CAPTION_UPSAMPLING: "Flux2Pipeline's caption upsampling (prompts rewritten by sampling "
    "Mistral's LM head, which is never loaded) is not supported; pass the rewritten prompt",
    "reference_kv": "the reference K/V render is Flux2KleinKVPipeline's; Flux2Pipeline has none",
}


def refused_option(name: str, value) -> FamilyError:
    """The error for a :data:`REFUSED_OPTIONS` option set to ``value``."""
    return FamilyError(f"{name}={value!r}: {REFUSED_OPTIONS[name]}")


@dataclasses.dataclass(frozen=True)
class Flux2DevPipelineOptions:
    """Pipeline-level settings: the Mistral hidden states the prompt embedding stacks
    (``__call__``'s ``text_encoder_out_layers``)."""

    text_encoder_out_layers: tuple[int, ...] = mistral3.FLUX2_DEV_LAYERS
    # Flux2Pipeline has no KV render; Klein's encode_images reads this
    reference_kv: ClassVar[bool] = False

    def __post_init__(self):
        """Refuse a layer list that is no non-empty list of ints."""
        layers = tuple(self.text_encoder_out_layers)
        if not layers or any(isinstance(k, bool) or not isinstance(k, int) for k in layers):
            raise ValueError(
                f"text_encoder_out_layers must be a non-empty list of ints, got {list(layers)}"
            )
        object.__setattr__(self, "text_encoder_out_layers", layers)

    def to_dict(self) -> dict:
        """The options as a model YAML's ``pipeline:`` section."""
        return {"text_encoder_out_layers": list(self.text_encoder_out_layers)}

    @classmethod
    def from_dict(cls, data: Mapping) -> Flux2DevPipelineOptions:
        """A model YAML's ``pipeline:`` section; unknown keys are errors naming them."""
        if CAPTION_UPSAMPLING in data:
            raise ValueError(str(refused_option(CAPTION_UPSAMPLING, data[CAPTION_UPSAMPLING])))
        return options_from_dict(cls, data)


def _options(configs: Mapping) -> Flux2DevPipelineOptions:
    """The pipeline options of these configs (the defaults where a model YAML has none)."""
    return configs.get("pipeline") or Flux2DevPipelineOptions()


def _config_problems(configs: Mapping) -> list[str]:
    """What keeps these configs from making one Flux2Pipeline: a transformer without the
    guidance embedder, then Klein's checks (the latent channels, the text encoder's layers and
    width), run as Klein's on the same shapes (they refuse the guidance embedder)."""
    transformer = configs.get("transformer")
    problems = []
    shapes = {**configs, "pipeline": _options(configs)}
    if transformer is not None:
        if not transformer.guidance_embeds:
            problems.append(
                "transformer guidance_embeds=false is FLUX.2 [klein] (Flux2KleinPipeline); "
                f"{PIPELINE} embeds its guidance_scale"
            )
        shapes["transformer"] = dataclasses.replace(transformer, guidance_embeds=False)
    return problems + flux2._config_problems(shapes)


class Flux2DevEncoders(flux2.Flux2Encoders):
    """The VAE encoder, Mistral-3 and its tokenizer of a Flux2Pipeline directory (convert):
    media and reference images as Klein's (:class:`~jaxcore.families.flux2.Flux2Encoders`);
    captions -> Mistral's stacked hidden states, as :meth:`Flux2DevFamily.encode_prompts`."""

    def __init__(
        self,
        directory: Path,
        compute: ComputeConfig,
        max_sequence_length: int,
        batch_size: int,
        configs: Mapping,
    ):
        # not Klein's __init__: it loads Qwen3
        self.batch_size = batch_size
        self.max_sequence_length = max_sequence_length
        self.layers = _options(configs).text_encoder_out_layers
        self.multiple = configs["vae"].spatial_compression * flux2.PACK
        (self.vae, self.vae_params), self.bn = _load_vae(
            directory, configs, compute, encoder_only=True
        )
        self.text_encoder, self.tokenizer = _load_text_encoder(directory, compute)

    def encode_text(self, captions):
        padded, count = self._padded(list(captions), "captions")
        module, params = self.text_encoder
        embeds = mistral3.prompt_embeds(
            self.tokenizer,
            module,
            params,
            padded,
            self.max_sequence_length,
            self.layers,
            dtype=jnp.float32,
        )
        return {flux2.TEXT: embeds[:count]}


def _load_vae(directory: Path, configs, compute: ComputeConfig, mesh=None, rules=None, **kw):
    """``((module, params), latent BatchNorm statistics)`` of the folder's VAE, as Klein's
    (``kw``: ``encoder_only`` for convert)."""
    try:
        vae = flux2_vae.load_autoencoder_kl_flux2(
            directory / "vae",
            dtype=compute.dtype,
            param_dtype=compute.param_dtype,
            attention=compute.attention,
            mesh=mesh,
            rules=rules,
            **kw,
        )
        return vae, flux2_vae.load_latent_bn(directory / "vae", configs["vae"])
    except (ValueError, weights.WeightsError) as err:
        raise FamilyError(f"{directory}: {err}") from None


def _load_text_encoder(directory: Path, compute: ComputeConfig):
    """``((module, params), tokenizer)``: Mistral-3's language model (outside any mesh: its
    params are replicated, nothing is lost) and the tokenizer with its chat template."""
    try:
        encoder = mistral3.load_mistral3(
            directory / "text_encoder", dtype=compute.dtype, param_dtype=compute.param_dtype
        )
        tokenizer = mistral3.load_prompt_tokenizer(directory / "tokenizer")
    except (ValueError, weights.WeightsError, TokenizerNotFoundError) as err:
        raise FamilyError(f"{directory}: {err}") from None
    return encoder, tokenizer


class Flux2DevFamily(flux2.Flux2Family):
    name = "flux2_dev"
    description = "FLUX.2 [dev] text-to-image and reference editing (Flux2Pipeline)"
    pipeline_classes = (PIPELINE,)
    load_options = ("text_encoder_out_layers",)
    # model_index.json holds none (Klein's are refused): component_configs sets the defaults
    pipeline_options = None

    def component_config_classes(self) -> dict[str, type]:
        return {**super().component_config_classes(), "text_encoder": mistral3.MistralTextConfig}

    def optional_config_classes(self) -> dict[str, type]:
        return {"pipeline": Flux2DevPipelineOptions}

    def check_model_index(self, index: Mapping, where: str) -> None:
        """Flux2Pipeline's model_index.json holds no option (Klein's is_distilled is refused)."""
        if index.get("is_distilled"):
            raise FamilyError(f"{where}: is_distilled is Flux2KleinPipeline's; {PIPELINE} has none")

    def component_configs(self, directory) -> dict:
        """The transformer, VAE and Mistral configs, the default options as ``pipeline``."""
        directory = Path(directory)
        self.check_model_index(read_model_index(directory), str(directory / "model_index.json"))
        # the plain components (Klein's reads Klein's options from model_index.json)
        configs = Family.component_configs(self, directory)
        configs["pipeline"] = Flux2DevPipelineOptions()
        self.check_configs(configs, str(directory))
        return configs

    def check_configs(self, configs, where) -> None:
        """The components must make one Flux2Pipeline (each check where its configs are)."""
        problems = _config_problems(configs)
        if problems:
            raise FamilyError(f"{where}: " + "; ".join(problems))

    def load_pipeline(self, directory, compute, mesh=None, rules=None, **options):
        """Klein's :meth:`~jaxcore.families.flux2.Flux2Family.load_pipeline` (the option
        ``text_encoder_out_layers``, default ``(10, 20, 30)``); the :data:`REFUSED_OPTIONS`
        (``caption_upsample_temperature``, ``reference_kv``) are refused by name unless off
        (unset, 0 or false, as diffusers takes them)."""
        for name in REFUSED_OPTIONS:
            value = options.pop(name, None)
            if value:
                raise refused_option(name, value)
        return super().load_pipeline(directory, compute, mesh, rules, **options)

    def load_encoders(self, directory, compute, max_sequence_length, batch_size):
        configs = self.component_configs(directory)
        return Flux2DevEncoders(Path(directory), compute, max_sequence_length, batch_size, configs)

    # --- inference --------------------------------------------------------------------------
    def load_components(self, directory, configs, compute, mesh, rules, denoiser):
        """The VAE (and its latent BatchNorm statistics), Mistral-3 and its tokenizer."""
        del denoiser  # checked against the others in check_configs
        vae, bn = _load_vae(directory, configs, compute, mesh, rules)
        encoder, tokenizer = _load_text_encoder(directory, compute)
        components = {"vae": vae, "latent_bn": bn, "text_encoder": encoder, "tokenizer": tokenizer}
        return {"components": components}

    def encode_prompts(self, pipe, prompts, max_sequence_length):
        """Mistral's stacked hidden states at the pipeline's ``text_encoder_out_layers``,
        each prompt with the pipeline's system message."""
        module, params = pipe.components["text_encoder"]
        layers = _options(pipe.configs).text_encoder_out_layers
        embeds = mistral3.prompt_embeds(
            pipe.components["tokenizer"],
            module,
            params,
            list(prompts),
            max_sequence_length,
            layers,
            dtype=jnp.float32,
        )
        return {flux2.TEXT: embeds}

    def sampling_defaults(self, configs) -> dict:
        # Flux2Pipeline.__call__'s defaults (a render with reference images and no size takes
        # the first one's, as Klein's: size_from_image)
        size = flux2.DEFAULT_SAMPLE_SIZE * configs["vae"].spatial_compression
        return {
            "height": size,
            "width": size,
            "num_frames": 1,
            "num_inference_steps": DEFAULT_STEPS,
            "guidance_scale": DEFAULT_GUIDANCE_SCALE,
            "max_sequence_length": mistral3.FLUX2_DEV_MAX_SEQUENCE_LENGTH,
        }

    def guidance(
        self,
        configs,
        *,
        guidance_scale: float,
        true_cfg_scale: float,
        guidance_scale_2: float | None = None,
    ) -> Guidance:
        """The embedded guidance: ``guidance_scale`` is the transformer's ``guidance`` input of
        every sample (diffusers' ``torch.full([B], guidance_scale)``); no CFG."""
        if guidance_scale_2 is not None:
            raise FamilyError(
                f"guidance_scale_2={guidance_scale_2}: FLUX.2 [dev] has one denoiser; "
                "guidance_scale_2 is the second expert's scale of two-expert models (Wan 2.2 A14B)"
            )
        if float(true_cfg_scale) != 1.0:
            raise FamilyError(
                f"true_cfg_scale={true_cfg_scale}: {PIPELINE} has no classifier-free guidance "
                "(no negative prompt); its guidance_scale is embedded in the transformer"
            )
        return Guidance(cfg_scale=1.0, embedded={flux2.GUIDANCE: float(guidance_scale)})
