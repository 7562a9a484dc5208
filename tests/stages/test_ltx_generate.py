"""``difforge generate`` with LTX-Video pipelines (tests/support/tiny_ltx.py), end to end on the
CPU's 8 virtual devices: prompt files with per-line initial latents (``.npy``, unpacked
``[C, F', H', W']``) render what diffusers' ``LTXPipeline`` / ``LTXImageToVideoPipeline``
render from the same noise.

- text-to-video: a line without CFG (32 x 96, 9 frames) and, in one batch, two lines with
  CFG 3, ``guidance_rescale`` 0.5 and a 64 x 32, 5-frame size at ``frame_rate`` 30 and 25
  (each row's own RoPE scale), ``decode_timestep`` 0.05 with ``decode_noise_scale`` 0;
- image-to-video: a 50 x 40 PNG beside the prompt file conditions a 64 x 32, 9-frame render
  (CFG 3, ``guidance_rescale`` 0.3, 24 fps); diffusers draws the image's posterior sample and
  the noise from its generator, the same noise is the line's ``latents``.

Asserted max |diff| <= 1e-4 on [0, 1] pixels (``save_arrays``); reached 1.0e-6 (plain),
1.1e-6 / 1.1e-6 (the CFG lines at 30 / 25 fps), 2.0e-6 (image-to-video). ``max_sequence_length``
is set to diffusers' default 128 (generate's own default is 512 for every family). The LTX
render settings are refused, naming the line and the field, by a model whose family does not
take them and where a value is out of range.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from jaxcore import storage
from jaxcore.artifacts import open_artifact
from jaxcore.models import ltx_transformer
from jaxcore.sampling import initial_latents
from pipelines import cli
from tests.support.tiny_ltx import build_ltx_pipeline

REPO = Path(__file__).resolve().parents[2]
TOLERANCE = 1e-4
STEPS = 3
LENGTH = 128
# latent shape of each size: 8 channels, (F - 1) / 4 + 1 frames, H / 8 x W / 8
T2V_LINES = [
    {"id": "plain", "prompt": "a red circle", "guidance_scale": 1.0, "seed": 10},
    {
        "id": "guided-30fps",
        "prompt": "a blue square moving left",
        "negative_prompt": "dark background",
        "guidance_scale": 3.0,
        "guidance_rescale": 0.5,
        "frame_rate": 30,
        "decode_timestep": 0.05,
        "decode_noise_scale": 0.0,
        "height": 64,
        "width": 32,
        "num_frames": 5,
        "seed": 11,
    },
    {
        "id": "guided-25fps",
        "prompt": "gold ring spinning",
        "negative_prompt": "gray",
        "guidance_scale": 3.0,
        "guidance_rescale": 0.5,
        "decode_timestep": 0.05,
        "decode_noise_scale": 0.0,
        "height": 64,
        "width": 32,
        "num_frames": 5,
        "seed": 12,
    },
]
DEFAULT_SIZE = {"height": 32, "width": 96, "num_frames": 9}


@pytest.fixture(scope="module")
def t2v_dir(tmp_path_factory) -> Path:
    return build_ltx_pipeline(tmp_path_factory.mktemp("ltx_t2v"), seed=3)


@pytest.fixture(scope="module")
def i2v_dir(tmp_path_factory) -> Path:
    return build_ltx_pipeline(tmp_path_factory.mktemp("ltx_i2v"), seed=4, image_to_video=True)


def _size(line: dict) -> tuple[int, int, int]:
    return tuple(line.get(key, DEFAULT_SIZE[key]) for key in ("height", "width", "num_frames"))


def _latent_shape(height: int, width: int, frames: int) -> tuple[int, ...]:
    return (8, (frames - 1) // 4 + 1, height // 8, width // 8)


def _generate(model: Path, prompt_file: Path, out: Path, *extra: str) -> int:
    return cli.main(
        [
            "generate",
            str(REPO / "configs/stages/generate.yml"),
            f"pretrained_model_name_or_path={model}",
            f"prompt_file={prompt_file}",
            f"output_dir={out}",
            f"num_inference_steps={STEPS}",
            f"max_sequence_length={LENGTH}",
            *(f"{key}={value}" for key, value in DEFAULT_SIZE.items()),
            "save_arrays=true",
            "-q",
            *extra,
        ]
    )


def _write_lines(folder: Path, lines: list[dict], noise: dict[str, np.ndarray]) -> Path:
    (folder / "noise").mkdir(exist_ok=True)
    out = []
    for line in lines:
        np.save(folder / "noise" / f"{line['id']}.npy", noise[line["id"]])
        out.append(json.dumps({**line, "latents": f"noise/{line['id']}.npy"}))
    prompts = folder / "prompts.jsonl"
    prompts.write_text("\n".join(out) + "\n")
    return prompts


def _array(root: Path, name: str) -> np.ndarray:
    return np.load(io.BytesIO(storage.read_bytes(str(root / "outputs" / f"{name}.npy"))))


def _t2v_reference(directory: Path, line: dict, latents: np.ndarray) -> np.ndarray:
    from diffusers import LTXPipeline

    height, width, frames = _size(line)
    packed = np.asarray(ltx_transformer.pack_latents(latents[None]))
    return (
        LTXPipeline.from_pretrained(directory)(
            prompt=line["prompt"],
            negative_prompt=line.get("negative_prompt"),
            height=height,
            width=width,
            num_frames=frames,
            frame_rate=line.get("frame_rate", 25),
            num_inference_steps=STEPS,
            guidance_scale=line["guidance_scale"],
            guidance_rescale=line.get("guidance_rescale", 0.0),
            latents=torch.from_numpy(packed),
            decode_timestep=line.get("decode_timestep", 0.0),
            decode_noise_scale=line.get("decode_noise_scale"),
            max_sequence_length=LENGTH,
            output_type="np",
        )
        .frames[0]
        .astype(np.float32)
    )


def test_text_to_video_prompt_file_renders_as_diffusers(t2v_dir, tmp_path):
    noise = {
        line["id"]: initial_latents(line["seed"] + 100, _latent_shape(*_size(line)))
        for line in T2V_LINES
    }
    prompts = _write_lines(tmp_path, T2V_LINES, noise)
    out = tmp_path / "render"
    assert _generate(t2v_dir, prompts, out) == 0
    summary = open_artifact(str(out), "generate").summary
    assert [p["id"] for p in summary["prompts"]] == [line["id"] for line in T2V_LINES]
    records = {p.stem: json.loads(p.read_text()) for p in (out / "records").glob("*.json")}
    assert records["guided-30fps"]["params"]["frame_rate"] == 30.0
    assert records["plain"]["params"]["frame_rate"] == 25.0  # the pipeline's default
    assert records["plain"]["params"]["decode_timestep"] == 0.0
    for line in T2V_LINES:
        ours = _array(out, line["id"])
        reference = _t2v_reference(t2v_dir, line, noise[line["id"]])
        height, width, frames = _size(line)
        assert ours.shape == reference.shape == (frames, height, width, 3)
        np.testing.assert_allclose(ours, reference, atol=TOLERANCE, rtol=0)


def test_image_to_video_prompt_file_renders_as_diffusers(i2v_dir, tmp_path):
    from diffusers import LTXImageToVideoPipeline
    from PIL import Image

    pixels = np.random.default_rng(5).integers(0, 256, (50, 40, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(tmp_path / "cat.png")
    line = {
        "id": "cat",
        "prompt": "a cat turns its head",
        "negative_prompt": "blurry",
        "image": "cat.png",
        "guidance_scale": 3.0,
        "guidance_rescale": 0.3,
        "frame_rate": 24,
        "height": 64,
        "width": 32,
        "seed": 21,
    }
    shape = _latent_shape(64, 32, 9)
    generator = torch.Generator().manual_seed(line["seed"])
    torch.randn((1, shape[0], 1, *shape[2:]), generator=generator)  # the image's sample
    noise = torch.randn((1, *shape), generator=generator).numpy()
    prompts = _write_lines(tmp_path, [line], {"cat": noise})
    out = tmp_path / "render"
    assert _generate(i2v_dir, prompts, out) == 0
    reference = LTXImageToVideoPipeline.from_pretrained(i2v_dir)(
        image=Image.open(tmp_path / "cat.png"),
        prompt=line["prompt"],
        negative_prompt=line["negative_prompt"],
        height=64,
        width=32,
        num_frames=9,
        frame_rate=24,
        num_inference_steps=STEPS,
        guidance_scale=3.0,
        guidance_rescale=0.3,
        generator=torch.Generator().manual_seed(line["seed"]),
        max_sequence_length=LENGTH,
        output_type="np",
    ).frames[0]
    ours = _array(out, "cat")
    assert ours.shape == reference.shape == (9, 64, 32, 3)
    np.testing.assert_allclose(ours, reference, atol=TOLERANCE, rtol=0)


def test_render_settings_are_refused_where_they_do_not_apply(t2v_dir, tmp_path, capsys):
    from pipelines.embedded.tiny import build_tiny_wan_pipeline

    wan_dir = build_tiny_wan_pipeline(tmp_path / "wan", seed=1)
    prompts = tmp_path / "p.jsonl"
    for model, line, words in (
        (wan_dir, {"prompt": "x", "frame_rate": 24}, ["line 2", "frame_rate=24"]),
        (wan_dir, {"prompt": "x", "decode_timestep": 0.05}, ["line 2", "decode_timestep"]),
        (t2v_dir, {"prompt": "x", "decode_noise_scale": 2.0}, ["line 2", "must be in [0, 1]"]),
        (t2v_dir, {"prompt": "x", "image": "cat.png"}, ["line 2", "takes no conditioning image"]),
    ):
        prompts.write_text(json.dumps({"prompt": "fine"}) + "\n" + json.dumps(line) + "\n")
        assert _generate(model, prompts, tmp_path / "out") == 2
        err = capsys.readouterr().err
        assert all(word in err for word in words), err
    prompts.write_text(json.dumps({"prompt": "x"}) + "\n")
    assert _generate(wan_dir, prompts, tmp_path / "out", "frame_rate=30") == 2
    assert "frame_rate=30" in capsys.readouterr().err
    assert _generate(t2v_dir, prompts, tmp_path / "out", "decode_noise_scale=2") == 2
    assert "decode_noise_scale must be in [0, 1]" in capsys.readouterr().err
