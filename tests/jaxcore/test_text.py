"""Tiny tokenizer round trip and encode_prompts vs diffusers' WanPipeline prompt encoding."""

import types

import numpy as np
import pytest
import torch
import transformers
from diffusers.pipelines.wan.pipeline_wan import WanPipeline

from jaxcore import text
from jaxcore.models import umt5
from pipelines.embedded.tokenizers import build_tiny_tokenizer

# fp32 parity of the whole encode path (tokenize -> encoder -> trim/zero-pad); reached 1.3e-6 (max_len 16), 1.4e-6 (max_len 64).
ATOL = 2e-5
MAX_LEN = 16

PROMPTS = [
    "A red circle on a blue background",
    "green",
    # html entity, extra whitespace and an unseen word (spelled out); longer than MAX_LEN tokens
    "  a   bright yellow star &amp; a dark   purple hexagon rotating slowly over a zebra ",
]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tokenizer")
    build_tiny_tokenizer(directory, vocab_size=128)
    return directory


@pytest.fixture(scope="module")
def encoder_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("umt5")
    torch.manual_seed(0)
    config = transformers.UMT5Config(
        vocab_size=128,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
    )
    transformers.UMT5EncoderModel(config).eval().save_pretrained(directory)
    return directory


def _wan_reference(tokenizer, torch_encoder, prompts, max_sequence_length):
    """Run diffusers' own WanPipeline._get_t5_prompt_embeds on a minimal stand-in pipeline."""
    pipe = types.SimpleNamespace(
        tokenizer=tokenizer, text_encoder=torch_encoder, _execution_device=torch.device("cpu")
    )
    with torch.no_grad():
        embeds = WanPipeline._get_t5_prompt_embeds(
            pipe,
            prompt=prompts,
            max_sequence_length=max_sequence_length,
            device=torch.device("cpu"),
            dtype=torch.float32,
        )
    return embeds.numpy()


def test_tiny_tokenizer_round_trips_through_autotokenizer(tmp_path):
    built = build_tiny_tokenizer(tmp_path, vocab_size=128)
    loaded = text.load_tokenizer(tmp_path)
    assert type(loaded).__name__ == "T5Tokenizer"
    assert len(loaded) == 128
    assert (loaded.pad_token_id, loaded.eos_token_id, loaded.unk_token_id) == (0, 1, 2)
    for prompt in PROMPTS:
        assert loaded(prompt).input_ids == built(prompt).input_ids
    ids = loaded("red circle on a blue background").input_ids
    assert loaded.convert_ids_to_tokens(ids) == [
        "▁red",
        "▁circle",
        "▁on",
        "▁a",
        "▁blue",
        "▁background",
        "</s>",
    ]
    assert loaded.decode(ids, skip_special_tokens=True) == "red circle on a blue background"
    # Unseen words are spelled out, unknown characters become <unk>.
    assert loaded.convert_ids_to_tokens(loaded("zebra ~").input_ids) == [
        "▁",
        "z",
        "e",
        "b",
        "r",
        "a",
        "▁",
        "<unk>",
        "</s>",
    ]


def test_tiny_tokenizer_rejects_small_vocab(tmp_path):
    with pytest.raises(ValueError, match="vocab_size=50"):
        build_tiny_tokenizer(tmp_path, vocab_size=50)


def test_load_tokenizer_missing_directory(tmp_path):
    from pipelines.cli import user_error_types

    with pytest.raises(FileNotFoundError, match="no_such_dir") as raised:
        text.load_tokenizer(tmp_path / "no_such_dir")
    # every family's tokenizers load here: the CLI reports a missing one as the user's error,
    # one line naming the folder, not a traceback
    assert isinstance(raised.value, user_error_types())


def test_prompt_clean_matches_diffusers():
    from diffusers.pipelines.wan.pipeline_wan import prompt_clean

    for prompt in [*PROMPTS, "tab\there\nnewline", "&amp;lt;b&amp;gt; x\u00a0y\u3000z"]:
        assert text.prompt_clean(prompt) == prompt_clean(prompt)


def test_encode_prompts_matches_wan_pipeline(tokenizer_dir, encoder_dir):
    tokenizer = text.load_tokenizer(tokenizer_dir)
    torch_encoder = transformers.UMT5EncoderModel.from_pretrained(encoder_dir).eval()
    expected = _wan_reference(tokenizer, torch_encoder, PROMPTS, MAX_LEN)

    module, params = umt5.load_umt5(encoder_dir)
    embeddings, lengths = text.encode_prompts(
        tokenizer, module, params, PROMPTS, max_sequence_length=MAX_LEN
    )

    assert embeddings.shape == expected.shape == (3, MAX_LEN, 32)
    assert embeddings.dtype == np.float32
    _, mask = text.tokenize_prompts(tokenizer, PROMPTS, MAX_LEN)
    np.testing.assert_array_equal(lengths, mask.sum(1))
    assert lengths[1] == 2 and lengths[2] == MAX_LEN  # "green </s>"; the long one truncated
    err = np.abs(embeddings - expected).max()
    assert err < ATOL, f"max abs error {err:.2e}"
    for row, length in zip(embeddings, lengths, strict=True):
        assert np.all(row[length:] == 0.0)
        assert np.all(np.abs(row[:length]).max(axis=-1) > 0)


