"""The engine core process with 2 front ends (`python -m serve.main`, bundled model), one server
taken through: /metrics counting every front end's requests whichever answers; device steps
failing inside the core (injected by a sitecustomize only that server loads: recomputed with
unchanged outputs, or an error event for a request in two failed steps); a front end that dies
(its requests aborted, their pages freed); a core that dies (kill -9: every open stream ends with
an error event at once and the server exits non-zero). Also a core that cannot start is reported
with its own error."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time

import httpx

from test_server import REPO, Server

LONG = {"model": "splash-tiny", "prompt": "Pages of latents", "max_tokens": 240, "ignore_eos": True,
        "temperature": 0, "stream": True}


def _pid(log: str, pattern: str) -> int:
    match = re.search(pattern, log)
    assert match, f"{pattern!r} not in the log"
    return int(match.group(1))


async def _stream(base: str, started: asyncio.Event | None = None) -> str:
    """One stream on its own connection: 'done', 'error' (an error event) or 'dropped' (connection lost)."""
    async with httpx.AsyncClient(base_url=base, timeout=60) as http:
        try:
            async with http.stream("POST", "/v1/completions", json=LONG) as r:
                async for line in r.aiter_lines():
                    if started is not None and line.startswith("data: {"):
                        started.set()
                    if line.startswith('data: {"error"'):
                        return "error"
                    if line == "data: [DONE]":
                        return "done"
        except httpx.HTTPError:
            return "dropped"
    return "dropped"


def _every_scrape_counts_every_front_ends_requests(srv) -> None:
    """Requests on connections of their own (the kernel spreads them over both front ends), then
    /metrics on new connections: each answer, whichever front end gives it, counts all of them."""
    n = 12

    async def send():
        async def one(i):
            async with httpx.AsyncClient(base_url=srv.base, timeout=60) as http:
                r = await http.post("/v1/completions", json={"model": "splash-tiny", "prompt": f"n{i}", "max_tokens": 3,
                                                             "ignore_eos": True, "temperature": 0})
                assert r.status_code == 200, r.text
        await asyncio.gather(*(one(i) for i in range(n)))

    asyncio.run(send())
    for _ in range(8):
        text = httpx.get(srv.base + "/metrics", headers={"connection": "close"}).text
        assert re.search(rf'^splash_requests_total{{finish_reason="length"}} {n}\.0$', text, re.M), text[-2000:]
        assert re.search(rf"^splash_time_to_first_token_seconds_count {n}\.0$", text, re.M)
        assert re.search(r"^splash_generation_tokens_total 36\.0$", text, re.M)


def test_two_front_ends_metrics_failed_steps_and_dead_processes(tmp_path):
    """One server, 2 front ends, in turn: /metrics sums both; failed device steps; a front end
    killed; the core killed."""
    env, once, always = _injected(tmp_path)
    srv = Server(tmp_path / "server.log", ("--api-server-count", "2"), env=env)
    try:
        srv.wait_ready()
        deadline = time.monotonic() + 60
        while srv.metric("splash_api_servers", 0) < 2:  # the second front end connects after the port opens
            assert time.monotonic() < deadline, srv.tail()
            time.sleep(0.2)
        _every_scrape_counts_every_front_ends_requests(srv)
        _failed_device_steps_recompute_and_a_request_failing_twice_gets_an_error(srv, once, always)
        front_end = _pid(srv.tail(100_000), r"front end 1 \(pid (\d+)\) connected")
        core = _pid(srv.tail(100_000), r"engine core starting \(pid (\d+)\)")

        async def kill_front_end_mid_stream():
            started = asyncio.Event()
            tasks = [asyncio.create_task(_stream(srv.base, started)) for _ in range(16)]  # the kernel spreads them
            await started.wait()
            os.kill(front_end, signal.SIGKILL)
            return await asyncio.gather(*tasks)

        results = asyncio.run(kill_front_end_mid_stream())
        match = re.search(r"front end 1 is gone: aborted its (\d+) requests", srv.tail(100_000))
        assert match, srv.tail()
        assert results.count("dropped") == int(match.group(1)) >= 1 and results.count("done") >= 1, results
        srv.wait_idle()  # the dead front end's requests left the core with their pages

        async def kill_core_mid_stream():
            started = asyncio.Event()
            tasks = [asyncio.create_task(_stream(srv.base, started)) for _ in range(4)]
            await started.wait()
            os.kill(core, signal.SIGKILL)
            t0 = time.monotonic()
            results = await asyncio.gather(*tasks)
            return results, time.monotonic() - t0

        results, waited = asyncio.run(kill_core_mid_stream())
        assert results == ["error"] * 4 and waited < 5, (results, waited)
        assert srv.proc.wait(timeout=30) == 1  # the server exits instead of serving nothing
        assert "the engine core process (pid" in srv.tail(100_000)
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
        srv.log.close()


def test_a_core_that_cannot_start_is_reported_with_its_error(tmp_path):
    missing = tmp_path / "no-model-here"
    proc = subprocess.run([sys.executable, "-m", "serve.main", "--model", str(missing), "--port", "1"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "cannot start:" in proc.stderr and str(missing) in proc.stderr.split("cannot start:")[1], proc.stderr[-3000:]


def test_front_ends_draw_different_seeds_for_unseeded_requests():
    """Two API servers over one core: unseeded sampled requests must not repeat each other's seeds."""
    from splash_jax.engine.request import SamplingParams
    from splash_jax.engine.request_factory import EngineFacts, RequestFactory

    facts = EngineFacts(vocab_size=100, max_model_len=64, max_stop_token_ids=4, max_logit_bias=4, eos_ids=[1], model="")
    factories = [RequestFactory(facts, None, stream=i) for i in range(3)]
    seeds = [[f.make([5, 6], SamplingParams(temperature=1.0)).sample_seed for _ in range(4)] for f in factories]
    assert len({s for row in seeds for s in row}) == 12


