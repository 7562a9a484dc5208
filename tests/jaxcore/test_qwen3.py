"""Qwen3 text encoder (Flux.2 [klein]'s) vs transformers' Qwen3ForCausalLM and the pipeline.

A tiny Qwen3ForCausalLM (3 layers, GQA 4 q / 2 kv heads, head_dim 16, q/k biases off) with
every parameter perturbed, saved with ``save_pretrained`` and loaded by our loader. The
prompt embedding is compared with ``Flux2KleinPipeline._get_qwen3_prompt_embeds`` itself,
called with that model and a tiny Qwen-style byte-level BPE tokenizer built here (special
tokens and a chat template honouring ``enable_thinking``, as Qwen3's does).
"""

import json

import jax
import numpy as np
import pytest
import torch
from diffusers.pipelines.flux2.pipeline_flux2_klein import Flux2KleinPipeline
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen3Config
from transformers import Qwen3ForCausalLM as TorchQwen3

from jaxcore.models import qwen3
from jaxcore.text import load_tokenizer

RTOL = 1e-5  # relative to the compared tensor's largest value; fp32, highest matmul precision

TINY = {
    "vocab_size": 320,  # the byte-level alphabet alone is 256
    "hidden_size": 48,
    "intermediate_size": 80,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rope_theta": 1000.0,
    "max_position_embeddings": 128,
}
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
# Qwen3's chat template, cut to what one user message needs (the real one has tools etc.).
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
PROMPTS = ["a red fox in the snow", "cat", "a very long prompt " * 6]
MAX_LEN = 40  # the long prompt is truncated, the short ones padded

# Real configs (config.json of Qwen/Qwen3-4B and Qwen/Qwen3-8B on the Hugging Face hub, as
# quoted in the public reference corpus: Qwen3-4B 2560 / 9728 / 36 layers / 32 q, 8 kv heads,
# head_dim 128, rope_theta 1e6, tied embeddings; Qwen3-8B 4096 / 12288, untied). Flux.2
# [klein] 4B uses Qwen3-4B, [klein] 9B Qwen3-8B.
QWEN3_4B = {
    "vocab_size": 151936,
    "hidden_size": 2560,
    "intermediate_size": 9728,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
}
QWEN3_8B = {**QWEN3_4B, "hidden_size": 4096, "intermediate_size": 12288}
QWEN3_8B["tie_word_embeddings"] = False
# (encoder = Qwen3Model, whole Qwen3ForCausalLM) from transformers on the meta device
REAL_COUNTS = {
    "4b": (4_022_468_096, 4_022_468_096),
    "8b": (7_568_405_504, 8_190_735_360),
}


def _tokenizer_dir(directory):
    """A byte-level BPE tokenizer with Qwen's special tokens, saved as a transformers one."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(["a red fox in the snow", "user assistant cat prompt long"], trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        pad_token="<|endoftext|>",
        eos_token="<|im_end|>",
        chat_template=CHAT_TEMPLATE,
    )
    fast.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """(torch model, our module, params, tokenizer directory), built once."""
    directory = tmp_path_factory.mktemp("qwen3")
    torch.manual_seed(0)
    model = TorchQwen3(Qwen3Config(**TINY)).eval()
    with torch.no_grad():
        for param in model.parameters():  # norms start at 1: perturb everything
            param.add_(0.1 * torch.randn_like(param))
    model.save_pretrained(directory)
    module, params = qwen3.load_qwen3(directory)
    tokenizer_dir = _tokenizer_dir(tmp_path_factory.mktemp("qwen3_tokenizer"))
    return model, module, params, tokenizer_dir


def _rel_err(got, expected) -> float:
    """Max abs difference over the reference's max abs."""
    got = np.asarray(got, np.float32)
    assert got.shape == expected.shape, (got.shape, expected.shape)
    return float(np.abs(got - expected).max() / np.abs(expected).max())


