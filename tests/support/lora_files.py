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


def flux2_bfl_shapes(config) -> dict[str, tuple[int, int]]:
    """``{BFL module: (out, in)}`` of every Linear of the original Flux.2 model for ``config``
    (a Flux2TransformerConfig), written from black-forest-labs/flux2 ``model.py``: bias-free
    embedders ``img_in`` / ``txt_in`` / ``time_in`` (/ ``guidance_in``), one shared modulation
    per block kind (``double_stream_modulation_img/txt.lin`` 6D, ``single_stream_modulation.lin``
    3D), double blocks with fused ``qkv`` and SwiGLU MLPs (``mlp.0`` D -> 2F), single blocks'
    ``linear1`` (D -> 3D + 2F) / ``linear2`` (D + F -> D), and the final layer."""
    d, f = config.hidden_dim, config.mlp_dim
    shapes = {
        "img_in": (d, config.in_channels),
        "txt_in": (d, config.joint_attention_dim),
        "time_in.in_layer": (d, config.timestep_guidance_channels),
        "time_in.out_layer": (d, d),
        "double_stream_modulation_img.lin": (6 * d, d),
        "double_stream_modulation_txt.lin": (6 * d, d),
        "single_stream_modulation.lin": (3 * d, d),
    }
    if config.guidance_embeds:
        shapes["guidance_in.in_layer"] = (d, config.timestep_guidance_channels)
        shapes["guidance_in.out_layer"] = (d, d)
    for i in range(config.num_layers):
        for stream in ("img", "txt"):
            b = f"double_blocks.{i}.{stream}"
            shapes[f"{b}_attn.qkv"] = (3 * d, d)
            shapes[f"{b}_attn.proj"] = (d, d)
            shapes[f"{b}_mlp.0"] = (2 * f, d)
            shapes[f"{b}_mlp.2"] = (d, f)
    for i in range(config.num_single_layers):
        shapes[f"single_blocks.{i}.linear1"] = (3 * d + 2 * f, d)
        shapes[f"single_blocks.{i}.linear2"] = (d, d + f)
    shapes["final_layer.linear"] = (config.proj_out_dim, d)
    shapes["final_layer.adaLN_modulation.1"] = (2 * d, d)
    return shapes


def swapped_halves(layer: RandomLayer) -> RandomLayer:
    """``layer`` with the two halves of ``up``'s rows exchanged ([shift, scale] <-> [scale,
    shift] of a modulation projection)."""
    half = layer.up.shape[0] // 2
    return dataclasses.replace(layer, up=np.concatenate([layer.up[half:], layer.up[:half]]))


@dataclasses.dataclass(frozen=True)
class RandomLokr:
    """One LoKr layer (LyCORIS / PEFT ``LoKrLayer``): ``w1`` or ``w1_a @ w1_b`` [l, m],
    ``w2`` or ``w2_a @ w2_b`` [k, n]; delta ``kron(w1, w2)`` of shape [l k, m n]."""

    factors: dict[str, np.ndarray]  # "lokr_w1", "lokr_w1_a", ... -> tensor
    alpha: float | None

    def matrix(self, name: str) -> np.ndarray:
        if f"lokr_{name}" in self.factors:
            return self.factors[f"lokr_{name}"].astype(np.float64)
        return self.factors[f"lokr_{name}_a"].astype(np.float64) @ self.factors[f"lokr_{name}_b"]

    @property
    def scale(self) -> float:
        """LyCORIS: ``alpha / rank`` of the decomposed factor (w2's first); 1 when both factors
        are full matrices or there is no alpha."""
        b = self.factors.get("lokr_w2_b", self.factors.get("lokr_w1_b"))
        return 1.0 if self.alpha is None or b is None else self.alpha / b.shape[0]

    def delta(self) -> np.ndarray:
        return self.scale * np.kron(self.matrix("w1"), self.matrix("w2"))


