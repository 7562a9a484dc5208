"""LTX-2 text connectors vs diffusers' LTX2TextConnectors, called as LTX2Pipeline calls them.

Three tiny layouts (tests/support/tiny_ltx2.py): LTX-2.0's (shared projection of masked
mean/range features, learnable registers, split RoPE), LTX-2.3's (per-modality projections,
gated attention, audio narrower than video) and one without registers (the padding masked in
attention, interleaved RoPE in float32). Every parameter is perturbed, the model saved with
``save_pretrained`` and loaded by our loader; inputs are packed states with per-sample padding.
"""

import json
import types

import jax
import numpy as np
import pytest
import torch
from diffusers.pipelines.ltx2.connectors import LTX2RotaryPosEmbed1d
from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors as TorchConnectors
from diffusers.pipelines.ltx2.pipeline_ltx2 import LTX2Pipeline
from transformers import Gemma3Config, Gemma3ForConditionalGeneration

from jaxcore import weights
from jaxcore.models import gemma3
from jaxcore.models import ltx2_connectors as connectors
from jaxcore.text import load_tokenizer
from tests.support import tiny_ltx2

RTOL = 1e-5  # relative to the compared tensor's largest value; fp32

LAYOUTS = {
    "ltx20": tiny_ltx2.CONNECTORS_LTX20,
    "ltx23": tiny_ltx2.CONNECTORS_LTX23,
    "no_registers": tiny_ltx2.CONNECTORS_NO_REGISTERS,
}
LENGTH = 16  # a multiple of every tiny layout's registers
REAL_TOKENS = [16, 9, 3]  # one unpadded sample, two padded

# The released configs: diffusers' scripts/convert_ltx2_to_diffusers.py,
# get_ltx2_connectors_config("2.0") and ("2.3") (diffusers main, public reference corpus).
LTX20 = {
    "caption_channels": 3840,
    "text_proj_in_factor": 49,
    "video_connector_num_attention_heads": 30,
    "video_connector_attention_head_dim": 128,
    "video_connector_num_layers": 2,
    "video_connector_num_learnable_registers": 128,
    "audio_connector_num_attention_heads": 30,
    "audio_connector_attention_head_dim": 128,
    "audio_connector_num_layers": 2,
    "audio_connector_num_learnable_registers": 128,
    "connector_rope_base_seq_len": 4096,
    "rope_theta": 10000.0,
    "rope_double_precision": True,
    "causal_temporal_positioning": False,
    "rope_type": "split",
}
LTX23 = {
    **LTX20,
    "video_connector_num_attention_heads": 32,
    "video_connector_num_layers": 8,
    "video_gated_attn": True,
    "audio_connector_num_attention_heads": 32,
    "audio_connector_attention_head_dim": 64,
    "audio_connector_num_layers": 8,
    "audio_gated_attn": True,
    "per_modality_projections": True,
    "video_hidden_dim": 4096,
    "audio_hidden_dim": 2048,
    "proj_bias": True,
}
# diffusers' LTX2TextConnectors parameter counts on the meta device for LTX20 / LTX23.
REAL_COUNTS = {"ltx20": 1_431_475_200, "ltx23": 3_172_227_584}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def reference(request, tmp_path_factory):
    """(layout name, torch model, our module, params), one per layout."""
    directory = tmp_path_factory.mktemp(f"connectors_{request.param}")
    torch.manual_seed(0)
    model = TorchConnectors(**LAYOUTS[request.param]).eval()
    with torch.no_grad():
        for param in model.parameters():  # norms start at 1, biases at 0: perturb everything
            param.add_(0.1 * torch.randn_like(param))
    model.save_pretrained(directory)
    module, params = connectors.load_ltx2_connectors(directory)
    return request.param, model, module, params


def _rel_err(got, expected) -> float:
    """Max abs difference over the reference's max abs."""
    got = np.asarray(got, np.float32)
    assert got.shape == expected.shape, (got.shape, expected.shape)
    return float(np.abs(got - expected).max() / np.abs(expected).max())


