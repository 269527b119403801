"""docs/WORKFLOWS.md shows what the suite runs: the five-line test and the worked example's imports."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOC = (REPO / "docs" / "WORKFLOWS.md").read_text()


def block_after(marker: str) -> str:
    """The fenced python block right after ``<!-- marker: path -->``."""
    found = re.search(rf"<!-- {re.escape(marker)}: \S+ -->\n```python\n(.*?)```", DOC, re.S)
    assert found, f"no block marked {marker!r} in docs/WORKFLOWS.md"
    return found.group(1)


def test_the_five_line_test_in_the_doc_is_the_one_the_suite_runs() -> None:
    shown = block_after("five-line test")
    run = (REPO / "tests/workflow_pkg/test_my_workflow.py").read_text()
    assert shown == run.replace("tests.workflow_pkg", "my_workflows")
    assert len([line for line in shown.splitlines() if line.strip()]) == 5


def test_the_worked_example_imports_are_the_templates() -> None:
    shown = block_after("worked example imports")
    template = (REPO / "tests/workflow_pkg/reference_template.py").read_text()
    imports = [line for line in template.splitlines() if line.startswith(("from rollstream", "import logging"))]
    assert shown.splitlines() == imports
