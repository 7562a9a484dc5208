"""``difforge generate`` with a FLUX.2 [dev] (Flux2Pipeline) folder: a prompt file's text-only
lines (the config's guidance_scale, and a line's own) and a line with a reference image
render as the library does (its Pipeline API, proven against diffusers in
tests/jaxcore/test_flux2_dev.py), with the config's ``model.text_encoder_out_layers``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from jaxcore.families import load_pipeline
from jaxcore.sampling import initial_latents
from pipelines import cli
from tests.stages.test_flux2_generate import HEIGHT, LENGTH, STEPS, WIDTH, _args, _array
from tests.stages.test_flux2_generate import _write_image as write_image
from tests.support.tiny_flux2_dev import build_flux2_dev_pipeline

CONFIG_GUIDANCE = 5.0  # configs/stages/generate.yml's guidance_scale
LAYERS = (4, 17, 30)  # non-default text_encoder_out_layers
LINES = [
    {"id": "text", "prompt": "a red fox", "seed": 3},
    {"id": "guided", "prompt": "a red fox", "seed": 3, "guidance_scale": 2.5},
    {"id": "one", "prompt": "make it blue", "seed": 4, "image": "refs/a.png"},
]


@pytest.fixture(scope="module")
def dev_dir(tmp_path_factory) -> Path:
    return build_flux2_dev_pipeline(tmp_path_factory.mktemp("flux2_dev"), seed=1)


def _library_render(pipe, line: dict, folder: Path) -> np.ndarray:
    """The line's render [1, H, W, 3] through the Pipeline API, from its seed's latents."""
    import PIL.Image

    given = line.get("image")
    images = None
    if given is not None:
        paths = given if isinstance(given, list) else [given]
        refs = [PIL.Image.open(folder / p).convert("RGB") for p in paths]
        images = [(refs if isinstance(given, list) else refs[0], None)]
    latents = initial_latents(line["seed"], pipe.latent_shape(HEIGHT, WIDTH, 1))[None]
    guidance = pipe.guidance(line.get("guidance_scale", CONFIG_GUIDANCE))
    cond, uncond, scales = pipe.conditioning(
        [line["prompt"]], [""], [guidance], LENGTH, images=images, size=(HEIGHT, WIDTH, 1)
    )
    z = pipe.sample(latents, cond, uncond, num_inference_steps=STEPS, cfg_scale=scales)
    return np.asarray(pipe.decode(z))[0]


def test_dev_prompt_file_renders_as_the_library_does(dev_dir, tmp_path):
    write_image(tmp_path / "refs/a.png", 72, 64, seed=1)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(line) + "\n" for line in LINES))
    out = tmp_path / "render"
    layers = "model.text_encoder_out_layers=[" + ",".join(map(str, LAYERS)) + "]"
    assert cli.main(_args(dev_dir, prompts, out, "save_arrays=true", layers)) == 0
    records = {p.stem: json.loads(p.read_text()) for p in (out / "records").glob("*.json")}
    assert records["one"]["params"]["image"] == str(tmp_path / "refs/a.png")
    assert records["guided"]["params"]["guidance_scale"] == 2.5

    pipe = load_pipeline(dev_dir, text_encoder_out_layers=LAYERS)
    arrays = {}
    for line in LINES:
        arrays[line["id"]] = _array(out, line["id"])
        expected = _library_render(pipe, line, tmp_path)
        np.testing.assert_allclose(arrays[line["id"]], expected, atol=1e-5, rtol=0)
    assert np.abs(arrays["guided"] - arrays["text"]).max() > 1e-3  # the guidance matters
