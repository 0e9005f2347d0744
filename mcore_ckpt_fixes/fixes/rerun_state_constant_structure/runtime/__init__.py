"""rerun-state-constant-structure's monkeypatch (runs in a job once the probe finds the bug)."""
