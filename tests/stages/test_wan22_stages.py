"""Wan 2.2 / image-to-video through the stages: one expert trained and rendered back in its
two-expert pipeline; prompt files with conditioning images."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxcore.artifacts import open_artifact
from jaxcore.compute import ComputeConfig
from jaxcore.sharding import MeshConfig, make_mesh
from pipelines import cli
from stages.generate import model as generate_model
from stages.generate.config import GenerateConfig, ModelSection
from tests.support import wan_variants
from tests.support.convert_artifacts import TinyDataConfig, write_convert_artifact

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def two_expert_dir(tmp_path_factory):
    return wan_variants.build_two_expert_pipeline(tmp_path_factory.mktemp("wan22"))


def _train(data_uri, pipeline_dir, out, expert, steps, *extra) -> int:
    return cli.main(
        [
            "train",
            str(REPO / "configs/stages/train.yml"),
            f"data={data_uri}",
            f"output_dir={out}",
            "dataset_type=tfrecord",
            "model.model_config=null",
            f"model.pretrained_model_name_or_path={pipeline_dir}",
            f"model.expert={expert}",
            f"max_train_steps={steps}",
            f"checkpoint_every={steps}",
            "eval_every=0",
            "per_device_batch_size=1",
            *extra,
            "-q",
        ]
    )


@pytest.mark.parametrize("expert", ["low", pytest.param("high", marks=pytest.mark.slow)])
def test_one_expert_trains_and_loads_back_into_its_slot(two_expert_dir, tmp_path, expert):
    """model.expert trains transformer_2 (low) or transformer (high) on its own timestep range;
    generate with the train artifact puts the trained weights in that slot, the base
    pipeline's in the other."""
    data_uri = str(tmp_path / "data")
    write_convert_artifact(data_uri, TinyDataConfig())
    out = tmp_path / "train"
    assert _train(data_uri, two_expert_dir, out, expert, 3) == 0
    source = open_artifact(str(out), "train").summary["model_source"]
    assert source["expert"] == expert and source["boundary_ratio"] == 0.875
    assert source["timestep_range"] == ([0.0, 0.875] if expert == "low" else [0.875, 1.0])

    def described(path, base=None):
        config = GenerateConfig(
            pretrained_model_name_or_path=str(path),
            prompt_file="unused.txt",
            output_dir=str(tmp_path / "unused"),
            model=ModelSection(checkpoint="final", base_pipeline=base),
        )
        return generate_model.describe(config)

    trained_source = described(out, str(two_expert_dir))
    mesh = make_mesh(MeshConfig())
    pipe = generate_model.load(trained_source, ComputeConfig(), mesh)
    base = generate_model.load(described(two_expert_dir), ComputeConfig(), mesh)
    slots = {"high": pipe.denoiser_params, "low": pipe.second_expert.params}
    base_slots = {"high": base.denoiser_params, "low": base.second_expert.params}
    other = "high" if expert == "low" else "low"

    def equal(a, b):
        return all(jax.tree.leaves(jax.tree.map(lambda x, y: bool(np.array_equal(x, y)), a, b)))

    assert not equal(slots[expert], base_slots[expert])  # the trained weights
    assert equal(slots[other], base_slots[other])


def test_expert_needs_a_two_expert_pipeline(tmp_path):
    from pipelines.embedded.tiny import build_tiny_wan_pipeline

    data_uri = str(tmp_path / "data")
    write_convert_artifact(data_uri, TinyDataConfig())
    one = build_tiny_wan_pipeline(tmp_path / "wan21")
    assert _train(data_uri, one, tmp_path / "train", "low", 2) != 0


def _write_image(path: Path, seed: int) -> str:
    from PIL import Image

    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (20, 24, 3), dtype=np.uint8)).save(path)
    return path.name


