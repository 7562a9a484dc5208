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


# --- the whole LTX2Pipeline (tests/jaxcore/test_ltx2_pipeline.py) -------------------------------

# The transformer between the tiny Gemma-3's connectors (48-wide captions for both modalities)
# and the VAEs below: 8 video channels, audio tokens of 2 channels x 4 latent mel bins, the
# VAE's 4 x 8 x 8 compression as its RoPE scale factors.
PIPELINE_TRANSFORMER = dict(
    in_channels=8,
    out_channels=8,
    num_attention_heads=2,
    attention_head_dim=8,
    cross_attention_dim=16,
    audio_in_channels=8,
    audio_out_channels=8,
    audio_num_attention_heads=2,
    audio_attention_head_dim=6,
    audio_cross_attention_dim=12,
    num_layers=2,
    caption_channels=48,
    rope_type="split",
    vae_scale_factors=(4, 8, 8),
)
# The video VAE of tests/jaxcore/test_ltx2_vae.py's released-like layout (compression 8 / 4,
# scaling_factor 0.8, reflect-padded non-causal decoder), without timestep conditioning.
PIPELINE_VAE = dict(
    in_channels=3,
    out_channels=3,
    latent_channels=8,
    block_out_channels=(16, 32, 32),
    down_block_types=("LTX2VideoDownBlock3D",) * 3,
    decoder_block_out_channels=(4, 16, 32),
    layers_per_block=(1, 0, 1, 1),
    decoder_layers_per_block=(1, 1, 1, 1),
    spatio_temporal_scaling=(True, True, True),
    decoder_spatio_temporal_scaling=(True, True, True),
    decoder_inject_noise=False,
    downsample_type=("spatial", "temporal", "spatiotemporal"),
    upsample_type=("spatiotemporal", "temporal", "spatial"),
    upsample_residual=(False, True, True),
    upsample_factor=(1, 2, 2),
    timestep_conditioning=False,
    patch_size=2,
    encoder_causal=True,
    decoder_causal=False,
    decoder_spatial_padding_mode="reflect",
    spatial_compression_ratio=8,
    temporal_compression_ratio=4,
    scaling_factor=0.8,
)
# A timestep-conditioned video VAE (tests/jaxcore/test_ltx2_vae.py's "conditioned" layout, no
# injected noise: diffusers draws it with torch): compression 16 / 4, so the transformer's RoPE
# scale factors follow (PIPELINE_CONDITIONED_TRANSFORMER).
PIPELINE_CONDITIONED_VAE = dict(
    in_channels=3,
    out_channels=3,
    latent_channels=8,
    block_out_channels=(8, 16, 32),
    down_block_types=("LTX2VideoDownBlock3D",) * 3,
    decoder_block_out_channels=(16, 32),
    layers_per_block=(1, 1, 1, 1),
    decoder_layers_per_block=(1, 2, 1),
    spatio_temporal_scaling=True,
    decoder_spatio_temporal_scaling=True,
    decoder_inject_noise=False,
    downsample_type=("conv", "spatial", "temporal"),
    upsample_type=("spatiotemporal", "spatiotemporal"),
    upsample_residual=(True, False),
    upsample_factor=(2, 2),
    timestep_conditioning=True,
    patch_size=4,
    encoder_causal=False,
    decoder_causal=True,
    spatial_compression_ratio=16,
    temporal_compression_ratio=4,
    scaling_factor=1.3,
)
PIPELINE_CONDITIONED_TRANSFORMER = dict(vae_scale_factors=(4, 16, 16))
# Audio VAE: 2 latent channels x 16 / 4 mel bins = 8 features per token = base_channels (the
# latent statistics' length), time-causal as released; 16 kHz, hop 160 (25 latent frames / s).
PIPELINE_AUDIO_VAE = dict(
    base_channels=8,
    output_channels=2,
    ch_mult=(1, 2, 2),
    num_res_blocks=1,
    latent_channels=2,
    norm_type="pixel",
    causality_axis="height",
    mel_bins=16,
)
# Vocoder: the audio VAE's 2 x 16 mel channels in, 100 mel frames / s x 6 = 600 samples / s.
PIPELINE_VOCODER = dict(
    in_channels=32,
    hidden_channels=16,
    out_channels=2,
    upsample_kernel_sizes=(7, 5),
    upsample_factors=(3, 2),
    resnet_kernel_sizes=(3,),
    resnet_dilations=((1, 2),),
    act_fn="leaky_relu",
    leaky_relu_negative_slope=0.2,
    final_act_fn="tanh",
    output_sampling_rate=600,
)
# Dynamic shifting moved to where the tiny renders' ~10 video tokens fall.
PIPELINE_SCHEDULER = dict(
    use_dynamic_shifting=True,
    base_shift=0.7,
    max_shift=1.6,
    base_image_seq_len=4,
    max_image_seq_len=64,
)


