"""The FLUX.2 model YAMLs (configs/models/flux2_*.yml) build the released architectures: each
component, built by diffusers / transformers from the YAML's section on the meta device, counts
the parameters ours counts from abstract shapes, and those are the released models' counts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from jaxcore.model_configs import read_model_yaml
from jaxcore.models import autoencoder_kl_flux2 as flux2_vae
from jaxcore.models import flux2_transformer as f2
from jaxcore.models import qwen3
from tests.jaxcore.test_flux2_transformer import RELEASED_COUNTS
from tests.jaxcore.test_qwen3 import REAL_COUNTS as QWEN3_COUNTS

REPO = Path(__file__).resolve().parents[2]
VAE_PARAMS = 84_046_115  # AutoencoderKLFlux2 with diffusers' defaults (the released VAE)

# YAML -> (transformer count, Qwen3 size)
CASES = {"flux2_klein_4b": ("klein-4b", "4b"), "flux2_klein_9b": ("klein-9b", "8b")}


def _meta_count(module_class, config) -> int:
    with torch.device("meta"):
        module = module_class(config) if not isinstance(config, dict) else module_class(**config)
    return sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize("name", sorted(CASES))
def test_klein_yamls_count_like_diffusers(name):
    from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    family, configs = read_model_yaml(REPO / f"configs/models/{name}.yml")
    transformer_name, qwen_name = CASES[name]
    assert family.name == "flux2"
    assert configs["pipeline"].is_distilled  # the released [klein] models are step-distilled

    transformer = configs["transformer"]
    reference = _meta_count(Flux2Transformer2DModel, transformer.to_dict())
    assert f2.count_params(transformer) == reference == RELEASED_COUNTS[transformer_name]

    vae = configs["vae"]
    assert _meta_count(AutoencoderKLFlux2, vae.to_dict()) == VAE_PARAMS
    assert flux2_vae.count_params(vae) == VAE_PARAMS

    encoder = configs["text_encoder"]
    hf_config = Qwen3Config(**encoder.to_dict())
    assert qwen3.count_params(encoder) == _meta_count(Qwen3Model, hf_config)
    assert qwen3.count_params(encoder) == QWEN3_COUNTS[qwen_name][0]

    # 1024 x 1024 -> 64 x 64 tokens of 128 channels (32 latent channels, patchified 2x2)
    assert family.latent_shape(configs, 1024, 1024, 1) == (128, 64, 64)
    assert family.geometry(configs).spatial_multiple == 16
