"""``difforge generate`` with a Flux.2 [klein] pipeline: a prompt file's text-only lines and its
lines with one or a list of reference images render as the library does (its Pipeline API,
proven against diffusers in tests/jaxcore/test_flux2_pipeline.py), with the config's
``model.text_encoder_out_layers``; a list ``image`` is refused by a model that takes one image,
and a changed reference file re-renders its prompt."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest

from jaxcore import storage
from jaxcore.artifacts import open_artifact
from jaxcore.families import load_pipeline
from jaxcore.sampling import initial_latents
from pipelines import cli
from pipelines.embedded.tiny import build_tiny_wan_pipeline
from tests.support.tiny_flux2 import build_flux2_pipeline

REPO = Path(__file__).resolve().parents[2]
HEIGHT, WIDTH, STEPS, LENGTH = 16, 24, 2, 32
LAYERS = (5, 12, 28)  # non-default text_encoder_out_layers
LINES = [
    {"id": "text", "prompt": "a red fox", "seed": 3},
    {"id": "one", "prompt": "make it blue", "seed": 4, "image": "refs/a.png"},
    {"id": "two", "prompt": "blend them", "seed": 5, "image": ["refs/a.png", "refs/b.png"]},
]


@pytest.fixture(scope="module")
def klein_dir(tmp_path_factory) -> Path:
    return build_flux2_pipeline(tmp_path_factory.mktemp("klein"), seed=1)


def _write_image(path: Path, width: int, height: int, seed: int) -> None:
    """A random RGB PNG of ``width`` x ``height`` at ``path``."""
    import PIL.Image

    rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    PIL.Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(path)


def _args(pipeline: Path, prompts: Path, out: Path, *extra: str) -> list[str]:
    """``difforge generate`` of ``prompts`` with ``pipeline`` into ``out`` (``extra``: more
    ``key=value`` overrides), quiet."""
    return [
        "generate",
        str(REPO / "configs/stages/generate.yml"),
        f"pretrained_model_name_or_path={pipeline}",
        f"prompt_file={prompts}",
        f"output_dir={out}",
        f"height={HEIGHT}",
        f"width={WIDTH}",
        "num_frames=1",
        f"num_inference_steps={STEPS}",
        f"sampling.max_sequence_length={LENGTH}",
        *extra,
        "-q",
    ]


def _array(root: Path, name: str) -> np.ndarray:
    """A prompt's saved array [F, H, W, 3]."""
    return np.load(io.BytesIO(storage.read_bytes(str(root / "outputs" / f"{name}.npy"))))


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
    guidance = pipe.guidance(5.0)  # configs/stages/generate.yml's guidance_scale
    cond, uncond, scales = pipe.conditioning(
        [line["prompt"]], [""], [guidance], LENGTH, images=images, size=(HEIGHT, WIDTH, 1)
    )
    z = pipe.sample(latents, cond, uncond, num_inference_steps=STEPS, cfg_scale=scales)
    return np.asarray(pipe.decode(z))[0]


def test_klein_prompt_file_renders_as_the_library_does(klein_dir, tmp_path):
    _write_image(tmp_path / "refs/a.png", 72, 64, seed=1)
    _write_image(tmp_path / "refs/b.png", 64, 84, seed=2)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(line) + "\n" for line in LINES))
    out = tmp_path / "render"
    layers = "model.text_encoder_out_layers=[" + ",".join(map(str, LAYERS)) + "]"
    args = _args(klein_dir, prompts, out, "save_arrays=true", layers)
    assert cli.main(args) == 0
    records = {p.stem: json.loads(p.read_text()) for p in (out / "records").glob("*.json")}
    assert records["one"]["params"]["image"] == str(tmp_path / "refs/a.png")
    assert records["two"]["params"]["image"] == [str(tmp_path / f"refs/{n}.png") for n in "ab"]

    pipe = load_pipeline(klein_dir, text_encoder_out_layers=LAYERS)
    arrays = {}
    for line in LINES:
        arrays[line["id"]] = _array(out, line["id"])
        expected = _library_render(pipe, line, tmp_path)
        np.testing.assert_allclose(arrays[line["id"]], expected, atol=1e-5, rtol=0)
    assert np.abs(arrays["two"] - arrays["one"]).max() > 1e-3  # the second reference matters

    # a changed reference: --force reruns, and only the prompt that reads it renders again
    _write_image(tmp_path / "refs/b.png", 64, 84, seed=9)
    assert cli.main([*args, "--force"]) == 0
    summary = open_artifact(str(out), "generate").summary
    assert (summary["rendered_this_run"], summary["reused"]) == (1, 2)
    assert np.abs(_array(out, "two") - arrays["two"]).max() > 1e-4
    np.testing.assert_array_equal(_array(out, "one"), arrays["one"])


