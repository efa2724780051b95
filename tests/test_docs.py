"""The README and the reference docs stay true: the README is short, every relative link resolves
(files and #anchors), and every ``adaspec ...`` command line they show parses against the CLI
(``adaspec.cli.parse_command``: options and values checked, nothing run); the cheap ones run."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from adaspec.cli import UsageError, app, parse_command

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md", ROOT / "tools" / "README.md"]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```(\w*)\s*$")
SPAN = re.compile(r"`(adaspec [^`]+)`")
#: commands that are cheap enough to run for real
CHEAP = (["--help"], ["bench", "--help"], ["fetch", "--list"])


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, markup and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out: set[str] = set()
    fenced = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            fenced = not fenced
        if fenced or not line.startswith("#"):
            continue
        base = slug(line.lstrip("#"))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def prose_and_code(page: Path) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """(line number, text) of the prose lines and of the shell code lines (continuations joined)."""
    prose: list[tuple[int, str]] = []
    code: list[tuple[int, str]] = []
    lang, pending, start = None, "", 0
    for i, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        m = FENCE.match(line)
        if m:
            lang = None if lang is not None else m.group(1)
            continue
        if lang is None:
            prose.append((i, line))
        elif lang in ("bash", "sh", "shell", ""):
            if not pending:
                start = i
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1] + " "
                continue
            code.append((start, pending + line))
            pending = ""
    return prose, code


def adaspec_commands(text: str) -> list[list[str]]:
    """The ``adaspec`` invocations of a shell line: each simple command whose program (after
    VAR=value assignments) is ``adaspec``, as its argument list."""
    lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    try:
        tokens = list(lexer)
    except ValueError:  # an unclosed quote in prose: not a command line
        return []
    out, cmd = [], []
    for tok in [*tokens, ";"]:
        if tok and set(tok) <= set(";&|()<>"):
            words = [w for w in cmd]
            while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
                words.pop(0)
            if words and words[0] == "adaspec":
                out.append(words[1:])
            cmd = []
        else:
            cmd.append(tok)
    return out


def all_commands() -> list[tuple[str, list[str]]]:
    found = []
    for page in PAGES:
        prose, code = prose_and_code(page)
        for n, line in code:
            found += [(f"{page.relative_to(ROOT)}:{n}", args) for args in adaspec_commands(line)]
        for n, line in prose:  # `adaspec NAME` alone names a command; with arguments it is a command line
            for span in SPAN.findall(line):
                found += [(f"{page.relative_to(ROOT)}:{n}", args if len(args) > 1 else [*args, "--help"])
                          for args in adaspec_commands(span)]
    return found


def test_readme_is_short():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) < 200, f"README.md has {len(lines)} lines: keep it under 200 (details go to docs/)"


def test_every_relative_link_resolves():
    bad = []
    for page in PAGES:
        prose, _ = prose_and_code(page)
        for n, line in prose:
            for m in LINK.finditer(line):
                target = m.group(1) or m.group(2)
                if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
                    continue
                path, _, anchor = target.partition("#")
                dest = (page.parent / path).resolve() if path else page
                where = f"{page.relative_to(ROOT)}:{n}: {target}"
                if not dest.exists():
                    bad.append(f"{where} (no such file)")
                elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                    bad.append(f"{where} (no such heading in {dest.name})")
    assert not bad, "broken links:\n" + "\n".join(bad)


def test_the_link_checker_finds_a_broken_link_and_a_missing_anchor(tmp_path):
    """Negative control: the slugs are GitHub's, and a wrong anchor is one."""
    page = tmp_path / "p.md"
    page.write_text("# Hello, `world` (2)\n## Hello, `world` (2)\n```bash\n# not a heading\n```\n")
    assert anchors(page) == {"hello-world-2", "hello-world-2-1"}
    assert slug("`auto` against its single drafters, and its ablation") == "auto-against-its-single-drafters-and-its-ablation"


def test_every_adaspec_command_in_the_docs_parses():
    commands = all_commands()
    assert len(commands) > 50  # the docs show many: the extraction works
    names = set(typer.main.get_command(app).commands)
    bad = []
    for where, args in commands:
        if "--help" in args:  # `adaspec NAME --help` or a command named in prose: NAME must exist
            head = args[:args.index("--help")]
            if head and head[0] not in names:
                bad.append(f"{where}: adaspec {shlex.join(args)}\n    no such command {head[0]!r}")
            continue
        try:
            parse_command(args)
        except UsageError as exc:
            bad.append(f"{where}: adaspec {shlex.join(args)}\n    {exc.format_message()}")
    assert not bad, "commands that do not parse:\n" + "\n".join(bad)


def test_the_command_check_rejects_what_the_cli_rejects():
    """Negative control: an unknown option, a bad value and an unknown command fail to parse."""
    assert adaspec_commands("PYTHONPATH=src adaspec bench -n 8 && pip install adaspec # adaspec x") == [["bench", "-n", "8"]]
    for args in (["bench", "--no-such-option"], ["bench", "-n", "many"], ["no-such-command"], ["bench", "--linear"]):
        with pytest.raises(UsageError):
            parse_command(args)


@pytest.mark.parametrize("args", CHEAP, ids=" ".join)
def test_the_cheap_commands_run(args):
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    assert res.output.strip()
