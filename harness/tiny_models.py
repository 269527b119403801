"""The tiny offline model of the fault tests (hidden 32, 2 layers, vocab 300), built once a session."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollstream.tiny.text_model import build_tiny_model, default_corpus


def build_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model in the session's base temp dir: built once, whichever conftest asks first."""
    return build_tiny_model(tmp_path_factory.getbasetemp() / "fault-model" / "tiny", default_corpus(),
                            vocab_size=300, hidden_size=32, num_layers=2, num_heads=4)
