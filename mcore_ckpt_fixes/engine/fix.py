"""How a fix declares itself. Every package (or module) in ``mcore_ckpt_fixes.fixes`` defines ``FIX = Fix(...)``."""

from __future__ import annotations

# Plain classes, no dataclasses/typing: ``import mcore_ckpt_fixes`` must stay far below 1 % of
# ``import megatron.core``, and those two modules alone cost more than the rest of the package.


class Target:
    """One module a fix patches, applied when that module is (or already was) imported.

    probe(module) -> (verdict, reason): True, the bug is there; False, fixed upstream; None, the
    feature it patches is absent. apply(module, patcher) makes the changes through the patcher;
    a runtime module without ``apply`` puts on the layers it declares (:mod:`.layers`).
    By convention both live in the fix's ``runtime/<name>.py`` (:func:`runtime_module`: ``core``
    for Megatron-Core, the framework's short name otherwise) as ``probe`` and ``apply``; only
    exceptions are spelt out, as a function name in that module (``"probe_radio"``), a
    ``"package.module:function"`` string, or a callable. Strings are imported only when the target
    module is reached: ``import mcore_ckpt_fixes`` imports declarations only.

    alias_sites: modules known to bind the patched names with ``from module import name`` (the
    engine rebinds by identity in every loaded module anyway; listed for reviewers and tests).

    package: the distribution whose version gates this target (``"megatron-core"`` by default; a
    framework that keeps its own copy of the buggy code, such as ``"verl"``, is gated by its own
    version, whatever Megatron-Core it runs on). affected: PEP 440 specifiers of that package's
    affected releases; None means the fix's own ``affected`` (which speaks of Megatron-Core).
    """

    __slots__ = ("module", "_probe", "_apply", "alias_sites", "package", "affected", "_spec", "home")

    def __init__(self, module, probe="probe", apply="apply", alias_sites=(), package="megatron-core", affected=None):
        self.module = module
        self._probe = probe
        self._apply = apply
        self.alias_sites = tuple(alias_sites)
        self.package = package
        self.affected = affected
        self._spec = None
        self.home = None  # the declaring fix's package, set by discovery: where the runtime lives

    @property
    def runtime(self) -> str:
        """The module this target's probe and apply live in unless spelt out."""
        return f"{self.home}.runtime.{runtime_module(self.package)}"

    @property
    def probe(self):
        if isinstance(self._probe, str):
            self._probe = self._resolve(self._probe)
        return self._probe

    @property
    def apply(self):
        if isinstance(self._apply, str):
            self._apply = self._resolve(self._apply, default=_apply_declared_layers)
        return self._apply

    def _resolve(self, ref: str, default=None):
        """``"name"`` in this target's runtime module, or ``"package.module:name"``. A runtime that
        lacks the conventional name gets ``default(runtime)`` when one is given."""
        import importlib

        module_name, _, attr = ref.rpartition(":")
        runtime = importlib.import_module(module_name or self.runtime)
        if default is not None and not module_name and not hasattr(runtime, attr):
            return default(runtime)
        return getattr(runtime, attr)

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


def _apply_declared_layers(runtime):
    """The conventional apply of a runtime module with no ``apply``: its ``@layer`` declarations."""
    from .layers import apply_layers

    def apply(module, patcher):
        apply_layers(runtime, module, patcher)

    return apply


def runtime_module(package: str) -> str:
    """The runtime module's name for a target gated by ``package``: ``core`` for Megatron-Core,
    else the distribution's short name (megatron-bridge: ``bridge``, nemo-toolkit: ``nemo``,
    ms-swift: ``ms_swift``, verl: ``verl``)."""
    return package.removeprefix("megatron-").removesuffix("-toolkit").replace("-", "_")


class Fix:
    """A fix's declaration. ``affected``: PEP 440 specifiers, prereleases included.

    ``implemented=False``: registered but not written yet; status says so and nothing is patched.
    """

    # home: the package that declared the fix, set by discovery (:meth:`settle`); its round trips
    # live in ``<home>.checks.scenarios``, its runtime in ``<home>.runtime``.
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

    def settle(self, home: str) -> "Fix":
        """Record where the fix was declared, which is where its targets' runtime lives."""
        self.home = home
        for target in self.targets:
            target.home = home
        return self

    @property
    def specifiers(self):
        if self._spec is None:
            from packaging.specifiers import SpecifierSet

            self._spec = SpecifierSet(self.affected, prereleases=True)
        return self._spec

    def __repr__(self):
        return f"Fix({self.id!r})"
