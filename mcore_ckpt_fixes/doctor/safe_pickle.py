"""Read the pickled metadata of checkpoints without running any code from them.

Two kinds of pickle reach the doctor: torch DCP's ``.metadata`` (dataclasses of
``torch.distributed.checkpoint``) and the ``data.pkl`` record inside a ``torch.save`` zip
(``model_optim_rng.pt``, ``common.pt``: an ``argparse.Namespace`` of args, nested dicts, tensors).

Every global the pickle names is looked up in an allow-list and replaced by an inert stand-in:
nothing named by the file is imported or called, so the doctor needs neither torch nor Megatron
(whose enums the saved args pickle) and is as safe as ``torch.load(weights_only=True)`` with an
allow-list, without its price: ``torch.load`` would read (or map) every tensor in the archive, and
allow-listing Megatron's enums would mean importing Megatron. Tensors become :class:`TensorStub`
(shape only); their storages (``data/N`` in the zip) are never opened.
"""

from __future__ import annotations

import argparse
import collections
import gc
import io
import pickle
import re
from typing import Any, Dict, Tuple


class UnsafeGlobal(pickle.UnpicklingError):
    """The pickle names a global that is not on the allow-list; ``qualname`` is that global."""

    def __init__(self, module: str, name: str):
        self.qualname = f"{module}.{name}"
        super().__init__(f"refusing to load {self.qualname} (not on the doctor's allow-list)")


class Stub:
    """An inert stand-in for an allow-listed class: keeps the state pickle hands it, nothing else."""

    _name = "?"

    def __init__(self, *args, **kwargs):
        self._args = args

    def __setstate__(self, state):
        if isinstance(state, tuple) and len(state) == 2 and (state[1] is None or isinstance(state[1], dict)):
            state, slots = state  # (dict state, slot state) as object.__reduce_ex__ gives for __slots__ classes
            if slots:
                self.__dict__.update(slots)
        if isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self._state = state

    def __repr__(self):
        fields = ", ".join(f"{k}={v!r}" for k, v in self.__dict__.items() if not k.startswith("_"))
        return f"<{self._name} {fields}>"


class FastStub:
    """Stand-in for dataclasses whose pickled state is a plain dict (no __setstate__: the C unpickler
    updates ``__dict__`` itself, which keeps 100k-chunk metadata fast)."""

    _name = "?"


class TensorStub:
    """A tensor of the checkpoint: its shape and dtype, never its data."""

    __slots__ = ("shape", "dtype")

    def __init__(self, shape, dtype=None):
        self.shape = tuple(shape)
        self.dtype = dtype

    def __repr__(self):
        return f"<tensor {list(self.shape)} {self.dtype or ''}>".replace(" >", ">")


class _StorageStub:
    __slots__ = ("dtype", "numel")

    def __init__(self, dtype, numel):
        self.dtype, self.numel = dtype, numel


def _rebuild_tensor(storage, storage_offset=0, size=(), *rest, **kw):
    return TensorStub(size, getattr(storage, "dtype", None))


def _rebuild_parameter(data, *rest, **kw):
    return data


def _identity(*args):
    return args[0] if args else None


_STUB_CLASSES: Dict[Tuple[str, str], type] = {}


def _stub_class(module: str, name: str, fast: bool = False) -> type:
    key = (module, name)
    cls = _STUB_CLASSES.get(key)
    if cls is None:
        cls = type(name, (FastStub if fast else Stub,), {"_name": f"{module}.{name}", "__module__": __name__})
        _STUB_CLASSES[key] = cls
    return cls


_TORCH_DTYPES = {
    "float32",
    "float",
    "float64",
    "double",
    "float16",
    "half",
    "bfloat16",
    "uint8",
    "int8",
    "int16",
    "short",
    "int32",
    "int",
    "int64",
    "long",
    "bool",
    "complex64",
    "complex128",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
    "uint16",
    "uint32",
    "uint64",
    "float4_e2m1fn_x2",
}
# Dataclasses of torch.distributed.checkpoint whose state is a plain dict.
_DCP_FAST = {
    "Metadata",
    "TensorStorageMetadata",
    "ChunkStorageMetadata",
    "BytesStorageMetadata",
    "MetadataIndex",
    "_StorageInfo",
    "StorageMeta",
}
_SAFE_BUILTINS = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("collections", "defaultdict"): collections.defaultdict,
    ("argparse", "Namespace"): argparse.Namespace,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "slice"): slice,
    ("builtins", "complex"): complex,
    ("builtins", "bytearray"): bytearray,
    ("builtins", "tuple"): tuple,
    ("builtins", "list"): list,
    ("builtins", "dict"): dict,
    ("builtins", "float"): float,
    ("builtins", "int"): int,
    ("_codecs", "encode"): lambda s, enc="utf-8": s.encode(enc),  # numpy arrays' bytes under protocol 2
    ("copyreg", "_reconstructor"): lambda cls, base, state=None: cls.__new__(cls),
    ("torch", "Size"): tuple,
    ("torch", "device"): _identity,
    ("torch.serialization", "_get_layout"): _identity,
    ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_tensor_v3"): _rebuild_tensor,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
}
# Module prefixes whose classes (dataclasses, enums, config objects) may appear as data and become
# inert stubs: Megatron's own (never imported), numpy's array/scalar/dtype reconstructors, DCP's.
_STUB_PREFIXES = (
    "megatron.",
    "numpy",
    "signal",
    "torch.distributed.checkpoint",
    "transformer_engine.",
    "pathlib",
    "enum",
    "datetime",
    "functools",
    "torch.distributed.tensor",
    "torch.distributed._tensor",
)
_STORAGE_RE = re.compile(r"^(\w*)Storage$")


def find_safe_global(module: str, name: str):
    """The stand-in for ``module.name`` or :class:`UnsafeGlobal`; never imports ``module``."""
    safe = _SAFE_BUILTINS.get((module, name))
    if safe is not None:
        return safe
    if module == "torch":
        if name in _TORCH_DTYPES:
            return f"torch.{name}"
        if name in ("strided", "sparse_coo", "contiguous_format", "channels_last", "preserve_format"):
            return f"torch.{name}"
        m = _STORAGE_RE.match(name)
        if m:  # torch.FloatStorage / torch.UntypedStorage: the storage type of a persistent id
            return f"torch.{name}"
    if module.startswith("torch.distributed.checkpoint") and name in _DCP_FAST:
        return _stub_class(module, name, fast=True)
    if module.startswith(_STUB_PREFIXES) and re.match(r"^_?[A-Za-z][A-Za-z0-9_]*$", name):
        return _stub_class(module, name)
    raise UnsafeGlobal(module, name)


class SafeUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        return find_safe_global(module, name)

    def persistent_load(self, pid):
        # torch.save zips: ('storage', storage_type, key, location, numel); the data itself stays in the zip.
        if isinstance(pid, tuple) and pid and pid[0] == "storage":
            numel = pid[4] if len(pid) > 4 else None
            return _StorageStub(pid[1], numel)
        raise pickle.UnpicklingError(f"unsupported persistent id {type(pid).__name__}")


def loads(data: bytes) -> Any:
    return load(io.BytesIO(data))


def load(f) -> Any:
    """The stand-in object of the pickle read from the binary file ``f``."""
    # Hundreds of thousands of small objects: the cyclic GC would rescan them again and again (it
    # doubled the load time of a 100k-chunk index); none of them can form a cycle worth collecting here.
    enabled = gc.isenabled()
    gc.disable()
    try:
        return SafeUnpickler(f).load()
    finally:
        if enabled:
            gc.enable()