@pytest.mark.parametrize("side", ["right", "left"])
def test_hidden_states_match_transformers(reference, side):
    model, module, params, _ = reference
    rng = np.random.default_rng(0)
    ids = rng.integers(0, TINY["vocab_size"], (3, 12))
    lengths = np.array([12, 7, 3])
    mask = np.zeros((3, 12), np.int64)
    for b, n in enumerate(lengths):
        if side == "right":
            mask[b, :n] = 1
        else:
            mask[b, 12 - n :] = 1
    with torch.no_grad():
        out = model(
            input_ids=torch.from_numpy(ids),
            attention_mask=torch.from_numpy(mask),
            output_hidden_states=True,
            use_cache=False,
        )
    layers = (0, 1, 2, 3)
    expected = torch.stack([out.hidden_states[k] for k in layers], dim=1).numpy()

    got = qwen3.hidden_states(module, params, ids, mask, layers)

    assert np.isfinite(expected).all()
    assert _rel_err(got, expected) < RTOL
    # the last index is normed: transformers' last_hidden_state
    assert _rel_err(got[:, -1], _last_hidden(model, ids, mask)) < RTOL


def _last_hidden(model, ids, mask):
    """transformers' ``last_hidden_state`` (after ``model.norm``)."""
    with torch.no_grad():
        return model.model(
            input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask)
        ).last_hidden_state.numpy()


@pytest.mark.parametrize("side", ["right", "left"])
def test_prompt_embeds_match_the_pipeline(reference, side):
    model, module, params, tokenizer_dir = reference
    tokenizer = load_tokenizer(tokenizer_dir)
    tokenizer.padding_side = side
    layers = (1, 3, 2)
    with torch.no_grad():
        expected = Flux2KleinPipeline._get_qwen3_prompt_embeds(
            model, tokenizer, PROMPTS, max_sequence_length=MAX_LEN, hidden_states_layers=layers
        ).numpy()
    ids, mask = qwen3.tokenize_prompts(tokenizer, PROMPTS, MAX_LEN)

    got = qwen3.prompt_embeds(tokenizer, module, params, PROMPTS, MAX_LEN, layers)

    assert expected.shape == (3, MAX_LEN, 3 * TINY["hidden_size"])
    assert _rel_err(got, expected) < RTOL
    # the chat template ran with the generation prompt and thinking disabled
    text = tokenizer.decode(ids[1][mask[1] > 0])
    assert text == "<|im_start|>user\ncat<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert mask[2].all() and 0 < mask[1].sum() < MAX_LEN  # truncated / padded
    assert (mask[1, -1] == 0) == (side == "right")


def test_weights_round_trip(reference):
    model, module, params, _ = reference
    from jaxcore import weights

    state = {k: v.numpy() for k, v in model.state_dict().items() if not k.startswith("lm_head")}
    exported = weights.export_state_dict(params, qwen3.weight_map(module.config))
    assert set(exported) == set(state)
    for key, value in state.items():
        np.testing.assert_array_equal(exported[key], value, err_msg=key)
    _, fresh = qwen3.init_qwen3(module.config, jax.random.key(0))
    assert jax.tree.map(np.shape, fresh) == jax.tree.map(np.shape, params)


def _meta_counts(cfg: dict) -> tuple[int, int]:
    """(Qwen3Model, Qwen3ForCausalLM) parameter counts on the meta device."""
    with torch.device("meta"):
        model = TorchQwen3(Qwen3Config(**cfg))
    whole = sum(p.numel() for p in model.parameters())  # a tied head is counted once
    return sum(p.numel() for p in model.model.parameters()), whole


@pytest.mark.parametrize(("name", "cfg"), [("4b", QWEN3_4B), ("8b", QWEN3_8B)])
def test_real_config_param_counts(name, cfg, tmp_path):
    Qwen3Config(**cfg).save_pretrained(tmp_path)  # the config.json this transformers writes
    config = qwen3.Qwen3Config.from_dict(json.loads((tmp_path / "config.json").read_text()))
    assert config.rope_theta == 1e6 and config.num_key_value_heads == 8
    ours = (qwen3.count_params(config), qwen3.count_params(config, with_lm_head=True))
    assert ours == _meta_counts(cfg) == REAL_COUNTS[name]


def test_config_refusals():
    for change, message in (
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type='yarn'"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"num_key_value_heads": 3}, "num_key_value_heads=3"),
        ({"bogus": 1}, "bogus"),
        ({"model_type": "qwen2"}, "model_type"),
    ):
        with pytest.raises(qwen3.Qwen3ConfigError, match=message):
            qwen3.Qwen3Config.from_dict({**TINY, **change})
    legacy = qwen3.Qwen3Config.from_dict({**TINY, "rope_scaling": None})  # transformers 4.x
    assert legacy.rope_theta == 1000.0
    with pytest.raises(ValueError, match=r"0\.\.3"):
        qwen3.hidden_states(qwen3.Qwen3Model(legacy), {}, [[0]], [[1]], (4,))
