"""Model YAMLs (``configs/models/*.yml``): one section per component, each validated by the
component's own config class (diffusers/transformers ``config.json`` field names)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jaxcore.config import ConfigError, read_yaml


def _section_classes() -> dict[str, Any]:
    from jaxcore.models.umt5 import UMT5Config
    from jaxcore.models.wan_transformer import WanTransformerConfig
    from jaxcore.models.wan_vae import WanVAEConfig

    return {"transformer": WanTransformerConfig, "vae": WanVAEConfig, "text_encoder": UMT5Config}


def load_model_yaml(path: str | Path, sections: tuple[str, ...] | None = None) -> dict[str, Any]:
    """{section: validated config} for the sections present (or only those asked for)."""
    data = read_yaml(path)
    classes = _section_classes()
    out = {}
    for name, values in data.items():
        if name not in classes:
            raise ConfigError(f"{path}: unknown section {name!r}; known: {sorted(classes)}")
        if sections is not None and name not in sections:
            continue
        try:
            out[name] = classes[name].from_dict(values or {})
        except (ValueError, TypeError, KeyError) as err:
            raise ConfigError(f"{path}: section {name}: {err}") from None
    return out
