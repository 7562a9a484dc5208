"""Mistral-3 text encoder (FLUX.2 [dev]'s) vs transformers' Mistral3ForConditionalGeneration and
the pipeline.

A tiny Mistral3ForConditionalGeneration (3 text layers, GQA 6 q / 2 kv heads, head_dim 10 so
q is 60 wide on a 48-wide model and each RoPE half is 5, a one-layer Pixtral vision tower that
the loader must skip) with every parameter perturbed, saved with ``save_pretrained`` and loaded
by our loader. The prompt embedding is compared with
``Flux2Pipeline._get_mistral_3_small_prompt_embeds`` itself, called with that model and a tiny
byte-level BPE tokenizer built here with Mistral's special tokens and a chat template cut from
Mistral-Small-3.1's (system prompt block, ``[INST]`` user turns, content given as blocks).
The pipeline's processor is a ``PixtralProcessor``, which cannot be built here (it imports
torchvision, absent from this venv); a ``ProcessorMixin`` holding only the tokenizer stands in
for its text path (transformers' processor ``apply_chat_template`` and ``__call__``).
"""

import json

import jax
import numpy as np
import pytest
import torch
from diffusers.pipelines.flux2.pipeline_flux2 import Flux2Pipeline
from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import Mistral3Config, MistralConfig, PreTrainedTokenizerFast, ProcessorMixin
from transformers import Mistral3ForConditionalGeneration as TorchMistral3
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from jaxcore import weights
from jaxcore.models import mistral3
from jaxcore.text import load_tokenizer

RTOL = 1e-5  # relative to the compared tensor's largest value; fp32, highest matmul precision

TINY_TEXT = {
    "model_type": "mistral",
    "vocab_size": 320,  # the byte-level alphabet alone is 256
    "hidden_size": 48,
    "intermediate_size": 80,
    "num_hidden_layers": 3,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "head_dim": 10,
    "rope_theta": 1000.0,
    "max_position_embeddings": 256,
    "sliding_window": None,
}
TINY_VISION = {
    "model_type": "pixtral",
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "head_dim": 8,
    "image_size": 32,
    "patch_size": 8,
}
SPECIALS = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[IMG]", "<pad>"]
SPECIALS += ["[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"]
# Mistral-Small-3.1's chat template, cut to a system turn and user turns whose content is a
# string or a list of text / image blocks (the real one adds a default system prompt, the
# date, assistant and tool turns).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['content'] is string %}{% set text = m['content'] %}"
    "{% else %}{% set text = namespace(v='') %}{% for b in m['content'] %}"
    "{% if b['type'] == 'text' %}{% set text.v = text.v + b['text'] %}"
    "{% else %}{% set text.v = text.v + '[IMG]' %}{% endif %}{% endfor %}"
    "{% set text = text.v %}{% endif %}"
    "{% if m['role'] == 'system' %}[SYSTEM_PROMPT]{{ text }}[/SYSTEM_PROMPT]"
    "{% elif m['role'] == 'user' %}[INST]{{ text }}[/INST]"
    "{% else %}{{ text }}{{ eos_token }}{% endif %}{% endfor %}"
)
PROMPTS = ["a red fox in the snow", "cat [IMG]", "a very long prompt " * 12]
MAX_LEN = 96  # the long prompt is truncated, the short ones padded

# FLUX.2 [dev]'s text encoder is Mistral-Small-3.2-24B-Instruct-2506 (Mistral-Small-3.1's
# architecture). Its text config as transformers' Mistral3Config gives it by default
# (transformers/models/mistral3/configuration_mistral3.py, sub_configs_defaults["text_config"],
# docstring checkpoint mistralai/Mistral-Small-3.1-24B-Instruct-2503), the same numbers as
# the FLUX.2-dev text_encoder config.json quoted by DiffSynth-Studio's flux2_text_encoder.py.
MISTRAL_SMALL_3_TEXT = {
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 5120,
    "intermediate_size": 32768,
    "max_position_embeddings": 131072,
    "model_type": "mistral",
    "num_attention_heads": 32,
    "num_hidden_layers": 40,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000000.0,
    "sliding_window": None,
    "vocab_size": 131072,
}
# (language model, with its untied LM head) from transformers on the meta device
REAL_COUNTS = (22_901_314_560, 23_572_403_200)


