"""LoRA: file formats -> one canonical form (:mod:`jaxcore.lora.base`), per-family converters
(``jaxcore/lora/<family>.py``), merging into a denoiser's parameters (:mod:`jaxcore.lora.merge`)."""
