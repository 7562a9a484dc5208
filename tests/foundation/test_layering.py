"""The layers stay layers (checked on the source, with the AST):

- ``jaxcore`` (the library) imports neither ``stages`` nor ``pipelines``;
- ``stages`` import nothing from ``pipelines`` (the CLI and chain runner sit above them);
- no stage imports another stage: ``stages.<convert|train|evaluate|generate>`` meet only
  through artifacts, and share code only through ``stages.common``;
- the stages know no model: no import of a model module or of a family's own module, and no
  identifier or string naming a family or one of its models (everything model-specific is a
  call into ``jaxcore.families``);
- nor does any product file outside ``jaxcore/families/``, ``jaxcore/models/``,
  ``jaxcore/lora/``, ``pipelines/demo/`` and ``pipelines/embedded/`` (tiny models of each
  family);
- nothing in the product outside ``pipelines/demo/`` imports the demo;
- the product's import graph has no cycle, counting imports inside functions too (a lazy
  import that closes a cycle is still a cycle: the two modules cannot be read apart).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from jaxcore.families import FAMILIES

REPO = Path(__file__).resolve().parents[2]
STAGES = ("convert", "train", "evaluate", "generate")
# Words that would mean a stage knows a model: the family names and their models' names.
# ("clip" alone is not one: stages clip gradients and read video clips.)
MODEL_WORDS = (*FAMILIES, "umt5", "t5", "clip_text", "unet", "autoencoder_kl", "transformer_2")


def _modules(package: str) -> list[Path]:
    return sorted((REPO / package).rglob("*.py"))


def _imports(path: Path) -> list[str]:
    """Every module a file imports (absolute names; relative imports resolved)."""
    tree = ast.parse(path.read_text())
    inside = path.is_relative_to(REPO)
    package = ".".join(path.relative_to(REPO).with_suffix("").parts[:-1]) if inside else ""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base]).strip(".")
            out.append(base)
            out += [f"{base}.{alias.name}" for alias in node.names]
    return out


def _violations(paths, forbidden) -> list[str]:
    return [
        f"{p.relative_to(REPO)} imports {name}"
        for p in paths
        for name in _imports(p)
        if any(name == f or name.startswith(f + ".") for f in forbidden)
    ]


def test_jaxcore_imports_no_stage_and_no_pipeline():
    assert _violations(_modules("jaxcore"), ("stages", "pipelines")) == []


def test_stages_import_nothing_from_pipelines():
    assert _violations(_modules("stages"), ("pipelines",)) == []


@pytest.mark.parametrize("stage", STAGES)
def test_no_stage_imports_another_stage(stage):
    others = tuple(f"stages.{s}" for s in STAGES if s != stage)
    assert _violations(_modules(f"stages/{stage}"), others) == []


def _named_things(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every identifier, attribute, import and non-docstring string."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            out.append((node.lineno, node.id))
        elif isinstance(node, ast.Attribute):
            out.append((node.lineno, node.attr))
        elif isinstance(node, ast.alias):
            out.append((node.lineno, node.name))
        elif isinstance(node, ast.ImportFrom):
            out.append((node.lineno, node.module or ""))
        elif isinstance(node, ast.FunctionDef | ast.ClassDef | ast.arg):
            out.append((node.lineno, getattr(node, "name", None) or node.arg))
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in docstrings
        ):
            out.append((node.lineno, node.value))
    return out


def _mentions_a_model(text: str) -> str | None:
    lowered = text.lower()
    tokens = {t for t in "".join(c if c.isalnum() else " " for c in lowered).split()}
    tokens |= set(lowered.replace(".", "_").split("_"))
    for word in MODEL_WORDS:
        if word in tokens or any(t.startswith(word) and t[len(word) :].isdigit() for t in tokens):
            return word
        if len(word) > 3 and word in lowered:
            return word
    return None


@pytest.mark.parametrize("stage", STAGES)
def test_stages_know_no_model(stage):
    found = []
    for path in _modules(f"stages/{stage}") + _modules("stages/common"):
        for name in _imports(path):
            if name.startswith("jaxcore.models") or (
                name.startswith("jaxcore.families.") and name.split(".")[2] in FAMILIES
            ):
                found.append(f"{path.relative_to(REPO)} imports {name}")
        for line, text in _named_things(path):
            word = _mentions_a_model(text)
            if word:
                found.append(f"{path.relative_to(REPO)}:{line} names {word!r}: {text[:60]!r}")
    assert found == []


def test_the_check_finds_what_it_looks_for(tmp_path):
    """The scanner is not vacuous: a Wan-specific stage module would be caught."""
    bad = tmp_path / "bad.py"
    bad.write_text(
        '"""Docstrings may say Wan."""\n'
        "from jaxcore.models import wan_transformer\n"
        "def f(x):\n"
        "    if x.text_encoder == 'umt5':\n"
        "        return WanPipeline\n"
    )
    words = {_mentions_a_model(text) for _, text in _named_things(bad)} - {None}
    assert words == {"wan", "umt5"}
    assert "jaxcore.models.wan_transformer" in _imports(bad)
    assert _mentions_a_model("Docstrings may say Wan.") == "wan"  # docstrings are skipped above
    assert _mentions_a_model("encoder_hidden_states") is None
    assert _mentions_a_model("latents") is None


PRODUCT = ("jaxcore", "stages", "pipelines")
# the demo and the embedded default's tiny builders make a tiny model of each family
MAY_NAME_FAMILIES = (
    "jaxcore/families/",
    "jaxcore/models/",
    "jaxcore/lora/",
    "pipelines/demo/",
    "pipelines/embedded/",
)


def test_only_the_family_layers_name_a_family():
    found = []
    for package in PRODUCT:
        for path in _modules(package):
            relative = str(path.relative_to(REPO))
            if relative.startswith(MAY_NAME_FAMILIES):
                continue
            for line, text in _named_things(path):
                word = _mentions_a_model(text)
                if word:
                    found.append(f"{relative}:{line} names {word!r}: {text[:60]!r}")
    assert found == []


def test_nothing_in_the_product_imports_the_demo():
    paths = [
        p
        for package in PRODUCT
        for p in _modules(package)
        if not str(p.relative_to(REPO)).startswith("pipelines/demo/")
    ]
    assert _violations(paths, ("pipelines.demo",)) == []


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(paths) -> dict[str, set[str]]:
    """{module: the product modules it imports}, anywhere in the file. ``from pkg import sub``
    is an edge to ``pkg.sub`` alone when ``sub`` is a module (to ``pkg`` too otherwise)."""
    modules = {_module_name(p): p for p in paths}

    def owner(name: str) -> str:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {owner(alias.name) for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
                base = node.module or ""
                if node.level:
                    parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*parent, base]).strip(".")
                subs = [f"{base}.{alias.name}" for alias in node.names]
                targets |= {s for s in subs if s in modules}
                if not all(s in modules for s in subs):
                    targets.add(owner(base))
        graph[name] = targets - {"", name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_the_import_graph_has_no_cycle():
    paths = [p for package in PRODUCT for p in _modules(package)]
    assert cycles(import_graph(paths)) == []


def test_the_cycle_check_finds_a_lazy_cycle(tmp_path):
    """Not vacuous: two modules importing each other, one lazily, are a cycle."""
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
