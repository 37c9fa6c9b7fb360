"""The README, docs/ and CHANGELOG keep their shape: a short README that holds the two commands, narrow lines,
relative links that resolve (files and ``#anchors``), and a Keep a Changelog file with the released version.

Fast: reads files only (no trainer, no verl import).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MAX_README_LINES = 250
MAX_LINE = 120
#: The two commands, verbatim as the README shows them (CI's .ci/run runs the second).
COMMANDS = ("./run verl-mtp demo", "./run pytest -q")
#: Public names the README documents (users configure or call them by these names).
PUBLIC_NAMES = ("hybrid_forward", "export_mtp_weights", "verl-mtp demo", "python -m verl_mtp_plugin.main_ppo")


def _docs_pages() -> list[Path]:
    return sorted(DOCS.glob("*.md"))


def _long_lines(path: Path, *, allow_table_rows: bool) -> list[str]:
    out = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if len(line) > MAX_LINE and not (allow_table_rows and line.startswith("|")):
            out.append(f"{path.relative_to(ROOT)}:{i}: {len(line)} chars")
    return out


def _strip_code(text: str) -> str:
    """The text without fenced code blocks and inline code spans (links inside them are not links)."""
    text = re.sub(r"(?ms)^\s*```.*?^\s*```[^\n]*$", "", text)
    return re.sub(r"`[^`]+`", "", text, flags=re.S)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (word characters, spaces and hyphens kept),
    spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading anchors by its text
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a markdown file (repeated headings get GitHub's ``-1``, ``-2`` suffixes)."""
    text = re.sub(r"(?ms)^\s*```.*?^\s*```[^\n]*$", "", path.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    out = set()
    for m in re.finditer(r"(?m)^#{1,6}\s+(.*?)\s*#*\s*$", text):
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(path: Path) -> list[str]:
    """Relative markdown links of ``path`` whose file does not exist or whose ``#anchor`` is not a heading there."""
    out = []
    for m in re.finditer(r"\[[^\]]*\]\(([^)\s]+)\)", _strip_code(path.read_text(encoding="utf-8"))):
        target = m.group(1)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(ROOT)}: ({target})"
        if not dest.exists():
            out.append(f"{where}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            out.append(f"{where}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    return out


def test_readme_is_at_most_250_lines_of_at_most_120_characters():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines (at most {MAX_README_LINES})"
    assert _long_lines(README, allow_table_rows=False) == []


def test_docs_pages_exist_with_an_index_and_narrow_lines():
    pages = _docs_pages()
    assert DOCS / "README.md" in pages, "docs/README.md (the index) is missing"
    long = [entry for page in pages for entry in _long_lines(page, allow_table_rows=True)]
    assert long == [], "lines over 120 characters (only table rows may be longer):\n" + "\n".join(long)


def test_the_index_links_every_docs_page():
    index = (DOCS / "README.md").read_text(encoding="utf-8")
    missing = [p.name for p in _docs_pages() if p.name != "README.md" and f"]({p.name})" not in index]
    assert missing == [], f"docs/README.md does not link {missing}"


@pytest.mark.parametrize("name", ["README.md", "benchmarks/RESULTS.md"] + [f"docs/{p.name}" for p in _docs_pages()])
def test_relative_links_resolve_to_files_and_headings(name):
    assert broken_links(ROOT / name) == []


def test_readme_holds_the_two_commands_verbatim_and_ci_runs_the_test_command():
    lines = [line.split("#")[0].strip() for line in README.read_text(encoding="utf-8").splitlines()]
    for command in COMMANDS:
        assert command in lines, f"README.md lost the command line {command!r}"
    assert COMMANDS[1] in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()


def test_readme_documents_the_public_names():
    from verl_mtp_plugin.config_keys import WORKER_EXTENSION_CLS

    text = README.read_text(encoding="utf-8")
    missing = [n for n in (*PUBLIC_NAMES, WORKER_EXTENSION_CLS) if n not in text]
    assert missing == [], f"README.md no longer names {missing}"


def test_changelog_keeps_a_changelog_with_the_released_version():
    from verl_mtp_plugin._version import __version__

    text = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    headings = re.findall(r"(?m)^## \[([^\]]+)\](.*)$", text)
    assert headings and headings[0][0] == "Unreleased", "CHANGELOG.md must open with ## [Unreleased]"
    released = {name: rest for name, rest in headings[1:]}
    assert __version__ in released, f"CHANGELOG.md has no ## [{__version__}] section (the package's version)"
    assert re.fullmatch(r" - \d{4}-\d{2}-\d{2}", released[__version__]), "a release heading is ## [X.Y.Z] - YYYY-MM-DD"
    assert _long_lines(ROOT / "CHANGELOG.md", allow_table_rows=True) == []
