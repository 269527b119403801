"""A test kit for workflow authors (see docs/WORKFLOWS.md).

* :func:`check_workflow`: run a workflow N times as a rollout worker would and check every
  result against the wire schema;
* :class:`ScriptedEngine` / :class:`Scripted`: an ``InferenceEngine`` whose answers the test
  chooses;
* :func:`tiny_model_dir`, :func:`workflow_tokenizer`, :func:`workflow_gconfig`: the tiny
  offline model and what a worker hands workflows for ``"$tokenizer"`` / ``"$gconfig"``;
  :func:`tiny_vlm_dir`, :func:`workflow_processor`: the tiny vision-language model and what a
  worker hands workflows for ``"$processor"``;
* pytest fixtures of the same in ``rollstream.testing.fixtures``.

Importing this package loads neither a model nor pytest.
"""

from rollstream.testing.check import SampleCheck, WorkflowCheck, check_workflow
from rollstream.testing.engine import Scripted, ScriptedEngine
from rollstream.testing.tiny import (
    tiny_model_dir,
    tiny_vlm_dir,
    workflow_gconfig,
    workflow_processor,
    workflow_tokenizer,
)

__all__ = [
    "SampleCheck",
    "Scripted",
    "ScriptedEngine",
    "WorkflowCheck",
    "check_workflow",
    "tiny_model_dir",
    "tiny_vlm_dir",
    "workflow_gconfig",
    "workflow_processor",
    "workflow_tokenizer",
]
