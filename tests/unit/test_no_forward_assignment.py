"""No module of the package assigns a ``forward`` (issue 44).

An assigned ``obj.forward = ...`` hides the hot path: from the step, the EP all-to-all could not be found by
reading calls. Behaviour goes into a module class (``moe/class_swap.py``: expert parallelism, activation
checkpointing, the planner's balanced routing) or a public hook (routing replay).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "twinkle_strategy"


def _assigned_attributes(target: ast.expr) -> list[ast.Attribute]:
    if isinstance(target, ast.Attribute):
        return [target]
    if isinstance(target, (ast.Tuple, ast.List)):
        return [a for element in target.elts for a in _assigned_attributes(element)]
    if isinstance(target, ast.Starred):
        return _assigned_attributes(target.value)
    return []


def _sets_forward_by_name(call: ast.Call) -> bool:
    """``setattr(x, "forward", f)``, ``object.__setattr__(x, "forward", f)`` or ``x.__setattr__("forward", f)``."""
    func = call.func
    if not ((isinstance(func, ast.Name) and func.id == "setattr")
            or (isinstance(func, ast.Attribute) and func.attr == "__setattr__")):
        return False
    return any(isinstance(arg, ast.Constant) and arg.value == "forward" for arg in call.args[:2])


def forward_assignments(source: str) -> list[int]:
    """Lines of ``source`` that assign an attribute named ``forward``."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Call) and _sets_forward_by_name(node):
            lines.append(node.lineno)
            continue
        else:
            continue
        if any(a.attr == "forward" for t in targets for a in _assigned_attributes(t)):
            lines.append(node.lineno)
    return sorted(lines)


def test_no_module_assigns_a_forward():
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 100  # the walk saw the package
    found = [f"{path.relative_to(PACKAGE.parent)}:{line}" for path in files
             for line in forward_assignments(path.read_text())]
    assert found == [], ("assignments of a forward (give the module a class, as moe/class_swap.py does, or a "
                         f"public hook such as register_forward_hook): {found}")


def test_the_check_sees_every_way_of_assigning_a_forward():
    source = "\n".join([
        "layer.forward = wrapped(layer.forward)",  # 1
        "block.experts.forward: object = f",  # 2
        "a.forward, b = f, g",  # 3
        "setattr(router, 'forward', f)",  # 4
        "object.__setattr__(router, 'forward', f)",  # 5
        "router.__setattr__('forward', f)",  # 6
        "forward = layer.forward",  # 7: a local name, reading is fine
        "layer.forward_hook = f",  # 8: another attribute
        "setattr(layer, 'forward_hook', f)",  # 9
        "x.forward += f",  # 10
        "def f():\n    self.forward = g",  # 11-12: inside functions too
    ])
    assert forward_assignments(source) == [1, 2, 3, 4, 5, 6, 10, 12]