def _inputs(config: dict, side: str, seed: int = 0):
    """Packed states ``[3, L, C * K]`` (scaled per hidden state, as real ones differ) and a
    0/1 mask padded on ``side``."""
    rng = np.random.default_rng(seed)
    c, k = config["caption_channels"], config["text_proj_in_factor"]
    states = rng.standard_normal((3, LENGTH, c, k)) * np.geomspace(0.5, 20, k)
    mask = np.zeros((3, LENGTH), np.int64)
    for b, n in enumerate(REAL_TOKENS):
        if side == "left":
            mask[b, LENGTH - n :] = 1
        else:
            mask[b, :n] = 1
    return states.reshape(3, LENGTH, c * k).astype(np.float32), mask


@pytest.mark.parametrize("side", ["left", "right"])
def test_matches_diffusers(reference, side):
    name, model, module, params = reference
    states, mask = _inputs(LAYOUTS[name], side)
    with torch.no_grad():
        video, audio, video_mask = model(
            torch.from_numpy(states), torch.from_numpy(mask), padding_side=side
        )

    got_video, got_audio, got_mask = connectors.encode(module, params, states, mask, side)

    assert np.isfinite(video.numpy()).all() and np.isfinite(audio.numpy()).all()
    assert _rel_err(got_video, video.numpy()) < RTOL
    assert _rel_err(got_audio, audio.numpy()) < RTOL
    np.testing.assert_array_equal(got_mask, video_mask.numpy())
    # per sample too: the short prompts must not hide behind the full one
    for b in range(3):
        assert _rel_err(got_video[b], video.numpy()[b]) < RTOL, b
        assert _rel_err(got_audio[b], audio.numpy()[b]) < RTOL, b


def test_unpacked_states_give_the_same(reference):
    """diffusers takes [B, L, C, K] as well as the packed [B, L, C * K]."""
    name, _, module, params = reference
    config = LAYOUTS[name]
    states, mask = _inputs(config, "left", seed=1)
    unpacked = states.reshape(3, LENGTH, config["caption_channels"], -1)
    packed_out = connectors.encode(module, params, states, mask)
    unpacked_out = connectors.encode(module, params, unpacked, mask)
    for a, b in zip(packed_out, unpacked_out, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_weights_round_trip(reference):
    _, model, module, params = reference
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    exported = weights.export_state_dict(params, connectors.weight_map(module.config))
    assert set(exported) == set(state)
    for key, value in state.items():
        np.testing.assert_array_equal(exported[key], value, err_msg=key)
    _, fresh = connectors.init_ltx2_connectors(module.config, jax.random.key(0))
    assert jax.tree.map(np.shape, fresh) == jax.tree.map(np.shape, params)


def test_register_length_is_checked(reference):
    name, _, module, params = reference
    if LAYOUTS[name]["video_connector_num_learnable_registers"] is None:
        pytest.skip("no registers in this layout: any length is valid")
    states, mask = _inputs(LAYOUTS[name], "left")
    with pytest.raises(ValueError, match="multiple of its num_learnable_registers"):
        connectors.encode(module, params, states[:, :-1], mask[:, :-1])


@pytest.mark.parametrize(("name", "cfg"), [("ltx20", LTX20), ("ltx23", LTX23)])
def test_real_config_param_counts(name, cfg, tmp_path):
    with torch.device("meta"):
        model = TorchConnectors(**cfg)
    model.save_config(tmp_path)  # the config.json diffusers writes
    config = connectors.LTX2TextConnectorsConfig.from_dict(
        json.loads((tmp_path / "config.json").read_text())
    )
    theirs = sum(p.numel() for p in model.parameters())
    assert connectors.count_params(config) == theirs == REAL_COUNTS[name]


@pytest.mark.parametrize(("name", "cfg"), [("ltx20", LTX20), ("ltx23", LTX23)])
def test_rope_tables_match_diffusers_at_real_widths(name, cfg):
    """The released (float64) RoPE at full width and 1024 tokens, where angles reach ~1.6e4
    rad: equal to diffusers' tables within a float32 ulp of cos / sin."""
    config = connectors.LTX2TextConnectorsConfig.from_dict(cfg)
    for side in ("video", "audio"):
        ours = config.connector(side)
        ref = LTX2RotaryPosEmbed1d(
            ours.inner_dim, 4096, 10000.0, True, "split", ours.num_attention_heads
        )
        cos, sin = ref(1, 1024, "cpu")  # [1, H, L, head_dim / 2]
        got = connectors.rope_cos_sin(1024, ours)
        for table, expected in zip(got, (cos, sin), strict=True):
            per_head = table.reshape(1024, ours.num_attention_heads, -1).transpose(1, 0, 2)
            assert np.abs(per_head - expected[0].numpy()).max() <= 6e-8, (name, side)


def test_config_refusals():
    base = tiny_ltx2.CONNECTORS_LTX20
    for change, message in (
        ({"rope_type": "rotary"}, "rope_type"),
        ({"caption_channels": 12}, "caption_channels=12"),
        ({"per_modality_projections": True, "video_hidden_dim": 8}, "video_hidden_dim=8"),
        (
            {"video_connector_attention_head_dim": 3, "video_connector_num_attention_heads": 4},
            "even",
        ),
        ({"bogus": 1}, "bogus"),
    ):
        with pytest.raises(connectors.LTX2ConnectorsConfigError, match=message):
            connectors.LTX2TextConnectorsConfig.from_dict({**base, **change})


def _perturbed(model):
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn_like(param))
    return model.eval()


