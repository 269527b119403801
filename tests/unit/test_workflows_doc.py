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


def _pins(text: str) -> dict[str, str]:
    return dict(re.findall(r"^([A-Za-z0-9_.\-]+)==(\S+)", text, re.M))


def test_the_install_steps_and_the_compatibility_table_say_what_setup_installs() -> None:
    found = re.search(r"<!-- install: requirements -->\n```bash\n(.*?)```", DOC, re.S)
    assert found, "no install block in docs/WORKFLOWS.md"
    shown = found.group(1)
    assert "pip install -r requirements/areal.txt -r requirements/verl.txt" in shown
    setup = (REPO / "scripts/setup.sh").read_text()
    pins = dict(re.findall(r"(areal|verl)==(\S+?)[\s\"]", setup))
    assert f"pip install --no-deps areal=={pins['areal']} verl=={pins['verl']}" in shown
    files = _pins((REPO / "requirements/areal.txt").read_text()) | _pins((REPO / "requirements/verl.txt").read_text())
    table = dict(re.findall(r"^\| (areal|verl|tensordict) \| ([0-9.]+) \|", DOC, re.M))
    assert table == {"areal": pins["areal"], "verl": pins["verl"], "tensordict": files["tensordict"]}
