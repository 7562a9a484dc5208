"""Faults on purpose, counted: seeded faults at random points of a stage's run (convert,
train, evaluate, generate, a ``difforge run`` chain), on a local folder and on gs:// (the local
GCS server), each followed by what an operator does (rerun).

Kinds (points are the stage's storage writes, chosen by the seed):
- ``crash``: the process dies at that write (an exception no handler catches, raised in
  place of the write: nothing after it runs; the stage's own ``finally`` blocks do, which a
  kill -9 would not run: the kill -9 tests of each stage are in the slow tier beside this);
- ``sigterm``: SIGTERM arrives there (the stage stops cleanly, exit 75);
- ``disk_full``: the write fails with ENOSPC (local folders);
- ``transient``: the GCS server answers 429/503, loses the answer after doing the work, or
  drops the connection, 1-3 times, for reads, writes, composes, listings or metadata;
- ``permanent``: GCS refuses every write from there on (403);
- ``corrupt_input``: an input file is damaged (a prompt file line, a truncated weights file).

Counted: faults injected; runs that left an artifact that looks complete but is not (must be
0); prompts lost or duplicated (must be 0); resumed runs whose outputs are byte-identical to
an uninterrupted run's. ``make test-faults`` prints the counts.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import random
import shutil
import signal
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxcore import artifacts, storage
from jaxcore.compute import ComputeConfig
from jaxcore.sharding import make_mesh
from pipelines import cli
from pipelines.embedded.tiny import build_tiny_wan_pipeline
from stages.common import checkpoints as checkpointing
from stages.common.preemption import Preemption
from tests.support import gcs_faults
from tests.support.convert_artifacts import TinyDataConfig, write_convert_artifact
from tests.support.wan_variants import write_one_layer_wan_yaml

pytestmark = [pytest.mark.slow, pytest.mark.faults]

REPO = Path(__file__).resolve().parents[2]
SEED = 20261207
# faults per stage and backend; DIFFORGE_FAULTS_SCALE=0.1 for a quick look
_SCALE = float(os.environ.get("DIFFORGE_FAULTS_SCALE", "1"))
FAULTS = {
    k: max(1, round(v * _SCALE))
    for k, v in {"generate": 70, "train": 25, "evaluate": 15, "convert": 10, "run": 4}.items()
}
PROMPTS = [{"id": f"p{i}", "prompt": f"a red circle {i}", "seed": i} for i in range(5)]
COUNTS: Counter = Counter()
MUTATIONS = ("write_bytes", "upload_file", "create_exclusive", "append_text", "delete")


class InjectedCrash(BaseException):
    """The process 'dies' here (BaseException: no ``except Exception`` in the stage stops it)."""


class Injector:
    """Wraps the storage writes; counts them, and at the ``at``-th does the fault."""

    def __init__(self, monkeypatch, kind: str | None = None, at: int = 0):
        self.kind, self.at, self.calls, self.fired, self.missed = kind, at, 0, False, False
        for name in MUTATIONS:
            monkeypatch.setattr(storage, name, self._wrap(getattr(storage, name)))

    def _wrap(self, original):
        def wrapper(*args, **kwargs):
            self.calls += 1
            if self.kind and self.calls >= self.at and not self.fired and not self.missed:
                self.fired = True
                self._fire(args)
                self.missed = not self.fired
            return original(*args, **kwargs)

        return wrapper

    def _fire(self, args) -> None:
        if self.kind == "crash":
            raise InjectedCrash
        if self.kind == "disk_full":
            raise OSError(errno.ENOSPC, "No space left on device", str(args[0]))
        if self.kind == "sigterm":
            handler = signal.getsignal(signal.SIGTERM)
            if isinstance(getattr(handler, "__self__", None), Preemption):
                os.kill(os.getpid(), signal.SIGTERM)
            else:  # outside the stage's SIGTERM handling this test process would die
                self.fired = False


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    for stage in sorted({k.split(":")[1] for k in COUNTS if k.startswith("injected:")}):
        kinds = ", ".join(
            f"{k.split(':')[2]} {v}"
            for k, v in sorted(COUNTS.items())
            if k.startswith(f"kind:{stage}:")
        )
        print(
            f"\nfault injection, {stage}: {COUNTS[f'injected:{stage}']} faults ({kinds}); "
            f"artifacts that looked complete but were not: {COUNTS[f'silent:{stage}']}; "
            f"items lost or duplicated: {COUNTS[f'lost:{stage}']}; resumed runs identical to an "
            f"uninterrupted run: {COUNTS[f'identical:{stage}']}/{COUNTS[f'resumed:{stage}']}"
        )
    total = sum(v for k, v in COUNTS.items() if k.startswith("injected:"))
    print(f"fault injection, all stages: {total} faults")


@dataclasses.dataclass
class Stage:
    """One stage under faults: ``call(out, broken)`` runs it (``broken``: with a damaged
    input), ``outputs(out)`` opens its artifact, checks it and returns what an uninterrupted
    run must equal (raising ArtifactError when it is not complete), ``corrupt(rng)`` damages
    an input and returns how to mend it."""

    name: str
    call: Callable[[str, bool], Callable[[], int]]
    outputs: Callable[[str], dict]
    corrupt: Callable[[random.Random], Callable[[], None]] | None


def _run(call, capsys) -> int | str:
    """The run's exit code, or 'crash'; a traceback fails the test."""
    try:
        rc = call()
    except InjectedCrash:
        return "crash"
    except RuntimeError as err:  # Beam re-raises a worker's exception wrapped in its own
        if InjectedCrash.__name__ not in str(err):
            raise
        capsys.readouterr()
        return "crash"
    err = capsys.readouterr().err.strip()
    if rc == 2:
        assert len(err.splitlines()) == 1 and "error:" in err, err
    return rc