# --- a device step that fails inside the core process ----------------------------------------------
INJECT = """
import os
import pathlib

import splash_jax.engine.executor as _executor

_run = _executor.StepExecutor.run
_once, _always = pathlib.Path(os.environ["SPLASH_TEST_FAIL_ONCE"]), pathlib.Path(os.environ["SPLASH_TEST_FAIL_ALWAYS"])


def run(self, *args, **kwargs):
    if _always.exists() or _once.exists():
        _once.unlink(missing_ok=True)
        raise RuntimeError("injected device step failure")
    return _run(self, *args, **kwargs)


_executor.StepExecutor.run = run
"""
GREEDY = {"model": "splash-tiny", "max_tokens": 40, "ignore_eos": True, "temperature": 0, "return_token_ids": True}


def _injected(tmp_path) -> tuple[dict, object, object]:
    """A sitecustomize that only this test's server loads: device steps raise while a file exists."""
    (tmp_path / "inject").mkdir()
    (tmp_path / "inject" / "sitecustomize.py").write_text(INJECT)
    once, always = tmp_path / "fail_once", tmp_path / "fail_always"
    env = {"PYTHONPATH": f"{tmp_path / 'inject'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "SPLASH_TEST_FAIL_ONCE": str(once), "SPLASH_TEST_FAIL_ALWAYS": str(always)}
    return env, once, always


def _failed_device_steps_recompute_and_a_request_failing_twice_gets_an_error(srv, once, always) -> None:
    """A device step that raises in the core process: the core restarts its pool and recomputes
    the running requests, whose streams end exactly as they do without the failure; a request in
    two failed steps ends with an error event, and the server keeps serving."""
    prompts = [f"Pages of latents {i}" for i in range(4)]

    async def streams(fail=None):
        async def one(prompt, started):
            async with httpx.AsyncClient(base_url=srv.base, timeout=60) as http:
                ids, error = [], None
                async with http.stream("POST", "/v1/completions", json={**GREEDY, "prompt": prompt, "stream": True}) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            event = json.loads(line[6:])
                            error = error or event.get("error")
                            for choice in event.get("choices", ()):
                                ids += choice.get("token_ids") or []
                            started.set()
                return ids, error

        started = asyncio.Event()
        tasks = [asyncio.create_task(one(p, started)) for p in prompts]
        if fail is not None:
            await started.wait()
            fail.touch()
        return await asyncio.gather(*tasks)

    alone = asyncio.run(streams())
    assert all(len(ids) == 40 and error is None for ids, error in alone), alone
    recovered = asyncio.run(streams(fail=once))
    assert srv.metric("splash_engine_device_step_failures_total") == 1
    assert recovered == alone  # recomputed from an empty pool: the same tokens, no error
    failed = asyncio.run(streams(fail=always))
    assert all(error is not None and "failed twice" in error["message"] for _, error in failed), failed
    always.unlink()
    again = asyncio.run(streams())
    assert again == alone and httpx.get(srv.base + "/health").status_code == 200
    srv.wait_idle()
