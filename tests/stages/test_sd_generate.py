"""``difforge generate`` with Stable Diffusion / SDXL pipelines: prompt files render with the
pipeline's scheduler or another chosen by ``scheduler=``, per-line ``guidance_rescale`` and
seeds (the ancestral sampler's per-step noise comes from each prompt's seed), and equal what
the library renders for the same settings (the library is proven against diffusers in
tests/jaxcore/test_sd_pipeline.py)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest

from jaxcore import families, storage
from jaxcore.artifacts import open_artifact
from jaxcore.families import load_pipeline
from jaxcore.sampling import initial_latents
from pipelines import cli
from tests.support.tiny_sd import build_sdxl_pipeline

REPO = Path(__file__).resolve().parents[2]
LINES = [
    {"id": "plain", "prompt": "a red circle", "seed": 5, "guidance_scale": 1.0},
    {
        "id": "guided",
        "prompt": "a blue square",
        "negative_prompt": "blurry",
        "seed": 6,
        "guidance_scale": 4.0,
        "guidance_rescale": 0.5,
        "original_size": [32, 48],
        "crops_coords_top_left": [4, 0],
        "negative_original_size": [8, 8],
        "negative_target_size": [16, 16],
    },
]


@pytest.fixture(scope="module")
def sdxl_dir(tmp_path_factory) -> Path:
    return build_sdxl_pipeline(tmp_path_factory.mktemp("sdxl"), seed=3)


def _generate_args(pipeline: Path, prompts: Path, out: Path, *extra: str) -> list[str]:
    """``difforge generate`` of ``prompts`` with ``pipeline`` into ``out``, 16-pixel-high
    renders, quiet; ``extra``: more ``key=value`` overrides."""
    return [
        "generate",
        str(REPO / "configs/stages/generate.yml"),
        f"pretrained_model_name_or_path={pipeline}",
        f"prompt_file={prompts}",
        f"output_dir={out}",
        "height=16",
        *extra,
        "-q",
    ]


def _array(root: Path, name: str) -> np.ndarray:
    return np.load(io.BytesIO(storage.read_bytes(str(root / "outputs" / f"{name}.npy"))))


# the ancestral sampler's stage run (14 s) is slow-tier; tests/jaxcore checks its steps
@pytest.mark.parametrize(
    "scheduler", [None, pytest.param("euler_ancestral", marks=pytest.mark.slow)]
)
def test_sdxl_prompt_file_renders_as_the_library_does(sdxl_dir, tmp_path, scheduler):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(line) + "\n" for line in LINES))
    out = tmp_path / "render"
    extra = ["width=24", "num_frames=1", "num_inference_steps=4", "save_arrays=true"]
    if scheduler:
        extra.append(f"scheduler={scheduler}")
    args = _generate_args(sdxl_dir, prompts, out, *extra)
    assert cli.main(args) == 0
    summary = open_artifact(str(out), "generate").summary
    assert [p["id"] for p in summary["prompts"]] == ["plain", "guided"]
    records = {p.stem: json.loads(p.read_text()) for p in (out / "records").glob("*.json")}
    assert records["guided"]["params"]["guidance_rescale"] == 0.5
    assert "guidance_rescale" not in records["plain"]["params"]
    assert records["guided"]["params"]["crops_coords_top_left"] == [4, 0]
    assert "original_size" not in records["plain"]["params"]

    pipe = load_pipeline(sdxl_dir)
    for line in LINES:
        guidance = pipe.guidance(line["guidance_scale"], 1.0, None, line.get("guidance_rescale", 0))
        latents = initial_latents(line["seed"], pipe.latent_shape(16, 24, 1))[None]
        cond, uncond, scales = pipe.conditioning(
            [line["prompt"]],
            [line.get("negative_prompt", "")],
            [guidance],
            512,
            size=(16, 24, 1),
            micro_conditioning=[
                {name: tuple(line[name]) for name in families.MICRO_CONDITIONING if name in line}
            ],
        )
        z = pipe.sample(
            latents,
            cond,
            uncond,
            num_inference_steps=4,
            cfg_scale=scales,
            scheduler=scheduler,
            guidance_rescale=[guidance.guidance_rescale],
            seeds=[line["seed"]],
        )
        expected = np.asarray(pipe.decode(z))[0]
        np.testing.assert_allclose(_array(out, line["id"]), expected, atol=1e-5)


def test_sd_refuses_what_its_pipelines_lack(sdxl_dir, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "x", "true_cfg_scale": 3.0}) + "\n")
    args = _generate_args(sdxl_dir, prompts, tmp_path / "out", "width=16")
    assert cli.main(args) == 2
    assert "true_cfg_scale" in capsys.readouterr().err
    assert cli.main([*args, "scheduler=lms"]) == 2
    assert "scheduler must be one of" in capsys.readouterr().err
    prompts.write_text(json.dumps({"prompt": "x", "negative_target_size": [8, 8]}) + "\n")
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert "line 1" in err and "needs both negative_original_size" in err


@pytest.mark.parametrize(
    ("scheduler", "torch_scheduler", "layout", "steps"),
    [("euler", "EulerDiscreteScheduler", "kohya", 4), ("ddim", "DDIMScheduler", "peft", 2)],
    ids=["lightning-like", "hyper-sd-like"],
)
def test_few_step_distillation_lora_renders_as_diffusers(
    sdxl_dir, tmp_path, scheduler, torch_scheduler, layout, steps
):
    """How SDXL-Lightning and Hyper-SD LoRAs are run: a UNet LoRA on Linears and convolutions
    (kohya diffusers-style names / PEFT), ``guidance_scale=0``, few steps, and the scheduler
    re-made from the pipeline's config with ``timestep_spacing="trailing"`` (Lightning: Euler,
    Hyper-SD's n-step LoRAs: DDIM) — here ``scheduler=`` plus ``scheduler_config.*`` overrides.
    The prompt file's render equals diffusers' (``load_lora_weights``, ``from_config(...,
    timestep_spacing="trailing", use_karras_sigmas=False)``) within 1e-4."""
    import diffusers
    import torch

    from jaxcore import weights
    from tests.support.tiny_sd import random_unet_lora

    pipe = load_pipeline(sdxl_dir)
    lora = tmp_path / "distilled.safetensors"
    tensors = random_unet_lora(pipe, layout, seed=11, alpha_per_rank=0.5)
    # diffusers 0.42 turns kohya's lora_unet_add_embedding_linear_1 into "add.embedding.linear"
    # and drops it with a warning (sd-scripts' SDXL files call that layer label_emb.0.0)
    tensors = {k: v for k, v in tensors.items() if not k.startswith("lora_unet_add_embedding")}
    weights.save_safetensors(tensors, lora)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "fast", "prompt": "a red circle", "seed": 9}) + "\n")
    out = tmp_path / "render"
    args = _generate_args(
        sdxl_dir,
        prompts,
        out,
        "width=16",
        "num_frames=1",
        f"num_inference_steps={steps}",
        "guidance_scale=0",
        f"scheduler={scheduler}",
        "sampling.scheduler_config.timestep_spacing=trailing",
        "sampling.scheduler_config.use_karras_sigmas=false",
        f"model.loras=[{{path: {lora}, scale: 1.0}}]",
        "save_arrays=true",
    )
    assert cli.main(args) == 0
    ours = _array(out, "fast")

    reference = diffusers.StableDiffusionXLPipeline.from_pretrained(sdxl_dir)
    reference.scheduler = getattr(diffusers, torch_scheduler).from_config(
        reference.scheduler.config, timestep_spacing="trailing", use_karras_sigmas=False
    )
    latents = initial_latents(9, pipe.latent_shape(16, 16, 1))[None]

    def render(torch_pipe):
        return torch_pipe(
            prompt="a red circle",
            height=16,
            width=16,
            num_inference_steps=steps,
            guidance_scale=0.0,
            latents=torch.from_numpy(latents),
            output_type="np",
        ).images[0]

    without = render(reference)
    reference.load_lora_weights(str(lora))
    theirs = render(reference)
    np.testing.assert_allclose(ours.reshape(theirs.shape), theirs, atol=1e-4, rtol=0)
    assert np.abs(without - theirs).max() > 1e-3  # the LoRA matters
