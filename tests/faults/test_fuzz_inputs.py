"""Bad input, fuzzed: seeded random mutations of prompt files, stage YAML configs,
``key=value`` overrides, a pipeline's model_index.json / config.json and LoRA files. Every case
must end in a one-line error naming the thing, or a correct run; never a traceback, never a
partial artifact. ``make test-faults`` runs it and prints the counts (docs/at-scale.md, "Faults on purpose");
``DIFFORGE_FUZZ_LOG=<file>`` also writes every case's message there.

A "correct run" is cut short where the input has been fully checked: generate up to loading the
model (prompts, overrides, YAML), up to rendering (model files), LoRA files through the
pipeline's own check of a LoRA set before rendering.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
from collections import Counter
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxcore import weights
from pipelines import cli
from pipelines.embedded.tiny import build_tiny_wan_pipeline
from stages.generate.prompts import KNOWN_FIELDS

pytestmark = [pytest.mark.slow, pytest.mark.faults]

REPO = Path(__file__).resolve().parents[2]
GENERATE_YML = REPO / "configs/stages/generate.yml"
SEED = 20261206
COUNTS: Counter = Counter()


class _Reached(Exception):
    """The input passed every check up to the point the case stops at."""


def _reach(*args, **kwargs):
    raise _Reached


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return build_tiny_wan_pipeline(tmp_path_factory.mktemp("fuzz_wan"), seed=3)


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    total = sum(v for k, v in COUNTS.items() if k[1] in ("error", "ran"))
    lines = [f"fuzzed inputs: {total}, tracebacks: {COUNTS['tracebacks']}"]
    for kind in sorted({k[0] for k in COUNTS if isinstance(k, tuple)}):
        lines.append(
            f"  {kind}: {COUNTS[(kind, 'error')]} one-line errors, {COUNTS[(kind, 'ran')]} correct runs"
        )
    print("\n" + "\n".join(lines))


def _outcome(kind: str, call, capsys, out: Path | None = None) -> str:
    """Run ``call``; 'error' (a one-line error, exit 2) or 'ran'; fail on anything else."""
    try:
        rc = call()
    except _Reached:
        rc = "reached"
    except SystemExit as err:  # argparse: its usage line and one error line, exit 2
        rc = ("argparse", err.code)
    except Exception as err:  # noqa: BLE001 (any other exception is what this test hunts)
        COUNTS["tracebacks"] += 1
        raise AssertionError(f"{kind}: a traceback: {type(err).__name__}: {err}") from err
    err_text = capsys.readouterr().err.strip()
    if os.environ.get("DIFFORGE_FUZZ_LOG"):  # every case's message, for a reader to judge
        with open(os.environ["DIFFORGE_FUZZ_LOG"], "a") as log:
            log.write(f"{kind}\t{err_text!r}\n")
    if out is not None:
        assert not (out / "manifest.json").exists() or rc in (0, "reached"), f"{kind}: partial"
    if rc in ("reached", 0):
        COUNTS[(kind, "ran")] += 1
        return "ran"
    if rc == ("argparse", 2):
        assert err_text.splitlines()[-1].startswith("difforge: error:"), err_text
        COUNTS[(kind, "error")] += 1
        return "error"
    lines = err_text.splitlines()
    assert rc == 2 and len(lines) == 1 and "error:" in lines[0], f"{kind}: rc {rc}: {err_text}"
    assert "Traceback" not in err_text
    COUNTS[(kind, "error")] += 1
    return "error"


# --- values and mutations ------------------------------------------------------------------

ODD_VALUES = [
    None,
    True,
    False,
    0,
    -1,
    1,
    7,
    2**63,
    -(2**31),
    1e309,
    -0.0,
    0.5,
    float("nan"),
    float("inf"),
    "",
    " ",
    "x",
    "16",
    "1e3",
    "\u00e9\u4e2d\U0001f600",
    "../../etc/passwd",
    "gs://",
    "gs://no-bucket-here/x.npy",
    [],
    [1],
    [1, 2],
    [1, 2, 3],
    ["a", "b"],
    {},
    {"a": 1},
    [{"path": "x.safetensors"}],
    [{"path": 3}],
    "\x00",
    "a" * 5000,
]
FIELDS = [*sorted(KNOWN_FIELDS), "colour"]  # every field a prompt line may set, and one it may not
GOOD_LINE = {"prompt": "a red circle", "height": 16, "width": 16, "num_frames": 1, "seed": 3}


def _mutate_text(rng: random.Random, text: str) -> str:
    """A byte-level edit: delete, insert, duplicate or truncate."""
    if not text:
        return rng.choice(["{", "\x00", "\n"])
    i = rng.randrange(len(text))
    op = rng.randrange(4)
    if op == 0:
        return text[:i] + text[i + 1 :]
    if op == 1:
        return text[:i] + rng.choice('{}[]":,\\\n\x00\u00e9 0-#') + text[i:]
    if op == 2:
        j = min(len(text), i + rng.randrange(1, 20))
        return text[:j] + text[i:j] + text[j:]
    return text[:i]


def _mutated_line(rng: random.Random) -> str:
    line = dict(GOOD_LINE)
    for _ in range(rng.randrange(1, 4)):
        field = rng.choice(FIELDS)
        if rng.random() < 0.2:
            line.pop(field, None)
        else:
            line[field] = rng.choice(ODD_VALUES)
    text = json.dumps(line, allow_nan=True)
    return _mutate_text(rng, text) if rng.random() < 0.3 else text


# --- the cases -----------------------------------------------------------------------------


def _generate(tiny_dir: Path, prompt_file: Path, out: Path, *extra: str):
    return lambda: cli.main(
        [
            "generate",
            str(GENERATE_YML),
            f"pretrained_model_name_or_path={tiny_dir}",
            f"prompt_file={prompt_file}",
            f"output_dir={out}",
            "num_inference_steps=2",
            "-q",
            *extra,
        ]
    )


def test_fuzzed_prompt_files(tiny_dir, tmp_path, capsys, monkeypatch):
    from stages.generate import model

    monkeypatch.setattr(model, "load", _reach)
    rng = random.Random(SEED)
    outcomes = Counter()
    for case in range(160):
        folder = tmp_path / f"p{case}"
        folder.mkdir()
        suffix = rng.choice([".jsonl", ".jsonl", ".txt"])
        if suffix == ".txt":
            lines = [
                rng.choice(["a red circle", "", "# note", "\u00e9\u4e2d", " "]) for _ in range(3)
            ]
            body = _mutate_text(rng, "\n".join(lines)).encode()
            if rng.random() < 0.2:
                body += bytes([0xFF, 0xFE, 0x80])  # not UTF-8
        else:
            lines = [json.dumps(GOOD_LINE)] + [
                _mutated_line(rng) for _ in range(rng.randrange(1, 4))
            ]
            body = "\n".join(lines).encode()
        prompts = folder / f"prompts{suffix}"
        prompts.write_bytes(body)
        outcomes[
            _outcome(
                "prompt files", _generate(tiny_dir, prompts, folder / "out"), capsys, folder / "out"
            )
        ] += 1
    assert outcomes["error"] > 80  # the mutations are mostly bad: they reach the checks


OVERRIDE_KEYS = [
    "num_inference_steps",
    "guidance_scale",
    "height",
    "width",
    "num_frames",
    "seed",
    "sampling.scheduler",
    "scheduler",
    "fps",
    "save_arrays",
    "per_device_batch_size",
    "ici_data_parallelism",
    "model.loras",
    "cache.kind",
    "output.fps",
    "mesh.ici_fsdp_parallelism",
    "compute.dtype",
    "nonsense",
    "sampling",
    "model",
    "flow_shift",
    "scheduler_config.shift",
]
OVERRIDE_VALUES = [
    "1",
    "0",
    "-1",
    "2.5",
    "nan",
    ".inf",
    "true",
    "null",
    "[",
    "]",
    "{",
    "[1, 2]",
    "{a: 1}",
    "'x'",
    '"',
    "unipc",
    "euler",
    "bfloat16",
    "!!python/object/apply:os.system ['true']",
    "\u00e9",
    "",
    "1e999",
    "0x10",
    "[{path: nope.safetensors}]",
    "*",
    "&a",
    ": :",
]


def test_fuzzed_overrides(tiny_dir, tmp_path, capsys, monkeypatch):
    from stages.generate import model

    monkeypatch.setattr(model, "load", _reach)
    prompts = tmp_path / "p.txt"
    prompts.write_text("a red circle\n")
    rng = random.Random(SEED + 1)
    for case in range(80):
        extra = []
        for _ in range(rng.randrange(1, 4)):
            token = f"{rng.choice(OVERRIDE_KEYS)}={rng.choice(OVERRIDE_VALUES)}"
            extra.append(_mutate_text(rng, token) if rng.random() < 0.2 else token)
        extra += ["height=16", "width=16", "num_frames=1"][: rng.randrange(4)]
        out = tmp_path / f"o{case}"
        _outcome("overrides", _generate(tiny_dir, prompts, out, *extra), capsys, out)


def test_fuzzed_stage_yaml(tiny_dir, tmp_path, capsys):
    """Every stage's checked-in YAML, mutated, through ``--dry-run`` (its whole config check)."""
    rng = random.Random(SEED + 2)
    sources = sorted((REPO / "configs/stages").glob("*.yml"))
    for case in range(60):
        source = rng.choice(sources)
        text = source.read_text()
        if rng.random() < 0.5:
            for _ in range(rng.randrange(1, 4)):
                text = _mutate_text(rng, text)
        else:  # a value replaced by an odd one, keeping the YAML well formed
            lines = text.splitlines()
            keyed = [
                i
                for i, line in enumerate(lines)
                if ":" in line and not line.lstrip().startswith("#")
            ]
            i = rng.choice(keyed)
            key = lines[i].split(":", 1)[0]
            lines[i] = f"{key}: {rng.choice(OVERRIDE_VALUES)}"
            text = "\n".join(lines)
        path = tmp_path / f"c{case}.yml"
        path.write_text(text)
        stage = source.stem if source.stem in cli.STAGES else "generate"
        call = lambda stage=stage, path=path: cli.main([stage, str(path), "--dry-run", "-q"])  # noqa: E731
        _outcome("stage YAML", call, capsys)


