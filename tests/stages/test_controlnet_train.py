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


@pytest.fixture(scope="module")
def committed(trained, converted):
    """The straight run as a finished train artifact (its manifest committed as the train
    stage commits it; the fixture ran the loop directly)."""
    from jaxcore.artifacts import ArtifactWriter
    from stages.train import loop

    pipeline, straight, _, result, _ = trained
    _, uri, _ = converted
    config = _config(pipeline, uri, straight, STEPS)
    writer = ArtifactWriter(str(straight), "train", config, {"data": open_artifact(uri, "convert")})
    fields = ("final_step", "checkpoints", "family", "model_config", "embedded_inputs")
    fields += ("objective", "model_source", "lora", "controlnet")
    summary = {name: getattr(result, name) for name in fields}
    writer.commit({**summary, "checkpoint_dir": loop.CHECKPOINT_DIR})
    return pipeline, straight


def _direct_eval_loss(pipeline, run_dir: Path, data_uri: str, with_controlnet: bool) -> float:
    """The eval loss computed with the library alone: the pipeline's UNet (+ the exported
    ControlNet, its control inputs made here from the records' pixels) at each eval record's
    timestep and noise, the mean of the timestep buckets' means."""
    from jaxcore import control, families
    from jaxcore.models import controlnet, unet_2d_condition
    from stages.common import data, objective, scoring

    train = open_artifact(str(run_dir), "train")
    spec = data.split_spec(open_artifact(data_uri, "convert"), "eval")
    target = objective.TrainingTarget.from_dict(train.summary["objective"], "objective")
    embedded = train.summary.get("embedded_inputs") or {}
    module, params = unet_2d_condition.KIND.load(Path(pipeline) / "unet")
    if with_controlnet:
        net, net_params = controlnet.load_controlnet(run_dir / "controlnet")
        module = control.Controlled(module, (net,))
        params = {"denoiser": params, "controlnets": (net_params,)}
    losses: dict[int, list[float]] = {}
    for batch in scoring.eval_batches(spec, 8, None):
        tensors = {n: batch[n] for n in spec.tensor_names if n != records.CONDITIONING_PIXELS}
        rows = len(batch[scoring.TIMESTEPS])
        pixels = batch[records.CONDITIONING_PIXELS].astype(np.float32) / 255.0
        tensors[control.CONTROL_IMAGE] = np.transpose(pixels, (0, 3, 1, 2))[:, None]
        tensors[control.CONTROL_SCALE] = np.ones((rows, 1), np.float32)
        tensors[control.CONTROL_GUESS] = np.zeros((rows,), bool)
        tensors[control.CONTROL_OFF] = np.zeros((rows,), bool)
        ts, ids = batch[scoring.TIMESTEPS], batch[scoring.IDS]
        family = families.get(train.summary["family"])
        out = scoring.per_record_loss(family, module, params, tensors, ts, ids, 0, embedded, target)
        for loss, t, ok in zip(np.asarray(out), ts, batch["valid"], strict=True):
            if ok:
                losses.setdefault(int(t), []).append(float(loss))
    return float(np.mean([np.mean(v) for v in losses.values()]))


@pytest.mark.slow  # the module's tiny train runs (~110 s on 2 cores) and one eval compile
def test_evaluate_scores_the_controlnet_checkpoints(committed, converted, tmp_path):
    """evaluate restores the ControlNet of each checkpoint beside the rebuilt UNet: its eval
    loss is the library's with the exported (final) ControlNet, not the UNet's alone."""
    pipeline, run = committed
    _, data_uri, _ = converted
    out = tmp_path / "eval"
    args = [
        "evaluate",
        str(REPO / "configs/stages/evaluate.yml"),
        f"checkpoints={run}",
        f"data={data_uri}",
        f"output_dir={out}",
        "-q",
    ]
    assert cli.main(args) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    first = min(metrics, key=int)
    assert str(STEPS) in metrics and int(first) < STEPS
    assert (out / "eval_loss.csv").is_file() and (out / "eval_loss_vs_step.png").is_file()
    ours = metrics[str(STEPS)]["eval_loss"]
    direct = _direct_eval_loss(pipeline, run, data_uri, with_controlnet=True)
    alone = _direct_eval_loss(pipeline, run, data_uri, with_controlnet=False)
    print("eval loss", ours, "direct", direct, "UNet alone", alone, first, metrics[first])
    assert ours == pytest.approx(direct, rel=1e-5, abs=1e-7)
    assert abs(ours - alone) > 1e-3 * alone  # the trained ControlNet's residuals count
    assert metrics[first]["eval_loss"] != ours


@pytest.mark.slow  # the module's tiny train runs (~110 s on 2 cores) and two tiny renders
def test_generate_takes_the_train_artifact_as_its_controlnet(committed, tmp_path):
    """model.controlnet=<train artifact> renders as model.controlnet=<artifact>/controlnet."""
    pipeline, run = committed
    _pattern(1, SIZE).save(tmp_path / "cond.png")
    line = {"id": "a", "prompt": "caption 1", "seed": 3, "control_image": "cond.png"}
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({**line, "height": SIZE, "width": SIZE}) + "\n")
    renders = []
    for name, given in (("artifact", run), ("folder", run / "controlnet")):
        out = tmp_path / name
        args = [
            "generate",
            str(REPO / "configs/stages/generate.yml"),
            f"pretrained_model_name_or_path={pipeline}",
            f"prompt_file={prompts}",
            f"output_dir={out}",
            f"model.controlnet={given}",
            "num_inference_steps=3",
            "save_arrays=true",
            "-q",
        ]
        assert cli.main(args) == 0
        renders.append(np.load(out / "outputs" / "a.npy"))
    np.testing.assert_array_equal(renders[0], renders[1])


def test_model_controlnet_refuses_a_train_artifact_without_one(tmp_path):
    from jaxcore.artifacts import ArtifactWriter
    from stages.common.errors import StageInputError
    from stages.generate import model

    uri = str(tmp_path / "train")
    ArtifactWriter(uri, "train", {"x": 1}, {}).commit({"controlnet": None})
    with pytest.raises(StageInputError, match="trained no ControlNet"):
        model._controlnet_dir(uri)


def test_evaluate_refuses_records_without_conditioning_pixels():
    from stages.common import checkpoints
    from stages.common.errors import StageInputError

    with pytest.raises(StageInputError, match=records.CONDITIONING_PIXELS):
        checkpoints.check_control_features({"latents": None}, "gs://b/converted")
