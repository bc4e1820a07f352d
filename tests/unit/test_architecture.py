"""The package rules, read from the source with ast: the imports that must never exist (the shared
ARCHITECTURE.md's "Never" rules), and docs/architecture.md's who-imports-whom tables held to the code.
Every `import` and `from ... import` of every module counts, at any depth (lazy imports inside functions and
TYPE_CHECKING blocks too)."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "chronomq"
ARCHITECTURE_DOC = ROOT / "docs" / "architecture.md"
IMPORTS_HEADING = "## Who imports whom"
BROKER_HEADING = "### Inside `broker/`"


def _module_name(path: Path, src: Path = SRC) -> str:
    rel = path.relative_to(src.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


class _Import(NamedTuple):
    target: str  # the absolute module of the statement (`from target import names`, or `import target`)
    names: tuple[str, ...]  # the names a `from` statement imports; () for `import target`
    types_only: bool  # inside an `if TYPE_CHECKING:` block


def _is_type_checking(test: ast.expr) -> bool:
    return ast.unparse(test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")


def _statements(path: Path, mod: str | None = None) -> Iterator[_Import]:
    """Every import statement of ``path`` (the module ``mod``, default: its name under src/), at any depth,
    with relative imports made absolute."""
    mod = mod or _module_name(path)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]

    def visit(node: ast.AST, types_only: bool) -> Iterator[_Import]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    yield from visit_one(stmt, True)
                for stmt in child.orelse:
                    yield from visit_one(stmt, types_only)
            else:
                yield from visit_one(child, types_only)

    def visit_one(node: ast.AST, types_only: bool) -> Iterator[_Import]:
        if isinstance(node, ast.Import):
            for a in node.names:
                yield _Import(a.name, (), types_only)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            yield _Import(target, tuple(a.name for a in node.names), types_only)
        yield from visit(node, types_only)

    yield from visit(ast.parse(path.read_text(encoding="utf-8")), False)


def _is_chronomq(name: str) -> bool:
    return name == "chronomq" or name.startswith("chronomq.")


def _imports(path: Path, mod: str | None = None) -> set[str]:
    """The chronomq modules ``path`` (the module ``mod``, default: its name under src/) imports, absolute."""
    out: set[str] = set()
    for imp in _statements(path, mod):
        out.add(imp.target)
        out.update(f"{imp.target}.{n}" for n in imp.names)  # `from chronomq import message`
    return {i for i in out if _is_chronomq(i)}


def _package_imports(package: str) -> dict[str, set[str]]:
    root = SRC / package
    files = [root.with_suffix(".py")] if root.with_suffix(".py").exists() else sorted(root.rglob("*.py"))
    return {_module_name(f): _imports(f) for f in files}


def _touches(imported: str, package: str) -> bool:
    name = f"chronomq.{package}"
    return imported == name or imported.startswith(name + ".")


def _violations(package: str, forbidden: list[str]) -> list[str]:
    return sorted(f"{mod} imports {i}" for mod, imps in _package_imports(package).items() for i in imps
                  if any(_touches(i, f) for f in forbidden))


@pytest.mark.parametrize("package,forbidden", [
    ("store", ["remoting", "broker", "client", "namesrv", "grpc", "acl", "web"]),
    ("client", ["broker", "store", "delay", "namesrv"]),
    ("delay", ["grpc", "acl", "web", "remoting", "broker", "client"]),
    ("ha", ["grpc", "acl", "web", "client"]),
])
def test_forbidden_imports(package: str, forbidden: list[str]) -> None:
    assert _violations(package, forbidden) == []


def test_the_filter_engine_imports_only_the_message_model() -> None:
    # filter/ is pure logic the broker and the gRPC endpoint both call: stdlib and message.py only
    bad = sorted(f"{mod} imports {i}" for mod, imps in _package_imports("filter").items() for i in imps
                 if i != "chronomq" and not (_touches(i, "message") or _touches(i, "filter")))
    assert bad == []
    assert _package_imports("filter"), "no filter/ package"


def test_codecs_never_import_storage_or_the_broker() -> None:
    for mod in ("remoting/codec.py", "remoting/codes.py", "ha/codec.py"):
        imps = _imports(SRC / mod)
        assert not [i for i in imps if _touches(i, "store") or _touches(i, "broker")], mod


@pytest.mark.parametrize("package", ["spark", "web"])
def test_clients_import_only_the_client_and_the_message_model(package: str) -> None:
    if not (SRC / package).exists():
        pytest.skip(f"no {package}/ package")
    allowed = ("client", "message", package)
    bad = sorted(f"{mod} imports {i}" for mod, imps in _package_imports(package).items() for i in imps
                 if i != "chronomq" and not any(_touches(i, a) for a in allowed))
    assert bad == []


def test_the_checker_sees_lazy_relative_and_package_imports(tmp_path: Path) -> None:
    # the checker itself can fail: a module with every kind of import it must see
    sample = tmp_path / "probe.py"
    sample.write_text("from __future__ import annotations\nimport chronomq.client\n"
                      "from ..broker import services\ndef f():\n    from chronomq import web\n")
    found = _imports(sample, "chronomq.store.probe")
    assert {"chronomq.client", "chronomq.broker", "chronomq.broker.services", "chronomq.web"} <= found


# --- docs/architecture.md's who-imports-whom tables, held to the code -----------------------------------

def _modules(src: Path) -> dict[str, Path]:
    """Every module under ``src`` (the chronomq package directory) by dotted name."""
    return {_module_name(f, src): f for f in sorted(src.rglob("*.py"))}


def _imported_modules(path: Path, mod: str, modules: dict[str, Path]) -> dict[str, bool]:
    """The chronomq modules one file imports -> whether only for types: `from a import b` counts as the
    module a.b when that is a module, else as a (an attribute of a, `__version__` of the root package)."""
    out: dict[str, bool] = {}
    for imp in _statements(path, mod):
        if not _is_chronomq(imp.target):
            continue
        names = [f"{imp.target}.{n}" for n in imp.names] or [imp.target]
        for name in names:
            target = name if name in modules else imp.target
            out[target] = out.get(target, True) and imp.types_only
    return out


def _unit(src: Path, module: str) -> str:
    """The top-level part of src/chronomq a dotted module belongs to, as the table names it: `remoting/`,
    `message.py`, or `__init__.py` for the root package itself."""
    parts = module.split(".")
    if len(parts) == 1:
        return "__init__.py"
    return f"{parts[1]}/" if (src / parts[1]).is_dir() else f"{parts[1]}.py"


def _units(src: Path) -> list[str]:
    out = []
    for f in sorted(src.iterdir()):
        if f.is_dir() and (f / "__init__.py").exists():
            out.append(f"{f.name}/")
        elif f.suffix == ".py":
            out.append(f.name)
    return out


def _code_package_imports(src: Path) -> dict[str, set[str]]:
    """Each top-level package or module of src/chronomq -> the others it imports (anything in it, at any
    depth, types-only imports included)."""
    modules = _modules(src)
    out: dict[str, set[str]] = {u: set() for u in _units(src)}
    for mod, path in modules.items():
        unit = _unit(src, mod)
        for target in _imported_modules(path, mod, modules):
            other = _unit(src, target)
            if other != unit:
                out[unit].add(other)
    return out


def _code_inner_imports(src: Path, package: str) -> dict[str, tuple[set[str], set[str]]]:
    """Each module of the package -> (the package's modules it imports at run time, at any depth, lazily
    too; those it imports only under TYPE_CHECKING). Names relative to the package: `processors/send`."""
    modules = _modules(src)
    prefix = f"chronomq.{package}"

    def short(mod: str) -> str:
        path = modules[mod].relative_to(src / package).with_suffix("")
        return path.as_posix()

    out: dict[str, tuple[set[str], set[str]]] = {}
    for mod, path in modules.items():
        if not (mod == prefix or mod.startswith(prefix + ".")):
            continue
        runtime, types = out.setdefault(short(mod), (set(), set()))
        for target, types_only in _imported_modules(path, mod, modules).items():
            if target != mod and (target == prefix or target.startswith(prefix + ".")):
                (types if types_only else runtime).add(short(target))
    return out


_TICKED = re.compile(r"`([^`]+)`")


def _doc_table(text: str, heading: str) -> dict[str, list[set[str]]]:
    """The first markdown table after ``heading`` (a line of its own): the name in each row's first cell ->
    the backticked names of each further cell. A duplicate row raises AssertionError."""
    lines = text.splitlines()
    assert heading in lines, f"docs/architecture.md has no heading {heading!r}"
    rows: dict[str, list[set[str]]] = {}
    started = False
    for line in lines[lines.index(heading) + 1:]:
        if not line.startswith("|"):
            if started:
                break
            continue
        started = True
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        first = _TICKED.findall(cells[0])
        if not first:
            continue  # the header and the separator row
        assert first[0] not in rows, f"{heading!r}: two rows for `{first[0]}`"
        rows[first[0]] = [set(_TICKED.findall(c)) for c in cells[1:]]
    assert rows, f"no table after {heading!r} in docs/architecture.md"
    return rows


def _differences(table: dict[str, set[str]], code: dict[str, set[str]], what: str) -> list[str]:
    """What the doc's ``table`` gets wrong about ``code``, one line per row: each line names the row and
    the imports the code has and the table lacks (added) or the table lists and the code lacks (removed)."""
    out = []
    for name in sorted(code.keys() - table.keys()):
        out.append(f"{what}: `{name}` is in the code but has no row (a new module or package); its row: "
                   f"{', '.join(f'`{i}`' for i in sorted(code[name])) or 'no imports'}")
    for name in sorted(table.keys() - code.keys()):
        out.append(f"{what}: row `{name}` names nothing in src/chronomq (removed or renamed)")
    for name in sorted(code.keys() & table.keys()):
        added, removed = code[name] - table[name], table[name] - code[name]
        if added:
            out.append(f"{what}: row `{name}`: the code imports {', '.join(f'`{i}`' for i in sorted(added))}"
                       " (an added import), the row does not list it")
        if removed:
            out.append(f"{what}: row `{name}` lists {', '.join(f'`{i}`' for i in sorted(removed))}, which the"
                       " code no longer imports (a removed import)")
    return out


def _package_table_differences(doc: str, src: Path) -> list[str]:
    table = {name: cells[0] if cells else set() for name, cells in _doc_table(doc, IMPORTS_HEADING).items()}
    return _differences(table, _code_package_imports(src), "who imports whom")


def _broker_table_differences(doc: str, src: Path) -> list[str]:
    rows = _doc_table(doc, BROKER_HEADING)
    code = _code_inner_imports(src, "broker")
    out = []
    for column, what in ((0, "inside broker/, imports"), (1, "inside broker/, for types only")):
        table = {name: cells[column] if len(cells) > column else set() for name, cells in rows.items()}
        out += _differences(table, {name: pair[column] for name, pair in code.items()}, what)
    return out


def test_the_who_imports_whom_table_is_the_code() -> None:
    differences = _package_table_differences(ARCHITECTURE_DOC.read_text(encoding="utf-8"), SRC)
    assert not differences, "docs/architecture.md is out of date:\n" + "\n".join(differences)


def test_the_broker_module_table_is_the_code() -> None:
    differences = _broker_table_differences(ARCHITECTURE_DOC.read_text(encoding="utf-8"), SRC)
    assert not differences, "docs/architecture.md is out of date:\n" + "\n".join(differences)


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    src = tmp_path / "chronomq"
    for name, text in files.items():
        path = src / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return src


_PROBE_DOC = """## Who imports whom

