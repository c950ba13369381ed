"""The house rule of the tree: the stages import only down the data path (streaming -> contract ->
feature_repo -> models -> serving), the ground floor (infra/) imports no stage, and nothing but the top floor
(flywheel/: the CLI and the demo) and the tests import the top floor. Every import statement counts,
module level or inside a function."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STAGES = ("streaming", "contract", "feature_repo", "models", "serving")
GROUND, TOP = "infra", "flywheel"


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import statement in a file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return found


def violations(package: str, module: str) -> str | None:
    """Why `package` may not import `module`, or None if it may."""
    head = module.split(".")[0]
    if head == TOP and package != TOP:
        return "imports the top floor"
    if package == GROUND and head in STAGES:
        return "ground floor imports a stage"
    if package in STAGES and head in STAGES and STAGES.index(head) > STAGES.index(package):
        return "imports up the data path"
    return None


def test_imports_go_down_the_path_and_never_up_to_the_top_floor() -> None:
    bad = [f"{path.relative_to(REPO)}:{line} {module}: {why}"
           for package in (*STAGES, GROUND, "dags", "benchmarks")
           for path in sorted((REPO / package).rglob("*.py"))
           for line, module in imports(path)
           if (why := violations(package, module))]
    assert bad == []


def test_the_rule_catches_each_kind_of_wrong_import() -> None:
    assert violations("infra", "streaming.topics") == "ground floor imports a stage"
    assert violations("feature_repo", "serving.api") == "imports up the data path"
    assert violations("serving", "flywheel.demo") == "imports the top floor"
    assert violations("serving", "models.dataset") is None
    assert violations("contract", "models.ctr") == "imports up the data path"  # the contract is below training
    assert violations("flywheel", "serving.api") is None
    assert violations("infra", "infra.settings") is None
