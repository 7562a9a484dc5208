"""Tiny random-init diffusers ``Flux2KleinPipeline`` directories, built with diffusers /
transformers (PyTorch) and written with ``save_pretrained``: the reference the flux2 family is
tested against.

Every parameter is perturbed (``p += 0.1 * randn``) so that a mis-mapped weight or a skipped
norm changes the output, and the VAE's latent BatchNorm statistics are set away from 0 / 1 (a
fresh BatchNorm's would hide a missing normalisation). The Qwen3 text encoder has 28 layers so
that the pipeline's default ``text_encoder_out_layers`` (9, 18, 27) exist; its tokenizer is a
byte-level BPE trained here with Qwen's special tokens and a chat template honouring
``enable_thinking`` (as tests/jaxcore/test_qwen3.py builds one; nothing is downloaded).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

QWEN3 = dict(
    vocab_size=320,  # the byte-level alphabet alone is 256
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=28,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    rope_theta=1000.0,
    max_position_embeddings=128,
)
OUT_LAYERS = (9, 18, 27)  # the pipeline's default text_encoder_out_layers
VAE = dict(
    block_out_channels=(8, 16),
    decoder_block_out_channels=(4, 12),  # the decoder's own widths
    down_block_types=("DownEncoderBlock2D",) * 2,
    up_block_types=("UpDecoderBlock2D",) * 2,
    layers_per_block=1,
    latent_channels=6,
    norm_num_groups=4,
    sample_size=16,
    batch_norm_eps=1e-3,
)
# Klein-like (no guidance embedder): 24 = 4 x the VAE's 6 latent channels; text of 3 layers x 32
TRANSFORMER = dict(
    in_channels=24,
    num_layers=1,
    num_single_layers=2,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=len(OUT_LAYERS) * QWEN3["hidden_size"],
    timestep_guidance_channels=32,
    axes_dims_rope=(4, 4, 4, 4),
    guidance_embeds=False,
)
# FLUX.2 [klein]'s scheduler_config.json (dynamic shifting; the pipeline passes mu)
SCHEDULER = dict(
    base_image_seq_len=256,
    base_shift=0.5,
    max_image_seq_len=4096,
    max_shift=1.15,
    num_train_timesteps=1000,
    shift=3.0,
    use_dynamic_shifting=True,
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
# Qwen3's chat template, cut to what one user message needs (the real one has tools etc.).
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
TOKENIZER_TEXTS = [
    "a red fox in the snow, a blue square on a green field",
    "user assistant cat prompt long make the sky purple edit",
]


def build_tokenizer(directory: Path):
    """A Qwen-style byte-level BPE tokenizer with a chat template, saved as a transformers one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(TOKENIZER_TEXTS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        pad_token="<|endoftext|>",
        eos_token="<|im_end|>",
        chat_template=CHAT_TEMPLATE,
    )
    fast.save_pretrained(directory)
    return fast


def _perturbed(model, seed: int):
    """Every parameter moved by 0.1 x N(0, 1) (norm weights not 1, biases not 0)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=generator))
    return model.eval()


def _vae(seed: int):
    """The perturbed VAE with BatchNorm running statistics away from 0 / 1."""
    import torch
    from diffusers import AutoencoderKLFlux2

    vae = _perturbed(AutoencoderKLFlux2(**VAE), seed)
    generator = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        n = vae.bn.running_mean.shape[0]
        vae.bn.running_mean.copy_(0.5 * torch.randn(n, generator=generator))
        vae.bn.running_var.copy_(torch.rand(n, generator=generator) * 3 + 0.2)
    return vae


def build_flux2_pipeline(directory: str | Path, *, seed: int = 0) -> Path:
    """Write a tiny non-distilled ``Flux2KleinPipeline`` into ``directory``; returns it."""
    import torch
    import transformers
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        Flux2KleinPipeline,
        Flux2Transformer2DModel,
    )

    directory = Path(directory)
    tokenizer = build_tokenizer(directory / "_tokenizer")
    torch.manual_seed(seed)
    text_encoder = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**QWEN3))
    pipe = Flux2KleinPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER),
        vae=_vae(seed + 1),
        text_encoder=_perturbed(text_encoder, seed + 2),
        tokenizer=tokenizer,
        transformer=_perturbed(Flux2Transformer2DModel(**TRANSFORMER), seed + 3),
        is_distilled=False,
    )
    pipe.save_pretrained(directory)
    shutil.rmtree(directory / "_tokenizer")
    return directory


def distilled_copy(source: str | Path, directory: str | Path) -> Path:
    """A copy of a built pipeline whose model_index.json says ``is_distilled: true`` (the
    step-distilled Klein models: same components, CFG off)."""
    directory = Path(directory)
    shutil.copytree(source, directory, dirs_exist_ok=True)
    index_path = directory / "model_index.json"
    index = json.loads(index_path.read_text())
    index["is_distilled"] = True
    index_path.write_text(json.dumps(index, indent=2))
    return directory


# the edits of write_edit_pairs: caption -> the RGB gains the target applies to the source
EDITS = {
    "make it red": (1.0, 0.25, 0.25),
    "make it blue": (0.25, 0.25, 1.0),
    "make it dark": (0.3, 0.3, 0.3),
}


def write_edit_pairs(directory: str | Path, count: int, size: int = 64, seed: int = 0) -> Path:
    """An imagefolder dataset of ``count`` edit pairs: ``file_name`` the edited (target) image,
    ``text`` the edit's instruction and ``source_image`` the absolute path of the source
    (reference) image, a smooth random pattern ``size x size`` that the edit tints per channel
    (:data:`EDITS`), so that the target depends on both the caption and the reference."""
    import numpy as np
    import PIL.Image

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    rows, edits = [], list(EDITS.items())
    for i in range(count):
        coarse = PIL.Image.fromarray(rng.integers(0, 256, (4, 4, 3), dtype=np.uint8))
        source = np.asarray(coarse.resize((size, size), PIL.Image.Resampling.BICUBIC))
        caption, gains = edits[i % len(edits)]
        target = (source.astype(np.float32) * np.asarray(gains, np.float32)).astype(np.uint8)
        PIL.Image.fromarray(source).save(directory / f"source_{i}.png")
        PIL.Image.fromarray(target).save(directory / f"target_{i}.png")
        rows.append(
            {
                "file_name": f"target_{i}.png",
                "text": caption,
                "source_image": str(directory / f"source_{i}.png"),
            }
        )
    (directory / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return directory


def kv_copy(source: str | Path, directory: str | Path) -> Path:
    """A built pipeline as diffusers saves it as a ``Flux2KleinKVPipeline`` (the same
    components: ``Flux2KleinKVPipeline.from_pretrained(source).save_pretrained(directory)``);
    its model_index.json names that class and, as that class writes it, no ``is_distilled``
    (the loading folder's ``_name_or_path`` dropped, as in a released folder)."""
    from diffusers import Flux2KleinKVPipeline

    directory = Path(directory)
    Flux2KleinKVPipeline.from_pretrained(source).save_pretrained(directory)
    index_path = directory / "model_index.json"
    index = json.loads(index_path.read_text())
    index.pop("_name_or_path", None)
    index_path.write_text(json.dumps(index, indent=2))
    return directory
