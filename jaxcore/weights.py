"""Diffusers-format weight loading: safetensors only, straight onto target shardings.

A model file provides ``weight_map(config) -> {flax_param_path: (source_key, transform)}``.
:func:`load_params` walks the abstract parameter tree (from ``jax.eval_shape``), reads each
source tensor lazily from memory-mapped safetensors, transforms it (e.g. transposes a torch
Linear weight into a Flax kernel), checks its shape, casts it, and builds each device's shard
with ``jax.make_array_from_callback`` so no full copy is ever gathered on one device.

Only ``.safetensors`` are read. Pickle checkpoints (``.bin``, ``.pt``, ``.ckpt``, ``.pth``)
are refused: loading them can run arbitrary code.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import mmap
import os
import struct
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import jax
import ml_dtypes
import numpy as np

log = logging.getLogger(__name__)

Transform = Callable[[np.ndarray], np.ndarray]
ParamPath = tuple[str, ...]
WeightMap = Mapping[ParamPath, tuple[str, Transform]]

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")

_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
}


class WeightsError(ValueError):
    """Bad or mismatched weights; the message names the file, key or parameter."""


# --- standard transforms (torch layout -> flax layout) -----------------------------------


def identity(w: np.ndarray) -> np.ndarray:
    return w


def linear(w: np.ndarray) -> np.ndarray:
    """torch Linear weight [out, in] -> flax Dense kernel [in, out]."""
    return w.T


def conv1d(w: np.ndarray) -> np.ndarray:
    return w.transpose(2, 1, 0)


def conv2d(w: np.ndarray) -> np.ndarray:
    """torch Conv2d [O, I, H, W] -> flax [H, W, I, O]."""
    return w.transpose(2, 3, 1, 0)


def conv3d(w: np.ndarray) -> np.ndarray:
    """torch Conv3d [O, I, T, H, W] -> flax [T, H, W, I, O]."""
    return w.transpose(2, 3, 4, 1, 0)


# --- reading safetensors ------------------------------------------------------------------


def _read_header(path: Path) -> tuple[dict, int]:
    """The header and the data's start, once the ``safetensors`` library has validated the
    file: a JSON header, known dtypes, each tensor's offsets the size its dtype and shape
    give, no overlaps or gaps, and the data ending exactly at the end of the file (so a
    truncated download is refused here, not met as a reshape error on first use)."""
    from safetensors import SafetensorError, safe_open

    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise WeightsError(f"{path}: not a safetensors file (shorter than its header)")
            (n,) = struct.unpack("<Q", raw)
            if n > min(100_000_000, size - 8):
                raise WeightsError(
                    f"{path}: not a safetensors file (header length {n}, file {size} bytes)"
                )
            header = json.loads(f.read(n))
        if not isinstance(header, dict):
            raise WeightsError(f"{path}: corrupt safetensors header: not a JSON object")
        with safe_open(path, framework="numpy"):
            pass
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise WeightsError(f"{path}: corrupt safetensors header: {err}") from None
    except SafetensorError as err:
        raise WeightsError(f"{path}: {_explain(err, header, size - 8 - n)}") from None
    except OSError as err:
        raise WeightsError(f"{path}: cannot read: {err}") from None
    for key, info in header.items():
        if key != "__metadata__" and info.get("dtype") not in _DTYPES:
            raise WeightsError(f"{path}: tensor {key!r} has unsupported dtype {info.get('dtype')}")
    return header, 8 + n


def _explain(err: Exception, header: dict, data_bytes: int) -> str:
    """The library's reason; with the sizes when the tensors tile a data block that ends
    elsewhere than the file does (a truncated or padded file)."""
    spans = sorted(
        tuple(info["data_offsets"])
        for key, info in header.items()
        if key != "__metadata__"
        and isinstance(info, dict)
        and isinstance(info.get("data_offsets"), list)
        and len(info["data_offsets"]) == 2
    )
    tiled = bool(spans) and spans[0][0] == 0
    tiled = tiled and all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
    wanted = spans[-1][1] if tiled else None
    if wanted is not None and wanted != data_bytes:
        state = (
            "truncated (an interrupted download or copy?)"
            if wanted > data_bytes
            else "longer than its header describes"
        )
        return (
            f"the header describes {wanted} bytes of tensor data, the file holds {data_bytes}: "
            f"the file is {state}. Download or copy it again."
        )
    return f"invalid safetensors file: {err}"


class SafetensorsFile:
    """One memory-mapped .safetensors file, validated on open; tensors are zero-copy numpy
    views (``safetensors``' own numpy reader copies, and knows no bfloat16)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.header, self._offset = _read_header(self.path)
        self.metadata = self.header.pop("__metadata__", {}) or {}
        self._mmap: np.memmap | None = None

    def keys(self) -> list[str]:
        return list(self.header)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.header[key]["shape"])

    def release(self, key: str) -> None:
        """Drop the tensor's pages from this process's resident memory (after it was placed).

        Mapped file pages count as resident once read; without this, loading a model holds the
        whole file *and* the placed arrays. The data stay readable (pages re-read on access).
        """
        if self._mmap is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        start, end = self.header[key]["data_offsets"]
        page = mmap.PAGESIZE
        lo = (self._offset + start) // page * page
        hi = self._offset + end
        if hi > lo:
            self._mmap._mmap.madvise(mmap.MADV_DONTNEED, lo, hi - lo)

    def get(self, key: str) -> np.ndarray:
        info = self.header[key]
        dtype = _DTYPES[info["dtype"]]
        if self._mmap is None:
            self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r")
        start, end = info["data_offsets"]
        buf = self._mmap[self._offset + start : self._offset + end]
        return buf.view(dtype).reshape(info["shape"])


