"""Shared fixtures: one tokenized-corpus cache for the whole session, so the BPE is trained once."""

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