def test_a_list_of_images_is_refused_by_a_one_image_model(tmp_path, capsys):
    wan = build_tiny_wan_pipeline(tmp_path / "wan", seed=1)
    _write_image(tmp_path / "a.png", 16, 16, seed=1)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        json.dumps({"prompt": "x"}) + "\n" + json.dumps({"prompt": "y", "image": ["a.png"]}) + "\n"
    )
    assert cli.main(_args(wan, prompts, tmp_path / "out")) == 2
    err = capsys.readouterr().err
    assert "line 2" in err and "not a list" in err


def test_text_encoder_out_layers_is_refused_by_a_family_without_it(tmp_path, capsys):
    wan = build_tiny_wan_pipeline(tmp_path / "wan", seed=1)
    prompts = tmp_path / "p.txt"
    prompts.write_text("x\n")
    args = _args(wan, prompts, tmp_path / "out", "model.text_encoder_out_layers=[1]")
    assert cli.main(args) == 2
    assert "model.text_encoder_out_layers" in capsys.readouterr().err


def test_a_line_without_a_size_renders_at_its_first_reference_size(klein_dir, tmp_path):
    """As Flux2KleinPipeline with height / width None: the first reference's size as it is
    prepared (cropped to the latent multiple; here 4), each side the line leaves unset."""
    _write_image(tmp_path / "refs/c.png", 70, 90, seed=3)
    _write_image(tmp_path / "refs/d.png", 64, 64, seed=4)
    lines = [
        {"id": "sized-by-ref", "prompt": "edit", "seed": 6, "image": ["refs/c.png", "refs/d.png"]},
        {"id": "own-size", "prompt": "edit", "seed": 7, "image": "refs/c.png", "height": 16},
    ]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "render"
    args = _args(klein_dir, prompts, out, "save_arrays=true")
    args = [a for a in args if not a.startswith(("height=", "width="))]
    args[-1:-1] = ["height=null", "width=null"]  # the stage config's 16 x 16 unset
    assert cli.main(args) == 0
    records = {p.stem: json.loads(p.read_text()) for p in (out / "records").glob("*.json")}
    params = records["sized-by-ref"]["params"]
    assert (params["height"], params["width"]) == (88, 68)
    assert _array(out, "sized-by-ref").shape == (1, 88, 68, 3)
    own = records["own-size"]["params"]
    assert (own["height"], own["width"]) == (16, 68)  # the width still from the image


def test_reference_size_caps_the_area_as_the_image_processor_does():
    """The size arithmetic against Flux2ImageProcessor's own resize of large images."""
    import PIL.Image
    from diffusers.pipelines.flux2.image_processor import Flux2ImageProcessor

    from jaxcore.families.flux2 import reference_size

    for width, height in [(1500, 1000), (2049, 513), (1024, 1024), (333, 4000), (100, 70)]:
        image = PIL.Image.new("RGB", (width, height))
        resized = Flux2ImageProcessor._resize_if_exceeds_area(image, 1024 * 1024)
        expected = tuple((side // 16) * 16 for side in resized.size)
        assert reference_size(width, height, 16) == expected, (width, height)
