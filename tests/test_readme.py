"""Every fenced code block of README.md runs, as written, except the ones marked skipped.

The rule, read off each block's fence and the line before it:
- `<!-- readme-test: skip (REASON) -->` on the line before the fence: not run (REASON is required);
- ```bash: run by bash against one server of the bundled model (`python -m serve.main` in a
  subprocess, tests/test_server.py's `Server`), `127.0.0.1:8000` replaced by its address; it must
  exit 0 and print JSON completions (one document per request, none an error);
- ```python that names `127.0.0.1:8000`: a client of that server, executed in this process with
  the address replaced; it must print text;
- any other ```python: an engine block, run in a fresh Python on the CPU (as a reader's shell
  would: no XLA_FLAGS, so the block's own device-count setting counts; HOME in a temporary
  folder, so the default persistent compile cache starts empty there); it must exit 0 and print;
- any other fence language fails the test: mark it skipped or make it one of the above.

Time: the server starts with `--no-warmup` (programs compile on first use, as the engine block's
`warmup=False` does) and the engine block runs beside it, so the module costs about one of them.
Relative links of the README are checked by tests/test_docs.py.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from test_server import _run_server

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
README_URL = "127.0.0.1:8000"
SKIP = re.compile(r"^<!--\s*readme-test:\s*skip\s*\((?P<reason>[^)]+)\)\s*-->$")
SETUP = (  # CI runs these two lines itself: they stay the README's first code block, unchanged
    "./scripts/setup.sh && .venv/bin/python -m serve.main            # serve the bundled model (OpenAI API on :8000; CPU if no accelerator)",
    "./scripts/setup.sh && .venv/bin/python -m pytest -q              # run the tests (8 simulated CPU devices, float32)",
)
ENGINE_TIMEOUT_S = 240


@dataclass
class Block:
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    skip: str | None  # the reason, when marked skipped

    @property
    def kind(self) -> str:
        if self.skip is not None:
            return "skip"
        if self.lang == "bash":
            return "shell"
        if self.lang == "python":
            return "client" if README_URL in self.code else "engine"
        return "unknown"

    def __str__(self) -> str:
        return f"README.md:{self.line} ({self.lang or 'no language'})"


def blocks(text: str) -> list[Block]:
    out, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = re.match(r"^```(\S*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        j = i + 1
        while not lines[j].startswith("```"):
            j += 1
        prev = next((lines[k].strip() for k in range(i - 1, -1, -1) if lines[k].strip()), "")
        skip = SKIP.match(prev)
        out.append(Block(i + 1, m.group(1), "\n".join(lines[i + 1 : j]) + "\n", skip and skip.group("reason").strip()))
        i = j + 1
    return out


BLOCKS = blocks(README.read_text())


def of_kind(kind: str) -> list[Block]:
    return [b for b in BLOCKS if b.kind == kind]


def test_every_block_follows_the_rule():
    unknown = [str(b) for b in of_kind("unknown")]
    assert not unknown, f"blocks the rule does not cover (mark them skipped with a reason, or use bash/python): {unknown}"
    assert of_kind("shell") and of_kind("client") and of_kind("engine"), [b.kind for b in BLOCKS]
    assert all(b.skip for b in of_kind("skip"))
    assert len(README.read_bytes()) < 10 * 1024, "README.md is limited to 10 KB: move details to docs/"


def test_setup_commands_are_the_first_block_unchanged():
    first = BLOCKS[0]
    assert first.kind == "skip" and tuple(first.code.splitlines()[:2]) == SETUP, first.code


# --- the engine blocks: a fresh Python each, started before the server so they run beside it ---
@pytest.fixture(scope="module")
def engine_runs(tmp_path_factory):
    runs = []
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    for b in of_kind("engine"):
        home = tmp_path_factory.mktemp("home")
        env_b = {**env, "HOME": str(home)}
        log = open(home / "out.txt", "w+")
        proc = subprocess.Popen([sys.executable, "-c", b.code], cwd=REPO, env=env_b, stdout=log, stderr=subprocess.STDOUT)
        runs.append((b, proc, log))
    yield runs
    for _, proc, log in runs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


@pytest.fixture(scope="module")
def server(engine_runs, tmp_path_factory):
    yield from _run_server(tmp_path_factory, "--no-warmup")


def _completions(stdout: str) -> list[dict]:
    """The JSON documents a block printed, back to back (curl -s adds no newline)."""
    docs, dec, text = [], json.JSONDecoder(), stdout.strip()
    while text:
        doc, end = dec.raw_decode(text)
        docs.append(doc)
        text = text[end:].strip()
    return docs


@pytest.mark.parametrize("block", of_kind("shell"), ids=str)
def test_shell_block_against_the_server(block, server):
    code = block.code.replace(README_URL, f"127.0.0.1:{server.port}")
    r = subprocess.run(["bash", "-e", "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr + server.tail()
    docs = _completions(r.stdout)
    assert docs and len(docs) == code.count("curl "), r.stdout
    for doc in docs:
        assert "error" not in doc and doc["choices"][0]["text"], doc


@pytest.mark.parametrize("block", of_kind("client"), ids=str)
def test_client_block_against_the_server(block, server):
    code = block.code.replace(README_URL, f"127.0.0.1:{server.port}")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(block), "exec"), {"__name__": "__readme__"})
    assert out.getvalue().strip(), "the block printed nothing"


@pytest.mark.parametrize("block", of_kind("engine"), ids=str)
def test_engine_block_runs(block, engine_runs):
    _, proc, log = next(r for r in engine_runs if r[0] is block)
    try:
        rc = proc.wait(timeout=ENGINE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = "timeout"
    log.seek(0)
    out = log.read()
    assert rc == 0, f"{block} exited {rc}:\n{out[-4000:]}"
    assert out.strip(), "the block printed nothing"
    if "switch_layout(" in block.code:
        assert "'state': 'done'" in out, out[-4000:]  # the switch finished (its handle.as_dict() printed)
