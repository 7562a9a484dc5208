"""DreamBooth with prior preservation (diffusers' ``train_dreambooth.py
--with_prior_preservation``), built from the ordinary stages.

- the loss: on the tiny SD UNet, our per-sample epsilon / v losses reduced by
  :func:`stages.common.objective.prior_preservation_loss` equal diffusers' script (chunk the
  2B predictions and targets, ``mse(instance) + prior_loss_weight * mse(prior)``) computed with
  the diffusers UNet and ``DDPMScheduler`` on the same inputs, within 1e-5 relative;
- the train step: with a class batch it trains on ``[instance; class]`` rows drawn from one key
  and reports the loss and its two parts as the objective computes them; sharded over 8
  devices it equals one device;
- convert: a generate artifact is a source (its renders captioned with their prompts, ids =
  prompt ids) and ``caption`` captions every row;
- end to end (slow): the tiny SD pipeline renders class images, they and the "subject" images
  convert, the UNet trains with prior preservation, and the checkpoint renders; the shipped
  ``configs/pipelines/dreambooth.yml`` chain runs.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcore import artifacts, sharding
from jaxcore.artifacts import ArtifactWriter, open_artifact
from jaxcore.compute import ComputeConfig
from jaxcore.families import TensorSpec, get
from pipelines import cli
from stages.common import checkpoints, data, objective
from stages.common.objective import ObjectiveSection
from stages.convert.config import DatasetConfig
from stages.convert.source import load_source, source_ids
from stages.train import model, trainer
from stages.train.config import ModelSection, OptimizerSection
from tests.support.tiny_sd import build_sd_pipeline
from tests.support.wan_variants import write_one_layer_wan_yaml

REPO = Path(__file__).resolve().parents[2]


# --- the loss against diffusers' script ---------------------------------------------------------


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
def test_prior_preservation_loss_matches_diffusers_script(tmp_path, prediction_type):
    import torch
    import torch.nn.functional as F
    from diffusers import DDPMScheduler, UNet2DConditionModel

    schedule = {
        "beta_start": 0.00085,
        "beta_end": 0.012,
        "beta_schedule": "scaled_linear",
        "prediction_type": prediction_type,
    }
    directory = build_sd_pipeline(
        tmp_path / "sd", seed=4, scheduler="DDPMScheduler", schedule=schedule
    )
    family = get("sd")
    target = objective.training_target(family, ObjectiveSection(), directory)
    module, params = family.load_denoiser(directory / "unet", ComputeConfig())
    rng = np.random.default_rng(0)
    latents = rng.standard_normal((4, 4, 8, 8)).astype(np.float32)  # 2 instance, 2 class
    noise = rng.standard_normal(latents.shape).astype(np.float32)
    states = rng.standard_normal((4, 20, 32)).astype(np.float32)
    timesteps = np.array([3, 250, 600, 999], np.int32)
    weight = 0.7

    per_sample = objective.ddpm_loss_at(
        family,
        module,
        params,
        jnp.asarray(latents),
        {"encoder_hidden_states": jnp.asarray(states)},
        jnp.asarray(timesteps),
        jnp.asarray(noise),
        target,
    )
    ours, parts = objective.prior_preservation_loss(per_sample, 2, weight)

    scheduler = DDPMScheduler.from_pretrained(directory / "scheduler")
    unet = UNet2DConditionModel.from_pretrained(directory / "unet").eval()
    latents_t, noise_t = torch.from_numpy(latents), torch.from_numpy(noise)
    steps_t = torch.from_numpy(timesteps).long()
    with torch.no_grad():
        noisy = scheduler.add_noise(latents_t, noise_t, steps_t)
        prediction = unet(noisy, steps_t, torch.from_numpy(states)).sample
    wanted = (
        noise_t
        if prediction_type == "epsilon"
        else scheduler.get_velocity(latents_t, noise_t, steps_t)
    )
    prediction, prediction_prior = torch.chunk(prediction, 2, dim=0)
    wanted, wanted_prior = torch.chunk(wanted, 2, dim=0)
    prior_loss = F.mse_loss(prediction_prior.float(), wanted_prior.float(), reduction="mean")
    loss = F.mse_loss(prediction.float(), wanted.float(), reduction="mean")
    theirs = loss + weight * prior_loss
    assert float(ours) == pytest.approx(float(theirs), rel=1e-5)
    assert float(parts["prior_loss"]) == pytest.approx(float(prior_loss), rel=1e-5)
    assert float(parts["instance_loss"]) == pytest.approx(float(loss), rel=1e-5)


# --- the train step -----------------------------------------------------------------------------

FEATURES = (TensorSpec("latents", (4, 1, 8, 8)), TensorSpec("encoder_hidden_states", (8, 32)))


@pytest.fixture(scope="module")
def one_layer_model(tmp_path_factory) -> str:
    return write_one_layer_wan_yaml(tmp_path_factory.mktemp("model"))


def _prior_step(model_yaml, mesh, weight=0.5):
    """(loss metrics, params after one step, the objective's loss at the initial params)."""
    built = model.build_model(
        ModelSection(model_config=model_yaml), ComputeConfig(), mesh, jax.random.key(0)
    )
    family, module, params = built.family, built.module, built.params
    initial = jax.device_get(params)
    tx, sched = trainer.make_optimizer(
        OptimizerSection(learning_rate=1e-3, warmup_steps_fraction=0.0), 10
    )
    p_sh = checkpoints.param_shardings(family, module, mesh)
    o_sh = trainer.opt_state_shardings(tx, params, p_sh, mesh)
    opt = jax.jit(tx.init, out_shardings=o_sh)(params)
    cfg = ObjectiveSection()
    step = trainer.make_train_step(
        family, module, tx, sched, cfg, mesh, p_sh, o_sh, FEATURES, 3, prior_loss_weight=weight
    )
    rng = np.random.default_rng(0)
    host = {f.name: rng.standard_normal((8, *f.shape), np.float32) for f in FEATURES}
    prior = {f.name: rng.standard_normal((8, *f.shape), np.float32) for f in FEATURES}
    keys = tuple(host)
    batch = data.to_global(host, mesh, 8, keys=keys)
    prior_batch = data.to_global(prior, mesh, 8, keys=keys)
    params, _, metrics = step(params, opt, batch, 5, prior=prior_batch)
    # the objective by hand: both batches as one, one key for all 16 rows
    joined = {k: jnp.concatenate([host[k], prior[k]]) for k in keys}
    key = jax.random.fold_in(jax.random.key(3), 5)
    per_sample = objective.weighted_losses(family, module, initial, joined, key, cfg)
    expected = (
        float(jnp.mean(per_sample[:8])) + weight * float(jnp.mean(per_sample[8:])),
        float(jnp.mean(per_sample[8:])),
    )
    return jax.device_get(metrics), jax.device_get(params), expected


def test_train_step_trains_on_instance_and_class_rows(one_layer_model):
    single = sharding.make_mesh(sharding.MeshConfig(), devices=jax.devices()[:1])
    metrics, params, (loss, prior_loss) = _prior_step(one_layer_model, single)
    assert float(metrics["loss"]) == pytest.approx(loss, rel=1e-5)
    assert float(metrics["prior_loss"]) == pytest.approx(prior_loss, rel=1e-5)
    assert float(metrics["loss"]) == pytest.approx(
        float(metrics["instance_loss"]) + 0.5 * float(metrics["prior_loss"]), rel=1e-6
    )


@pytest.mark.slow  # ~15 s; the train step's sharded layouts are checked in the default tier by
# tests/stages/test_train.py::test_sharded_step_equals_single_device_step
def test_prior_step_on_a_sharded_mesh_equals_one_device(one_layer_model):
    single = sharding.make_mesh(sharding.MeshConfig(), devices=jax.devices()[:1])
    metrics, params, _ = _prior_step(one_layer_model, single)
    sharded = sharding.make_mesh(
        sharding.MeshConfig(
            ici_data_parallelism=2, ici_fsdp_parallelism=2, ici_tensor_parallelism=2
        )
    )
    metrics_8, params_8, _ = _prior_step(one_layer_model, sharded)
    assert float(metrics_8["loss"]) == pytest.approx(float(metrics["loss"]), abs=1e-5)
    worst = max(
        jax.tree.leaves(jax.tree.map(lambda a, b: float(np.max(np.abs(a - b))), params, params_8))
    )
    assert worst < 5e-5, worst


# --- convert sources ----------------------------------------------------------------------------


def _fake_generate_artifact(root: Path) -> str:
    """A committed generate artifact of three renders (what the convert source reads)."""
    from PIL import Image

    from stages.generate.config import GenerateConfig

    uri = str(root / "renders")
    config = GenerateConfig(pretrained_model_name_or_path="x", prompt_file="p.txt", output_dir=uri)
    writer = ArtifactWriter(uri, "generate", config, {})
    prompts = []
    for i, colour in enumerate(["red", "green", "blue"]):
        name = f"class-{i}"
        path = Path(uri) / "outputs" / f"{name}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (16, 16), colour).save(path)
        prompts.append(
            {
                "id": name,
                "name": name,
                "output": f"outputs/{name}.png",
                "params": {"prompt": "a photo of a shape"},
            }
        )
    writer.commit({"prompts": prompts})
    return uri


def test_generate_artifact_is_a_source_and_caption_captions_every_row(tmp_path):
    uri = _fake_generate_artifact(tmp_path)
    dataset = load_source(DatasetConfig(source=uri))
    assert dataset["text"] == ["a photo of a shape"] * 3
    ids, kind = source_ids(dataset, DatasetConfig(source=uri))
    assert (ids, kind) == (["class-0", "class-1", "class-2"], "column:id")
    cell = dataset[1]["image"]
    assert cell["path"].endswith("outputs/class-1.png") and cell["bytes"][:4] == b"\x89PNG"
    captioned = load_source(DatasetConfig(source=uri, caption="a photo of sks shape"))
    assert captioned["text"] == ["a photo of sks shape"] * 3


# --- end to end ---------------------------------------------------------------------------------


def _run(*args) -> None:
    assert cli.main([*args, "-q"]) == 0


@pytest.mark.slow  # ~2 minutes on 2 cores
def test_sd_dreambooth_end_to_end(tmp_path):
    from tests.stages.test_convert_elements import _plain_imagefolder

    pipeline = build_sd_pipeline(tmp_path / "sd", seed=2)
    class_prompts = tmp_path / "class.txt"
    class_prompts.write_text("a photo of a shape\n" * 4)
    stages = REPO / "configs" / "stages"
    size = ("height=16", "width=16")
    _run(
        "generate",
        str(stages / "generate.yml"),
        f"pretrained_model_name_or_path={pipeline}",
        f"prompt_file={class_prompts}",
        f"output_dir={tmp_path / 'class_images'}",
        "num_inference_steps=3",
        *size,
    )
    _run(
        "convert",
        str(stages / "convert.yml"),
        f"source={tmp_path / 'class_images'}",
        f"output_dir={tmp_path / 'class_data'}",
        f"pretrained_model_name_or_path={pipeline}",
        "eval_fraction=0",
        *size,
    )
    subject = _plain_imagefolder(tmp_path / "subject", [f"img{i}.png" for i in range(4)])
    _run(
        "convert",
        str(stages / "convert.yml"),
        f"source={subject}",
        "caption=a photo of sks shape",
        f"output_dir={tmp_path / 'instance_data'}",
        f"pretrained_model_name_or_path={pipeline}",
        "eval_fraction=0",
        *size,
    )
    class_data = open_artifact(str(tmp_path / "class_data"), "convert")
    assert class_data.summary["splits"]["train"]["records"] == 4
    train = tmp_path / "train"
    _run(
        "train",
        str(stages / "train.yml"),
        f"data={tmp_path / 'instance_data'}",
        f"prior_preservation.data={tmp_path / 'class_data'}",
        "prior_preservation.prior_loss_weight=1.0",
        f"output_dir={train}",
        "dataset_type=tfrecord",
        "model.model_config=null",
        f"model.pretrained_model_name_or_path={pipeline}",
        "max_train_steps=6",
        "checkpoint_every=3",
        "learning_rate=1e-3",
        "per_device_batch_size=1",
    )
    manifest = open_artifact(str(train), "train")
    assert manifest.inputs["prior_data"]["uri"] == str(tmp_path / "class_data")
    rows = [json.loads(x) for x in (train / "metrics.jsonl").read_text().splitlines()]
    assert all({"instance_loss", "prior_loss"} <= set(r) for r in rows)
    for r in rows:
        assert r["loss"] == pytest.approx(r["instance_loss"] + r["prior_loss"], rel=1e-5)
    prompts = tmp_path / "p.txt"
    prompts.write_text("a photo of sks shape\n")
    _run(
        "generate",
        str(stages / "generate.yml"),
        f"pretrained_model_name_or_path={train}",
        f"model.base_pipeline={pipeline}",
        "model.checkpoint=final",
        f"prompt_file={prompts}",
        f"output_dir={tmp_path / 'render'}",
        "num_inference_steps=3",
        *size,
    )
    render = open_artifact(str(tmp_path / "render"), "generate")
    assert len(render.file_paths("outputs/", ".png")) == 1


@pytest.mark.slow  # ~1 minute
def test_dreambooth_chain(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    root = tmp_path / "run"
    _run("run", "configs/pipelines/dreambooth.yml", f"root={root}")
    train = artifacts.open_artifact(str(root / "train"), "train")
    assert train.inputs["prior_data"]["uri"] == str(root / "class_data")
    class_data = artifacts.open_artifact(str(root / "class_data"), "convert")
    assert class_data.summary["source"]["id_source"] == "column:id"
    assert class_data.summary["splits"]["train"]["records"] == 8
    render = artifacts.open_artifact(str(root / "render"), "generate")
    assert len(render.file_paths("outputs/", ".png")) == 2
