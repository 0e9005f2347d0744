"""One read of a checkpoint's ``.metadata`` per load, however many parts of the load ask for it.

Some fixes decide what a load asks for from the checkpoint's metadata (rng-under-ep: which RNG layout
is stored; mimo-optimizer: which MIMO key layout). Reading it themselves would add a whole
``.metadata`` read per rank to every resume (135 MB at 1M chunks; on 1,000+ ranks and a parallel
file system that is seconds and a metadata storm). So they read it inside a :func:`shared_metadata`
scope, opened around the load they wrap, and Megatron-Core's own readers (every
``_get_filesystem_reader`` of ``megatron.core.dist_checkpointing.strategies.torch``, wherever it is
bound: the torch_dist strategy, 0.19's common-state load in ``serialization``, Megatron-Bridge's
fsdp_dtensor load) hand out the same parsed ``Metadata`` within that scope. A patched load then reads
``.metadata`` once per rank, as an unpatched 0.17/0.18 load does (0.19's unpatched load reads it
twice: once for the common state, once for the tensors; within a scope, once).

Outside a scope every reader behaves exactly as Megatron's: nothing is cached across loads (a
checkpoint rewritten at the same path is read afresh), and a reader's own ``read_metadata`` is
untouched.

The replacement is shared by the fixes that use it: whichever applies first installs it (``mark``ed,
so the second sees it in place), revert restores Megatron's function. A fix whose scope finds no
replacement installed (the other fix reverted it) still works: its own read is then one more.
"""

from __future__ import annotations

import contextlib
import contextvars
import os

from .engine.patching import mark, original

MODULE = "megatron.core.dist_checkpointing.strategies.torch"
NAME = "_get_filesystem_reader"

# {checkpoint location: Metadata} while a load runs inside shared_metadata(); None outside.
_SCOPE = contextvars.ContextVar("mcore_ckpt_fixes_shared_metadata", default=None)


@contextlib.contextmanager
def shared_metadata():
    """Within: each checkpoint's ``.metadata`` is read once, by whichever reader asks first. Nested
    scopes share the outermost one (a wrapped ``_load_global_dist_base_checkpoint`` around a
    wrapped ``dist_checkpointing.load``)."""
    if _SCOPE.get() is not None:
        yield
        return
    token = _SCOPE.set({})
    try:
        yield
    finally:
        _SCOPE.reset(token)


def _location(checkpoint_dir) -> str:
    text = os.fspath(checkpoint_dir)
    return text if "://" in text else os.path.abspath(text)  # MSC URLs stay as they are


def _share(reader, checkpoint_dir):
    """``reader`` whose ``read_metadata`` answers from the scope's copy (reading it the first time)."""
    memo = _SCOPE.get()
    if memo is None:
        return reader
    key = _location(checkpoint_dir)
    own = reader.read_metadata

    def read_metadata(*args, **kwargs):
        metadata = memo.get(key)
        if metadata is None:
            metadata = memo[key] = own(*args, **kwargs)
        else:
            # What torch's FileSystemReader.read_metadata stamps on what it returns: this reader's id.
            storage_meta = getattr(metadata, "storage_meta", None)
            if storage_meta is not None and hasattr(reader, "load_id"):
                storage_meta.load_id = reader.load_id
        return metadata

    reader.read_metadata = read_metadata  # this instance only: the class and other readers untouched
    return reader


@mark("shared")
def get_filesystem_reader(checkpoint_dir, *args, **kwargs):
    """Megatron-Core's ``_get_filesystem_reader``; inside a :func:`shared_metadata` scope its reader
    shares the scope's parsed ``.metadata``."""
    return _share(original(MODULE, NAME)(checkpoint_dir, *args, **kwargs), checkpoint_dir)


def install(patcher) -> None:
    """Put :func:`get_filesystem_reader` in place of Megatron's (and of every binding of it by name);
    a no-op where it is already there (another fix installed it)."""
    import importlib

    module = importlib.import_module(MODULE)
    if hasattr(module, NAME):
        patcher.replace_function(module, NAME, get_filesystem_reader)


def read_metadata(checkpoint_dir):
    """The checkpoint's DCP ``Metadata``, through Megatron's reader (MSC URLs work as for the load
    itself): shared within a :func:`shared_metadata` scope."""
    try:
        reader = get_filesystem_reader(checkpoint_dir)
    except (ImportError, AttributeError):  # a Megatron-Core without that helper
        from torch.distributed.checkpoint import FileSystemReader

        reader = _share(FileSystemReader(os.fspath(checkpoint_dir)), checkpoint_dir)
    return reader.read_metadata()
