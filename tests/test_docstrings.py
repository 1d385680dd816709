"""Every public function, method and class of course_lib documents itself in PyTorch's sections.

A docstring is a one-line summary, the explanation (formula, units, source), then Google-style
sections as PyTorch writes them: ``Args:`` (each parameter), ``Returns:`` (or ``Yields:``),
``Raises:`` (for an input check) and ``Example::``. The fields of a dataclass are documented in
its ``Attributes:`` (or ``Args:``) section or by a ``#:`` comment above the field.

Public: a function or class without a leading underscore, defined in the module (its
``__module__``), and the methods and properties without a leading underscore that a public
class defines itself. A property needs a docstring only. The sections are asked of what a
learner calls: a function or class a lecture, a companion, an exercise or a solution names in its
code, and the methods of such a class; the rest of the package needs a docstring, whose first
line says what it does.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import inspect
import pkgutil
import re
import textwrap

import pytest
from notebook_tools import COMPANIONS, EXERCISES, LECTURES, SOLUTIONS, read

import course_lib
from course_lib import validation

HEADERS = ("Args", "Arguments", "Attributes", "Returns", "Yields", "Raises", "Example",
           "Examples", "Note", "Notes", "Warning", "See Also")
SECTION = re.compile(rf"^(\s*)({'|'.join(HEADERS)})::?\s*$")
ENTRY = re.compile(r"^\s*(\*{0,2}\w+(?:\s*,\s*\*{0,2}\w+)*)\s*(?:\([^)]*\))?\s*:")
#: The input checks of ``course_lib.validation``: a function calling one raises ValueError.
CHECKERS = {name for name, obj in vars(validation).items()
            if inspect.isfunction(obj) and obj.__module__ == validation.__name__}


def sections(doc: str) -> dict[str, list[str]]:
    """The lines under each section header of ``doc`` (indented below the header)."""
    found: dict[str, list[str]] = {}
    current, base = None, 0
    for line in inspect.cleandoc(doc).splitlines():
        match = SECTION.match(line)
        if match:
            current, base = match.group(2), len(match.group(1))
            found.setdefault(current, [])
            continue
        if current is None:
            continue
        if line.strip() and len(line) - len(line.lstrip()) <= base:
            current = None
            continue
        found[current].append(line)
    return found


def entries(lines: list[str]) -> set[str]:
    """The names a section documents: ``name (type): ...`` lines at its first indentation."""
    lines = [line for line in lines if line.strip()]
    if not lines:
        return set()
    first = min(len(line) - len(line.lstrip()) for line in lines)
    names = set()
    for line in lines:
        match = ENTRY.match(line)
        if match and len(line) - len(line.lstrip()) == first:
            names.update(n.strip().lstrip("*") for n in match.group(1).split(","))
    return names


def _tree(fn) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    try:
        source = textwrap.dedent(inspect.getsource(inspect.unwrap(fn)))
    except (OSError, TypeError):
        return None
    node = ast.parse(source).body[0]
    return node if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) else None


def _own_nodes(node):
    """The nodes of a function's body, not of the functions and classes defined in it."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda | ast.ClassDef):
            continue
        yield child
        yield from _own_nodes(child)


def _returns_value(fn, tree) -> bool:
    annotation = inspect.signature(fn).return_annotation
    if annotation is not inspect.Signature.empty:
        return annotation not in (None, "None", "NoReturn", "typing.NoReturn")
    return tree is not None and any(
        isinstance(n, ast.Return) and n.value is not None
        and not (isinstance(n.value, ast.Constant) and n.value.value is None)
        for n in _own_nodes(tree))


def _is_generator(tree) -> bool:
    return tree is not None and any(isinstance(n, ast.Yield | ast.YieldFrom)
                                    for n in _own_nodes(tree))


def _validates(fn, tree) -> bool:
    """Whether ``fn``'s source raises ValueError or calls a ``course_lib.validation`` check."""
    if tree is None:
        return False
    names = getattr(inspect.unwrap(fn), "__globals__", {})
    for node in ast.walk(tree):
        if isinstance(node, ast.Raise) and node.exc is not None:
            exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(exc, ast.Name) and exc.id == "ValueError":
                return True
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) \
                    and func.value.id == "validation" and func.attr in CHECKERS:
                return True
            if isinstance(func, ast.Name):
                target = names.get(func.id)
                if inspect.isfunction(target) and target.__module__ == validation.__name__:
                    return True
    return False


