"""Quantized denoiser weights kept as an artifact (``model.quantized_cache``), so the hosts of a
long bulk run load the denoisers quantized instead of reading the float weights and quantizing
them on every start (int8 is half of bf16 to read).

Under the cache root, one artifact per (pipeline, its denoisers' weight files, quantization,
weights dtype): ``<root>/<key>/`` holds ``<component>.safetensors`` for the denoiser and a
two-expert model's second one (quantized kernels as ``<path>.qvalue`` + ``<path>.scale``, the
other parameters as they load) and the manifest, written last, whose summary records the mode
and the source. The first run that finds no artifact loads as usual (each kernel quantized as
it is placed) and then writes it; every later run (a resumed one, another host, another prompt
file) loads it. The weight files are identified by name, size and modification time (and the
config by its checksum): files rewritten in place make a new key, not a stale load.

Only a diffusers pipeline's denoisers are cached; a train artifact's checkpoint quantizes as it
loads, every time (its step is its identity, and it is read once per run anyway).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import tempfile
from pathlib import Path

import numpy as np

from jaxcore import artifacts, quantization, sharding, storage, weights
from jaxcore.compute import ComputeConfig

log = logging.getLogger(__name__)

STAGE = "quantize"


@dataclasses.dataclass(frozen=True)
class CachedWeights:
    """What a cache artifact is made from (its config: the artifact key hashes it)."""

    pipeline: str
    family: str
    quantization: str
    weights_dtype: str
    denoisers: dict  # component -> {"config_sha256", "files": [[name, size, mtime_ns]]}


def _identity(directory: Path) -> dict:
    config = directory / "config.json"
    files = sorted(p for p in directory.iterdir() if p.name.endswith((".safetensors", ".json")))
    return {
        "config_sha256": hashlib.sha256(config.read_bytes()).hexdigest(),
        "files": [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files],
    }


def components(source) -> list[str]:
    """The denoiser components of the source's pipeline (a second expert's too)."""
    second = source.family.second_expert_component(source.configs)
    return [source.family.denoiser_component] + ([second] if second else [])


def describe(root: str, source, compute: ComputeConfig) -> tuple[str, CachedWeights]:
    """(the artifact's URI under ``root``, what it is made of) for this source and compute."""
    made_of = CachedWeights(
        pipeline=str(source.pipeline_dir),
        family=source.family.name,
        quantization=compute.quantization,
        weights_dtype=compute.weights_dtype,
        denoisers={c: _identity(source.pipeline_dir / c) for c in components(source)},
    )
    key = artifacts.artifact_key(STAGE, made_of, {})
    return storage.join(root, key), made_of


def load(uri: str, source, compute: ComputeConfig, mesh, rules=None) -> dict | None:
    """``load_pipeline`` keywords with the cached denoisers (``denoiser``, and
    ``second_denoiser`` for a two-expert model), placed on ``mesh``; None when ``uri`` holds
    no finished artifact."""
    if artifacts.read_manifest(uri) is None:
        return None
    manifest = artifacts.open_artifact(uri, STAGE)
    folder = storage.local_copy(uri)
    loaded = {}
    for component, keyword in zip(
        components(source), ("denoiser", "second_denoiser"), strict=False
    ):
        config = source.configs[component]
        reader = weights.SafetensorsFile(folder / f"{component}.safetensors")
        loaded[keyword] = _placed(reader, config, source.family, compute, mesh, rules)
    log.info("generate: %s denoiser weights from %s", compute.quantization, manifest.uri)
    return loaded


def _placed(reader, config, family, compute: ComputeConfig, mesh, rules):
    """(module, quantized params) read from ``reader`` onto ``mesh``."""
    import jax
    from flax import linen as nn

    module = family.make_denoiser(config, compute, mesh)
    boxed = family.abstract_params(module)
    unboxed = nn.meta.unbox(boxed)
    if mesh is not None:
        where = sharding.param_shardings(mesh, boxed, rules)
    else:
        where = jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(jax.devices()[0]), unboxed)

    def sharded(leaf, at):
        floating = np.issubdtype(leaf.dtype, np.floating)
        dtype = compute.param_dtype if floating else leaf.dtype
        return jax.ShapeDtypeStruct(leaf.shape, dtype, sharding=at)

    abstract = jax.tree.map(sharded, unboxed, where)
    expected = quantization.abstract_quantized(abstract, compute.quantization)

    def get(name, leaf):
        if name not in reader.header:
            raise weights.WeightsError(f"{reader.path}: no tensor {name!r} for this model")
        value = reader.get(name)
        if tuple(value.shape) != tuple(leaf.shape) or value.dtype != leaf.dtype:
            raise weights.WeightsError(
                f"{reader.path}: {name} is {value.dtype}{list(value.shape)}, the model "
                f"expects {leaf.dtype}{list(leaf.shape)}"
            )
        return jax.make_array_from_callback(leaf.shape, leaf.sharding, lambda i: value[i])

    return module, quantization.from_tensors(get, expected)


def store(uri: str, made_of: CachedWeights, pipe) -> None:
    """Write the pipeline's quantized denoisers as the artifact at ``uri`` (process 0 writes;
    every process takes part in gathering sharded weights)."""
    import jax

    trees = [pipe.denoiser_params]
    if pipe.second_expert is not None:
        trees.append(pipe.second_expert.params)
    writer = artifacts.ArtifactWriter(uri, STAGE, made_of)
    with tempfile.TemporaryDirectory() as tmp:
        for component, tree in zip(made_of.denoisers, trees, strict=True):
            tensors = {k: _host(v) for k, v in quantization.to_tensors(tree).items()}
            if jax.process_index() != 0:
                continue
            local = Path(tmp) / f"{component}.safetensors"
            weights.save_safetensors(tensors, local)
            storage.upload_file(local, writer.file(local.name))
    if jax.process_index() == 0:
        writer.commit({"quantization": made_of.quantization, "pipeline": made_of.pipeline})
        log.info("generate: cached the %s denoiser weights at %s", made_of.quantization, uri)


def _host(array) -> np.ndarray:
    """The whole array on this host (gathered across processes when sharded over them)."""
    if getattr(array, "is_fully_addressable", True):
        return np.asarray(array)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(array, tiled=True))
