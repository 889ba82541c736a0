"""Readable sizes: no function over 60 lines of its own code, no file over 450 lines unexplained,
at most five functions over 8 parameters (public APIs whose arguments are their knobs).

A function's own code is every physical line from its `def` (or first decorator) to its
end, less its docstring and less the lines of the functions and classes nested inside
it (those are counted on their own). A file over 450 lines must say why in its module
docstring, with the phrase "Over 450 lines because".
"""

import ast
import textwrap
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "gac_jax"
MAX_FUNCTION_LINES = 60
MAX_FILE_LINES = 450
FILE_REASON = "Over 450 lines because"
MAX_PARAMETERS = 8
MAX_WIDE_FUNCTIONS = 5

_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)
_SCOPES = (*_FUNCTIONS, ast.ClassDef)


def _span(node: ast.AST) -> set[int]:
    """The physical lines of `node`, its decorators included."""
    start = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", ()))])
    return set(range(start, node.end_lineno + 1))


def _docstring_lines(node: ast.AST) -> set[int]:
    body = getattr(node, "body", None)
    if not body or ast.get_docstring(node, clean=False) is None:
        return set()
    return set(range(body[0].lineno, body[0].end_lineno + 1))


def _nested_scopes(node: ast.AST):
    """The functions and classes directly nested in `node` (not inside one another)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, _SCOPES):
            yield child
        else:
            yield from _nested_scopes(child)


def own_lines(function: ast.AST) -> int:
    """Lines of `function`'s own code: its span less docstring and nested scopes."""
    lines = _span(function) - _docstring_lines(function)
    for nested in _nested_scopes(function):
        lines -= _span(nested)
    return len(lines)


def long_functions(source: str, filename: str = "<string>") -> list[str]:
    """`"file:line name (N lines)"` for every function in `source` over the limit."""
    tree = ast.parse(source, filename)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, _FUNCTIONS) and (n := own_lines(node)) > MAX_FUNCTION_LINES:
            found.append(f"{filename}:{node.lineno} {node.name} ({n} lines)")
    return found


def wide_functions(source: str, filename: str = "<string>") -> list[str]:
    """`"file:line name (N parameters)"` for every function in `source` over the limit
    (`self` and `cls` aside; ``*args`` and ``**kwargs`` count one each)."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, _FUNCTIONS):
            a = node.args
            names = [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
            n = len(names) - (names[:1] in (["self"], ["cls"])) + bool(a.vararg) + bool(a.kwarg)
            if n > MAX_PARAMETERS:
                found.append(f"{filename}:{node.lineno} {node.name} ({n} parameters)")
    return found


def unexplained_long_file(source: str, filename: str = "<string>") -> str | None:
    """`"file (N lines)"` if `source` is over the limit without a stated reason."""
    n = len(source.splitlines())
    docstring = ast.get_docstring(ast.parse(source, filename)) or ""
    if n > MAX_FILE_LINES and FILE_REASON not in docstring:
        return f"{filename} ({n} lines)"
    return None


def _package_files() -> list[Path]:
    files = sorted(PACKAGE.rglob("*.py"))
    assert files, f"no Python files found under {PACKAGE}"
    return files


def test_no_function_over_the_limit():
    found = []
    for path in _package_files():
        found += long_functions(path.read_text(), str(path.relative_to(PACKAGE.parent)))
    assert not found, f"Functions over {MAX_FUNCTION_LINES} own lines:\n" + "\n".join(found)


def test_at_most_five_functions_over_the_parameter_limit():
    found = []
    for path in _package_files():
        found += wide_functions(path.read_text(), str(path.relative_to(PACKAGE.parent)))
    assert len(found) <= MAX_WIDE_FUNCTIONS, (
        f"{len(found)} functions over {MAX_PARAMETERS} parameters:\n" + "\n".join(found)
    )


def test_no_long_file_without_a_reason():
    found = []
    for path in _package_files():
        entry = unexplained_long_file(path.read_text(), str(path.relative_to(PACKAGE.parent)))
        if entry is not None:
            found.append(entry)
    assert not found, (
        f"Files over {MAX_FILE_LINES} lines whose module docstring lacks "
        f"{FILE_REASON!r}:\n" + "\n".join(found)
    )


# A function of 1 def line, a 3-line docstring, a 4-line nested function, a 3-line nested
# class (with a method) and 2 lines of its own code: 3 own lines in all.
_SYNTHETIC = textwrap.dedent(
    '''
    def outer(x):
        """Docstring
        over three
        lines."""
        @staticmethod
        def inner(y):
            """Inner docstring."""
            return y
        class Local:
            def method(self):
                return 1
        y = inner(x)
        return y
    '''
)


def test_counter_excludes_docstrings_and_nested_scopes():
    tree = ast.parse(_SYNTHETIC)
    functions = {n.name: n for n in ast.walk(tree) if isinstance(n, _FUNCTIONS)}
    assert own_lines(functions["outer"]) == 3
    assert own_lines(functions["inner"]) == 3  # Decorator, def and return; no docstring.
    assert own_lines(functions["method"]) == 2


def test_counter_flags_long_functions_and_files():
    def function(statements):
        return "def f():\n" + "".join(f"    x{i} = {i}\n" for i in range(statements))

    # The def line plus MAX_FUNCTION_LINES statements is one line too many.
    long_source = function(MAX_FUNCTION_LINES)
    assert long_functions(long_source, "m.py") == [f"m.py:1 f ({MAX_FUNCTION_LINES + 1} lines)"]
    assert long_functions(function(MAX_FUNCTION_LINES - 1)) == []  # Exactly at the limit.
    docstring = '    """' + "\n" * MAX_FUNCTION_LINES + '    """\n'
    assert long_functions("def f():\n" + docstring + "    return 1\n") == []

    filler = "x = 1\n" * MAX_FILE_LINES
    assert unexplained_long_file('"""Short."""\n' + filler, "a.py") == (
        f"a.py ({MAX_FILE_LINES + 1} lines)"
    )
    assert unexplained_long_file(f'"""{FILE_REASON} reasons."""\n' + filler) is None
    assert unexplained_long_file('"""Short."""\n' + filler[6:]) is None


def test_counter_flags_wide_functions():
    nine = "def f(self, a, b, c, *d, e, f, g, h, **i):\n    pass\n"
    assert wide_functions(nine, "m.py") == ["m.py:1 f (9 parameters)"]
    assert wide_functions(nine.replace("**i", "i")) == ["<string>:1 f (9 parameters)"]
    assert wide_functions(nine.replace(", **i", "")) == []  # Exactly at the limit.
