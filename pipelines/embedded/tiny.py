"""Tiny, random-init pipelines (Wan 2.1, Flux.1) written in diffusers' on-disk format, no torch.

Used by tests, benchmarks and the demo wherever a real checkpoint would be (none can be
downloaded here). The directory is what ``WanPipeline.save_pretrained`` writes::

    model_index.json                      WanPipeline, its component classes
    transformer/{config.json, diffusion_pytorch_model.safetensors}   WanTransformer3DModel
    vae/{config.json, diffusion_pytorch_model.safetensors}           AutoencoderKLWan
    text_encoder/{config.json, model.safetensors}                    UMT5EncoderModel
    tokenizer/...                                                    T5 tokenizer (tiny vocab)
    scheduler/scheduler_config.json       UniPCMultistepScheduler with flow sigmas (as Wan)

Weights come from our own ``init_*`` functions, exported with the models' weight maps, so
diffusers' ``WanPipeline.from_pretrained(directory)`` and our loader read the same numbers.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax

from jaxcore import weights
from jaxcore.families import flux, wan

DEFAULT_MODEL_CONFIG = Path(__file__).resolve().parents[2] / "configs/models/wan_tiny.yml"
DIFFUSERS_VERSION = "0.42.1"
TRANSFORMERS_VERSION = "5.24.0"

# What diffusers writes for a flow-matching Wan 2.1 pipeline (UniPC with flow sigmas).
UNIPC_SCHEDULER_CONFIG: dict[str, Any] = {
    **wan.REFERENCE_SCHEDULER_CONFIG,
    "_diffusers_version": DIFFUSERS_VERSION,
}


def _model_sections(model_config: str | os.PathLike | Mapping) -> dict[str, Any]:
    """{"transformer", "vae", "text_encoder": validated config} from a model YAML or a dict."""
    from jaxcore.families import get
    from jaxcore.model_configs import read_model_yaml

    if isinstance(model_config, Mapping):
        classes = get("wan").component_config_classes()
        sections = {name: classes[name].from_dict(model_config[name]) for name in classes}
    else:
        family, sections = read_model_yaml(model_config)
        if family.name != "wan":
            raise ValueError(f"model_config {model_config}: a {family.name} model, not wan")
    missing = {"transformer", "vae", "text_encoder"} - set(sections)
    if missing:
        raise ValueError(f"model_config {model_config!r} lacks section(s) {sorted(missing)}")
    return sections


def _check_compatible(sections: Mapping[str, Any]) -> None:
    """The components must fit: channels = z_dim, text_dim = the encoder's d_model."""
    transformer, vae, text = sections["transformer"], sections["vae"], sections["text_encoder"]
    if transformer.in_channels != vae.z_dim or transformer.out_channels != vae.z_dim:
        raise ValueError(
            f"transformer in/out_channels ({transformer.in_channels}/{transformer.out_channels}) "
            f"must equal vae.z_dim ({vae.z_dim})"
        )
    if transformer.text_dim != text.d_model:
        raise ValueError(
            f"transformer.text_dim ({transformer.text_dim}) must equal text_encoder.d_model "
            f"({text.d_model})"
        )


# Kept for callers that imported it from here; the implementation lives in weights.
export_state_dict = weights.export_state_dict


# --- config.json writers -----------------------------------------------------------------------


def _write_json(path: Path, data: Mapping) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(data), indent=2, sort_keys=True) + "\n")


def _diffusers_config(class_name: str, config) -> dict:
    return {"_class_name": class_name, "_diffusers_version": DIFFUSERS_VERSION, **config.to_dict()}


def _umt5_config(config) -> dict:
    """A transformers UMT5EncoderModel config.json for our UMT5Config."""
    fields = dataclasses.asdict(config)
    return {
        "architectures": ["UMT5EncoderModel"],
        "model_type": "umt5",
        "transformers_version": TRANSFORMERS_VERSION,
        "dtype": "float32",
        "is_encoder_decoder": True,
        "is_decoder": False,
        "is_gated_act": config.is_gated,
        "dense_act_fn": config.activation_name,
        "num_decoder_layers": config.num_layers,
        "pad_token_id": 0,
        "eos_token_id": 1,
        "decoder_start_token_id": 0,
        "tie_word_embeddings": True,
        "dropout_rate": 0.0,
        **fields,
    }


