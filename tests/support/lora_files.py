"""Random Flux LoRA state dicts in the key layouts of the formats :mod:`jaxcore.lora.flux`
reads, written as safetensors: test inputs for the converter and for diffusers' loader.

A LoRA is first a ``{module name: RandomLayer}`` in one vocabulary (diffusers, BFL or XLabs
module names); :func:`lora_keys` then writes it with a format's prefix and suffixes. The BFL and
XLabs layer shapes here are written from the original Flux code (black-forest-labs/flux
``model.py``/``layers.py``, XLabs-AI/x-flux ``layers.py``), independently of the converter.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path

import numpy as np

TIMESTEP_CHANNELS = 256


@dataclasses.dataclass(frozen=True)
class RandomLayer:
    down: np.ndarray  # [rank, in]
    up: np.ndarray  # [out, rank]
    alpha: float | None

    @property
    def scale(self) -> float:
        return 1.0 if self.alpha is None else self.alpha / self.down.shape[0]

    def delta(self) -> np.ndarray:
        """``alpha / rank * up @ down`` in float64."""
        return self.scale * (self.up.astype(np.float64) @ self.down.astype(np.float64))


def random_layers(
    shapes: Mapping[str, tuple[int, int]],
    seed: int,
    *,
    alphas: bool = True,
    max_rank: int = 7,
    std: float = 0.2,
) -> dict[str, RandomLayer]:
    """One random layer per ``{name: (out, in)}``, rank ``1 + i % max_rank`` (distinct ranks
    over neighbouring layers), alpha a distinct value in [1, 9) when ``alphas``."""
    rng = np.random.default_rng(seed)
    out = {}
    for i, (name, (rows, cols)) in enumerate(shapes.items()):
        rank = 1 + i % max_rank
        alpha = float(np.float32(1.0 + 8.0 * rng.random())) if alphas else None
        out[name] = RandomLayer(
            (std * rng.standard_normal((rank, cols))).astype(np.float32),
            (std * rng.standard_normal((rows, rank))).astype(np.float32),
            alpha,
        )
    return out


def random_layer(
    out: int, inp: int, rank: int, alpha: float | None, seed: int, std: float = 0.2
) -> RandomLayer:
    """One random ``[out, in]`` layer of the given rank and alpha."""
    rng = np.random.default_rng(seed)
    down = (std * rng.standard_normal((rank, inp))).astype(np.float32)
    return RandomLayer(down, (std * rng.standard_normal((out, rank))).astype(np.float32), alpha)


def block_sparse(layer: RandomLayer, rows: list[int]) -> RandomLayer:
    """``layer`` with ``up`` made block-diagonal over row parts ``rows`` (sd-scripts split_qkv:
    part i uses rank block i only); the rank must divide by ``len(rows)``."""
    n, rank = len(rows), layer.down.shape[0]
    assert rank % n == 0, (rank, n)
    r, up, start = rank // n, np.zeros_like(layer.up), 0
    for i, size in enumerate(rows):
        up[start : start + size, i * r : (i + 1) * r] = layer.up[
            start : start + size, i * r : (i + 1) * r
        ]
        start += size
    return dataclasses.replace(layer, up=up)


# (prefix, underscored names, down suffix, up suffix)
LAYOUTS = {
    "diffusers": ("transformer.", False, ".lora_A.weight", ".lora_B.weight"),
    "kohya": ("lora_unet_", True, ".lora_down.weight", ".lora_up.weight"),
    "comfyui": ("diffusion_model.", False, ".lora_down.weight", ".lora_up.weight"),
    "comfyui-peft": ("diffusion_model.", False, ".lora_A.weight", ".lora_B.weight"),
    "kohya-mixture": ("lora_transformer_", True, ".lora_down.weight", ".lora_up.weight"),
    "xlabs": ("", False, ".down.weight", ".up.weight"),
}


def lora_keys(
    layers: Mapping[str, RandomLayer],
    layout: str,
    *,
    prefix: str | None = None,
    suffixes: tuple[str, str] | None = None,
) -> dict[str, np.ndarray]:
    """The state dict of ``layers`` in ``layout`` (a key of :data:`LAYOUTS`); ``prefix`` /
    ``suffixes`` override the layout's. Alphas are written as ``<name>.alpha`` float32 scalars."""
    default_prefix, underscored, down, up = LAYOUTS[layout]
    prefix = default_prefix if prefix is None else prefix
    down, up = suffixes or (down, up)
    out = {}
    for name, layer in layers.items():
        stem = prefix + (name.replace(".", "_") if underscored else name)
        out[stem + down] = layer.down
        out[stem + up] = layer.up
        if layer.alpha is not None:
            out[stem + ".alpha"] = np.asarray(layer.alpha, np.float32)
    return out


