"""How a fix declares itself. Every module in ``mcore_ckpt_fixes.fixes`` defines ``FIX = Fix(...)``."""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Callable, Optional, Tuple

from packaging.specifiers import SpecifierSet

from .patching import Patcher

# A probe looks at the imported target module and answers (verdict, reason):
# True: the bug is there; False: fixed upstream; None: the feature it patches is absent.
Probe = Callable[[types.ModuleType], Tuple[Optional[bool], str]]
Apply = Callable[[types.ModuleType, Patcher], None]


@dataclass(frozen=True)
class Target:
    """One module a fix patches, applied when that module is (or already was) imported."""

    module: str
    probe: Probe
    apply: Apply
    # Modules known to bind the patched names with ``from module import name``; the engine rebinds
    # by identity in every loaded module anyway, these are listed for reviewers and tests.
    alias_sites: Tuple[str, ...] = ()


@dataclass(frozen=True)
class Fix:
    id: str
    summary: str
    affected: str  # PEP 440 specifiers, prereleases included
    upstream: Tuple[str, ...] = ()
    targets: Tuple[Target, ...] = ()
    # Registered but not written yet: status says so and nothing is patched.
    implemented: bool = True
    tracking: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def specifiers(self) -> SpecifierSet:
        return SpecifierSet(self.affected, prereleases=True)