def _generate(model_path, prompt_file, out, *extra) -> int:
    return cli.main(
        [
            "generate",
            str(REPO / "configs/stages/generate.yml"),
            f"pretrained_model_name_or_path={model_path}",
            f"prompt_file={prompt_file}",
            f"output_dir={out}",
            "num_inference_steps=2",
            "height=16",
            "width=16",
            "num_frames=5",
            "max_sequence_length=16",
            *extra,
            "-q",
        ]
    )


@pytest.fixture(scope="module")
def i2v22_dir(tmp_path_factory):
    return wan_variants.build_i2v_pipeline(
        tmp_path_factory.mktemp("i2v22"), image_encoder=False, second_expert=True
    )


def test_generate_renders_image_to_video_prompt_files(i2v22_dir, tmp_path):
    """Images relative to the prompt file, a last_image, guidance_scale_2 per line; the
    record keeps them; rendering the same line in-process gives the same frames."""
    first, last = _write_image(tmp_path / "a.png", 1), _write_image(tmp_path / "b.png", 2)
    lines = [
        {"id": "one", "prompt": "a red circle", "image": first, "guidance_scale_2": 2.0},
        {"id": "two", "prompt": "a blue square", "image": first, "last_image": last},
    ]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    out = tmp_path / "render"
    assert _generate(i2v22_dir, prompts, out, "save_arrays=true", "guidance_scale=3.0") == 0
    rendered = open_artifact(str(out), "generate")
    records = {r["id"]: r for r in rendered.summary.get("prompts", [])} or None
    arrays = {p.stem: np.load(p) for p in (out / "outputs").glob("*.npy")}
    assert set(arrays) == {"one", "two"} and arrays["one"].shape == (5, 16, 16, 3)
    assert records is None or records["one"]["params"]["guidance_scale_2"] == 2.0
    assert np.abs(arrays["one"] - arrays["two"]).max() > 1e-3


def test_a_line_without_image_for_an_i2v_model_is_named(i2v22_dir, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        json.dumps({"prompt": "x", "image": _write_image(tmp_path / "a.png", 1)})
        + "\n"
        + json.dumps({"prompt": "no image here"})
        + "\n"
    )
    assert _generate(i2v22_dir, prompts, tmp_path / "render") != 0
    err = capsys.readouterr().err
    assert "p.jsonl line 2" in err and "needs an 'image'" in err
    assert not (tmp_path / "render" / "manifest.json").exists()


def test_missing_or_broken_image_is_named_before_rendering(i2v22_dir, tmp_path, capsys):
    (tmp_path / "broken.png").write_bytes(b"not an image")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "x", "image": "broken.png"}) + "\n")
    assert _generate(i2v22_dir, prompts, tmp_path / "render") != 0
    assert "broken.png is not a readable image" in capsys.readouterr().err


# --- image-to-video training: records conditioned on their own first frame ---------------------


def _write_clips(directory: Path, count: int, frames: int = 5) -> Path:
    """A JSONL dataset of ``count`` small mp4 clips (moving bars, one colour per clip)."""
    import imageio.v2 as imageio

    directory.mkdir(parents=True)
    rng = np.random.default_rng(3)
    rows = []
    for i in range(count):
        clip = np.zeros((frames, 16, 16, 3), np.uint8)
        colour = rng.integers(40, 255, 3)
        for t in range(frames):
            clip[t, :, 2 * t : 2 * t + 6] = colour
        path = directory / f"clip{i}.mp4"
        imageio.mimwrite(path, list(clip), fps=8, format="ffmpeg", macro_block_size=1)
        rows.append({"id": f"clip{i}", "video": str(path), "text": f"bar number {i}"})
    data = directory / "data.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return data


@pytest.mark.parametrize("variant", ["wan21_i2v", pytest.param("flf2v", marks=pytest.mark.slow)])
def test_i2v_records_equal_generates_conditioning(tmp_path, variant):
    """convert stores each clip's first-frame conditioning (mask + encoded clip; Wan 2.1 also
    the CLIP tokens, first and last frame for FLF2V) equal to what generate computes for that
    frame as the conditioning image."""
    _convert_i2v_and_check(tmp_path, variant)


