"""ControlNet training for the SD family (diffusers' examples/controlnet/train_controlnet.py):

- ``jaxcore.models.controlnet.from_unet`` equals diffusers' ``ControlNetModel.from_unet`` on a
  tiny SD and SDXL UNet: every copied weight equal, the zero convs zero (the control
  embedding's other convs are fresh in both, only their shapes compared);
- convert with ``conditioning_image_column`` stores each row's conditioning image as pixels,
  resized / centre-cropped as the row's image;
- a tiny ControlNet trains beside the frozen tiny SD UNet on those records: the loss falls,
  the UNet is untouched, a run stopped at step 4 and resumed logs the straight run's losses;
  the exported ControlNet loads in diffusers with residuals equal to ours (1e-5 relative), and
  diffusers' StableDiffusionControlNetPipeline with it renders as our pipeline does (1e-4).
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from PIL import Image

from jaxcore.artifacts import open_artifact
from jaxcore.config import load_config
from pipelines import cli
from stages.common import records
from stages.train.config import TrainConfig
from tests.support.tiny_sd import SD_UNET, XL_UNET, _perturbed, build_sd_pipeline

REPO = Path(__file__).resolve().parents[2]
TRAIN_YML = REPO / "configs/stages/train.yml"
SIZE = 16  # pixels; the tiny VAE's latents are 8x8
EMBEDDING = (8, 16)  # one stride-2 step: the tiny VAE's 2x
STEPS = 24


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("unet_keys", [SD_UNET, XL_UNET], ids=["sd", "sdxl"])
def test_from_unet_equals_diffusers(unet_keys, tmp_path):
    import diffusers
    import torch

    from jaxcore import weights
    from jaxcore.models import controlnet, unet_2d_condition

    torch.manual_seed(0)
    unet = _perturbed(diffusers.UNet2DConditionModel(**unet_keys), 0)
    unet.save_pretrained(tmp_path / "unet")
    reference = diffusers.ControlNetModel.from_unet(
        unet, conditioning_embedding_out_channels=EMBEDDING
    )
    module, params = unet_2d_condition.KIND.load(tmp_path / "unet")
    ours_module, ours = controlnet.from_unet(
        module.config, params, jax.random.key(0), conditioning_embedding_out_channels=EMBEDDING
    )
    assert (
        ours_module.config.to_dict()
        == {k: v for k, v in json.loads(json.dumps(dict(reference.config))).items() if k[0] != "_"}
        | ours_module.config.to_dict()
    )
    state = weights.export_state_dict(ours, controlnet.weight_map(ours_module.config))
    theirs = {k: v.numpy() for k, v in reference.state_dict().items()}
    assert sorted(state) == sorted(theirs)
    fresh = 0
    for key, value in theirs.items():
        if key.startswith("controlnet_cond_embedding.") and ".conv_out." not in key:
            assert state[key].shape == value.shape, key
            fresh += 1
            continue
        if key.startswith(("controlnet_down_blocks", "controlnet_mid_block")) or (
            ".conv_out." in key
        ):
            assert not value.any() and not state[key].any(), key  # the zero convs
        np.testing.assert_array_equal(state[key], value, err_msg=key)
    assert fresh == 2 * (1 + 2 * (len(EMBEDDING) - 1))  # conv_in, blocks: weight + bias


def _pattern(i: int, size: int) -> Image.Image:
    """A conditioning image that says something about the row (a bright square somewhere)."""
    pixels = np.zeros((size, size + 6, 3), np.uint8)
    at = (i % 4) * 3
    pixels[at : at + 6, at : at + 8] = (255, 200 - 20 * i, 40 * (i % 3))
    return Image.fromarray(pixels)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(tiny SD pipeline, its convert artifact with conditioning pixels, the source folder)."""
    root = tmp_path_factory.mktemp("controlnet")
    pipeline = build_sd_pipeline(root / "sd", seed=2)
    folder = root / "imgs"
    folder.mkdir()
    rows = []
    for i in range(8):
        rgb = np.full((24, 30, 3), (30 * i, 100, 255 - 30 * i), np.uint8)
        rgb[4 + i : 12 + i, 6:18] = 255
        Image.fromarray(rgb).save(folder / f"img{i}.png")
        _pattern(i, 24).save(folder / f"cond{i}.png")
        cond = str(folder / f"cond{i}.png")
        rows.append({"file_name": f"img{i}.png", "text": f"caption {i}", "cond": cond})
    (folder / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = root / "converted"
    args = [
        "convert",
        str(REPO / "configs/stages/convert.yml"),
        f"source={folder}",
        f"output_dir={out}",
        f"pretrained_model_name_or_path={pipeline}",
        "dataset.conditioning_image_column=cond",
        f"height={SIZE}",
        f"width={SIZE}",
        "eval_fraction=0.25",
        "-q",
    ]
    assert cli.main(args) == 0
    return pipeline, str(out), folder


def test_convert_stores_the_conditioning_pixels(converted):
    from stages.convert.media import resize_center_crop

    _, uri, folder = converted
    manifest = open_artifact(uri, "convert")
    features = manifest.summary["features"]
    assert features[records.CONDITIONING_PIXELS]["shape"] == [SIZE, SIZE, 3]
    import tensorflow as tf

    shapes = {name: tuple(f["shape"]) for name, f in features.items()}
    seen = 0
    for split in records.SPLITS:
        shards = [str(Path(uri) / rel) for rel in manifest.summary["splits"][split]["shards"]]
        for raw in tf.data.TFRecordDataset(shards):
            example = records.parse_example(raw, shapes, with_timesteps=split == "eval")
            sid = example[records.SOURCE_ID].numpy().decode()
            i = int(sid.removeprefix("img").removesuffix(".png"))
            source = np.asarray(Image.open(folder / f"cond{i}.png").convert("RGB"))
            wanted = resize_center_crop(source[None], SIZE, SIZE)[0]
            pixels = example[records.CONDITIONING_PIXELS].numpy()
            np.testing.assert_array_equal(pixels, wanted.astype(np.float32))
            seen += 1
    assert seen == 8


def _config(pipeline, uri, out, steps: int, *extra: str) -> TrainConfig:
    overrides = [
        f"data={uri}",
        f"output_dir={out}",
        "dataset_type=tfrecord",
        "model.model_config=null",
        f"model.pretrained_model_name_or_path={pipeline}",
        "controlnet.enabled=true",
        f"controlnet.conditioning_embedding_out_channels={list(EMBEDDING)}",
        "learning_rate=1e-3",
        "warmup_steps_fraction=0.0",
        "per_device_batch_size=2",
        f"max_train_steps={steps}",
        "checkpoint_every=4",
        "enable_async_checkpointing=false",
        *extra,
    ]
    return load_config(TrainConfig, TRAIN_YML, overrides)


def _losses(out: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


@pytest.fixture(scope="module")
def trained(converted, tmp_path_factory):
    """(pipeline, a straight run of STEPS steps, one stopped at step 8 and resumed to STEPS,
    the straight run's result, its frozen UNet after training)."""
    import shutil

    from stages.train import loop

    pipeline, uri, _ = converted
    root = tmp_path_factory.mktemp("runs")
    manifest = open_artifact(uri, "convert")
    straight = root / "straight"
    run = loop.prepare(_config(pipeline, uri, straight, STEPS), str(straight), manifest)
    loop.resume(run)
    result = loop.finish(run, *loop.run_steps(run))
    frozen = jax.device_get(run.trainable.frozen)
    shutil.rmtree(run.local_dir, ignore_errors=True)
    resumed = root / "resumed"
    loop.train(_config(pipeline, uri, resumed, 8), str(resumed), manifest)  # stopped at 8
    loop.train(_config(pipeline, uri, resumed, STEPS), str(resumed), manifest)
    return pipeline, straight, resumed, result, frozen


@pytest.mark.slow  # three tiny train runs (3 compiles): ~110 s on 2 cores
def test_controlnet_trains_and_resumes(trained):
    from jaxcore.models import unet_2d_condition
    from stages.common import checkpoints

    pipeline, straight, resumed, result, frozen = trained
    losses = _losses(straight)
    first = np.mean([losses[s] for s in (1, 2, 3, 4)])
    last = np.mean([losses[s] for s in range(STEPS - 3, STEPS + 1)])
    print("losses", [round(losses[s], 5) for s in sorted(losses)])
    assert last < 0.8 * first, (first, last)
    assert result.controlnet["folder"] == "controlnet"
    assert result.controlnet["config"]["conditioning_embedding_out_channels"] == list(EMBEDDING)
    meta = checkpoints.read_meta(str(straight / "checkpoints"), STEPS)
    assert meta["controlnet"]["init"] == "denoiser"
    again = _losses(resumed)
    assert sorted(again) == sorted(losses) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        assert again[step] == pytest.approx(losses[step], rel=1e-5, abs=1e-7), step
    _, unet_params = unet_2d_condition.KIND.load(pipeline / "unet")
    jax.tree.map(np.testing.assert_array_equal, frozen, jax.device_get(unet_params))


@pytest.mark.slow  # three tiny train runs (3 compiles): ~110 s on 2 cores
def test_exported_controlnet_matches_diffusers(trained):
    """diffusers' ControlNetModel.from_pretrained of the export gives our residuals, and its
    StableDiffusionControlNetPipeline renders as ours does."""
    import diffusers
    import torch

    from jaxcore.families import load_pipeline
    from jaxcore.models import controlnet
    from tests.jaxcore.test_sd_controlnet_pipeline import _control_image, _render

    pipeline, straight, _, _, _ = trained
    folder = straight / "controlnet"
    reference = diffusers.ControlNetModel.from_pretrained(folder).eval()
    module, params = controlnet.load_controlnet(folder)
    rng = np.random.default_rng(0)
    sample = rng.standard_normal((2, 4, 8, 8)).astype(np.float32)
    context = rng.standard_normal((2, 20, 32)).astype(np.float32)
    image = rng.uniform(0, 1, (2, 3, SIZE, SIZE)).astype(np.float32)
    t = np.array([10.0, 700.0], np.float32)
    down, mid = module.apply({"params": params}, sample, t, context, image, np.ones(2, np.float32))
    with torch.no_grad():
        ref_down, ref_mid = reference(
            torch.from_numpy(sample),
            torch.from_numpy(t),
            torch.from_numpy(context),
            torch.from_numpy(image),
            return_dict=False,
        )
    worst = 0.0
    for ours, theirs in zip([*down, mid], [*ref_down, ref_mid], strict=True):
        theirs = theirs.numpy()
        worst = max(worst, float(np.abs(np.asarray(ours) - theirs).max() / np.abs(theirs).max()))
    print("residual max relative diff", worst)
    assert worst < 1e-5
    ours_pipe = load_pipeline(str(pipeline), controlnet=str(folder))
    torch_pipe = diffusers.StableDiffusionControlNetPipeline.from_pretrained(
        pipeline, controlnet=reference
    )
    rows = [dict(images=[_control_image(0)], scales=[1.0], starts=[0.0], ends=[1.0])]
    ours, theirs = _render((ours_pipe, torch_pipe), rows, height=SIZE, width=SIZE)
    print("render max diff", float(np.abs(ours - theirs).max()))
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)


def test_controlnet_config_errors_name_the_key(tmp_path):
    from jaxcore.config import ConfigError

    base = ["data=x", f"output_dir={tmp_path}", "controlnet.enabled=true"]
    for extra, key in (
        (["lora.rank=4"], "lora.rank"),
        (["export_diffusers=true"], "export_diffusers"),
        (["controlnet.conditioning_embedding_out_channels=[0]"], "conditioning_embedding"),
    ):
        with pytest.raises((ConfigError, ValueError), match=key):
            load_config(TrainConfig, TRAIN_YML, base + extra)
