"""The imports that must never exist (the shared ARCHITECTURE.md's "Never" rules), read from the source with
ast: every `import` and `from ... import` of every module, at any depth (lazy imports inside functions and
TYPE_CHECKING blocks count too)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "chronomq"


def _module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, mod: str | None = None) -> set[str]:
    """The chronomq modules ``path`` (the module ``mod``, default: its name under src/) imports, absolute."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    mod = mod or _module_name(path)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out.add(target)
            out.update(f"{target}.{a.name}" for a in node.names)  # `from chronomq import message`
    return {i for i in out if i == "chronomq" or i.startswith("chronomq.")}


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
