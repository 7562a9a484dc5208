"""A small train split held on the devices (``input.in_memory_max_mib``): the batch order, its
independence from the mesh, resumption, and the switch between it and tf.data."""

from __future__ import annotations

import logging
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxcore import sharding
from jaxcore.artifacts import open_artifact
from jaxcore.config import load_config
from stages.common import data, records
from stages.train import loop
from stages.train.config import TrainConfig
from tests.support.convert_artifacts import TinyDataConfig, write_convert_artifact
from tests.support.wan_variants import write_one_layer_wan_yaml

REPO = Path(__file__).resolve().parents[2]
TRAIN_YML = REPO / "configs" / "stages" / "train.yml"
RECORDS = 20  # not a multiple of the batches below: steps straddle epochs


@pytest.fixture(scope="module")
def small_data(tmp_path_factory) -> str:
    uri = str(tmp_path_factory.mktemp("data") / "convert")
    write_convert_artifact(uri, TinyDataConfig(train_records=RECORDS, eval_records=6))
    return uri


@pytest.fixture(scope="module")
def spec(small_data) -> data.DataSpec:
    return data.split_spec(open_artifact(small_data, "convert"), "train")


@pytest.fixture(scope="module")
def arrays(spec) -> dict[str, np.ndarray]:
    return data.load_split(spec)


def _mesh(devices: int):
    return sharding.make_mesh(sharding.MeshConfig(), devices=jax.devices()[:devices])


def test_load_split_reads_every_record_once(spec, arrays):
    """The same records tf.data streams (compared by value, as a set of rows), once each."""
    assert set(arrays) == set(spec.tensor_names)
    assert len(arrays[records.LATENTS]) == spec.records == RECORDS
    streamed = next(
        data.iterate_numpy(
            spec,
            data.tf_dataset(
                spec, 64, seed=0, start_step=0, shuffle_buffer=1, prefetch=1, repeat=False
            ),
        )
    )
    key = lambda a: [row.tobytes() for row in a]  # noqa: E731
    assert sorted(key(arrays[records.LATENTS])) == sorted(key(streamed[records.LATENTS]))
    assert data.split_mib(spec) == pytest.approx(
        RECORDS * sum(4 * np.prod(f.shape) for f in spec.features) / 2**20
    )


def test_each_epoch_is_a_permutation_reshuffled_per_epoch(arrays):
    batches = data.DeviceBatches(arrays, _mesh(1), 8, seed=3, start_step=0)
    flat = np.concatenate([batches.rows(s) for s in range(5)])  # 40 rows = 2 epochs
    first, second = flat[:RECORDS], flat[RECORDS:]
    assert sorted(first) == sorted(second) == list(range(RECORDS))
    assert list(first) != list(second)
    other = data.DeviceBatches(arrays, _mesh(1), 8, seed=4, start_step=0)
    assert list(other.rows(0)) != list(batches.rows(0))


def test_batches_equal_the_records_and_do_not_depend_on_the_mesh_or_the_start(arrays):
    """Step k of a run started at 0 on one device equals step k of a run started at k on 8
    devices (sharded over the batch), and holds exactly the records its rows name."""
    one = data.DeviceBatches(arrays, _mesh(1), 8, seed=0, start_step=0)
    straight = [next(one) for _ in range(6)]
    eight = data.DeviceBatches(arrays, _mesh(8), 8, seed=0, start_step=3)
    for step in range(3, 6):
        batch = next(eight)
        rows = one.rows(step)
        for name, value in batch.items():
            assert value.sharding.spec[0] is not None  # sharded over the batch axes
            np.testing.assert_array_equal(np.asarray(value), arrays[name][rows])
            np.testing.assert_array_equal(np.asarray(value), np.asarray(straight[step][name]))


def _config(out, data_uri, model_yaml, *overrides) -> TrainConfig:
    return load_config(
        TrainConfig,
        TRAIN_YML,
        [
            f"output_dir={out}",
            f"data={data_uri}",
            f"model.model_config={model_yaml}",
            "checkpoint_every=3",
            "enable_async_checkpointing=false",
            "per_device_batch_size=1",  # 8 rows on 8 devices: steps straddle the 20-record epochs
            *overrides,
        ],
    )


def _train(config: TrainConfig, out: Path, data_uri: str):
    return loop.train(config, str(out), open_artifact(data_uri, "convert"))


def _losses(out: Path) -> dict[int, float]:
    import json

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def test_train_holds_a_small_split_in_memory_and_resumes_exactly(small_data, tmp_path, caplog):
    """A run of 6 steps equals one stopped after 3 and resumed; both say the split is held in
    memory. The same run through tf.data (``in_memory_max_mib=0``) trains too (another order:
    a different loss at some step, the same number of steps)."""
    (tmp_path / "model").mkdir()
    model_yaml = write_one_layer_wan_yaml(tmp_path / "model")
    common = ("log_every=1", "ici_data_parallelism=-1")
    with caplog.at_level(logging.INFO, logger="stages.train.loop"):
        _train(
            _config(tmp_path / "straight", small_data, model_yaml, "max_train_steps=6", *common),
            tmp_path / "straight",
            small_data,
        )
    assert "held in memory" in caplog.text
    _train(
        _config(tmp_path / "resumed", small_data, model_yaml, "max_train_steps=3", *common),
        tmp_path / "resumed",
        small_data,
    )
    _train(
        _config(tmp_path / "resumed", small_data, model_yaml, "max_train_steps=6", *common),
        tmp_path / "resumed",
        small_data,
    )
    straight, resumed = _losses(tmp_path / "straight"), _losses(tmp_path / "resumed")
    assert sorted(straight) == sorted(resumed) == list(range(1, 7))
    for step in range(1, 7):
        assert resumed[step] == pytest.approx(straight[step], rel=1e-6, abs=1e-7), step
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="stages.train.loop"):
        streamed = tmp_path / "streamed"
        _train(
            _config(
                streamed,
                small_data,
                model_yaml,
                "max_train_steps=6",
                "input.in_memory_max_mib=0",
                *common,
            ),
            streamed,
            small_data,
        )
    assert "held in memory" not in caplog.text
    tf_losses = _losses(streamed)
    assert sorted(tf_losses) == list(range(1, 7))
    assert any(tf_losses[s] != pytest.approx(straight[s], rel=1e-6) for s in range(2, 7))


def test_negative_in_memory_limit_is_refused(tmp_path):
    with pytest.raises(ValueError, match="in_memory_max_mib must be >= 0"):
        load_config(
            TrainConfig, TRAIN_YML, [f"output_dir={tmp_path}", "input.in_memory_max_mib=-1"]
        )