def test_fuzzed_model_files(tiny_dir, tmp_path, capsys, monkeypatch):
    """model_index.json and each component's config.json, values replaced or bytes edited."""
    from stages.generate import render

    monkeypatch.setattr(render, "render_batches", _reach)
    rng = random.Random(SEED + 3)
    prompts = tmp_path / "p.txt"
    prompts.write_text("a red circle\n")
    targets = [
        "model_index.json",
        *sorted(p.relative_to(tiny_dir).as_posix() for p in tiny_dir.glob("*/config.json")),
    ]
    for case in range(40):
        copy = tmp_path / f"m{case}"
        shutil.copytree(tiny_dir, copy)
        target = copy / rng.choice(targets)
        data = json.loads(target.read_text())
        if rng.random() < 0.3:
            text = _mutate_text(rng, json.dumps(data))
        else:
            key = rng.choice(sorted(data))
            small = [None, 0, -1, 1, 2, 3, "x", [], {}, ["diffusers", "Nope"], True, 0.5]
            if rng.random() < 0.8:
                data[key] = rng.choice(small)
            else:
                del data[key]
            text = json.dumps(data)
        target.write_text(text)
        out = tmp_path / f"mo{case}"
        call = _generate(copy, prompts, out, "height=16", "width=16", "num_frames=1")
        _outcome("model files", call, capsys, out)


