"""A target gated by another package's version (a framework's own copy of the buggy code).

No framework is needed for this: a tiny installed distribution ``fakefw`` (a real ``.dist-info``
that ``importlib.metadata`` reads) with one module stands in for one, so the engine's gating is
checked on its own. The real frameworks' targets are tested with the frameworks installed.
"""

import os
import textwrap

import pytest

from conftest import check_py

pytestmark = pytest.mark.one_line  # the whole matrix runs it on one line (tools/test.sh)


def _site(tmp_path, version):
    site = tmp_path / f"site-{version}"
    (site / "fakefw").mkdir(parents=True)
    (site / "fakefw" / "__init__.py").write_text("")
    (site / "fakefw" / "ckpt.py").write_text("def get_rng_state():\n    return 'per (pp, tp)'\n")
    dist = site / f"fakefw-{version}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: fakefw\nVersion: {version}\n")
    # The fix's patch module, referenced by string: imported only when fakefw.ckpt is.
    (site / "fakefw_fix_patch.py").write_text(
        textwrap.dedent("""
        IMPORTED = True

        def probe(module):
            return True, "fakefw keys its RNG state by (pp, tp)"

        def fixed_get_rng_state():
            return "per rank"

        def apply(module, patcher):
            patcher.replace_function(module, "get_rng_state", fixed_get_rng_state)
    """)
    )
    return str(site)


CODE = """
import sys
import mcore_ckpt_fixes
from mcore_ckpt_fixes.engine.fix import Fix, Target
from mcore_ckpt_fixes.engine.registry import ENGINE

# The fix's affected range speaks of Megatron-Core and excludes everything: the target's own
# package range must decide.
ENGINE.register(Fix(id="fakefw-rng", summary="test", affected="<0", upstream=("test",), targets=(
    Target("fakefw.ckpt", "fakefw_fix_patch:probe", "fakefw_fix_patch:apply", package="fakefw", affected="<1.3"),
)))
mcore_ckpt_fixes.apply()
assert "fakefw_fix_patch" not in sys.modules, "a string-referenced patch module was imported before its target"
row = {r["id"]: r for r in mcore_ckpt_fixes.report()}["fakefw-rng"]
print("BEFORE", row["state"])
import fakefw.ckpt
row = {r["id"]: r for r in mcore_ckpt_fixes.report()}["fakefw-rng"]
print("AFTER", row["state"], "|", row["reason"])
print("CALL", fakefw.ckpt.get_rng_state())
mcore_ckpt_fixes.revert()
print("REVERTED", fakefw.ckpt.get_rng_state())
"""


@pytest.mark.parametrize(
    "version,state,call", [("1.2.0", "applied", "per rank"), ("1.4.0", "not-needed", "per (pp, tp)")]
)
def test_target_gated_by_its_own_package(tmp_path, version, state, call):
    out = check_py(CODE, env={"PYTHONPATH": _site(tmp_path, version)})
    lines = dict(line.split(" ", 1) for line in out.strip().splitlines())
    assert lines["BEFORE"] == "pending"
    got_state, reason = lines["AFTER"].split(" | ")
    assert got_state == state
    if state == "applied":
        assert reason == "fakefw.ckpt: fakefw keys its RNG state by (pp, tp)"
    else:
        assert reason == f"fakefw.ckpt: fakefw {version} is outside the affected range <1.3"
    assert lines["CALL"] == call
    assert lines["REVERTED"] == "per (pp, tp)"


def test_unparseable_or_absent_package_version_leaves_the_probe_to_decide(tmp_path):
    site = _site(tmp_path, "1.2.0")
    os.rename(os.path.join(site, "fakefw-1.2.0.dist-info"), os.path.join(site, "unrelated"))
    out = check_py(CODE, env={"PYTHONPATH": site})
    # No fakefw distribution: reported not applicable until the module is imported anyway (a
    # source tree on the path), then patched as usual.
    assert "BEFORE not-applicable" in out
    assert "AFTER applied" in out


STATUS = """
import sys
import mcore_ckpt_fixes
from mcore_ckpt_fixes.engine.fix import Fix, Target
from mcore_ckpt_fixes.engine.registry import ENGINE
from mcore_ckpt_fixes.cli import status

ENGINE.register(Fix(id="fakefw-rng", summary="test", affected="<0", upstream=("test",), targets=(
    Target("fakefw.ckpt", "fakefw_fix_patch:probe", "fakefw_fix_patch:apply", package="fakefw", affected="<1.3"),
)))
mcore_ckpt_fixes.apply()
status.run(as_json=False, import_targets_first=True)
print("IMPORTED", "fakefw.ckpt" in sys.modules)
"""


@pytest.mark.parametrize("installed", [True, False])
def test_status_names_each_framework_target(tmp_path, installed):
    """status lists a fix's framework targets one per line; one that is not installed is
    not-applicable and status does not try to import it."""
    out = check_py(STATUS, env={"PYTHONPATH": _site(tmp_path, "1.2.0") if installed else str(tmp_path)})
    row = [line for line in out.splitlines() if "fakefw-rng" in line][0]
    if installed:
        assert "applied" in row and "IMPORTED True" in out
        assert "fakefw.ckpt (fakefw): applied" in out
    else:
        assert "not-applicable" in row and "fakefw is not installed" in row and "IMPORTED False" in out
        assert "fakefw.ckpt (fakefw): not-applicable" in out
