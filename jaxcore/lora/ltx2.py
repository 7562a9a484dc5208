"""LTX-2 LoRA files -> :class:`~jaxcore.lora.base.Converted` (diffusers module names of
``LTX2VideoTransformer3DModel``).

Two key layouts name the transformer's Linear layers; every key is read on its own, by its
prefix:

- ``diffusers``: ``transformer.`` + diffusers/PEFT module names
  (``transformer.transformer_blocks.0.audio_to_video_attn.to_q.lora_A.weight``), as
  ``LTX2Pipeline.save_lora_weights`` and difforge's LoRA training write them;
- ``comfyui``: ``diffusion_model.`` + the original LTX-2 names (LTX-2 trainer, ComfyUI), renamed
  as diffusers renames them: the top-level modules ``patchify_proj`` / ``audio_patchify_proj``
  -> ``proj_in`` / ``audio_proj_in``, ``adaln_single`` / ``audio_adaln_single`` ->
  ``time_embed`` / ``audio_time_embed``, the cross-modal ``av_ca_video_scale_shift_adaln_single``
  / ``av_ca_audio_scale_shift_adaln_single`` / ``av_ca_a2v_gate_adaln_single`` /
  ``av_ca_v2a_gate_adaln_single`` -> ``av_cross_attn_video_scale_shift`` /
  ``av_cross_attn_audio_scale_shift`` / ``av_cross_attn_video_a2v_gate`` /
  ``av_cross_attn_audio_v2a_gate``, and LTX-2.3's ``prompt_adaln_single`` /
  ``audio_prompt_adaln_single`` -> ``prompt_adaln`` / ``audio_prompt_adaln``. The blocks'
  Linears (``attn1``, ``attn2``, ``audio_attn1``, ``audio_attn2``, ``audio_to_video_attn``,
  ``video_to_audio_attn``: ``to_q`` / ``to_k`` / ``to_v`` / ``to_out.0`` / ``to_gate_logits``;
  ``ff`` / ``audio_ff``: ``net.0.proj`` / ``net.2``), the caption projections and the output
  projections are named alike in both. The diffusers names are accepted under this prefix too,
  as diffusers' converter accepts them.

Per layer: ``lora_A`` / ``lora_down`` ``[r, in]`` with ``lora_B`` / ``lora_up`` ``[out, r]``
and an optional ``.alpha`` (scale ``alpha / r``, else 1, as diffusers loads files without
alphas); a factor saved as a 1x1 convolution is read as the matrix it is. The PEFT config in a
diffusers-saved file's header (``lora_alpha``, ``rank_pattern``, ...) is applied by
:func:`jaxcore.lora.merge.load_lora`.

Reference: diffusers 0.42 ``LTX2LoraLoaderMixin.lora_state_dict`` (loaders/lora_pipeline.py)
and ``_convert_non_diffusers_ltx2_lora_to_diffusers`` (loaders/lora_conversion_utils.py), whose
renames follow ``convert_ltx2_transformer_to_diffusers`` (loaders/single_file_utils.py).
Where this module differs, and why:

- ``.alpha`` keys and ``lora_down`` / ``lora_up`` pairs are read (as ComfyUI reads them);
  diffusers' ``load_lora_weights`` refuses a file holding a key without ``lora`` in its name,
  and its PEFT loader reads ``lora_A`` / ``lora_B`` only;
- each key is placed on its own, so a file mixing the two layouts works (diffusers keeps only
  the ``diffusion_model.`` keys of a file holding any, dropping its ``transformer.`` keys);
- a layer's shape is checked against the model here, so a LoRA for another LTX-2 size fails
  naming its key.

What has no Linear LoRA of this transformer is returned in ``unmatched``, never dropped: the
text connectors' LoRA (``text_embedding_projection.*``, which diffusers loads into
``LTX2Pipeline.connectors``, and ``connectors.*``), text-encoder LoRAs, keys without one of the
two prefixes, unknown modules and blocks the model lacks, original names under
``transformer.``, norms, bias deltas (``lora_B.bias``), DoRA magnitudes (``dora_scale``, which
diffusers drops with a warning), LoKr / LoHa tensors, and an alpha without its pair.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping

import numpy as np

from jaxcore.lora.base import Converted, LoraError, LoraLayer, paired_layer, split_part
from jaxcore.models.ltx2_transformer import (
    CROSS_MODAL_SCALE_SHIFTS,
    MLP_RATIO,
    TIMESTEP_CHANNELS,
    LTX2VideoTransformerConfig,
    Stream,
)

DIFFUSERS, COMFYUI = "diffusers", "comfyui"
_PREFIXES = {"transformer.": DIFFUSERS, "diffusion_model.": COMFYUI}

# key suffix -> which part of a layer it is
_PARTS = {
    "lora_A.weight": "down",
    "lora_down.weight": "down",
    "lora_B.weight": "up",
    "lora_up.weight": "up",
    "alpha": "alpha",
}

# original LTX-2 top-level module -> diffusers module (the first dotted component of a name)
ORIGINAL_RENAMES = {
    "patchify_proj": "proj_in",
    "audio_patchify_proj": "audio_proj_in",
    "adaln_single": "time_embed",
    "audio_adaln_single": "audio_time_embed",
    "av_ca_video_scale_shift_adaln_single": "av_cross_attn_video_scale_shift",
    "av_ca_audio_scale_shift_adaln_single": "av_cross_attn_audio_scale_shift",
    "av_ca_a2v_gate_adaln_single": "av_cross_attn_video_a2v_gate",
    "av_ca_v2a_gate_adaln_single": "av_cross_attn_audio_v2a_gate",
    "prompt_adaln_single": "prompt_adaln",
    "audio_prompt_adaln_single": "audio_prompt_adaln",
}

PROMPT_SCALE_SHIFTS = 2  # LTX2AdaLayerNormSingle(num_mod_params=2): the prompt's scale, shift


# ----------------------------------------------------------------------------------------------
# Vocabulary (built from the config)
# ----------------------------------------------------------------------------------------------


def _time_embed_shapes(name: str, dim: int, modulations: int) -> dict[str, tuple[int, int]]:
    """``LTX2AdaLayerNormSingle``: sinusoid -> linear_1 -> SiLU -> linear_2 -> SiLU -> linear."""
    return {
        f"{name}.emb.timestep_embedder.linear_1": (dim, TIMESTEP_CHANNELS),
        f"{name}.emb.timestep_embedder.linear_2": (dim, dim),
        f"{name}.linear": (modulations * dim, dim),
    }


def _attention_shapes(name: str, query: int, key: int, out: int, heads: Stream, gated: bool):
    """``LTX2Attention``: q from ``query`` features, k / v from ``key`` features, at the width
    of ``heads``' stream; the output projected to ``out`` features; per-head gate logits."""
    inner = heads.dim
    shapes = {
        f"{name}.to_q": (inner, query),
        f"{name}.to_k": (inner, key),
        f"{name}.to_v": (inner, key),
        f"{name}.to_out.0": (out, inner),
    }
    if gated:
        shapes[f"{name}.to_gate_logits"] = (heads.heads, query)
    return shapes