def test_fuzzed_lora_files(tiny_dir, tmp_path, capsys):
    """A valid LoRA, then its bytes, keys or shapes mutated; checked as generate checks a set
    before rendering."""
    from jaxcore.families import load_pipeline
    from jaxcore.sharding import make_mesh
    from tests.stages.test_lora_render import write_peft_lora

    pipe = load_pipeline(tiny_dir, mesh=make_mesh(devices=jax.devices()[:1]))
    good = write_peft_lora(tmp_path / "good.safetensors", tiny_dir, seed=1)
    file = weights.SafetensorsFile(good)
    tensors = {k: np.array(file.get(k)) for k in file.keys()}  # noqa: SIM118
    rng = random.Random(SEED + 4)
    errors = cli.user_error_types()
    for case in range(40):
        path = tmp_path / f"l{case}.safetensors"
        op = rng.randrange(4)
        if op == 0:  # bytes: flipped, cut or padded
            raw = bytearray(good.read_bytes())
            i = rng.randrange(len(raw))
            raw = raw[:i] if rng.random() < 0.5 else raw[:i] + bytes([raw[i] ^ 0xFF]) + raw[i + 1 :]
            path.write_bytes(bytes(raw))
        else:
            edited = dict(tensors)
            key = rng.choice(sorted(edited))
            if op == 1:  # renamed
                edited[key.replace("lora_", rng.choice(["lora", "lora_C", "x_"]), 1)] = edited.pop(
                    key
                )
            elif op == 2:  # reshaped
                edited[key] = np.concatenate([edited[key], edited[key]], axis=rng.randrange(2))
            else:  # another dtype, or gone
                edited[key] = (
                    edited[key].astype(np.int8) if rng.random() < 0.5 else edited.pop(key)[:0]
                )
            weights.save_safetensors(edited, path)

        def call(path=path):
            try:
                pipe.check_loras({((str(path), 1.0, "high"),)}, strict=True)
            except errors as err:
                print(f"difforge generate: error: {err}", file=sys.stderr)
                assert path.name in str(err), err
                return 2
            return 0

        _outcome("LoRA files", call, capsys)
