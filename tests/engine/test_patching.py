"""engine/patching.py: a replacement that is a module (a fix's stand-in for a module another module
imported, e.g. its ``np``) is reverted like a function: every binding of it points back at the
original, while its own package keeps it as its submodule, so the next apply finds it again (a
fresh interpreter)."""

import textwrap

from conftest import check_py

MODULES = {
    "target.py": "import math as np\n",
    "late.py": "from target import np as bound\n",  # imported while the replacement is in place
    "fixpkg/__init__.py": "",
    "fixpkg/stand_in.py": "import math\n__mcore_ckpt_fix__ = 'x'\nextra = 1\n\n\ndef __getattr__(name):\n    return getattr(math, name)\n",
}


def test_module_replacement_reverts_its_bindings_and_stays_in_its_package(tmp_path):
    for name, text in MODULES.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    out = check_py(
        textwrap.dedent(
            """
            import importlib, math
            import fixpkg, target
            from mcore_ckpt_fixes.engine.patching import Patcher
            p = Patcher("x")
            p.replace(target, "np", importlib.import_module("fixpkg.stand_in"))
            import late
            print(target.np.extra, target.np.pi == math.pi, late.bound is fixpkg.stand_in)
            p.revert()
            print(target.np is math, late.bound is math, fixpkg.stand_in.__name__)
            p.replace(target, "np", importlib.import_module("fixpkg.stand_in"))
            print(target.np is fixpkg.stand_in)
            """
        ),
        env={"PYTHONPATH": str(tmp_path)},
    )
    assert out.strip().splitlines()[-3:] == ["1 True True", "True True fixpkg.stand_in", "True"], out
