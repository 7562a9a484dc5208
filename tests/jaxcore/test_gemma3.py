"""Gemma-3 text encoder (LTX-2's) vs transformers' Gemma3ForConditionalGeneration and the
pipeline's ``_get_gemma_prompt_embeds``.

A tiny Gemma3ForConditionalGeneration (tests/support/tiny_ltx2.py: 6 layers, local and global
with a sliding window of 5 tokens, linear RoPE scaling, GQA, query_pre_attn_scalar != head_dim)
with every parameter perturbed, saved with ``save_pretrained`` and loaded by our loader. The
prompt embedding is compared with ``LTX2Pipeline._get_gemma_prompt_embeds`` itself, called
unbound with that model and a tiny Gemma-style tokenizer (BOS in front, pad 0 / eos 1).
"""

import json
import types

import jax
import numpy as np
import pytest
import torch
from diffusers.pipelines.ltx2.pipeline_ltx2 import LTX2Pipeline
from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig
from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

from jaxcore import weights
from jaxcore.models import gemma3
from jaxcore.text import load_tokenizer
from tests.support import tiny_ltx2

RTOL = 1e-5  # relative to the compared tensor's largest value; fp32

# transformers' Gemma3 never applies attn_logit_softcapping (its attention does not pass it on);
# a cap of 0.5 would flatten every score if it did, so parity proves ours ignores it too.
TINY_TEXT = {**tiny_ltx2.GEMMA3_TEXT, "attn_logit_softcapping": 0.5}
PROMPTS = ["  a red fox in the snow ", "cat", "a very long prompt " * 6]
MAX_LEN = 24  # the long prompt is truncated, the short ones padded (window 5 < prompt)

# google/gemma-3-12b-it's config.json (LTX-2's text encoder) as quoted in the public reference
# corpus (an LTX-2 trainer that builds Gemma3ForConditionalGeneration from it for ComfyUI
# checkpoints; transformers 4.51.3 keys), its text_config and vision_config. MaxText's
# gemma3-12b model config agrees (48 layers, 3840 wide, 16 q / 8 kv heads).
GEMMA3_12B_TEXT = {
    "attention_bias": False,
    "attn_logit_softcapping": None,
    "final_logit_softcapping": None,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 3840,
    "intermediate_size": 15360,
    "max_position_embeddings": 131072,
    "model_type": "gemma3_text",
    "num_attention_heads": 16,
    "num_hidden_layers": 48,
    "num_key_value_heads": 8,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06,
    "rope_local_base_freq": 10000,
    "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
    "rope_theta": 1000000,
    "sliding_window": 1024,
    "sliding_window_pattern": 6,
    "vocab_size": 262208,
}
GEMMA3_12B_VISION = {
    "hidden_act": "gelu_pytorch_tanh",
    "hidden_size": 1152,
    "image_size": 896,
    "intermediate_size": 4304,
    "layer_norm_eps": 1e-06,
    "model_type": "siglip_vision_model",
    "num_attention_heads": 16,
    "num_hidden_layers": 27,
    "patch_size": 14,
    "vision_use_head": False,
}
# Gemma3TextModel's parameters in transformers on the meta device for GEMMA3_12B_TEXT.
GEMMA3_12B_TEXT_PARAMS = 11_766_034_176


def _torch_config(text: dict, vision: dict, mm_tokens: int = 256) -> Gemma3Config:
    return Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=mm_tokens)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """(torch model, our module, params, tokenizer directory), built once."""
    directory = tmp_path_factory.mktemp("gemma3")
    torch.manual_seed(0)
    config = _torch_config(TINY_TEXT, tiny_ltx2.GEMMA3_VISION, tiny_ltx2.GEMMA3_MM_TOKENS_PER_IMAGE)
    model = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for param in model.parameters():  # norms start at 0 (a factor 1): perturb everything
            param.add_(0.1 * torch.randn_like(param))
    model.save_pretrained(directory)
    module, params = gemma3.load_gemma3(directory)
    tokenizer_dir = tiny_ltx2.gemma_tokenizer_dir(tmp_path_factory.mktemp("gemma_tokenizer"))
    return model, module, params, tokenizer_dir


