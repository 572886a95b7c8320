"""The benchmarks' layout: every `tandem bench` command answers --help, each sub-package says what it measures, and
only the layers above the benchmarks (the demo and the CLI) import them (layers import downward only)."""
import argparse
import ast
from pathlib import Path

import pytest

import tandem
from tandem.cli import build_parser, main

ROOT = Path(tandem.__file__).resolve().parent
ABOVE_BENCH = {ROOT / "demo.py", ROOT / "cli.py"}
BENCH_COMMANDS = ["aurora", "batch", "control", "decode", "forward", "quality", "report", "rl-trl", "serve", "shift",
                  "soak", "throughput", "trainer-step", "vocab"]
SUBJECTS = ["flywheel", "kernels", "peers", "report", "rl", "serving", "speculation"]


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def imported_modules(path: Path) -> set[str]:
    """Every module an import names (inside functions too); `from tandem import bench` names tandem.bench."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            if node.module == "tandem":
                names |= {f"tandem.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
    return names


def bench_importers(root: Path) -> dict[str, list[str]]:
    found = {}
    for path in sorted(root.rglob("*.py")):
        if (root / "bench") in path.parents or path in ABOVE_BENCH:
            continue
        hits = sorted(m for m in imported_modules(path) if m == "tandem.bench" or m.startswith("tandem.bench."))
        if hits:
            found[str(path.relative_to(root))] = hits
    return found


def test_the_parser_lists_every_bench_command():
    assert sorted(subcommands(subcommands(build_parser())["bench"])) == BENCH_COMMANDS


@pytest.mark.parametrize("command", BENCH_COMMANDS)
def test_each_bench_command_answers_help(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", command, "--help"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: tandem bench {command}")


def test_each_subject_has_a_one_line_docstring():
    found = sorted(p.name for p in (ROOT / "bench").iterdir() if (p / "__init__.py").exists())
    assert found == SUBJECTS
    for subject in SUBJECTS:
        doc = ast.get_docstring(ast.parse((ROOT / "bench" / subject / "__init__.py").read_text(encoding="utf-8")))
        assert doc is not None and "\n" not in doc, subject


def test_nothing_below_bench_imports_it():
    assert bench_importers(ROOT) == {}


def test_the_check_sees_a_bench_import(tmp_path):
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "decode.py").write_text("import tandem.bench.machine\n")
    (tmp_path / "cli.py").write_text("from tandem.bench.speculation.decode import run_decode_bench\n")
    (tmp_path / "engine.py").write_text("from tandem import bench\n")
    (tmp_path / "server.py").write_text("def f():\n    from tandem.bench.serving import load\n")
    assert bench_importers(tmp_path) == {"cli.py": ["tandem.bench.speculation.decode"],
                                         "engine.py": ["tandem.bench"],
                                         "server.py": ["tandem.bench.serving"]}