def _block_shapes(i: int, config: LTX2VideoTransformerConfig) -> dict[str, tuple[int, int]]:
    block, video, audio = f"transformer_blocks.{i}", config.video, config.audio
    d, da = video.dim, audio.dim
    shapes: dict[str, tuple[int, int]] = {}
    for stream in (video, audio):
        attn = f"{block}.{stream.prefix}attn"
        shapes |= _attention_shapes(
            f"{attn}1", stream.dim, stream.dim, stream.dim, stream, stream.gated_attn
        )
        shapes |= _attention_shapes(
            f"{attn}2", stream.dim, stream.context_dim, stream.dim, stream, stream.gated_attn
        )
    # the cross-modal attentions run at the audio width, their queries from their own side
    shapes |= _attention_shapes(f"{block}.audio_to_video_attn", d, da, d, audio, video.gated_attn)
    shapes |= _attention_shapes(f"{block}.video_to_audio_attn", da, d, da, audio, audio.gated_attn)
    for stream in (video, audio):
        ff, hidden = f"{block}.{stream.prefix}ff", MLP_RATIO * stream.dim
        shapes[f"{ff}.net.0.proj"] = (hidden, stream.dim)
        shapes[f"{ff}.net.2"] = (stream.dim, hidden)
    return shapes


def linear_shapes(config: LTX2VideoTransformerConfig) -> dict[str, tuple[int, int]]:
    """``{diffusers module name: (out_features, in_features)}`` of every Linear layer of
    ``LTX2VideoTransformer3DModel`` with this config: the layers a LoRA can target."""
    video, audio = config.video, config.audio
    shapes: dict[str, tuple[int, int]] = {}
    for stream in (video, audio):
        p = stream.prefix
        shapes[f"{p}proj_in"] = (stream.dim, stream.in_channels)
        if config.use_prompt_embeddings:
            shapes[f"{p}caption_projection.linear_1"] = (stream.dim, config.caption_channels)
            shapes[f"{p}caption_projection.linear_2"] = (stream.dim, stream.dim)
        shapes |= _time_embed_shapes(f"{p}time_embed", stream.dim, stream.modulations)
    for side, stream in (("video", video), ("audio", audio)):
        shapes |= _time_embed_shapes(
            f"av_cross_attn_{side}_scale_shift", stream.dim, CROSS_MODAL_SCALE_SHIFTS
        )
    shapes |= _time_embed_shapes("av_cross_attn_video_a2v_gate", video.dim, 1)
    shapes |= _time_embed_shapes("av_cross_attn_audio_v2a_gate", audio.dim, 1)
    if config.prompt_adaln:
        for stream in (video, audio):
            shapes |= _time_embed_shapes(
                f"{stream.prefix}prompt_adaln", stream.dim, PROMPT_SCALE_SHIFTS
            )
    for i in range(config.num_layers):
        shapes |= _block_shapes(i, config)
    for stream in (video, audio):
        shapes[f"{stream.prefix}proj_out"] = (stream.out_channels, stream.dim)
    return shapes


