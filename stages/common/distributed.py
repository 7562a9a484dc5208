"""Joining a multi-host job (every model stage calls this before it touches the devices)."""

from __future__ import annotations

import os

import jax


def maybe_initialize_distributed() -> bool:
    """``jax.distributed.initialize()`` on multi-host jobs (xpk/GKE JobSet, Megascale, TPU pods).

    A no-op on one machine. Must run before anything touches the devices. The coordinator,
    process count and process id come from the environment: ``JAX_COORDINATOR_ADDRESS``
    (``host:port``) with ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID`` when set (what a
    hand-launched or test run sets), else JAX's own detection (TPU pods, GKE/JobSet).
    ``JAX_PLATFORMS=cpu`` selects gloo collectives between CPU processes.
    """
    markers = ("JOBSET_NAME", "MEGASCALE_COORDINATOR_ADDRESS", "JAX_COORDINATOR_ADDRESS")
    hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
    multi = any(os.environ.get(m) for m in markers) or "," in hosts
    if not multi or jax.distributed.is_initialized():
        return False
    kwargs = {}
    if os.environ.get("JAX_NUM_PROCESSES") and os.environ.get("JAX_PROCESS_ID"):
        kwargs = {
            "coordinator_address": os.environ["JAX_COORDINATOR_ADDRESS"],
            "num_processes": int(os.environ["JAX_NUM_PROCESSES"]),
            "process_id": int(os.environ["JAX_PROCESS_ID"]),
        }
    if os.environ.get("JAX_PLATFORMS", "") == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(**kwargs)
    return True
