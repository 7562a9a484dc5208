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


# --- tcmalloc, preloaded by re-executing the program ----------------------------------------

_PRELOAD_SCRIPT = textwrap.dedent(
    """
    import ctypes, os, resource
    from jaxcore.host_memory import keep_freed_host_memory, reexec_with_tcmalloc
    reexec_with_tcmalloc()
    loaded = "tcmalloc" in open("/proc/self/maps").read()
    process = ctypes.CDLL(None)  # the malloc every library binds to: tcmalloc's when preloaded
    process.malloc.restype, process.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
    process.free.argtypes = (ctypes.c_void_p,)
    def round_trip():
        block = process.malloc(64 << 20)
        ctypes.memset(block, 1, 64 << 20)
        process.free(block)
    round_trip()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    round_trip()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    print(loaded, keep_freed_host_memory(), faults)
    """
)


def _preload_run(**env: str) -> tuple[str, str, int]:
    base = {"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"}
    out = subprocess.run(
        [sys.executable, "-c", _PRELOAD_SCRIPT],
        capture_output=True,
        text=True,
        env={**base, **env},
        check=True,
    ).stdout.split()
    return out[0], out[1], int(out[2])


@pytest.mark.skipif(
    host_memory.find_tcmalloc() is None,
    reason="no tcmalloc on this host (Debian: apt-get install libtcmalloc-minimal4)",
)
def test_the_program_re_executes_itself_with_tcmalloc():
    loaded, glibc_policy, faults = _preload_run()
    assert loaded == "True" and glibc_policy == "False"  # tcmalloc serves; mallopt is moot
    assert faults < 200, faults  # the freed 64 MiB came back without page faults
    loaded, glibc_policy, _ = _preload_run(DIFFORGE_TCMALLOC="0")
    assert loaded == "False" and glibc_policy == "True"  # the glibc policy instead


def test_tcmalloc_choice(monkeypatch):
    calls = []
    monkeypatch.setattr(host_memory.os, "execve", lambda *args: calls.append(args))
    monkeypatch.setattr(host_memory, "find_tcmalloc", lambda: "/lib/libtcmalloc_minimal.so.4")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    for name in (host_memory.TCMALLOC_ENV, host_memory._REEXECUTED_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LD_PRELOAD", "/lib/other.so")
    host_memory.reexec_with_tcmalloc()
    (executable, argv, env) = calls.pop()
    assert executable == sys.executable and argv[1:] == sys.orig_argv[1:]
    assert env["LD_PRELOAD"] == "/lib/libtcmalloc_minimal.so.4:/lib/other.so"
    assert env[host_memory._REEXECUTED_ENV] == "1"
    assert env[host_memory.TCMALLOC_RELEASE_ENV] == "0"  # freed memory kept
    monkeypatch.setenv(host_memory.TCMALLOC_RELEASE_ENV, "2")  # the user's choice stands
    host_memory.reexec_with_tcmalloc()
    assert calls.pop()[2][host_memory.TCMALLOC_RELEASE_ENV] == "2"
    monkeypatch.delenv(host_memory.TCMALLOC_RELEASE_ENV)
    # not again: already preloaded, already re-executed, turned off, an accelerator host
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/libtcmalloc.so.4")
    host_memory.reexec_with_tcmalloc()
    monkeypatch.delenv("LD_PRELOAD")
    monkeypatch.setenv(host_memory._REEXECUTED_ENV, "1")
    host_memory.reexec_with_tcmalloc()
    monkeypatch.delenv(host_memory._REEXECUTED_ENV)
    monkeypatch.setenv(host_memory.TCMALLOC_ENV, "0")
    host_memory.reexec_with_tcmalloc()
    monkeypatch.delenv(host_memory.TCMALLOC_ENV)
    monkeypatch.setenv("JAX_PLATFORMS", "tpu")
    host_memory.reexec_with_tcmalloc()
    assert calls == []
    # asked for where there is none: an error naming the variable
    monkeypatch.setattr(host_memory, "find_tcmalloc", lambda: None)
    monkeypatch.setenv(host_memory.TCMALLOC_ENV, "1")
    with pytest.raises(ValueError, match="DIFFORGE_TCMALLOC=1 but no tcmalloc"):
        host_memory.reexec_with_tcmalloc()
    monkeypatch.setenv(host_memory.TCMALLOC_ENV, "yes")
    with pytest.raises(ValueError, match="DIFFORGE_TCMALLOC must be 0 or 1"):
        host_memory.reexec_with_tcmalloc()
