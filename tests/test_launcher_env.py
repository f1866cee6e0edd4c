"""The launcher's environment variables, read before Ray starts (no Ray here)."""

from __future__ import annotations

import pytest

from pdserve.entrypoints.launcher import _worker_niceness


def test_ray_worker_niceness_is_a_nice_value_or_a_clear_error(monkeypatch):
    monkeypatch.delenv("RAY_worker_niceness", raising=False)
    assert _worker_niceness() == 0  # not Ray's 15: the workers are the engines
    monkeypatch.setenv("RAY_worker_niceness", "5")
    assert _worker_niceness() == 5
    for bad in ("high", "20", "-21", "1.5", ""):
        monkeypatch.setenv("RAY_worker_niceness", bad)
        with pytest.raises(ValueError, match="RAY_worker_niceness must be an integer from "
                                             "-20 to 19"):
            _worker_niceness()
