"""Shared test helpers.

Engine tests run Python in subprocesses (import order matters and must be fresh); round trips run
in worlds of forked ranks (see mcore_ckpt_fixes.testing.launcher), started from this warm process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")


def pytest_sessionstart(session):
    """Register the tp-group scenarios' ``mamba_ssm`` stand-in before any test imports Megatron.

    Megatron binds ``mamba_ssm``'s gated RMSNorm when ``megatron.core.ssm.mamba_mixer`` is first
    imported, and other tests import it on the way (on 0.18.2, ``megatron.training``, which the
    rng-under-ep and expert-keys tests load in this process, imports it); whichever test runs first
    must not fix that choice for the whole session. The stand-in (see mcore_ckpt_fixes/testing/_standins.py) is test infrastructure for a
    CUDA-only package that cannot be installed here; a real installation wins."""
    from mcore_ckpt_fixes.testing._standins import install_mamba_ssm_stand_in

    install_mamba_ssm_stand_in()


def megatron_version():
    from mcore_ckpt_fixes.engine.version import detect

    return detect().version


def envs_dir() -> str:
    """Where tools/envs.sh and tools/test.sh keep the environments (``$MCORE_CKPT_FIXES_ENVS``)."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.environ.get("MCORE_CKPT_FIXES_ENVS") or os.path.join(cache, "mcore-ckpt-fixes", "envs")


def child_env(paths: list, env: dict | None) -> dict:
    """This environment without fix flags, ``paths`` before the inherited PYTHONPATH, then ``env``
    (whose own PYTHONPATH entries, if any, go first: the caller's must shadow the environment's)."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("MCORE_CKPT_FIX")}
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = dict(env or {})
    first = [env.pop("PYTHONPATH")] if "PYTHONPATH" in env else []
    full_env["PYTHONPATH"] = os.pathsep.join(first + paths + inherited)
    full_env.update(env)
    return full_env


def run_py(
    code: str, env: dict | None = None, timeout: float = 300, cwd=None, main_only: bool = False
) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter of this environment with clean fix flags (``env``'s
    PYTHONPATH, e.g. a patched source tree, first on the path). ``main_only``: the code runs under
    ``if __name__ == "__main__":``, for code that saves on releases whose checkpoint writer starts
    ``spawn`` processes (they import the script again)."""
    full_env = child_env([ROOT, TESTS, os.path.join(TESTS, "engine")], env)
    code = textwrap.dedent(code)
    if main_only:
        code = 'if __name__ == "__main__":\n' + textwrap.indent(code, "    ")
    # A real script file, not -c: spawn children re-import __main__ to find functions defined there.
    # In a directory of its own (the script's directory is first on sys.path: nothing else there can
    # shadow a module), removed afterwards.
    with tempfile.TemporaryDirectory(prefix="mcore_ckpt_fixes_test_") as where:
        script = os.path.join(where, "mcore_ckpt_fixes_test_script.py")  # a name no test module has
        with open(script, "w") as f:
            f.write(code)
        return subprocess.run(
            [sys.executable, script],
            env=full_env,
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=cwd,
        )


def run_cli(
    args: list, env: dict | None = None, timeout: float = 300, preexec_fn=None, cwd=None
) -> subprocess.CompletedProcess:
    """``python -m mcore_ckpt_fixes ARGS`` in a fresh interpreter, as a user runs it (``preexec_fn``:
    run in the child before it starts Python, e.g. to take privileges away)."""
    full_env = child_env([ROOT], env)
    return subprocess.run(
        [sys.executable, "-m", "mcore_ckpt_fixes", *args],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
        preexec_fn=preexec_fn,
        cwd=cwd,
    )


def check_py(code: str, env: dict | None = None, timeout: float = 300) -> str:
    proc = run_py(code, env, timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc.stdout


@pytest.fixture(scope="session")
def mcore_version():
    v = megatron_version()
    if v is None:
        pytest.fail("Megatron-Core is not importable in this environment (see tools/envs.sh)")
    return v


def on_this_line(name, older_lines) -> bool:
    """Whether a costly resume test named ``name`` runs on this release line: every one on the
    newest line (0.19), on an older one only where ``older_lines`` (``{name: ((0, 17), ...)}``)
    names that line for it (CI's time: one older line shows what the others would)."""
    version = megatron_version()
    return version is None or version.release >= (0, 19) or version.release[:2] in older_lines.get(name, ())


def needs_megatron_training():
    """Skip where this release cannot run the resume check: only a wheel without megatron.training
    (before 0.17) may lack it; anywhere else its absence is a failure."""
    from mcore_ckpt_fixes.resume.check import not_applicable

    why = not_applicable()
    if why:
        version = megatron_version()
        assert version is not None and version.release < (0, 17), f"megatron.training missing on {version}: {why}"
        pytest.skip(f"not applicable on {version}: {why}")


def resume_fail_text(mode_out):
    """What a resume check's mode (``on``, ``off``, ``only``) got wrong, for an assertion message:
    the error, or per inexact rank where the losses and which values differ; per way of resuming
    where run C resumed several ways."""
    if "ways" in mode_out:
        return "\n".join(f"{' '.join(w['args'])}: {resume_fail_text(w)}" for w in mode_out["ways"])
    if mode_out["verdict"] == "error" or "ranks" not in mode_out:
        return f"{mode_out['error']}\n{mode_out.get('detail') or ''}"
    return "\n".join(
        f"rank {r['rank']} (ep {r['ep']}, tp {r['tp']}): losses differ at {r['losses_differ']}, "
        f"{r['n_differ']} values: {r['differ']}"
        for r in mode_out["ranks"]
        if not r["exact"]
    )


class WarmPython:
    """:func:`run_py` for many scripts, each in a child forked from one interpreter that has
    imported torch (tests/patches/warm_python.py): the same environment and ``sys.path`` as a fresh
    interpreter, without torch's import per script. ``close()`` stops it."""

    SERVER = os.path.join(TESTS, "patches", "warm_python.py")

    def __init__(self):
        self.env = child_env([ROOT, TESTS, os.path.join(TESTS, "engine")], None)
        self.proc = subprocess.Popen(
            [sys.executable, self.SERVER], env=self.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self._answer(120)  # {"ready": pid}: torch is imported

    def _answer(self, timeout):
        import select

        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.close()
            raise TimeoutError(f"the warm interpreter gave no answer within {timeout:.0f} s")
        return json.loads(line)

    def run(self, code, env=None, timeout=300, main_only=False) -> subprocess.CompletedProcess:
        code = textwrap.dedent(code)
        if main_only:
            code = 'if __name__ == "__main__":\n' + textwrap.indent(code, "    ")
        full_env = child_env([ROOT, TESTS, os.path.join(TESTS, "engine")], env)
        with tempfile.TemporaryDirectory(prefix="mcore_ckpt_fixes_test_") as where:
            script = os.path.join(where, "mcore_ckpt_fixes_test_script.py")
            out = os.path.join(where, "output.txt")
            with open(script, "w") as f:
                f.write(code)
            request = {
                "script": script,
                "out": out,
                "env": full_env,
                "server_pythonpath": [p for p in self.env["PYTHONPATH"].split(os.pathsep) if p],
                "server_dir": os.path.dirname(self.SERVER),
            }
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            pid = self._answer(30)["pid"]  # forked
            try:
                rc = self._answer(timeout)["rc"]
            except TimeoutError:
                import signal

                os.kill(pid, signal.SIGKILL)
                raise
            with open(out) as f:
                output = f.read()
        # stdout and stderr are one stream here: both fields hold it.
        return subprocess.CompletedProcess([self.SERVER, script], rc, output, output)

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
