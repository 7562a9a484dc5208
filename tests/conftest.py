"""Test-wide setup: 8 virtual CPU devices (before jax is imported) and fp32-exact matmuls."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("NO_GCE_CHECK", "true")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