def _fault_campaign(stage: Stage, root: str, server: str | None, count: int, capsys, monkeypatch):
    """``count`` seeded faults, each in a fresh output folder, each run again until done."""
    if server:
        gcs_faults.count_requests(server)
    with monkeypatch.context() as m:  # the uninterrupted run, and how many writes it makes
        counter = Injector(m)
        assert stage.call(storage.join(root, "clean"), False)() == 0
    writes = counter.calls
    requests = {}
    if server:  # and how many GCS requests of each kind: transient faults land among them
        requests = {k: n for k, n in gcs_faults.requests_seen(server).items() if n}
        gcs_faults.arm(server)
    reference = stage.outputs(storage.join(root, "clean"))
    kinds = ["crash", "crash", "sigterm"] + (["corrupt_input"] if stage.corrupt else [])
    kinds += ["transient", "transient", "permanent"] if server else ["disk_full"]
    rng = random.Random(f"{SEED}-{stage.name}-{bool(server)}")
    differing = []
    for case in range(count):
        kind = rng.choice(kinds)
        out = storage.join(root, f"run{case}")
        broken = False
        with monkeypatch.context() as m:
            if kind in ("crash", "sigterm", "disk_full"):
                injector = Injector(m, kind, rng.randint(1, writes))
                rc = _run(stage.call(out, False), capsys)
                injected = injector.fired
                expected = {"crash": ("crash",), "sigterm": (75, 0), "disk_full": (2,)}[kind]
            elif kind in ("transient", "permanent"):
                op = rng.choice(sorted(requests))
                if kind == "transient":
                    mode = rng.choice(
                        [
                            {"status": 503},
                            {"status": 429},
                            {"status": 503, "mode": "after"},
                            {"mode": "drop"},
                        ]
                    )
                    nth = rng.randint(1, requests[op])
                    rule = {"op": op, "nth": nth, "count": rng.randint(1, 3), **mode}
                else:
                    rule = {
                        "op": "write",
                        "nth": rng.randint(1, writes),
                        "count": 10**9,
                        "status": 403,
                    }
                gcs_faults.arm(server, rule)
                try:
                    rc = _run(stage.call(out, False), capsys)
                    injected = gcs_faults.injected(server) > 0
                finally:
                    gcs_faults.arm(server)
                expected = (0,) if kind == "transient" else (2, 0)
            else:
                mend = stage.corrupt(rng)
                broken = True
                try:
                    rc = _run(stage.call(out, True), capsys)
                finally:
                    mend()
                injected, expected = True, (2,)
        if not injected:
            continue
        COUNTS[f"injected:{stage.name}"] += 1
        COUNTS[f"kind:{stage.name}:{kind}"] += 1
        assert rc in expected, f"{stage.name} case {case} ({kind}): exit {rc}, expected {expected}"
        if artifacts.read_manifest(out) is not None:  # it says finished: it must be right
            try:
                if stage.outputs(out) != reference:
                    COUNTS[f"silent:{stage.name}"] += 1
            except (artifacts.ArtifactError, LostOrDuplicated):
                COUNTS[f"silent:{stage.name}"] += 1
        if rc != 0 or broken:  # the operator reruns it
            rerun = _run(stage.call(out, False), capsys)
            assert rerun == 0, f"{stage.name} case {case} ({kind}): the rerun exited {rerun}"
        COUNTS[f"resumed:{stage.name}"] += 1
        try:
            got = stage.outputs(out)
        except LostOrDuplicated as err:
            COUNTS[f"lost:{stage.name}"] += 1
            differing.append(f"case {case} ({kind}, exit {rc}): lost or duplicated: {err}")
            continue
        if got == reference:
            COUNTS[f"identical:{stage.name}"] += 1
        else:
            differing.append(
                f"case {case} ({kind}, exit {rc}): {sorted(k for k in got if got[k] != reference.get(k))}"
            )
    assert not differing, differing
    assert COUNTS[f"silent:{stage.name}"] == 0 and COUNTS[f"lost:{stage.name}"] == 0