def _tokenizer_dir(directory):
    """A byte-level BPE tokenizer with Mistral's special tokens, saved as a transformers one."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_TEXT["vocab_size"],
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator([SYSTEM_MESSAGE, "a red fox in the snow", "cat long prompt"], trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        chat_template=CHAT_TEMPLATE,
    )
    fast.save_pretrained(directory)
    return directory


def _perturbed_model(text_config: dict, seed: int = 0):
    """A tiny Mistral3ForConditionalGeneration, every parameter moved off its init."""
    torch.manual_seed(seed)
    config = Mistral3Config(text_config=text_config, vision_config=TINY_VISION)
    model = TorchMistral3(config).eval()
    with torch.no_grad():
        for param in model.parameters():  # norms start at 1: perturb everything
            param.add_(0.1 * torch.randn_like(param))
    return model


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """(torch model, our module, params, tokenizer directory), built once."""
    directory = tmp_path_factory.mktemp("mistral3")
    model = _perturbed_model(TINY_TEXT)
    model.save_pretrained(directory)
    module, params = mistral3.load_mistral3(directory)
    tokenizer_dir = _tokenizer_dir(tmp_path_factory.mktemp("mistral3_tokenizer"))
    return model, module, params, tokenizer_dir


def _rel_err(got, expected) -> float:
    """Max abs difference over the reference's max abs."""
    got = np.asarray(got, np.float32)
    assert got.shape == expected.shape, (got.shape, expected.shape)
    return float(np.abs(got - expected).max() / np.abs(expected).max())


def _padded_batch(side: str, length: int = 12):
    """Random ids ``[3, length]`` and a mask of lengths (length, 7, 3) padded on ``side``."""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, TINY_TEXT["vocab_size"], (3, length))
    mask = np.zeros((3, length), np.int64)
    for b, n in enumerate((length, 7, 3)):
        if side == "right":
            mask[b, :n] = 1
        else:
            mask[b, length - n :] = 1
    return ids, mask


def _torch_states(model, ids, mask, layers):
    """transformers' ``output_hidden_states[k]`` for k in ``layers``, ``[B, K, L, E]``."""
    with torch.no_grad():
        out = model(
            input_ids=torch.from_numpy(ids),
            attention_mask=torch.from_numpy(mask),
            output_hidden_states=True,
            use_cache=False,
        )
    return torch.stack([out.hidden_states[k] for k in layers], dim=1).numpy()


@pytest.mark.parametrize("side", ["right", "left"])
def test_hidden_states_match_transformers(reference, side):
    model, module, params, _ = reference
    ids, mask = _padded_batch(side)
    layers = (0, 1, 2, 3)
    expected = _torch_states(model, ids, mask, layers)

    got = mistral3.hidden_states(module, params, ids, mask, layers)

    assert np.isfinite(expected).all()
    assert _rel_err(got, expected) < RTOL
    # the last index is normed: transformers' last_hidden_state
    with torch.no_grad():
        last = model.model.language_model(
            input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask)
        ).last_hidden_state.numpy()
    assert _rel_err(got[:, -1], last) < RTOL


@pytest.mark.parametrize("side", ["right", "left"])
def test_sliding_window_matches_transformers(tmp_path, side):
    model = _perturbed_model({**TINY_TEXT, "sliding_window": 4}, seed=1)
    model.save_pretrained(tmp_path)
    module, params = mistral3.load_mistral3(tmp_path)
    assert module.config.sliding_window == 4
    ids, mask = _padded_batch(side)
    layers = (1, 3)
    expected = _torch_states(model, ids, mask, layers)

    got = mistral3.hidden_states(module, params, ids, mask, layers)

    assert _rel_err(got, expected) < RTOL
    # the window matters here: the full causal mask gives other states
    full = mistral3.MistralTextModel(mistral3.MistralTextConfig(**TINY_TEXT))
    assert _rel_err(mistral3.hidden_states(full, params, ids, mask, layers), expected) > 1e-3