def _rel_err(got, expected) -> float:
    """Max abs difference over the reference's max abs."""
    got = np.asarray(got, np.float32)
    assert got.shape == expected.shape, (got.shape, expected.shape)
    return float(np.abs(got - expected).max() / np.abs(expected).max())


def _padded_mask(lengths, length: int, side: str) -> np.ndarray:
    mask = np.zeros((len(lengths), length), np.int64)
    for b, n in enumerate(lengths):
        mask[b, :n] = 1 if side == "right" else 0
        if side == "left":
            mask[b, length - n :] = 1
    return mask


def test_config_has_both_layer_kinds(reference):
    model, module, _, _ = reference
    c = module.config
    assert c.layer_types == tuple(model.config.text_config.layer_types)
    assert set(c.layer_types) == {"sliding_attention", "full_attention"}
    assert c.rope_factor == 8.0 and c.rope_local_base_freq == 100.0
    assert c.sliding_window < MAX_LEN


@pytest.mark.parametrize("side", ["right", "left"])
def test_hidden_states_match_transformers(reference, side):
    model, module, params, _ = reference
    rng = np.random.default_rng(0)
    length = 14
    ids = rng.integers(0, TINY_TEXT["vocab_size"], (3, length))
    mask = _padded_mask([14, 9, 3], length, side)
    with torch.no_grad():
        out = model(
            input_ids=torch.from_numpy(ids),
            attention_mask=torch.from_numpy(mask),
            output_hidden_states=True,
        )
    expected = torch.stack(out.hidden_states).numpy()  # [N + 1, B, L, D]

    got = gemma3.hidden_states(module, params, ids, mask)

    assert expected.shape[0] == TINY_TEXT["num_hidden_layers"] + 1
    assert np.isfinite(expected).all()
    assert _rel_err(got, expected) < RTOL
    # every state on its own too (a small late layer must not hide behind a large one)
    for k in range(expected.shape[0]):
        assert _rel_err(got[k], expected[k]) < RTOL, k


@pytest.mark.parametrize("variant", ["right_padded_tokenizer", "no_pad_token"])
def test_prompt_embeds_match_the_pipeline(reference, variant, tmp_path):
    model, module, params, tokenizer_dir = reference
    if variant == "no_pad_token":
        tokenizer_dir = tiny_ltx2.gemma_tokenizer_dir(tmp_path, with_pad_token=False)
    theirs, ours = load_tokenizer(tokenizer_dir), load_tokenizer(tokenizer_dir)
    for tokenizer in (theirs, ours):
        tokenizer.padding_side = "right"  # the pipeline sets "left" whatever it was
    pipe = types.SimpleNamespace(tokenizer=theirs, text_encoder=model)
    with torch.no_grad():
        expected, expected_mask = LTX2Pipeline._get_gemma_prompt_embeds(
            pipe,
            PROMPTS,
            num_videos_per_prompt=2,
            max_sequence_length=MAX_LEN,
            device=torch.device("cpu"),
            dtype=torch.float32,
        )

    got, got_mask = gemma3.prompt_embeds(ours, module, params, PROMPTS, 2, MAX_LEN)

    k = TINY_TEXT["num_hidden_layers"] + 1
    assert expected.shape == (6, MAX_LEN, TINY_TEXT["hidden_size"] * k)
    assert _rel_err(got, expected.numpy()) < RTOL
    np.testing.assert_array_equal(got_mask, expected_mask.numpy())
    # left padding, BOS first, the long prompt truncated, the short ones padded
    ids, mask = gemma3.tokenize_prompts(ours, PROMPTS, MAX_LEN)
    assert ours.padding_side == "left" and mask[1, 0] == 0 and mask[1, -1] == 1
    assert mask[2].all() and ids[2, 0] == ours.bos_token_id
    assert ids[1, int(np.argmax(mask[1]))] == ours.bos_token_id
    assert ours.decode(ids[0][mask[0] > 0], skip_special_tokens=True) == "a red fox in the snow"


