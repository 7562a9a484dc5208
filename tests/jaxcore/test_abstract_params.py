"""A model's abstract parameters (the first step of every loader) are computed without running
XLA: a process's first compile grows its resident memory by ~60 MiB (the CPU compiler
starting), which made loading a model look like 1.34x its weight bytes (bench memory_load).
Each model's abstract function is checked on the tiny configs, in a fresh process so that no
earlier test has already paid the first compile."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import json, jax
    from jaxcore.model_configs import load_model_yaml
    from jaxcore.models import (
        autoencoder_kl, clip_text, clip_vision, flux_transformer, t5, unet_2d_condition,
        wan_transformer, wan_vae,
    )
    from jaxcore.models.unet_2d_condition import UNet2DConditionConfig

    compiles = []

    def listener(name, secs, **kwargs):
        if name == "/jax/core/compile/backend_compile_duration":
            compiles.append(name)

    jax.monitoring.register_event_duration_secs_listener(listener)
    wan = load_model_yaml("configs/models/wan_tiny.yml")
    flux = load_model_yaml("configs/models/flux_tiny.yml")
    unet = UNet2DConditionConfig.from_dict({
        "block_out_channels": [8, 16], "layers_per_block": 1, "cross_attention_dim": 8,
        "down_block_types": ["CrossAttnDownBlock2D", "DownBlock2D"],
        "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D"],
        "attention_head_dim": 2, "norm_num_groups": 4, "sample_size": 8,
    })
    cases = {
        "wan transformer": lambda: wan_transformer.abstract_params(
            wan_transformer.WanTransformer(wan["transformer"])),
        "wan vae": lambda: wan_vae.abstract_params(wan_vae.WanVAE(wan["vae"])),
        "umt5": lambda: t5.abstract_variables(t5.T5Encoder(wan["text_encoder"])),
        "flux transformer": lambda: flux_transformer.abstract_params(
            flux_transformer.FluxTransformer(flux["transformer"])),
        "autoencoder kl": lambda: autoencoder_kl.abstract_params(
            autoencoder_kl.AutoencoderKL(flux["vae"])),
        "clip text": lambda: clip_text.abstract_variables(
            clip_text.CLIPTextEncoder(flux["text_encoder"])),
        "t5": lambda: t5.abstract_variables(t5.T5Encoder(flux["text_encoder_2"])),
        "clip vision": lambda: clip_vision.abstract_variables(clip_vision.CLIPVisionEncoder(
            clip_vision.CLIPVisionConfig(hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2,
                                         image_size=8, patch_size=4))),
        "unet": lambda: unet_2d_condition.abstract_params(
            unet_2d_condition.UNet2DConditionModel(unet)),
    }
    result = {}
    for name, make in cases.items():
        before = len(compiles)
        leaves = jax.tree.leaves(make())
        result[name] = {"compiles": len(compiles) - before, "leaves": len(leaves)}
    # The listener sees compiles at all: a plain jitted call is one.
    before = len(compiles)
    jax.jit(lambda x: x + 1)(1)
    result["control"] = {"compiles": len(compiles) - before, "leaves": 1}
    print(json.dumps(result))
    """
)


def test_abstract_params_compile_nothing():
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result.pop("control")["compiles"] >= 1, "the compile listener saw nothing"
    assert all(r["leaves"] > 0 for r in result.values()), result
    compiled = {name: r["compiles"] for name, r in result.items() if r["compiles"]}
    assert not compiled, f"abstract parameters compiled XLA programs: {compiled}"