def random_lokr_layers(
    shapes: Mapping[str, tuple[int, int]],
    seed: int,
    *,
    rank: int = 2,
    alphas: bool = True,
    decompose_w1: bool = False,
    std: float = 0.3,
) -> dict[str, RandomLokr]:
    """One random LoKr layer per ``{name: (out, in)}``, factored as PEFT factors it
    (``factorization(dim, -1)``; ``w2`` decomposed at ``rank`` when ``rank < max(k, n) / 2``,
    ``w1`` full unless ``decompose_w1``), so that diffusers' inferred ``LoKrConfig`` rebuilds
    the same layer shapes."""
    from peft.tuners.lokr.layer import factorization

    rng = np.random.default_rng(seed)

    def normal(*shape):
        return (std * rng.standard_normal(shape)).astype(np.float32)

    out = {}
    for name, (rows, cols) in shapes.items():
        # PEFT's names: out = out_l x out_k, in = in_m x in_n; w1 [l, m], w2 [k, n]
        (out_l, out_k), (in_m, in_n) = factorization(rows, -1), factorization(cols, -1)
        factors = (
            {"lokr_w1_a": normal(out_l, rank), "lokr_w1_b": normal(rank, in_m)}
            if decompose_w1
            else {"lokr_w1": normal(out_l, in_m)}
        )
        if rank < max(out_k, in_n) / 2:
            factors |= {"lokr_w2_a": normal(out_k, rank), "lokr_w2_b": normal(rank, in_n)}
        else:
            factors["lokr_w2"] = normal(out_k, in_n)
        alpha = float(np.float32(1.0 + 4.0 * rng.random())) if alphas else None
        out[name] = RandomLokr(factors, alpha)
    return out


def lokr_keys(
    layers: Mapping[str, RandomLokr], prefix: str, *, underscored: bool = False
) -> dict[str, np.ndarray]:
    """``<prefix><name>.lokr_*`` (+ ``.alpha``) tensors of ``layers``."""
    out = {}
    for name, layer in layers.items():
        stem = prefix + (name.replace(".", "_") if underscored else name)
        for factor, value in layer.factors.items():
            out[f"{stem}.{factor}"] = value
        if layer.alpha is not None:
            out[f"{stem}.alpha"] = np.asarray(layer.alpha, np.float32)
    return out


def swapped_lokr_halves(layer: RandomLokr) -> RandomLokr:
    """``layer`` whose delta has its two row halves exchanged: the halves of ``w1``'s rows
    (``kron`` rows are ``w1`` row-major), which must be even in number."""
    key = "lokr_w1" if "lokr_w1" in layer.factors else "lokr_w1_a"
    w1 = layer.factors[key]
    half, odd = divmod(w1.shape[0], 2)
    assert not odd, f"{key} has an odd number of rows"
    swapped = np.concatenate([w1[half:], w1[:half]])
    return dataclasses.replace(layer, factors={**layer.factors, key: swapped})


# diffusers module -> original LTX-2 module, for the top-level modules the original model names
# otherwise (written from diffusers' single-file checkpoint converter,
# convert_ltx2_transformer_to_diffusers, read backwards; LTX-2.3's prompt modulations from its
# LoRA converter); everything else (blocks, caption and output projections) is named alike
LTX2_ORIGINAL_TOP_LEVEL = {
    "proj_in": "patchify_proj",
    "audio_proj_in": "audio_patchify_proj",
    "time_embed": "adaln_single",
    "audio_time_embed": "audio_adaln_single",
    "av_cross_attn_video_scale_shift": "av_ca_video_scale_shift_adaln_single",
    "av_cross_attn_audio_scale_shift": "av_ca_audio_scale_shift_adaln_single",
    "av_cross_attn_video_a2v_gate": "av_ca_a2v_gate_adaln_single",
    "av_cross_attn_audio_v2a_gate": "av_ca_v2a_gate_adaln_single",
    "prompt_adaln": "prompt_adaln_single",
    "audio_prompt_adaln": "audio_prompt_adaln_single",
}


def ltx2_original_name(name: str) -> str:
    """The original LTX-2 (LTX-2 trainer / ComfyUI) name of the diffusers module ``name`` of
    ``LTX2VideoTransformer3DModel``."""
    head, dot, rest = name.partition(".")
    return LTX2_ORIGINAL_TOP_LEVEL.get(head, head) + dot + rest


def folded_alpha(layer: RandomLayer) -> RandomLayer:
    """``layer`` with its ``alpha / rank`` scale folded into ``up`` and no alpha: the same
    delta as a file format without alphas carries it."""
    up = (layer.up * np.float32(layer.scale)).astype(np.float32)
    return RandomLayer(layer.down, up, None)