| package | imports from chronomq | notes |
|---|---|---|
| `__init__.py` | stdlib only | |
| `clock.py` | stdlib only | |
| `broker/` | `clock.py`, `__init__.py` | |

### Inside `broker/`

| module | imports from `broker/` | for types only |
|---|---|---|
| `__init__` | | |
| `a` | `b` | |
| `b` | | `a` |
"""


def test_the_table_check_names_the_row_and_the_difference(tmp_path: Path) -> None:
    # the checker itself can fail: a tree that matches the probe doc, then one that drifted from it
    files = {"__init__.py": "__version__ = '1'\n", "clock.py": "", "broker/__init__.py": "",
             "broker/a.py": "from chronomq import __version__\nfrom . import b\n"
                            "def f():\n    import chronomq.clock\n",
             "broker/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import X\n"}
    src = _tree(tmp_path, files)
    assert _package_table_differences(_PROBE_DOC, src) == []
    assert _broker_table_differences(_PROBE_DOC, src) == []

    (src / "broker" / "a.py").write_text("from . import b\n")  # drops both chronomq.__version__ and clock
    (src / "levels.py").write_text("from chronomq.clock import Clock\n")  # a new top-level leaf
    (src / "broker" / "b.py").write_text("from .a import X\n")  # a types-only import becomes a real one
    assert _package_table_differences(_PROBE_DOC, src) == [
        "who imports whom: `levels.py` is in the code but has no row (a new module or package); its row: "
        "`clock.py`",
        "who imports whom: row `broker/` lists `__init__.py`, `clock.py`, which the code no longer imports "
        "(a removed import)",
    ]
    assert _broker_table_differences(_PROBE_DOC, src) == [
        "inside broker/, imports: row `b`: the code imports `a` (an added import), the row does not list it",
        "inside broker/, for types only: row `b` lists `a`, which the code no longer imports"
        " (a removed import)",
    ]


def test_a_types_only_import_is_one_only_when_every_import_of_it_is(tmp_path: Path) -> None:
    probe = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import b\nelse:\n    pass\n"
             "def f():\n    from .b import g\n")
    src = _tree(tmp_path, {"__init__.py": "", "p/__init__.py": "", "p/b.py": "", "p/a.py": probe})
    assert _code_inner_imports(src, "p")["a"] == ({"b"}, set())


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of ``graph`` (module -> the modules it imports) as [a, b, ..., a], or []."""
    done: set[str] = set()

    def walk(node: str, path: list[str]) -> list[str]:
        if node in path:
            return [*path[path.index(node):], node]
        if node in done:
            return []
        for nxt in sorted(graph.get(node, ())):
            found = walk(nxt, [*path, node])
            if found:
                return found
        done.add(node)
        return []

    for start in sorted(graph):
        found = walk(start, [])
        if found:
            return found
    return []


