"""Megatron's argument parser, built without re-reading its config classes' source in every rank.

From 0.17, ``megatron.training``'s ``parse_args`` builds its argument groups from config dataclasses
(``ArgumentGroupFactory``), and each factory takes every field's help text from the class's source:
``inspect.getsource`` and ``ast.parse`` of ``TransformerConfig`` and a dozen others. On this CPU host
that is most of ``parse_args`` (about 0.25 s) and a third of a small world's rank, paid again in
every rank of every world. The help texts are a function of the class alone, so the world's parent
reads them once (:func:`warm`, into this module's own dict: nothing of Megatron's is touched there)
and each forked rank's factories look them up (:func:`install`, in the rank only). A class the parent
did not read is read as the release reads it; releases without the factory are left as they are.
"""

from __future__ import annotations

import dataclasses
import sys

FACTORY_MODULE = "megatron.training.argument_utils"
TRAINING_PACKAGE = "megatron.training"
HELP_TEXTS: dict = {}  # config class -> its fields' help texts, as the release's factory reads them
UNREADABLE: set = set()


def _release_reader():
    factory = getattr(sys.modules.get(FACTORY_MODULE), "ArgumentGroupFactory", None)
    return getattr(factory, "_get_field_docstrings", None)


class _Reader:
    """What the release's reader calls ``self``: it recurses into base classes through it."""

    def __init__(self, read):
        self._read = read

    def _get_field_docstrings(self, cls):
        if cls not in HELP_TEXTS:
            HELP_TEXTS[cls] = self._read(self, cls)
        return dict(HELP_TEXTS[cls])


def warm() -> None:
    """In a world's parent: read the help texts of the config dataclasses that ``megatron.training``'s
    modules define or import (those the factories are built from among them), where the parent
    imported them; once per class."""
    read = _release_reader()
    if read is None:
        return
    reader = _Reader(read)
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith(TRAINING_PACKAGE):
            continue
        for value in list(vars(module).values()):
            if isinstance(value, type) and dataclasses.is_dataclass(value) and value not in HELP_TEXTS:
                if value in UNREADABLE:
                    continue
                try:
                    reader._get_field_docstrings(value)
                except Exception:  # its source cannot be read: the rank reads it as the release does
                    UNREADABLE.add(value)


def install() -> None:
    """In a forked rank: the factories look up what the parent read (a copy each time, as the release
    returns a new dict), and read any other class as the release does."""
    read = _release_reader()
    if read is None or not HELP_TEXTS:
        return

    def _get_field_docstrings(self, src_cfg_class):
        if src_cfg_class in HELP_TEXTS:
            return dict(HELP_TEXTS[src_cfg_class])
        return read(self, src_cfg_class)

    sys.modules[FACTORY_MODULE].ArgumentGroupFactory._get_field_docstrings = _get_field_docstrings
