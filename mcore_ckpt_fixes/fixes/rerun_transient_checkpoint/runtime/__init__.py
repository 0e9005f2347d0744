"""rerun-transient-checkpoint's monkeypatch (runs in a job once the probe finds the bug)."""
