"""LoRA weights in one canonical form: low-rank deltas of a denoiser's Linear layers, named by
their diffusers module path.

Every file format (diffusers/PEFT, kohya / sd-scripts, ComfyUI, AI-Toolkit, XLabs, ...) is
converted by its family's converter (``jaxcore/lora/<family>.py``) into a :class:`LoraWeights`:
``{diffusers module name: LoraLayer}`` where the module name is the denoiser's own diffusers
name without the pipeline prefix (``transformer_blocks.0.attn.to_q``, ``blocks.3.ffn.net.2``),
``down`` is ``[rank, in_features]`` (PEFT ``lora_A``, kohya ``lora_down``), ``up`` is
``[out_features, rank]`` (``lora_B`` / ``lora_up``) and ``scale`` is what the format multiplies
``up @ down`` by (kohya / PEFT: ``alpha / rank``; 1 when the file gives no alpha, as diffusers
loads such files). The delta of a torch ``Linear`` weight ``[out, in]`` is then
``scale * up @ down`` (:meth:`LoraLayer.delta`); merging it into our parameters goes through the
family's weight map (:mod:`jaxcore.lora.merge`).

Only ``.safetensors`` files are read (:func:`read_lora_file`): a pickle is refused with an error
naming the file.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from jaxcore import weights


class LoraError(weights.WeightsError):
    """A LoRA file that cannot be used; the message names the file and the key."""


@dataclasses.dataclass(frozen=True)
class LoraLayer:
    """One layer's low-rank update: ``delta = scale * up @ down`` in torch layout.

    A Linear's ``down`` is ``[rank, in_features]``; a convolution's (LoCon / PEFT ``Conv2d``
    LoRA: ``lora_A`` a ``k x k`` conv to ``rank`` channels, ``lora_B`` a 1x1 conv) is
    ``[rank, in_channels, kh, kw]``, and its delta ``[out, in, kh, kw]`` is
    ``sum_r up[o, r] * down[r, i, y, x]``, as PEFT merges it."""

    down: np.ndarray  # [rank, in_features] or [rank, in_channels, kh, kw]
    up: np.ndarray  # [out_features, rank]
    scale: float = 1.0

    def __post_init__(self):
        if self.down.ndim not in (2, 4) or self.up.ndim != 2:
            raise ValueError(
                f"LoRA up {self.up.shape} and down {self.down.shape} are not [out, r] and "
                "[r, in] (or [r, in, kh, kw])"
            )
        if self.up.shape[1] != self.down.shape[0]:
            raise ValueError(f"LoRA up {self.up.shape} and down {self.down.shape}: ranks differ")

    @property
    def rank(self) -> int:
        return int(self.down.shape[0])

    @property
    def torch_shape(self) -> tuple[int, ...]:
        """The shape of the torch weight the delta adds to: ``[out, in]`` or
        ``[out, in, kh, kw]``."""
        return (int(self.up.shape[0]), *(int(n) for n in self.down.shape[1:]))

    def delta(self) -> np.ndarray:
        """``scale * up @ down`` as float32 of :attr:`torch_shape`."""
        up = np.asarray(self.up, np.float32)
        down = np.asarray(self.down, np.float32).reshape(self.rank, -1)
        return ((np.float32(self.scale) * up) @ down).reshape(self.torch_shape)


LoraWeights = dict[str, LoraLayer]


def alpha_scale(alpha, rank: int) -> float:
    """kohya / PEFT scaling: ``alpha / rank``; no alpha means 1 (diffusers' default)."""
    if alpha is None:
        return 1.0
    value = float(np.asarray(alpha, np.float64).reshape(-1)[0])
    return value / rank


def conv_down_factor(key: str, value: np.ndarray, where: str) -> np.ndarray:
    """A convolution's down factor as ``[rank, in, kh, kw]`` (a 2-D one is a 1x1 conv's)."""
    value = np.asarray(value)
    if value.ndim == 2:
        value = value.reshape(*value.shape, 1, 1)
    if value.ndim != 4:
        raise LoraError(
            f"{where}: {key} has shape {list(value.shape)}, not a conv's [r, in, kh, kw]"
        )
    return value


def linear_factor(key: str, value: np.ndarray, where: str) -> np.ndarray:
    """A LoRA factor as a 2-D array; a Linear's factor saved as a 1x1 conv ([.., 1, 1]) is
    squeezed; anything else is a LoraError naming ``key`` and ``where``."""
    value = np.asarray(value)
    if value.ndim > 2 and all(n == 1 for n in value.shape[2:]):
        value = value.reshape(value.shape[:2])
    if value.ndim != 2:
        raise LoraError(f"{where}: {key} has shape {list(value.shape)}, not a Linear's [a, b]")
    return value


def split_part(key: str, parts: Mapping[str, str]) -> tuple[str, str] | None:
    """``<module>.<suffix>`` -> (module, the part ``parts[suffix]`` names: down / up / alpha
    ...), for the first suffix of ``parts`` the key ends with; None for none."""
    for suffix, part in parts.items():
        if key.endswith(f".{suffix}"):
            return key[: -len(suffix) - 1], part
    return None


def paired_layer(parts: Mapping[str, tuple[str, np.ndarray]], where: str) -> LoraLayer | None:
    """The LoRA of one Linear from its parts ``{"down" | "up" | "alpha": (key, value)}``: the
    factors as matrices, their ranks checked, the ``alpha / rank`` scale; None when it has no
    down / up pair (an alpha alone). A down without its up, or the other way, is a LoraError."""
    if ("down" in parts) != ("up" in parts):
        have, lack = ("down", "up") if "down" in parts else ("up", "down")
        peft_name = {"up": "lora_B", "down": "lora_A"}[lack]
        raise LoraError(f"{where}: {parts[have][0]} has no matching lora_{lack} / {peft_name}")
    if "down" not in parts:
        return None
    (down_key, down), (up_key, up) = parts["down"], parts["up"]
    down, up = linear_factor(down_key, down, where), linear_factor(up_key, up, where)
    if up.shape[1] != down.shape[0]:
        raise LoraError(
            f"{where}: rank mismatch: {down_key} is {list(down.shape)} (rank {down.shape[0]}) "
            f"but {up_key} is {list(up.shape)} (rank {up.shape[1]})"
        )
    alpha = None
    if "alpha" in parts:
        alpha_key, alpha = parts["alpha"]
        if np.size(alpha) != 1:
            raise LoraError(f"{where}: {alpha_key} has {np.size(alpha)} values, not one")
    return LoraLayer(down=down, up=up, scale=alpha_scale(alpha, down.shape[0]))


LORA_FILE_NAME = "pytorch_lora_weights.safetensors"  # what diffusers' load_lora_weights looks for


def resolve_lora_file(source: str) -> Path:
    """A local ``.safetensors`` file for a LoRA given as a file, a folder, ``gs://`` or a hub id.

    A folder (or a hub repository) must hold ``pytorch_lora_weights.safetensors`` or exactly
    one ``.safetensors`` file, as diffusers' ``load_lora_weights`` finds it; ``gs://`` objects
    are copied into the local cache; hub ids resolve from the local cache when offline.
    """
    from jaxcore import storage

    if storage.is_gcs(source):
        local = storage.local_copy(source)
    else:
        local = Path(source).expanduser()
        if not local.exists() and source.count("/") == 1 and not source.startswith((".", "/")):
            from huggingface_hub import snapshot_download

            try:
                local = Path(snapshot_download(source, allow_patterns=["*.safetensors"]))
            except Exception as err:  # offline and not cached, unknown repo, ...
                raise LoraError(
                    f"LoRA {source}: not a local path, and the Hugging Face snapshot could not "
                    f"be resolved ({type(err).__name__}: {err})"
                ) from None
    if local.is_dir():
        if (local / LORA_FILE_NAME).is_file():
            return local / LORA_FILE_NAME
        found = sorted(local.glob("*.safetensors"))
        if len(found) != 1:
            raise LoraError(
                f"LoRA {source}: the folder holds {len(found)} .safetensors files and no "
                f"{LORA_FILE_NAME}; name the file"
            )
        return found[0]
    return local


def file_sha256(path: str | os.PathLike) -> str:
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


METADATA_KEY = "lora_adapter_metadata"  # diffusers' save_lora_weights: the PEFT LoraConfig


def lora_metadata(path: str | os.PathLike, component: str) -> dict | None:
    """The PEFT ``LoraConfig`` diffusers stored for ``component`` in the file's header
    (``lora_adapter_metadata``: ``{"<component>.r": ..., "<component>.lora_alpha": ...}``), or
    None when the file carries none."""
    import json

    raw = weights.SafetensorsFile(path).metadata.get(METADATA_KEY)
    if not raw:
        return None
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as err:
        raise LoraError(f"{path}: malformed {METADATA_KEY} header: {err}") from None
    prefix = f"{component}."
    config = {k.removeprefix(prefix): v for k, v in data.items() if k.startswith(prefix)}
    return config or None


def _pattern_value(patterns: Mapping, module: str, default):
    r"""PEFT's rank_pattern / alpha_pattern lookup: the first key that matches the module's
    name or a dotted suffix of it (``re.match(rf"(.*\.)?({key})$", module)``)."""
    import re

    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def apply_peft_config(converted: Converted, config: Mapping, where: str) -> Converted:
    """Scales of a diffusers/PEFT file from its stored ``LoraConfig``: ``lora_alpha / r`` per
    module (``alpha_pattern`` / ``rank_pattern`` overrides; ``use_rslora``: ``/ sqrt(r)``),
    as PEFT computes them when diffusers loads the file."""
    layers = {}
    for module, layer in converted.layers.items():
        rank = _pattern_value(config.get("rank_pattern"), module, config.get("r", layer.rank))
        alpha = _pattern_value(config.get("alpha_pattern"), module, config.get("lora_alpha", rank))
        if int(rank) != layer.rank:
            raise LoraError(
                f"{where}: {module} has rank {layer.rank}, its stored LoRA config says {rank}"
            )
        denominator = float(np.sqrt(rank)) if config.get("use_rslora") else float(rank)
        layers[module] = dataclasses.replace(layer, scale=layer.scale * float(alpha) / denominator)
    return dataclasses.replace(converted, layers=layers)


def read_lora_file(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """All tensors of one ``.safetensors`` LoRA file (float arrays, bf16 read as float32)."""
    path = Path(path)
    if path.suffix in weights.PICKLE_SUFFIXES:
        raise LoraError(
            f"{path}: a pickle checkpoint; difforge loads LoRAs from .safetensors only, since "
            "unpickling can run arbitrary code"
        )
    if not path.is_file():
        raise LoraError(f"LoRA file {path} does not exist")
    try:
        file = weights.SafetensorsFile(path)
    except weights.WeightsError as err:
        raise LoraError(f"{path}: not a safetensors file ({err})") from None
    out = {}
    for key in file.keys():  # noqa: SIM118 (not a dict)
        value = np.asarray(file.get(key))
        out[key] = value.astype(np.float32) if value.dtype != np.float32 else value
    return out


@dataclasses.dataclass(frozen=True)
class Converted:
    """What a family's converter made of one file.

    ``layers``: the denoiser's LoRA layers by diffusers module name. ``unmatched``: the file's
    keys no rule placed (text-encoder LoRAs, unknown modules); the caller decides whether that
    is an error (``lora_strict``) or a warning. ``format``: the detected format's name.
    """

    layers: LoraWeights
    unmatched: tuple[str, ...]
    format: str


def unused_keys(used: set[str], state_dict: Mapping[str, np.ndarray]) -> tuple[str, ...]:
    """The keys of a file no converter rule read, sorted."""
    return tuple(sorted(set(state_dict) - used))
