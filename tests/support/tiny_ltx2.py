"""Tiny LTX-2 configs for tests, built against diffusers/transformers (PyTorch).

Each LTX-2 part keeps its constants in its own clearly named section; append yours below.
"""

from __future__ import annotations

from pathlib import Path

# --- text side: Gemma-3 text encoder, its tokenizer, the text connectors -------------------------

# A Gemma-3 text config small enough for CPU tests yet with every variant the 12B uses: local and
# global layers (sliding_window_pattern 3: layers 3 and 6 global) with a window shorter than the
# prompts, linear RoPE scaling on the global layers (the 12B's factor 8), distinct local/global
# bases, GQA, and a query_pre_attn_scalar that is not head_dim (so the score scale is tested).
GEMMA3_TEXT = dict(
    vocab_size=320,  # the byte-level alphabet alone is 256
    hidden_size=48,
    intermediate_size=80,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    sliding_window=5,
    sliding_window_pattern=3,
    rope_theta=10_000.0,
    rope_local_base_freq=100.0,
    rope_scaling={"rope_type": "linear", "factor": 8.0},
    query_pre_attn_scalar=24,
    max_position_embeddings=256,
)
# The vision tower Gemma3ForConditionalGeneration always builds (never run by the encoder).
GEMMA3_VISION = dict(
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    image_size=28,
    patch_size=14,
)
GEMMA3_MM_TOKENS_PER_IMAGE = 4  # (28 / 14) ** 2

# Gemma's special tokens (pad 0, eos 1, bos 2 as in the real vocabulary's order).
GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]


def gemma_tokenizer_dir(directory: str | Path, *, with_pad_token: bool = True) -> Path:
    """A byte-level BPE tokenizer with Gemma's special tokens that adds ``<bos>`` in front (as
    Gemma's does), saved as a transformers tokenizer; ``with_pad_token=False`` leaves the pad
    token unset (the pipeline then pads with EOS)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=GEMMA_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(["a red fox in the snow", "a cat on a mat, a long prompt"], trainer)
    bos = bpe.token_to_id("<bos>")
    bpe.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", bos)]
    )
    tokens = {"bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>"}
    if with_pad_token:
        tokens["pad_token"] = "<pad>"
    fast = PreTrainedTokenizerFast(tokenizer_object=bpe, **tokens)
    fast.save_pretrained(directory)
    return Path(directory)


# LTX2TextConnectors, tiny, one per released layout. Text states are GEMMA3-like packs of
# caption_channels x text_proj_in_factor; text lengths in tests are multiples of the registers.
# LTX-2.0: one shared projection, masked mean/range features, registers, "split" RoPE.
CONNECTORS_LTX20 = dict(
    caption_channels=16,
    text_proj_in_factor=3,
    video_connector_num_attention_heads=4,
    video_connector_attention_head_dim=4,
    video_connector_num_layers=2,
    video_connector_num_learnable_registers=4,
    audio_connector_num_attention_heads=2,
    audio_connector_attention_head_dim=8,
    audio_connector_num_layers=1,
    audio_connector_num_learnable_registers=8,
    connector_rope_base_seq_len=32,
    rope_theta=10000.0,
    rope_double_precision=True,
    rope_type="split",
)
# LTX-2.3: per-modality projections (biased) of RMS-normed features, gated attention, audio
# narrower than video.
CONNECTORS_LTX23 = dict(
    caption_channels=12,
    text_proj_in_factor=3,
    video_connector_num_attention_heads=4,
    video_connector_attention_head_dim=4,
    video_connector_num_layers=2,
    video_connector_num_learnable_registers=4,
    video_gated_attn=True,
    audio_connector_num_attention_heads=2,
    audio_connector_attention_head_dim=4,
    audio_connector_num_layers=2,
    audio_connector_num_learnable_registers=4,
    audio_gated_attn=True,
    connector_rope_base_seq_len=32,
    rope_theta=10000.0,
    rope_double_precision=True,
    rope_type="split",
    per_modality_projections=True,
    video_hidden_dim=16,
    audio_hidden_dim=8,
    proj_bias=True,
)
# No registers (padding masked in attention), "interleaved" RoPE in float32: diffusers'
# conversion script's "test" connectors.
CONNECTORS_NO_REGISTERS = dict(
    caption_channels=16,
    text_proj_in_factor=3,
    video_connector_num_attention_heads=4,
    video_connector_attention_head_dim=4,
    video_connector_num_layers=1,
    video_connector_num_learnable_registers=None,
    audio_connector_num_attention_heads=4,
    audio_connector_attention_head_dim=4,
    audio_connector_num_layers=1,
    audio_connector_num_learnable_registers=None,
    connector_rope_base_seq_len=32,
    rope_theta=10000.0,
    rope_double_precision=False,
    rope_type="interleaved",
)
# Connectors fed by the tiny Gemma-3 above: its 48 channels x 7 hidden states (6 layers + the
# embedding), registers dividing the prompt tests' 24 tokens.
CONNECTORS_FOR_TINY_GEMMA3 = dict(
    caption_channels=GEMMA3_TEXT["hidden_size"],
    text_proj_in_factor=GEMMA3_TEXT["num_hidden_layers"] + 1,
    video_connector_num_attention_heads=4,
    video_connector_attention_head_dim=12,
    video_connector_num_layers=1,
    video_connector_num_learnable_registers=8,
    audio_connector_num_attention_heads=2,
    audio_connector_attention_head_dim=24,
    audio_connector_num_layers=1,
    audio_connector_num_learnable_registers=8,
    connector_rope_base_seq_len=64,
    rope_type="split",
)