def test_pipeline_text_path_end_to_end(tmp_path):
    """The pipeline's text path from prompts to the transformer's conditioning:
    ``_get_gemma_prompt_embeds`` then ``connectors(embeds, mask, padding_side=...)``, with the
    negative prompt "" (BOS alone) in the batch as classifier-free guidance puts it."""
    torch.manual_seed(0)
    text_config = Gemma3Config(
        text_config=tiny_ltx2.GEMMA3_TEXT,
        vision_config=tiny_ltx2.GEMMA3_VISION,
        mm_tokens_per_image=tiny_ltx2.GEMMA3_MM_TOKENS_PER_IMAGE,
    )
    encoder = _perturbed(Gemma3ForConditionalGeneration(text_config))
    encoder.save_pretrained(tmp_path / "text_encoder")
    heads = _perturbed(TorchConnectors(**tiny_ltx2.CONNECTORS_FOR_TINY_GEMMA3))
    heads.save_pretrained(tmp_path / "connectors")
    tokenizer_dir = tiny_ltx2.gemma_tokenizer_dir(tmp_path / "tokenizer")
    theirs, ours = load_tokenizer(tokenizer_dir), load_tokenizer(tokenizer_dir)
    prompts, max_len = ["", "a red fox in the snow", "a cat on a mat, a long prompt " * 3], 24
    with torch.no_grad():
        pipe = types.SimpleNamespace(tokenizer=theirs, text_encoder=encoder)
        embeds, mask = LTX2Pipeline._get_gemma_prompt_embeds(
            pipe, prompts, 1, max_len, device=torch.device("cpu"), dtype=torch.float32
        )
        expected = heads(embeds, mask, padding_side=theirs.padding_side)

    module, params = gemma3.load_gemma3(tmp_path / "text_encoder")
    got_embeds, got_mask = gemma3.prompt_embeds(ours, module, params, prompts, 1, max_len)
    head_module, head_params = connectors.load_ltx2_connectors(tmp_path / "connectors")
    got = connectors.encode(
        head_module, head_params, got_embeds, got_mask, padding_side=ours.padding_side
    )

    assert got_mask[0].sum() == 1 and got_mask[2].all()  # BOS alone; truncated
    assert _rel_err(got[0], expected[0].numpy()) < RTOL
    assert _rel_err(got[1], expected[1].numpy()) < RTOL
    np.testing.assert_array_equal(got[2], expected[2].numpy())
