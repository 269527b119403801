"""The layers of the tree (docs/ARCHITECTURE.md, "Layers"): an import runs down the layers or
inside one, never up, and no modules import each other in a circle, imports inside functions
included."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TIERS = ("producers", "rollout_workers", "reward_workers", "consumers")

# From the ground up; a path is a file or a folder (everything under it).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("rollstream/api", "rollstream/file_names.py", "rollstream/retry.py", "rollstream/tokenizer_file.py",
     "rollstream/rewards", "rollstream/vision", "rollstream/tiny"),
    ("rollstream/config.py", "rollstream/wire", "rollstream/runtime"),
    ("rollstream/trajectory", "rollstream/engines", "rollstream/kafka", "rollstream/state", "rollstream/areal",
     "rollstream/imports.py"),
    ("rollstream/agent", "rollstream/dump", "rollstream/tier", "rollstream/trainer", "rollstream/workflows"),
    (*TIERS, "rollstream/tools", "rollstream/testing", "rollstream/cli.py"),
    ("rollstream/dev", "rollstream/demo", "harness", "bench", "scripts", "examples"),
)


def _files() -> list[Path]:
    roots = [REPO / "rollstream", *(REPO / name for name in (*TIERS, "harness", "bench", "scripts", "examples"))]
    return sorted(path for root in roots for path in root.rglob("*.py"))


def _module_file(name: str) -> Path | None:
    parts = name.split(".")
    if parts[0] == "rollstream" and len(parts) > 1 and parts[1] in TIERS:
        parts = parts[1:]
    base = REPO.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imports(path: Path) -> set[Path]:
    """The files of this tree that ``path`` imports (anywhere in it); a package's ``__init__``
    that hands on its own modules' names is not counted as importing them."""
    found: set[Path] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            choices = [[alias.name] for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            choices = [[f"{node.module}.{alias.name}", node.module] for alias in node.names]
        else:
            continue
        for names in choices:
            target = next((file for file in map(_module_file, names) if file is not None), None)
            if target is not None:
                found.add(target)
    if path.name == "__init__.py":
        found = {target for target in found if path.parent not in target.parents}
    found.discard(path)
    return found


def _layer(path: Path) -> int:
    relative = path.relative_to(REPO).as_posix()
    for index, layer in enumerate(LAYERS):
        if any(relative == place or relative.startswith(place + "/") for place in layer):
            return index
    raise AssertionError(f"{relative} is on no layer: add it to LAYERS and to docs/ARCHITECTURE.md")


@functools.cache
def _graph() -> dict[Path, set[Path]]:
    return {path: _imports(path) for path in _files() if path != REPO / "rollstream" / "__init__.py"}


def test_every_import_runs_down_the_layers() -> None:
    upward = [
        f"{path.relative_to(REPO)} (layer {_layer(path) + 1}) imports {target.relative_to(REPO)} "
        f"(layer {_layer(target) + 1})"
        for path, targets in _graph().items()
        for target in targets
        if target != REPO / "rollstream" / "__init__.py" and _layer(target) > _layer(path)
    ]
    assert not upward, "\n".join(upward)


def test_no_modules_import_each_other_in_a_circle() -> None:
    graph = _graph()
    index: dict[Path, int] = {}
    low: dict[Path, int] = {}
    stack: list[Path] = []
    circles: list[list[Path]] = []

    def visit(node: Path) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(component)

    for node in graph:
        if node not in index:
            visit(node)
    assert not circles, "\n".join(", ".join(str(p.relative_to(REPO)) for p in circle) for circle in circles)
