"""Layering: the flywheel and the demo import nothing from the benchmarks (layers import downward only)."""
import ast
from pathlib import Path

import tandem

ROOT = Path(tandem.__file__).resolve().parent


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
    return names


def test_flywheel_and_demo_do_not_import_bench():
    files = sorted((ROOT / "flywheel").glob("*.py")) + [ROOT / "demo.py"]
    offenders = {f.name: sorted(m for m in imported_modules(f) if m.startswith("tandem.bench")) for f in files}
    assert {k: v for k, v in offenders.items() if v} == {}
    assert "tandem.flywheel.stream" in imported_modules(ROOT / "demo.py")  # the demo's stream comes from below


def test_the_check_sees_a_bench_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from tandem.bench.flywheel.shift import build_stream\nimport tandem.bench.machine\n")
    assert imported_modules(bad) >= {"tandem.bench.flywheel.shift", "tandem.bench.machine"}
