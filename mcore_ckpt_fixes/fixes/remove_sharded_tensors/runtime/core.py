"""remove-sharded-tensors in a job: the layers on ``TorchDistLoadShardedStrategy.remove_sharded_tensors``
(the strategy's removal) and on ``serialization.remove_sharded_tensors`` (the public call, 0.17-0.18),
and their probes. Why: the package's docstring, in full: doc.md."""

from __future__ import annotations

import sys
import types

from ....engine.layers import layer
from ....engine.patching import original
from ....engine.probing import in_scope, module_scope
from .. import CLASS, FUNCTION, ID, MODULE, SERIALIZATION

WRITER = "FileSystemWriter"
_NAMING_WRITERS: dict = {}  # torch's FileSystemWriter -> its subclass that names its metadata file


def _writer_names_its_metadata(writer_class) -> bool:
    """Whether torch's writer has the ``metadata_path`` the release's removal renames (older torch
    set it in ``__init__``; current torch computes the name where it writes)."""
    if hasattr(writer_class, "metadata_path"):
        return True
    inits = (vars(k).get("__init__") for k in writer_class.__mro__)
    return any("metadata_path" in getattr(getattr(f, "__code__", None), "co_names", ()) for f in inits)


def naming_writer(writer_class):
    """torch's writer, with ``metadata_path``: the checkpoint's ``.metadata`` file, the name torch's
    own writer writes the metadata under (and the release's removal computes beside it)."""
    if writer_class not in _NAMING_WRITERS:

        def metadata_path(self):
            return self.fs.concat_path(self.path, ".metadata")

        _NAMING_WRITERS[writer_class] = type(
            writer_class.__name__, (writer_class,), {"metadata_path": property(metadata_path), "__module__": __name__}
        )
    return _NAMING_WRITERS[writer_class]


@layer(ID, MODULE, FUNCTION, owner=CLASS)
def remove_sharded_tensors(below_us, self, checkpoint_dir, key_prefix):
    """The release's removal, given the directory as a ``Path`` (it removes each file as
    ``checkpoint_dir / name``, a ``TypeError`` for the ``str`` its signature asks for, after renaming
    the metadata); where torch's writer no longer has the ``metadata_path`` it renames, the release's
    own code run with a writer that names it (in a copy of its module's globals: the live module is
    left as it is)."""
    from pathlib import Path

    checkpoint_dir = Path(checkpoint_dir)
    module = sys.modules[MODULE]
    writer = vars(module).get(WRITER)
    if writer is None or _writer_names_its_metadata(writer):
        return below_us(self, checkpoint_dir, key_prefix)
    release = original(getattr(module, CLASS), FUNCTION)
    return in_scope(release, module_scope(module, **{WRITER: naming_writer(writer)}))(self, checkpoint_dir, key_prefix)


def probe(module: types.ModuleType):
    cls = module.__dict__.get(CLASS)
    writer = module.__dict__.get(WRITER)
    if cls is None or FUNCTION not in vars(cls) or writer is None:
        return None, f"{MODULE} has no {CLASS}.{FUNCTION} (or no {WRITER})"
    names = original(cls, FUNCTION).__code__.co_names
    if not {"read_metadata", "rename", "rm_file"} <= set(names):
        return None, f"{CLASS}.{FUNCTION} is not the metadata rewrite and file removal this fix knows"
    if "metadata_path" not in names:
        return False, f"{CLASS}.{FUNCTION} names the metadata file itself"
    if _writer_names_its_metadata(writer):
        return False, f"{CLASS}.{FUNCTION} renames {WRITER}.metadata_path, which this torch's writer has"
    return True, (
        f"{CLASS}.{FUNCTION} renames {WRITER}.metadata_path, which this torch's writer does not have: "
        f"AttributeError after writing .metadata.tmp"
    )


# -- the public call: serialization.remove_sharded_tensors --------------------------------------------


@layer(ID, SERIALIZATION, FUNCTION)
def public_remove_sharded_tensors(below_us, checkpoint_dir, key_prefix):
    """``dist_checkpointing.remove_sharded_tensors``: the checkpoint verified as the release verifies
    it, then the removal of the strategy that has one (the load strategy's, an instance)."""
    serialization = sys.modules[SERIALIZATION]
    serialization.verify_checkpoint(checkpoint_dir)
    return getattr(serialization, "TorchDistLoadShardedStrategy")().remove_sharded_tensors(checkpoint_dir, key_prefix)


def probe_serialization(module: types.ModuleType):
    fn = module.__dict__.get(FUNCTION)
    if fn is None:
        return None, f"{SERIALIZATION} has no {FUNCTION}"
    release = original(module, FUNCTION)
    names = release.__code__.co_names
    save = module.__dict__.get("TorchDistSaveShardedStrategy")
    if "TorchDistSaveShardedStrategy" in names and save is not None and not hasattr(save, FUNCTION):
        if "verify_checkpoint" not in vars(module) or "TorchDistLoadShardedStrategy" not in vars(module):
            return None, f"{SERIALIZATION}.{FUNCTION} calls a missing method, and the module has no load strategy"
        return True, (
            f"{SERIALIZATION}.{FUNCTION} calls TorchDistSaveShardedStrategy.{FUNCTION}, which that class does "
            f"not have: AttributeError"
        )
    if FUNCTION in names:
        return False, f"{SERIALIZATION}.{FUNCTION} calls a strategy that has the method"
    return None, f"{SERIALIZATION}.{FUNCTION} calls no strategy's {FUNCTION}: not the code this fix knows"
