"""lm-evaluation-harness end to end (slow): benchmarks/lm_eval_offline.py starts the server, runs
lm-eval's local-completions with the remote tokenizer on the three local tasks, and checks every
loglikelihood and generation against the engine. Needs lm_eval in its own venv (.venv-lmeval)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
VENV = REPO / ".venv-lmeval"


@pytest.mark.slow  # 40 s alone on a 2-core host, 2 min beside other work (server start-up, lm-eval, the reference)
def test_lm_eval_loglikelihoods_and_generations_equal_the_engine(tmp_path):
    if not (VENV / "bin" / "lm_eval").exists():
        pytest.skip(f"lm-evaluation-harness is not installed in {VENV} "
                    "(python3.12 -m venv .venv-lmeval && .venv-lmeval/bin/pip install 'lm_eval[api]==0.4.13')")
    out = tmp_path / "lm_eval_offline.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/lm_eval_offline.py", "--out", str(out), "--work-dir", str(tmp_path / "work")],
        cwd=REPO, capture_output=True, text=True, timeout=1800,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    result = json.loads(out.read_text())
    assert result["passed"]
    tasks = {row["task"]: row for row in result["tasks"]}
    assert set(tasks) == {"splash_py_loglikelihood", "splash_py_multiple_choice", "splash_py_generate_until"}
    assert tasks["splash_py_loglikelihood"]["ll_requests"] == 20 and tasks["splash_py_multiple_choice"]["ll_requests"] == 80
    assert tasks["splash_py_generate_until"]["generations"] == 20
    assert all(abs(s["lm_eval_ll"] - s["engine_ll"]) <= result["tolerance"] for s in result["loglikelihoods"])
