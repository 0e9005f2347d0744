"""The resume check across releases (mcore_ckpt_fixes/cli/resume_across.py), on this line: a checkpoint
saved with every fix off, resumed with the fixes on, as after upgrading to the import.

Save and resume meet only through the directory (A's results pickled, B's checkpoint, what saved
it), as they do when each side runs in another environment; tools/resume_across.py runs the pairs
of release lines and docs/resume.md records them. What is checked here: the warnings
``load_checkpoint`` raised reach the verdict, and an inexact resume is compared with this release's
own uninterrupted run to say whether the checkpoint lost state.
"""

from __future__ import annotations


from conftest import needs_megatron_training

from mcore_ckpt_fixes.cli import resume_across as across
from mcore_ckpt_fixes.resume import check
from mcore_ckpt_fixes.resume.configs import by_name

OLD_LAYOUT = "rng-under-ep: {} stores the RNG state in the old 2-D (pp, tp) layout of an unfixed Megatron-Core"


def test_unfixed_checkpoint_resumed_with_the_fixes_warns_and_says_where_state_was_lost(tmp_path):
    needs_megatron_training()
    cfg = by_name("moe-ep2")
    check.prepare()
    saved = across.save(cfg, str(tmp_path), "off")
    assert saved["error"] is None, saved["detail"]
    out = across.resume(cfg, str(tmp_path), "on")
    assert out["verdict"] != "error", f"{out.get('error')}\n{out.get('detail')}"
    assert out["saved"]["fixes"] == "off" and out["resumed"]["fixes"] == "on"
    ckpt = f"{tmp_path}/ckpt/iter_{check.RESUME_AT:07d}"
    patch_warnings = [w for w in out["load_warnings"] if w["text"].startswith("MegatronPatchWarning")]
    if check.needed_here(cfg) != ["rng-under-ep"]:
        assert out["verdict"] == "exact", out["line"]  # the release saved each rank's own RNG state
        assert not patch_warnings, patch_warnings
        return
    # The rank whose state is not its own is warned: EP rank 1 resumes on rank 0's streams (rank 0
    # restores its own copy and is not warned: it logs the old layout instead).
    assert sorted(r for w in patch_warnings for r in w["ranks"]) == [1], patch_warnings
    assert all(OLD_LAYOUT.format(ckpt) in w["text"] for w in patch_warnings), patch_warnings
    assert out["verdict"] == "inexact", out["line"]
    first = {r["ep"]: r["first_step"] for r in out["ranks"]}
    assert first[1] == check.RESUME_AT + 1 and first[0] != check.RESUME_AT + 1, out["line"]
    # The same release on both sides trains alike: the difference is the checkpoint's.
    assert out["here"]["uninterrupted_same"] is True
    assert out["here"]["cause"] == "checkpoint", out["line"]
    assert "state was lost or changed in the checkpoint" in out["line"]
