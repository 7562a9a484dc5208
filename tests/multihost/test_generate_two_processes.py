"""Multi-host rendering with real processes: 2 processes x 4 CPU devices render disjoint
shares of one prompt file into one output, equal to a 1-process x 8-device run; the
manifest is written once, by process 0."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from tests.multihost.test_train_two_processes import REPO, _env, _free_port


@pytest.fixture(scope="module")
def pipeline_dir(tmp_path_factory):
    from pipelines.embedded.tiny import build_tiny_wan_pipeline

    return build_tiny_wan_pipeline(tmp_path_factory.mktemp("wan"))


def _argv(model, prompts, out):
    return [
        sys.executable,
        "-m",
        "pipelines.cli",
        "generate",
        str(REPO / "configs/stages/generate.yml"),
        f"pretrained_model_name_or_path={model}",
        f"prompt_file={prompts}",
        f"output_dir={out}",
        "num_inference_steps=2",
        "height=16",
        "width=16",
        "num_frames=1",
        "max_sequence_length=16",
        "save_arrays=true",
        "-q",
    ]


def _run(argv, processes: int) -> None:
    import subprocess

    port = _free_port()
    devices = 8 // processes
    procs = []
    for i in range(processes):
        extra = {}
        if processes > 1:
            extra = dict(
                JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                JAX_NUM_PROCESSES=str(processes),
                JAX_PROCESS_ID=str(i),
            )
        procs.append(
            subprocess.Popen(
                argv, cwd=REPO, env=_env(devices, **extra), stderr=subprocess.PIPE, text=True
            )
        )
    errors = [p.communicate(timeout=900)[1] for p in procs]
    for proc, err in zip(procs, errors, strict=True):
        assert proc.returncode == 0, err[-3000:]


def test_two_processes_render_what_one_renders(pipeline_dir, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("\n".join(f"a red shape number {i}" for i in range(12)) + "\n")
    one, two = tmp_path / "one", tmp_path / "two"
    _run(_argv(pipeline_dir, prompts, one), 1)
    _run(_argv(pipeline_dir, prompts, two), 2)
    records = [json.loads(p.read_text()) for p in (two / "records").glob("*.json")]
    # disjoint shares: each prompt rendered once, both processes rendered (batches of 8 rows,
    # rows 0-3 on process 0 and 4-7 on process 1: 8 + 4 prompts)
    assert len({r["name"] for r in records}) == len(records) == 12
    assert sorted(r["process_index"] for r in records) == [0] * 8 + [1] * 4
    manifest = json.loads((two / "manifest.json").read_text())
    assert manifest["summary"]["num_prompts"] == 12
    names = sorted(p.name for p in (one / "outputs").glob("*.npy"))
    assert len(names) == 12 and names == sorted(p.name for p in (two / "outputs").glob("*.npy"))
    for name in names:
        np.testing.assert_allclose(
            np.load(two / "outputs" / name), np.load(one / "outputs" / name), atol=1e-5, rtol=0
        )


@pytest.mark.slow
def test_a_killed_two_process_job_reruns_only_the_missing_prompts(pipeline_dir, tmp_path):
    """Both processes SIGKILLed mid-run (a JobSet restarts all of its pods): no manifest, every
    visible output complete; the rerun renders only what is missing, one manifest."""
    import signal
    import subprocess
    import time

    prompts = tmp_path / "p.txt"
    prompts.write_text("\n".join(f"a blue shape number {i}" for i in range(64)) + "\n")
    out = tmp_path / "job"
    argv = _argv(pipeline_dir, prompts, out)
    port = _free_port()
    env = [
        _env(
            4,
            JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
            JAX_NUM_PROCESSES="2",
            JAX_PROCESS_ID=str(i),
        )
        for i in range(2)
    ]
    procs = [subprocess.Popen(argv, cwd=REPO, env=e, stderr=subprocess.DEVNULL) for e in env]
    records = out / "records"
    deadline = time.monotonic() + 600
    while not (records.is_dir() and len(list(records.glob("*.json"))) >= 8):
        assert all(p.poll() is None for p in procs), "a process ended before the kill"
        assert time.monotonic() < deadline
        time.sleep(0.2)
    for proc in procs:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    done_before = len(list(records.glob("*.json")))
    assert done_before < 64 and not (out / "manifest.json").exists()
    _run(argv, 2)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["summary"]["rendered_this_run"] == 64 - done_before
    assert manifest["summary"]["reused"] == done_before
