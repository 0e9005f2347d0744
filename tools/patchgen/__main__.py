"""Write a fix's source diff for one release: ``python tools/patchgen FIX_ID SRC_ROOT RELEASE``.

SRC_ROOT holds the pristine sources (an unpacked wheel: SRC_ROOT/megatron/core/...). RELEASE is a
Megatron-Core release, or ``<dist>-<version>`` for a framework's own copy of the code (SRC_ROOT then
holds that framework's unpacked wheel), as the fix's ``source_edits`` accepts. The edits come
from the fix's ``diff`` package, ``mcore_ckpt_fixes/fixes/<fix>/diff/`` (``source_edits(release)``,
which dispatches per target); see :mod:`mcore_ckpt_fixes.sourcediff` and CONTRIBUTING.md.
"""

import importlib
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(fix_id: str, src_root: str, release: str) -> None:
    sys.path.insert(0, ROOT)
    sys.stdout.write(render_fix(fix_id, src_root, release))


def render_fix(fix_id: str, src_root: str, release: str) -> str:
    pkg = fix_id.replace("-", "_")
    home = os.path.join(ROOT, "mcore_ckpt_fixes", "fixes", pkg)
    if not os.path.isfile(os.path.join(home, "diff", "__init__.py")):
        raise SystemExit(f"patchgen: no fix {fix_id!r} with a diff package (mcore_ckpt_fixes/fixes/{pkg}/diff/)")
    from mcore_ckpt_fixes.sourcediff import render

    diff = importlib.import_module(f"mcore_ckpt_fixes.fixes.{pkg}.diff")
    return render(src_root, diff.source_edits(release))


if __name__ == "__main__":
    if len(sys.argv) != 4:
        raise SystemExit("usage: python tools/patchgen FIX_ID SRC_ROOT RELEASE")
    main(*sys.argv[1:])
