"""Every YAML under configs/ loads and validates into its dataclass."""

from pathlib import Path

import pytest

from jaxcore.config import load_config, read_yaml
from pipelines.registry import STAGES, load_entry

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("stages/*.yml")), ids=lambda p: p.name)
def test_stage_configs(path):
    cls = load_entry(STAGES[path.stem].config_class)
    assert load_config(cls, path) is not None


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("pipelines/*.yml")), ids=lambda p: p.name)
def test_pipeline_configs(path):
    from pipelines.config import PipelineConfig, load_pipeline_spec

    cfg = load_config(PipelineConfig, path)
    load_pipeline_spec(cfg)  # every stage section validates against its stage's config


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("models/*.yml")), ids=lambda p: p.name)
def test_model_configs(path):
    from jaxcore.model_configs import read_model_yaml

    family, sections = read_model_yaml(path)
    assert family.denoiser_component in sections
    assert set(read_yaml(path)) == {"family", *sections}
    known = {**family.component_config_classes(), **family.optional_config_classes()}
    assert set(sections) <= set(known)


def test_there_are_configs():
    assert list(CONFIGS.glob("stages/*.yml")) and list(CONFIGS.glob("models/*.yml"))