class SafetensorsReader:
    """All tensors of one model directory (single file, or sharded with an index json)."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise WeightsError(f"weights directory {self.directory} does not exist")
        files = sorted(self.directory.glob("*.safetensors"))
        if not files:
            pickles = [p.name for p in self.directory.iterdir() if p.suffix in PICKLE_SUFFIXES]
            if pickles:
                raise WeightsError(
                    f"{self.directory} holds only pickle checkpoints ({', '.join(pickles)}); "
                    "difforge loads safetensors only, since unpickling can run arbitrary code. "
                    "Convert them to .safetensors first."
                )
            raise WeightsError(f"no .safetensors files in {self.directory}")
        self._key_to_file: dict[str, SafetensorsFile] = {}
        index_files = sorted(self.directory.glob("*.safetensors.index.json"))
        opened = {p.name: SafetensorsFile(p) for p in files}
        if index_files:
            for key, fname in _weight_map(index_files[0]).items():
                if fname not in opened:
                    raise WeightsError(
                        f"{index_files[0]}: shard {fname} (holding {key!r}) is missing"
                    )
                if key not in opened[fname].header:
                    raise WeightsError(
                        f"{index_files[0]}: {key!r} is mapped to {fname}, which does not hold it"
                    )
                self._key_to_file[key] = opened[fname]
        for f in opened.values():
            for key in f.keys():  # noqa: SIM118 (not a dict)
                self._key_to_file.setdefault(key, f)

    def keys(self) -> list[str]:
        return list(self._key_to_file)

    def __contains__(self, key: str) -> bool:
        return key in self._key_to_file

    def shape(self, key: str) -> tuple[int, ...]:
        return self._key_to_file[key].shape(key)

    def get(self, key: str) -> np.ndarray:
        try:
            f = self._key_to_file[key]
        except KeyError:
            raise WeightsError(f"{self.directory}: no tensor {key!r}") from None
        return f.get(key)

    def release(self, key: str) -> None:
        if key in self._key_to_file:
            self._key_to_file[key].release(key)

    def as_dict(self) -> dict[str, np.ndarray]:
        return {k: self.get(k) for k in self.keys()}


def _weight_map(index_file: Path) -> dict[str, str]:
    """A sharded checkpoint's ``weight_map`` (tensor name -> shard file name)."""
    try:
        index = json.loads(index_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise WeightsError(f"{index_file}: not a readable JSON index: {err}") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise WeightsError(f"{index_file}: no 'weight_map' of tensor names to shard file names")
    return weight_map


def read_config(directory: str | os.PathLike, name: str = "config.json") -> dict:
    path = Path(directory) / name
    if not path.is_file():
        raise WeightsError(f"{path} does not exist (expected a diffusers/transformers config)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise WeightsError(f"{path}: invalid JSON: {err}") from None


# --- placing parameters ----------------------------------------------------------------------


def _flatten(tree: Mapping, prefix: ParamPath = ()) -> dict[ParamPath, object]:
    out: dict[ParamPath, object] = {}
    for k, v in tree.items():
        if isinstance(v, Mapping):
            out.update(_flatten(v, (*prefix, str(k))))
        else:
            out[(*prefix, str(k))] = v
    return out


def _unflatten(flat: Mapping[ParamPath, object]) -> dict:
    root: dict = {}
    for path, v in flat.items():
        node = root
        for p in path[:-1]:
            node = node.setdefault(p, {})
        node[path[-1]] = v
    return root


def _fmt(path: ParamPath) -> str:
    return "/".join(path)


def load_params(
    reader: SafetensorsReader | Mapping[str, np.ndarray],
    weight_map: WeightMap,
    abstract_params: Mapping,
    *,
    shardings: Mapping | None = None,
    dtype=None,
    ignore_unused: Iterable[str] = (),
    finish: Callable | None = None,
) -> dict:
    """Read, check, cast and place every parameter.

    ``abstract_params``: nested dict of ``jax.ShapeDtypeStruct`` (unboxed ``params`` collection).
    ``shardings``: same structure of ``jax.sharding.Sharding`` (default: first device).
    ``dtype``: cast target for floating parameters (default: the abstract dtype).
    ``ignore_unused``: source keys (or key prefixes) allowed to be present but unused.
    ``finish``: ``(path, placed array) -> what to keep``, applied to each parameter as it is
    placed (a quantized load keeps each kernel quantized, so the float tree never exists).
    Raises WeightsError listing missing/unexpected keys and shape mismatches together.
    """
    abstract_flat = _flatten(abstract_params)
    sharding_flat = _flatten(shardings) if shardings is not None else {}
    source_keys = set(reader.keys())
    ignore = tuple(ignore_unused)

    no_rule = sorted(_fmt(p) for p in abstract_flat if p not in weight_map)
    stale_rule = sorted(_fmt(p) for p in weight_map if p not in abstract_flat)
    missing = sorted(
        f"{src} (for {_fmt(p)})"
        for p, (src, _) in weight_map.items()
        if p in abstract_flat and src not in source_keys
    )
    used = {src for src, _ in weight_map.values()}
    unexpected = sorted(k for k in source_keys - used if not (ignore and k.startswith(ignore)))
    problems = []
    if no_rule:
        problems.append(f"parameters with no source key in the weight map: {_few(no_rule)}")
    if stale_rule:
        problems.append(f"weight map names parameters the model does not have: {_few(stale_rule)}")
    if missing:
        problems.append(f"missing keys in the checkpoint: {_few(missing)}")
    if unexpected:
        problems.append(f"unexpected keys in the checkpoint: {_few(unexpected)}")
    where = getattr(reader, "directory", "the given state dict")
    if problems:
        raise WeightsError(f"weights at {where} do not match the model: " + "; ".join(problems))

    mismatched = []
    placed: dict[ParamPath, jax.Array] = {}
    default_sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    for path, abstract in abstract_flat.items():
        src, transform = weight_map[path]
        value = transform(reader.get(src) if hasattr(reader, "get") else reader[src])
        if tuple(value.shape) != tuple(abstract.shape):
            mismatched.append(
                f"{_fmt(path)} expects {tuple(abstract.shape)} but {src} gives "
                f"{tuple(value.shape)} after conversion"
            )
            continue
        target = abstract.dtype
        if dtype is not None and jax.numpy.issubdtype(abstract.dtype, jax.numpy.floating):
            target = dtype
        sharding = sharding_flat.get(path, default_sharding)
        placed[path] = jax.block_until_ready(_place(value, sharding, target))
        if finish is not None:
            placed[path] = jax.block_until_ready(finish(path, placed[path]))
        if hasattr(reader, "release"):
            reader.release(src)
    if mismatched:
        raise WeightsError(
            f"weights at {where} do not match the model its config describes (shape mismatch: "
            f"{_few(mismatched)}); were they saved with this config.json?"
        )
    return _unflatten(placed)


def _few(items: list[str], shown: int = 4) -> str:
    """The first few of a list, on one line, with how many more there are."""
    text = "; ".join(items[:shown])
    return f"{text}; and {len(items) - shown} more" if len(items) > shown else text


def load_placed(
    reader: SafetensorsReader | str | os.PathLike,
    weight_map: WeightMap,
    boxed_params: Mapping,
    *,
    mesh=None,
    rules=None,
    dtype=None,
    ignore_unused: Iterable[str] = (),
    finish: Callable | None = None,
) -> dict:
    """:func:`load_params` for a model: each parameter placed by the logical partitioning its
    boxed abstract (``nn.Partitioned`` from ``eval_shape``) carries, on ``mesh`` under the
    logical axis ``rules`` (default ``jaxcore.sharding.LOGICAL_AXIS_RULES``); without a mesh
    on the first device. ``reader``: a SafetensorsReader or a model directory."""
    from flax import linen as nn

    from jaxcore import sharding

    if not isinstance(reader, SafetensorsReader):
        reader = SafetensorsReader(reader)
    shardings = sharding.param_shardings(mesh, boxed_params, rules) if mesh is not None else None
    return load_params(
        reader,
        weight_map,
        nn.meta.unbox(boxed_params),
        shardings=shardings,
        dtype=dtype,
        ignore_unused=ignore_unused,
        finish=finish,
    )


def _zeros_like(spec):
    import jax.numpy as jnp

    return None if spec is None else jnp.zeros(spec.shape, spec.dtype)


def shapes_of_init(init, *inputs):
    """``jax.eval_shape(init, rng, *inputs)`` with the PRNG key made inside the trace.

    A concrete ``jax.random.key(0)`` (or ``jnp.zeros``) outside the trace compiles and runs
    small XLA programs, and a process's first compile grows its resident memory by ~60 MiB
    (XLA's CPU compiler starting) before a single weight is read: loading a model then looked
    like 1.34x its weight bytes (``make bench``, memory_load). Traced, nothing runs.
    ``inputs``: arrays or ShapeDtypeStructs."""
    return jax.eval_shape(lambda *args: init(jax.random.key(0), *args), *inputs)


def abstract_from_inputs(module, dummy_inputs, method=None) -> Mapping:
    """A module's ``params`` collection as boxed ShapeDtypeStructs (``nn.Partitioned`` kept),
    traced through ``method`` (None: ``__call__``) on ``dummy_inputs`` (ShapeDtypeStructs or
    None); nothing is allocated. The mesh is dropped for tracing: parameters do not depend on
    it."""
    shapes_only = module.clone(mesh=None)

    def init(rng):
        return shapes_only.init(rng, *(_zeros_like(s) for s in dummy_inputs), method=method)

    return shapes_of_init(init)["params"]


def init_placed(module, dummy_inputs, rng, *, mesh=None, rules=None, method=None) -> dict:
    """Random-init ``params`` of ``module`` (its own initialisers, traced through ``method``),
    created already placed by their logical partitioning on ``mesh`` (else on the default
    device), unboxed."""
    from flax import linen as nn

    from jaxcore import sharding

    unmeshed = module.clone(mesh=None)  # a dummy batch of 1 need not divide the mesh

    def init(key):
        variables = unmeshed.init(key, *(_zeros_like(s) for s in dummy_inputs), method=method)
        return nn.meta.unbox(variables["params"])

    if mesh is None:
        return jax.jit(init)(rng)
    boxed = abstract_from_inputs(module, dummy_inputs, method)
    shardings = nn.meta.unbox(sharding.param_shardings(mesh, boxed, rules))
    return jax.jit(init, out_shardings=shardings)(rng)


def weight_map_by_path(boxed_params: Mapping, source_entry: Callable) -> dict:
    """``{param path: source_entry(path, ndim)}`` for every leaf of ``boxed_params``: the
    weight map of a model whose checkpoint keys follow from its parameter paths (the
    diffusers VAEs and UNet, whose module names mirror diffusers' attribute names)."""
    from flax import linen as nn

    flat = jax.tree_util.tree_flatten_with_path(nn.meta.unbox(boxed_params))[0]
    entries = {}
    for keypath, leaf in flat:
        path = tuple(str(k.key) for k in keypath)
        entries[path] = source_entry(path, len(leaf.shape))
    return entries


@dataclasses.dataclass(frozen=True)
class ModelKind:
    """How one model class is built, loaded, initialised, shaped and counted: the same four
    functions every denoiser and VAE file needs, written once.

    ``module``: the flax Module class, called ``module(config, **options)`` (``dtype``,
    ``param_dtype``, ``attention``, ``mesh``, ``remat_policy``, ...: its own fields);
    ``config``: its config dataclass (``from_dict`` of a diffusers ``config.json``);
    ``dummy_inputs``: config -> the ShapeDtypeStructs ``init`` traces with;
    ``weight_map``: (config, boxed abstract params) -> :data:`WeightMap` (diffusers keys);
    ``ignore_unused``: config -> checkpoint keys the model does not use;
    ``trace_method``: the method ``init`` traces to create every parameter (None: ``__call__``)."""

    module: type
    config: type
    dummy_inputs: Callable
    weight_map: Callable
    ignore_unused: Callable = lambda config: ()
    trace_method: str | Callable | None = None

    def abstract_params(self, module) -> Mapping:
        """The ``params`` collection as boxed ShapeDtypeStructs (``nn.Partitioned`` kept)."""
        return abstract_from_inputs(module, self.dummy_inputs(module.config), self.trace_method)

    def load(self, directory: str | os.PathLike, *, mesh=None, rules=None, finish=None, **options):
        """``(module, params)`` of a diffusers model directory (config.json + safetensors):
        params cast to ``param_dtype`` and placed on ``mesh`` by the logical axis ``rules``
        when a mesh is given (else on the first device). Raises WeightsError naming
        missing/unexpected keys or the parameter whose shape does not match, and the config's
        error for a config key the model cannot represent. ``finish``: see
        :func:`load_params`."""
        import jax.numpy as jnp

        config = self.config.from_dict(read_config(directory))
        module = self.module(config, mesh=mesh, **options)
        boxed = self.abstract_params(module)
        params = load_placed(
            directory,
            self.weight_map(config, boxed),
            boxed,
            mesh=mesh,
            rules=rules,
            dtype=options.get("param_dtype", jnp.float32),
            ignore_unused=self.ignore_unused(config),
            finish=finish,
        )
        return module, params

    def init(self, config, rng, *, mesh=None, rules=None, **options):
        """``(module, params)`` random-initialised by the layers' own initialisers (training
        from scratch), created already sharded when a mesh is given."""
        module = self.module(config, mesh=mesh, **options)
        params = init_placed(
            module, self.dummy_inputs(config), rng, mesh=mesh, rules=rules, method=self.trace_method
        )
        return module, params

    def count_params(self, config) -> int:
        """Number of parameters, from eval_shape (nothing is allocated)."""
        return count_elements(self.abstract_params(self.module(config)))


# The checkpoint keys only decoding reads, in diffusers' AutoencoderKL and AutoencoderKLWan alike.
VAE_DECODER_PREFIXES = ("decoder.", "post_quant_conv.")


@dataclasses.dataclass(frozen=True)
class VAEKind(ModelKind):
    """The :class:`ModelKind` of a convolutional VAE: it also loads its encoder alone, and
    random-inits without running the layers' initialisers.

    ``encoder_method``: the method that, traced on ``dummy_inputs``, creates the encoder's
    (and quant_conv's) parameters alone; ``fill``: ``(leaf name, shape, dtype) -> array`` for
    every parameter but the kernels (:func:`init_kernels_fan_in`), as the layers declare them."""

    encoder_method: str | Callable = "encode"
    fill: Callable | None = None

    def encoder_part(self) -> ModelKind:
        """The kind whose whole model is this VAE's encoder: an encoder-only load creates and
        reads the encoder's parameters alone and leaves the decoder's keys unread."""
        return ModelKind(
            self.module,
            self.config,
            self.dummy_inputs,
            self.weight_map,
            lambda config: VAE_DECODER_PREFIXES,
            self.encoder_method,
        )

    def abstract_params(self, module, *, encoder_only: bool = False) -> Mapping:
        """The ``params`` collection as boxed ShapeDtypeStructs (``nn.Partitioned`` kept), no
        allocation; ``encoder_only``: the encoder's and quant_conv's alone."""
        if encoder_only:
            return self.encoder_part().abstract_params(module)
        return super().abstract_params(module)

    def load(self, directory: str | os.PathLike, *, encoder_only: bool = False, **options):
        """:meth:`ModelKind.load`; ``encoder_only``: read the encoder's parameters alone
        (encoding: convert, image conditioning); the module cannot decode then."""
        if encoder_only:
            return self.encoder_part().load(directory, **options)
        return super().load(directory, **options)

    def init(self, config, rng, *, mesh=None, rules=None, **options):
        """``(module, params)``, unboxed (sharded if a mesh): kernels LeCun normal (normal
        truncated at +-2 sigma, variance 1 / fan_in: flax's ``lecun_normal``, the layers'
        declared init), every other parameter ``fill``. ``module.init`` would compile the
        whole forward (minutes on CPU) with one RNG draw per parameter, so shapes come from
        ``eval_shape`` and all kernels share one truncated-normal draw."""
        import jax.numpy as jnp

        module = self.module(config, mesh=mesh, **options)
        dtype = options.get("param_dtype", jnp.float32)
        boxed = self.abstract_params(module)
        params = init_kernels_fan_in(boxed, rng, dtype, self.fill, mesh=mesh, rules=rules)
        return module, params


# Standard deviation of a standard normal truncated to [-2, 2] (flax's lecun_normal divides by it).
TRUNCATED_NORMAL_STD = 0.87962566103423978


def init_kernels_fan_in(boxed_params: Mapping, rng, dtype, fill, *, mesh=None, rules=None) -> dict:
    """Random init without tracing the model: every ``kernel`` LeCun normal (normal truncated
    at +-2 sigma, variance 1 / fan_in, flax's ``lecun_normal``) cut from ONE truncated-normal
    draw, every other leaf ``fill(name, shape, dtype)``; placed by the logical partitioning of
    ``boxed_params`` on ``mesh``.

    For convolutional VAEs: ``module.init`` compiles their whole forward (for minutes on CPU,
    with one RNG draw per parameter), while the shapes alone come from ``eval_shape``.
    """
    import math

    import jax.numpy as jnp
    from flax import linen as nn

    from jaxcore import sharding

    flat, treedef = jax.tree_util.tree_flatten_with_path(nn.meta.unbox(boxed_params))
    kernel_sizes = [math.prod(leaf.shape) for path, leaf in flat if path[-1].key == "kernel"]

    def init(key):
        noise = jax.random.truncated_normal(key, -2.0, 2.0, (sum(kernel_sizes),), dtype)
        pieces = iter(jnp.split(noise, np.cumsum(kernel_sizes)[:-1]))
        leaves = []
        for path, leaf in flat:
            name = path[-1].key
            if name == "kernel":
                fan_in = math.prod(leaf.shape[:-1])
                scale = math.sqrt(1.0 / fan_in) / TRUNCATED_NORMAL_STD
                leaves.append(next(pieces).reshape(leaf.shape) * scale)
            else:
                leaves.append(fill(name, leaf.shape, dtype))
        return jax.tree_util.tree_unflatten(treedef, leaves)

    if mesh is None:
        return jax.jit(init)(rng)
    shardings = nn.meta.unbox(sharding.param_shardings(mesh, boxed_params, rules))
    return jax.jit(init, out_shardings=shardings)(rng)


def count_elements(tree) -> int:
    """Number of elements in a (possibly boxed) tree of arrays or ShapeDtypeStructs."""
    from flax import linen as nn

    return sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(nn.meta.unbox(tree)))


# Indices of the source's fastest axis copied at a time by contiguous_copy.
COPY_BLOCK = 64


def contiguous_copy(x: np.ndarray) -> np.ndarray:
    """``np.ascontiguousarray(x)``, in slabs when ``x`` is a transposed view.

    numpy copies a transposed view along the destination's rows, reading the source with a
    large stride, so every element read costs a cache line. Copying ``COPY_BLOCK`` indices of
    the view's smallest-stride axis at a time keeps each line's neighbours in use: a Wan VAE
    conv kernel ``[O, I, 3, 3, 3] -> [3, 3, 3, I, O]`` (384 x 384) 24 -> 8.5 ms, and reading,
    converting and copying the Wan 2.1 VAE's 508 MB 1.0 -> 0.45 s (2-core VM)."""
    axis = slab_axis(x)
    if axis is None:
        return np.ascontiguousarray(x)
    out = np.empty(x.shape, x.dtype)
    for start in range(0, x.shape[axis], COPY_BLOCK):
        slab = (slice(None),) * axis + (slice(start, start + COPY_BLOCK),)
        out[slab] = x[slab]
    return out


def slab_axis(x: np.ndarray) -> int | None:
    """The axis :func:`contiguous_copy` cuts ``x`` along: among all but the last axis, those
    longer than ``COPY_BLOCK``, the one with the smallest stride, if it is smaller than the last
    axis's (else numpy's own copy already reads in order; None)."""
    if x.ndim < 2 or x.flags.c_contiguous:
        return None
    blockable = [a for a in range(x.ndim - 1) if x.shape[a] > COPY_BLOCK]
    if not blockable:
        return None
    axis = min(blockable, key=lambda a: abs(x.strides[a]))
    return axis if abs(x.strides[axis]) < abs(x.strides[-1]) else None


def _place(value: np.ndarray, sharding, dtype) -> jax.Array:
    def shard(index):
        return contiguous_copy(value[index]).astype(dtype, copy=False)

    return jax.make_array_from_callback(tuple(value.shape), sharding, shard)


def save_safetensors(tensors: Mapping[str, np.ndarray], path: str | os.PathLike, metadata=None):
    """Write a safetensors file (any of the dtypes above, bf16 included)."""
    inverse = {np.dtype(v): k for k, v in _DTYPES.items()}
    header: dict[str, object] = {}
    offset = 0
    arrays = []
    for key in sorted(tensors):
        arr = np.ascontiguousarray(np.asarray(tensors[key]))
        code = inverse.get(arr.dtype)
        if code is None:
            raise WeightsError(f"cannot save tensor {key!r} of dtype {arr.dtype} as safetensors")
        header[key] = {
            "dtype": code,
            "shape": list(arr.shape),
            "data_offsets": [offset, offset + arr.nbytes],
        }
        offset += arr.nbytes
        arrays.append(arr)
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    tmp = Path(str(path) + ".partial")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for arr in arrays:
            f.write(arr.tobytes())
    os.replace(tmp, path)


# --- exporting (flax -> diffusers layout) ----------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Invertible:
    """A transform that carries its inverse, for reshaping transforms that depend on the
    config or the key (export writes diffusers layout back through ``inverse``)."""

    forward: Transform
    inverse: Transform

    def __call__(self, w: np.ndarray) -> np.ndarray:
        return self.forward(w)


INVERSE_TRANSFORMS: dict[Transform, Transform] = {
    identity: identity,
    linear: linear,  # a transpose is its own inverse
    conv1d: conv1d,
    conv2d: lambda w: w.transpose(3, 2, 0, 1),
    conv3d: lambda w: w.transpose(4, 3, 0, 1, 2),
}


def export_state_dict(params: Mapping, weight_map: WeightMap) -> dict[str, np.ndarray]:
    """Flax params -> {diffusers key: array in torch layout}, the inverse of :func:`load_params`.

    Every tensor is pushed back through its forward transform and compared with the parameter,
    so a wrong inverse fails here instead of writing a wrong checkpoint.
    """
    flat = _flatten(params)
    out: dict[str, np.ndarray] = {}
    for path, (key, transform) in weight_map.items():
        if path not in flat:
            raise WeightsError(f"export: the params have no {_fmt(path)} (for {key})")
        inverse = getattr(transform, "inverse", None) or INVERSE_TRANSFORMS.get(transform)
        if inverse is None:
            raise WeightsError(f"export: no inverse transform registered for {key}")
        value = np.asarray(jax.device_get(flat[path]))
        exported = np.ascontiguousarray(inverse(value))
        if not np.array_equal(transform(exported), value):
            raise WeightsError(f"export: {key} does not round-trip through its transform")
        out[key] = exported
    return out
