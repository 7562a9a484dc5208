"""bench.ablate: each mechanism's switch really takes the path without it."""

from bench import ablate
from jaxcore.kernels import native, products


def test_every_replaced_mechanism_is_replaced(monkeypatch):
    # monkeypatch remembers the originals, so the switches are undone after the test
    monkeypatch.setattr(native, "kernel_for", native.kernel_for)
    monkeypatch.setattr(products, "materialised_transpose", products.materialised_transpose)
    for mechanism in ("attention", "transposed_copies"):
        ablate.switch_off(mechanism)
    assert native.kernel_for("float32", 64) is None
    assert products.materialised_transpose is products._swap_last_axes


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
