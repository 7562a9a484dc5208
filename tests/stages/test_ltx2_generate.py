"""``difforge generate`` with an LTX-2 pipeline (tests/support/tiny_ltx2.py): video with sound.

One prompt file, rendered once on the CPU's 8 virtual devices with ``save_arrays``:

- ``seeded``: a seed alone, the video unguided (the config's ``guidance_scale=1``), everything
  else LTX2Pipeline's defaults (the audio's CFG at 7, so CFG runs; rescale 0.7; modality
  guidance 3); its video and audio noise are drawn from the seed,
  video first then audio, from one PCG64 generator (spelled out here, not taken from the
  family);
- ``given``: the line's ``latents`` [C, F', H', W'] and ``audio_latents`` [C_a, L, M'] .npy
  files noised by its ``noise_scale`` 0.2 with its seed's noise (spelled out here), CFG 3 with
  its own ``audio_guidance_scale`` 6 and the modality guidance off;
- ``paced``: a seed at ``frame_rate`` 16 (its sound 14 latent frames long, not 9) and
  ``motion_speed`` 0.5, in a batch of its own.

Each line's frames (.npy) and waveform (.audio.npy) equal the library's render of the same
latents and settings (the Pipeline API, as tests/jaxcore/test_ltx2_pipeline.py renders; that
one is proven against diffusers) within :data:`TOLERANCE`; each MP4 holds one video and one
audio stream and plays at the line's frame rate (the config leaves ``output.fps`` unset). A
line with ``noise_scale`` 1.5 fails naming it and the line; ``audio_latents`` on a Wan model
fails naming the line.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest

from jaxcore import families
from jaxcore.families import ltx2
from pipelines import cli
from stages.common.errors import StageInputError
from stages.common.subprocesses import allow_fork_exec_under_jax
from stages.generate.config import SamplingSection
from stages.generate.prompts import parse_prompts
from tests.support import tiny_ltx2

REPO = Path(__file__).resolve().parents[2]
TOLERANCE = 1e-5  # max abs on [0, 1] pixels and on the waveform (in [-1, 1])
HEIGHT = WIDTH = 32  # LTX2Pipeline: multiples of 32
NUM_FRAMES = 9  # 3 latent frames; 9 audio latent frames at 24 fps, 14 at 16
STEPS = 2
MAX_SEQUENCE_LENGTH = 16  # a multiple of the connectors' 8 registers
SEEDED = {"id": "seeded", "prompt": "a red fox in the snow", "seed": 5}
GIVEN = {
    "id": "given",
    "prompt": "a cat on a mat",
    "negative_prompt": "a long prompt",
    "guidance_scale": 3.0,
    "audio_guidance_scale": 6.0,
    "modality_scale": 1.0,
    "latents": "noise/video.npy",
    "audio_latents": "noise/audio.npy",
    "noise_scale": 0.2,
    "seed": 7,
}
PACED = {"id": "paced", "prompt": "a slow river", "frame_rate": 16, "motion_speed": 0.5, "seed": 3}
LINES = (SEEDED, GIVEN, PACED)
# what each line renders with, by the library's names: (guidance scale, rescale, settings);
# what a line leaves out is LTX2Pipeline.__call__'s default (STG's block 28 is past the tiny
# model's 2 blocks, so its pass would change nothing and does not run)
DEFAULTS = {
    "audio_guidance_scale": 7.0,
    "audio_guidance_rescale": 0.7,
    "modality_scale": 3.0,
    "audio_modality_scale": 3.0,
}
SETTINGS = {
    # the video unguided (the config's guidance_scale=1), the audio guided at its default 7:
    # CFG runs, as diffusers' do_classifier_free_guidance
    "seeded": (1.0, 0.7, {"seed": 5, **DEFAULTS}),
    "given": (
        3.0,
        0.7,
        {
            "seed": 7,
            **DEFAULTS,
            "audio_guidance_scale": 6.0,
            "modality_scale": 1.0,
            "noise_scale": 0.2,
        },
    ),
    "paced": (1.0, 0.7, {"seed": 3, **DEFAULTS, "frame_rate": 16, "motion_speed": 0.5}),
}


@pytest.fixture(autouse=True)
def _fork_exec_allowed():
    """ffmpeg is started under JAX (see tests/stages/test_generate_audio.py)."""
    allow_fork_exec_under_jax.__wrapped__()


def _generate(model: Path, prompt_file: Path, out: Path, *extra: str) -> int:
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
            "save_arrays=true",
            "-q",
            *extra,
        ]
    )


def _write_prompts(folder: Path, lines: list[dict]) -> Path:
    path = folder / "prompts.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tiny_ltx2.build_ltx2_pipeline(tmp_path_factory.mktemp("ltx2_generate"))


@pytest.fixture(scope="module")
def pipe(model_dir):
    return families.load_pipeline(model_dir)


def _shapes(pipe, frame_rate=24.0) -> tuple[tuple[int, ...], tuple[int, ...], ltx2.JointLayout]:
    """(video [C, F', H', W'], audio [C_a, L, M'], the joint layout) of the test's size."""
    shape = pipe.latent_shape(HEIGHT, WIDTH, NUM_FRAMES, {"frame_rate": frame_rate})
    joint = ltx2.layout(pipe.configs, shape[1:], frame_rate)
    channels = pipe.configs["audio_vae"].latent_channels
    audio = (channels, joint.audio_frames, joint.audio_width // channels)
    return (joint.channels, *joint.grid), audio, joint


@pytest.fixture(scope="module")
def rendered(model_dir, pipe, tmp_path_factory):
    """(the run's folder, each line's (video, audio) initial latents) of one generate run."""
    folder = tmp_path_factory.mktemp("ltx2_generate_run")
    video_shape, audio_shape, _ = _shapes(pipe)
    rng = np.random.default_rng(123)  # not PCG64(7): the files are not the seed's noise
    given = (
        rng.standard_normal(video_shape, np.float32),
        rng.standard_normal(audio_shape, np.float32),
    )
    (folder / "noise").mkdir()
    np.save(folder / "noise/video.npy", given[0])
    np.save(folder / "noise/audio.npy", given[1])

    def drawn(seed, audio=audio_shape):  # a seed's noise: video, then audio, one generator
        generator = np.random.Generator(np.random.PCG64(seed))
        return (
            generator.standard_normal(video_shape, np.float32),
            generator.standard_normal(audio, np.float32),
        )

    scale = np.float32(GIVEN["noise_scale"])  # diffusers' _create_noised_state
    noised = tuple(
        scale * n + (np.float32(1) - scale) * x
        for n, x in zip(drawn(GIVEN["seed"]), given, strict=True)
    )
    paced_audio = _shapes(pipe, PACED["frame_rate"])[1]
    assert paced_audio[1] == 14 != audio_shape[1]
    prompts = _write_prompts(folder, list(LINES))
    out = folder / "run"
    assert _generate(model_dir, prompts, out) == 0
    latents = {
        "seeded": drawn(SEEDED["seed"]),
        "given": noised,
        "paced": drawn(PACED["seed"], paced_audio),
    }
    return out, latents, given


def _library_render(pipe, line: dict, video, audio):
    """The Pipeline API's render of one line: (frames [F, H, W, 3], waveform [C, S])."""
    scale, rescale, settings = SETTINGS[line["id"]]
    row = pipe.guidance(scale, guidance_rescale=rescale, settings=settings)
    assert row.uses_cfg  # both lines: the seeded one by its audio scale alone
    cond, uncond, scales = pipe.conditioning(
        [line["prompt"]],
        [line.get("negative_prompt", "")],
        [row],
        MAX_SEQUENCE_LENGTH,
        size=(HEIGHT, WIDTH, NUM_FRAMES),
        micro_conditioning=[settings],
    )
    joint = _shapes(pipe, settings.get("frame_rate", 24.0))[2]
    latents = ltx2.joint_latents(video[None], audio[None], joint)
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
    """The ``Stream #0:n ...`` lines ``ffmpeg -i`` prints of a file."""
    import imageio_ffmpeg

    command = [imageio_ffmpeg.get_ffmpeg_exe(), "-nostdin", "-hide_banner", "-i", str(path)]
    probe = subprocess.run(command, capture_output=True, check=False).stderr.decode()
    return [line.strip() for line in probe.splitlines() if re.search(r"Stream #0:\d", line)]


@pytest.mark.parametrize("line", LINES, ids=lambda line: line["id"])
def test_each_line_renders_what_the_library_renders(pipe, rendered, line):
    out, latents, _ = rendered
    record = json.loads((out / f"records/{line['id']}.json").read_text())
    frames = np.load(out / record["array"])
    wave = np.load(out / record["audio"]["array"])
    want_frames, want_wave = _library_render(pipe, line, *latents[line["id"]])

    assert frames.shape == want_frames.shape == (NUM_FRAMES, HEIGHT, WIDTH, 3)
    assert wave.shape == want_wave.shape and wave.dtype == np.float32
    # not trivially equal: the render varies across pixels and samples
    assert want_frames.std() > 1e-2 and want_wave.std() > 1e-3
    pixel_error = np.abs(frames - want_frames).max()
    wave_error = np.abs(wave - want_wave).max()
    print(f"{line['id']}: pixels {pixel_error:.2e}, waveform {wave_error:.2e}")
    assert pixel_error < TOLERANCE and wave_error < TOLERANCE

    streams = _streams(out / record["output"])
    assert len(streams) == 2, streams
    assert sum("Video:" in s for s in streams) == 1 and sum("Audio:" in s for s in streams) == 1
    fps = line.get("frame_rate", 24)  # the MP4 plays at the line's rate: its sound's
    assert any(re.search(rf"\b{fps} fps\b", s) for s in streams), streams
    seconds = record["audio"]["seconds"]
    assert abs(seconds - NUM_FRAMES / fps) < 0.05, seconds
    # the line's files and settings are what the record (and so the fingerprint) holds
    params = record["params"]
    assert (
        params["seed"] == line["seed"]
        and params["modality_scale"] == SETTINGS[line["id"]][2]["modality_scale"]
    )
    if "audio_latents" in line:
        assert params["audio_latents"].endswith(line["audio_latents"])
        assert params["latents"].endswith(line["latents"])
    else:
        assert "audio_latents" not in params and params["latents"] is None


def test_the_audio_latents_decide_the_sound(pipe, rendered):
    """The ``given`` line's waveform is its audio file's: the seed's audio noise in its place
    renders another sound (so the equality above could fail)."""
    out, latents, files = rendered
    video, _ = latents["given"]
    seed_audio = np.random.Generator(np.random.PCG64(GIVEN["seed"]))
    seed_audio.standard_normal(video.shape, np.float32)
    audio = seed_audio.standard_normal(latents["given"][1].shape, np.float32)
    _, other = _library_render(pipe, GIVEN, video, audio)
    assert np.abs(latents["given"][0] - files[0]).max() > 0.1  # noise_scale moved the start
    wave = np.load(out / "outputs/given.audio.npy")
    changed = np.abs(wave - other).max()
    print(f"the seed's audio noise changes the waveform by {changed:.2e}")
    assert changed > 100 * TOLERANCE


def test_a_setting_out_of_range_is_refused_naming_it(model_dir, tmp_path, capsys):
    prompts = _write_prompts(tmp_path, [SEEDED, {"prompt": "x", "noise_scale": 1.5}])
    assert _generate(model_dir, prompts, tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert "line 2" in err and "noise_scale=1.5" in err, err
    assert not (tmp_path / "out/outputs").exists()


def test_audio_latents_on_a_model_without_sound_is_refused(tmp_path, capsys):
    from pipelines.embedded.tiny import build_tiny_wan_pipeline

    wan_dir = build_tiny_wan_pipeline(tmp_path / "wan", seed=1)
    line = {"prompt": "x", "audio_latents": "audio.npy"}
    prompts = _write_prompts(tmp_path, [{"prompt": "fine"}, line])
    assert (
        _generate(wan_dir, prompts, tmp_path / "out", "num_frames=1", "height=16", "width=16") == 2
    )
    err = capsys.readouterr().err
    assert "line 2" in err and "audio_latents" in err, err


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("audio_latents", "audio.wav", "audio_latents must name a .npy file"),
        ("use_cross_timestep", 1, "use_cross_timestep must be true or false"),
        ("audio_guidance_scale", "7", "audio_guidance_scale must be a number"),
    ],
)
def test_the_new_fields_are_checked_naming_the_line(field, value, message):
    """Pure parsing (no model): each new field's type, the line and the field named."""
    line = json.dumps({"prompt": "x", field: value})
    defaults = SamplingSection(
        height=32, width=32, num_frames=9, num_inference_steps=2, guidance_scale=1.0
    )
    with pytest.raises(StageInputError, match=re.escape(f"p.jsonl line 2: {message}")):
        parse_prompts("p.jsonl", ['{"prompt": "fine"}', line], defaults)
