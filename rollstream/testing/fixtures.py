"""pytest fixtures for workflow authors; enable with ``pytest_plugins = ["rollstream.testing.fixtures"]``
in a ``conftest.py``.

* ``tiny_model_dir`` (session): the tiny offline model's directory (``rollstream.testing.tiny``);
* ``tiny_tokenizer`` (session): its tokenizer as workflows receive it for ``"$tokenizer"``;
* ``gconfig``: generation settings as workflows receive them for ``"$gconfig"``
  (``max_new_tokens=8``);
* ``tiny_vlm_dir`` (session): the tiny vision-language model's directory;
* ``scripted_engine``: a :class:`~rollstream.testing.ScriptedEngine` answering ``[10, 11]``
  then the tokenizer's eos, with the tiny model's vocabulary size.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rollstream.api.io_struct import GenerationHyperparameters
from rollstream.testing.engine import ScriptedEngine
from rollstream.testing.tiny import tiny_model_dir as _tiny_model_dir
from rollstream.testing.tiny import tiny_vlm_dir as _tiny_vlm_dir
from rollstream.testing.tiny import workflow_gconfig, workflow_tokenizer


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    return _tiny_model_dir()


@pytest.fixture(scope="session")
def tiny_vlm_dir() -> Path:
    return _tiny_vlm_dir()


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir: Path) -> Any:
    return workflow_tokenizer(tiny_model_dir)


@pytest.fixture
def gconfig(tiny_tokenizer: Any) -> GenerationHyperparameters:
    return workflow_gconfig(tiny_tokenizer)


@pytest.fixture
def scripted_engine(tiny_tokenizer: Any) -> ScriptedEngine:
    return ScriptedEngine([[10, 11, tiny_tokenizer.eos_token_id]], vocab_size=len(tiny_tokenizer), tokenizer=tiny_tokenizer)