class LostOrDuplicated(AssertionError):
    """A finished artifact whose items (prompts, steps, checkpoints) are not each there once."""


def _root(backend: str, tmp_path: Path, request) -> tuple[str, str | None]:
    if backend == "local":
        return str(tmp_path / "root"), None
    return request.getfixturevalue("gcs_root"), request.getfixturevalue("gcs_server")


# --- generate ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return build_tiny_wan_pipeline(tmp_path_factory.mktemp("faults_wan"), seed=5)


def _generate_stage(root: str, tiny_dir: Path, broken_dir: Path) -> Stage:
    prompts = storage.join(root, "in/prompts.jsonl")
    good = "".join(json.dumps(p) + "\n" for p in PROMPTS)
    storage.write_text(prompts, good)

    def call(out: str, broken: bool):
        model = broken_dir if broken and broken_dir.exists() else tiny_dir
        return lambda: cli.main(
            [
                "generate",
                str(REPO / "configs/stages/generate.yml"),
                f"pretrained_model_name_or_path={model}",
                f"prompt_file={prompts}",
                f"output_dir={out}",
                "num_inference_steps=2",
                "height=16",
                "width=16",
                "num_frames=1",
                "per_device_batch_size=0.25",  # 2 prompts a batch over 8 devices: 3 batches
                "save_arrays=true",
                "-q",
            ]
        )

    def outputs(out: str) -> dict:
        manifest = artifacts.open_artifact(out, "generate")
        artifacts.verify(manifest, checksums=True)
        ids = [entry["id"] for entry in manifest.summary["prompts"]]
        if sorted(ids) != sorted(p["id"] for p in PROMPTS):
            raise LostOrDuplicated(ids)
        return {
            entry["id"]: storage.read_bytes(storage.join(out, f"outputs/{entry['name']}.npy"))
            for entry in manifest.summary["prompts"]
        }

    def corrupt(rng: random.Random):
        shutil.rmtree(broken_dir, ignore_errors=True)
        if rng.random() < 0.5:
            storage.write_text(prompts, good + '{"prompt": "x", "seed": -4}\n')
        else:  # the weights cut short
            shutil.copytree(tiny_dir, broken_dir)
            weights_file = next(broken_dir.glob("transformer/*.safetensors"))
            weights_file.write_bytes(weights_file.read_bytes()[: -rng.randint(1, 4000)])
        return lambda: (
            storage.write_text(prompts, good),
            shutil.rmtree(broken_dir, ignore_errors=True),
        )

    return Stage("generate", call, outputs, corrupt)