def _perturb(model, seed: int, scale: float = 0.1):
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=generator))
    return model.eval()


def _with_statistics(vae, seed: int, channels: int):
    """Non-default latents_mean / latents_std buffers (the pipeline normalises with them)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        vae.latents_mean.copy_(0.3 * torch.randn(channels, generator=generator))
        vae.latents_std.copy_(0.6 + torch.rand(channels, generator=generator))
    return vae


def build_ltx2_pipeline(
    directory: str | Path,
    *,
    seed: int = 0,
    vae: dict | None = None,
    transformer: dict | None = None,
) -> Path:
    """Write a tiny random-init ``LTX2Pipeline`` (every parameter perturbed) into
    ``directory`` with ``save_pretrained``; returns it. ``vae`` / ``transformer``: configs
    over :data:`PIPELINE_VAE` / :data:`PIPELINE_TRANSFORMER`."""
    import torch
    from diffusers import (
        AutoencoderKLLTX2Audio,
        AutoencoderKLLTX2Video,
        FlowMatchEulerDiscreteScheduler,
        LTX2Pipeline,
        LTX2VideoTransformer3DModel,
    )
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
    from transformers import AutoTokenizer, Gemma3Config, Gemma3ForConditionalGeneration

    directory = Path(directory)
    torch.manual_seed(seed)
    text_config = Gemma3Config(
        text_config=GEMMA3_TEXT,
        vision_config=GEMMA3_VISION,
        mm_tokens_per_image=GEMMA3_MM_TOKENS_PER_IMAGE,
    )
    vae = _perturb(AutoencoderKLLTX2Video(**{**PIPELINE_VAE, **(vae or {})}), seed + 1, 0.05)
    audio_vae = _perturb(AutoencoderKLLTX2Audio(**PIPELINE_AUDIO_VAE), seed + 2)
    pipe = LTX2Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**PIPELINE_SCHEDULER),
        vae=_with_statistics(vae, seed + 3, vae.config.latent_channels),
        audio_vae=_with_statistics(audio_vae, seed + 4, PIPELINE_AUDIO_VAE["base_channels"]),
        text_encoder=_perturb(Gemma3ForConditionalGeneration(text_config), seed + 5),
        tokenizer=AutoTokenizer.from_pretrained(gemma_tokenizer_dir(directory / "tokenizer")),
        connectors=_perturb(LTX2TextConnectors(**CONNECTORS_FOR_TINY_GEMMA3), seed + 6),
        transformer=_perturb(
            LTX2VideoTransformer3DModel(**{**PIPELINE_TRANSFORMER, **(transformer or {})}), seed + 7
        ),
        vocoder=_perturb(LTX2Vocoder(**PIPELINE_VOCODER), seed + 8),
    )
    pipe.save_pretrained(directory)
    return directory


# --- an LTX-2.3-style LTX2Pipeline (tests/jaxcore/test_ltx2_pipeline.py) -------------------------

# The transformer with LTX-2.3's options: gated attention, prompt modulation from sigma,
# captions at the attention widths (no caption projection), STG switchable, no FFN biases.
PIPELINE_TRANSFORMER_LTX23 = dict(
    gated_attn=True,
    audio_gated_attn=True,
    cross_attn_mod=True,
    audio_cross_attn_mod=True,
    use_prompt_embeddings=False,
    perturbed_attn=True,
    ff_bias=False,
)
# LTX-2.3's connectors (per-modality biased projections of RMS-normed features, gated
# attention) fed by the tiny Gemma-3, writing the transformer's cross-attention widths.
CONNECTORS_LTX23_FOR_TINY_GEMMA3 = dict(
    CONNECTORS_LTX23,
    caption_channels=GEMMA3_TEXT["hidden_size"],
    text_proj_in_factor=GEMMA3_TEXT["num_hidden_layers"] + 1,
    video_connector_num_attention_heads=4,
    video_connector_attention_head_dim=4,
    video_connector_num_learnable_registers=8,
    audio_connector_num_attention_heads=2,
    audio_connector_attention_head_dim=6,
    audio_connector_num_learnable_registers=8,
    video_hidden_dim=PIPELINE_TRANSFORMER["cross_attention_dim"],
    audio_hidden_dim=PIPELINE_TRANSFORMER["audio_cross_attention_dim"],
    connector_rope_base_seq_len=64,
)
# LTX2VocoderWithBWE (LTX-2.3's): the audio VAE's 2 x 16 mel channels into stage 1, its
# 2 channels x 6 mels into the extender (hop 10 = prod(stage-1 factors), 16 -> 48 kHz:
# prod(bwe factors) = 3 x 10; tests/jaxcore/test_ltx2_vocoder.py's shrunk invariants).
PIPELINE_VOCODER_BWE = dict(
    in_channels=32,
    hidden_channels=16,
    out_channels=2,
    upsample_kernel_sizes=(11, 5),
    upsample_factors=(5, 2),
    resnet_kernel_sizes=(3, 5),
    resnet_dilations=((1, 3), (1, 2)),
    antialias_kernel_size=8,
    bwe_in_channels=12,
    bwe_hidden_channels=8,
    bwe_out_channels=2,
    bwe_upsample_kernel_sizes=(11, 7, 4),
    bwe_upsample_factors=(5, 3, 2),
    bwe_resnet_kernel_sizes=(3,),
    bwe_resnet_dilations=((1, 2),),
    filter_length=32,
    hop_length=10,
    window_length=32,
    num_mel_channels=6,
    input_sampling_rate=16000,
    output_sampling_rate=48000,
)


def build_ltx23_pipeline(directory: str | Path, *, seed: int = 0) -> Path:
    """:func:`build_ltx2_pipeline` with LTX-2.3's transformer options, connectors and
    bandwidth-extending vocoder (every parameter perturbed); returns ``directory``."""
    import torch
    from diffusers import LTX2Pipeline, LTX2VideoTransformer3DModel
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2VocoderWithBWE

    directory = Path(directory)
    build_ltx2_pipeline(directory / "base", seed=seed)
    base = LTX2Pipeline.from_pretrained(directory / "base", dtype=torch.float32)
    torch.manual_seed(seed + 20)
    transformer = LTX2VideoTransformer3DModel(
        **{**PIPELINE_TRANSFORMER, **PIPELINE_TRANSFORMER_LTX23}
    )
    pipe = LTX2Pipeline(
        scheduler=base.scheduler,
        vae=base.vae,
        audio_vae=base.audio_vae,
        text_encoder=base.text_encoder,
        tokenizer=base.tokenizer,
        connectors=_perturb(LTX2TextConnectors(**CONNECTORS_LTX23_FOR_TINY_GEMMA3), seed + 21),
        transformer=_perturb(transformer, seed + 22),
        vocoder=_perturb(LTX2VocoderWithBWE(**PIPELINE_VOCODER_BWE), seed + 23),
    )
    pipe.save_pretrained(directory / "ltx23")
    return directory / "ltx23"
