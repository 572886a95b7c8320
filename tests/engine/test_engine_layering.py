"""Layering: the engine layer builds no drafter and loads no model; composition lives above it (llm, flywheel, rl,
server, cli). Drafter *types* may be imported for annotations only (under TYPE_CHECKING)."""
import ast
from pathlib import Path

import tandem

ROOT = Path(tandem.__file__).resolve().parent
ABOVE_ENGINE = ("tandem.llm", "tandem.training", "tandem.flywheel", "tandem.rl", "tandem.server", "tandem.cluster",
                "tandem.bench", "tandem.demo", "tandem.cli")
CONSTRUCTION = ("tandem.drafters", "tandem.models.loader")  # builders of drafters and loaders of models
CONSTRUCTORS = {"build_drafter", "load_transformer", "resolve_model"}


def runtime_imports(source: str) -> set[tuple[str, str]]:
    """(module, name) for every import that runs (inside functions too), skipping `if TYPE_CHECKING:` blocks;
    name is "" for `import module`."""
    found = set()

    def visit(node):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            return
        if isinstance(node, ast.ImportFrom) and node.module:
            found.update((node.module, alias.name) for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update((alias.name, "") for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(source))
    return found


def offenders(source: str) -> list[tuple[str, str]]:
    return sorted((m, n) for m, n in runtime_imports(source)
                  if m.startswith(ABOVE_ENGINE + CONSTRUCTION) or n in CONSTRUCTORS)


def test_the_engine_builds_no_drafter_and_loads_no_model():
    found = {f.name: offenders(f.read_text()) for f in sorted((ROOT / "engine").glob("*.py"))}
    assert {k: v for k, v in found.items() if v} == {}


def test_the_check_sees_construction_and_ignores_type_only_imports():
    bad = ("from tandem.drafters import build_drafter\nimport tandem.llm\n"
           "def f():\n    from tandem.models.zoo import resolve_model\n    from tandem.models.loader import load_transformer\n")
    assert offenders(bad) == [("tandem.drafters", "build_drafter"), ("tandem.llm", ""), ("tandem.models.loader", "load_transformer"),
                              ("tandem.models.zoo", "resolve_model")]
    typed = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from tandem.drafters.base import Drafter\n"
    assert offenders(typed) == []
