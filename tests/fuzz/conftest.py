"""Fixtures of the fuzz tests: the same tiny model as the fault tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.tiny_models import build_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory)