def _model_index(tokenizer_class: str) -> dict:
    """model_index.json as diffusers' ``WanPipeline.save_pretrained`` writes it."""
    return {
        "_class_name": "WanPipeline",
        "_diffusers_version": DIFFUSERS_VERSION,
        "boundary_ratio": None,
        "expand_timesteps": False,
        "scheduler": ["diffusers", "UniPCMultistepScheduler"],
        "text_encoder": ["transformers", "UMT5EncoderModel"],
        "tokenizer": ["transformers", tokenizer_class],
        "transformer": ["diffusers", "WanTransformer3DModel"],
        "transformer_2": [None, None],
        "vae": ["diffusers", "AutoencoderKLWan"],
    }


# --- the builder -------------------------------------------------------------------------------


def _write_component(folder: Path, config: Mapping, weights_file: str, tensors: Mapping) -> None:
    """A component's folder as diffusers and transformers save it: config.json, then the
    weights (safetensors, PyTorch's names)."""
    _write_json(folder / "config.json", config)
    weights.save_safetensors(tensors, folder / weights_file, {"format": "pt"})


def write_transformer(directory: str | os.PathLike, config, params) -> None:
    """``transformer/``-style folder: config.json + diffusion_pytorch_model.safetensors.

    Also what a train run exports for its checkpoints (diffusers ``WanTransformer3DModel``).
    """
    from jaxcore.models import wan_transformer

    _write_component(
        Path(directory),
        _diffusers_config("WanTransformer3DModel", config),
        "diffusion_pytorch_model.safetensors",
        weights.export_state_dict(params, wan_transformer.weight_map(config)),
    )


# The output projections of a T5/UMT5 block's two residual branches, as transformers names them.
T5_BRANCH_OUTPUTS = ("SelfAttention.o.weight", "DenseReluDense.wo.weight")


def scale_residual_branches(tensors: Mapping[str, Any], scale: float) -> dict[str, Any]:
    """A T5/UMT5 state dict whose residual branches' output projections are ``scale`` times
    the given ones (the embeddings, norms and other projections unchanged).

    The blocks are pre-norm, so a branch adds ``scale`` times what it added before while the
    token embeddings stay as they are: the encoder's output leans on each word's own embedding
    and mixes in less of the sentence around it. A random-init encoder with ``scale`` 1 mixes
    so much that one word's output differs from prompt to prompt about as much as two words
    differ (pipelines.demo.assets.DEMO_TEXT_ENCODER_BRANCH_SCALE gives the figures).
    """
    if not scale > 0:
        raise ValueError(f"text_encoder_branch_scale must be > 0, got {scale}")
    return {
        key: value * scale if key.endswith(T5_BRANCH_OUTPUTS) else value
        for key, value in tensors.items()
    }


