"""Flux.1 LoRA files -> the canonical form of :mod:`jaxcore.lora.base`.

Reference: diffusers 0.42 ``FluxLoraLoaderMixin.lora_state_dict`` / ``load_lora_weights``
(loaders/lora_pipeline.py) and its converters ``_convert_kohya_flux_lora_to_diffusers`` and
``_convert_xlabs_flux_lora_to_diffusers`` (loaders/lora_conversion_utils.py).

Every key is read on its own: ``<prefix><module><suffix>``. The suffix gives the role
(``lora_A`` / ``lora_down`` / ``lora.down`` / ``lora_linear_layer.down`` = down, the ``B`` / ``up``
forms = up, ``alpha``), the module is looked up in three vocabularies built from the config:

- diffusers module names (``transformer_blocks.0.attn.to_q``), the vocabulary of diffusers /
  PEFT and AI-Toolkit files (``transformer.`` or ``diffusion_model.`` prefix, or none) and of
  kohya's "mixture" files (``lora_transformer_`` + the name with ``_`` for ``.``),
- the original BFL names (``double_blocks.0.img_attn.qkv``), the vocabulary of kohya /
  sd-scripts files (``lora_unet_`` + underscored name), ComfyUI files (``diffusion_model.`` +
  dotted name) and PEFT saves of the BFL model (``base_model.model.``),
- XLabs' attention-processor names (``double_blocks.0.processor.qkv_lora1`` + ``.down.weight``).

So a file that mixes formats converts whole, and the detected format is reported per prefix /
vocabulary (``Converted.format``: e.g. ``"kohya"``, ``"kohya+diffusers"``).

A BFL layer can feed several diffusers layers: the fused ``img_attn.qkv`` / ``txt_attn.qkv``
(q, k, v) and the single blocks' ``linear1`` (q, k, v, MLP in) have their ``up`` rows split at
the sizes of the config (``[D, D, D]``, ``[D, D, D, mlp_dim]``; diffusers hard-codes Flux.1's
3072 / 12288), every part keeping the whole ``down``; an ``up`` that is block-diagonal over the
parts (sd-scripts ``split_qkv``) is cut into its blocks instead, which is the same delta at a
smaller rank. ``final_layer.adaLN_modulation.1`` emits ``[shift, scale]`` where diffusers'
``norm_out.linear`` emits ``[scale, shift]``: its ``up`` halves are swapped.

Scale: ``alpha / rank`` from the file's ``<module>.alpha`` (the rank of the whole file layer,
also for the split parts), 1 without one; XLabs files carry no alpha (scale 1, as diffusers).

Keys no rule places (text-encoder LoRAs ``lora_te*_`` / ``text_encoder.``, T5 or CLIP keys of
ComfyUI files, ``diff`` / ``diff_b`` / ``dora_scale`` / LoKr / LoHa tensors, modules this
model does not have, an alpha without weights) go to ``Converted.unmatched``. A placed layer
that is malformed (down without up, ranks that differ, a shape that is not the model layer's,
fused rows that do not split at the config's sizes, two keys for one layer) is a
:class:`~jaxcore.lora.base.LoraError` naming ``where`` and the key.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping

import numpy as np

from jaxcore.lora.base import Converted, LoraError, LoraLayer, alpha_scale, unused_keys
from jaxcore.models.flux_transformer import TIMESTEP_CHANNELS, FluxTransformerConfig

DOWN, UP, ALPHA = "down", "up", "alpha"
DIFFUSERS, BFL, XLABS = "diffusers", "bfl", "xlabs"

# Longest first: ".lora.down.weight" must not be read as XLabs' bare ".down.weight".
_SUFFIXES = (
    (".lora_linear_layer.down.weight", DOWN),
    (".lora_linear_layer.up.weight", UP),
    (".lora.down.weight", DOWN),
    (".lora.up.weight", UP),
    (".lora_down.weight", DOWN),
    (".lora_up.weight", UP),
    (".lora_A.weight", DOWN),
    (".lora_B.weight", UP),
    (".alpha", ALPHA),
)
_XLABS_SUFFIXES = ((".down.weight", DOWN), (".up.weight", UP))  # XLabs processor keys only

# (key prefix, whether the module name is underscored, format name per vocabulary)
_PREFIXES = (
    ("lora_unet_", True, {BFL: "kohya", DIFFUSERS: "kohya"}),
    ("lora_transformer_", True, {DIFFUSERS: "kohya-mixture", BFL: "kohya-mixture"}),
    ("transformer.", False, {DIFFUSERS: "diffusers", BFL: "bfl", XLABS: "xlabs"}),
    ("diffusion_model.", False, {DIFFUSERS: "diffusers", BFL: "comfyui", XLABS: "xlabs"}),
    ("base_model.model.", False, {DIFFUSERS: "peft", BFL: "peft"}),
    ("", False, {DIFFUSERS: "diffusers", BFL: "bfl", XLABS: "xlabs"}),
)


@dataclasses.dataclass(frozen=True)
class Target:
    """Where one file layer goes: ``up`` rows ``rows[i]`` feed diffusers module ``modules[i]``
    (in order); ``in_features`` is the width every part's ``down`` reads."""

    modules: tuple[str, ...]
    rows: tuple[int, ...]
    in_features: int
    swap_halves: bool = False  # BFL [shift, scale] rows -> diffusers [scale, shift]


