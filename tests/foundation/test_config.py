"""Typed configs: YAML + key=value overrides, named errors."""

import dataclasses
from typing import Literal

import pytest

from jaxcore.config import ConfigError, from_dict, load_config, to_dict, to_yaml
from jaxcore.sharding import MeshConfig


@dataclasses.dataclass(frozen=True)
class Optim:
    learning_rate: float = 1e-5
    schedule: Literal["constant", "cosine"] = "constant"
    betas: tuple[float, float] = (0.9, 0.999)


@dataclasses.dataclass(frozen=True)
class Data:
    path: str = ""
    shuffle_seed: int = 0


@dataclasses.dataclass(frozen=True)
class Job:
    output_dir: str
    steps: int = 10
    tags: tuple[str, ...] = ()
    optim: Optim = Optim()
    mesh: MeshConfig = MeshConfig()
    data: Data = Data()
    note: str | None = None


def write(tmp_path, text):
    p = tmp_path / "job.yml"
    p.write_text(text)
    return p


def test_yaml_and_overrides(tmp_path):
    p = write(tmp_path, "output_dir: /tmp/x\noptim:\n  learning_rate: 1e-4\n")
    cfg = load_config(
        Job, p, ["steps=20", "optim.schedule=cosine", "ici_fsdp_parallelism=4", "tags=[a, b]"]
    )
    assert cfg.optim.learning_rate == 1e-4  # YAML 1.1 reads 1e-4 as a string: coerced
    assert cfg.steps == 20 and cfg.optim.schedule == "cosine"
    assert cfg.mesh.ici_fsdp_parallelism == 4  # bare leaf key, resolved uniquely
    assert cfg.tags == ("a", "b")
    assert dataclasses.is_dataclass(cfg.mesh)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.steps = 3  # type: ignore[misc]


def test_unknown_key_suggests(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown key no_such_key"):
        load_config(Job, None, ["output_dir=x", "no_such_key=1"])
    with pytest.raises(
        ConfigError, match=r"unknown key optim.learning_rat \(did you mean 'learning_rate'\?\)"
    ):
        load_config(Job, write(tmp_path, "output_dir: x\noptim: {learning_rat: 1}\n"))
    with pytest.raises(ConfigError, match=r"did you mean 'optim.learning_rate'"):
        load_config(Job, None, ["output_dir=x", "learning_rat=1"])


def test_wrong_type_and_missing(tmp_path):
    with pytest.raises(ConfigError, match=r"^steps: expected an integer, got 'ten'$"):
        load_config(Job, None, ["output_dir=x", "steps=ten"])
    with pytest.raises(ConfigError, match=r"optim.schedule: 'linear' is not one of"):
        load_config(Job, None, ["output_dir=x", "optim.schedule=linear"])
    with pytest.raises(ConfigError, match=r"missing required value output_dir"):
        load_config(Job, None, [])
    with pytest.raises(ConfigError, match=r"optim.betas: expected 2 items, got 3"):
        load_config(Job, None, ["output_dir=x", "optim.betas=[1,2,3]"])
    with pytest.raises(ConfigError, match=r"steps: expected an integer, got True"):
        from_dict(Job, {"output_dir": "x", "steps": True})
    for given in ("nan", ".nan", ".inf", "-.inf", "inf"):
        with pytest.raises(ConfigError, match=r"^optim.learning_rate: expected a finite number"):
            load_config(Job, None, ["output_dir=x", f"optim.learning_rate={given}"])
    with pytest.raises(ConfigError, match=r"^optim.betas\[1\]: expected a finite number"):
        load_config(Job, None, ["output_dir=x", "optim.betas=[0.9, .nan]"])


def test_ambiguous_bare_key():
    @dataclasses.dataclass(frozen=True)
    class A:
        seed: int = 0

    @dataclasses.dataclass(frozen=True)
    class Two:
        a: A = A()
        b: A = A()

    with pytest.raises(ConfigError, match=r"ambiguous: write one of a.seed, b.seed"):
        load_config(Two, None, ["seed=1"])


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"config file .*nope.yml does not exist"):
        load_config(Job, tmp_path / "nope.yml")
    with pytest.raises(
        ConfigError,
        match=r"malformed YAML in .*job.yml line 2 column 9: mapping values are not allowed",
    ):
        load_config(Job, write(tmp_path, "output_dir: x\nsteps: a: b\n"))
    with pytest.raises(ConfigError, match=r"expected a mapping at the top level"):
        load_config(Job, write(tmp_path, "- a\n- b\n"))
    with pytest.raises(ConfigError, match=r"not of the form key=value"):
        load_config(Job, None, ["output_dir"])


def test_roundtrip_yaml(tmp_path):
    cfg = load_config(Job, None, ["output_dir=x", "note=hello"])
    again = load_config(Job, write(tmp_path, to_yaml(cfg)))
    assert again == cfg
    assert to_dict(cfg)["optim"]["betas"] == [0.9, 0.999]


def test_a_minus_one_mesh_axis_on_the_command_line_takes_over_the_yamls():
    """MaxDiffusion users type ici_fsdp_parallelism=-1 over a YAML whose data axis is -1 (the
    README's train command): the YAML's auto axis becomes 1; explicit sizes are kept; two -1
    given on the command line still reach mesh_shape's error."""
    from pathlib import Path

    from jaxcore.sharding import ShardingError, mesh_shape
    from stages.train.config import TrainConfig

    path = Path(__file__).resolve().parents[2] / "configs/stages/train.yml"
    assert load_config(TrainConfig, path).mesh.ici_data_parallelism == -1
    cfg = load_config(TrainConfig, path, ["ici_fsdp_parallelism=-1", "ici_tensor_parallelism=2"])
    assert (cfg.mesh.ici_data_parallelism, cfg.mesh.ici_fsdp_parallelism) == (1, -1)
    assert cfg.mesh.dcn_data_parallelism == -1  # another kind of axis: untouched
    assert mesh_shape(cfg.mesh, 8) == {"data": 1, "fsdp": 4, "context": 1, "tensor": 2}
    both = load_config(TrainConfig, path, ["ici_fsdp_parallelism=-1", "ici_data_parallelism=-1"])
    with pytest.raises(ShardingError, match="only one of"):
        mesh_shape(both.mesh, 8)


def test_an_override_changes_a_sections_own_default_not_its_classes():
    @dataclasses.dataclass(frozen=True)
    class Inner:
        a: int = 1
        b: int = 2

    @dataclasses.dataclass(frozen=True)
    class Outer:
        inner: Inner = dataclasses.field(default_factory=lambda: Inner(b=20))

    assert load_config(Outer, None, []).inner == Inner(1, 20)
    # `a` given: `b` keeps the section's default (20), not Inner's (2)
    assert load_config(Outer, None, ["inner.a=5"]).inner == Inner(5, 20)
    assert load_config(Outer, None, ["a=5", "b=7"]).inner == Inner(5, 7)
