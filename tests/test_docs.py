"""The docs cannot drift from the code: docs/flags.md is what scripts/gen_flags.py writes and
carries every `--help` flag with its default, docs/README.md indexes every page, and every
relative markdown link in README.md and docs/*.md resolves (to a file and, for a .md, a heading)."""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
from pathlib import Path
from urllib.parse import unquote

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = sorted(p.relative_to(REPO).as_posix() for p in [REPO / "README.md", *(REPO / "docs").glob("*.md")])


def _gen_flags():
    spec = importlib.util.spec_from_file_location("gen_flags", REPO / "scripts" / "gen_flags.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_flags_page_is_what_the_generator_writes():
    page = _gen_flags().render()
    assert (REPO / "docs" / "flags.md").read_text() == page, "docs/flags.md is stale: run .venv/bin/python scripts/gen_flags.py"


def _help_output(monkeypatch, capsys) -> tuple[str, argparse.ArgumentParser]:
    """`python -m serve.main --help` in-process (no server starts: argparse exits after printing),
    in an empty environment (defaults read from JAX_* variables are the page's "unset" ones) and
    wide enough that no help line wraps; with the parser, for the defaults --help does not print."""
    from serve.main import parse_all_args

    printed = []
    print_help = argparse.ArgumentParser.print_help
    with monkeypatch.context() as m, pytest.raises(SystemExit):
        m.setattr(argparse.ArgumentParser, "print_help", lambda self, *a: (printed.append(self), print_help(self, *a)))
        m.setattr(os, "environ", {"COLUMNS": "100000"})
        parse_all_args(["--help"])
    return capsys.readouterr().out, printed[0]


def _help_entries(text: str) -> dict[str, str]:
    """Each option's flags -> its help text, from the "options" part of --help."""
    entries, current = {}, None
    body = text[text.index("\noptions:") :]
    for line in body.splitlines():
        m = re.match(r"  (-\S.*?)(?:\s{2,}(.*))?$", line)
        if m:
            current = [re.findall(r"--[a-z0-9][a-z0-9-]*", m.group(1)), m.group(2) or ""]
            for flag in current[0]:
                entries[flag] = current
        elif current is not None and line.startswith(" ") and line.strip():
            current[1] = (current[1] + " " + line.strip()).strip()
        else:
            current = None
    return {flag: help_text for flag, (_, help_text) in entries.items()}


def _flags_page_defaults() -> dict[str, str]:
    """Each flag on docs/flags.md -> its default cell's value (the first code span, unescaped)."""
    out = {}
    for line in (REPO / "docs" / "flags.md").read_text().splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        if len(cells) != 4 or not cells[0].startswith("`--"):
            continue
        code = re.match(r"`([^`]*)`", cells[2])
        value = (code.group(1) if code else cells[2]).replace(r"\|", "|")
        for flag in re.findall(r"--[a-z0-9][a-z0-9-]*", cells[0]):
            out[flag] = "" if value == '""' else value
    return out


def test_every_help_flag_is_on_the_flags_page_with_its_default(monkeypatch, capsys):
    home = os.path.expanduser("~")
    text, parser = _help_output(monkeypatch, capsys)
    helps = _help_entries(text)
    page = _flags_page_defaults()
    by_flag = {o: a for a in parser._actions for o in a.option_strings}
    assert len(helps) > 50 and "--max-num-seqs" in helps and "--coordinator-address" in helps, sorted(helps)
    problems = []
    for flag, help_text in helps.items():
        if flag == "--help":
            continue
        if flag not in page:
            problems.append(f"{flag}: not on docs/flags.md")
            continue
        shown = re.search(r"\(default: ([^()]*)\)$", help_text)
        default = shown.group(1) if shown else str(by_flag[flag].default)  # booleans print none
        default = "~" + default[len(home):] if home not in ("", "/") and default.startswith(home) else default
        if page[flag] != default:
            problems.append(f"{flag}: --help default {default!r}, docs/flags.md {page[flag]!r}")
    assert not problems, "\n".join(problems) + "\nrun .venv/bin/python scripts/gen_flags.py"
    assert not set(page) - set(helps), f"on docs/flags.md but not in --help: {sorted(set(page) - set(helps))}"


# --- links ------------------------------------------------------------------------------------
_FENCE = re.compile(r"^ {0,3}(```|~~~)")
_INLINE_LINK = re.compile(r"\]\(\s*<?([^()\s<>]+)>?(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)")
_REF_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?([^\s>]+)>?")


def _prose(path: Path) -> list[str]:
    """The file's lines outside fenced code, inline code spans blanked (a path in backticks is no link)."""
    lines, fenced = [], False
    for line in path.read_text().splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(re.sub(r"(`+)(?:(?!\1).)+?\1", "``", line))
    return lines


def _links(path: Path) -> list[str]:
    out = []
    for line in _prose(path):
        out += _INLINE_LINK.findall(line)
        out += _REF_DEF.findall(line)
    return out


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: link text kept, lowercased, punctuation dropped, spaces to '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in path.read_text().splitlines():  # headings in code spans keep their text, so not _prose
        if _FENCE.match(line):
            fenced = not fenced
            continue
        m = None if fenced else re.match(r" {0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            slug = _slug(m.group(1))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _broken_links(doc: str, root: Path = REPO) -> list[str]:
    path = root / doc
    broken = []
    for link in _links(path):
        if re.match(r"[A-Za-z][A-Za-z0-9+.-]*:", link):  # http(s), mailto: not checked here
            continue
        target, _, anchor = unquote(link).partition("#")
        target = target.split("?")[0]
        file = (root / target.lstrip("/")) if target.startswith("/") else (path.parent / target if target else path)
        if not file.exists():
            broken.append(f"{link}: no such file")
        elif anchor and file.suffix == ".md" and anchor.lower() not in _anchors(file):
            broken.append(f"{link}: no heading with that anchor in {file.relative_to(root).as_posix()}")
    return broken


@pytest.mark.parametrize("doc", DOCS)
def test_relative_links_resolve(doc):
    broken = _broken_links(doc)
    assert not broken, f"{doc}: broken links:\n" + "\n".join(broken)


def test_docs_index_lists_every_page():
    linked = {Path(unquote(link).partition("#")[0]).name for link in _links(REPO / "docs" / "README.md")}
    missing = [p.name for p in sorted((REPO / "docs").glob("*.md")) if p.name != "README.md" and p.name not in linked]
    assert not missing, f"docs/README.md does not list {missing}"


def test_link_checker_sees_links_not_code(tmp_path):
    """The checker itself: code spans and fences are not links, anchors are checked against headings."""
    (tmp_path / "a.md").write_text("# A title (`x`)\n## Same\n## Same\n")
    (tmp_path / "b.md").write_text(
        "[ok](a.md#a-title-x) [dup](a.md#same-1) [bad](a.md#nope) [gone](missing.md) ![img](a.md)\n"
        "`[code](missing.md)` [web](https://example.com/x)\n```\n[fenced](missing.md)\n```\n[ref]: a.md#same\n"
    )
    broken = _broken_links("b.md", root=tmp_path)
    assert broken == ["a.md#nope: no heading with that anchor in a.md", "missing.md: no such file"], broken
