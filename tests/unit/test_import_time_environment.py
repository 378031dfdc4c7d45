"""No module of the package reads an environment variable when it is imported.

A value read at import is fixed for the life of the process. The suite's fork servers (tests/preload.py)
import the package once and fork each rank from there, so a rank whose environment differs from the server's would
silently keep the server's value. The servers let a rank's ``TWINKLE_*`` variables differ from their own (and
torchrun's per-rank keys) on the strength of this scan: the package reads every variable when it is called. Any other
key that differs makes the rank start in a fresh interpreter, since torch, transformers and huggingface_hub do read
theirs at import.
"""

from __future__ import annotations

import ast
import dataclasses
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "twinkle_strategy"


@dataclasses.dataclass(frozen=True)
class EnvironmentRead:
    """One read of the environment that runs when its module is imported."""

    path: Path
    line: int
    code: str
    key: str | None  # the variable's name where it is a literal; None for ``dict(os.environ)`` and the like

    def where(self) -> str:
        return f"{self.path.relative_to(PACKAGE.parent)}:{self.line}: {self.code}"


class _ImportTimeReads(ast.NodeVisitor):
    """Visits what a module runs when imported: its top level and class bodies, decorators and default values, and
    the bodies of the module's own functions that this code calls (``_configure()`` at the bottom of a module); not
    the bodies of other functions and lambdas (they run when called)."""

    def __init__(self, path: Path, source: str) -> None:
        self.path, self.source = path, source
        self.environ_names: set[str] = set()  # `from os import environ, getenv` (as ...)
        self.os_names: set[str] = {"os"}  # `import os as _os`
        self.reads: list[EnvironmentRead] = []
        self.functions: dict[str, ast.FunctionDef | ast.AsyncFunctionDef] = {}  # the module's top-level functions
        self.entered: set[str] = set()  # those whose bodies were visited, called at import

    def visit_Import(self, node: ast.Import) -> None:
        self.os_names |= {alias.asname or alias.name for alias in node.names if alias.name == "os"}

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.module == "os":
            self.environ_names |= {alias.asname or alias.name for alias in node.names
                                   if alias.name in ("environ", "getenv", "environb", "getenvb")}

    def _visit_function(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> None:
        for expression in [*getattr(node, "decorator_list", []), *node.args.defaults, *node.args.kw_defaults]:
            if expression is not None:
                self.visit(expression)

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _visit_function

    def visit_If(self, node: ast.If) -> None:
        """``if __name__ == "__main__":`` runs when the module is a program, not when it is imported."""
        test = node.test
        if (isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id == "__name__"
                and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in test.comparators)):
            for statement in node.orelse:
                self.visit(statement)
            return
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        name = node.func.id if isinstance(node.func, ast.Name) else None
        if name in self.functions and name not in self.entered:  # a function of this module, called at import
            self.entered.add(name)
            for statement in self.functions[name].body:
                self.visit(statement)
        self.generic_visit(node)

    def _is_environment(self, node: ast.AST) -> bool:
        """``os.environ``, ``os.getenv`` (or ``os.environb``), or a name imported from os as one of them."""
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            return node.value.id in self.os_names and node.attr in ("environ", "getenv", "environb", "getenvb")
        return isinstance(node, ast.Name) and node.id in self.environ_names

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if self._is_environment(node):
            self._record(node)
        self.generic_visit(node)

    def visit_Name(self, node: ast.Name) -> None:
        if self._is_environment(node):
            self._record(node)

    def _record(self, node: ast.AST) -> None:
        line = self.source.splitlines()[node.lineno - 1].strip()
        self.reads.append(EnvironmentRead(self.path, node.lineno, line, _literal_key(self.tree, node)))

    def scan(self) -> list[EnvironmentRead]:
        self.tree = ast.parse(self.source, str(self.path))
        self.functions = {node.name: node for node in self.tree.body
                          if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
        self.visit(self.tree)
        return self.reads


def _literal_key(tree: ast.AST, environment: ast.AST) -> str | None:
    """The variable a read names, when it is a string literal: ``os.environ["K"]``, ``os.environ.get("K")``,
    ``os.getenv("K")``, ``"K" in os.environ``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and node.value is environment:
            key = node.slice
        elif isinstance(node, ast.Call) and (node.func is environment or (
                isinstance(node.func, ast.Attribute) and node.func.value is environment)) and node.args:
            key = node.args[0]
        elif isinstance(node, ast.Compare) and environment in node.comparators:
            key = node.left
        else:
            continue
        return key.value if isinstance(key, ast.Constant) and isinstance(key.value, str) else None
    return None


def import_time_environment_reads(root: Path) -> list[EnvironmentRead]:
    """Every read of the environment that runs when a module under ``root`` is imported."""
    reads = []
    for path in sorted(root.rglob("*.py")):
        reads += _ImportTimeReads(path, path.read_text()).scan()
    return reads


def test_no_module_of_the_package_reads_the_environment_when_imported():
    reads = import_time_environment_reads(PACKAGE)
    assert not reads, ("read these when called, not at import (a process forked after the import, as the suite's "
                       "ranks are, would keep the value of the process it was forked from):\n"
                       + "\n".join(read.where() for read in reads))


def test_the_scan_finds_each_form_of_read_and_only_at_import(tmp_path):
    """The scanner itself, on a module with every form it must catch and every place it must leave alone."""
    (tmp_path / "twinkle_strategy").mkdir()
    module = tmp_path / "twinkle_strategy" / "module.py"
    module.write_text(
        "import os\nimport os as _os\nfrom os import environ as env, getenv\n"
        "A = os.environ['TWINKLE_A']\n"                     # 4
        "B = os.environ.get('TWINKLE_B', '1')\n"            # 5
        "C = _os.getenv('TWINKLE_C')\n"                     # 6
        "D = 'TWINKLE_D' in env\n"                          # 7
        "E = getenv('TWINKLE_E')\n"                         # 8
        "class K:\n    F = dict(os.environ)\n"              # 10
        "def f(x=os.environ.get('TWINKLE_G')):\n"           # 11: a default value is evaluated at import
        "    return os.environ.get('TWINKLE_CALLED'), lambda: os.getenv('TWINKLE_LATER')\n"
        "async def g():\n    return env['TWINKLE_CALLED']\n"
        "H = lambda: os.environ['TWINKLE_LATER']\n"
        "def configure():\n    return os.environ.get('TWINKLE_I')\n"   # 17: called below, at import
        "configure()\n"
        "def main():\n    return os.environ['TWINKLE_MAIN']\n"
        "if __name__ == '__main__':\n    main()\n"
    )
    reads = _ImportTimeReads(module, module.read_text()).scan()
    assert [(read.line, read.key) for read in reads] == [
        (4, "TWINKLE_A"), (5, "TWINKLE_B"), (6, "TWINKLE_C"), (7, "TWINKLE_D"), (8, "TWINKLE_E"), (10, None),
        (11, "TWINKLE_G"), (17, "TWINKLE_I")], reads


def test_the_fork_servers_let_differ_only_what_no_module_reads_at_import():
    """tests/preload.py's rule (``env_difference``): a rank may be forked although its ``TWINKLE_*``
    variables differ from the server's. That holds only while the package reads none at import, which the scan
    checks; a variable it did read at import must make the rank start fresh."""
    sys.path.insert(0, str(PACKAGE.parent / "tests"))
    try:
        from preload import env_difference
    finally:
        sys.path.pop(0)
    assert env_difference({"TWINKLE_ANY": "rank"}, {"TWINKLE_ANY": "server"}) is None  # the rule the scan justifies
    for read in import_time_environment_reads(PACKAGE):
        key = read.key or "(a variable the scan cannot name)"
        assert read.key is not None and env_difference({key: "rank"}, {key: "server"}) is not None, (
            f"{read.where()}: a rank forked from a preload server would keep the server's {key}")


def test_the_log_level_is_read_when_a_process_starts_its_work_and_a_level_the_user_set_is_kept(monkeypatch):
    """log.py reads TWINKLE_LOG_LEVEL when called (init_distributed, twinkle-sft's main), so a process forked from
    one that imported the package follows its own environment."""
    import logging

    from twinkle_strategy import log

    root = logging.getLogger("twinkle_strategy")
    saved = root.level, list(log._set_by_package)
    try:
        monkeypatch.setenv("TWINKLE_LOG_LEVEL", "warning")
        log.apply_level_from_environment()
        assert root.level == logging.WARNING
        monkeypatch.setenv("TWINKLE_LOG_LEVEL", "DEBUG")  # a later process start reads the variable again
        log.apply_level_from_environment()
        assert root.level == logging.DEBUG
        root.setLevel(logging.ERROR)  # the user's own configuration wins
        log.apply_level_from_environment()
        assert root.level == logging.ERROR
    finally:
        root.setLevel(saved[0])
        log._set_by_package[:] = saved[1]
