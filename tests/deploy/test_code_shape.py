"""The code stays readable: no hand-written module of the package or the tools over 500 lines,
no function over 120 (docs/development.md, "Shape"). Generated code (`deviceplugin/_proto`) is
exempt."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.deploy.support import ROOT

MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 120
CHECKED = ("deviceplugin", "tools")
GENERATED = ROOT / "deviceplugin" / "_proto"


def modules() -> list[Path]:
    """Every hand-written Python module of the package and the tools."""
    found = []
    for top in CHECKED:
        for path in sorted((ROOT / top).rglob("*.py")):
            if not path.is_relative_to(GENERATED):
                found.append(path)
    return found


def functions(tree: ast.AST, prefix: str = "") -> list[tuple[str, int]]:
    """(qualified name, length in lines) of every function and method in `tree`, nested ones
    too, each named after what encloses it (`Class.method`, `outer.inner`)."""
    found = []
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            name = prefix + node.name
            if not isinstance(node, ast.ClassDef):
                assert node.end_lineno is not None
                found.append((name, node.end_lineno - node.lineno + 1))
            found.extend(functions(node, name + "."))
        else:
            found.extend(functions(node, prefix))
    return found


def offenders() -> dict[str, int]:
    """Every module over MAX_MODULE_LINES and function over MAX_FUNCTION_LINES, by
    `path` or `path:function`, with its length in lines."""
    found = {}
    for path in modules():
        name = str(path.relative_to(ROOT))
        text = path.read_text()
        lines = len(text.splitlines())
        if lines > MAX_MODULE_LINES:
            found[name] = lines
        for function, length in functions(ast.parse(text, filename=name)):
            if length > MAX_FUNCTION_LINES:
                found[f"{name}:{function}"] = length
    return found


def test_the_check_sees_long_functions_and_nested_names() -> None:
    source = "class A:\n    def f(self):\n" + "        x = 1\n" * 130 + "def g():\n    def h():\n"
    source += "        pass\n"
    assert dict(functions(ast.parse(source))) == {"A.f": 131, "g": 3, "g.h": 2}


def test_the_check_covers_the_package_and_the_tools_but_not_generated_code() -> None:
    names = {str(p.relative_to(ROOT)) for p in modules()}
    assert "deviceplugin/model.py" in names
    assert "tools/bench/bench_idle.py" in names
    assert not any(n.startswith("deviceplugin/_proto/") for n in names)


def test_no_module_or_function_is_too_long() -> None:
    too_long = offenders()
    assert not too_long, (
        f"over {MAX_MODULE_LINES} lines a module or {MAX_FUNCTION_LINES} a function: "
        f"{too_long}; split it by what its parts mean"
    )


def module_names() -> set[str]:
    """Every name a unit test file may take after its module: the module's dotted path below
    `deviceplugin/` (or its path in `tools/`) with `_` for `.`, and each shorter tail of it
    (`usage/cgroups.py` -> `usage_cgroups`, `cgroups`); packages count as modules."""
    names: set[str] = set()
    for path in modules():
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[0] == "deviceplugin":
            parts = parts[1:]
        if parts and parts[-1] == "__init__":
            parts = parts[:-1]
        names.update("_".join(parts[i:]) for i in range(len(parts)))
    return names


def unnamed_unit_tests(names: set[str], directory: Path = ROOT / "tests" / "unit") -> list[str]:
    """Unit test files not named `test_<module>.py` or `test_<module>_<topic>.py`."""
    return [
        path.name
        for path in sorted(directory.glob("test_*.py"))
        if not any(path.stem[5:] == n or path.stem[5:].startswith(n + "_") for n in names)
    ]


def test_the_unit_test_naming_check_sees_a_file_named_after_nothing(tmp_path: Path) -> None:
    for stem in ("usage_cgroups", "cgroups_leaf", "slicing_mig", "cgroup_leaf", "usagecgroups"):
        (tmp_path / f"test_{stem}.py").touch()
    names = {"usage_cgroups", "cgroups", "usage", "slicing"}
    assert unnamed_unit_tests(names, tmp_path) == ["test_cgroup_leaf.py", "test_usagecgroups.py"]
    assert {"usage_cgroups", "cgroups", "usage", "kubelet_proto"} <= module_names()


def test_each_unit_test_file_is_named_after_the_module_it_tests() -> None:
    # docs/development.md, "Shape": a module's unit tests are found from its name.
    stray = unnamed_unit_tests(module_names())
    assert not stray, (
        f"unit test files named after no module of deviceplugin/ or tools/: {stray}; name each "
        "test_<module>.py (or test_<module>_<topic>.py) after the module it tests"
    )
