"""docs/errors.md tells the truth: every table row with an example is executed here.

A table whose header has the columns `class`, `example` and `message` lists errors. Its example
cell is one of
- a Python expression in backticks: evaluated inside `jax.eval_shape` (a `JaxRuntimeError` row
  runs it instead), it must raise exactly the class in the `class` column with the message in
  the `message` column (the whole message; a message ending in "…" is its beginning);
- `source: FILE`, for messages a CPU machine cannot produce: a Python FILE must hold a
  `raise CLASS(...)` whose string or f-string template (each `{...}` any text) matches the whole
  message; a C++ FILE a string literal (adjacent literals joined) that contains it (the class,
  an XLA status there, is not checked);
- "—": no check.
A change of any message in the code fails its row here.
"""

from __future__ import annotations

import ast
import builtins
import functools
import importlib
import pathlib
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_kernels as jk

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "errors.md"
ELLIPSIS = "…"


# --- reading the page ---------------------------------------------------------------------------


def _cells(line: str) -> list[str]:
    """The cells of a Markdown table row; a `|` inside a code span does not split."""
    cells, current, i = [], "", 0
    body = line.strip()
    body = body[1:] if body.startswith("|") else body
    body = body[:-1] if body.endswith("|") else body
    while i < len(body):
        if body[i] == "`":
            ticks = len(body[i:]) - len(body[i:].lstrip("`"))
            end = body.find("`" * ticks, i + ticks)
            while end != -1 and body[end + ticks:end + ticks + 1] == "`":
                end = body.find("`" * ticks, end + 1)
            if end == -1:  # an unmatched run of backticks is literal text
                current += body[i:i + ticks]
                i += ticks
                continue
            current += body[i:end + ticks]
            i = end + ticks
        elif body[i] == "|":
            cells.append(current.strip())
            current, i = "", i + 1
        else:
            current += body[i]
            i += 1
    cells.append(current.strip())
    return cells


def _code(cell: str) -> str | None:
    """The content of a cell that is one code span (CommonMark: one space stripped from each
    side when both are there), else None."""
    match = re.fullmatch(r"(`+)(.*?)\1", cell, flags=re.S)
    if match is None or "`" * len(match.group(1)) in match.group(2):
        return None
    text = match.group(2)
    if len(text) > 1 and text.startswith(" ") and text.endswith(" ") and text.strip():
        text = text[1:-1]
    return text


