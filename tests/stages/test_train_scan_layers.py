"""Training with ``compute.scan_layers``: the run holds the blocks' parameters (and their Adam
moments) stacked (:mod:`jaxcore.layer_stack`), so the train step's program is the same at any
depth, while checkpoints keep the per-layer layout: a run resumes across the two layouts and
trains exactly as the unrolled model does."""

from __future__ import annotations

import re
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml

from jaxcore import sharding
from jaxcore.compute import ComputeConfig
from jaxcore.families import TensorSpec
from pipelines.cli import main
from stages.common import checkpoints, data, records
from stages.common.objective import ObjectiveSection
from stages.train import model, trainer
from stages.train.config import LoraSection, ModelSection, OptimizerSection
from tests.support import train_steps
from tests.support.convert_artifacts import write_convert_artifact

REPO = Path(__file__).resolve().parents[2]


def _wan_yaml(directory: Path, layers: int) -> str:
    sections = yaml.safe_load((REPO / "configs/models/wan_tiny.yml").read_text())
    sections["transformer"]["num_layers"] = layers
    path = directory / f"wan_{layers}_layers.yml"
    path.write_text(yaml.safe_dump(sections))
    return str(path)


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory) -> str:
    uri = str(tmp_path_factory.mktemp("data") / "convert")
    write_convert_artifact(uri)
    return uri


def _train(data_uri, model_yaml, out, steps: int, scan: bool) -> None:
    # a second run in ``out`` goes on from its last checkpoint: --force drops the finished
    # manifest (the config differs), train resumes from the checkpoints it keeps
    extra = ["learning_rate=3e-3", f"compute.scan_layers={str(scan).lower()}"]
    args = train_steps.train_args(data_uri, model_yaml, out, steps, *extra)
    if (out / "manifest.json").exists():
        args.append("--force")
    assert main(args) == 0


def _losses(out: Path) -> dict[int, float]:
    import json

    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


def _checkpoint_params(out: Path, step: int) -> dict:
    return checkpoints.restore_tree(str(out / "checkpoints"), step, None)


