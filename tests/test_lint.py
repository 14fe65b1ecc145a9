"""The code and the notebooks pass the linter (ruff): no unused names, undefined names or star imports."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_is_clean_on_code_and_notebooks():
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    if not Path(ruff).exists():
        pytest.skip("ruff is not installed (it is in requirements.txt)")
    result = subprocess.run([ruff, "check", "course_utils", "course_tools", "tests", "benchmarks", "notebooks"],
                            cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def _intra_package_imports(package: Path) -> dict[str, set[str]]:
    """{module: the package modules it imports}, every import counted (inside functions too), except those under
    `if TYPE_CHECKING:` (annotations only, never run). Importing a.b.c also imports a and a.b."""
    import ast

    def name_of(path):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    modules = {name_of(p): p for p in package.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):  # drop the TYPE_CHECKING blocks
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                node.body = []
        here = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        deps = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = here.split(".")[: len(here.split(".")) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                deps |= {f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target for a in node.names}
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
        deps = {d for d in deps if d in modules}
        for d in list(deps):
            parts = d.split(".")
            deps |= {".".join(parts[:k]) for k in range(1, len(parts))}
        graph[name] = {d for d in deps if d != name and not name.startswith(d + ".")}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    done, path = set(), []

    def visit(module):
        if module in path:
            return path[path.index(module):] + [module]
        if module in done:
            return None
        path.append(module)
        for dep in sorted(graph[module]):
            found = visit(dep)
            if found:
                return found
        path.pop()
        done.add(module)
        return None

    return next((c for c in map(visit, sorted(graph)) if c), None)


def test_the_package_has_no_import_cycle_not_even_inside_functions(tmp_path):
    graph = _intra_package_imports(ROOT / "course_utils")
    assert _cycle(graph) is None, "import cycle: " + " -> ".join(_cycle(graph))
    assert graph["course_utils.monitor.stats"] == set(), "the monitor's data types are a leaf"
    # the tool chain (translation, slides) is outside what learners import
    uses_tools = [str(p.relative_to(ROOT)) for p in (ROOT / "course_utils").rglob("*.py") if "course_tools" in p.read_text()]
    assert uses_tools == [], uses_tools
    # the instructor's tools too; the grader's layers point one way, and its sandbox launcher (run as a script,
    # `python -I -S sandbox.py`, so the standard library only) and the cells it runs in the kernel import nothing else
    tools = _intra_package_imports(ROOT / "course_tools")
    assert _cycle(tools) is None, "import cycle: " + " -> ".join(_cycle(tools))
    assert tools["course_tools.grader.sandbox"] == tools["course_tools.grader.kernel"] == set()
    for low in ("sandbox", "kernel", "limits", "results", "report"):
        assert not {"course_tools.grader.run", "course_tools.grader.cli"} & tools[f"course_tools.grader.{low}"], low
    import ast
    launcher = ast.parse((ROOT / "course_tools" / "grader" / "sandbox.py").read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(launcher) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(launcher) if isinstance(n, ast.ImportFrom) and n.module}
    assert imported <= set(sys.stdlib_module_names), imported - set(sys.stdlib_module_names)
    assert not any(isinstance(n, ast.ImportFrom) and n.level for n in ast.walk(launcher)), "a relative import"
    # the check sees a cycle hidden in a function-level import, and ignores one under TYPE_CHECKING
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from . import b\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import c\nfrom . import a\n")
    (pkg / "c.py").write_text("from . import b\n")
    found = _intra_package_imports(pkg)
    assert _cycle(found) in (["pkg.a", "pkg.b", "pkg.a"], ["pkg.b", "pkg.a", "pkg.b"]), _cycle(found)
    assert "pkg.c" not in found["pkg.b"]
