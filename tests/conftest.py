"""Test-wide setup: 8 virtual CPU devices (before jax is imported) and fp32-exact matmuls."""

import os

# 8 devices for the sharding tests. LLVM at -O0: the tests' tiny models spend most of their
# time compiling, and -O0 compiles ~25% faster; results move by < 1e-6 (the UNet and Wan
# parity tests hold at the default level too). Set XLA_FLAGS to run the suite otherwise.
os.environ.setdefault(
    "XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("NO_GCE_CHECK", "true")
# etils reads this when orbax is first imported (possibly at collection): never tf.io.gfile for
# gs://, which cannot reach the local GCS server.
os.environ.setdefault("EPATH_USE_TF", "false")
# The difforge command keeps freed host memory for reuse (jaxcore/host_memory.py); tests call
# it in-process, and a pytest worker runs hundreds of unlike programs: keep glibc's default
# there (tests/foundation/test_host_memory.py checks the policy in its own processes).
os.environ.setdefault("DIFFORGE_KEEP_HOST_MEMORY", "0")
# Likewise the command's re-execution under tcmalloc, for the commands tests start (the test
# of it sets its own environment)
os.environ.setdefault("DIFFORGE_TCMALLOC", "0")

import sys  # noqa: E402

# PyPI's torch for Python 3.12 (the tests' oracle) brings triton, its GPU compiler, and
# diffusers imports it through torch._dynamo. triton's libtriton.so bundles LLVM, and so does
# TensorFlow (the TFRecord reader), which loads it with RTLD_GLOBAL: once TensorFlow is in the
# process, libtriton's static constructors bind to TensorFlow's llvm::DebugCounter and the
# process dies with a segfault (gdb: _GLOBAL__sub_I_PassBuilder.cpp in libtriton.so). The
# oracle runs on the CPU and never needs triton, so the tests make it unimportable
# (torch.utils._triton.has_triton_package then answers False).
sys.modules.setdefault("triton", None)

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

import socket  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
GCS_BUCKET = "difforge-test"


@pytest.hookimpl(tryfirst=True)  # before `-m "not slow"` deselects
def pytest_collection_modifyitems(config, items):
    """The slow tier's listed tests (tests/slow_tier.py) get the ``slow`` marker."""
    from tests.slow_tier import SLOW_NODE_IDS

    for item in items:
        if item.nodeid in SLOW_NODE_IDS:
            item.add_marker(pytest.mark.slow)
    if config.args_source == pytest.Config.ArgsSource.TESTPATHS:  # the whole suite collected
        stale = SLOW_NODE_IDS - {item.nodeid for item in items}
        if stale:  # a renamed test would otherwise fall back into the default tier unnoticed
            raise pytest.UsageError(
                "tests/slow_tier.py lists tests that do not exist: " + ", ".join(sorted(stale))
            )


def pytest_sessionstart(session):
    """The native CPU kernels built first, as ``difforge prepare`` builds them (``make test`` and
    a bare ``pytest`` alike): a run never compiles them while it traces."""
    from jaxcore.kernels import cpu_gemm, native

    native.prepare()
    cpu_gemm.prepare()


_EXIT_STATUS: list[int] = []


def pytest_sessionfinish(session, exitstatus):
    _EXIT_STATUS.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """After the last report, the run's status leaves the process at once, without the
    interpreter's teardown: at that teardown the native threads of the libraries the suite
    loads (multiprocessing managers, ffmpeg / PyAV, XLA) were cancelled and one died with
    "terminate called ... FATAL: exception not rethrown", turning a passing run into an abort
    (2026-12-07's CI, after its summary said the tests passed or failed)."""
    if not _EXIT_STATUS or os.environ.get("DIFFORGE_TESTS_NORMAL_EXIT"):
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_EXIT_STATUS[-1])


# One pytest process runs the whole suite, thousands of compiled programs; JAX's caches keep
# every one (and the constants they closed over) for the life of the process. Twice on
# 2026-12-07 the full default run died near its end inside XLA's CPU compiler
# (backend_compile_and_load: an abort at 96%, a segfault at 98%, in unrelated tests that pass
# alone), where the suite had passed before with fewer programs. So each module's compiled
# programs are dropped when the module ends (a later module compiles what it needs again).
@pytest.fixture(autouse=True, scope="module")
def _programs_freed_per_module():
    yield
    import gc

    jax.clear_caches()
    gc.collect()


@pytest.fixture
def xla_dots(monkeypatch):
    """The dense layers' products as XLA's dots, MKL's GEMM switched off
    (jaxcore/kernels/cpu_gemm.py): for tests that read XLA's FLOP count of a model, which does
    not see into custom calls, or that compare against XLA's own products."""
    from jaxcore.kernels import cpu_gemm

    monkeypatch.setattr(cpu_gemm, "unavailable", lambda: "switched off by the xla_dots fixture")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def gcs_server():
    """A real local GCS server (tests/support/gcs_server.py) on a free loopback port.

    Sets the environment every client needs: google-cloud-storage (STORAGE_EMULATOR_HOST),
    tensorstore/orbax (TENSORSTORE_GCS_HTTP_URL, a dummy token, EPATH_USE_TF=false).
    Yields the base URL; use the ``gcs_root`` fixture for a fresh gs:// folder.
    """
    port = _free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.support.gcs_server",
            "--port",
            str(port),
            "--bucket",
            GCS_BUCKET,
        ],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail("the local GCS server did not start")
            time.sleep(0.1)
    env = {
        "STORAGE_EMULATOR_HOST": url,
        "TENSORSTORE_GCS_HTTP_URL": url,
        "GOOGLE_AUTH_TOKEN_FOR_TESTING": "dummy",
        "EPATH_USE_TF": "false",
        "GOOGLE_CLOUD_PROJECT": "local",
        # gcsfs (orbax's path layer) otherwise probes each bucket for HNS and stalls 60 s
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
    }
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    _beam_gcs_anonymous()
    from jaxcore import storage

    storage._client.cache_clear()
    try:
        yield url
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        storage._client.cache_clear()
        proc.terminate()
        proc.wait(timeout=10)


def _beam_gcs_anonymous() -> None:
    """Beam's gcsio asks ``google.auth.default()`` for credentials with exponential-backoff
    retries (~19 s per process here, where there are none) before it goes anonymous, which the
    local server takes. A test harness may set what Beam has no option for: its credential
    cache, resolved to none, in this process (the product never touches Beam's internals)."""
    from apache_beam.internal.gcp import auth

    with auth._Credentials._credentials_lock:
        auth._Credentials._credentials = None
        auth._Credentials._credentials_init = True


@pytest.fixture
def gcs_root(gcs_server) -> str:
    """A fresh, empty gs:// folder on the local server."""
    return f"gs://{GCS_BUCKET}/t-{uuid.uuid4().hex[:10]}"


@pytest.fixture(params=["local", "gcs"])
def any_root(request, tmp_path) -> str:
    """The same test on a local folder and on gs:// (local GCS server)."""
    if request.param == "local":
        return str(tmp_path / "root")
    return request.getfixturevalue("gcs_root")
