"""Flag parsing: accepted values, precedence, and one-line errors naming the variable."""

import json

import pytest

from conftest import run_cli, run_py
from mcore_ckpt_fixes.engine.errors import FlagError
from mcore_ckpt_fixes.engine.flags import env_var_for, parse

pytestmark = pytest.mark.one_line  # the whole matrix runs it on one line (tools/test.sh)

IDS = ["tp-group", "gdn-fsdp-split"]


def test_env_var_names():
    assert env_var_for("gdn-fsdp-split") == "MCORE_CKPT_FIX_GDN_FSDP_SPLIT"


@pytest.mark.parametrize(
    "environ, expected",
    [
        ({}, {"tp-group": "auto", "gdn-fsdp-split": "auto"}),
        ({"MCORE_CKPT_FIXES": "off"}, {"tp-group": "off", "gdn-fsdp-split": "off"}),
        (
            {"MCORE_CKPT_FIXES": "OFF", "MCORE_CKPT_FIX_TP_GROUP": "require"},
            {"tp-group": "off", "gdn-fsdp-split": "off"},
        ),
        ({"MCORE_CKPT_FIXES": "tp-group"}, {"tp-group": "auto", "gdn-fsdp-split": "off"}),
        ({"MCORE_CKPT_FIXES": " tp-group , gdn-fsdp-split "}, {"tp-group": "auto", "gdn-fsdp-split": "auto"}),
        (
            {"MCORE_CKPT_FIXES": "tp-group", "MCORE_CKPT_FIX_GDN_FSDP_SPLIT": "on"},
            {"tp-group": "auto", "gdn-fsdp-split": "on"},
        ),
        ({"MCORE_CKPT_FIX_TP_GROUP": "off"}, {"tp-group": "off", "gdn-fsdp-split": "auto"}),
        ({"MCORE_CKPT_FIX_TP_GROUP": "Require"}, {"tp-group": "require", "gdn-fsdp-split": "auto"}),
        ({"MCORE_CKPT_FIXES_AUTO": "1"}, {"tp-group": "auto", "gdn-fsdp-split": "auto"}),
    ],
)
def test_modes(environ, expected):
    assert dict(parse(IDS, environ).modes) == expected


@pytest.mark.parametrize(
    "environ, var, accepted",
    [
        (
            {"MCORE_CKPT_FIXES": "sometimes"},
            "MCORE_CKPT_FIXES",
            "auto, off, or a comma list of tp-group, gdn-fsdp-split",
        ),
        ({"MCORE_CKPT_FIXES": "tp-group,nope"}, "MCORE_CKPT_FIXES", "auto, off, or a comma list of"),
        ({"MCORE_CKPT_FIXES": ","}, "MCORE_CKPT_FIXES", "auto, off, or a comma list of"),
        ({"MCORE_CKPT_FIX_TP_GROUP": "yes"}, "MCORE_CKPT_FIX_TP_GROUP", "auto, off, on, require"),
        ({"MCORE_CKPT_FIX_TP_GROUP": ""}, "MCORE_CKPT_FIX_TP_GROUP", "auto, off, on, require"),
        (
            {"MCORE_CKPT_FIX_TP_GROUPS": "on"},
            "MCORE_CKPT_FIX_TP_GROUPS",
            "MCORE_CKPT_FIX_GDN_FSDP_SPLIT, MCORE_CKPT_FIX_TP_GROUP",
        ),
    ],
)
def test_bad_values_raise_one_line(environ, var, accepted):
    with pytest.raises(FlagError) as info:
        parse(IDS, environ)
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith(var) and accepted in msg, msg


@pytest.mark.parametrize(
    "env, var",
    [
        ({"MCORE_CKPT_FIX_TP_GROUP": "maybe"}, "MCORE_CKPT_FIX_TP_GROUP"),
        ({"MCORE_CKPT_FIXES": "tp-grup"}, "MCORE_CKPT_FIXES"),
        ({"MCORE_CKPT_FIX_UNKNOWN": "on"}, "MCORE_CKPT_FIX_UNKNOWN"),
    ],
)
def test_cli_exits_2_with_one_line(env, var):
    proc = run_cli(["status"], env)
    assert proc.returncode == 2, proc
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and var in lines[0] and "accepted" in lines[0], proc.stderr


def test_import_raises_flag_error_naming_variable():
    proc = run_py("import mcore_ckpt_fixes", {"MCORE_CKPT_FIX_TP_GROUP": "always"})
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("mcore_ckpt_fixes.engine.errors.FlagError: MCORE_CKPT_FIX_TP_GROUP='always'")
    assert "auto, off, on, require" in last


def test_off_disables_everything_in_status():
    proc = run_cli(["status", "--json", "--no-import"], {"MCORE_CKPT_FIXES": "off"})
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert {r["state"] for r in rows} == {"disabled"}
