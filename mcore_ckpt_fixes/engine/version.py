"""Find which Megatron-Core the process will import, without importing it.

A Megatron-LM checkout on PYTHONPATH shadows any installed wheel, and its ``package_info.py`` may
name a release its code does not match yet; we report the source so ``status`` can say so, and the
fixes' behavioural probes have the last word.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys


class MegatronInfo:
    __slots__ = ("version", "source", "path")

    def __init__(self, version, source, path):
        self.version = version  # packaging Version or None
        self.source = source  # "wheel", "checkout" or "absent"
        self.path = path

    def describe(self) -> str:
        if self.source == "absent":
            return "Megatron-Core not found"
        return f"Megatron-Core {self.version or 'unknown version'} ({self.source}: {self.path})"


_FIELD = re.compile(r"^(MAJOR|MINOR|PATCH|PRE_RELEASE)\s*=\s*(.+?)\s*$", re.M)


def _read_package_info(core_dir: str):
    try:
        with open(os.path.join(core_dir, "package_info.py"), encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return None
    from packaging.version import InvalidVersion, Version

    fields = {k: v.strip("'\"") for k, v in _FIELD.findall(text)}
    try:
        return Version(f"{fields['MAJOR']}.{fields['MINOR']}.{fields['PATCH']}{fields.get('PRE_RELEASE', '')}")
    except (KeyError, InvalidVersion):
        return None


def _megatron_search_paths() -> list[str]:
    mod = sys.modules.get("megatron")
    if mod is not None and getattr(mod, "__path__", None):
        return list(mod.__path__)
    try:
        spec = importlib.util.find_spec("megatron")  # top level: imports nothing
    except (ImportError, ValueError):
        return []
    if spec is None or not spec.submodule_search_locations:
        return []
    return list(spec.submodule_search_locations)


def detect() -> MegatronInfo:
    for pkg_dir in _megatron_search_paths():
        core_dir = os.path.join(pkg_dir, "core")
        if not os.path.isdir(core_dir):
            continue
        version = _read_package_info(core_dir)
        site = os.path.dirname(pkg_dir)
        has_dist_info = any(n.startswith("megatron_core-") and n.endswith(".dist-info") for n in os.listdir(site))
        return MegatronInfo(version, "wheel" if has_dist_info else "checkout", pkg_dir)
    return MegatronInfo(None, "absent", None)


def package_version(distribution: str):
    """The installed version of ``distribution`` (a packaging Version), or None when it is not
    installed as a distribution or its version does not parse (a source tree on the path)."""
    from importlib import metadata

    from packaging.version import InvalidVersion, Version

    try:
        return Version(metadata.version(distribution))
    except (metadata.PackageNotFoundError, InvalidVersion):
        return None


def ships_module(distribution: str, module: str):
    """Does the installed ``distribution`` ship ``module`` (``a/b/c.py`` or ``a/b/c/__init__.py`` in
    its file list)? None when that cannot be told (not installed, no RECORD)."""
    from importlib import metadata

    try:
        files = metadata.files(distribution)
    except metadata.PackageNotFoundError:
        return None
    if not files:
        return None
    path = module.replace(".", "/")
    wanted = {f"{path}.py", f"{path}/__init__.py"}
    return any(str(f).replace("\\", "/") in wanted for f in files)