YARN_VARIANTS = [
    {"factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 8.0, "beta_slow": 1.0},
    {"factor": 16.0, "original_max_position_embeddings": 32, "mscale": 1.0, "mscale_all_dim": 0.5},
    {"factor": 2.0, "attention_factor": 0.9, "original_max_position_embeddings": 128},
    {"factor": 8.0, "original_max_position_embeddings": 16, "truncate": False},
]


@pytest.mark.parametrize("yarn", YARN_VARIANTS)
def test_yarn_frequencies_match_transformers(yarn):
    rope = {"rope_type": "yarn", "rope_theta": 1000.0, **yarn}
    torch_config = MistralConfig(**{**TINY_TEXT, "rope_parameters": rope})
    expected_inv_freq, expected_factor = ROPE_INIT_FUNCTIONS["yarn"](torch_config)
    config = mistral3.MistralTextConfig.from_dict(json.loads(torch_config.to_json_string()))

    inv_freq, factor = mistral3.rope_frequencies(config)

    np.testing.assert_allclose(inv_freq, expected_inv_freq.numpy(), rtol=1e-6)
    assert factor == pytest.approx(expected_factor, rel=1e-12) and factor != 1.0
    assert config.rope_parameters() == torch_config.rope_parameters
    # the scaling moves the frequencies off the default ones
    default_inv_freq, _ = mistral3.rope_frequencies(mistral3.MistralTextConfig(**TINY_TEXT))
    assert not np.allclose(inv_freq, default_inv_freq, rtol=1e-3)


def test_yarn_hidden_states_match_transformers(tmp_path):
    rope = {"rope_type": "yarn", "rope_theta": 1000.0, **YARN_VARIANTS[0]}
    model = _perturbed_model({**TINY_TEXT, "rope_parameters": rope}, seed=2)
    model.save_pretrained(tmp_path)
    module, params = mistral3.load_mistral3(tmp_path)
    ids, mask = _padded_batch("left")
    expected = _torch_states(model, ids, mask, (1, 3))

    got = mistral3.hidden_states(module, params, ids, mask, (1, 3))

    assert _rel_err(got, expected) < RTOL
    plain = mistral3.MistralTextModel(mistral3.MistralTextConfig(**TINY_TEXT))
    assert _rel_err(mistral3.hidden_states(plain, params, ids, mask, (1, 3)), expected) > 1e-3


class _TextProcessor(ProcessorMixin):
    """A processor with only a tokenizer: transformers' processor text path (what
    PixtralProcessor runs for text, its image parts aside)."""

    def __init__(self, tokenizer, chat_template=None):
        super().__init__(tokenizer, chat_template=chat_template)


@pytest.mark.parametrize("side", ["right", "left"])
def test_prompt_embeds_match_the_pipeline(reference, side):
    model, module, params, tokenizer_dir = reference
    tokenizer = mistral3.load_prompt_tokenizer(tokenizer_dir)
    tokenizer.padding_side = side
    layers = (1, 3, 2)
    with torch.no_grad():
        expected = Flux2Pipeline._get_mistral_3_small_prompt_embeds(
            model, tokenizer, PROMPTS, max_sequence_length=MAX_LEN, hidden_states_layers=layers
        ).numpy()
    ids, mask = mistral3.tokenize_prompts(tokenizer, PROMPTS, MAX_LEN)

    got = mistral3.prompt_embeds(tokenizer, module, params, PROMPTS, MAX_LEN, layers)

    assert expected.shape == (3, MAX_LEN, 3 * TINY_TEXT["hidden_size"])
    assert got.dtype == np.float32
    assert _rel_err(got, expected) < RTOL
    # the template ran with the pipeline's system message, BOS once, [IMG] stripped
    text = tokenizer.decode(ids[1][mask[1] > 0])
    assert text == f"<s>[SYSTEM_PROMPT]{SYSTEM_MESSAGE}[/SYSTEM_PROMPT][INST]cat [/INST]"
    assert mask[2].all() and 0 < mask[1].sum() < MAX_LEN  # truncated / padded
    assert (mask[1, -1] == 0) == (side == "right")
    # a processor's apply_chat_template (its own template) gives the same ids
    processor = _TextProcessor(tokenizer, chat_template=CHAT_TEMPLATE)
    processor_ids, processor_mask = mistral3.tokenize_prompts(processor, PROMPTS, MAX_LEN)
    np.testing.assert_array_equal(processor_ids, ids)
    np.testing.assert_array_equal(processor_mask, mask)


def test_system_message_and_defaults_are_the_pipelines():
    assert mistral3.SYSTEM_MESSAGE == SYSTEM_MESSAGE
    defaults = Flux2Pipeline._get_mistral_3_small_prompt_embeds.__defaults__
    assert mistral3.FLUX2_DEV_LAYERS in defaults
    assert mistral3.FLUX2_DEV_MAX_SEQUENCE_LENGTH in defaults
    messages = mistral3.format_messages(["x [IMG]y"])
    assert messages[0][1]["content"] == [{"type": "text", "text": "x y"}]


def test_prompt_tokenizer_loading(tmp_path, reference):
    *_, tokenizer_dir = reference
    tokenizer = load_tokenizer(tokenizer_dir)
    tokenizer.chat_template = None  # a processor folder keeping its template the legacy way
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(weights.WeightsError, match="no chat template"):
        mistral3.load_prompt_tokenizer(tmp_path)
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    assert mistral3.load_prompt_tokenizer(tmp_path).chat_template == CHAT_TEMPLATE


def _language_model_state(model) -> dict:
    """The language model's tensors under the key prefix save_pretrained writes."""
    state = model.model.language_model.state_dict()
    return {f"language_model.model.{k}": v.numpy() for k, v in state.items()}


def test_weights_round_trip_and_layouts(reference, tmp_path):
    model, module, params, _ = reference
    state = _language_model_state(model)
    exported = weights.export_state_dict(params, mistral3.weight_map(module.config))
    assert set(exported) == set(state)
    for key, value in state.items():
        np.testing.assert_array_equal(exported[key], value, err_msg=key)
    _, fresh = mistral3.init_mistral3(module.config, jax.random.key(0))
    assert jax.tree.map(np.shape, fresh) == jax.tree.map(np.shape, params)

    # the in-memory layout (model.language_model.*) beside a vision tower loads the same
    renamed = {
        k.replace("language_model.model.", "model.language_model."): v for k, v in state.items()
    }
    renamed["model.vision_tower.ln_pre.weight"] = np.ones(4, np.float32)
    weights.save_safetensors(renamed, tmp_path / "model.safetensors")
    model.config.save_pretrained(tmp_path)
    _, reloaded = mistral3.load_mistral3(tmp_path)
    assert jax.tree.map(np.array_equal, reloaded, params) == jax.tree.map(lambda _: True, params)

    # a key that is neither the language model's nor ignored by name is an error naming it
    renamed["model.language_model.layers.0.bogus"] = np.ones(4, np.float32)
    weights.save_safetensors(renamed, tmp_path / "model.safetensors")
    with pytest.raises(weights.WeightsError, match=r"layers\.0\.bogus"):
        mistral3.load_mistral3(tmp_path)


def _meta_counts(text_config: dict) -> tuple[int, int]:
    """(language model, language model + untied LM head) of a Mistral3ForConditionalGeneration
    with this text config, on the meta device."""
    with torch.device("meta"):
        model = TorchMistral3(Mistral3Config(text_config=text_config, tie_word_embeddings=False))
    language = sum(p.numel() for p in model.model.language_model.parameters())
    return language, language + model.lm_head.weight.numel()


def test_real_config_param_counts(tmp_path):
    # the config.json this transformers writes for the whole Mistral3 model
    Mistral3Config(text_config=MISTRAL_SMALL_3_TEXT).save_pretrained(tmp_path)
    config = mistral3.MistralTextConfig.from_dict(
        json.loads((tmp_path / "config.json").read_text())
    )
    assert config.rope_theta == 1e9 and config.sliding_window is None and config.head_dim == 128
    ours = (mistral3.count_params(config), mistral3.count_params(config, with_lm_head=True))
    assert ours == _meta_counts(MISTRAL_SMALL_3_TEXT) == REAL_COUNTS
    # transformers' Mistral3Config default text config is this one
    default = json.loads(Mistral3Config().to_json_string())
    assert mistral3.MistralTextConfig.from_dict(default) == config


def test_config_keys_and_refusals():
    flat = {k: v for k, v in TINY_TEXT.items() if k != "head_dim"}
    config = mistral3.MistralTextConfig.from_dict(flat)  # transformers 4.x keys, no head_dim
    assert config.head_dim == 48 // 6 and config.rope_theta == 1000.0
    nested = {"model_type": "mistral3", "image_token_index": 10, "text_config": TINY_TEXT}
    v5 = {**TINY_TEXT, "rope_parameters": {"rope_theta": 1000.0, "rope_type": "default"}}
    del v5["rope_theta"]
    assert mistral3.MistralTextConfig.from_dict(nested) == mistral3.MistralTextConfig.from_dict(v5)
    assert mistral3.MistralTextConfig().sliding_window == 4096  # transformers' default
    for change, message in (
        ({"rope_scaling": {"rope_type": "linear", "factor": 4.0}}, "rope_type='linear'"),
        ({"rope_scaling": {"rope_type": "yarn"}}, "'factor' is required"),
        (
            {"rope_scaling": {"type": "yarn", "factor": 2.0, "partial_rotary_factor": 0.5}},
            "partial",
        ),
        ({"num_key_value_heads": 4}, "num_key_value_heads=4"),
        ({"head_dim": 9}, "head_dim=9"),
        ({"bogus": 1}, "bogus"),
        ({"model_type": "ministral3"}, "model_type='ministral3'"),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ):
        with pytest.raises(mistral3.MistralConfigError, match=message):
            mistral3.MistralTextConfig.from_dict({**TINY_TEXT, **change})
    with pytest.raises(mistral3.MistralConfigError, match="text_config"):
        mistral3.MistralTextConfig.from_dict({"model_type": "mistral3"})
    with pytest.raises(ValueError, match=r"0\.\.3"):
        mistral3.hidden_states(mistral3.MistralTextModel(config), {}, [[0]], [[1]], (4,))
