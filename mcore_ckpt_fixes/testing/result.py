"""One rank's round-trip result: the phase it reached, its first error, what it loaded back.

Every scenario returns ``RoundTrip.result``; none types the dict out itself, so selftest and the
tests read one shape and one error policy::

    rt = RoundTrip(device=device)
    with rt.running():
        rt.phase("precondition")
        rt["fix_state"] = ...
        rt.phase("save")
        ...
        rt.compare(expected, loaded)
    return rt.result

Error policy: any exception inside ``running()`` ends the round trip and is recorded (``error`` =
one line ``"Type: message"``, ``raw_error`` the full text, ``phase``, ``traceback``); the rank still
returns its result, so every rank reports what broke instead of the world dying on the first one.
That includes ``BaseException`` subclasses: torch DCP's ``CheckpointException`` (every rank's
failure of a save or load) derives from ``BaseException``, and Megatron calls ``sys.exit`` in places.
Only ``KeyboardInterrupt`` and ``GeneratorExit`` propagate (the launcher's deadline kills the rank).
"""

from __future__ import annotations

import contextlib
import traceback

from .compare import max_abs_delta, part_digests


def error_line(exc) -> str:
    return f"{type(exc).__name__}: {exc}"


class RoundTrip:
    """``error_line``: how an exception becomes the one-line ``error`` a :class:`Bug` matches
    (default ``"Type: message"``); ``extra``: fields this scenario reports besides the common ones."""

    def __init__(self, error_line=error_line, **extra):
        self.result = {"error": None, "phase": None, "max_delta": {}, "n_tensors": 0, "fix_state": None, "digests": {}}
        self.result.update(extra)
        self._error_line = error_line
        self._phase = None

    def phase(self, name: str) -> None:
        """Where the round trip is now: the phase an error is reported in."""
        self._phase = name

    @property
    def current_phase(self):
        return self._phase

    def __getitem__(self, key):
        return self.result[key]

    def __setitem__(self, key, value):
        self.result[key] = value

    @contextlib.contextmanager
    def running(self):
        try:
            yield self
        except BaseException as exc:
            if isinstance(exc, (KeyboardInterrupt, GeneratorExit)):
                raise
            self.record(exc)

    def record(self, exc, phase=None) -> None:
        """Record ``exc`` as this round trip's failure (in ``phase``, default the current one)."""
        if self.result["error"] is not None:
            return  # the first failure is the one that matters
        self.result["error"] = self._error_line(exc)
        self.result["raw_error"] = f"{type(exc).__name__}: {exc}"
        self.result["phase"] = phase if phase is not None else self._phase
        self.result["traceback"] = traceback.format_exc()

    def fail(self, message: str, phase=None) -> None:
        """Record a failure the scenario found itself (no exception), e.g. a wrong layout on disk."""
        if self.result["error"] is None:
            self.result["error"] = message
            self.result["phase"] = phase if phase is not None else self._phase

    def compare(self, expected: dict, got: dict, prefix: str = "", parts=None) -> dict:
        """Record ``max_delta`` per tensor (``prefix`` + key, sorted) between what was saved and what
        was loaded, and ``digests`` (what was saved and what was loaded, part by part: ``parts``
        maps a key to the sizes of the flat tensor's parts); returns the keys that differ with their
        deltas. Enters phase ``compare``."""
        self.phase("compare")
        missing = sorted(set(expected) - set(got))
        if missing:
            raise AssertionError(f"not loaded: {missing}")
        deltas = {f"{prefix}{k}": max_abs_delta(expected[k], got[k]) for k in sorted(expected)}
        sizes = parts or {}
        self.result["digests"].update(
            {
                f"{prefix}{k}": (part_digests(expected[k], sizes.get(k)), part_digests(got[k], sizes.get(k)))
                for k in sorted(expected)
            }
        )
        self.result["max_delta"].update(deltas)
        self.result["max_delta"] = dict(sorted(self.result["max_delta"].items()))
        self.result["n_tensors"] = len(self.result["max_delta"])
        return {k: d for k, d in deltas.items() if d != 0.0}

    def differing(self) -> dict:
        return {k: d for k, d in self.result["max_delta"].items() if d != 0.0}
