"""Model YAMLs (``configs/models/*.yml``): a ``family`` and one section per component.

::

    family: wan                 # a name of jaxcore.families.FAMILIES
    transformer: {...}          # each section in the component's config.json field names,
    vae: {...}                  # validated by the family's config class for that component
    text_encoder: {...}
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jaxcore.config import ConfigError, read_yaml


def read_model_yaml(path: str | Path, sections: tuple[str, ...] | None = None):
    """(family, {section: validated config}) for the sections present (or those asked for)."""
    from jaxcore import families

    data = dict(read_yaml(path))
    name = data.pop("family", None)
    if name is None:
        raise ConfigError(
            f"{path}: no 'family' key (one of {sorted(families.FAMILIES)}) naming the model family"
        )
    try:
        family = families.get(name)
    except families.FamilyError as err:
        raise ConfigError(f"{path}: {err}") from None
    classes = {**family.component_config_classes(), **family.optional_config_classes()}
    out = {}
    for section, values in data.items():
        if section not in classes:
            raise ConfigError(
                f"{path}: unknown section {section!r} for the {name} family; known: {sorted(classes)}"
            )
        if sections is not None and section not in sections:
            continue
        try:
            out[section] = classes[section].from_dict(values or {})
        except (ValueError, TypeError, KeyError) as err:
            raise ConfigError(f"{path}: section {section}: {err}") from None
    if sections is None:
        try:
            family.check_configs(out, str(path))
        except families.FamilyError as err:
            raise ConfigError(str(err)) from None
    return family, out


def load_model_yaml(path: str | Path, sections: tuple[str, ...] | None = None) -> dict[str, Any]:
    """{section: validated config} of a model YAML (see :func:`read_model_yaml`)."""
    return read_model_yaml(path, sections)[1]