@pytest.mark.slow  # ~50 s more: train on the records, render from the checkpoint
@pytest.mark.parametrize("variant", ["wan21_i2v", "flf2v"])
def test_i2v_records_train_and_render(tmp_path, variant):
    """The records of an image-to-video convert train; the checkpoint renders an image prompt."""
    pipeline_dir, convert_out = _convert_i2v_and_check(tmp_path, variant)
    _train_and_render_i2v(tmp_path, variant, pipeline_dir, convert_out)


def _convert_i2v_and_check(tmp_path, variant):
    from jaxcore import families
    from jaxcore.families import wan
    from stages.common import data, records
    from stages.convert.media import prepare_video

    pipeline_dir = wan_variants.build_i2v_pipeline(tmp_path / "model", flf2v=variant == "flf2v")
    source = _write_clips(tmp_path / "clips", 6)
    convert_out = tmp_path / "convert"
    args = [
        "convert",
        str(REPO / "configs/stages/convert.yml"),
        f"source={source}",
        "media_column=video",
        f"output_dir={convert_out}",
        f"pretrained_model_name_or_path={pipeline_dir}",
        "height=16",
        "width=16",
        "num_frames=5",
        "fps=8",
        "max_sequence_length=16",
        "eval_fraction=0.4",
        "-q",
    ]
    assert cli.main(args) == 0
    manifest = open_artifact(str(convert_out), "convert")
    features = {k: v["shape"] for k, v in manifest.summary["features"].items()}
    latents = features["latents"]
    tokens = 2 * 17 if variant == "flf2v" else 17  # (28 / 7)^2 patches + class token
    assert features == {
        "latents": latents,
        "encoder_hidden_states": [16, 32],
        "image_condition": [wan_variants.TEMPORAL + latents[0], *latents[1:]],
        "image_embeds": [tokens, 24],
    }

    import tensorflow as tf

    spec = data.split_spec(manifest, "train")
    shards = [str(convert_out / s) for s in manifest.summary["splits"]["train"]["shards"]]
    row = next(
        tf.data.TFRecordDataset(shards)
        .map(lambda x: records.parse_example(x, spec.shapes))
        .as_numpy_iterator()
    )
    index = int(row[records.SOURCE_ID].decode().removeprefix("clip"))
    video = prepare_video(
        str(tmp_path / "clips" / f"clip{index}.mp4"), height=16, width=16, num_frames=5, fps=8
    )
    family = families.get("wan")
    pipe = family.load_pipeline(pipeline_dir, ComputeConfig())
    last = wan.to_pil(video[:, -1]) if variant == "flf2v" else None
    expected = family.encode_images(pipe, [(wan.to_pil(video[:, 0]), last)], 16, 16, 5)
    for name in ("image_condition", "image_embeds"):
        np.testing.assert_allclose(row[name], expected[name][0], atol=2e-5, err_msg=name)
    return pipeline_dir, convert_out


def _train_and_render_i2v(tmp_path, variant, pipeline_dir, convert_out):
    train_out = tmp_path / "train"
    assert (
        cli.main(
            [
                "train",
                str(REPO / "configs/stages/train.yml"),
                f"data={convert_out}",
                f"output_dir={train_out}",
                "dataset_type=tfrecord",
                "model.model_config=null",
                f"model.pretrained_model_name_or_path={pipeline_dir}",
                "max_train_steps=2",
                "checkpoint_every=2",
                "eval_every=2",
                "per_device_batch_size=1",
                "-q",
            ]
        )
        == 0
    )
    image = _write_image(tmp_path / "first.png", 5)
    line = {"id": "a", "prompt": "bar", "image": image}
    if variant == "flf2v":
        line["last_image"] = _write_image(tmp_path / "last.png", 6)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps(line) + "\n")
    extra = [f"model.base_pipeline={pipeline_dir}", "model.checkpoint=final", "save_arrays=true"]
    assert _generate(train_out, prompts, tmp_path / "render", *extra) == 0
    assert np.load(tmp_path / "render" / "outputs" / "a.npy").shape == (5, 16, 16, 3)


