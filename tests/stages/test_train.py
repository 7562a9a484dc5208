"""train stage: pure pieces, the input pipeline, sharded-vs-unsharded steps, end to end.

Tolerances: a training step on dp/fsdp/tp meshes matches the single-device step to 1e-5
(loss) and 5e-5 absolute (updated parameters after one AdamW step at lr 1e-3; Adam divides by
sqrt(v), which magnifies fp32 reduction-order differences of tiny gradients).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml

from jaxcore import sharding, storage
from jaxcore.artifacts import ArtifactError, read_manifest
from jaxcore.compute import ComputeConfig
from jaxcore.config import load_config
from jaxcore.families import FamilyError, TensorSpec, get
from pipelines.cli import main
from stages.common import checkpoints, data, objective, records
from stages.common.errors import StageInputError
from stages.common.objective import ObjectiveSection
from stages.train import model, trainer
from stages.train.config import (
    ModelSection,
    OptimizerSection,
    TrainConfig,
    batch_mesh,
    global_batch_size,
)
from tests.support import train_steps
from tests.support.convert_artifacts import TinyDataConfig, write_convert_artifact
from tests.support.wan_variants import write_one_layer_wan_yaml

REPO = Path(__file__).resolve().parents[2]
TRAIN_YML = REPO / "configs" / "stages" / "train.yml"


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory) -> str:
    uri = str(tmp_path_factory.mktemp("data") / "convert")
    write_convert_artifact(uri)
    return uri


@pytest.fixture(scope="module")
def one_layer_model(tmp_path_factory) -> str:
    """The tiny Wan with one block (compiles faster)."""
    return write_one_layer_wan_yaml(tmp_path_factory.mktemp("model"))


def _config(output_dir, *overrides) -> TrainConfig:
    return load_config(TrainConfig, TRAIN_YML, [f"output_dir={output_dir}", *overrides])


# --- pure pieces ------------------------------------------------------------------------------


def test_checked_in_config_loads():
    cfg = load_config(TrainConfig, TRAIN_YML, ["learning_rate=1e-4", "dataset_type=synthetic"])
    assert cfg.optimizer.learning_rate == 1e-4
    assert cfg.model.model_config == "configs/models/wan_tiny.yml"


def test_fractional_per_device_batch_must_make_a_whole_batch():
    assert global_batch_size(0.5, 8) == 4
    with pytest.raises(ValueError, match="per_device_batch_size=0.3"):
        global_batch_size(0.3, 8)


def test_config_errors_name_the_key(tmp_path):
    with pytest.raises(ValueError, match="exactly one of model"):  # two on the command line
        _config(tmp_path, "model.init_from=/x", "model.model_config=y.yml")
    assert _config(tmp_path, "model.init_from=/x").model.model_config is None  # replaces YAML's
    with pytest.raises(ValueError, match="data"):
        _config(tmp_path, "dataset_type=tfrecord")


def test_warmup_then_constant_and_cosine():
    sched = trainer.learning_rate_schedule(OptimizerSection(learning_rate=1.0), 100)
    assert float(sched(0)) == 0.0 and float(sched(5)) == pytest.approx(0.5)
    assert float(sched(50)) == 1.0
    cos = trainer.learning_rate_schedule(
        OptimizerSection(learning_rate=1.0, lr_schedule="cosine"), 100
    )
    assert float(cos(10)) == pytest.approx(1.0) and float(cos(100)) == pytest.approx(0.0)


def test_shifted_timesteps_follow_the_maxdiffusion_formula():
    key = jax.random.key(3)
    u = np.asarray(jax.random.uniform(key, (1000,)))
    t = np.asarray(objective.sample_t(key, 1000, ObjectiveSection(timestep_shift=3.0)))
    np.testing.assert_allclose(t, 3 * u / (1 + 2 * u), rtol=1e-6)
    assert t.mean() > u.mean()  # the shift moves mass to high noise


def test_loss_weight_is_normalised_over_the_schedule_not_the_batch():
    cfg = ObjectiveSection(loss_weighting="gaussian")
    grid = np.arange(1000, dtype=np.float32) / 1000  # the schedule, in t units
    assert float(np.mean(objective.loss_weight(grid, cfg))) == pytest.approx(1.0, rel=1e-5)
    one = objective.loss_weight(np.array([0.5], np.float32), cfg)  # a batch of one stays finite
    assert np.isfinite(one).all() and float(one[0]) > 1.0


def test_noisy_input_and_target():
    x0, noise = np.ones((2, 3)), np.full((2, 3), 3.0)
    xt = objective.noisy_input(x0, noise, np.array([0.0, 1.0]))
    s = objective.SIGMA_MIN  # MaxDiffusion leaves sigma_min of noise at t = 0
    np.testing.assert_allclose(xt, [[1 + 2 * s] * 3, [3, 3, 3]], rtol=1e-6)
    np.testing.assert_allclose(objective.velocity_target(x0, noise), 2.0)


# --- input pipeline ---------------------------------------------------------------------------


def _take(spec, start_step, steps, batch=4):
    ds = data.tf_dataset(spec, batch, seed=7, start_step=start_step, shuffle_buffer=16, prefetch=1)
    it = data.iterate_numpy(spec, ds)
    return [next(it) for _ in range(steps)]


def test_data_order_is_reproducible_from_any_step(tiny_data):
    """A pipeline started at step k yields exactly batches k.. of an uninterrupted one, across
    epoch boundaries (32 records / batch 4 = 8 steps per epoch)."""
    spec = data.split_spec(_open(tiny_data), "train")
    full = _take(spec, 0, 12)
    resumed = _take(spec, 7, 5)
    for a, b in zip(full[7:], resumed, strict=True):
        assert list(a[records.SOURCE_ID]) == list(b[records.SOURCE_ID])
        np.testing.assert_array_equal(a[records.LATENTS], b[records.LATENTS])
    epoch1 = sorted(s for b in full[:8] for s in b[records.SOURCE_ID])
    assert len(set(epoch1)) == 32  # each record once per epoch
    assert [s for b in full[8:10] for s in b[records.SOURCE_ID]] != [
        s for b in full[:2] for s in b[records.SOURCE_ID]
    ]  # reshuffled per epoch


def _open(uri):
    from jaxcore.artifacts import open_artifact

    return open_artifact(uri, "convert")


def test_corrupt_shard_is_named(tmp_path):
    uri = str(tmp_path / "convert")
    manifest = write_convert_artifact(uri, TinyDataConfig(train_records=8))
    shard = Path(uri) / manifest.summary["splits"]["train"]["shards"][1]
    raw = bytearray(shard.read_bytes())
    raw[40:60] = b"\xff" * 20
    shard.write_bytes(bytes(raw))
    # opening the artifact hashes this small shard: refused before any record is read
    with pytest.raises(ArtifactError, match="train-00001-of-00002.tfrecord does not match"):
        _open(uri)
    # a shard too big to hash on open is checked by the reader (TFRecord's CRC per record)
    spec = data.split_spec(read_manifest(uri), "train")
    with pytest.raises(StageInputError, match="train-00001-of-00002"):
        _take(spec, 0, 3, batch=2)


def test_missing_shard_and_missing_manifest(tmp_path):
    uri = str(tmp_path / "convert")
    manifest = write_convert_artifact(uri, TinyDataConfig(train_records=4, eval_records=2))
    rel = manifest.summary["splits"]["train"]["shards"][0]
    (Path(uri) / rel).unlink()
    with pytest.raises(ArtifactError, match=f"{rel} is listed in the manifest but missing"):
        _open(uri)
    with pytest.raises(StageInputError, match=rel):  # the reader's own check
        data.split_spec(read_manifest(uri), "train")
    with pytest.raises(ArtifactError, match="manifest.json"):
        _open(str(tmp_path / "nothing"))


def test_mismatched_record_shape_names_the_feature(tmp_path):
    uri = str(tmp_path / "convert")
    write_convert_artifact(uri, TinyDataConfig(train_records=4, eval_records=2))
    # a manifest claiming another latent shape than the records hold
    mpath = Path(uri) / "manifest.json"
    m = json.loads(mpath.read_text())
    m["summary"]["features"]["latents"]["shape"] = [4, 1, 4, 4]
    mpath.write_text(json.dumps(m))
    spec = data.split_spec(_open(uri), "train")
    with pytest.raises(StageInputError, match="latents"):
        _take(spec, 0, 1, batch=2)


def test_records_that_do_not_fit_the_model_name_both(tmp_path):
    wan = get("wan")
    config = wan.denoiser_config(
        yaml.safe_load((REPO / "configs/models/wan_tiny.yml").read_text())["transformer"]
    )
    good = {
        "latents": TensorSpec("latents", (4, 1, 8, 8)),
        "encoder_hidden_states": TensorSpec("encoder_hidden_states", (8, 32)),
    }
    wan.check_features(config, good, "data")
    with pytest.raises(FamilyError, match="8 channels, the denoiser takes 4"):
        wan.check_features(config, {**good, "latents": TensorSpec("latents", (8, 1, 8, 8))}, "d")
    wide = {**good, "encoder_hidden_states": TensorSpec("encoder_hidden_states", (8, 64))}
    with pytest.raises(FamilyError, match=r"'encoder_hidden_states' has shape \[8, 64\]"):
        wan.check_features(config, wide, "d")
    with pytest.raises(FamilyError, match="no 'encoder_hidden_states' feature"):
        wan.check_features(config, {"latents": good["latents"]}, "d")


def test_synthetic_batches_are_indexed_by_step():
    features = (TensorSpec("latents", (4, 1, 2, 2)), TensorSpec("encoder_hidden_states", (3, 8)))
    a = data.synthetic_batches(features, 2, seed=1, start_step=0)
    b = data.synthetic_batches(features, 2, seed=1, start_step=2)
    first = [next(a) for _ in range(3)]
    np.testing.assert_array_equal(first[2][records.LATENTS], next(b)[records.LATENTS])
    assert first[0]["encoder_hidden_states"].shape == (2, 3, 8)


# --- the step on meshes -----------------------------------------------------------------------


FEATURES = (TensorSpec("latents", (4, 1, 8, 8)), TensorSpec("encoder_hidden_states", (8, 32)))


def _one_step(model_yaml, mesh):
    section = ModelSection(model_config=model_yaml)
    return train_steps.one_step(section, mesh, FEATURES, train_steps.random_batch(FEATURES))


MESHES = {
    "dp": sharding.MeshConfig(ici_data_parallelism=8),
    "fsdp": sharding.MeshConfig(ici_data_parallelism=1, ici_fsdp_parallelism=8),
    "tp": sharding.MeshConfig(ici_data_parallelism=4, ici_tensor_parallelism=2),
    "dp_fsdp_tp": sharding.MeshConfig(
        ici_data_parallelism=2, ici_fsdp_parallelism=2, ici_tensor_parallelism=2
    ),
}


@pytest.fixture(scope="module")
def single_device_step(one_layer_model):
    single = sharding.make_mesh(sharding.MeshConfig(), devices=jax.devices()[:1])
    assert single.size == 1
    return _one_step(one_layer_model, single)


@pytest.mark.parametrize(
    "name",
    [
        "dp_fsdp_tp",
        pytest.param("dp", marks=pytest.mark.slow),
        pytest.param("fsdp", marks=pytest.mark.slow),
        pytest.param("tp", marks=pytest.mark.slow),
    ],
)
def test_sharded_step_equals_single_device_step(name, one_layer_model, single_device_step):
    ref_params, ref_loss = single_device_step
    params, loss = _one_step(one_layer_model, sharding.make_mesh(MESHES[name]))
    assert loss == pytest.approx(ref_loss, abs=1e-5)
    worst = max(
        jax.tree.leaves(jax.tree.map(lambda a, b: float(np.max(np.abs(a - b))), params, ref_params))
    )
    assert worst < 5e-5, worst
    moved = max(
        jax.tree.leaves(
            jax.tree.map(
                lambda a, b: float(np.max(np.abs(a - b))), params, _initial(one_layer_model)
            )
        )
    )
    assert moved > 1e-4  # the step did change the parameters


def test_a_batch_smaller_than_fsdp_trains_its_tokens_split_over_context(one_layer_model):
    """Global batch 1 on 4 fsdp chips (MaxDiffusion's per_device_batch_size=0.25): the fsdp
    ways fold into context ways, the weights sharded over all four (embed spans fsdp and
    context), and the step equals the single-device step on that one example."""
    config = TrainConfig(
        output_dir="unused",
        model=ModelSection(model_config=one_layer_model),
        data="unused",
        per_device_batch_size=0.25,
        mesh=sharding.MeshConfig(ici_data_parallelism=1, ici_fsdp_parallelism=4),
    )
    mesh_config, note = batch_mesh(config, 4)
    assert (mesh_config.ici_fsdp_parallelism, mesh_config.ici_context_parallelism) == (1, 4)
    assert "context 4" in note
    mesh = sharding.make_mesh(mesh_config, jax.devices()[:4])
    batch = train_steps.random_batch(FEATURES, rows=1)
    params, loss = train_steps.one_step(
        ModelSection(model_config=one_layer_model), mesh, FEATURES, batch
    )
    single = sharding.make_mesh(sharding.MeshConfig(), devices=jax.devices()[:1])
    ref_params, ref_loss = train_steps.one_step(
        ModelSection(model_config=one_layer_model), single, FEATURES, batch
    )
    assert loss == pytest.approx(ref_loss, abs=1e-5)
    worst = max(
        jax.tree.leaves(jax.tree.map(lambda a, b: float(np.max(np.abs(a - b))), params, ref_params))
    )
    assert worst < 5e-5, worst


def _initial(model_yaml):
    section = ModelSection(model_config=model_yaml)
    mesh = sharding.make_mesh(sharding.MeshConfig(), devices=jax.devices()[:1])
    built = model.build_model(section, ComputeConfig(), mesh, jax.random.key(0))
    return jax.device_get(built.params)


# --- end to end -------------------------------------------------------------------------------


def _summary(uri):
    return json.loads((Path(uri) / "manifest.json").read_text())["summary"]


def _losses(uri):
    rows = [json.loads(x) for x in (Path(uri) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


def test_fp8_training_follows_the_float_loss(tiny_data, one_layer_model, tmp_path):
    """compute.quantization=fp8 in train: the step's dense products run on e4m3 operands and
    its weight gradients on e5m2 ones (in the lowered step), the weights stay float32, and
    over 60 steps the loss falls as the float run's does: the mean of the last 10 steps
    within 5% of float's (measured: see the issue note), not equal to it. Other modes are
    refused by name."""
    runs = {}
    for mode in ("none", "fp8"):
        out = tmp_path / mode
        args = [
            "train",
            str(TRAIN_YML),
            f"data={tiny_data}",
            f"output_dir={out}",
            "dataset_type=tfrecord",
            f"model.model_config={one_layer_model}",
            "max_train_steps=60",
            "checkpoint_every=60",
            "learning_rate=3e-3",
            f"quantization={mode}",
            "-q",
        ]
        assert main(args) == 0
        losses = _losses(out)
        runs[mode] = (
            np.mean([losses[s] for s in range(1, 11)]),
            np.mean([losses[s] for s in range(51, 61)]),
        )
    (_, float_last), (fp8_first, fp8_last) = runs["none"], runs["fp8"]
    print(f"fp8 training: last-10 mean {fp8_last:.5f} vs float {float_last:.5f}")
    assert fp8_last < 0.8 * fp8_first
    assert fp8_last != float_last and abs(fp8_last - float_last) < 0.05 * float_last
    with pytest.raises(ValueError, match="compute.quantization=int8: train runs its products"):
        _config(tmp_path / "x", "quantization=int8")


def test_fp8_training_products_are_float8_both_ways():
    import re

    from jaxcore import quantization
    from jaxcore.models import layers

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(4, 16)), jnp.float32)
    kernel = jnp.asarray(rng.normal(size=(16, 8)), jnp.float32)

    def loss(kernel, x):
        return jnp.sum(layers.projection(x, kernel, jnp.zeros(8)) ** 2)

    want = jax.grad(loss, argnums=(0, 1))(kernel, x)
    with quantization.training_products("fp8"):
        got = jax.grad(loss, argnums=(0, 1))(kernel, x)
        text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(kernel, x).as_text()
    dots = re.findall(r"stablehlo.dot_general[^\n]*", text)
    assert sum("f8E4M3FN" in d for d in dots) >= 1  # the forward
    assert sum("f8E5M2" in d for d in dots) == 2  # both backward products
    for g, w in zip(got, want, strict=True):  # e4m3 / e5m2 rounding: within 10% of the largest
        assert 0 < float(jnp.abs(g - w).max() / jnp.abs(w).max()) < 0.1


def test_end_to_end_train_and_evaluate_local(tiny_data, one_layer_model, tmp_path, caplog):
    """~100 steps on the tiny dataset: training loss falls, the last checkpoint scores better
    than the first, evaluate names the best checkpoint, export writes diffusers weights; the
    log shows progress lines (first and last step at least) where no progress bar is."""
    import logging

    caplog.set_level(logging.INFO, logger="stages.train.loop")
    out = tmp_path / "train"
    rc = main(
        [
            "train",
            str(TRAIN_YML),
            f"data={tiny_data}",
            f"output_dir={out}",
            "dataset_type=tfrecord",
            f"model.model_config={one_layer_model}",
            "max_train_steps=100",
            "checkpoint_every=25",
            "max_to_keep=5",
            "eval_every=25",
            "learning_rate=3e-3",
            "export_diffusers=true",
            "-q",
        ]
    )
    assert rc == 0
    progress = [r.getMessage() for r in caplog.records if "ETA" in r.getMessage()]
    assert progress[0].startswith("step 1/100") and progress[-1].startswith("step 100/100")
    assert "loss" in progress[0] and "tokens/s" in progress[0]
    summary = _summary(out)
    assert summary["checkpoints"] == [25, 50, 75, 100] and summary["final_step"] == 100
    losses = _losses(out)
    first, last = (
        np.mean([losses[s] for s in range(1, 11)]),
        np.mean([losses[s] for s in range(91, 101)]),
    )
    assert last < 0.5 * first, (first, last)
    history = {e["step"]: e["eval_loss"] for e in summary["eval_history"]}
    assert history[100] < history[25]
    assert (out / "transformer" / "diffusion_pytorch_model.safetensors").is_file()
    assert (out / "loss_curve.png").stat().st_size > 1000
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))

    ev = tmp_path / "eval"
    args = [
        "evaluate",
        str(REPO / "configs/stages/evaluate.yml"),
        f"checkpoints={out}",
        f"data={tiny_data}",
        f"output_dir={ev}",
        "-q",
    ]
    assert main(args) == 0
    ev_summary = _summary(ev)
    assert ev_summary["best_checkpoint_step"] == min(history, key=history.get)
    for step, loss in history.items():  # evaluate and periodic eval share the scoring code
        assert ev_summary["eval_loss"][str(step)] == pytest.approx(loss, rel=1e-5)


def _train_cmd(data_uri, model_yaml, out, steps, *extra):
    return [sys.executable, "-m", "pipelines.cli", *train_steps.train_args(
        data_uri, model_yaml, out, steps, *extra
    )]  # fmt: skip


@pytest.fixture(scope="module")
def flux_data(tmp_path_factory) -> str:
    from tests.support.convert_artifacts import FLUX

    uri = str(tmp_path_factory.mktemp("flux_data") / "convert")
    write_convert_artifact(uri, TinyDataConfig(**FLUX))
    return uri


@pytest.mark.parametrize(
    "family",
    [
        # slow tier (76 s); test_checkpoints_on_gcs_save_keep_resume_and_reshard resumes in the
        # default tier
        pytest.param("wan", marks=pytest.mark.slow),
        pytest.param("flux", marks=pytest.mark.slow),
        pytest.param("wan22_low_expert", marks=pytest.mark.slow),
        pytest.param("wan_prior_preservation", marks=pytest.mark.slow),
    ],
)
def test_kill_9_then_resume_equals_an_uninterrupted_run(family, request, tmp_path):
    """The same for every family (the loop is shared) and for one expert of a two-expert
    model (timesteps drawn in its range) and for a prior-preservation run (two record streams):
    a run SIGKILLed after its step-4 checkpoint, rerun, logs exactly the losses of an
    uninterrupted run."""
    extra = ()
    if family == "wan_prior_preservation":
        tiny_data = request.getfixturevalue("tiny_data")
        one_layer_model = request.getfixturevalue("one_layer_model")
        extra = (f"prior_preservation.data={tiny_data}", "prior_preservation.prior_loss_weight=0.5")
    elif family == "wan":
        tiny_data = request.getfixturevalue("tiny_data")
        one_layer_model = request.getfixturevalue("one_layer_model")
    elif family == "flux":
        tiny_data = request.getfixturevalue("flux_data")
        one_layer_model = str(REPO / "configs/models/flux_tiny.yml")
    else:
        from tests.support import wan_variants

        tiny_data = request.getfixturevalue("tiny_data")
        one_layer_model = "null"
        pipeline = wan_variants.build_two_expert_pipeline(tmp_path / "wan22")
        extra = (f"model.pretrained_model_name_or_path={pipeline}", "model.expert=low")
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0",
        "JAX_PLATFORMS": "cpu",
    }
    steps = 12
    straight = tmp_path / "straight"
    subprocess.run(
        _train_cmd(tiny_data, one_layer_model, straight, steps, *extra),
        cwd=REPO,
        env=env,
        check=True,
        timeout=900,
    )
    killed = tmp_path / "killed"
    proc = subprocess.Popen(
        _train_cmd(tiny_data, one_layer_model, killed, steps, *extra), cwd=REPO, env=env
    )
    deadline = time.monotonic() + 600
    while not (killed / "checkpoints" / "4").is_dir() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert proc.poll() is None, "the run finished before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (killed / "manifest.json").exists()
    subprocess.run(
        _train_cmd(tiny_data, one_layer_model, killed, steps, *extra),
        cwd=REPO,
        env=env,
        check=True,
        timeout=900,
    )
    a, b = _losses(straight), _losses(killed)
    assert sorted(a) == sorted(b) == list(range(1, steps + 1))
    for s in range(1, steps + 1):
        assert b[s] == pytest.approx(a[s], rel=1e-6, abs=1e-7), s
    assert _summary(killed)["final_loss"] == pytest.approx(_summary(straight)["final_loss"])


def test_sigterm_checkpoints_and_exits_75(tiny_data, one_layer_model, tmp_path):
    """Preemption: SIGTERM saves a checkpoint at the step in flight, writes no manifest and
    exits 75 (EXIT_PREEMPTED, which the deploy templates retry)."""
    from stages.common.preemption import EXIT_PREEMPTED

    out = tmp_path / "train"
    cmd = _train_cmd(tiny_data, one_layer_model, out, 100000)
    cmd[cmd.index("checkpoint_every=4")] = "checkpoint_every=2"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 600
    while not (out / "checkpoints" / "2").is_dir():
        assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == EXIT_PREEMPTED, err[-2000:]
    assert "preempted" in err and "rerun to resume" in err
    assert not (out / "manifest.json").exists()
    saved = max(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit())
    assert saved >= 2  # the step in flight was checkpointed; rerunning resumes from it
    assert max(_losses(out)) == saved  # (resume itself: test_checkpoints_on_gcs_...)


@pytest.mark.slow  # 67 s: two training processes
def test_two_processes_train_bit_identical_models(tiny_data, one_layer_model, tmp_path):
    """Same config + same records in two processes (8 CPU devices, data-parallel reductions,
    tf.data reading 2 shards) -> the same losses and the same exported weights, bit for bit."""
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0",
        "JAX_PLATFORMS": "cpu",
    }
    outs = [tmp_path / "one", tmp_path / "two"]
    for out in outs:
        cmd = [*_train_cmd(tiny_data, one_layer_model, out, 6), "export_diffusers=true"]
        subprocess.run(cmd, cwd=REPO, env=env, check=True, timeout=900)
    assert _losses(outs[0]) == _losses(outs[1])
    weights = [o / "transformer" / "diffusion_pytorch_model.safetensors" for o in outs]
    assert weights[0].read_bytes() == weights[1].read_bytes()


def test_checkpoints_on_gcs_save_keep_resume_and_reshard(gcs_root, one_layer_model, monkeypatch):
    """orbax on the local GCS server: saves every 2 steps keeping 2, a longer run resumes from
    the latest, and a checkpoint restores onto another mesh shape. The local folder that
    stages the TensorBoard events for upload is gone after each run."""
    # orbax reaches gs:// through etils.epath -> fsspec -> gcsfs; tensorstore does the array I/O.
    from stages.train import loop

    made = []
    make_dir = loop.tempfile.mkdtemp
    monkeypatch.setattr(
        loop.tempfile, "mkdtemp", lambda *a, **kw: made.append(make_dir(*a, **kw)) or made[-1]
    )
    out = f"{gcs_root}/train"
    common = [f"model.model_config={one_layer_model}", "checkpoint_every=2", "max_to_keep=2"]
    first = loop.train(_config(out, *common, "max_train_steps=4"), out)
    assert first.checkpoints == [2, 4]
    assert storage.list_files(f"{out}/tensorboard"), "the events were uploaded"
    local_dirs = [d for d in made if Path(d).name.startswith("difforge-train-")]
    assert local_dirs and not any(Path(d).exists() for d in local_dirs)
    second = loop.train(_config(out, *common, "max_train_steps=6"), out)
    assert second.checkpoints == [4, 6]  # resumed at 4 (no step 2 re-saved), kept 2
    mesh = sharding.make_mesh(sharding.MeshConfig(ici_data_parallelism=2, ici_tensor_parallelism=4))
    family, cfg = model.config_from_yaml(one_layer_model, None)
    module = family.make_denoiser(cfg, ComputeConfig(), mesh)
    params = checkpoints.restore_params(f"{out}/checkpoints", 6, family, module, mesh)
    q = params["blocks_0"]["attn1"]["to_q"]["kernel"]
    assert q.sharding.spec == jax.sharding.PartitionSpec(("fsdp", "context"), "tensor")
    meta = checkpoints.read_meta(f"{out}/checkpoints", 6)
    assert meta["model_config"]["num_layers"] == 1 and meta["family"] == "wan"


@pytest.mark.slow  # ~30 s; resume is covered by the kill -9 and GCS tests
def test_relative_output_dir_checkpoints_and_resumes(one_layer_model, tmp_path, monkeypatch):
    """`make demo` passes root=outputs/demo: orbax needs absolute paths, the stage must not."""
    from stages.train import loop

    monkeypatch.chdir(tmp_path)
    out = "outputs/train"
    common = [f"model.model_config={one_layer_model}", "dataset_type=synthetic"]
    first = loop.train(_config(out, *common, "max_train_steps=2", "checkpoint_every=1"), out)
    assert first.checkpoints == [1, 2]
    assert (tmp_path / out / "checkpoints" / "2").is_dir()
    again = loop.train(_config(out, *common, "max_train_steps=3", "checkpoint_every=1"), out)
    assert again.checkpoints[-1] == 3


@pytest.mark.parametrize(
    ("override", "names"),
    [
        ("attention=nope", "compute: attention: unknown attention backend 'nope'"),
        ("remat_policy=sometimes", "unknown remat_policy 'sometimes'"),
        ("weights_dtype=float8", "compute.weights_dtype"),
    ],
)
def test_compute_section_is_checked_when_the_config_is_read(tmp_path, override, names):
    """A typo in the attention backend or remat policy fails before any weights load."""
    from jaxcore.config import ConfigError

    with pytest.raises(ConfigError, match=names):
        _config(tmp_path, override)


def test_records_of_another_family_are_refused_naming_both(tmp_path, flux_data, one_layer_model):
    from stages.train import loop

    config = _config(
        tmp_path / "out",
        f"data={flux_data}",
        "dataset_type=tfrecord",
        f"model.model_config={one_layer_model}",
    )
    with pytest.raises(StageInputError, match="records of the 'flux' family.*a 'wan' model"):
        loop.train(config, str(tmp_path / "out"), _open(flux_data))


def test_an_empty_eval_split_is_refused_before_training(tmp_path, one_layer_model):
    from stages.train import loop

    uri = str(tmp_path / "data")
    write_convert_artifact(uri, TinyDataConfig(train_records=4, eval_records=0))
    config = _config(
        tmp_path / "out",
        f"data={uri}",
        "dataset_type=tfrecord",
        f"model.model_config={one_layer_model}",
        "eval_every=2",
    )
    with pytest.raises(StageInputError, match="eval split has no records.*eval_every=0"):
        loop.train(config, str(tmp_path / "out"), _open(uri))
