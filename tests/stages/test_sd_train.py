"""The tiny Stable Diffusion UNet trains with epsilon and with v-prediction.

- stages: convert -> train -> evaluate -> generate on a tiny diffusers-built SD 2.x-like
  pipeline (as test_flux_stages.py), once with its epsilon scheduler config and once with
  v_prediction + zero-terminal SNR: the train manifest records the target, the loss falls,
  evaluate's scores equal the periodic eval's, and the checkpoint renders. Skipped until train
  and evaluate pass the target along (the stages/train/loop.py wiring).
- the objective alone: the pipeline's UNet, loaded by the family, is trained by the shared
  objective (:func:`stages.common.objective.training_loss`, jitted with the target closed
  over) on one small repeated batch of random latents and text states at a high learning rate,
  the target resolved from the pipeline's ``scheduler_config.json`` (epsilon, and v_prediction
  with zero-terminal SNR plus every DDPM option). The loss is finite and falls (mean over four
  fixed keys: below 0.7x in 30 Adam steps; reached 0.49x both); evaluate's per-record score
  runs on the trained params.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxcore import families
from jaxcore.artifacts import open_artifact
from jaxcore.compute import ComputeConfig
from pipelines import cli
from stages.common import objective, scoring
from stages.common.objective import ObjectiveSection
from tests.stages.test_convert_elements import _plain_imagefolder
from tests.support.tiny_sd import build_sd_pipeline

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]

SD_NOISE = {"beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear"}
CASES = {
    "epsilon": ({**SD_NOISE, "prediction_type": "epsilon"}, ObjectiveSection()),
    "v-zero-snr-all-options": (
        {**SD_NOISE, "prediction_type": "v_prediction", "rescale_betas_zero_snr": True},
        ObjectiveSection(noise_offset=0.05, snr_gamma=5.0, input_perturbation=0.1),
    ),
}


def _family():
    return families.get("sd")


@pytest.mark.parametrize("case", sorted(CASES))
def test_tiny_unet_loss_falls(case, tmp_path):
    schedule, cfg = CASES[case]
    directory = build_sd_pipeline(
        tmp_path / "sd", seed=1, scheduler="DDPMScheduler", schedule=schedule
    )
    family = _family()
    target = objective.training_target(family, cfg, directory)
    assert target.kind == schedule["prediction_type"]
    module, params = family.load_denoiser(directory / "unet", ComputeConfig())
    rng = np.random.default_rng(0)
    batch = {
        "latents": jnp.asarray(rng.standard_normal((2, 4, 8, 8), np.float32)),
        "encoder_hidden_states": jnp.asarray(rng.standard_normal((2, 20, 32), np.float32)),
    }

    def loss(p, key):
        return objective.training_loss(family, module, p, batch, key, cfg, None, target)

    tx = optax.adam(3e-3)

    @jax.jit
    def step(p, opt_state, key):
        value, grads = jax.value_and_grad(loss)(p, key)
        updates, opt_state = tx.update(grads, opt_state, p)
        return optax.apply_updates(p, updates), opt_state, value

    jitted = jax.jit(loss)
    fixed = [jax.random.key(100 + i) for i in range(4)]  # the same draws before and after

    def held_out(p):
        return float(np.mean([float(jitted(p, key)) for key in fixed]))

    before = held_out(params)
    opt_state = tx.init(params)
    for i in range(30):
        params, opt_state, value = step(params, opt_state, jax.random.key(i))
        assert np.isfinite(float(value))
    after = held_out(params)
    assert after < 0.7 * before, (before, after)

    scores = scoring.per_record_loss(
        family,
        module,
        params,
        batch,
        jnp.array([10, 1000], jnp.int32),
        jnp.array([1, 2], jnp.uint32),
        0,
        None,
        target,
    )
    assert np.all(np.isfinite(np.asarray(scores)))


# --- the stages -----------------------------------------------------------------------------

V_SCHEDULE = {"prediction_type": "v_prediction", "rescale_betas_zero_snr": True}


@pytest.fixture(scope="module")
def sd_dirs(tmp_path_factory):
    """(epsilon pipeline, v-prediction copy, its convert artifact with an eval split)."""
    root = tmp_path_factory.mktemp("sd")
    eps = build_sd_pipeline(root / "eps", seed=2)
    v_dir = root / "v"
    shutil.copytree(eps, v_dir)
    path = v_dir / "scheduler" / "scheduler_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **V_SCHEDULE}))
    folder = _plain_imagefolder(root / "imgs", [f"img{i}.png" for i in range(8)])
    data_uri = root / "converted"
    args = [
        "convert",
        str(REPO / "configs/stages/convert.yml"),
        f"source={folder}",
        f"output_dir={data_uri}",
        f"pretrained_model_name_or_path={eps}",
        "height=16",
        "width=16",
        "eval_fraction=0.25",
        "-q",
    ]
    assert cli.main(args) == 0
    return eps, v_dir, str(data_uri)


@pytest.mark.parametrize("kind", ["epsilon", "v_prediction"])
def test_sd_trains_evaluates_and_renders_its_checkpoint(sd_dirs, kind, tmp_path):
    eps, v_dir, data_uri = sd_dirs
    pipeline = eps if kind == "epsilon" else v_dir
    out = tmp_path / "train"
    args = [
        "train",
        str(REPO / "configs/stages/train.yml"),
        f"data={data_uri}",
        f"output_dir={out}",
        "dataset_type=tfrecord",
        "model.model_config=null",
        f"model.pretrained_model_name_or_path={pipeline}",
        "max_train_steps=40",
        "checkpoint_every=20",
        "eval_every=20",
        "learning_rate=3e-3",
        "per_device_batch_size=2",
        "-q",
    ]
    if kind == "v_prediction":
        args[-1:-1] = ["objective.snr_gamma=5.0", "objective.noise_offset=0.05"]
    assert cli.main(args) == 0
    summary = open_artifact(str(out), "train").summary
    assert summary["family"] == "sd" and summary["objective"]["objective"] == kind
    assert summary["objective"]["noise_schedule"]["rescale_betas_zero_snr"] == (kind != "epsilon")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows]
    assert all(np.isfinite(losses))
    assert np.mean(losses[-10:]) < 0.8 * np.mean(losses[:10]), (losses[:10], losses[-10:])

    ev = tmp_path / "evaluate"
    args = ["evaluate", str(REPO / "configs/stages/evaluate.yml"), f"checkpoints={out}"]
    assert cli.main([*args, f"data={data_uri}", f"output_dir={ev}", "-q"]) == 0
    evaluated = open_artifact(str(ev), "evaluate").summary["eval_loss"]
    history = {e["step"]: e["eval_loss"] for e in summary["eval_history"]}
    assert sorted(history) == [20, 40]
    for step, loss in history.items():  # evaluate and periodic eval: the same schedule
        assert evaluated[str(step)] == pytest.approx(loss, rel=1e-5)

    prompts = tmp_path / "p.txt"
    prompts.write_text("a red circle\na blue square\n")
    render = tmp_path / "render"
    args = [
        "generate",
        str(REPO / "configs/stages/generate.yml"),
        f"pretrained_model_name_or_path={ev}",
        f"model.base_pipeline={pipeline}",
        f"prompt_file={prompts}",
        f"output_dir={render}",
        "num_inference_steps=3",
        "height=16",
        "width=16",
        "-q",
    ]
    assert cli.main(args) == 0
    rendered = open_artifact(str(render), "generate")
    assert rendered.summary["model"]["source"] == "train_artifact"
    assert len(rendered.file_paths("outputs/", ".png")) == 2