def test_pad_batch_to_reuses_one_compilation(tokenizer_dir, encoder_dir):
    tokenizer = text.load_tokenizer(tokenizer_dir)
    module, params = umt5.load_umt5(encoder_dir)
    full, full_lengths = text.encode_prompts(tokenizer, module, params, PROMPTS, MAX_LEN)

    encode = text._jitted_encoder(module)
    before = encode._cache_size()
    one, one_lengths = text.encode_prompts(
        tokenizer, module, params, PROMPTS[1:2], MAX_LEN, pad_batch_to=4
    )
    two, two_lengths = text.encode_prompts(
        tokenizer, module, params, PROMPTS[:2], MAX_LEN, pad_batch_to=4
    )
    assert encode._cache_size() == before + 1  # both padded calls share one compilation
    assert one.shape == (1, MAX_LEN, 32) and two.shape == (2, MAX_LEN, 32)
    # Row results do not depend on the rest of the batch (up to fp32 gemm blocking, ~1e-6).
    np.testing.assert_allclose(one[0], full[1], atol=1e-5)
    np.testing.assert_allclose(two, full[:2], atol=1e-5)
    np.testing.assert_array_equal(two_lengths, full_lengths[:2])
    assert one_lengths.tolist() == [2]

    with pytest.raises(ValueError, match="pad_batch_to=2"):
        text.encode_prompts(tokenizer, module, params, PROMPTS, MAX_LEN, pad_batch_to=2)


def test_encoding_length_is_the_next_power_of_two_within_bounds():
    assert [text.encoding_length(n, 512) for n in (0, 1, 16, 17, 33, 300, 512)] == [
        16,
        16,
        16,
        32,
        64,
        512,
        512,
    ]
    assert text.encoding_length(20, 24) == 24  # never past max_sequence_length
    assert text.encoding_length(3, 8) == 8


def test_short_batches_run_only_their_tokens_and_match_wan_pipeline(
    tokenizer_dir, encoder_dir, monkeypatch
):
    """At max_sequence_length 64 a batch of short prompts runs the encoder on 16 tokens, a
    batch with the long prompt on 32, and both equal diffusers' 64-token encoding."""
    max_len = 64
    tokenizer = text.load_tokenizer(tokenizer_dir)
    torch_encoder = transformers.UMT5EncoderModel.from_pretrained(encoder_dir).eval()
    module, params = umt5.load_umt5(encoder_dir)
    seen = []
    jitted = text._jitted_encoder(module)

    def recording(module_):
        def encode(params_, ids_bl, mask_bl):
            seen.append(ids_bl.shape[1])
            return jitted(params_, ids_bl, mask_bl)

        return encode

    monkeypatch.setattr(text, "_jitted_encoder", recording)
    _, mask = text.tokenize_prompts(tokenizer, PROMPTS, max_len)
    assert 16 < mask[2].sum() <= 32 and mask[:2].sum(axis=1).max() <= 16
    for prompts, length in ((PROMPTS[:2], 16), (PROMPTS, 32)):
        expected = _wan_reference(tokenizer, torch_encoder, prompts, max_len)
        embeddings, lengths = text.encode_prompts(tokenizer, module, params, prompts, max_len)
        assert seen[-1] == length
        assert embeddings.shape == expected.shape == (len(prompts), max_len, 32)
        err = np.abs(embeddings - expected).max()
        assert err < ATOL, f"{len(prompts)} prompts: max abs error {err:.2e}"
        for row, n in zip(embeddings, lengths, strict=True):
            assert np.all(row[n:] == 0.0)


def test_prompts_must_be_a_list(tokenizer_dir):
    tokenizer = text.load_tokenizer(tokenizer_dir)
    with pytest.raises(TypeError, match="list of strings"):
        text.tokenize_prompts(tokenizer, "a red circle", MAX_LEN)


def test_threads_sharing_a_tokenizer_get_their_own_lengths(tokenizer_dir):
    """A fast tokenizer keeps truncation / padding on its shared backend; without the lock in
    call_tokenizer, threads tokenizing at different lengths got each other's (about one call
    in ten padded to another thread's length here)."""
    import threading

    tokenizer = text.load_tokenizer(tokenizer_dir)
    jobs = [([f"a red circle number {i} " * (50 + i % 5)] * 16, 8 + i % 24) for i in range(200)]
    expected = [text.tokenize_prompts(tokenizer, prompts, length) for prompts, length in jobs]
    got = [None] * len(jobs)

    def work(first: int):
        for i in range(first, len(jobs), 8):
            got[i] = text.tokenize_prompts(tokenizer, *jobs[i])

    threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for (ids, mask), (want_ids, want_mask) in zip(got, expected, strict=True):
        np.testing.assert_array_equal(ids, want_ids)
        np.testing.assert_array_equal(mask, want_mask)