def test_the_broker_modules_import_one_another_without_a_cycle() -> None:
    # types-only imports do not run; every other one does, lazy ones when their function first runs
    runtime = {name: pair[0] for name, pair in _code_inner_imports(SRC, "broker").items()}
    assert _cycle(runtime) == [], "an import cycle in broker/"
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]



def _layout_names(readme: str) -> list[str]:
    """The first backticked name of each bullet of README.md's "## Layout" section."""
    section = readme.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    return [m.group(1) for m in re.finditer(r"^- `([^`]+)`", section, re.MULTILINE)]


def test_the_readme_layout_lists_every_package() -> None:
    listed = _layout_names((ROOT / "README.md").read_text(encoding="utf-8"))
    code = [u for u in _units(SRC) if u != "__init__.py"]
    assert sorted(listed) == sorted(set(listed)), "README.md's layout lists a package twice"
    assert {"missing from README.md's layout": sorted(set(code) - set(listed)),
            "in README.md's layout but not in src/chronomq": sorted(set(listed) - set(code))} == \
        {"missing from README.md's layout": [], "in README.md's layout but not in src/chronomq": []}
    assert _layout_names("x\n## Layout\n\n- `a/`: A\n- `b.py`: B\n\n## Next\n- `c/`\n") == ["a/", "b.py"]