# ----------------------------------------------------------------------------------------------
# Vocabularies (built from the config)
# ----------------------------------------------------------------------------------------------


def linear_shapes(config: FluxTransformerConfig) -> dict[str, tuple[int, int]]:
    """``{diffusers module name: (out_features, in_features)}`` of every Linear layer of
    ``FluxTransformer2DModel`` with this config: the layers a LoRA can target."""
    d, mlp = config.hidden_dim, config.mlp_dim
    shapes = {
        "x_embedder": (d, config.in_channels),
        "context_embedder": (d, config.joint_attention_dim),
    }
    embedders = {"timestep_embedder": TIMESTEP_CHANNELS, "text_embedder": None}
    if config.guidance_embeds:
        embedders["guidance_embedder"] = TIMESTEP_CHANNELS
    for sub, width in embedders.items():
        width = width or config.pooled_projection_dim
        shapes[f"time_text_embed.{sub}.linear_1"] = (d, width)
        shapes[f"time_text_embed.{sub}.linear_2"] = (d, d)
    for i in range(config.num_layers):
        b = f"transformer_blocks.{i}"
        shapes[f"{b}.norm1.linear"] = (6 * d, d)
        shapes[f"{b}.norm1_context.linear"] = (6 * d, d)
        for proj in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj"):
            shapes[f"{b}.attn.{proj}"] = (d, d)
        shapes[f"{b}.attn.to_out.0"] = (d, d)
        shapes[f"{b}.attn.to_add_out"] = (d, d)
        for ff in ("ff", "ff_context"):
            shapes[f"{b}.{ff}.net.0.proj"] = (mlp, d)
            shapes[f"{b}.{ff}.net.2"] = (d, mlp)
    for i in range(config.num_single_layers):
        b = f"single_transformer_blocks.{i}"
        shapes[f"{b}.norm.linear"] = (3 * d, d)
        for proj in ("to_q", "to_k", "to_v"):
            shapes[f"{b}.attn.{proj}"] = (d, d)
        shapes[f"{b}.proj_mlp"] = (mlp, d)
        shapes[f"{b}.proj_out"] = (d, d + mlp)
    shapes["norm_out.linear"] = (2 * d, d)
    shapes["proj_out"] = (config.out_channels, d)
    return shapes