def test_weights_round_trip(reference):
    model, module, params, _ = reference
    prefix = "model.language_model."  # transformers' in-memory names (it saves the others)
    state = {k: v.numpy() for k, v in model.state_dict().items() if k.startswith(prefix)}
    exported = weights.export_state_dict(params, gemma3.weight_map(module.config, prefix))
    assert set(exported) == set(state)
    for key, value in state.items():
        np.testing.assert_array_equal(exported[key], value, err_msg=key)
    _, fresh = gemma3.init_gemma3(module.config, jax.random.key(0))
    assert jax.tree.map(np.shape, fresh) == jax.tree.map(np.shape, params)


def test_loader_reads_a_text_only_checkpoint(reference, tmp_path):
    """A Gemma3TextModel saved alone (no prefix) loads to the same parameters."""
    model, module, params, _ = reference
    prefix = "model.language_model."
    state = {
        k[len(prefix) :]: v.numpy() for k, v in model.state_dict().items() if k.startswith(prefix)
    }
    weights.save_safetensors(state, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(module.config.to_dict()))
    again, loaded = gemma3.load_gemma3(tmp_path)
    assert again.config == module.config
    jax.tree.map(np.testing.assert_array_equal, loaded, params)


def test_real_config_param_count(tmp_path):
    _torch_config(GEMMA3_12B_TEXT, GEMMA3_12B_VISION).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())  # transformers 5 keys
    config = gemma3.Gemma3TextConfig.from_dict(saved)
    assert config.rope_factor == 8.0 and config.rope_theta == 1e6
    assert config.rope_local_base_freq == 1e4 and config.sliding_window == 1024
    assert (
        config.layer_types.count("full_attention") == 8
        and config.layer_types[5] == "full_attention"
    )
    assert config == gemma3.Gemma3TextConfig.from_dict({"text_config": GEMMA3_12B_TEXT})  # 4.x keys
    with torch.device("meta"):
        model = Gemma3ForConditionalGeneration(_torch_config(GEMMA3_12B_TEXT, GEMMA3_12B_VISION))
    theirs = sum(p.numel() for p in model.model.language_model.parameters())
    assert gemma3.count_params(config) == theirs == GEMMA3_12B_TEXT_PARAMS


def test_rope_tables_match_transformers_at_the_12b_config():
    """Both RoPEs of the 12B (local base 1e4, global 1e6 scaled by 8) over 1024 positions
    (LTX-2's prompt length): equal to transformers' tables within a float32 ulp."""
    config = gemma3.Gemma3TextConfig.from_dict(GEMMA3_12B_TEXT)
    rope = Gemma3RotaryEmbedding(Gemma3TextConfig(**GEMMA3_12B_TEXT))
    positions = torch.arange(1024)[None]
    for kind, theta, factor in (
        ("sliding_attention", config.rope_local_base_freq, 1.0),
        ("full_attention", config.rope_theta, config.rope_factor),
    ):
        cos, sin = rope(torch.zeros(1), positions, kind)
        got = gemma3.rope_cos_sin(1024, config.head_dim, theta, factor)
        assert np.abs(got[0] - cos[0].numpy()).max() <= 6e-8, kind
        assert np.abs(got[1] - sin[0].numpy()).max() <= 6e-8, kind


def test_config_refusals():
    for change, message in (
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type='yarn'"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"num_key_value_heads": 3}, "num_key_value_heads=3"),
        ({"hidden_activation": "gelu"}, "hidden_activation"),
        ({"layer_types": ["sliding_attention"]}, "layer_types"),
        ({"bogus": 1}, "bogus"),
        ({"model_type": "gemma2"}, "model_type"),
    ):
        with pytest.raises(gemma3.Gemma3ConfigError, match=message):
            gemma3.Gemma3TextConfig.from_dict({**tiny_ltx2.GEMMA3_TEXT, **change})