def function_problems(fn, *, skip_first: bool = False) -> list[str]:
    """What ``fn``'s docstring lacks; ``skip_first`` drops ``self``/``cls``."""
    doc = inspect.getdoc(fn)
    if not doc or not doc.strip():
        return ["no docstring"]
    found = sections(doc)
    problems = []
    params = list(inspect.signature(fn).parameters.values())
    if skip_first and params and params[0].name in ("self", "cls"):
        params = params[1:]
    named = [p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if named:
        documented = entries(found.get("Args", []) + found.get("Arguments", []))
        missing = [name for name in named if name not in documented]
        if "Args" not in found and "Arguments" not in found:
            problems.append("no Args: section")
        elif missing:
            problems.append(f"Args: does not name {', '.join(missing)}")
    tree = _tree(fn)
    if _is_generator(tree):
        if not {"Yields", "Returns"} & found.keys():
            problems.append("no Yields: section")
    elif _returns_value(fn, tree) and "Returns" not in found:
        problems.append("no Returns: section")
    if _validates(fn, tree) and "Raises" not in found:
        problems.append("no Raises: section (it raises ValueError)")
    return problems


def _class_doc(cls) -> str | None:
    """The class's own docstring (not the signature dataclasses write in its place)."""
    try:
        node = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
    except (OSError, TypeError):
        return cls.__dict__.get("__doc__")
    return ast.get_docstring(node)


def _commented_fields(cls) -> set[str]:
    """The fields of ``cls`` with a ``#:`` comment on the line above or at the end of the line."""
    lines, _ = inspect.getsourcelines(cls)
    node = ast.parse(textwrap.dedent("".join(lines))).body[0]
    names = set()
    for item in node.body:
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            above = lines[item.lineno - 2].strip() if item.lineno >= 2 else ""
            if above.startswith("#:") or "#:" in lines[item.lineno - 1]:
                names.add(item.target.id)
    return names


def class_problems(cls) -> list[str]:
    """What ``cls``'s docstring lacks: a docstring; its constructor's Args; its fields."""
    doc = _class_doc(cls)
    if not doc or not doc.strip():
        return ["no docstring"]
    found = sections(doc)
    documented = set()
    for header in ("Args", "Arguments", "Attributes"):
        documented |= entries(found.get(header, []))
    if dataclasses.is_dataclass(cls):
        fields = [f.name for f in dataclasses.fields(cls)
                  if f.name in cls.__dict__.get("__annotations__", {})]
        commented = _commented_fields(cls)
        missing = [f for f in fields if f not in documented and f not in commented]
        problems = [f"fields not documented: {', '.join(missing)}"] if missing else []
        post_init = cls.__dict__.get("__post_init__")
        if post_init is not None and "Raises" not in found and _validates(post_init,
                                                                           _tree(post_init)):
            problems.append("no Raises: section (its __post_init__ raises ValueError)")
        return problems
    init = cls.__dict__.get("__init__")
    if init is None or not inspect.isfunction(init):
        return []
    params = [p for p in list(inspect.signature(init).parameters.values())[1:]
              if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    init_doc = sections(inspect.getdoc(init) or "") if init.__doc__ else {}
    documented |= entries(init_doc.get("Args", []))
    missing = [p.name for p in params if p.name not in documented]
    problems = [f"constructor Args: does not name {', '.join(missing)}"] if missing else []
    if "Raises" not in found and "Raises" not in init_doc and _validates(init, _tree(init)):
        problems.append("no Raises: section (its constructor raises ValueError)")
    return problems


def _modules():
    yield course_lib
    for info in pkgutil.walk_packages(course_lib.__path__, "course_lib."):
        yield importlib.import_module(info.name)


def public_objects():
    """``(qualified name, object, kind)`` of every public function, class, method, property."""
    for module in _modules():
        for name, obj in sorted(vars(module).items()):
            if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
                continue
            if inspect.isfunction(obj):
                yield f"{module.__name__}.{name}", obj, "function"
            elif inspect.isclass(obj):
                yield f"{module.__name__}.{name}", obj, "class"
                for attr, member in sorted(vars(obj).items()):
                    if attr.startswith("_"):
                        continue
                    where = f"{module.__name__}.{name}.{attr}"
                    if isinstance(member, property | functools.cached_property):
                        yield where, member, "property"
                    elif isinstance(member, staticmethod):
                        yield where, member.__func__, "function"
                    elif isinstance(member, classmethod):
                        yield where, member.__func__, "method"
                    elif inspect.isfunction(member):
                        yield where, member, "method"


def problems(obj, kind: str) -> list[str]:
    if kind == "class":
        return class_problems(obj)
    if kind == "property":
        getter = obj.fget if isinstance(obj, property) else obj.func
        return [] if (getter.__doc__ or "").strip() else ["no docstring"]
    return function_problems(obj, skip_first=kind == "method")


def _course_object(module: str, name: str):
    """``module.name`` imported: a submodule, or the object the module holds (None if neither)."""
    try:
        return importlib.import_module(f"{module}.{name}")
    except ImportError:
        return getattr(importlib.import_module(module), name, None)


@functools.cache
def learner_facing() -> frozenset[str]:
    """The qualified names of the course_lib functions and classes that the lectures, the
    companions, the exercises and the solutions name in their code: imported from course_lib, or
    read as an attribute of a course_lib module they imported."""
    named = []
    for path in [*LECTURES, *COMPANIONS, *EXERCISES, *SOLUTIONS]:
        trees = []
        for cell in read(path).cells:
            if cell.cell_type == "code":
                code = "\n".join(line for line in cell.source.splitlines()
                                 if not line.lstrip().startswith(("%", "!")))
                try:
                    trees.append(ast.parse(code))
                except SyntaxError:
                    continue
        modules = {}
        for node in (n for tree in trees for n in ast.walk(tree)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("course_lib"):
                for alias in node.names:
                    obj = _course_object(node.module, alias.name)
                    named.append(obj)
                    if inspect.ismodule(obj):
                        modules[alias.asname or alias.name] = obj
            elif isinstance(node, ast.Import):
                modules.update({alias.asname: importlib.import_module(alias.name)
                                for alias in node.names
                                if alias.name.startswith("course_lib") and alias.asname})
        named += [getattr(modules[node.value.id], node.attr, None)
                  for tree in trees for node in ast.walk(tree)
                  if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                  and node.value.id in modules]
    return frozenset(f"{obj.__module__}.{obj.__qualname__}" for obj in named
                     if inspect.isfunction(obj) or inspect.isclass(obj))


def test_public_docstrings_have_the_sections():
    """Full sections on what a learner calls (a method as its class); a docstring elsewhere."""
    facing = learner_facing()
    bad = {}
    for where, obj, kind in public_objects():
        if where in facing or where.rsplit(".", 1)[0] in facing:
            found = problems(obj, kind)
        else:
            doc = _class_doc(obj) if kind == "class" else inspect.getdoc(obj)
            found = [] if (doc or "").strip() else ["no docstring"]
        if found:
            bad[where] = found
    assert not bad, "docstrings lacking sections:\n" + "\n".join(
        f"  {where}: {'; '.join(found)}" for where, found in sorted(bad.items()))


def test_the_walk_sees_the_package():
    seen = {where for where, _, _ in public_objects()}
    assert {"course_lib.model.gpt.GPTConfig", "course_lib.model.gpt.GPT.forward",
            "course_lib.units.storage_bytes", "course_lib.grading.expect"} <= seen
    assert not any(where.split(".")[-1].startswith("_") for where in seen)
    facing = learner_facing()
    assert {"course_lib.model.gpt.GPT", "course_lib.units.format_bytes",
            "course_lib.training.checkpointing.best_segments"} <= facing  # by import, by module
    assert not {"course_lib.validation.integer", "course_lib.model.kernels.allocated"} & facing


# The checker must be able to fail: bad docstrings are caught.

def _missing_arg(shape, dtype):
    """Bytes of a tensor.

    Args:
        shape: its shape.

    Returns:
        An int.
    """
    return 0


def _missing_returns(n: int) -> int:
    """Twice ``n``.

    Args:
        n (int): a number.
    """
    return 2 * n


def _missing_raises(n):
    """``n`` if it is positive.

    Args:
        n (int): a number.

    Returns:
        ``n``.
    """
    return validation.positive_int("n", n)


def _raises_itself(n) -> None:
    """Nothing.

    Args:
        n: anything.
    """
    if n:
        raise ValueError("n must be falsy")


def _generator(n):
    """Counts.

    Args:
        n: how far.
    """
    yield from range(n)


def _good(shape, *args, dtype="fp32", **kwargs) -> int:
    """Bytes of a tensor.

    Args:
        shape (tuple of int): its shape; each size an int >= 0.
        dtype (str): ``"fp32"`` or ``"bf16"``.
        **kwargs: ignored.

    Returns:
        int: the bytes.

    Raises:
        ValueError: naming ``shape`` for a negative size.
    """
    if any(d < 0 for d in shape):
        raise ValueError("shape must hold sizes >= 0")
    return 0


@dataclasses.dataclass
class _Config:
    """A config.

    Attributes:
        documented: a field.
    """

    documented: int = 1
    #: a field, commented as Sphinx reads it.
    commented: int = 2
    bare: int = 3


@dataclasses.dataclass
class _Checked:
    """A checked config.

    Attributes:
        size: a positive size.
    """

    size: int = 1

    def __post_init__(self):
        if self.size < 1:
            raise ValueError("size must be positive")


class _Thing:
    """A thing.

    Args:
        size (int): how big.
    """

    def __init__(self, size, colour):
        self.size, self.colour = size, colour


@pytest.mark.parametrize("fn, expected", [
    (_missing_arg, "Args: does not name dtype"),
    (_missing_returns, "no Returns: section"),
    (_missing_raises, "no Raises: section"),
    (_raises_itself, "no Raises: section"),
    (_generator, "no Yields: section"),
    (lambda x: x, "no docstring"),
])
def test_the_checker_rejects_a_bad_docstring(fn, expected):
    assert any(expected in problem for problem in function_problems(fn)), \
        function_problems(fn)


def test_the_checker_accepts_a_good_docstring_and_names_missing_fields():
    assert function_problems(_good) == []
    assert class_problems(_Config) == ["fields not documented: bare"]
    assert class_problems(_Thing) == ["constructor Args: does not name colour"]
    assert class_problems(_Checked) == [
        "no Raises: section (its __post_init__ raises ValueError)"]


def test_every_check_documents_the_grader_switch_and_its_return_value():
    from course_lib.grading import CHECKS

    assert len(CHECKS) >= 20
    for name, check in CHECKS.items():
        doc = inspect.getdoc(check)
        assert "(callable): the learner" in doc, name
        assert "Keyword Args:\n    quiet (bool)" in doc and "Returns:\n    bool: True when" in doc