def build_tiny_wan_pipeline(
    directory: str | os.PathLike,
    *,
    seed: int = 0,
    model_config: str | os.PathLike | Mapping = DEFAULT_MODEL_CONFIG,
    flow_shift: float = 3.0,
    transformer_output_scale: float = 1.0,
    text_encoder_branch_scale: float = 1.0,
) -> Path:
    """Write a complete random-init diffusers Wan pipeline into ``directory``; returns it.

    ``model_config``: a model YAML (``configs/models/*.yml``) or a dict with sections
    ``transformer``, ``vae``, ``text_encoder`` (config.json names). The tokenizer's vocabulary
    is the text encoder's ``vocab_size``. ``seed`` fixes every weight.
    ``transformer_output_scale`` multiplies the transformer's output projection: random-init
    models predict velocities of order 0.01, so a test can scale them up to make guidance and
    the sampler visibly matter. ``text_encoder_branch_scale`` multiplies the output projections
    of the text encoder's residual branches (each block's attention ``o`` and feed-forward
    ``wo``), so a random-init encoder mixes less context into each word (see
    :func:`scale_residual_branches`).
    """
    from jaxcore.models import umt5, wan_transformer, wan_vae
    from pipelines.embedded.tokenizers import build_tiny_tokenizer

    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    sections = _model_sections(model_config)
    _check_compatible(sections)
    keys = jax.random.split(jax.random.key(seed), 3)

    t_cfg = sections["transformer"]
    _, t_params = wan_transformer.init_wan_transformer(t_cfg, keys[0])
    if transformer_output_scale != 1.0:
        t_params = dict(t_params)
        t_params["proj_out"] = {
            name: value * transformer_output_scale for name, value in t_params["proj_out"].items()
        }
    write_transformer(root / "transformer", t_cfg, t_params)

    # diffusers' WanPipeline sizes its own noise from these (metadata) factors: write the ones
    # this (possibly tiny) architecture really has, so both pipelines agree on latent shapes.
    v_cfg = dataclasses.replace(
        sections["vae"],
        scale_factor_temporal=sections["vae"].temporal_compression,
        scale_factor_spatial=sections["vae"].spatial_compression,
    )
    _, v_params = wan_vae.init_wan_vae(v_cfg, keys[1])
    _write_component(
        root / "vae",
        _diffusers_config("AutoencoderKLWan", v_cfg),
        "diffusion_pytorch_model.safetensors",
        weights.export_state_dict(v_params, wan_vae.weight_map(v_cfg)),
    )

    e_cfg = sections["text_encoder"]
    _, e_params = umt5.init_umt5(e_cfg, keys[2])
    # transformers stores the tied embedding once, as shared.weight.
    tensors = weights.export_state_dict(e_params, umt5.weight_map(e_cfg, "shared.weight"))
    tensors = scale_residual_branches(tensors, text_encoder_branch_scale)
    _write_component(root / "text_encoder", _umt5_config(e_cfg), "model.safetensors", tensors)

    tokenizer = build_tiny_tokenizer(root / "tokenizer", vocab_size=e_cfg.vocab_size)
    _write_json(
        root / "scheduler/scheduler_config.json",
        {**UNIPC_SCHEDULER_CONFIG, "flow_shift": flow_shift},
    )
    _write_json(root / "model_index.json", _model_index(type(tokenizer).__name__))
    return root


# --- Flux -----------------------------------------------------------------------------------------

FLUX_MODEL_CONFIG = Path(__file__).resolve().parents[2] / "configs/models/flux_tiny.yml"
# FLUX.1-dev's scheduler (dynamic shifting by image size).
FLUX_SCHEDULER_CONFIG: dict[str, Any] = {
    **flux.REFERENCE_SCHEDULER_CONFIG,
    "_diffusers_version": DIFFUSERS_VERSION,
}


def _transformers_config(architecture: str, config) -> dict:
    return {
        "architectures": [architecture],
        "transformers_version": TRANSFORMERS_VERSION,
        "dtype": "float32",
        **config.to_dict(),
    }


def _clip_config_for(tokenizer, config):
    """``config`` (a CLIP text encoder's) with ``tokenizer``'s vocabulary size and special ids."""
    return dataclasses.replace(
        config,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def _flux_model_index(clip_tokenizer, t5_tokenizer) -> dict:
    """model_index.json as diffusers' ``FluxPipeline.save_pretrained`` writes it."""
    return {
        "_class_name": "FluxPipeline",
        "_diffusers_version": DIFFUSERS_VERSION,
        "feature_extractor": [None, None],
        "image_encoder": [None, None],
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "CLIPTextModel"],
        "text_encoder_2": ["transformers", "T5EncoderModel"],
        "tokenizer": ["transformers", type(clip_tokenizer).__name__],
        "tokenizer_2": ["transformers", type(t5_tokenizer).__name__],
        "transformer": ["diffusers", "FluxTransformer2DModel"],
        "vae": ["diffusers", "AutoencoderKL"],
    }


