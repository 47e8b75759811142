"""Shared fixtures: one tokenized-corpus cache for the whole session, so the BPE is trained once; one
failure-free reference run for the control-plane and launcher tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def data_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache directory shared by every test of the session (tokenizer + token arrays)."""
    override = os.environ.get("UNBROKEN_TEST_CACHE")
    if override:
        Path(override).mkdir(parents=True, exist_ok=True)
        return Path(override)
    return tmp_path_factory.mktemp("data-cache")


@pytest.fixture(scope="session")
def control_reference(tmp_path_factory: pytest.TempPathFactory, data_cache_dir: Path) -> Path:
    """The failure-free run (exact reduction) that the control-plane and launcher tests compare with."""
    from runner import CONTROL_COMMON, train

    out = tmp_path_factory.mktemp("control") / "reference"
    result = train(out, data_cache_dir, *CONTROL_COMMON)
    assert result.returncode == 0, result.stderr[-3000:]
    return out
