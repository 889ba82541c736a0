"""No module of gac_jax reaches into another's private names (issue #43): no import of a
`_name` from another gac_jax module (a module private as a whole, like
`objectives/_loss_terms`, aside), and no `._name` read on anything but `self`, `cls`,
`super()` or a class of the same module. Named exceptions: dunders, the namedtuple API
(`_replace`, `_asdict`, `_fields`, `_make`) and `jax`'s `_cache_size` of a jitted function
(the only count of its compiled programs)."""

import ast
import textwrap
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "gac_jax"
ALLOWED_ATTRIBUTES = {"_replace", "_asdict", "_fields", "_make", "_cache_size"}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _module_classes(tree: ast.Module) -> set[str]:
    return {node.name for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}


def _own_object(value: ast.expr, classes: set[str]) -> bool:
    if isinstance(value, ast.Name):
        return value.id in ("self", "cls") or value.id in classes
    return isinstance(value, ast.Call) and getattr(value.func, "id", None) == "super"


def reaches(source: str, filename: str = "<string>") -> list[str]:
    """`"file:line what"` for each private name of another module that `source` uses."""
    tree = ast.parse(source, filename)
    classes = _module_classes(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gac_jax"):
            if any(_private(part) for part in node.module.split(".")):
                continue  # A private module: its names are for the package.
            for alias in node.names:
                if _private(alias.name):
                    found.append(f"{filename}:{node.lineno} imports {node.module}.{alias.name}")
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            if node.attr in ALLOWED_ATTRIBUTES or _own_object(node.value, classes):
                continue
            found.append(f"{filename}:{node.lineno} reads {ast.unparse(node)[:60]}")
    return found


def test_no_module_reaches_into_another_modules_private_names():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        found += reaches(path.read_text(), str(path.relative_to(PACKAGE.parent)))
    assert not found, "Private names used from outside:\n" + "\n".join(found)


def test_the_scan_finds_each_kind_of_reach_and_spares_the_allowed_ones():
    source = textwrap.dedent(
        """
        from gac_jax.models.sampler import Sampler, _SlotState
        from gac_jax.objectives._loss_terms import _helper
        class Own:
            def f(self, other, state):
                self._a(); Own._b(); super()._c(); state._replace(x=1)
                other.sampler._refill(); other._chunk
        """
    )
    assert sorted(line.split(" ", 1)[1] for line in reaches(source)) == [
        "imports gac_jax.models.sampler._SlotState",
        "reads other._chunk",
        "reads other.sampler._refill",
    ]