def _bfl_names(config: FluxTransformerConfig) -> dict[str, tuple[str, ...]]:
    """``{BFL module: diffusers modules its output rows feed, in order}``."""
    names = {
        "img_in": ("x_embedder",),
        "txt_in": ("context_embedder",),
        "time_in.in_layer": ("time_text_embed.timestep_embedder.linear_1",),
        "time_in.out_layer": ("time_text_embed.timestep_embedder.linear_2",),
        "vector_in.in_layer": ("time_text_embed.text_embedder.linear_1",),
        "vector_in.out_layer": ("time_text_embed.text_embedder.linear_2",),
    }
    if config.guidance_embeds:
        names["guidance_in.in_layer"] = ("time_text_embed.guidance_embedder.linear_1",)
        names["guidance_in.out_layer"] = ("time_text_embed.guidance_embedder.linear_2",)
    for i in range(config.num_layers):
        bfl, b = f"double_blocks.{i}", f"transformer_blocks.{i}"
        names[f"{bfl}.img_attn.qkv"] = tuple(f"{b}.attn.to_{p}" for p in "qkv")
        names[f"{bfl}.txt_attn.qkv"] = tuple(f"{b}.attn.add_{p}_proj" for p in "qkv")
        names[f"{bfl}.img_attn.proj"] = (f"{b}.attn.to_out.0",)
        names[f"{bfl}.txt_attn.proj"] = (f"{b}.attn.to_add_out",)
        for stream, ff, norm in (("img", "ff", "norm1"), ("txt", "ff_context", "norm1_context")):
            names[f"{bfl}.{stream}_mlp.0"] = (f"{b}.{ff}.net.0.proj",)
            names[f"{bfl}.{stream}_mlp.2"] = (f"{b}.{ff}.net.2",)
            names[f"{bfl}.{stream}_mod.lin"] = (f"{b}.{norm}.linear",)
    for i in range(config.num_single_layers):
        bfl, b = f"single_blocks.{i}", f"single_transformer_blocks.{i}"
        names[f"{bfl}.linear1"] = (*(f"{b}.attn.to_{p}" for p in "qkv"), f"{b}.proj_mlp")
        names[f"{bfl}.linear2"] = (f"{b}.proj_out",)
        names[f"{bfl}.modulation.lin"] = (f"{b}.norm.linear",)
    names["final_layer.linear"] = ("proj_out",)
    names["final_layer.adaLN_modulation.1"] = ("norm_out.linear",)
    return names


def _xlabs_names(config: FluxTransformerConfig) -> dict[str, tuple[str, ...]]:
    """XLabs' processor LoRAs (x-flux ``DoubleStreamBlockLoraProcessor`` / ``SingleStream...``):
    ``qkv_lora1/2`` = image / text q, k, v; ``proj_lora1/2`` = image / text attention output;
    single blocks: ``qkv_lora`` = q, k, v (not the MLP rows of ``linear1``), ``proj_lora`` =
    ``proj_out`` (diffusers' mapping)."""
    names = {}
    for i in range(config.num_layers):
        x, b = f"double_blocks.{i}.processor", f"transformer_blocks.{i}.attn"
        names[f"{x}.qkv_lora1"] = tuple(f"{b}.to_{p}" for p in "qkv")
        names[f"{x}.qkv_lora2"] = tuple(f"{b}.add_{p}_proj" for p in "qkv")
        names[f"{x}.proj_lora1"] = (f"{b}.to_out.0",)
        names[f"{x}.proj_lora2"] = (f"{b}.to_add_out",)
    for i in range(config.num_single_layers):
        x, b = f"single_blocks.{i}.processor", f"single_transformer_blocks.{i}"
        names[f"{x}.qkv_lora"] = tuple(f"{b}.attn.to_{p}" for p in "qkv")
        names[f"{x}.proj_lora"] = (f"{b}.proj_out",)
    return names


@dataclasses.dataclass(frozen=True)
class _Vocabulary:
    targets: dict[str, tuple[str, Target]]  # dotted module name -> (vocabulary, target)
    underscored: dict[str, str]  # name with "_" for "." -> dotted name


