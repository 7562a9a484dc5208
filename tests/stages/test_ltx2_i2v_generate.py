"""``difforge generate`` with an LTX-2 image-to-video pipeline (tests/support/tiny_ltx2_i2v.py).

One prompt file, rendered once with ``save_arrays``; each line has an ``image`` (a PNG of
another size than the render's), which the family re-compresses (PyAV; at the default CRF 33
unless the line sets ``image_crf``), resizes, encodes and holds as the first latent frame:

- ``seeded``: a seed alone, the video unguided (the config's ``guidance_scale=1``), the rest
  LTX2Pipeline's defaults (the audio's CFG at 7, so CFG runs);
- ``given``: the line's ``latents`` (the noise of the frames after the first) and
  ``audio_latents`` .npy files, CFG 3, ``image_crf`` 18.

Each line's frames (.npy) and waveform (.audio.npy) equal the library's render of the same
image, latents and settings (the Pipeline API, as tests/jaxcore/test_ltx2_i2v.py renders it,
proven against diffusers there) within :data:`TOLERANCE`; each MP4 holds one video and one
audio stream; the first frame follows the image; a line without ``image`` is refused naming
the line.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from jaxcore import families
from jaxcore.families import ltx2
from pipelines import cli
from stages.common.subprocesses import allow_fork_exec_under_jax
from tests.support import tiny_ltx2_i2v

REPO = Path(__file__).resolve().parents[2]
TOLERANCE = 1e-5  # max abs on [0, 1] pixels and on the waveform (in [-1, 1])
HEIGHT = WIDTH = 32
NUM_FRAMES = 9  # 3 latent frames; 9 audio latent frames at 24 fps
STEPS = 2
MAX_SEQUENCE_LENGTH = 16
SEEDED = {"id": "seeded", "prompt": "a red fox in the snow", "image": "fox.png", "seed": 5}
GIVEN = {
    "id": "given",
    "prompt": "a cat on a mat",
    "negative_prompt": "a long prompt",
    "image": "cat.png",
    "guidance_scale": 3.0,
    "latents": "noise/video.npy",
    "audio_latents": "noise/audio.npy",
    "image_crf": 18,
    "seed": 7,
}
DEFAULTS = {  # LTX2ImageToVideoPipeline.__call__'s (STG's block 28: past the tiny model's 2)
    "audio_guidance_scale": 7.0,
    "audio_guidance_rescale": 0.7,
    "modality_scale": 3.0,
    "audio_modality_scale": 3.0,
}
SETTINGS = {  # per line: (guidance scale, rescale, settings), by the library's names
    "seeded": (1.0, 0.7, {"seed": 5, **DEFAULTS}),
    "given": (3.0, 0.7, {"seed": 7, **DEFAULTS, "image_crf": 18}),
}


@pytest.fixture(autouse=True)
def _fork_exec_allowed():
    """ffmpeg is started under JAX (see tests/stages/test_generate_audio.py)."""
    allow_fork_exec_under_jax.__wrapped__()


def _generate(model: Path, prompt_file: Path, out: Path) -> int:
    return cli.main(
        [
            "generate",
            str(REPO / "configs/stages/generate.yml"),
            f"pretrained_model_name_or_path={model}",
            f"prompt_file={prompt_file}",
            f"output_dir={out}",
            f"num_inference_steps={STEPS}",
            f"max_sequence_length={MAX_SEQUENCE_LENGTH}",
            f"height={HEIGHT}",
            f"width={WIDTH}",
            f"num_frames={NUM_FRAMES}",
            "guidance_scale=1",
            "output.fps=24",
            "save_arrays=true",
            "-q",
        ]
    )


def _write_prompts(folder: Path, lines: list[dict]) -> Path:
    path = folder / "prompts.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("ltx2_i2v_generate")
    return tiny_ltx2_i2v.build_ltx2_i2v_pipeline(folder / "pipe")


@pytest.fixture(scope="module")
def pipe(model_dir):
    return families.load_pipeline(model_dir)


def _shapes(pipe):
    joint = ltx2.layout(pipe.configs, pipe.latent_shape(HEIGHT, WIDTH, NUM_FRAMES)[1:])
    channels = pipe.configs["audio_vae"].latent_channels
    audio = (channels, joint.audio_frames, joint.audio_width // channels)
    return (joint.channels, *joint.grid), audio, joint


@pytest.fixture(scope="module")
def rendered(model_dir, pipe, tmp_path_factory):
    """(the run's folder, each line's (image, video latents, audio latents))."""
    folder = tmp_path_factory.mktemp("ltx2_i2v_generate_run")
    video_shape, audio_shape, _ = _shapes(pipe)
    images = {
        "seeded": tiny_ltx2_i2v.conditioning_image(40, 56, seed=1),
        "given": tiny_ltx2_i2v.conditioning_image(48, 36, seed=2),
    }
    for line in (SEEDED, GIVEN):
        images[line["id"]].save(folder / line["image"])
    rng = np.random.default_rng(123)
    given = (
        rng.standard_normal(video_shape, np.float32),
        rng.standard_normal(audio_shape, np.float32),
    )
    (folder / "noise").mkdir()
    np.save(folder / "noise/video.npy", given[0])
    np.save(folder / "noise/audio.npy", given[1])
    generator = np.random.Generator(np.random.PCG64(SEEDED["seed"]))
    seeded = (
        generator.standard_normal(video_shape, np.float32),
        generator.standard_normal(audio_shape, np.float32),
    )
    out = folder / "run"
    assert _generate(model_dir, _write_prompts(folder, [SEEDED, GIVEN]), out) == 0
    return out, {
        "seeded": (Image.open(folder / SEEDED["image"]), *seeded),
        "given": (Image.open(folder / GIVEN["image"]), *given),
    }


def _library_render(pipe, line: dict, image, video, audio):
    """The Pipeline API's render of one line: (frames [F, H, W, 3], waveform [C, S])."""
    scale, rescale, settings = SETTINGS[line["id"]]
    row = pipe.guidance(scale, guidance_rescale=rescale, settings=settings)
    cond, uncond, scales = pipe.conditioning(
        [line["prompt"]],
        [line.get("negative_prompt", "")],
        [row],
        MAX_SEQUENCE_LENGTH,
        images=[(image, None)],
        size=(HEIGHT, WIDTH, NUM_FRAMES),
        micro_conditioning=[settings],
    )
    latents = ltx2.joint_latents(video[None], audio[None], _shapes(pipe)[2])
    result = pipe.sample(
        latents,
        cond,
        uncond,
        num_inference_steps=STEPS,
        cfg_scale=scales,
        guidance_rescale=[row.guidance_rescale],
    )
    frames = np.asarray(pipe.decode(result, cond))[0]
    wave, _ = pipe.family.decode_audio(pipe, result, cond)
    return frames, wave[0]


