"""How a fix declares itself. Every package (or module) in ``mcore_ckpt_fixes.fixes`` defines ``FIX = Fix(...)``."""

from __future__ import annotations

# Plain classes, no dataclasses/typing: ``import mcore_ckpt_fixes`` must stay far below 1 % of
# ``import megatron.core``, and those two modules alone cost more than the rest of the package.


class Target:
    """One module a fix patches, applied when that module is (or already was) imported.

    probe(module) -> (verdict, reason): True, the bug is there; False, fixed upstream; None, the
    feature it patches is absent. apply(module, patcher) makes the changes through the patcher.
    Both may be given as ``"package.module:function"`` strings, imported only when the target module
    is reached: a fix package's ``__init__`` declares, its ``patch`` module does the work, and
    ``import mcore_ckpt_fixes`` imports declarations only.

    alias_sites: modules known to bind the patched names with ``from module import name`` (the
    engine rebinds by identity in every loaded module anyway; listed for reviewers and tests).

    package: the distribution whose version gates this target (``"megatron-core"`` by default; a
    framework that keeps its own copy of the buggy code, such as ``"verl"``, is gated by its own
    version, whatever Megatron-Core it runs on). affected: PEP 440 specifiers of that package's
    affected releases; None means the fix's own ``affected`` (which speaks of Megatron-Core).
    """

    __slots__ = ("module", "_probe", "_apply", "alias_sites", "package", "affected", "_spec")

    def __init__(self, module, probe, apply, alias_sites=(), package="megatron-core", affected=None):
        self.module = module
        self._probe = probe
        self._apply = apply
        self.alias_sites = tuple(alias_sites)
        self.package = package
        self.affected = affected
        self._spec = None

    @property
    def probe(self):
        if isinstance(self._probe, str):
            self._probe = _resolve(self._probe)
        return self._probe

    @property
    def apply(self):
        if isinstance(self._apply, str):
            self._apply = _resolve(self._apply)
        return self._apply

    @property
    def gated_by_megatron(self) -> bool:
        return self.package == "megatron-core"

    def specifiers(self, fix):
        """The SpecifierSet this target's package version is checked against."""
        if self.affected is None:
            return fix.specifiers
        if self._spec is None:
            from packaging.specifiers import SpecifierSet

            self._spec = SpecifierSet(self.affected, prereleases=True)
        return self._spec

    def __repr__(self):
        return f"Target({self.module!r})"


def _resolve(ref: str):
    import importlib

    module_name, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module_name), attr)


class Fix:
    """A fix's declaration. ``affected``: PEP 440 specifiers, prereleases included.

    ``implemented=False``: registered but not written yet; status says so and nothing is patched.
    """

    # home: the package (or module) that declared the fix, set by discovery; a fix's scenarios
    # live in ``<home>.scenarios``.
    __slots__ = ("id", "summary", "affected", "upstream", "targets", "implemented", "tracking", "_spec", "home")

    def __init__(self, id, summary, affected, upstream=(), targets=(), implemented=True, tracking=""):
        self.id = id
        self.summary = summary
        self.affected = affected
        self.upstream = tuple(upstream)
        self.targets = tuple(targets)
        self.implemented = implemented
        self.tracking = tracking
        self._spec = None
        self.home = None

    @property
    def specifiers(self):
        if self._spec is None:
            from packaging.specifiers import SpecifierSet

            self._spec = SpecifierSet(self.affected, prereleases=True)
        return self._spec

    def __repr__(self):
        return f"Fix({self.id!r})"