@functools.cache
def _vocabulary(config: FluxTransformerConfig) -> _Vocabulary:
    shapes = linear_shapes(config)
    targets: dict[str, tuple[str, Target]] = {}

    def add(vocab: str, name: str, modules: tuple[str, ...], swap: bool = False):
        ins = {shapes[m][1] for m in modules}
        assert len(ins) == 1 and name not in targets, (name, modules)
        rows = tuple(shapes[m][0] for m in modules)
        targets[name] = (vocab, Target(modules, rows, ins.pop(), swap))

    for name in shapes:
        add(DIFFUSERS, name, (name,))
    for name, modules in _bfl_names(config).items():
        add(BFL, name, modules, swap=name == "final_layer.adaLN_modulation.1")
    for name, modules in _xlabs_names(config).items():
        add(XLABS, name, modules)
    underscored = {name.replace(".", "_"): name for name in targets}
    assert len(underscored) == len(targets), "two module names differ only in '.' vs '_'"
    return _Vocabulary(targets, underscored)


def targets(config: FluxTransformerConfig) -> dict[str, Target]:
    """Every module name a Flux LoRA file may use (diffusers, BFL and XLabs vocabularies,
    dotted) and the diffusers layers it feeds."""
    return {name: target for name, (_, target) in _vocabulary(config).targets.items()}


# ----------------------------------------------------------------------------------------------
# Keys
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Key:
    module: str  # dotted name in its vocabulary
    vocab: str
    role: str  # DOWN, UP or ALPHA
    format: str


def _split_suffix(key: str) -> tuple[str, str, bool] | None:
    """``(stem, role, xlabs_only)`` or None when the key is no LoRA tensor we read."""
    for suffix, role in _SUFFIXES:
        if key.endswith(suffix):
            return key[: -len(suffix)], role, False
    for suffix, role in _XLABS_SUFFIXES:
        if key.endswith(suffix):
            return key[: -len(suffix)], role, True
    return None


def _parse_key(key: str, vocab: _Vocabulary) -> _Key | None:
    """Where ``key`` belongs, or None (unmatched)."""
    split = _split_suffix(key)
    if split is None:
        return None
    stem, role, xlabs_only = split
    for prefix, underscored, formats in _PREFIXES:
        if not stem.startswith(prefix):
            continue
        name = stem[len(prefix) :]
        if underscored:
            name = vocab.underscored.get(name.replace(".", "_"), "")
        found = vocab.targets.get(name)
        if found is None:
            continue
        kind = found[0]
        if (kind == XLABS) != xlabs_only or kind not in formats:
            continue
        return _Key(name, kind, role, formats[kind])
    return None


# ----------------------------------------------------------------------------------------------
# Conversion
# ----------------------------------------------------------------------------------------------


def _block_sparse_parts(down: np.ndarray, up: np.ndarray, rows: tuple[int, ...]):
    """``[(down_i, up_i)]`` when ``up`` is block-diagonal over the parts (rank split evenly,
    part i's rows use only rank block i; sd-scripts' split_qkv), else None."""
    n, rank = len(rows), down.shape[0]
    if n == 1 or rank % n:
        return None
    r = rank // n
    starts = np.cumsum((0, *rows))
    for i in range(n):
        block = up[starts[i] : starts[i + 1]]
        if np.any(block[:, : i * r]) or np.any(block[:, (i + 1) * r :]):
            return None
    return [
        (down[i * r : (i + 1) * r], up[starts[i] : starts[i + 1], i * r : (i + 1) * r])
        for i in range(n)
    ]


def _split_layer(down: np.ndarray, up: np.ndarray, target: Target) -> list[tuple[np.ndarray, ...]]:
    """The file layer's ``(down, up)`` per diffusers module of ``target``, in order."""
    if target.swap_halves:
        half = up.shape[0] // 2
        up = np.concatenate([up[half:], up[:half]])
    parts = _block_sparse_parts(down, up, target.rows)
    if parts is None:
        starts = np.cumsum((0, *target.rows))
        parts = [(down, up[starts[i] : starts[i + 1]]) for i in range(len(target.rows))]
    return [(np.ascontiguousarray(d), np.ascontiguousarray(u)) for d, u in parts]