def build_tiny_flux_pipeline(
    directory: str | os.PathLike,
    *,
    seed: int = 0,
    model_config: str | os.PathLike = FLUX_MODEL_CONFIG,
) -> Path:
    """Write a complete random-init diffusers ``FluxPipeline`` into ``directory``; returns it.

    ``model_config``: a Flux model YAML. The CLIP vocabulary and special ids come from the tiny
    CLIP tokenizer written beside it; the T5 tokenizer's vocabulary is ``text_encoder_2``'s.
    """
    from jaxcore.model_configs import read_model_yaml
    from jaxcore.models import autoencoder_kl, clip_text, flux_transformer, t5
    from pipelines.embedded.tokenizers import build_tiny_clip_tokenizer, build_tiny_tokenizer

    root = Path(directory)
    family, sections = read_model_yaml(model_config)
    if family.name != "flux":
        raise ValueError(f"model_config {model_config}: a {family.name} model, not flux")
    clip_tokenizer = build_tiny_clip_tokenizer(
        root / "tokenizer", model_max_length=sections["text_encoder"].max_position_embeddings
    )
    t5_cfg = sections["text_encoder_2"]
    t5_tokenizer = build_tiny_tokenizer(root / "tokenizer_2", vocab_size=t5_cfg.vocab_size)
    clip_cfg = _clip_config_for(clip_tokenizer, sections["text_encoder"])
    keys = jax.random.split(jax.random.key(seed), 4)

    t_cfg = sections["transformer"]
    _, t_params = flux_transformer.init_flux_transformer(t_cfg, keys[0])
    _write_component(
        root / "transformer",
        _diffusers_config("FluxTransformer2DModel", t_cfg),
        "diffusion_pytorch_model.safetensors",
        weights.export_state_dict(t_params, flux_transformer.weight_map(t_cfg)),
    )
    v_cfg = sections["vae"]
    _, v_params = autoencoder_kl.init_autoencoder_kl(v_cfg, keys[1])
    _write_component(
        root / "vae",
        _diffusers_config("AutoencoderKL", v_cfg),
        "diffusion_pytorch_model.safetensors",
        weights.export_state_dict(v_params, autoencoder_kl.weight_map(v_cfg)),
    )
    _, c_params = clip_text.init_clip_text(clip_cfg, keys[2])
    _write_component(
        root / "text_encoder",
        _transformers_config("CLIPTextModel", clip_cfg),
        "model.safetensors",
        weights.export_state_dict(c_params, clip_text.weight_map(clip_cfg)),
    )
    _, e_params = t5.init_t5_encoder(t5_cfg, keys[3])
    _write_component(
        root / "text_encoder_2",
        _transformers_config("T5EncoderModel", t5_cfg),
        "model.safetensors",
        weights.export_state_dict(e_params, t5.weight_map(t5_cfg, "shared.weight")),
    )
    _write_json(root / "scheduler/scheduler_config.json", FLUX_SCHEDULER_CONFIG)
    _write_json(root / "model_index.json", _flux_model_index(clip_tokenizer, t5_tokenizer))
    return root


# --- the cache ------------------------------------------------------------------------------------

DEFAULT_FAMILY = "wan"
BUILDERS = {"wan": (build_tiny_wan_pipeline, DEFAULT_MODEL_CONFIG)}
BUILDERS["flux"] = (build_tiny_flux_pipeline, FLUX_MODEL_CONFIG)


def cached_tiny_pipeline(
    family: str = "wan", model_config: str | os.PathLike | None = None
) -> Path:
    """The tiny ``family`` pipeline of ``model_config``, built once into the difforge cache.

    Keyed by the model YAML's bytes, so an edited config builds a fresh pipeline; built in a
    temporary folder and renamed into place, so a killed build never looks complete.
    """
    import hashlib
    import shutil
    import tempfile

    from jaxcore import storage

    if family not in BUILDERS:
        raise ValueError(f"no tiny {family!r} pipeline; known: {sorted(BUILDERS)}")
    build, default_config = BUILDERS[family]
    model_config = model_config or default_config
    digest = hashlib.sha256(Path(model_config).read_bytes()).hexdigest()[:12]
    directory = storage.cache_dir() / f"tiny_{family}_pipeline-{digest}"
    if (directory / "model_index.json").exists():
        return directory
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".tiny-", dir=directory.parent))
    try:
        build(staging, model_config=model_config)
        try:
            os.rename(staging, directory)
        except OSError:  # another process finished first
            if not (directory / "model_index.json").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return directory


if __name__ == "__main__":
    import sys

    if len(sys.argv) not in (2, 3) or (len(sys.argv) == 3 and sys.argv[2] not in BUILDERS):
        sys.exit(
            f"usage: python -m pipelines.embedded.tiny OUTPUT_DIRECTORY [{'|'.join(BUILDERS)}]"
        )
    build, _ = BUILDERS[sys.argv[2] if len(sys.argv) == 3 else "wan"]
    print(build(sys.argv[1]))
