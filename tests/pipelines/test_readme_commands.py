"""The ``difforge`` commands of the README and of ``docs/*.md``, run as printed (cloud and
placeholder paths replaced by local ones), so the documentation cannot drift from the shipped
YAMLs again.

Default tier: every command resolves its config (``--dry-run``; ``difforge run`` validates each
step), and the ``deploy`` commands write their launch files. Slow tier: the stage commands run
for real, chained as the README chains them (convert -> train -> evaluate -> generate), with
only the step count lowered.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from pipelines.cli import main

REPO = Path(__file__).resolve().parents[2]


DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def documented_commands(documents: list[Path] = DOCUMENTS) -> list[str]:
    """Each ``difforge ...`` command of the documents' bash blocks, in order (continuations
    joined, comments and ``&& other tools`` dropped; the ``difforge <stage> [...]`` synopsis
    skipped)."""
    text = "\n".join(path.read_text() for path in documents)
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        joined = block.replace("\\\n", " ")
        for line in joined.splitlines():
            line = line.split(" #", 1)[0].split("&&", 1)[0].strip()
            if line.startswith("difforge ") and "[" not in line:
                commands.append(" ".join(line.split()))
    return commands


def _placeholders(tmp: Path) -> dict[str, str]:
    """Documented placeholder -> local stand-in (made by :func:`_make_inputs`)."""
    return {
        "gs://bucket/": f"{tmp}/bucket/",
        "path/to/hf_dataset": str(tmp / "imagefolder"),
        "path/or/gs/or/hub-id": str(tmp / "pipeline"),
        "prompts.jsonl": str(tmp / "prompts.jsonl"),
        "root=outputs/demo": f"root={tmp}/outputs/demo",
    }


def _local(command: str, tmp: Path) -> list[str]:
    for placeholder, local in _placeholders(tmp).items():
        command = command.replace(placeholder, local)
    argv = shlex.split(command)
    assert argv[0] == "difforge"
    return argv[1:]


def _make_inputs(tmp: Path, pipeline: bool = True) -> None:
    from pipelines.embedded.tiny import build_tiny_wan_pipeline
    from tests.stages.test_convert_elements import _plain_imagefolder

    _plain_imagefolder(tmp / "imagefolder", [f"img{i}.png" for i in range(8)])
    if pipeline:
        build_tiny_wan_pipeline(tmp / "pipeline", seed=0)
    lines = [{"prompt": "a red square", "seed": 1}, {"prompt": "a blue circle", "seed": 2}]
    (tmp / "prompts.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_the_docs_have_the_commands_this_file_runs():
    stages = [c.split()[1] for c in documented_commands()]
    for stage in ("convert", "train", "evaluate", "generate", "run", "deploy", "fit"):
        assert stage in stages, stage
    # the README itself shows the whole chain; deploy and fit live in docs/at-scale.md
    in_readme = [c.split()[1] for c in documented_commands([REPO / "README.md"])]
    for stage in ("convert", "train", "evaluate", "generate", "run"):
        assert stage in in_readme, stage


def test_every_documented_command_resolves_its_config(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO)  # the documented config paths are relative to the checkout
    _make_inputs(tmp_path, pipeline=False)  # resolving a config reads no weights
    for command in documented_commands():
        argv = _local(command, tmp_path)
        if argv[0] == "deploy":  # writes files only: run it (into a temporary folder)
            out = tmp_path / "deploy"
            assert main([*argv, f"out={out}"]) == 0, command
            stdout = capsys.readouterr().out
            if "target=argo" in command:  # the file docs/at-scale.md applies with kubectl
                printed = command.split("kubectl apply -f", 1)[-1].strip()
                assert (out / Path(printed).name).is_file() or "outputs/deploy" not in printed
                assert "kubectl apply" in stdout
            continue
        code = main([*argv, "--dry-run"])
        captured = capsys.readouterr()
        assert code == 0, f"{command}\n{captured.err}"


@pytest.mark.slow  # ~2 min: the four stages for real on tiny models
def test_the_documented_stage_commands_run_as_printed(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    _make_inputs(tmp_path)
    lowered = {"train": ["max_train_steps=2"]}
    for command in documented_commands():
        argv = _local(command, tmp_path)
        if argv[0] not in ("convert", "train", "evaluate", "generate"):
            continue
        assert main([*argv, *lowered.get(argv[0], [])]) == 0, command
    bucket = tmp_path / "bucket"
    for name in ("data", "train", "eval", "renders"):
        assert (bucket / name / "manifest.json").is_file(), name
