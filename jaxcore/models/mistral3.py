"""The Mistral-3 text encoder of FLUX.2 [dev] in Flax linen (= the language model of transformers
``Mistral3ForConditionalGeneration``, a ``MistralModel``), and the prompt embedding of
diffusers' ``Flux2Pipeline``.

References: ``transformers/models/mistral/modeling_mistral.py``,
``transformers/models/mistral3/modeling_mistral3.py`` (transformers 5.x) and
``diffusers/pipelines/flux2/pipeline_flux2.py`` (``format_input`` and
``_get_mistral_3_small_prompt_embeds``; the system message from ``system_messages.py``).

The network is the shared Llama-style decoder (:mod:`jaxcore.models.decoder_lm`, which
describes it) with Mistral's switches: bias-free projections, no q/k norms, the causal mask a
band of ``sliding_window`` keys when the config sets one (as
``create_sliding_window_causal_mask``), and ``head_dim`` possibly absent
(``hidden_size // num_attention_heads``). This file holds what is Mistral's: its config
(transformers' names), its RoPE frequencies, the system-message chat prompt embedding and the
checkpoint layouts (key prefixes).

``hidden_states`` are numbered as transformers' ``output_hidden_states``: index 0 is the
embedding, index k < N the output of layer k (1-based), and index N (the last layer) has the
final ``norm`` applied (= ``last_hidden_state``).

RoPE: ``rope_type`` "default" (Mistral-Small-3.x, FLUX.2 [dev]'s encoder: ``rope_theta`` 1e9,
no scaling) and "yarn" (the scaling Mistral-3 text configs such as Ministral-3's carry:
transformers' ``_compute_yarn_parameters``, YaRN, Peng et al. 2023, arXiv:2309.00071, its
frequencies blended between interpolation and extrapolation and cos/sin scaled by the
attention factor); any other RoPE type or parameter is refused by its key. The vision tower,
the projector and the LM head are never loaded (their weights are ignored by name).

Public API: :class:`MistralTextConfig`, :class:`MistralTextModel`, :func:`hidden_states`,
:func:`stacked_hidden_states`, :func:`format_messages`, :func:`tokenize_prompts`,
:func:`prompt_embeds`, :func:`load_prompt_tokenizer`, :func:`weight_map`,
:func:`load_mistral3`, :func:`init_mistral3`, :func:`count_params`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxcore import weights
from jaxcore.models import decoder_lm, layers
from jaxcore.models.decoder_lm import hidden_states

__all__ = [
    "FLUX2_DEV_LAYERS",
    "FLUX2_DEV_MAX_SEQUENCE_LENGTH",
    "SYSTEM_MESSAGE",
    "MistralConfigError",
    "MistralTextConfig",
    "MistralTextModel",
    "count_params",
    "format_messages",
    "hidden_states",
    "init_mistral3",
    "load_mistral3",
    "load_prompt_tokenizer",
    "prompt_embeds",
    "stacked_hidden_states",
    "tokenize_prompts",
    "weight_map",
]

# Flux2Pipeline's defaults (``text_encoder_out_layers``, ``max_sequence_length``).
FLUX2_DEV_LAYERS = (10, 20, 30)
FLUX2_DEV_MAX_SEQUENCE_LENGTH = 512

# diffusers' flux2 ``SYSTEM_MESSAGE`` (from black-forest-labs/flux2 system_messages.py), the
# system turn of every prompt; tests/jaxcore/test_mistral3.py checks it is diffusers' string.
SYSTEM_MESSAGE = (
    "You are an AI that reasons about image descriptions. You give structured responses "
    "focusing on object relationships, object\nattribution and actions without speculation."
)

# YaRN's rope parameters (transformers' _validate_yarn_rope_parameters, plus the 4.x "type");
# ``llama_4_scaling_beta`` is read by Ministral-3's attention, not Mistral's, which ignores it.
YARN_KEYS = frozenset(
    {
        "rope_type",
        "type",
        "factor",
        "original_max_position_embeddings",
        "attention_factor",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "truncate",
        "llama_4_scaling_beta",
    }
)

# config.json keys about training, generation or bookkeeping; the hidden states do not depend
# on them. Any other key that is no MistralTextConfig field is an error naming it.
IGNORED_CONFIG_KEYS = frozenset(
    {
        "architectures",
        "attention_dropout",
        "bos_token_id",
        "dtype",
        "eos_token_id",
        "initializer_range",
        "pad_token_id",
        "torch_dtype",
        "transformers_version",
        "use_cache",
    }
)


class MistralConfigError(ValueError):
    """A config.json key or value MistralTextConfig cannot represent; names the key."""


@dataclasses.dataclass(frozen=True)
class MistralTextConfig:
    """transformers ``MistralConfig`` fields the encoder uses; defaults are transformers'
    (``sliding_window`` 4096 included: a config.json without the key gets the window).

    A ``Mistral3Config`` dict nests this under ``text_config`` (read by :meth:`from_dict`).
    ``rope_theta`` / ``rope_scaling`` are the transformers 4.x keys; a 5.x ``rope_parameters``
    dict is read into them. ``rope_scaling`` is None for the default RoPE and otherwise kept
    as sorted ``(key, value)`` pairs (modules holding this config must hash); see
    :meth:`rope_parameters`. ``head_dim`` None means ``hidden_size // num_attention_heads``.
    ``max_position_embeddings`` and ``tie_word_embeddings`` (the unused LM head's) are kept
    for round trips.
    """

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 14336
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 4096 * 32
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Mapping | tuple | None = None
    sliding_window: int | None = 4096
    tie_word_embeddings: bool = False
    model_type: str = "mistral"

    def __post_init__(self):
        """Resolve ``head_dim``; refuse unsupported variants and bad sizes by key."""
        if self.num_attention_heads < 1:
            raise MistralConfigError(
                f"num_attention_heads must be >= 1, got {self.num_attention_heads}"
            )
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        self._check_supported()
        object.__setattr__(self, "rope_scaling", self._normalised_rope_scaling())
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers"):
            if getattr(self, key) < 1:
                raise MistralConfigError(f"{key} must be >= 1, got {getattr(self, key)}")
        if self.num_key_value_heads < 1 or self.num_attention_heads % self.num_key_value_heads:
            raise MistralConfigError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim < 2 or self.head_dim % 2:
            raise MistralConfigError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise MistralConfigError(f"sliding_window={self.sliding_window} must be >= 1 or null")

    def _check_supported(self) -> None:
        """Variants the encoder does not implement are refused by the key that asks for them."""
        if self.model_type != "mistral":
            raise MistralConfigError(
                f"text_config model_type={self.model_type!r} is not 'mistral' (a Mistral-3 text "
                "config of another type, e.g. 'ministral3', is not supported)"
            )
        if self.hidden_act != "silu":
            raise MistralConfigError(f"hidden_act={self.hidden_act!r} is not supported (silu only)")

    def _normalised_rope_scaling(self) -> tuple | None:
        """None for the default RoPE; YaRN's parameters as sorted pairs, checked by key, with
        transformers' default ``original_max_position_embeddings``."""
        rope = dict(self.rope_scaling or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type == "default":
            extra = sorted(set(rope) - {"rope_type", "type"})
            if extra:
                raise MistralConfigError(f"rope_scaling keys {extra} are not supported")
            return None
        if rope_type != "yarn":
            raise MistralConfigError(f"rope_scaling rope_type={rope_type!r} is not supported")
        unknown = sorted(set(rope) - YARN_KEYS)
        if unknown:
            raise MistralConfigError(f"rope_scaling keys {unknown} are not supported for yarn")
        rope = {k: v for k, v in rope.items() if k != "type"} | {"rope_type": "yarn"}
        rope.setdefault("original_max_position_embeddings", self.max_position_embeddings)
        if "factor" not in rope:
            raise MistralConfigError("rope_scaling 'factor' is required for rope_type='yarn'")
        return tuple(sorted(rope.items()))

    def rope_parameters(self) -> dict[str, Any]:
        """transformers 5's ``rope_parameters``: ``rope_theta`` and ``rope_type`` (and YaRN's
        parameters)."""
        rope = dict(self.rope_scaling or {"rope_type": "default"})
        return {"rope_theta": self.rope_theta, **rope}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> MistralTextConfig:
        """Build from a transformers config.json dict: a ``Mistral3Config`` (``model_type``
        "mistral3"; its ``text_config`` is read, the vision keys ignored) or a plain
        ``MistralConfig``; 4.x or 5.x RoPE keys."""
        if d.get("model_type") == "mistral3":
            if not isinstance(d.get("text_config"), Mapping):
                raise MistralConfigError("a mistral3 config.json needs a text_config object")
            # transformers' Mistral3Config fills a missing text model_type with "mistral".
            d = {"model_type": "mistral", **d["text_config"]}
        kwargs = {k: v for k, v in d.items() if not k.startswith("_")}
        kwargs = {k: v for k, v in kwargs.items() if k not in IGNORED_CONFIG_KEYS}
        rope = kwargs.pop("rope_parameters", None)
        if rope is not None:  # transformers 5: {"rope_theta": ..., "rope_type": ...}
            rope = dict(rope)
            kwargs["rope_theta"] = rope.pop("rope_theta", cls.rope_theta)
            kwargs["rope_scaling"] = rope or None
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise MistralConfigError(
                f"unknown MistralTextConfig keys {unknown}; known: {sorted(known)}"
            )
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        """The fields as a dict (a plain ``MistralConfig`` config.json, 4.x RoPE keys)."""
        d = dataclasses.asdict(self)
        d["rope_scaling"] = dict(self.rope_scaling) if self.rope_scaling else None
        return d

    def decoder_options(self) -> decoder_lm.DecoderOptions:
        """The shared decoder's view: no biases or q/k norms, the config's sliding window and
        RoPE (:func:`rope_frequencies`)."""
        inv_freq, attention_factor = rope_frequencies(self)
        return decoder_lm.DecoderOptions.of(
            self,
            inv_freq,
            rope_attention_factor=attention_factor,
            sliding_window=self.sliding_window,
        )


# --- RoPE ----------------------------------------------------------------------------------------


def _yarn_correction_range(rope: Mapping, head_dim: int, theta: float) -> tuple[float, float]:
    """The dimensions between which YaRN ramps from extrapolation to interpolation
    (``find_correction_range``: where a dimension turns ``beta_fast`` / ``beta_slow`` times
    over the original context), floored / ceiled unless ``truncate`` is false."""
    original = rope["original_max_position_embeddings"]

    def dimension(rotations: float) -> float:
        """The (fractional) dimension that turns ``rotations`` times over ``original``."""
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension(rope.get("beta_fast") or 32), dimension(rope.get("beta_slow") or 1)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, head_dim - 1)


def _yarn_attention_factor(rope: Mapping, factor: float) -> float:
    """cos/sin scale: ``attention_factor``, else YaRN's ``0.1 * mscale * ln(s) + 1`` ratio."""
    if rope.get("attention_factor") is not None:
        return float(rope["attention_factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        """YaRN's Eq. 21 (1 for no scaling)."""
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if rope.get("mscale") and rope.get("mscale_all_dim"):
        return float(mscale(factor, rope["mscale"]) / mscale(factor, rope["mscale_all_dim"]))
    return mscale(factor)


def rope_frequencies(config: MistralTextConfig) -> tuple[np.ndarray, float]:
    """``(inv_freq [head_dim / 2] float32, attention_factor)`` as transformers' RoPE init for
    the config's ``rope_type`` (default: ``theta ** (-2i / d)`` and 1)."""
    if config.rope_scaling is None:
        return decoder_lm.default_inv_freq(config.head_dim, config.rope_theta), 1.0
    powers = layers.rope_theta_powers(config.head_dim, config.rope_theta)
    rope = dict(config.rope_scaling)
    factor = rope["factor"]
    if factor is None:  # transformers: the ratio of the context lengths
        factor = config.max_position_embeddings / rope["original_max_position_embeddings"]
    low, high = _yarn_correction_range(rope, config.head_dim, config.rope_theta)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = np.arange(config.head_dim // 2, dtype=np.float32) - np.float32(low)
    ramp = np.clip(ramp / np.float32(high - low), 0, 1).astype(np.float32)
    extrapolated = 1 - ramp  # weight of the original frequency (fast-turning dimensions)
    inv_extrapolation = np.float32(1.0) / powers
    inv_interpolation = np.float32(1.0) / (np.float32(factor) * powers)
    inv_freq = inv_interpolation * (1 - extrapolated) + inv_extrapolation * extrapolated
    return inv_freq.astype(np.float32), _yarn_attention_factor(rope, factor)


# --- the model ----------------------------------------------------------------------------------


class MistralTextModel(decoder_lm.DecoderLM):
    """transformers ``MistralModel`` (Mistral3's ``language_model``);
    ``__call__(ids, mask, layers)`` -> the hidden states ``layers`` (numbered as
    transformers': 0 the embedding, k the output of layer k, the last layer's through
    ``norm``) stacked ``[K, B, L, E]``, running only the first ``max(layers)`` layers
    (default: all the hidden states): the shared :class:`~jaxcore.models.decoder_lm.DecoderLM`
    built from :meth:`MistralTextConfig.decoder_options`."""

    config: MistralTextConfig


def stacked_hidden_states(
    module: MistralTextModel, params, ids_bl, mask_bl, layers=FLUX2_DEV_LAYERS
) -> jax.Array:
    """The pipeline's prompt embedding from token ids: ``[B, L, K * E]``, channel
    ``k * E + e`` = hidden state ``layers[k]`` (its ``stack(dim=1).permute(0, 2, 1, 3)``)."""
    return decoder_lm.stacked_hidden_states(module, params, ids_bl, mask_bl, layers)


# --- prompts -------------------------------------------------------------------------------------


def format_messages(prompts: Sequence[str], system_message: str = SYSTEM_MESSAGE) -> list:
    """diffusers' flux2 ``format_input`` without images: per prompt a system turn and a user
    turn, each one text block; ``[IMG]`` is removed from the prompts (the processor would
    count image tokens against images)."""
    return [
        [
            {"role": "system", "content": [{"type": "text", "text": system_message}]},
            {"role": "user", "content": [{"type": "text", "text": prompt.replace("[IMG]", "")}]},
        ]
        for prompt in prompts
    ]


def tokenize_prompts(
    tokenizer,
    prompts,
    max_sequence_length: int = FLUX2_DEV_MAX_SEQUENCE_LENGTH,
    system_message: str = SYSTEM_MESSAGE,
) -> tuple[np.ndarray, np.ndarray]:
    """ids and attention mask int32 ``[B, max_sequence_length]`` as
    ``_get_mistral_3_small_prompt_embeds`` makes them: the whole batch through
    ``tokenizer.apply_chat_template`` (a ``PixtralProcessor`` or a tokenizer with the chat
    template; no generation prompt), padded to ``max_sequence_length`` (the tokenizer's own
    padding side) and truncated, the very call the pipeline makes."""
    from jaxcore.text import call_tokenizer

    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    # call_tokenizer serialises the call (a fast tokenizer's padding state is shared).
    encoded = call_tokenizer(
        tokenizer.apply_chat_template,
        format_messages(prompts, system_message),
        add_generation_prompt=False,
        tokenize=True,
        return_dict=True,
        return_tensors="np",
        padding="max_length",
        truncation=True,
        max_length=max_sequence_length,
    )
    ids = np.asarray(encoded["input_ids"], np.int32)
    mask = np.asarray(encoded["attention_mask"], np.int32)
    return ids.reshape(len(prompts), -1), mask.reshape(len(prompts), -1)


def prompt_embeds(
    tokenizer,
    module: MistralTextModel,
    params,
    prompts,
    max_sequence_length: int = FLUX2_DEV_MAX_SEQUENCE_LENGTH,
    layers: Sequence[int] = FLUX2_DEV_LAYERS,
    system_message: str = SYSTEM_MESSAGE,
    dtype=None,
) -> np.ndarray:
    """``Flux2Pipeline._get_mistral_3_small_prompt_embeds``: ``[B, max_sequence_length,
    K * E]`` on the host in ``dtype`` (default the module's activation dtype, as the pipeline
    defaults to the text encoder's); padding rows are kept (the pipeline keeps them too)."""
    ids_bl, mask_bl = tokenize_prompts(tokenizer, prompts, max_sequence_length, system_message)
    embeds = stacked_hidden_states(module, params, ids_bl, mask_bl, layers)
    return np.asarray(embeds.astype(module.dtype if dtype is None else dtype))


def load_prompt_tokenizer(directory: str | os.PathLike):
    """FLUX.2 [dev]'s ``tokenizer`` folder (saved by a ``PixtralProcessor``) as a tokenizer
    that renders the chat template: ``AutoTokenizer`` (local files only, no remote code),
    which reads ``chat_template.jinja``; a processor's legacy ``chat_template.json`` is read
    when the tokenizer found no template. The processor itself needs torchvision and only its
    tokenizer matters for text: both produce the same ids when the rendered text starts with
    the BOS token (the processor then turns ``add_special_tokens`` off, as the tokenizer's
    ``apply_chat_template`` always does), which Mistral's template does."""
    from jaxcore.text import load_tokenizer

    tokenizer = load_tokenizer(directory)
    legacy = Path(directory) / "chat_template.json"
    if tokenizer.chat_template is None and legacy.is_file():
        tokenizer.chat_template = json.loads(legacy.read_text())["chat_template"]
    if tokenizer.chat_template is None:
        raise weights.WeightsError(
            f"tokenizer at {directory} has no chat template (chat_template.jinja or "
            "chat_template.json); Flux2Pipeline formats every prompt with it"
        )
    return tokenizer


# --- weights -------------------------------------------------------------------------------------

# Where the language model's keys live: transformers' save layout for Mistral3 (also what
# 4.x wrote), its in-memory layout, and a plain MistralForCausalLM / MistralModel.
LANGUAGE_MODEL_PREFIXES = ("language_model.model.", "model.language_model.", "model.")

# Mistral3ForConditionalGeneration weights that are no part of the text encoder, by name.
UNUSED_PREFIXES = (
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
    "language_model.lm_head.",
    "lm_head.",
)


def weight_map(config: MistralTextConfig, prefix: str = LANGUAGE_MODEL_PREFIXES[0]) -> dict:
    """Flax param path -> (transformers key under ``prefix``, transform)."""
    return decoder_lm.weight_map(config.decoder_options(), prefix)


def language_model_prefix(reader: weights.SafetensorsReader) -> str:
    """The key prefix of the language model in a checkpoint (see LANGUAGE_MODEL_PREFIXES);
    WeightsError naming the directory when none holds ``embed_tokens.weight``."""
    return decoder_lm.find_prefix(reader, LANGUAGE_MODEL_PREFIXES, "Mistral language model")


def count_params(config: MistralTextConfig, *, with_lm_head: bool = False) -> int:
    """Parameters of the language model (``MistralModel``); ``with_lm_head`` adds the untied
    LM head, giving ``MistralForCausalLM``'s count."""
    n = decoder_lm.count_params(MistralTextModel(config))
    if with_lm_head and not config.tie_word_embeddings:
        n += config.vocab_size * config.hidden_size
    return n


def init_mistral3(config: MistralTextConfig, rng, *, dtype=jnp.float32, param_dtype=None):
    """Random-init ``(module, params)`` (unboxed, on the default device)."""
    module = MistralTextModel(config, dtype=dtype, param_dtype=param_dtype or dtype)
    return module, decoder_lm.init_params(module, rng)


def load_mistral3(
    directory: str | os.PathLike,
    *,
    dtype=jnp.float32,
    param_dtype=None,
    mesh: jax.sharding.Mesh | None = None,
    rules=None,
) -> tuple[MistralTextModel, dict]:
    """A transformers ``Mistral3ForConditionalGeneration`` directory (FLUX.2 [dev]'s
    ``text_encoder``; a plain Mistral one reads too) -> ``(module, params)`` of its language
    model; the vision tower, projector and LM head are not read."""
    config = MistralTextConfig.from_dict(weights.read_config(directory))
    module = MistralTextModel(config, dtype=dtype, param_dtype=param_dtype or dtype)
    reader = weights.SafetensorsReader(directory)
    mapping = weight_map(config, language_model_prefix(reader))
    params = decoder_lm.load_params(
        module, reader, mapping, mesh=mesh, rules=rules, ignore_unused=UNUSED_PREFIXES
    )
    return module, params
