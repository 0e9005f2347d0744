"""Write a fix's source diff for one release: ``python tools/patchgen FIX_ID SRC_ROOT RELEASE``.

SRC_ROOT holds the pristine sources (an unpacked wheel: SRC_ROOT/megatron/core/...). RELEASE is a
Megatron-Core release, or ``<dist>-<version>`` for a framework's own copy of the code (SRC_ROOT then
holds that framework's unpacked wheel), as the fix's diff modules accept. The edits come
from ``mcore_ckpt_fixes/fixes/<fix>/diff/<target>.py`` (``core`` for Megatron-Core, the framework's
short name otherwise: :func:`mcore_ckpt_fixes.sourcediff.fix_edits`); see CONTRIBUTING.md.
"""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(fix_id: str, src_root: str, release: str) -> None:
    sys.path.insert(0, ROOT)
    sys.stdout.write(render_fix(fix_id, src_root, release))


def render_fix(fix_id: str, src_root: str, release: str) -> str:
    from mcore_ckpt_fixes.sourcediff import fix_edits, render

    return render(src_root, fix_edits(fix_id, release))


if __name__ == "__main__":
    if len(sys.argv) != 4:
        raise SystemExit("usage: python tools/patchgen FIX_ID SRC_ROOT RELEASE")
    main(*sys.argv[1:])
