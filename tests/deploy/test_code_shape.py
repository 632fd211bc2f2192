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
