"""evaluate stage: deterministic per-record noise, bucket means, identical scores across runs
and meshes (tolerance 1e-6 relative across meshes: only the reduction order differs), outputs.

The train artifact is built directly (random-init params saved as orbax checkpoints), so these
tests need no training run.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxcore import sharding
from jaxcore.artifacts import ArtifactWriter, open_artifact
from jaxcore.compute import ComputeConfig
from jaxcore.config import load_config
from jaxcore.models import wan_transformer as wan
from pipelines.cli import main
from stages.common import checkpoints as checkpointing
from stages.common import data, scoring
from stages.common.errors import StageInputError
from stages.evaluate.config import EvaluateConfig
from stages.evaluate.run import selected_steps
from tests.support.convert_artifacts import write_convert_artifact

REPO = Path(__file__).resolve().parents[2]
EVAL_YML = REPO / "configs" / "stages" / "evaluate.yml"
ONE_LAYER = {
    "patch_size": [1, 2, 2],
    "num_attention_heads": 2,
    "attention_head_dim": 16,
    "in_channels": 4,
    "out_channels": 4,
    "text_dim": 32,
    "freq_dim": 32,
    "ffn_dim": 64,
    "num_layers": 1,
    "rope_max_seq_len": 64,
}


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    """(convert artifact, train artifact with checkpoints at steps 1 and 2 of different params)."""
    root = tmp_path_factory.mktemp("eval")
    data_uri = str(root / "convert")
    write_convert_artifact(data_uri)
    train_uri = str(root / "train")
    config = wan.WanTransformerConfig.from_dict(ONE_LAYER)
    mngr = checkpointing.manager(f"{train_uri}/checkpoints", async_save=False)
    for step in (1, 2):
        _, params = wan.init_wan_transformer(config, jax.random.key(step))
        meta = {"family": "wan", "model_config": config.to_dict()}
        checkpointing.save(mngr, step, params, None, meta)
    mngr.wait_until_finished()
    mngr.close()
    ArtifactWriter(train_uri, "train", {"test": "checkpoints"}).commit(
        {
            "checkpoints": [1, 2],
            "checkpoint_dir": "checkpoints",
            "final_step": 2,
            "family": "wan",
            "model_config": config.to_dict(),
        }
    )
    return data_uri, train_uri


def test_checked_in_config_loads():
    cfg = load_config(EvaluateConfig, EVAL_YML, ["eval_batch_size=4"])
    assert cfg.eval_batch_size == 4 and cfg.split == "eval"


def test_noise_depends_on_the_source_id_not_the_position():
    ids = np.array([scoring.source_id_hash(b"a"), scoring.source_id_hash(b"b")], np.uint32)
    ab = np.asarray(scoring.record_noise(0, ids, (3,)))
    ba = np.asarray(scoring.record_noise(0, ids[::-1], (3,)))
    np.testing.assert_array_equal(ab, ba[::-1])
    assert scoring.source_id_hash("a") == scoring.source_id_hash(b"a")
    assert not np.allclose(ab[0], ab[1])


def test_eval_loss_is_the_mean_of_bucket_means(artifacts):
    data_uri, _ = artifacts
    spec = data.split_spec(open_artifact(data_uri, "convert"), "eval")
    # a fake scorer: loss = timestep / 1000 for one bucket size pattern
    result = scoring.score(
        lambda params, batch: batch[scoring.TIMESTEPS].astype(np.float64) / 1000,
        None,
        spec,
        batch_size=4,
        max_records=9,
    )
    # 9 of 14 records (padding of the last batch of 4 dropped) over 7 timesteps: unequal
    # buckets, so the mean of bucket means differs from the plain record mean
    counts = result.bucket_counts
    assert sum(counts.values()) == 9 and len(counts) == 7
    for t, mean in result.bucket_means.items():
        assert mean == pytest.approx(t / 1000)
    assert result.eval_loss == pytest.approx(np.mean([t / 1000 for t in counts]))
    record_mean = sum(t / 1000 * n for t, n in counts.items()) / 9
    assert result.eval_loss != pytest.approx(record_mean)


def test_selected_steps_reject_unknown_ones(artifacts):
    _, train_uri = artifacts
    manifest = open_artifact(train_uri, "train")
    assert selected_steps(manifest, None) == [1, 2]
    with pytest.raises(StageInputError, match=r"\[7\]"):
        selected_steps(manifest, [2, 7])


def _scores(train_uri, data_uri, mesh_config, batch_size=8, quantization="none"):
    from stages.evaluate import evaluator

    cfg = EvaluateConfig(
        checkpoints=train_uri,
        data=data_uri,
        output_dir="unused",
        mesh=mesh_config,
        eval_batch_size=batch_size,
        compute=ComputeConfig(quantization=quantization),
    )
    return evaluator.evaluate_checkpoints(
        cfg, open_artifact(train_uri, "train"), open_artifact(data_uri, "convert"), [1, 2]
    )


def test_scores_are_identical_across_runs_and_meshes(artifacts):
    data_uri, train_uri = artifacts
    dp = sharding.MeshConfig(ici_data_parallelism=8)
    first = _scores(train_uri, data_uri, dp)
    assert _scores(train_uri, data_uri, dp) == first  # bit-identical rerun
    other = _scores(
        train_uri,
        data_uri,
        sharding.MeshConfig(
            ici_data_parallelism=2, ici_fsdp_parallelism=2, ici_tensor_parallelism=2
        ),
        batch_size=4,  # other batching too: noise follows the record, not its position
    )
    for step in (1, 2):
        assert other[step]["bucket_counts"] == first[step]["bucket_counts"]
        assert other[step]["eval_loss"] == pytest.approx(first[step]["eval_loss"], rel=1e-6)
    assert first[1]["eval_loss"] != first[2]["eval_loss"]


@pytest.mark.parametrize("mode, tolerance", [("int8_weights", 0.01), ("int8", 0.02)])
def test_quantized_checkpoints_score_near_the_float_ones(artifacts, mode, tolerance):
    """compute.quantization in evaluate: each checkpoint is scored quantized, as generate
    would render it, on an 8-way data mesh; the eval loss is within ``tolerance`` (relative)
    of the float one and not equal to it (measured: int8_weights 3e-4, int8 1.9e-3)."""
    data_uri, train_uri = artifacts
    dp = sharding.MeshConfig(ici_data_parallelism=8)
    full, quantized = _scores(train_uri, data_uri, dp), _scores(train_uri, data_uri, dp, 8, mode)
    for step in (1, 2):
        want, got = full[step]["eval_loss"], quantized[step]["eval_loss"]
        assert got != want and got == pytest.approx(want, rel=tolerance)


def test_cli_writes_metrics_csv_plots_and_best_step(artifacts, tmp_path):
    data_uri, train_uri = artifacts
    out = tmp_path / "evaluate"
    args = [
        "evaluate",
        str(EVAL_YML),
        f"checkpoints={train_uri}",
        f"data={data_uri}",
        f"output_dir={out}",
        "-q",
    ]
    assert main(args) == 0
    summary = json.loads((out / "manifest.json").read_text())["summary"]
    losses = {int(k): v for k, v in summary["eval_loss"].items()}
    assert summary["best_checkpoint_step"] == min(losses, key=losses.get)
    metrics = json.loads((out / "metrics.json").read_text())
    assert set(metrics) == {"1", "2"} and len(metrics["1"]["bucket_means"]) == 7
    csv = (out / "eval_loss.csv").read_text().splitlines()
    assert csv[0] == "checkpoint_step,timestep,mean_loss,records" and len(csv) == 1 + 2 * 8
    for png in ("loss_per_timestep.png", "eval_loss_vs_step.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    assert main(args) == 0  # a rerun finds the finished artifact


def test_missing_data_manifest_is_a_one_line_error(artifacts, tmp_path, capsys):
    _, train_uri = artifacts
    rc = main(
        [
            "evaluate",
            str(EVAL_YML),
            f"checkpoints={train_uri}",
            f"data={tmp_path / 'none'}",
            f"output_dir={tmp_path / 'e'}",
            "-q",
        ]
    )
    assert rc == 2
    assert "manifest.json" in capsys.readouterr().err


def test_a_copied_run_folder_reads_its_own_checkpoints(artifacts, tmp_path):
    """Train and evaluate artifacts copied together (``gsutil cp -r runs gs://other/``), the
    originals gone: the copied evaluation's best checkpoint is restored from the copied train
    artifact, with the same parameters."""
    from jaxcore.compute import ComputeConfig

    data_uri, train_uri = artifacts
    runs = tmp_path / "runs"
    shutil.copytree(train_uri, runs / "train")
    args = [
        "evaluate",
        str(EVAL_YML),
        f"checkpoints={runs / 'train'}",
        f"data={data_uri}",
        f"output_dir={runs / 'evaluate'}",
        "-q",
    ]
    assert main(args) == 0
    mesh = sharding.make_mesh(sharding.MeshConfig(), jax.devices()[:1])
    source = checkpointing.resolve_checkpoint_source(str(runs / "evaluate"), "best")
    *_, before = checkpointing.restore_denoiser(source, ComputeConfig(), mesh)

    moved = tmp_path / "other-bucket" / "runs"
    shutil.copytree(runs, moved)
    shutil.rmtree(runs)
    source = checkpointing.resolve_checkpoint_source(str(moved / "evaluate"), "best")
    assert source.train.uri == str(moved / "train")
    *_, after = checkpointing.restore_denoiser(source, ComputeConfig(), mesh)
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
