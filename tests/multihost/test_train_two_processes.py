"""Multi-host training, proven with real processes on this machine: 2 processes x 4 CPU
devices (jax.distributed on a localhost coordinator, gloo collectives) train exactly as
1 process x 8 devices does on the same global batch, and a 2-process checkpoint resumes on 1.

By hand (what the test runs), in two shells::

    export XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu \\
        JAX_COORDINATOR_ADDRESS=127.0.0.1:12355 JAX_NUM_PROCESSES=2
    JAX_PROCESS_ID=0 difforge train configs/stages/train.yml data=... input.data_streams=2 ...
    JAX_PROCESS_ID=1 difforge train configs/stages/train.yml data=... input.data_streams=2 ...
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.support.convert_artifacts import TinyDataConfig, write_convert_artifact
from tests.support.wan_variants import write_one_layer_wan_yaml

REPO = Path(__file__).resolve().parents[2]
TRAIN_YML = REPO / "configs" / "stages" / "train.yml"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("multihost")
    data = str(root / "data")
    write_convert_artifact(data, TinyDataConfig(shards_per_split=4))
    return data, write_one_layer_wan_yaml(root)


def _argv(data, model, out, steps, *extra):
    return [
        sys.executable,
        "-m",
        "pipelines.cli",
        "train",
        str(TRAIN_YML),
        f"data={data}",
        f"output_dir={out}",
        "dataset_type=tfrecord",
        f"model.model_config={model}",
        f"max_train_steps={steps}",
        "checkpoint_every=3",
        "input.data_streams=2",
        "per_device_batch_size=1",
        "ici_fsdp_parallelism=2",  # parameters split across the two processes' devices
        "enable_async_checkpointing=false",
        "export_diffusers=true",
        "-q",
        *extra,
    ]


def _env(devices: int, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    env.update(
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} --xla_backend_optimization_level=0",
        JAX_PLATFORMS="cpu",
    )
    env.update(extra)
    return env


def _one_process(argv) -> None:
    subprocess.run(argv, cwd=REPO, env=_env(8), check=True, timeout=900)


def _two_processes(argv) -> None:
    port = _free_port()
    procs = [
        subprocess.Popen(
            argv,
            cwd=REPO,
            env=_env(
                4,
                JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                JAX_NUM_PROCESSES="2",
                JAX_PROCESS_ID=str(i),
            ),
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    errors = [p.communicate(timeout=900)[1] for p in procs]
    for proc, err in zip(procs, errors, strict=True):
        assert proc.returncode == 0, err[-3000:]


def _losses(out: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


def _weights(out: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(out / "transformer" / "diffusion_pytorch_model.safetensors")


def _close(a: dict, b: dict, atol: float) -> None:
    assert sorted(a) == sorted(b)
    for key in a:
        np.testing.assert_allclose(a[key], b[key], atol=atol, rtol=0, err_msg=str(key))


@pytest.fixture(scope="module")
def reference(setup, tmp_path_factory):
    data, model = setup
    out = tmp_path_factory.mktemp("ref") / "train"
    _one_process(_argv(data, model, out, 6))
    return out


@pytest.mark.slow  # ~80 s with its setup; the default tier keeps the 2-process generate test
def test_two_processes_equal_one(setup, reference, tmp_path):
    data, model = setup
    out = tmp_path / "train"
    _two_processes(_argv(data, model, out, 6))
    manifest = json.loads((out / "manifest.json").read_text())  # committed by process 0
    assert manifest["summary"]["process_count"] == 2
    ref_losses, losses = _losses(reference), _losses(out)
    assert sorted(losses) == list(range(1, 7))  # one row per step: process 0 writes
    _close(losses, ref_losses, 1e-5)
    _close(_weights(out), _weights(reference), 5e-5)


@pytest.mark.slow
def test_a_two_process_checkpoint_resumes_on_one_process(setup, reference, tmp_path):
    data, model = setup
    out = tmp_path / "train"
    _two_processes(_argv(data, model, out, 3))
    assert sorted(int(p.name) for p in (out / "checkpoints").iterdir()) == [3]
    _one_process([*_argv(data, model, out, 6), "--force"])  # same output: resumes at 3
    _close(_losses(out), _losses(reference), 1e-5)
    _close(_weights(out), _weights(reference), 5e-5)
