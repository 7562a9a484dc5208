"""Random Wan LoRA files in the layouts ``jaxcore.lora.wan`` reads (diffusers/PEFT, ComfyUI /
original Wan names, musubi-tuner), written from one set of per-module factors so that every
layout can be compared with diffusers' loader and with the others.

The diffusers -> original Wan name rules are written out here on their own (not imported from
the code under test), from Wan's ``WanModel`` attribute names.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np

from jaxcore import weights

_ORIGINAL = [  # (diffusers module pattern, original Wan name)
    (r"blocks\.(\d+)\.attn1\.to_q", r"blocks.\1.self_attn.q"),
    (r"blocks\.(\d+)\.attn1\.to_k", r"blocks.\1.self_attn.k"),
    (r"blocks\.(\d+)\.attn1\.to_v", r"blocks.\1.self_attn.v"),
    (r"blocks\.(\d+)\.attn1\.to_out\.0", r"blocks.\1.self_attn.o"),
    (r"blocks\.(\d+)\.attn2\.to_q", r"blocks.\1.cross_attn.q"),
    (r"blocks\.(\d+)\.attn2\.to_k", r"blocks.\1.cross_attn.k"),
    (r"blocks\.(\d+)\.attn2\.to_v", r"blocks.\1.cross_attn.v"),
    (r"blocks\.(\d+)\.attn2\.to_out\.0", r"blocks.\1.cross_attn.o"),
    (r"blocks\.(\d+)\.ffn\.net\.0\.proj", r"blocks.\1.ffn.0"),
    (r"blocks\.(\d+)\.ffn\.net\.2", r"blocks.\1.ffn.2"),
    (r"condition_embedder\.text_embedder\.linear_1", "text_embedding.0"),
    (r"condition_embedder\.text_embedder\.linear_2", "text_embedding.2"),
    (r"condition_embedder\.time_embedder\.linear_1", "time_embedding.0"),
    (r"condition_embedder\.time_embedder\.linear_2", "time_embedding.2"),
    (r"condition_embedder\.time_proj", "time_projection.1"),
    (r"proj_out", "head.head"),
]


def original_name(module: str) -> str:
    """The original Wan (ComfyUI) name of a diffusers Linear module of WanTransformer3DModel."""
    for pattern, replacement in _ORIGINAL:
        if re.fullmatch(pattern, module):
            return re.sub(pattern, replacement, module)
    raise KeyError(module)


def is_block_module(module: str) -> bool:
    return module.startswith("blocks.")


@dataclasses.dataclass(frozen=True)
class Factors:
    """One module's random LoRA: down [r, in], up [out, r], alpha (None: none in the file)."""

    down: np.ndarray
    up: np.ndarray
    alpha: float | None

    @property
    def scale(self) -> float:
        return 1.0 if self.alpha is None else self.alpha / self.down.shape[0]


def linear_shapes(pipeline_dir: Path) -> dict[str, tuple[int, int]]:
    """{diffusers module: (out, in)} of every Linear of a pipeline's transformer."""
    file = weights.SafetensorsFile(pipeline_dir / "transformer/diffusion_pytorch_model.safetensors")
    shapes, keys = {}, file.keys()
    for key in keys:
        value = file.get(key)
        if key.endswith(".weight") and value.ndim == 2:
            shapes[key.removesuffix(".weight")] = tuple(value.shape)
    return shapes


def random_factors(
    shapes: Mapping[str, tuple[int, int]],
    seed: int,
    *,
    alphas: str = "none",
    modules: Iterable[str] | None = None,
) -> dict[str, Factors]:
    """Random factors with ranks 1..5 varying by module; ``alphas``: "none", "blocks" (on block
    layers only) or "all"."""
    rng = np.random.default_rng(seed)
    out = {}
    for i, module in enumerate(sorted(modules if modules is not None else shapes)):
        out_features, in_features = shapes[module]
        rank = 1 + (i * 3 + seed) % 5
        with_alpha = alphas == "all" or (alphas == "blocks" and is_block_module(module))
        out[module] = Factors(
            down=(0.3 * rng.standard_normal((rank, in_features))).astype(np.float32),
            up=(0.3 * rng.standard_normal((out_features, rank))).astype(np.float32),
            alpha=float(rng.integers(1, 9)) if with_alpha else None,
        )
    return out


def diffusers_tensors(
    factors: Mapping[str, Factors], prefix: str = "transformer."
) -> dict[str, np.ndarray]:
    """``transformer.<module>.lora_A/lora_B.weight`` (+ ``.alpha``)."""
    tensors = {}
    for module, f in factors.items():
        tensors[f"{prefix}{module}.lora_A.weight"] = f.down
        tensors[f"{prefix}{module}.lora_B.weight"] = f.up
        if f.alpha is not None:
            tensors[f"{prefix}{module}.alpha"] = np.float32(f.alpha)
    return tensors


def comfyui_tensors(
    factors: Mapping[str, Factors], naming: tuple[str, str] = ("lora_down", "lora_up")
) -> dict[str, np.ndarray]:
    """``diffusion_model.<original>.lora_down/lora_up.weight`` (or lora_A/lora_B) + ``.alpha``."""
    down, up = naming
    tensors = {}
    for module, f in factors.items():
        name = f"diffusion_model.{original_name(module)}"
        tensors[f"{name}.{down}.weight"] = f.down
        tensors[f"{name}.{up}.weight"] = f.up
        if f.alpha is not None:
            tensors[f"{name}.alpha"] = np.float32(f.alpha)
    return tensors


def musubi_tensors(factors: Mapping[str, Factors]) -> dict[str, np.ndarray]:
    """``lora_unet_<original with _ for .>.lora_down/lora_up.weight`` + ``.alpha``."""
    tensors = {}
    for module, f in factors.items():
        name = "lora_unet_" + original_name(module).replace(".", "_")
        tensors[f"{name}.lora_down.weight"] = f.down
        tensors[f"{name}.lora_up.weight"] = f.up
        if f.alpha is not None:
            tensors[f"{name}.alpha"] = np.float32(f.alpha)
    return tensors


def save(tensors: Mapping[str, np.ndarray], path: Path) -> Path:
    """Write ``tensors`` as a safetensors file (0-d alphas as the 0-d tensors kohya writes)."""
    weights.save_safetensors({k: np.asarray(v) for k, v in tensors.items()}, path)
    return path