def save_lora(path: str | Path, state_dict: Mapping[str, np.ndarray]) -> Path:
    from safetensors.numpy import save_file

    path = Path(path)
    save_file({k: np.ascontiguousarray(v) for k, v in state_dict.items()}, str(path))
    return path


def bfl_shapes(config) -> dict[str, tuple[int, int]]:
    """``{BFL module: (out, in)}`` of every Linear of the original Flux model for ``config``
    (a FluxTransformerConfig): ``Flux`` / ``DoubleStreamBlock`` / ``SingleStreamBlock``."""
    d, mlp = config.hidden_dim, config.mlp_dim
    shapes = {
        "img_in": (d, config.in_channels),
        "txt_in": (d, config.joint_attention_dim),
        "time_in.in_layer": (d, TIMESTEP_CHANNELS),
        "time_in.out_layer": (d, d),
        "vector_in.in_layer": (d, config.pooled_projection_dim),
        "vector_in.out_layer": (d, d),
    }
    if config.guidance_embeds:
        shapes["guidance_in.in_layer"] = (d, TIMESTEP_CHANNELS)
        shapes["guidance_in.out_layer"] = (d, d)
    for i in range(config.num_layers):
        for stream in ("img", "txt"):
            b = f"double_blocks.{i}.{stream}"
            shapes[f"{b}_mod.lin"] = (6 * d, d)
            shapes[f"{b}_attn.qkv"] = (3 * d, d)
            shapes[f"{b}_attn.proj"] = (d, d)
            shapes[f"{b}_mlp.0"] = (mlp, d)
            shapes[f"{b}_mlp.2"] = (d, mlp)
    for i in range(config.num_single_layers):
        b = f"single_blocks.{i}"
        shapes[f"{b}.linear1"] = (3 * d + mlp, d)
        shapes[f"{b}.linear2"] = (d, d + mlp)
        shapes[f"{b}.modulation.lin"] = (3 * d, d)
    shapes["final_layer.linear"] = (config.out_channels, d)
    shapes["final_layer.adaLN_modulation.1"] = (2 * d, d)
    return shapes


def xlabs_shapes(config) -> dict[str, tuple[int, int]]:
    """``{XLabs processor LoRA: (out, in)}``: x-flux ``DoubleStreamBlockLoraProcessor``
    (``qkv_lora1/2`` D -> 3D, ``proj_lora1/2`` D -> D) and ``SingleStreamBlockLoraProcessor``
    (``qkv_lora`` D -> 3D, ``proj_lora`` (D + mlp) -> D)."""
    d, mlp = config.hidden_dim, config.mlp_dim
    shapes = {}
    for i in range(config.num_layers):
        p = f"double_blocks.{i}.processor"
        for n in (1, 2):
            shapes[f"{p}.qkv_lora{n}"] = (3 * d, d)
            shapes[f"{p}.proj_lora{n}"] = (d, d)
    for i in range(config.num_single_layers):
        p = f"single_blocks.{i}.processor"
        shapes[f"{p}.qkv_lora"] = (3 * d, d)
        shapes[f"{p}.proj_lora"] = (d, d + mlp)
    return shapes