def _streams(path: Path) -> list[str]:
    import imageio_ffmpeg

    command = [imageio_ffmpeg.get_ffmpeg_exe(), "-nostdin", "-hide_banner", "-i", str(path)]
    probe = subprocess.run(command, capture_output=True, check=False).stderr.decode()
    return [line.strip() for line in probe.splitlines() if re.search(r"Stream #0:\d", line)]


@pytest.mark.slow
@pytest.mark.parametrize("line", [SEEDED, GIVEN], ids=lambda line: line["id"])
def test_each_line_renders_what_the_library_renders(pipe, rendered, line):
    out, inputs = rendered
    record = json.loads((out / f"records/{line['id']}.json").read_text())
    frames = np.load(out / record["array"])
    wave = np.load(out / record["audio"]["array"])
    want_frames, want_wave = _library_render(pipe, line, *inputs[line["id"]])

    assert frames.shape == want_frames.shape == (NUM_FRAMES, HEIGHT, WIDTH, 3)
    assert wave.shape == want_wave.shape and wave.dtype == np.float32
    assert want_frames.std() > 1e-2 and want_wave.std() > 1e-3
    pixel_error = np.abs(frames - want_frames).max()
    wave_error = np.abs(wave - want_wave).max()
    print(f"{line['id']}: pixels {pixel_error:.2e}, waveform {wave_error:.2e}")
    assert pixel_error < TOLERANCE and wave_error < TOLERANCE
    streams = _streams(out / record["output"])
    assert len(streams) == 2, streams
    assert sum("Video:" in s for s in streams) == 1 and sum("Audio:" in s for s in streams) == 1
    assert record["params"]["image"].endswith(line["image"])


@pytest.mark.slow
def test_the_image_decides_the_render(pipe, rendered):
    """Another image in the ``given`` line's place renders other frames (so the equality above
    could fail)."""
    out, inputs = rendered
    _, video, audio = inputs["given"]
    other = tiny_ltx2_i2v.conditioning_image(48, 36, seed=9)
    frames, _ = _library_render(pipe, GIVEN, other, video, audio)
    changed = np.abs(np.load(out / "outputs/given.npy") - frames).max()
    print(f"another image changes the frames by {changed:.2e}")
    assert changed > 100 * TOLERANCE


def test_a_line_without_image_is_refused_naming_it(model_dir, tmp_path, capsys):
    folder = tmp_path
    tiny_ltx2_i2v.conditioning_image(32, 32).save(folder / "fox.png")
    prompts = _write_prompts(folder, [SEEDED, {"prompt": "no image"}])
    assert _generate(model_dir, prompts, folder / "out") == 2
    err = capsys.readouterr().err
    assert "line 2" in err and "image" in err, err
    assert not (folder / "out/outputs").exists()
