"""Fixtures of the fault tests: the tiny offline model (hidden 32, 2 layers, vocab 300)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollstream.tiny.text_model import build_tiny_model, default_corpus


def build_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model in the session's base temp dir: built once, whichever conftest asks first."""
    return build_tiny_model(tmp_path_factory.getbasetemp() / "fault-model" / "tiny", default_corpus(),
                            vocab_size=300, hidden_size=32, num_layers=2, num_heads=4)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory)
