"""bench.ablate: each mechanism's switch really takes the path without it."""

import contextlib

from bench import ablate
from jaxcore.kernels import native, products
from stages.convert import run as convert_run
from stages.convert import source


def test_every_replaced_mechanism_is_replaced(monkeypatch):
    # monkeypatch remembers the originals, so the switches are undone after the test
    monkeypatch.setattr(native, "kernel_for", native.kernel_for)
    monkeypatch.setattr(products, "materialised_transpose", products.materialised_transpose)
    monkeypatch.setattr(source, "_quick_split_inference", source._quick_split_inference)
    monkeypatch.setattr(convert_run, "prompt_state_sampler", convert_run.prompt_state_sampler)
    for mechanism in ("attention", "transposed_copies", "split_inference", "state_sampler"):
        ablate.switch_off(mechanism)
    assert native.kernel_for("float32", 64) is None
    assert products.materialised_transpose is products._swap_last_axes
    assert isinstance(source._quick_split_inference("/nowhere"), contextlib.nullcontext)
    assert isinstance(convert_run.prompt_state_sampler(None), contextlib.nullcontext)


def test_environment_switches_name_the_documented_variables():
    assert ablate.SWITCHES["mkl"][0] == {"DIFFORGE_MKL": "0"}
    assert ablate.SWITCHES["allocators"][0] == {
        "DIFFORGE_TCMALLOC": "0",
        "DIFFORGE_KEEP_HOST_MEMORY": "0",
    }


def test_an_unknown_mechanism_lists_the_known_ones(capsys):
    assert ablate.main(["nonsense"]) == 2
    out = capsys.readouterr().out
    assert all(name in out for name in ablate.SWITCHES)