def _from_original(name: str) -> str:
    """The diffusers name of original LTX-2 module ``name`` (its first component renamed)."""
    head, dot, rest = name.partition(".")
    return ORIGINAL_RENAMES.get(head, head) + dot + rest


@functools.cache
def _shapes(config: LTX2VideoTransformerConfig) -> dict[str, tuple[int, int]]:
    return linear_shapes(config)


# ----------------------------------------------------------------------------------------------
# Keys
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Key:
    stem: str  # the key without its suffix: one file layer
    module: str  # the diffusers module it targets
    part: str  # down, up or alpha
    format: str


def _module(stem: str, shapes: Mapping[str, tuple[int, int]]) -> tuple[str, str] | None:
    """(format, diffusers module) a key stem names, or None."""
    for prefix, fmt in _PREFIXES.items():
        if not stem.startswith(prefix):
            continue
        name = stem.removeprefix(prefix)
        if fmt == COMFYUI and name not in shapes:
            name = _from_original(name)
        return (fmt, name) if name in shapes else None
    return None


def _parse_key(key: str, shapes: Mapping[str, tuple[int, int]]) -> _Key | None:
    split = split_part(key, _PARTS)
    if split is None:
        return None
    stem, part = split
    placed = _module(stem, shapes)
    return None if placed is None else _Key(stem, placed[1], part, placed[0])


# ----------------------------------------------------------------------------------------------
# Conversion
# ----------------------------------------------------------------------------------------------


def _check_shape(layer: LoraLayer, parts: Mapping, module: str, shape, where: str) -> None:
    rows, cols = shape
    if layer.down.shape[1] != cols:
        raise LoraError(
            f"{where}: {parts['down'][0]}: down {list(layer.down.shape)} reads "
            f"{layer.down.shape[1]} features but {module} of this model reads {cols} "
            "(a LoRA for another model?)"
        )
    if layer.up.shape[0] != rows:
        raise LoraError(
            f"{where}: {parts['up'][0]}: up {list(layer.up.shape)} has {layer.up.shape[0]} rows "
            f"but {module} of this model has {rows} (a LoRA for another model?)"
        )


def _layer(stem: str, parts: Mapping, module: str, shape, where: str) -> LoraLayer | None:
    """The checked LoRA of one file layer ``{part: (key, value)}``, or None for an alpha
    alone."""
    for part, other in (("down", "up"), ("up", "down")):
        if part in parts and other not in parts:
            raise LoraError(f"{where}: {parts[part][0]} has no LoRA {other} for {stem}")
    layer = paired_layer(parts, where)
    if layer is not None:
        _check_shape(layer, parts, module, shape, where)
    return layer


def _group(state_dict: Mapping[str, np.ndarray], shapes, where: str):
    """``{stem: (module, format, {part: (key, value)})}`` of every key a rule places."""
    groups: dict[str, tuple[str, str, dict]] = {}
    for key, value in state_dict.items():
        parsed = _parse_key(key, shapes)
        if parsed is None:
            continue
        _, _, parts = groups.setdefault(parsed.stem, (parsed.module, parsed.format, {}))
        if parsed.part in parts:  # the same stem under two suffixes (lora_A and lora_down)
            raise LoraError(
                f"{where}: {key} and {parts[parsed.part][0]} are both the LoRA {parsed.part} "
                f"of {parsed.stem}"
            )
        parts[parsed.part] = (key, value)
    return groups


def to_diffusers(
    state_dict: Mapping[str, np.ndarray], config: LTX2VideoTransformerConfig, where: str
) -> Converted:
    """An LTX-2 LoRA file's tensors -> LoRA layers by diffusers module name of ``config``'s
    transformer.

    ``where`` names the source (a file path) in errors. Keys no rule places are returned in
    ``unmatched`` (sorted); a malformed layer (a down without its up, ranks that differ, a
    factor that is not a matrix, a shape that is not the model layer's, two file layers for
    one module) is a :class:`LoraError` naming the key and ``where``.
    """
    shapes = _shapes(config)
    layers: dict[str, LoraLayer] = {}
    sources: dict[str, str] = {}  # diffusers module -> the file layer that set it
    used: set[str] = set()
    formats: set[str] = set()
    for stem, (module, fmt, parts) in _group(state_dict, shapes, where).items():
        layer = _layer(stem, parts, module, shapes[module], where)
        if layer is None:
            continue  # an alpha alone places nothing: unmatched
        if module in layers:
            raise LoraError(f"{where}: {stem} and {sources[module]} are both LoRAs of {module}")
        layers[module], sources[module] = layer, stem
        used.update(key for key, _ in parts.values())
        formats.add(fmt)
    unmatched = tuple(sorted(set(state_dict) - used))
    return Converted(layers, unmatched, "+".join(sorted(formats)) or "none")