@pytest.mark.slow
def test_one_expert_loss_falls(two_expert_dir, tmp_path):
    """The low-noise expert alone, on its timestep range: the training loss falls."""
    data_uri = str(tmp_path / "data")
    write_convert_artifact(data_uri, TinyDataConfig())
    out = tmp_path / "train"
    assert _train(data_uri, two_expert_dir, out, "low", 80, "learning_rate=3e-3") == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in rows if "loss" in r}
    first = np.mean([losses[s] for s in range(1, 11)])
    last = np.mean([losses[s] for s in range(71, 81)])
    assert last < 0.6 * first, (first, last)


def test_two_expert_loras_match_diffusers(two_expert_dir, tmp_path, capsys):
    """A LoRA per expert (``expert: low`` = diffusers' ``load_into_transformer_2=True``)
    renders as diffusers' WanPipeline with the same files, within 1e-4 on [0, 1] pixels; a
    low-expert LoRA on a one-expert model is an error naming the file."""
    import torch
    from diffusers import WanPipeline

    from jaxcore.sampling import initial_latents
    from tests.stages.test_lora_render import write_peft_lora

    (tmp_path / "loras").mkdir()
    high = write_peft_lora(tmp_path / "loras" / "high.safetensors", two_expert_dir, seed=1)
    low = write_peft_lora(tmp_path / "loras" / "low.safetensors", two_expert_dir, seed=2)
    shape = (4, 3, 8, 8)
    cases = {
        "both": [{"path": str(high)}, {"path": str(low), "expert": "low"}],
        "low": [{"path": str(low), "expert": "low"}],
        "none": [],
    }
    lines = []
    for i, (name, loras) in enumerate(cases.items()):
        np.save(tmp_path / f"z{i}.npy", initial_latents(20 + i, shape))
        lines.append({"id": name, "prompt": "a red bar", "latents": f"z{i}.npy", "loras": loras})
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "render"
    extra = ("save_arrays=true", "guidance_scale=1", "num_inference_steps=3")
    assert _generate(two_expert_dir, prompts, out, *extra) == 0
    rendered = {r["id"]: r for r in open_artifact(str(out), "generate").summary["prompts"]}
    assert [e.get("expert") for e in rendered["both"]["loras"]] == [None, "low"]

    for i, (name, loras) in enumerate(cases.items()):
        pipe = WanPipeline.from_pretrained(two_expert_dir)
        for j, lora in enumerate(loras):
            into_second = lora.get("expert") == "low"
            pipe.load_lora_weights(
                lora["path"], adapter_name=f"l{j}", load_into_transformer_2=into_second
            )
        frames = pipe(
            prompt="a red bar",
            height=16,
            width=16,
            num_frames=5,
            num_inference_steps=3,
            guidance_scale=1.0,
            latents=torch.from_numpy(initial_latents(20 + i, shape)[None]),
            max_sequence_length=16,
            output_type="np",
        ).frames[0]
        ours = np.load(out / "outputs" / f"{name}.npy")
        np.testing.assert_allclose(ours, frames, atol=1e-4, rtol=0, err_msg=name)
    both, only_low, none = (np.load(out / "outputs" / f"{n}.npy") for n in cases)
    assert np.abs(both - only_low).max() > 1e-3  # each expert's LoRA matters
    assert np.abs(only_low - none).max() > 1e-3

    from pipelines.embedded.tiny import build_tiny_wan_pipeline

    one = build_tiny_wan_pipeline(tmp_path / "wan21")
    prompts.write_text(json.dumps({"prompt": "x", "loras": cases["low"]}) + "\n")
    capsys.readouterr()
    assert _generate(one, prompts, tmp_path / "one") != 0
    assert "low.safetensors: expert=low needs a two-expert pipeline" in capsys.readouterr().err