# --- doc citations in docstrings and comments: docs/<name>.md#<anchor> must name a heading -------------

_CITATION = re.compile(r"docs/([\w.-]+\.md)(?:#([\w-]+))?")


def _anchors(markdown: str) -> set[str]:
    """The anchors of a markdown file's headings, as GitHub makes them (lower case, punctuation dropped,
    spaces to hyphens, -1, -2 ... for repeats); lines inside code fences are not headings."""
    out: set[str] = set()
    fenced = False
    for line in markdown.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            anchor, n = slug, 0
            while anchor in out:
                n += 1
                anchor = f"{slug}-{n}"
            out.add(anchor)
    return out


def _citation_problems(src: Path, docs: Path) -> list[str]:
    problems = []
    anchors: dict[str, set[str]] = {}
    for path in sorted(src.rglob("*.py")):
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for name, anchor in _CITATION.findall(line):
                where = f"{path.relative_to(src.parent)}:{n}"
                doc = docs / name
                if not doc.exists():
                    problems.append(f"{where} cites docs/{name}, which does not exist")
                    continue
                if name not in anchors:
                    anchors[name] = _anchors(doc.read_text(encoding="utf-8"))
                if anchor and anchor not in anchors[name]:
                    problems.append(f"{where} cites docs/{name}#{anchor}: no heading has that anchor")
    return problems


def test_every_doc_section_cited_in_the_code_exists() -> None:
    assert _citation_problems(SRC, ROOT / "docs") == []


def test_a_citation_of_a_missing_section_is_named(tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "p.md").write_text("# P\n\n## Stored record\n```sh\n# not a heading\n```\n### Inside `broker/`\n"
                               "## Stored record\n")
    assert _anchors((docs / "p.md").read_text()) == {"p", "stored-record", "inside-broker", "stored-record-1"}
    src = _tree(tmp_path, {"m.py": '"""See docs/p.md#stored-record and docs/p.md."""\n'
                                   "# docs/p.md#not-a-heading, docs/q.md#x\n"})
    assert _citation_problems(src, docs) == [
        "chronomq/m.py:2 cites docs/p.md#not-a-heading: no heading has that anchor",
        "chronomq/m.py:2 cites docs/q.md, which does not exist",
    ]


def test_no_code_waits_with_asyncio_wait_for() -> None:
    """Python 3.11's ``asyncio.wait_for`` returns the awaited result when a cancel arrives in the loop turn
    the result does, so a service stopped at that moment runs on (a promoted slave's HA client went on
    linking to its dead master); ``async with asyncio.timeout(...)`` delivers the cancel."""
    users = [f"{path.relative_to(SRC.parent)}:{n}" for path in sorted(SRC.rglob("*.py"))
             for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
             if "asyncio.wait_for(" in line]
    assert users == []