def _check_pair(where: str, module: str, keys: dict[str, str], down, up, target: Target) -> None:
    down_key, up_key = keys[DOWN], keys[UP]
    if down.ndim != 2:
        raise LoraError(f"{where}: {down_key}: LoRA down has shape {down.shape}, not [rank, in]")
    if up.ndim != 2:
        raise LoraError(f"{where}: {up_key}: LoRA up has shape {up.shape}, not [out, rank]")
    if down.shape[0] != up.shape[1]:
        raise LoraError(
            f"{where}: {up_key}: up {up.shape} has rank {up.shape[1]} but {down_key} "
            f"{down.shape} has rank {down.shape[0]}"
        )
    if down.shape[1] != target.in_features:
        raise LoraError(
            f"{where}: {down_key}: down {down.shape} reads {down.shape[1]} features but "
            f"{module} of this model reads {target.in_features} (a LoRA for another model?)"
        )
    if up.shape[0] != sum(target.rows):
        what = (
            f"{sum(target.rows)} rows"
            if len(target.rows) == 1
            else f"{sum(target.rows)} rows split {list(target.rows)} into "
            f"{', '.join(target.modules)}"
        )
        raise LoraError(
            f"{where}: {up_key}: up {up.shape} has {up.shape[0]} rows but {module} of this "
            f"model needs {what} (a LoRA for another model?)"
        )


def to_diffusers(
    state_dict: Mapping[str, np.ndarray], config: FluxTransformerConfig, where: str
) -> Converted:
    """Convert a Flux LoRA state dict (any format of the module docstring) into
    ``{diffusers module name: LoraLayer}`` for the transformer of ``config``.

    ``where`` names the source (a file path) in errors. Keys no rule places are returned in
    ``unmatched``; a malformed layer raises :class:`LoraError` naming the key.
    """
    vocab = _vocabulary(config)
    groups: dict[str, dict[str, str]] = {}  # module (names are unique over vocabularies)
    formats: dict[str, str] = {}
    for key in state_dict:
        parsed = _parse_key(key, vocab)
        if parsed is None:
            continue
        roles = groups.setdefault(parsed.module, {})
        if parsed.role in roles:
            raise LoraError(
                f"{where}: {key} and {roles[parsed.role]} are both the LoRA {parsed.role} of "
                f"{parsed.module}"
            )
        roles[parsed.role] = key
        formats.setdefault(parsed.module, parsed.format)

    layers: dict[str, LoraLayer] = {}
    sources: dict[str, str] = {}  # diffusers module -> file key that set it
    used: set[str] = set()
    for module, keys in groups.items():
        if DOWN not in keys and UP not in keys:
            continue  # an alpha alone places nothing: unmatched
        for role, other in ((DOWN, UP), (UP, DOWN)):
            if role not in keys:
                raise LoraError(f"{where}: {keys[other]} has no LoRA {role} for {module}")
        target = vocab.targets[module][1]
        down = np.asarray(state_dict[keys[DOWN]])
        up = np.asarray(state_dict[keys[UP]])
        _check_pair(where, module, keys, down, up, target)
        alpha = None
        if ALPHA in keys:
            alpha = np.asarray(state_dict[keys[ALPHA]])
            if alpha.size != 1:
                raise LoraError(f"{where}: {keys[ALPHA]}: alpha has shape {alpha.shape}, not []")
        scale = alpha_scale(alpha, down.shape[0])
        for name, (d, u) in zip(target.modules, _split_layer(down, up, target), strict=True):
            if name in layers:
                raise LoraError(
                    f"{where}: {keys[DOWN]} and {sources[name]} are both LoRAs of {name}"
                )
            layers[name] = LoraLayer(d, u, scale)
            sources[name] = keys[DOWN]
        used.update(keys.values())

    placed = {formats[module] for module, keys in groups.items() if keys.keys() & {DOWN, UP}}
    return Converted(layers, unused_keys(used, state_dict), "+".join(sorted(placed)) or "none")
