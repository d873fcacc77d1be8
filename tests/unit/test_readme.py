"""The README's schema table is the one the code declares, and its commands exist."""

from __future__ import annotations

from pathlib import Path

from turnstile.output.schema import schema_markdown

ROOT = Path(__file__).resolve().parents[2]


def test_readme_schema_table_matches_the_declared_schema() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    begin = readme.index("<!-- schema:begin")
    begin = readme.index("\n", begin) + 1
    end = readme.index("<!-- schema:end -->")
    documented = readme[begin:end].strip().replace("#### `", "### `")
    assert documented == schema_markdown().strip(), "run `turnstile schema` and update README"


def test_ci_runs_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    command = ".venv/bin/python -m pytest"
    assert command in readme and command in ci
