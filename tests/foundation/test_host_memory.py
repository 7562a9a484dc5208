"""The host allocator policy (jaxcore.host_memory): freed memory is reused without faults."""

import subprocess
import sys
import textwrap

import pytest

from jaxcore import host_memory

# Allocates, touches and frees a 64 MiB block twice through the C library (as XLA's CPU
# runtime allocates a step's temporaries) and prints the page faults of the second round.
_SCRIPT = textwrap.dedent(
    """
    import ctypes, resource, sys
    from jaxcore.host_memory import keep_freed_host_memory
    applied = keep_freed_host_memory() if sys.argv[1] == "policy" else False
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
    libc.free.argtypes = (ctypes.c_void_p,)
    size = 64 << 20
    def round_trip():
        block = libc.malloc(size)
        ctypes.memset(block, 1, size)
        libc.free(block)
    round_trip()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    round_trip()
    print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    """
)


def _second_round_faults(mode: str) -> tuple[str, int]:
    env = {"DIFFORGE_KEEP_HOST_MEMORY": "1", "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT, mode], capture_output=True, text=True, env=env, check=True
    ).stdout.split()
    return out[0], int(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_policy_reuses_a_freed_block_without_page_faults():
    applied, faults = _second_round_faults("policy")
    assert applied == "True"
    assert faults < 200, faults  # the block came back from the heap, already mapped
    # without the policy glibc maps the block afresh: every 4 KiB page faults again
    _, default_faults = _second_round_faults("default")
    assert default_faults > 10_000, default_faults


def test_platform_choice_and_opt_out(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert not host_memory.accelerator_present()
    monkeypatch.setenv("JAX_PLATFORMS", "tpu,cpu")
    assert host_memory.accelerator_present()
    # an accelerator host keeps glibc's default unless asked
    monkeypatch.delenv(host_memory.ENV, raising=False)
    assert host_memory.keep_freed_host_memory() is False
    monkeypatch.setenv(host_memory.ENV, "0")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert host_memory.keep_freed_host_memory() is False


def test_a_bad_setting_names_the_variable(monkeypatch):
    monkeypatch.setenv(host_memory.ENV, "yes")
    with pytest.raises(ValueError, match="DIFFORGE_KEEP_HOST_MEMORY must be 0 or 1"):
        host_memory.keep_freed_host_memory()
