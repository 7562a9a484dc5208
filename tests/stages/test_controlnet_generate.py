"""``difforge generate`` with ControlNet pipelines: per-line control images, scales, windows,
guess mode and Canny preprocessing render as diffusers' StableDiffusionControlNetPipeline does
(within 1e-4 on [0, 1] pixels, from the saved arrays), the edge maps land beside the renders,
the control images' bytes join the resume fingerprint, and bad lines fail before rendering,
named."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from jaxcore.sampling import initial_latents
from pipelines import cli
from tests.support.tiny_sd import build_controlnet_pipeline, build_sd_pipeline

REPO = Path(__file__).resolve().parents[2]
TOLERANCE = 1e-4
CANNY = {"kind": "canny", "low": 50, "high": 150}


@pytest.fixture(scope="module")
def sd_cn(tmp_path_factory) -> Path:
    return build_controlnet_pipeline(tmp_path_factory.mktemp("sd_cn"), seed=4)


def _photo(size=(24, 16), seed=0) -> Image.Image:
    """Shapes on a noisy background: Canny finds edges in it."""
    rng = np.random.default_rng(seed)
    w, h = size
    yy, xx = np.mgrid[:h, :w]
    pixels = (rng.integers(0, 40, (h, w, 3)) + 100).astype(np.uint8)
    disc = (yy - h / 2) ** 2 + (xx - w / 3) ** 2 < (h / 3) ** 2
    pixels[disc] = (230, 40, 30)
    pixels[2 : h // 2, w - 8 : w - 2] = (20, 200, 60)
    return Image.fromarray(pixels)


def _args(pipeline, prompts, out, *extra) -> list[str]:
    return [
        "generate",
        str(REPO / "configs/stages/generate.yml"),
        f"pretrained_model_name_or_path={pipeline}",
        f"prompt_file={prompts}",
        f"output_dir={out}",
        "num_inference_steps=4",
        "guidance_scale=7.5",
        "height=null",  # the lines' sizes, or their control images'
        "width=null",
        "save_arrays=true",
        *extra,
        "-q",
    ]


def _write(path: Path, lines) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _diffusers(pipeline: Path, line: dict, image, height: int, width: int) -> np.ndarray:
    import diffusers
    import torch

    pipe = diffusers.StableDiffusionControlNetPipeline.from_pretrained(pipeline)
    latents = initial_latents(line["seed"], (4, height // 2, width // 2))[None]
    return pipe(
        prompt=line["prompt"],
        negative_prompt=line.get("negative_prompt"),
        image=image,
        controlnet_conditioning_scale=line.get("controlnet_conditioning_scale", 1.0),
        control_guidance_start=line.get("control_guidance_start", 0.0),
        control_guidance_end=line.get("control_guidance_end", 1.0),
        guess_mode=line.get("guess_mode", False),
        guidance_scale=line.get("guidance_scale", 7.5),
        height=height,
        width=width,
        num_inference_steps=4,
        latents=torch.from_numpy(latents),
        output_type="np",
    ).images[0]


def test_control_lines_render_as_diffusers(sd_cn, tmp_path):
    import cv2

    _photo().save(tmp_path / "photo.png")
    _photo((32, 24), seed=1).convert("L").save(tmp_path / "gray.png")
    lines = [
        {
            "id": "canny",
            "prompt": "a red disc",
            "seed": 1,
            "height": 16,
            "width": 24,
            "control_image": "photo.png",
            "control_preprocess": CANNY,
            "controlnet_conditioning_scale": 0.7,
        },
        {
            # no size: the control image's (24 x 32), as diffusers takes it
            "id": "window",
            "prompt": "a green bar",
            "negative_prompt": "blurry",
            "seed": 2,
            "guidance_scale": 5.0,
            "control_image": str(tmp_path / "gray.png"),
            "control_guidance_start": 0.25,
            "control_guidance_end": 0.75,
            "guess_mode": True,
        },
    ]
    prompts = _write(tmp_path / "prompts.jsonl", lines)
    out = tmp_path / "render"
    assert cli.main(_args(sd_cn, prompts, out)) == 0

    edges = cv2.Canny(np.asarray(_photo()), CANNY["low"], CANNY["high"])
    edge_image = Image.fromarray(np.stack([edges] * 3, axis=-1))
    stored = np.asarray(Image.open(out / "outputs" / "canny.control.png"))
    np.testing.assert_array_equal(stored, np.asarray(edge_image))
    references = {
        "canny": _diffusers(sd_cn, lines[0], edge_image, 16, 24),
        "window": _diffusers(sd_cn, lines[1], Image.open(tmp_path / "gray.png"), 24, 32),
    }
    for name, reference in references.items():
        ours = np.load(out / "outputs" / f"{name}.npy")[0]
        np.testing.assert_allclose(ours, reference, atol=TOLERANCE, rtol=0)
    records = {p.stem: json.loads(p.read_text()) for p in (out / "records").glob("*.json")}
    assert records["canny"]["control_outputs"] == ["outputs/canny.control.png"]
    assert records["window"]["params"]["guess_mode"] is True
    assert (records["window"]["params"]["height"], records["window"]["params"]["width"]) == (24, 32)

    # resume: a changed control image re-renders its prompt only
    before = {name: (out / "records" / f"{name}.json").stat().st_mtime_ns for name in references}
    time.sleep(0.01)
    _photo((32, 24), seed=2).convert("L").save(tmp_path / "gray.png")
    assert cli.main(_args(sd_cn, prompts, out, "--force")) == 0
    after = {name: (out / "records" / f"{name}.json").stat().st_mtime_ns for name in references}
    assert after["canny"] == before["canny"]
    assert after["window"] != before["window"]


def test_bad_control_lines_fail_before_rendering(sd_cn, tmp_path, capsys):
    _photo().save(tmp_path / "photo.png")
    cases = [
        ({"prompt": "x", "height": 16, "width": 16}, "needs a control_image"),
        ({"prompt": "x", "control_image": "missing.png"}, "missing.png"),
        ({"prompt": "x", "control_image": "photo.png", "control_mode": 1}, "union"),
        (
            {"prompt": "x", "control_image": "photo.png", "controlnet_conditioning_scale": [1, 2]},
            "2 entries for 1 image",
        ),
        (
            {
                "prompt": "x",
                "control_image": "photo.png",
                "control_guidance_start": 0.8,
                "control_guidance_end": 0.5,
            },
            "control_guidance_start",
        ),
        (
            {"prompt": "x", "control_image": "photo.png", "control_preprocess": {"kind": "hed"}},
            "kind",
        ),
    ]
    for k, (line, message) in enumerate(cases):
        prompts = _write(tmp_path / f"p{k}.jsonl", [line])
        assert cli.main(_args(sd_cn, prompts, tmp_path / f"out{k}")) == 2, line
        err = capsys.readouterr().err
        assert message in err, (line, err)
        assert not (tmp_path / f"out{k}" / "manifest.json").exists()


def test_control_fields_without_a_controlnet_are_refused(tmp_path, capsys):
    plain = build_sd_pipeline(tmp_path / "sd", seed=1)
    _photo().save(tmp_path / "photo.png")
    prompts = _write(tmp_path / "p.jsonl", [{"prompt": "x", "control_image": "photo.png"}])
    assert cli.main(_args(plain, prompts, tmp_path / "out", "height=16", "width=16")) == 2
    assert "no ControlNet" in capsys.readouterr().err
