"""The docs stay what a reader needs: a README that is one page, figures that are
current, each document saying first whom it serves, links and commands that work,
and nothing in docs, code or tests that speaks of the project's own tickets or work
stages (that history is git's; a user or contributor cannot look those numbers up)."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))

# A ticket number ("issue" and digits) or a work stage named by its order (an
# ordinal, then "stop"): the words the project's own making left behind.
OWN_MAKING = re.compile(
    r"\b(first|second|third|fourth|fifth|this|last|next) stop\b|\bissue [0-9]+", re.I)
README_MAX_LINES = 220
BENCHMARKS_MAX_LINES = 420
LINK = re.compile(r"\]\(([^)\s]+)\)")
CODE_BLOCK = re.compile(r"```(\w*)\n(.*?)```", re.S)
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")


def project_files() -> list[Path]:
    """Every file of the checkout that git tracks or would track (new ones included),
    so that a file not yet committed is checked too."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                            cwd=REPO, capture_output=True, text=True, timeout=60, check=True)
    return [REPO / name for name in sorted(set(listed.stdout.splitlines()))
            if (REPO / name).is_file()]


def text_of(path: Path) -> str | None:
    """The file's text, or None for a binary file (no pattern can be read in it)."""
    data = path.read_bytes()
    if b"\0" in data[:8192]:
        return None
    return data.decode("utf-8", errors="replace")


def test_nothing_speaks_of_the_projects_own_tickets_or_work_stages():
    found = []
    for path in project_files():
        text = text_of(path)
        if text is None:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if OWN_MAKING.search(line):
                found.append(f"{path.relative_to(REPO)}:{number}: {line.strip()[:100]}")
    assert found == [], "say what the behaviour is instead:\n" + "\n".join(found)


def test_the_pattern_finds_what_it_is_meant_to_and_no_more():
    """The check above is only as good as its pattern: a ticket number and a work
    stage are found in any case; a process that stops, or the word issue alone, are not."""
    ticket, stage = "fixed for Issue " + "27", "the Fifth" + " stop"  # split: not found here
    assert OWN_MAKING.search(ticket) and OWN_MAKING.search(stage)
    assert not OWN_MAKING.search("the broker stops; a known issue; a stop of the node")


def test_the_readme_is_one_page():
    lines = README.read_text().count("\n")
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines (at most {README_MAX_LINES}): move what a reader "
        f"needs only once it runs into docs/")


def test_the_benchmarks_give_current_figures_not_a_diary():
    text = (REPO / "docs" / "benchmarks.md").read_text()
    lines = text.count("\n")
    assert lines <= BENCHMARKS_MAX_LINES, (
        f"docs/benchmarks.md has {lines} lines (at most {BENCHMARKS_MAX_LINES}): keep the "
        f"latest figures, drop superseded runs")
    dated = [h for h in text.splitlines() if h.startswith("#") and DATE.search(h)]
    assert dated == [], f"sections titled by date: {dated}"


@pytest.mark.parametrize("document", DOCS, ids=lambda p: p.name)
def test_every_document_says_first_whom_it_is_for(document):
    paragraphs = [p.strip() for p in document.read_text().split("\n\n") if p.strip()]
    assert paragraphs[0].startswith("# "), f"{document.name}: no title first"
    assert paragraphs[1].startswith("For "), (
        f"{document.name}: the paragraph after the title must start by saying whom the "
        f"document is for (\"For whoever ...\"), not {paragraphs[1][:60]!r}")


def anchors(markdown: str) -> set[str]:
    """The anchors a renderer gives the headings, as GitHub makes them: lower case,
    punctuation dropped, spaces as hyphens."""
    prose = CODE_BLOCK.sub("", markdown)
    titles = re.findall(r"^#+ (.+)$", prose, flags=re.M)
    return {re.sub(r"[^\w\- ]", "", t.strip().lower()).replace(" ", "-") for t in titles}


def test_every_relative_link_between_the_readme_and_the_docs_resolves():
    bad = []
    for document in [README, *DOCS]:
        text = document.read_text()
        for target in LINK.findall(CODE_BLOCK.sub("", text)):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):
                continue  # a web address
            path, _, anchor = target.partition("#")
            linked = (document.parent / path).resolve() if path else document
            if not linked.exists():
                bad.append(f"{document.name}: {target} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked.read_text()):
                bad.append(f"{document.name}: {target} (no such heading)")
    assert bad == []


def shell_lines(markdown: str) -> list[list[str]]:
    """The command lines of the code blocks that are not a config or a program, each
    as its words (comments and continuations joined, `&` dropped)."""
    commands = []
    for language, body in CODE_BLOCK.findall(markdown):
        if language in ("toml", "python", "ini"):
            continue
        for line in body.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0].strip().rstrip("&").strip()
            if line.startswith(("tierkv", "python -m ", "scripts/")) and "'" not in line:
                commands.append(shlex.split(line))
    return commands


def shown_commands() -> list[list[str]]:
    return [c for d in [README, *DOCS] for c in shell_lines(d.read_text())]


def test_every_tierkv_sub_command_shown_exists():
    """`tierkv X ...` in a code block: `tierkv X --help` succeeds, and a bench part
    named after `tierkv bench` is one the bench knows."""
    from tierkv.bench import select_parts

    shown = [c for c in shown_commands() if c[0] == "tierkv"]
    assert {"up", "status", "down"} <= {c[1] for c in shown if len(c) > 1}
    for sub in sorted({c[1] for c in shown if len(c) > 1}):
        out = subprocess.run([sys.executable, "-m", "tierkv.cli", sub, "--help"], cwd=REPO,
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, f"tierkv {sub} --help: {out.stderr[-300:]}"
    parts = [w for c in shown if c[1:2] == ["bench"] for w in c[2:3]
             if not w.startswith("-") and "|" not in w and "[" not in w]
    select_parts(parts)  # raises on a part that does not exist


def test_every_program_and_module_shown_exists():
    """`scripts/demo` and `scripts/test` are there to run; `tierkv-broker`,
    `tierkv-tier`, ... are installed scripts; `python -m M` names a module that is there."""
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    commands = shown_commands()
    assert ["scripts/demo"] in commands and ["scripts/test"] in commands
    for command in commands:
        if command[0].startswith("scripts/"):
            assert os.access(REPO / command[0], os.X_OK), command
        elif command[0].startswith("tierkv-"):
            assert command[0] in scripts, command
        elif command[:2] == ["python", "-m"]:
            assert importlib.util.find_spec(command[2]) is not None, command