def _rows() -> list[dict]:
    """Every row of the error tables: line number, class, example cell and message."""
    rows, header = [], None
    for number, line in enumerate(PAGE.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.lstrip().startswith("|"):
            header = None
            continue
        cells = _cells(line)
        if header is None:
            header = [c.lower() for c in cells]
            continue
        if all(set(c) <= set("-: ") for c in cells):  # the delimiter row
            continue
        if not {"class", "example", "message"} <= set(header):
            continue
        row = dict(zip(header, cells))
        rows.append({"line": number, "class": _code(row["class"]) or row["class"],
                     "example": row["example"], "message": _code(row["message"])})
    return rows


ROWS = _rows()
EXAMPLES = [r for r in ROWS if (_code(r["example"]) or "").strip()
            and not _code(r["example"]).startswith("source:")]
SOURCES = [r for r in ROWS if (_code(r["example"]) or "").startswith("source:")]


def _id(row: dict) -> str:
    return f"errors.md:{row['line']}"


def _exception_class(name: str) -> type:
    if name == "JaxRuntimeError":
        return jax.errors.JaxRuntimeError
    cls = getattr(builtins, name, None)
    assert isinstance(cls, type) and issubclass(cls, BaseException), f"unknown class {name!r}"
    return cls


def _message_matches(actual: str, expected: str) -> bool:
    if expected.endswith(ELLIPSIS):
        return actual.startswith(expected[:-len(ELLIPSIS)])
    return actual == expected


def test_the_tables_are_read():
    """Every row has a class, a message and an example (an expression, a source or "—"), and
    the page has as many examples as it had when this test was written (or more)."""
    assert len(EXAMPLES) >= 90, len(EXAMPLES)
    assert len(SOURCES) >= 6, len(SOURCES)
    for row in ROWS:
        assert row["message"], f"{_id(row)}: the message is not one code span"
        _exception_class(row["class"])
        assert row["example"] == "—" or _code(row["example"]), \
            f"{_id(row)}: the example is neither a code span nor —"


# --- the examples -------------------------------------------------------------------------------


def _related(name: str, roots: tuple[str, ...]) -> bool:
    return any(name == r or name.startswith(r + ".") for r in roots)


def import_without(module: str, dependency: str):
    """Imports `module` afresh while `dependency` cannot be imported; restores every module it
    touched (and the parents' attributes) afterwards."""
    roots = (module, dependency)
    saved = {name: m for name, m in sys.modules.items() if _related(name, roots)}
    attributes = {}
    for name in roots:
        parent, _, child = name.rpartition(".")
        if parent in sys.modules and hasattr(sys.modules[parent], child):
            attributes[parent, child] = getattr(sys.modules[parent], child)
            delattr(sys.modules[parent], child)
    for name in saved:
        del sys.modules[name]
    sys.modules[dependency] = None  # import of `dependency` now raises ImportError
    try:
        return importlib.import_module(module)
    finally:
        for name in [n for n in sys.modules if _related(n, roots)]:
            del sys.modules[name]
        sys.modules.update(saved)
        for (parent, child), value in attributes.items():
            setattr(sys.modules[parent], child, value)


def _namespace(expression: str) -> dict:
    namespace = {"functools": functools, "jax": jax, "jnp": jnp, "np": np, "jk": jk,
                 "jax_kernels": jk, "import_without": import_without}
    if "jax_kernels.flax" in expression or "nnx." in expression:
        pytest.importorskip("flax")
        import jax_kernels.flax
        import jax_kernels.flax.linen  # noqa: F401
        from flax import nnx
        namespace["nnx"] = nnx
    if "jax_kernels.equinox" in expression:
        pytest.importorskip("equinox")
        import jax_kernels.equinox  # noqa: F401
    return namespace


@pytest.mark.parametrize("row", EXAMPLES, ids=_id)
def test_example_raises_the_stated_error(row):
    expression = _code(row["example"])
    expected = _exception_class(row["class"])
    namespace = _namespace(expression)
    if expected is jax.errors.JaxRuntimeError:
        def run():
            jax.block_until_ready(eval(expression, namespace))
    else:
        def run():
            jax.eval_shape(lambda: eval(expression, namespace))
    try:
        run()
    except Exception as error:  # noqa: BLE001 - the class is compared below
        assert type(error) is expected, (
            f"{_id(row)}: {expression} raised {type(error).__name__}, not "
            f"{expected.__name__}: {error}")
        assert _message_matches(str(error), row["message"]), (
            f"{_id(row)}: {expression} raised\n  {error}\nthe page says\n  {row['message']}")
    else:
        pytest.fail(f"{_id(row)}: {expression} raised nothing")


# --- messages checked against the source -----------------------------------------------------


def _template(node: ast.expr) -> str | None:
    """A regular expression for a string or f-string node (each `{...}` matches any text)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return re.escape(node.value)
    if isinstance(node, ast.JoinedStr):
        return "".join(re.escape(part.value) if isinstance(part, ast.Constant) else ".+?"
                       for part in node.values)
    return None


def _python_raises(path: pathlib.Path) -> list[tuple[str, str]]:
    """(class name, message template) of every `raise Class("...")` in a Python file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)
                and isinstance(node.exc.func, ast.Name) and node.exc.args):
            template = _template(node.exc.args[0])
            if template is not None:
                found.append((node.exc.func.id, template))
    return found


def _cpp_literals(path: pathlib.Path) -> list[str]:
    """The string literals of a C++ file, adjacent ones joined, escapes resolved."""
    text = path.read_text(encoding="utf-8")
    literals, end = [], None
    for match in re.finditer(r'"((?:[^"\\\n]|\\.)*)"', text):
        value = re.sub(r"\\(.)", r"\1", match.group(1))
        if end is not None and text[end:match.start()].strip() == "" and literals:
            literals[-1] += value
        else:
            literals.append(value)
        end = match.end()
    return literals


@pytest.mark.parametrize("row", SOURCES, ids=_id)
def test_source_produces_the_stated_message(row):
    relative = _code(row["example"])[len("source:"):].strip()
    path = ROOT / relative
    if not path.is_file() and not (ROOT / "pyproject.toml").is_file():
        # The tests run from a copy next to an installed wheel (tools/gpu_check.sh WHEEL=1):
        # the package's Python files are the installed ones, its C++ sources are not shipped.
        if relative.startswith("jax_kernels/"):
            path = pathlib.Path(jk.__file__).resolve().parents[1] / relative
        else:
            pytest.skip(f"{relative} is not next to these tests (run outside the source tree)")
    assert path.is_file(), f"{_id(row)}: no file {path}"
    message = row["message"]
    if path.suffix == ".py":
        assert not message.endswith(ELLIPSIS), f"{_id(row)}: give the whole message"
        raises = _python_raises(path)
        assert any(cls == row["class"] and re.fullmatch(template, message, flags=re.S)
                   for cls, template in raises), (
            f"{_id(row)}: no `raise {row['class']}(...)` in {path.name} produces\n  {message}")
    else:
        fragment = message[:-len(ELLIPSIS)] if message.endswith(ELLIPSIS) else message
        assert any(fragment in literal for literal in _cpp_literals(path)), (
            f"{_id(row)}: no string literal in {path.name} contains\n  {fragment}")
