"""Tiny random-init diffusers ``Flux2Pipeline`` (FLUX.2 [dev]) directories, built with diffusers /
transformers (PyTorch): the reference the flux2_dev family is tested against.

The transformer is tests/support/tiny_flux2.py's with a guidance embedder (``guidance_embeds``),
the VAE that file's (every parameter perturbed, BatchNorm statistics away from 0 / 1), the text
encoder a perturbed tiny ``Mistral3ForConditionalGeneration`` with 30 text layers so that the
pipeline's default ``text_encoder_out_layers`` (10, 20, 30) exist (and a one-layer Pixtral vision
tower that the loader must skip), its tokenizer a byte-level BPE trained here with Mistral's
special tokens and a cut of Mistral-Small-3.1's chat template (tests/jaxcore/test_mistral3.py's).

The pipeline's ``tokenizer`` is a ``PixtralProcessor``, which cannot be built here (it imports
torchvision, absent from this venv). :class:`TextProcessor`, a processor holding only the
tokenizer, stands in for its text path (all ``Flux2Pipeline`` uses without caption upsampling).
So the folder is written component by component, as ``save_pretrained`` writes a released one
(``model_index.json`` naming ``PixtralProcessor``), and :func:`reference_pipeline` builds
diffusers' ``Flux2Pipeline`` from the folder's components with the stand-in.
"""

from __future__ import annotations

import json
from pathlib import Path

from transformers import ProcessorMixin

from tests.jaxcore.test_mistral3 import CHAT_TEMPLATE, SPECIALS, TINY_VISION
from tests.support.tiny_flux2 import SCHEDULER, TRANSFORMER, _perturbed, _vae

MISTRAL_TEXT = dict(
    model_type="mistral",
    vocab_size=320,  # the byte-level alphabet alone is 256
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=30,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    rope_theta=1000.0,
    max_position_embeddings=256,
    sliding_window=None,  # as Mistral-Small-3.x
)
OUT_LAYERS = (10, 20, 30)  # Flux2Pipeline's default text_encoder_out_layers
# FLUX.2 [dev]-like: Klein's tiny transformer with the guidance embedder; text of 3 x 32 wide
DEV_TRANSFORMER = {
    **TRANSFORMER,
    "joint_attention_dim": len(OUT_LAYERS) * MISTRAL_TEXT["hidden_size"],
    "guidance_embeds": True,
}
TOKENIZER_TEXTS = [
    "You are an AI that reasons about image descriptions. object relationships attribution",
    "a red fox in the snow, a blue square on a green field, make the sky purple",
]
# model_index.json as Flux2Pipeline.save_pretrained writes FLUX.2-dev's
MODEL_INDEX = {
    "_class_name": "Flux2Pipeline",
    "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    "text_encoder": ["transformers", "Mistral3ForConditionalGeneration"],
    "tokenizer": ["transformers", "PixtralProcessor"],
    "transformer": ["diffusers", "Flux2Transformer2DModel"],
    "vae": ["diffusers", "AutoencoderKLFlux2"],
}


class TextProcessor(ProcessorMixin):
    """A processor with only a tokenizer: transformers' processor text path (what
    ``PixtralProcessor`` runs for text, its image parts aside)."""

    def __init__(self, tokenizer, chat_template=None):
        super().__init__(tokenizer, chat_template=chat_template)


def build_tokenizer():
    """A byte-level BPE tokenizer with Mistral's special tokens and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=MISTRAL_TEXT["vocab_size"],
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(TOKENIZER_TEXTS, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        chat_template=CHAT_TEMPLATE,
    )


def _save_processor(tokenizer, directory: Path) -> None:
    """The stand-in processor saved as a PixtralProcessor's folder is laid out (tokenizer files,
    ``chat_template.jinja``, ``processor_config.json``), naming that class as a released one."""
    TextProcessor(tokenizer, chat_template=CHAT_TEMPLATE).save_pretrained(directory)
    for name in ("processor_config.json", "tokenizer_config.json"):
        path = directory / name
        config = json.loads(path.read_text())
        config["processor_class"] = "PixtralProcessor"
        path.write_text(json.dumps(config, indent=2))


def build_flux2_dev_pipeline(directory: str | Path, *, seed: int = 0) -> Path:
    """Write a tiny ``Flux2Pipeline`` folder into ``directory``; returns it."""
    import diffusers
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    directory = Path(directory)
    torch.manual_seed(seed)
    config = Mistral3Config(text_config=MISTRAL_TEXT, vision_config=TINY_VISION)
    components = {
        "scheduler": FlowMatchEulerDiscreteScheduler(**SCHEDULER),
        "vae": _vae(seed + 1),
        "text_encoder": _perturbed(Mistral3ForConditionalGeneration(config), seed + 2),
        "transformer": _perturbed(Flux2Transformer2DModel(**DEV_TRANSFORMER), seed + 3),
    }
    for name, component in components.items():
        component.save_pretrained(directory / name)
    _save_processor(build_tokenizer(), directory / "tokenizer")
    index = {**MODEL_INDEX, "_diffusers_version": diffusers.__version__}
    (directory / "model_index.json").write_text(json.dumps(index, indent=2))
    return directory


def reference_pipeline(directory: str | Path):
    """diffusers' ``Flux2Pipeline`` of a folder's components, the stand-in processor (over the
    folder's tokenizer and chat template) as its ``tokenizer``."""
    from diffusers import (
        AutoencoderKLFlux2,
        FlowMatchEulerDiscreteScheduler,
        Flux2Pipeline,
        Flux2Transformer2DModel,
    )
    from transformers import AutoTokenizer, Mistral3ForConditionalGeneration

    directory = Path(directory)
    template = (directory / "tokenizer" / "chat_template.jinja").read_text()
    tokenizer = AutoTokenizer.from_pretrained(directory / "tokenizer")
    return Flux2Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(directory / "scheduler"),
        vae=AutoencoderKLFlux2.from_pretrained(directory / "vae").eval(),
        text_encoder=Mistral3ForConditionalGeneration.from_pretrained(
            directory / "text_encoder"
        ).eval(),
        tokenizer=TextProcessor(tokenizer, chat_template=template),
        transformer=Flux2Transformer2DModel.from_pretrained(directory / "transformer").eval(),
    )
