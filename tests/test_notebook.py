"""notebooks/layouts.ipynb executes top to bottom (nbclient, the `python3` kernel on this test's own
interpreter, cwd = notebooks/ as Jupyter would start it) and shows what it says it shows: generated
text, every layout's capacity, two live switches that finished (one moving pages), streamed text equal
to a fixed layout's, a dynamic run with every request complete, a timeline image, and the policy's
explanation in engine.stats()."""

import ast
import base64
import os
import sys
from pathlib import Path

import nbclient  # the `test` extra installs nbclient, nbformat and ipykernel
import nbformat
import pytest

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "layouts.ipynb"


@pytest.fixture(scope="module")
def executed():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), "commit the notebook with outputs cleared"
    # The kernel is a child process: it must not inherit this process's 8-device flag (the notebook
    # sets its own) nor its platform choice, so that the notebook's setup cell is what is tested.
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    client = nbclient.NotebookClient(
        nb, kernel_name="python3", timeout=600, allow_errors=False,
        resources={"metadata": {"path": str(NOTEBOOK.parent)}},
    )
    client.execute(env=env)  # raises CellExecutionError on the first failing cell
    return nb


def cell(nb, tag):
    found = [c for c in nb.cells if tag in c.get("metadata", {}).get("tags", [])]
    assert len(found) == 1, f"one cell tagged {tag!r}"
    return found[0]


def stdout(c) -> str:
    return "".join(o["text"] for o in c.outputs if o["output_type"] == "stream" and o["name"] == "stdout")


def value(c):
    """The cell's result (its last expression), read back from its repr."""
    results = [o for o in c.outputs if o["output_type"] == "execute_result"]
    assert results, "the cell shows a result"
    return ast.literal_eval(results[-1]["data"]["text/plain"])


def test_no_cell_errored(executed):
    errors = [o for c in executed.cells if c.cell_type == "code" for o in c.outputs if o["output_type"] == "error"]
    assert not errors
    assert all(c.get("execution_count") for c in executed.cells if c.cell_type == "code"), "every code cell ran"


def test_kernel_ran_this_interpreter_on_eight_cpu_devices(executed):
    out = stdout(cell(executed, "setup"))
    assert f"python: {sys.executable}" in out
    assert "devices: 8 cpu" in out


def test_generate_returned_text_for_every_prompt(executed):
    lines = [ln for ln in stdout(cell(executed, "generate")).splitlines() if "prompt tokens ->" in ln]
    assert len(lines) == 3
    for ln in lines:
        n_tokens = int(ln.split("->")[1].split()[0])
        text = ast.literal_eval(ln.split("tokens ", 2)[2].rsplit("  ttft", 1)[0])
        assert n_tokens == 12 and text


def test_capacities_cover_every_layout_and_tp_holds_least(executed):
    tokens = {ln.split()[0]: int(ln.split()[1]) for ln in stdout(cell(executed, "capacities")).splitlines()}
    assert set(tokens) == {"tp", "dp", "dop", "cp"}
    assert tokens["tp"] < tokens["dp"] < tokens["dop"]


def test_live_switches_finished_and_moved_what_the_pair_needs(executed):
    out = stdout(cell(executed, "switch"))
    assert "<tp->dop>" in out and "<dop->cp>" in out and "layout now cp" in out
    to_dop, to_cp = value(cell(executed, "handles"))
    assert (to_dop["src"], to_dop["dst"], to_dop["state"]) == ("tp", "dop", "done")
    assert to_dop["pages_copied"] == 0 and to_dop["plan"]["pages_reused"] > 0  # the owner's replica stays
    assert (to_cp["src"], to_cp["dst"], to_cp["state"]) == ("dop", "cp", "done")
    assert to_cp["pages_copied"] > 0 and to_cp["bytes_moved"] > 0
    assert "== text in a fixed layout: [True, True]" in stdout(cell(executed, "identical"))


def test_policy_run_completed_and_its_timeline_was_drawn(executed):
    assert value(cell(executed, "dynamic")) == {"requests": 8, "completed": 8, "wrong_lengths": 0, "complete": True}
    images = [o["data"]["image/png"] for o in cell(executed, "timeline").outputs if "image/png" in o.get("data", {})]
    assert len(images) == 1
    png = base64.b64decode(images[0])
    assert png.startswith(b"\x89PNG") and len(png) > 10_000


def test_policy_explains_itself_in_stats(executed):
    out = stdout(cell(executed, "policy"))
    policy = ast.literal_eval(out)
    assert policy["cost_model"] == "roofline"
    last = policy["last_evaluation"]
    assert last is not None and last["reason"] and set(last["estimates"]) | set(last["infeasible"]) == {"tp", "dp", "dop", "cp"}
    for d in policy["switches"]:
        assert d["action"] in ("switch", "refused") and d["reason"]
    # the engine's own policy made the same moves as the benchmark's run of the same workload
    layouts = stdout(cell(executed, "auto_engine")).splitlines()[-1].removeprefix("layouts: ").split(" -> ")
    assert layouts[0] == "dp" and layouts == ["dp"] + [d["to"] for d in policy["switches"] if d["action"] == "switch"]
