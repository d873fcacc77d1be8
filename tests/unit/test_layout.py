"""The package's layout: names that cannot shadow the standard library, a design map that
names every module, and packages by layer without import cycles between the modules named."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "turnstile"
DESIGN = ROOT / "docs" / "design.md"


def _modules() -> list[Path]:
    return sorted(
        path
        for path in PACKAGE.rglob("*.py")
        if path.name not in {"__init__.py", "__main__.py"} and "static" not in path.parts
    )


def _dotted(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def test_no_module_or_package_is_named_like_a_standard_library_module() -> None:
    # Run as a script from inside the package (a helper with the directory on sys.path),
    # such a module shadows the standard library's for everything the script imports.
    clashes = [
        str(path.relative_to(ROOT))
        for path in [*PACKAGE.rglob("*.py"), *(p for p in PACKAGE.rglob("*") if p.is_dir())]
        if path.stem in sys.stdlib_module_names and path.name != "__init__.py"
    ]
    assert clashes == []


def test_the_design_map_names_every_module() -> None:
    text = DESIGN.read_text(encoding="utf-8")
    named = set(re.findall(r"`(turnstile/[\w/]+\.py)`", text))
    missing = [
        str(p.relative_to(ROOT)) for p in _modules() if str(p.relative_to(ROOT)) not in named
    ]
    assert missing == [], f"docs/design.md does not describe: {missing}"
    stale = sorted(p for p in named if not (ROOT / p).is_file())
    assert stale == [], f"docs/design.md names modules that do not exist: {stale}"


def test_the_readme_links_the_design_map() -> None:
    assert "docs/design.md" in (ROOT / "README.md").read_text(encoding="utf-8")


def _imports(path: Path, *, module_level: bool = False, typing: bool = True) -> set[str]:
    """The turnstile modules a module imports: only at module level when ``module_level``;
    with those under ``if TYPE_CHECKING:`` unless ``typing`` is false."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: set[str] = set()

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if (
                not typing
                and isinstance(node, ast.If)
                and ast.unparse(node.test).endswith("TYPE_CHECKING")
            ):
                visit(node.orelse)
                continue
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                if node.module.startswith("turnstile"):
                    found.add(node.module)
                    found.update(f"{node.module}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.startswith("turnstile"))
            if module_level:
                continue
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.stmt):
                    visit([child])
                else:
                    for grandchild in ast.walk(child):
                        if isinstance(grandchild, ast.stmt):
                            visit([grandchild])

    visit(tree.body)
    return found


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ("turnstile.dev.devstack", "turnstile.dev.tinyqwen"),
        ("turnstile.server.metrics", "turnstile.proxy.core"),
        ("turnstile.tito.templates.audit", "turnstile.tito.templates.fixes"),
    ],
)
def test_no_import_cycle_between(first: str, second: str) -> None:
    modules = {_dotted(p): p for p in _modules()}
    forward = second in _imports(modules[first])
    backward = first in _imports(modules[second])
    assert not (forward and backward), f"{first} and {second} import each other"


def test_development_tooling_is_not_imported_by_the_runtime() -> None:
    runtime = [p for p in _modules() if "dev" not in p.relative_to(PACKAGE).parts[:1]]
    offenders = [
        str(p.relative_to(ROOT))
        for p in runtime
        if any(
            name.startswith("turnstile.dev")
            for name in _imports(p, module_level=True, typing=False)
        )
    ]
    assert offenders == []
