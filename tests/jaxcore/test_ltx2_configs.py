"""The LTX-2 model YAMLs (configs/models/ltx2_*.yml) build the released architecture: each
component, built by diffusers / transformers from the YAML's section on the meta device,
counts the parameters ours counts from abstract shapes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from jaxcore.model_configs import read_model_yaml
from jaxcore.models import gemma3, ltx2_audio_vae, ltx2_connectors, ltx2_transformer, ltx2_vae
from tests.jaxcore.test_gemma3 import GEMMA3_12B_TEXT_PARAMS
from tests.jaxcore.test_ltx2_connectors import REAL_COUNTS as CONNECTOR_COUNTS

REPO = Path(__file__).resolve().parents[2]
# diffusers' counts on the meta device of the released components
TRANSFORMER_19B = 18_876_174_592
VIDEO_VAE = 1_222_479_601  # without timestep conditioning, as converted
AUDIO_VAE = 53_248_146


def _meta_count(module_class, **config) -> int:
    with torch.device("meta"):
        module = module_class(**config)
    return sum(p.numel() for p in module.parameters())


# the distilled YAML holds the same sections (~15 s each: eval_shape of the 19B transformer)
@pytest.mark.parametrize(
    "name", ["ltx2_19b", pytest.param("ltx2_19b_distilled", marks=pytest.mark.slow)]
)
def test_yamls_count_like_diffusers(name):
    from diffusers import AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video
    from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors

    family, configs = read_model_yaml(REPO / f"configs/models/{name}.yml")
    assert family.name == "ltx2"
    transformer = configs["transformer"]
    assert ltx2_transformer.count_params(transformer) == TRANSFORMER_19B
    vae = configs["vae"]
    assert _meta_count(AutoencoderKLLTX2Video, **vae.to_dict()) == VIDEO_VAE
    assert ltx2_vae.count_params(vae) == VIDEO_VAE
    audio = configs["audio_vae"]
    assert _meta_count(AutoencoderKLLTX2Audio, **audio.to_dict()) == AUDIO_VAE
    assert ltx2_audio_vae.count_params(audio) == AUDIO_VAE
    connectors = configs["connectors"]
    assert _meta_count(LTX2TextConnectors, **connectors.to_dict()) == CONNECTOR_COUNTS["ltx20"]
    assert ltx2_connectors.count_params(connectors) == CONNECTOR_COUNTS["ltx20"]
    assert gemma3.count_params(configs["text_encoder"]) == GEMMA3_12B_TEXT_PARAMS
    # 121 frames of 512 x 768 -> 16 x 24 latents of 16 frames
    assert family.latent_shape(configs, 512, 768, 121)[1:] == (16, 16, 24)


def test_the_transformer_section_counts_like_diffusers():
    from diffusers import LTX2VideoTransformer3DModel

    _, configs = read_model_yaml(REPO / "configs/models/ltx2_19b.yml")
    reference = _meta_count(LTX2VideoTransformer3DModel, **configs["transformer"].to_dict())
    assert reference == TRANSFORMER_19B
