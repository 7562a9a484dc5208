"""Flux.2 (dev, [klein]) LoRA and LoKr files -> the canonical form of :mod:`jaxcore.lora.base`.

Reference: diffusers 0.42 ``Flux2LoraLoaderMixin.lora_state_dict`` (loaders/lora_pipeline.py),
its converters ``_convert_non_diffusers_flux2_lora_to_diffusers``,
``_convert_kohya_flux2_lora_to_diffusers``, ``_convert_non_diffusers_flux2_lokr_to_diffusers``,
``_convert_lycoris_flux2_lokr_to_diffusers``, ``_convert_non_diffusers_lokr_to_diffusers``
(loaders/lora_conversion_utils.py) and PEFT's ``LoKrLayer``. Each key is read on its own as
``<prefix><module><suffix>``; the prefix says which module names and suffixes the format uses:

- ``transformer.`` + diffusers module names, ``lora_A`` / ``lora_B`` or LoKr factors
  (``diffusers``): what ``Flux2KleinPipeline.save_lora_weights`` and difforge's LoRA training
  write;
- ``diffusion_model.`` + the original BFL names (``double_blocks.0.img_attn.qkv``,
  ``single_blocks.0.linear1``, ``double_stream_modulation_img.lin``, ...) or diffusers block
  names (``transformer_blocks.*``, ``single_transformer_blocks.*``, and the ``sformer_blocks.*``
  alias some exports write), ``lora_A`` / ``lora_B``, ``lora_down`` / ``lora_up`` or LoKr
  factors (``ai-toolkit``: AI-Toolkit, ComfyUI);
- ``base_model.model.`` + the same names (``peft``: a PEFT save; diffusers reads it as
  ``diffusion_model.``);
- ``lora_unet_`` + the BFL names with ``_`` for ``.``, ``lora_down`` / ``lora_up``
  (``kohya``: sd-scripts / musubi-tuner);
- LoKr only: ``lycoris_`` + diffusers block names with ``_`` for ``.`` (``lycoris``), and
  diffusers names with no prefix (``bare``: SimpleTuner).

A LoKr layer (``lokr_w1`` or ``lokr_w1_a @ lokr_w1_b``, ``lokr_w2`` or ``lokr_w2_a @
lokr_w2_b``; delta ``kron(w1, w2)``) is a LoRA exactly: with ``w1 = P1 Q1`` and ``w2 = P2 Q2``
(a full factor as the identity times itself on its smaller side), ``kron(w1, w2) =
kron(P1, P2) @ kron(Q1, Q2)``, of rank ``rank(P1) x rank(P2)``.

A BFL layer can feed several diffusers layers: a double block's fused ``img_attn.qkv`` /
``txt_attn.qkv`` has its ``up`` rows split into q, k, v (``[D, D, D]``), each part keeping the
whole ``down``, or cut into its rank blocks when ``up`` is block-diagonal (sd-scripts
``split_qkv``: the same delta at a smaller rank). For a LoKr qkv this is the row split of the
Kronecker delta that diffusers applies to the fused ``to_qkv`` it makes for it. The single
blocks' ``linear1`` / ``linear2`` are diffusers' fused ``attn.to_qkv_mlp_proj`` /
``attn.to_out`` as they are.

Scale: LoRA ``alpha / rank`` from ``<module>.alpha`` (the whole file layer's rank, also for the
split parts), 1 without one; LoKr (LyCORIS, as diffusers bakes it in) ``alpha / rank`` with
the rank of the decomposed factor (``w2``'s, else ``w1``'s), 1 when both are full matrices. A
diffusers-saved file's ``lora_adapter_metadata`` (PEFT ``lora_alpha``, ``rank_pattern``, ...)
is applied by :func:`jaxcore.lora.merge.load_lora` (LoRA configs only: a LoKr file saved with
its PEFT ``LoKrConfig`` fails there with a rank mismatch naming the module).

Where this module differs from diffusers, and why:

- ``final_layer.adaLN_modulation.1`` emits BFL's ``[shift, scale]`` while diffusers'
  ``norm_out.linear`` emits ``[scale, shift]``: its ``up`` halves are swapped, as diffusers'
  own Flux.2 checkpoint converter swaps the weight (``convert_flux2_transformer_checkpoint_to_
  diffusers``); diffusers' LoRA / LoKr converters do not, so their delta lands on the wrong
  halves;
- alphas are applied in every format (diffusers refuses an ``.alpha`` key beside
  ``lora_A`` / ``lora_B`` weights or ``transformer.`` LoKr factors, and ``lora_state_dict``
  never reaches its ``diffusion_model.`` converter for ``lora_down`` / ``lora_up`` keys: any
  ``.lora_down.weight`` key sends the whole file to the kohya converter, which drops every key
  not under ``lora_unet_``);
- kohya files may name every BFL layer (diffusers' kohya converter drops the modulations,
  ``guidance_in`` and ``final_layer.adaLN_modulation.1`` with a warning); LoKr files under
  ``diffusion_model.`` may name diffusers blocks as LoRA files may;
- each key is placed on its own, so a file may mix layouts (diffusers picks one per file).

Keys no rule places (text-encoder LoRAs, modules this model does not have, diffusers names that
are no block under ``diffusion_model.``, LoRA pairs without a prefix, ``dora_scale`` / bias
deltas, a LoKr conv core ``lokr_t2``, an alpha without weights) go to ``Converted.unmatched``:
:class:`jaxcore.lora.merge.LoraMerger` refuses them by name (``lora_strict``). A placed layer
that is malformed (down without up, ranks that differ, LoKr factors missing or of the wrong
shape, a shape that is not the model layer's, two keys for one layer) is a
:class:`~jaxcore.lora.base.LoraError` naming ``where`` and the key.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping

import numpy as np

from jaxcore.lora.base import Converted, LoraError, LoraLayer, alpha_scale, unused_keys
from jaxcore.lora.flux import Target, _check_pair, _split_layer
from jaxcore.models.flux2_transformer import Flux2TransformerConfig

DIFFUSERS, BFL = "diffusers", "bfl"  # the two vocabularies of module names
DOWN, UP, ALPHA = "down", "up", "alpha"
W1, W2 = "lokr_w1", "lokr_w2"  # LoKr factors: each full, or as "<factor>_a" @ "<factor>_b"

_LORA = {".lora_A.weight": DOWN, ".lora_B.weight": UP}
_KOHYA = {".lora_down.weight": DOWN, ".lora_up.weight": UP}
_LOKR = {f".{w}{part}": f"{w}{part}" for w in (W1, W2) for part in ("", "_a", "_b")}
_ALPHA = {".alpha": ALPHA}
# diffusers block names a diffusion_model. file may use instead of BFL ones, with the alias
# some exports write (diffusers' _convert_non_diffusers_flux2_lora_to_diffusers)
_BLOCK_PREFIXES = {
    "single_transformer_blocks.": "single_transformer_blocks.",
    "transformer_blocks.": "transformer_blocks.",
    "sformer_blocks.": "transformer_blocks.",
}

# the module names a layout uses
DIFFUSERS_NAMES = "diffusers"  # dotted diffusers names
ORIGINAL_NAMES = "original"  # dotted BFL names, or diffusers block names
KOHYA_NAMES = "kohya"  # BFL names with "_" for "."
LYCORIS_NAMES = "lycoris"  # diffusers block names with "_" for "."


@dataclasses.dataclass(frozen=True)
class _Layout:
    """One key prefix: the suffixes (-> roles) it uses, the names it uses, its format name."""

    prefix: str
    suffixes: Mapping[str, str]
    names: str
    format: str


# The first layout whose prefix a key starts with reads it ("" last: bare LoKr keys only).
_LAYOUTS = (
    _Layout("transformer.", _LORA | _LOKR | _ALPHA, DIFFUSERS_NAMES, "diffusers"),
    _Layout("diffusion_model.", _LORA | _KOHYA | _LOKR | _ALPHA, ORIGINAL_NAMES, "ai-toolkit"),
    _Layout("base_model.model.", _LORA | _KOHYA | _LOKR | _ALPHA, ORIGINAL_NAMES, "peft"),
    _Layout("lora_unet_", _KOHYA | _ALPHA, KOHYA_NAMES, "kohya"),
    _Layout("lycoris_", _LOKR | _ALPHA, LYCORIS_NAMES, "lycoris"),
    _Layout("", _LOKR | _ALPHA, DIFFUSERS_NAMES, "bare"),
)


# ----------------------------------------------------------------------------------------------
# Vocabularies (built from the config)
# ----------------------------------------------------------------------------------------------


def linear_shapes(config: Flux2TransformerConfig) -> dict[str, tuple[int, int]]:
    """``{diffusers module name: (out_features, in_features)}`` of every Linear layer of
    ``Flux2Transformer2DModel`` with this config: the layers a LoRA can target."""
    d, mlp = config.hidden_dim, config.mlp_dim
    shapes = {
        "x_embedder": (d, config.in_channels),
        "context_embedder": (d, config.joint_attention_dim),
        "double_stream_modulation_img.linear": (6 * d, d),
        "double_stream_modulation_txt.linear": (6 * d, d),
        "single_stream_modulation.linear": (3 * d, d),
    }
    embedders = ["timestep_embedder"] + (["guidance_embedder"] if config.guidance_embeds else [])
    for sub in embedders:
        shapes[f"time_guidance_embed.{sub}.linear_1"] = (d, config.timestep_guidance_channels)
        shapes[f"time_guidance_embed.{sub}.linear_2"] = (d, d)
    for i in range(config.num_layers):
        attn = f"transformer_blocks.{i}.attn"
        for proj in ("to_q", "to_k", "to_v", "to_out.0"):
            shapes[f"{attn}.{proj}"] = (d, d)
        for proj in ("add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"):
            shapes[f"{attn}.{proj}"] = (d, d)
        for ff in ("ff", "ff_context"):
            shapes[f"transformer_blocks.{i}.{ff}.linear_in"] = (2 * mlp, d)  # SwiGLU gate, value
            shapes[f"transformer_blocks.{i}.{ff}.linear_out"] = (d, mlp)
    for i in range(config.num_single_layers):
        attn = f"single_transformer_blocks.{i}.attn"
        shapes[f"{attn}.to_qkv_mlp_proj"] = (3 * d + 2 * mlp, d)
        shapes[f"{attn}.to_out"] = (d, d + mlp)
    shapes["norm_out.linear"] = (2 * d, d)
    shapes["proj_out"] = (config.proj_out_dim, d)
    return shapes


def bfl_names(config: Flux2TransformerConfig) -> dict[str, tuple[str, ...]]:
    """``{BFL module: the diffusers modules its output rows feed, in order}`` (the original
    Flux.2 model's names, as diffusers' converters map them)."""
    names = {
        "img_in": ("x_embedder",),
        "txt_in": ("context_embedder",),
        "time_in.in_layer": ("time_guidance_embed.timestep_embedder.linear_1",),
        "time_in.out_layer": ("time_guidance_embed.timestep_embedder.linear_2",),
        "double_stream_modulation_img.lin": ("double_stream_modulation_img.linear",),
        "double_stream_modulation_txt.lin": ("double_stream_modulation_txt.linear",),
        "single_stream_modulation.lin": ("single_stream_modulation.linear",),
        "final_layer.linear": ("proj_out",),
        "final_layer.adaLN_modulation.1": ("norm_out.linear",),
    }
    if config.guidance_embeds:
        names["guidance_in.in_layer"] = ("time_guidance_embed.guidance_embedder.linear_1",)
        names["guidance_in.out_layer"] = ("time_guidance_embed.guidance_embedder.linear_2",)
    for i in range(config.num_layers):
        bfl, b = f"double_blocks.{i}", f"transformer_blocks.{i}"
        names[f"{bfl}.img_attn.qkv"] = tuple(f"{b}.attn.to_{p}" for p in "qkv")
        names[f"{bfl}.txt_attn.qkv"] = tuple(f"{b}.attn.add_{p}_proj" for p in "qkv")
        names[f"{bfl}.img_attn.proj"] = (f"{b}.attn.to_out.0",)
        names[f"{bfl}.txt_attn.proj"] = (f"{b}.attn.to_add_out",)
        for stream, ff in (("img", "ff"), ("txt", "ff_context")):
            names[f"{bfl}.{stream}_mlp.0"] = (f"{b}.{ff}.linear_in",)
            names[f"{bfl}.{stream}_mlp.2"] = (f"{b}.{ff}.linear_out",)
    for i in range(config.num_single_layers):
        bfl, attn = f"single_blocks.{i}", f"single_transformer_blocks.{i}.attn"
        names[f"{bfl}.linear1"] = (f"{attn}.to_qkv_mlp_proj",)
        names[f"{bfl}.linear2"] = (f"{attn}.to_out",)
    return names


@dataclasses.dataclass(frozen=True)
class _Vocabulary:
    targets: dict[str, dict[str, Target]]  # DIFFUSERS / BFL -> dotted module name -> target
    underscored_bfl: dict[str, str]  # BFL name with "_" for "." -> dotted name
    underscored_diffusers: dict[str, str]  # diffusers name with "_" for "." -> dotted name


@functools.cache
def _vocabulary(config: Flux2TransformerConfig) -> _Vocabulary:
    shapes = linear_shapes(config)

    def target(modules: tuple[str, ...], swap: bool = False) -> Target:
        ins = {shapes[m][1] for m in modules}
        assert len(ins) == 1, modules
        return Target(modules, tuple(shapes[m][0] for m in modules), ins.pop(), swap)

    diffusers = {name: target((name,)) for name in shapes}
    bfl = {
        name: target(modules, swap=name == "final_layer.adaLN_modulation.1")
        for name, modules in bfl_names(config).items()
    }
    underscored = [{name.replace(".", "_"): name for name in names} for names in (bfl, diffusers)]
    assert list(map(len, underscored)) == [len(bfl), len(diffusers)], "'.' vs '_' clash"
    return _Vocabulary({DIFFUSERS: diffusers, BFL: bfl}, *underscored)


def targets(config: Flux2TransformerConfig) -> dict[str, Target]:
    """Every module name a Flux.2 LoRA file may use (diffusers and BFL vocabularies, dotted)
    and the diffusers layers it feeds."""
    vocab = _vocabulary(config)
    return {**vocab.targets[DIFFUSERS], **vocab.targets[BFL]}


# ----------------------------------------------------------------------------------------------
# Keys
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Key:
    stem: str  # the key without its suffix: one file layer
    target: Target
    role: str  # DOWN, UP, ALPHA or a LoKr factor (lokr_w1, lokr_w2_a, ...)
    format: str


def _is_block(name: str) -> bool:
    return name.startswith(("transformer_blocks.", "single_transformer_blocks."))


def _target(layout: _Layout, name: str, vocab: _Vocabulary) -> Target | None:
    """The target ``name`` means under ``layout``, or None."""
    diffusers, bfl = vocab.targets[DIFFUSERS], vocab.targets[BFL]
    if layout.names == KOHYA_NAMES:
        return bfl.get(vocab.underscored_bfl.get(name, ""))
    if layout.names == LYCORIS_NAMES:
        dotted = vocab.underscored_diffusers.get(name, "")
        return diffusers.get(dotted) if _is_block(dotted) else None
    if layout.names == DIFFUSERS_NAMES:
        return diffusers.get(name)
    if name in bfl:
        return bfl[name]
    for source, replacement in _BLOCK_PREFIXES.items():
        if name.startswith(source):
            return diffusers.get(replacement + name[len(source) :])
    return None


def _parse_key(key: str, vocab: _Vocabulary) -> _Key | None:
    """Where ``key`` belongs, or None (unmatched)."""
    layout = next(layout for layout in _LAYOUTS if key.startswith(layout.prefix))
    for suffix, role in layout.suffixes.items():
        if key.endswith(suffix):
            stem = key[: -len(suffix)]
            target = _target(layout, stem[len(layout.prefix) :], vocab)
            return None if target is None else _Key(stem, target, role, layout.format)
    return None


# ----------------------------------------------------------------------------------------------
# Conversion
# ----------------------------------------------------------------------------------------------


def _group(state_dict: Mapping[str, np.ndarray], vocab: _Vocabulary, where: str):
    """``{stem: (target, format, {role: key})}`` of every key a rule places."""
    groups: dict[str, tuple[Target, str, dict[str, str]]] = {}
    for key in state_dict:
        parsed = _parse_key(key, vocab)
        if parsed is None:
            continue
        _, _, roles = groups.setdefault(parsed.stem, (parsed.target, parsed.format, {}))
        if parsed.role in roles:  # the same stem under two suffixes (lora_A and lora_down)
            raise LoraError(
                f"{where}: {key} and {roles[parsed.role]} are both the LoRA {parsed.role} of "
                f"{parsed.stem}"
            )
        roles[parsed.role] = key
    return groups


def _alpha(state_dict: Mapping[str, np.ndarray], keys: Mapping[str, str], where: str):
    if ALPHA not in keys:
        return None
    alpha = np.asarray(state_dict[keys[ALPHA]])
    if alpha.size != 1:
        raise LoraError(f"{where}: {keys[ALPHA]}: alpha has shape {alpha.shape}, not []")
    return alpha


def _lora_pair(state_dict, stem: str, keys: Mapping[str, str], target: Target, where: str):
    """(down, up, scale) of a lora_A/B or lora_down/up pair, checked against ``target``."""
    for role, other in ((DOWN, UP), (UP, DOWN)):
        if role not in keys:
            raise LoraError(f"{where}: {keys[other]} has no LoRA {role} for {stem}")
    down = np.asarray(state_dict[keys[DOWN]])
    up = np.asarray(state_dict[keys[UP]])
    _check_pair(where, stem, keys, down, up, target)
    return down, up, alpha_scale(_alpha(state_dict, keys, where), down.shape[0])


def _lokr_factor(state_dict, keys: Mapping[str, str], factor: str, where: str):
    """``(P, Q, rank)`` with ``P @ Q`` = the LoKr factor ``factor``: a full matrix ``[a, b]``
    as identity times it on its smaller side (rank None), else its stored ``_a`` / ``_b``."""
    parts = {part: keys.get(factor + part) for part in ("", "_a", "_b")}
    named = [key for key in parts.values() if key]
    if parts[""] and (parts["_a"] or parts["_b"]) or not named:
        raise LoraError(
            f"{where}: LoKr {factor} needs {factor} or {factor}_a with {factor}_b; the file has "
            f"{', '.join(named) or 'neither'} (beside {', '.join(sorted(keys.values()))})"
        )
    if parts[""]:
        full = np.asarray(state_dict[parts[""]])
        if full.ndim != 2:
            raise LoraError(f"{where}: {parts['']} has shape {list(full.shape)}, not [a, b]")
        rows, cols = full.shape
        if rows <= cols:
            return np.eye(rows, dtype=np.float32), full, None
        return full, np.eye(cols, dtype=np.float32), None
    if not (parts["_a"] and parts["_b"]):
        raise LoraError(f"{where}: {named[0]} has no matching {factor}_a / {factor}_b")
    a, b = np.asarray(state_dict[parts["_a"]]), np.asarray(state_dict[parts["_b"]])
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
        raise LoraError(
            f"{where}: {parts['_a']} {list(a.shape)} and {parts['_b']} {list(b.shape)} are no "
            "[a, r] @ [r, b] pair (a LoKr conv factor, lokr_t2, is not read)"
        )
    return a, b, int(b.shape[0])


def _lokr_pair(state_dict, stem: str, keys: Mapping[str, str], target: Target, where: str):
    """(down, up, scale) of a LoKr layer: ``kron(w1, w2)`` with ``w1 = P1 Q1``, ``w2 = P2 Q2``
    is ``kron(P1, P2) @ kron(Q1, Q2)`` (the mixed-product rule), a LoRA of rank
    ``rank(P1) x rank(P2)``. Scale: LyCORIS' ``alpha / rank`` with the rank of the decomposed
    factor (w2's first), as diffusers bakes it in; 1 when both factors are full matrices."""
    p1, q1, rank1 = _lokr_factor(state_dict, keys, W1, where)
    p2, q2, rank2 = _lokr_factor(state_dict, keys, W2, where)
    up, down = np.kron(p1, p2), np.kron(q1, q2)
    rows, cols = sum(target.rows), target.in_features
    if up.shape[0] != rows or down.shape[1] != cols:
        shapes = f"[{p1.shape[0]}, {q1.shape[1]}] x [{p2.shape[0]}, {q2.shape[1]}]"
        raise LoraError(
            f"{where}: {keys[W1 if W1 in keys else W1 + '_a']}: the LoKr factors {shapes} make a "
            f"[{up.shape[0]}, {down.shape[1]}] delta but {', '.join(target.modules)} of this "
            f"model is [{rows}, {cols}] (a LoRA for another model?)"
        )
    rank = rank2 or rank1
    alpha = _alpha(state_dict, keys, where)
    scale = 1.0 if rank is None else alpha_scale(alpha, rank)
    return down.astype(np.float32), up.astype(np.float32), scale


def _layer(state_dict, stem: str, keys: Mapping[str, str], target: Target, where: str):
    """(down, up, scale, kind) of one file layer, or None for an alpha alone."""
    lora, lokr = keys.keys() & {DOWN, UP}, [k for r, k in keys.items() if r.startswith("lokr_")]
    if lora and lokr:
        raise LoraError(f"{where}: {stem} has both LoRA ({keys[lora.pop()]}) and LoKr keys")
    if lokr:
        return (*_lokr_pair(state_dict, stem, keys, target, where), "lokr")
    if lora:
        return (*_lora_pair(state_dict, stem, keys, target, where), "")
    return None


def to_diffusers(
    state_dict: Mapping[str, np.ndarray], config: Flux2TransformerConfig, where: str
) -> Converted:
    """Convert a Flux.2 LoRA / LoKr state dict (any format of the module docstring) into
    ``{diffusers module name: LoraLayer}`` for the transformer of ``config``.

    ``where`` names the source (a file path) in errors. Keys no rule places are returned in
    ``unmatched``; a malformed layer raises :class:`LoraError` naming the key.
    """
    vocab = _vocabulary(config)
    layers: dict[str, LoraLayer] = {}
    sources: dict[str, str] = {}  # diffusers module -> the file layer that set it
    used: set[str] = set()
    formats: set[str] = set()
    for stem, (target, fmt, keys) in _group(state_dict, vocab, where).items():
        found = _layer(state_dict, stem, keys, target, where)
        if found is None:
            continue  # an alpha alone places nothing: unmatched
        down, up, scale, kind = found
        for name, (d, u) in zip(target.modules, _split_layer(down, up, target), strict=True):
            if name in layers:
                raise LoraError(f"{where}: {stem} and {sources[name]} are both LoRAs of {name}")
            layers[name] = LoraLayer(d, u, scale)
            sources[name] = stem
        used.update(keys.values())
        formats.add(f"{fmt}-{kind}" if kind else fmt)
    return Converted(layers, unused_keys(used, state_dict), "+".join(sorted(formats)) or "none")