@pytest.mark.parametrize("backend", ["local", "gcs"])
def test_generate_survives_faults(backend, tiny_dir, tmp_path, capsys, monkeypatch, request):
    root, server = _root(backend, tmp_path, request)
    stage = _generate_stage(root, tiny_dir, tmp_path / "broken_model")
    _fault_campaign(stage, root, server, FAULTS["generate"], capsys, monkeypatch)


# --- train and evaluate ------------------------------------------------------------------


@pytest.fixture(scope="module")
def one_layer_model(tmp_path_factory) -> str:
    return write_one_layer_wan_yaml(tmp_path_factory.mktemp("faults_model"))


def _flip_a_shard_byte(data: str, rng: random.Random):
    manifest = artifacts.read_manifest(data)
    shard = storage.join(data, rng.choice(manifest.file_paths(suffix=".tfrecord")))
    raw = storage.read_bytes(shard)
    i = rng.randrange(len(raw))
    storage.write_bytes(shard, raw[:i] + bytes([raw[i] ^ 0x5A]) + raw[i + 1 :])
    return lambda: storage.write_bytes(shard, raw)


def _train_stage(root: str, model_yaml: str) -> Stage:
    data = storage.join(root, "data")
    write_convert_artifact(data, TinyDataConfig(train_records=16, eval_records=6))

    def call(out: str, broken: bool):
        return lambda: cli.main(
            [
                "train",
                str(REPO / "configs/stages/train.yml"),
                f"data={data}",
                f"output_dir={out}",
                "dataset_type=tfrecord",
                f"model.model_config={model_yaml}",
                "max_train_steps=6",
                "checkpoint_every=2",
                "max_to_keep=5",
                "eval_every=0",
                "-q",
            ]
        )

    def outputs(out: str) -> dict:
        manifest = artifacts.open_artifact(out, "train")
        artifacts.verify(manifest)
        rows = [
            json.loads(line)
            for line in storage.read_text(storage.join(out, "metrics.jsonl")).splitlines()
            if line.strip()
        ]
        steps = [row["step"] for row in rows if "loss" in row]
        kept = manifest.summary["checkpoints"]  # a SIGTERM adds one at the step it came
        if steps != list(range(1, 7)) or not {2, 4, 6} <= set(kept) or len(set(kept)) != len(kept):
            raise LostOrDuplicated((steps, kept))
        mesh = make_mesh(devices=jax.devices()[:1])
        source = checkpointing.resolve_checkpoint_source(out, "final")
        *_, params = checkpointing.restore_denoiser(source, ComputeConfig(), mesh)
        leaves = jax.tree_util.tree_leaves_with_path(params)
        return {
            "losses": [row["loss"] for row in rows if "loss" in row],
            **{jax.tree_util.keystr(k): np.asarray(v).tobytes() for k, v in leaves},
        }

    return Stage("train", call, outputs, lambda rng: _flip_a_shard_byte(data, rng))


@pytest.mark.parametrize("backend", ["local", "gcs"])
def test_train_survives_faults(backend, one_layer_model, tmp_path, capsys, monkeypatch, request):
    root, server = _root(backend, tmp_path, request)
    stage = _train_stage(root, one_layer_model)
    _fault_campaign(stage, root, server, FAULTS["train"], capsys, monkeypatch)


def _evaluate_stage(root: str, model_yaml: str, capsys) -> Stage:
    train = _train_stage(root, model_yaml)
    checkpoints = storage.join(root, "trained")
    assert train.call(checkpoints, False)() == 0
    capsys.readouterr()
    data = storage.join(root, "data")

    def call(out: str, broken: bool):
        return lambda: cli.main(
            [
                "evaluate",
                str(REPO / "configs/stages/evaluate.yml"),
                f"checkpoints={checkpoints}",
                f"data={data}",
                f"output_dir={out}",
                "-q",
            ]
        )

    def outputs(out: str) -> dict:
        manifest = artifacts.open_artifact(out, "evaluate")
        artifacts.verify(manifest)
        losses = manifest.summary["eval_loss"]
        if sorted(losses) != ["2", "4", "6"]:
            raise LostOrDuplicated(losses)
        metrics = storage.read_text(storage.join(out, "metrics.json"))
        return {"eval_loss": losses, "metrics": metrics}

    return Stage("evaluate", call, outputs, lambda rng: _flip_a_shard_byte(data, rng))


