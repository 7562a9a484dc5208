"""metrics.jsonl is appended, not rewritten (progress lines: test_train end to end)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jaxcore import storage
from stages.train import metrics


def _row(step: int) -> dict:
    return {"step": step, "loss": 1.0 / step}


def _steps(uri: str) -> list[int]:
    return [json.loads(line)["step"] for line in storage.read_text(uri).splitlines()]


def test_flush_appends_only_new_rows(any_root, tmp_path, monkeypatch):
    """After the first flush, no flush sends the history again (a 50k-step run once rewrote
    13 MB per flush); a resume keeps the rows up to its step and drops later ones once."""
    log = metrics.MetricsLog(any_root, tmp_path / "local")
    for step in (1, 2, 3):
        log.rows.append(_row(step))
    log.flush()
    sent = []
    real_append = storage.append_text
    monkeypatch.setattr(storage, "write_text", lambda *a: pytest.fail("metrics were rewritten"))
    monkeypatch.setattr(storage, "append_text", lambda u, t: (sent.append(t), real_append(u, t)))
    for step in (4, 5):
        log.rows.append(_row(step))
    log.flush()
    log.flush()  # nothing new: nothing sent
    assert [len(t.splitlines()) for t in sent if t] == [2]
    assert _steps(log.uri) == [1, 2, 3, 4, 5]
    monkeypatch.undo()

    resumed = metrics.MetricsLog(any_root, tmp_path / "local2")
    resumed.resume_from(3)  # the checkpoint was at step 3; steps 4-5 are redone
    assert [r["step"] for r in resumed.rows] == [1, 2, 3]
    resumed.rows.append(_row(4))
    resumed.flush()
    assert _steps(resumed.uri) == [1, 2, 3, 4]


def test_a_torn_last_line_is_skipped_and_replaced(tmp_path):
    root = tmp_path / "run"
    root.mkdir()
    (root / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "lo')
    log = metrics.MetricsLog(str(root), tmp_path / "local")
    log.resume_from(2)
    assert [r["step"] for r in log.rows] == [1]
    log.rows.append(_row(2))
    log.flush()
    assert _steps(str(root / "metrics.jsonl")) == [1, 2]


def test_appends_to_a_gcs_object_compose_server_side(gcs_root):
    uri = f"{gcs_root}/m.jsonl"
    for i in range(3):
        storage.append_text(uri, f"line {i}\n")
    assert storage.read_text(uri) == "line 0\nline 1\nline 2\n"
    assert [f.path for f in storage.list_files(gcs_root)] == ["m.jsonl"]  # no parts left


def test_data_streams_split_over_hosts_without_changing_the_batches(monkeypatch):
    """Stream k reads shards k, k + S, ...; host p of P serves S / P consecutive streams."""
    import jax

    from stages.common import data
    from stages.common.errors import StageInputError

    shards = tuple(f"/d/train-{i}.tfrecord" for i in range(6))
    monkeypatch.setattr(storage, "local_copy", lambda uri: Path(uri))
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    assert data.stream_shards(shards, 2) == [
        ["/d/train-1.tfrecord", "/d/train-3.tfrecord", "/d/train-5.tfrecord"]
    ]
    assert [s[0] for s in data.stream_shards(shards, 6)] == [
        f"/d/train-{i}.tfrecord" for i in (3, 4, 5)
    ]
    with pytest.raises(StageInputError, match="data_streams=3 does not split over 2 hosts"):
        data.stream_shards(shards, 3)
    with pytest.raises(StageInputError, match="6 shard files cannot feed 8 data streams"):
        data.stream_shards(shards, 8)


def test_the_readme_fine_tune_command_works_with_the_shipped_yaml():
    """The YAML picks model_config and synthetic data; `data=... pretrained_model_name_or_path=
    ...` on the command line means records and that model (two sources there still clash)."""
    from jaxcore.config import ConfigError, load_config
    from stages.train.config import TrainConfig

    yml = Path(__file__).resolve().parents[2] / "configs/stages/train.yml"
    config = load_config(
        TrainConfig, yml, ["data=/d", "pretrained_model_name_or_path=/p", "output_dir=/o"]
    )
    assert config.input.dataset_type == "tfrecord" and config.data == "/d"
    assert config.model.pretrained_model_name_or_path == "/p"
    assert config.model.model_config is None and config.model.init_from is None
    kept = load_config(TrainConfig, yml, ["data=/d", "dataset_type=synthetic", "output_dir=/o"])
    assert kept.input.dataset_type == "synthetic"
    assert kept.model.model_config == "configs/models/wan_tiny.yml"  # the YAML's source
    with pytest.raises((ConfigError, ValueError), match="set exactly one of"):
        load_config(
            TrainConfig,
            yml,
            ["pretrained_model_name_or_path=/p", "model_config=x.yml", "output_dir=/o"],
        )
