"""How a fix declares itself. Every module in ``mcore_ckpt_fixes.fixes`` defines ``FIX = Fix(...)``."""

from __future__ import annotations

# Plain classes, no dataclasses/typing: ``import mcore_ckpt_fixes`` must stay far below 1 % of
# ``import megatron.core``, and those two modules alone cost more than the rest of the package.


class Target:
    """One module a fix patches, applied when that module is (or already was) imported.

    probe(module) -> (verdict, reason): True, the bug is there; False, fixed upstream; None, the
    feature it patches is absent. apply(module, patcher) makes the changes through the patcher.
    alias_sites: modules known to bind the patched names with ``from module import name`` (the
    engine rebinds by identity in every loaded module anyway; listed for reviewers and tests).
    """

    __slots__ = ("module", "probe", "apply", "alias_sites")

    def __init__(self, module, probe, apply, alias_sites=()):
        self.module = module
        self.probe = probe
        self.apply = apply
        self.alias_sites = tuple(alias_sites)

    def __repr__(self):
        return f"Target({self.module!r})"


class Fix:
    """A fix's declaration. ``affected``: PEP 440 specifiers, prereleases included.

    ``implemented=False``: registered but not written yet; status says so and nothing is patched.
    """

    __slots__ = ("id", "summary", "affected", "upstream", "targets", "implemented", "tracking", "_spec")

    def __init__(self, id, summary, affected, upstream=(), targets=(), implemented=True, tracking=""):
        self.id = id
        self.summary = summary
        self.affected = affected
        self.upstream = tuple(upstream)
        self.targets = tuple(targets)
        self.implemented = implemented
        self.tracking = tracking
        self._spec = None

    @property
    def specifiers(self):
        if self._spec is None:
            from packaging.specifiers import SpecifierSet

            self._spec = SpecifierSet(self.affected, prereleases=True)
        return self._spec

    def __repr__(self):
        return f"Fix({self.id!r})"