@pytest.mark.parametrize("backend", ["local", "gcs"])
def test_evaluate_survives_faults(backend, one_layer_model, tmp_path, capsys, monkeypatch, request):
    root, server = _root(backend, tmp_path, request)
    stage = _evaluate_stage(root, one_layer_model, capsys)
    _fault_campaign(stage, root, server, FAULTS["evaluate"], capsys, monkeypatch)


# --- convert --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def encoder_dir(tmp_path_factory) -> Path:
    from tests.stages.test_convert_pipeline import _write_encoder_pipeline

    return _write_encoder_pipeline(tmp_path_factory.mktemp("faults_encoders"))


def _convert_stage(root: str, encoder_dir: Path, tmp_path: Path) -> Stage:
    from tests.stages.test_convert_elements import _plain_imagefolder
    from tests.stages.test_convert_pipeline import CONFIG, _overrides

    names = [f"img{i:02d}.png" for i in range(10)]
    folder = _plain_imagefolder(tmp_path / "images", names)
    metadata = folder / "metadata.jsonl"
    good = metadata.read_text()

    def call(out: str, broken: bool):
        return lambda: cli.main(["convert", CONFIG, *_overrides(folder, encoder_dir, out), "-q"])

    def outputs(out: str) -> dict:
        manifest = artifacts.open_artifact(out, "convert")
        artifacts.verify(manifest, checksums=True)
        ids = [
            json.loads(line)["id"]
            for line in storage.read_text(
                storage.join(out, manifest.summary["ids_file"])
            ).splitlines()
            if line.strip()
        ]
        if len(ids) != len(names) or len(set(ids)) != len(ids):
            raise LostOrDuplicated(ids)
        return {
            path: storage.read_bytes(storage.join(out, path))
            for path in manifest.file_paths(suffix=".tfrecord")
        }

    def corrupt(rng: random.Random):
        metadata.write_text(good + '{"file_name": "img00.png", "text": 3}\n{"broken\n')
        return lambda: metadata.write_text(good)

    return Stage("convert", call, outputs, corrupt)


@pytest.mark.parametrize("backend", ["local", "gcs"])
def test_convert_survives_faults(backend, encoder_dir, tmp_path, capsys, monkeypatch, request):
    root, server = _root(backend, tmp_path, request)
    stage = _convert_stage(root, encoder_dir, tmp_path)
    _fault_campaign(stage, root, server, FAULTS["convert"], capsys, monkeypatch)


# --- a chain (difforge run) -----------------------------------------------------------------


def _chain_stage(root: str) -> Stage:
    """configs/pipelines/two_stage.yml: two converts, two trainings, two evaluations, a render."""
    pipeline = str(REPO / "configs/pipelines/two_stage.yml")

    def call(out: str, broken: bool):
        return lambda: cli.main(["run", pipeline, f"root={out}", "-q"])

    def outputs(out: str) -> dict:
        chain = artifacts.open_artifact(storage.join(out, "pipeline"), "pipeline")
        names = [step["name"] for step in chain.summary["steps"]]
        if len(names) != 7 or len(set(names)) != 7:
            raise LostOrDuplicated(names)
        render = artifacts.open_artifact(storage.join(out, "render"), "generate")
        artifacts.verify(render, checksums=True)
        pngs = render.file_paths("outputs/", ".png")
        if len(pngs) != 4:
            raise LostOrDuplicated(pngs)
        evaluation = artifacts.open_artifact(storage.join(out, "eval_high"), "evaluate")
        return {
            "eval_high": evaluation.summary["eval_loss"],
            **{p: storage.read_bytes(storage.join(out, "render", p)) for p in pngs},
        }

    return Stage("run", call, outputs, None)  # its inputs are each stage's, damaged above


@pytest.mark.parametrize("backend", ["local", "gcs"])
def test_a_chain_survives_faults(backend, tmp_path, capsys, monkeypatch, request):
    monkeypatch.chdir(REPO)
    root, server = _root(backend, tmp_path, request)
    _fault_campaign(_chain_stage(root), root, server, FAULTS["run"], capsys, monkeypatch)