# slow: four train runs (43 s, the default suite's heaviest); the step-level equalities below
# (any depth, sharded) stay in the default suite
@pytest.mark.slow
def test_scanned_run_trains_as_the_unrolled_one_and_resumes_across_layouts(
    tiny_data, tmp_path, caplog
):
    """Two runs of 8 steps on a 3-block Wan, each resumed at its step-4 checkpoint in the other
    layout: A unrolled then scanned, B scanned then unrolled. Step by step the losses agree (so
    the scanned steps train as the unrolled ones, from either layout's checkpoint), the
    checkpoints name the blocks per layer (``blocks_0`` ...), and the final weights agree."""
    import logging

    caplog.set_level(logging.INFO, logger="stages.train.loop")
    model_yaml = _wan_yaml(tmp_path, 3)
    a, b = tmp_path / "a", tmp_path / "b"
    _train(tiny_data, model_yaml, a, 4, scan=False)
    _train(tiny_data, model_yaml, b, 4, scan=True)
    _train(tiny_data, model_yaml, a, 8, scan=True)
    _train(tiny_data, model_yaml, b, 8, scan=False)

    resumed = [r for r in caplog.messages if "resuming from the checkpoint at step 4" in r]
    assert len(resumed) == 2, caplog.messages
    losses_a, losses_b = _losses(a), _losses(b)
    assert sorted(losses_a) == sorted(losses_b) == list(range(1, 9))
    for step in range(1, 9):
        assert losses_b[step] == pytest.approx(losses_a[step], rel=1e-5), step

    scanned_checkpoint = _checkpoint_params(b, 4)
    assert {"blocks_0", "blocks_1", "blocks_2"} <= set(scanned_checkpoint)
    assert not any(key.endswith("_stacked") for key in scanned_checkpoint)
    final_a, final_b = _checkpoint_params(a, 8), _checkpoint_params(b, 8)
    assert jax.tree.structure(final_a) == jax.tree.structure(final_b)
    before = _checkpoint_params(a, 4)
    leaves = [jax.tree.leaves(tree) for tree in (final_b, final_a, before)]
    for got, want, start in zip(*leaves, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
        assert float(np.abs(want - start).max()) > 0  # every leaf trained: not a no-op's weights


FEATURES = (
    TensorSpec(records.LATENTS, (4, 1, 8, 8)),
    TensorSpec("encoder_hidden_states", (7, 32)),
)


def _step(model_yaml: str, mesh, scan: bool):
    """(the train stage's step, its trainable, its optimizer state) for ``model_yaml``."""
    section = ModelSection(model_config=model_yaml)
    built = model.build_model(section, ComputeConfig(scan_layers=scan), mesh, jax.random.key(0))
    family, module = built.family, built.module
    trainable = model.make_trainable(built, LoraSection(), mesh, jax.random.key(1))
    tx, schedule = trainer.make_optimizer(
        OptimizerSection(learning_rate=1e-3, warmup_steps_fraction=0.0, max_grad_norm=1.0), 10
    )
    opt_sh = trainer.opt_state_shardings(tx, trainable.params, trainable.shardings, mesh)
    opt_state = jax.jit(tx.init, out_shardings=opt_sh)(trainable.params)
    step = trainer.make_train_step(
        family, module, tx, schedule, ObjectiveSection(), mesh, trainable.shardings, opt_sh,
        FEATURES, 0,
    )  # fmt: skip
    return step, trainable, opt_state


def _one_device():
    return sharding.make_mesh(sharding.MeshConfig(), devices=jax.devices()[:1])


def _lowered_step(model_yaml: str, scan: bool) -> str:
    """The train stage's step for ``model_yaml``, lowered (not compiled), as text."""
    step, trainable, opt_state = _step(model_yaml, _one_device(), scan)
    batch = {f.name: jax.ShapeDtypeStruct((2, *f.shape), np.float32) for f in FEATURES}
    with sharding.mesh_context(step.mesh):
        lowered = step.fn.lower(trainable.params, opt_state, {}, batch, {}, np.int32(0))
    return lowered.as_text()


def _operations(program: str) -> int:
    """Operations in a StableHLO module's text (lines that assign a result)."""
    return sum(1 for line in program.splitlines() if re.match(r"\s*%\S+ = ", line))


@pytest.mark.slow  # 22 s (four lowerings); the compile_layers bench measures the same growth
def test_scanned_train_step_is_the_same_program_at_any_depth(tmp_path):
    """With scan_layers the whole step (forward, backward, clipping, AdamW) has as many
    operations at 6 blocks as at 2; unrolled it grows with every block (the control)."""
    shallow, deep = _wan_yaml(tmp_path, 2), _wan_yaml(tmp_path, 6)
    scanned = [_operations(_lowered_step(path, scan=True)) for path in (shallow, deep)]
    unrolled = [_operations(_lowered_step(path, scan=False)) for path in (shallow, deep)]
    assert scanned[0] == scanned[1], scanned
    assert unrolled[1] > unrolled[0] + 100, unrolled


def test_a_lora_run_keeps_the_base_per_layer(tmp_path):
    """LoRA trains adapters on a frozen base: nothing is stacked (the model stacks the base's
    blocks per call, as inference does)."""
    mesh = sharding.make_mesh(sharding.MeshConfig(), devices=jax.devices()[:1])
    section = ModelSection(model_config=_wan_yaml(tmp_path, 2))
    compute = ComputeConfig(scan_layers=True)
    built = model.build_model(section, compute, mesh, jax.random.key(0))
    trainable = model.make_trainable(built, LoraSection(rank=2), mesh, jax.random.key(1))
    assert trainable.layers is None and "blocks_0" in trainable.frozen


def test_a_scanned_step_on_a_sharded_mesh_equals_the_unrolled_one_on_one_device(tmp_path):
    """The stacks are sharded as their blocks are (an unsharded leading layer axis): one step
    on data x fsdp x tensor = 2 x 2 x 2 gives the single-device unrolled step's loss and
    weights."""
    model_yaml = _wan_yaml(tmp_path, 2)
    rng = np.random.default_rng(0)
    host = {f.name: rng.standard_normal((8, *f.shape), np.float32) for f in FEATURES}

    def run(mesh, scan: bool):
        step, trainable, opt_state = _step(model_yaml, mesh, scan)
        batch = data.to_global(host, mesh, 8, keys=tuple(host))
        params, _, metrics = step(trainable.params, opt_state, batch, 0)
        return trainable, params, float(metrics["loss"])

    _, want, want_loss = run(_one_device(), scan=False)
    mesh = sharding.make_mesh(
        sharding.MeshConfig(
            ici_data_parallelism=2, ici_fsdp_parallelism=2, ici_tensor_parallelism=2
        )
    )
    trainable, got, got_loss = run(mesh, scan=True)
    stacked_kernel = got["blocks_stacked"]["attn1"]["to_q"]["kernel"]
    per_layer = trainable.checkpoint_shardings["blocks_0"]["attn1"]["to_q"]["kernel"]
    assert stacked_kernel.sharding.spec == jax.sharding.PartitionSpec(None, *per_layer.spec)
    assert any(axis is not None for axis in per_layer.spec)  # the test shards something
    assert got_loss == pytest.approx(want_loss, rel=1e-5)
    got = jax.device_get(trainable.denoiser_params(got))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5), got, want)
