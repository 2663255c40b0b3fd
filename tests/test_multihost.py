"""One engine over two processes (jax.distributed, 2 x 4 CPU devices, gloo collectives) against
the single-process engine on 8 devices: identical greedy outputs in a fixed layout and across
live switches; a killed follower stops process 0 with a clear error within a bounded time.

Each multi-process run starts two fresh interpreters (tests/multihost_worker.py); the reference
runs in this process on conftest's 8 simulated devices. The every-layout sweep and the switch
tour are marked slow.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from multihost_worker import engine_kwargs, workload
from random_models import tiny_config, write_random_checkpoint
from splash_jax.mesh.layouts import LAYOUT_NAMES

WORKER = Path(__file__).with_name("multihost_worker.py")
REPO = WORKER.parent.parent


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_random_checkpoint(tmp_path_factory.mktemp("multihost") / "model", tiny_config()))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(model: str, tmp: Path, layout: str, switches=(), *extra: str) -> tuple[list[subprocess.Popen], Path]:
    """Start process 0 and process 1 of a 2-process engine; returns them and process 0's result file."""
    port, out = _free_port(), tmp / "result.json"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs = []
    for pid in (1, 0):
        cmd = [sys.executable, str(WORKER), "--process-id", str(pid), "--coordinator-address", f"127.0.0.1:{port}",
               "--model", model, "--layout", layout, "--switches", ",".join(switches), *extra]
        if pid == 0:
            cmd += ["--out", str(out)]
        log = open(tmp / f"p{pid}.log", "w")
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT))
    return procs[::-1], out


def run_two(model: str, tmp: Path, layout: str, switches=(), *extra: str, timeout: float = 540) -> dict:
    procs, out = launch(model, tmp, layout, switches, *extra)
    try:
        for pid, p in enumerate(procs):
            rc = p.wait(timeout)
            assert rc == 0, f"process {pid} exited with {rc}:\n{(tmp / f'p{pid}.log').read_text()[-4000:]}"
    finally:
        for p in procs:
            p.kill()
    if not out.exists():
        return {}
    result = json.loads(out.read_text())
    result["outputs"] = {int(k): v for k, v in result["outputs"].items()}
    result["follower_log"] = (tmp / "p1.log").read_text()
    return result


def reference(model: str, layout: str) -> dict:
    """The same workload on one process with 8 devices, in a fixed layout (no switching)."""
    from splash_jax.engine import Engine, EngineConfig

    return workload(Engine(EngineConfig(**engine_kwargs(model, layout, False))), [])[0]


def test_two_processes_match_one_across_a_live_switch(model_dir, tmp_path):
    # dp -> tp: page copies inside steps and at handoff, weight reshards, the extra segment appears.
    got = run_two(model_dir, tmp_path, "dp", ["tp"])
    assert got["switches"] == [["dp", "tp", "done"]]
    want = reference(model_dir, "dp")
    assert got["outputs"] == want
    assert got["copied_pages"] > 0  # the repeated page-aligned prompt's copy-on-write page, mirrored (worker)
    assert "step command lag" in got["follower_log"]


def test_killing_a_follower_stops_process_0_with_a_clear_error(model_dir, tmp_path):
    ready = tmp_path / "ready"
    procs, _ = launch(model_dir, tmp_path, "dop", (), "--long", "9", "--ready-file", str(ready), "--peer-timeout-s", "5")
    leader, follower = procs
    try:
        deadline = time.monotonic() + 300
        while not ready.exists():
            assert leader.poll() is None, (tmp_path / "p0.log").read_text()[-4000:]
            assert time.monotonic() < deadline, "process 0 never reached step 5"
            time.sleep(0.2)
        follower.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        rc = leader.wait(60)  # bounded: the channel sees the closed socket at once (heartbeat timeout 5 s otherwise)
        elapsed = time.monotonic() - t0
    finally:
        for p in procs:
            p.kill()
    log = (tmp_path / "p0.log").read_text()
    assert rc == 3, log[-4000:]
    assert "lost a process" in log and "process 1" in log, log[-4000:]
    assert elapsed < 15, elapsed
    print(f"process 0 exited {elapsed:.2f}s after process 1 was killed")


def test_command_channel_latency():
    """The channel alone (no jax): one-way latency of a decode-step-sized command on loopback."""
    from splash_jax.distributed.channel import FollowerChannel, LeaderChannel
    from splash_jax.distributed.wire import Command

    lost = []
    leader = LeaderChannel(1, 0, timeout_s=5.0, on_failure=lost.append)
    follower_box = []
    t = threading.Thread(target=lambda: follower_box.append(FollowerChannel("127.0.0.1", leader.port, 1, 5.0, 10.0)))
    t.start()
    leader.accept(10.0)
    t.join()
    follower = follower_box[0]
    rep, dev = np.arange(600, dtype=np.int32), np.zeros((8, 900), np.int32)  # about a 16-token step's buffers
    samples = []
    for i in range(300):
        t0 = time.perf_counter()
        leader.send(Command("step", {"bucket": {"tokens": 16, "requests": 4}, "full": False, "i": i}, {"rep": rep, "dev": dev, "move": None}))
        cmd = follower.recv()
        samples.append(time.perf_counter() - t0)
        assert cmd.fields["i"] == i and np.array_equal(cmd.arrays["dev"], dev) and cmd.arrays["move"] is None
    leader.close()
    assert follower.recv().op == "stop"
    follower.close()
    ms = np.asarray(samples[20:]) * 1e3
    print(f"command channel: p50 {np.percentile(ms, 50):.3f} ms, p99 {np.percentile(ms, 99):.3f} ms per step command")
    assert np.percentile(ms, 50) < 5.0
    assert not lost


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_two_processes_match_one_in_every_layout(model_dir, tmp_path, layout):
    assert run_two(model_dir, tmp_path, layout)["outputs"] == reference(model_dir, layout)


@pytest.mark.slow
def test_two_processes_match_one_across_a_switch_tour(model_dir, tmp_path):
    tour = ["dp", "dop", "cp", "tp", "dop", "dp", "cp", "dop", "tp", "cp", "dp", "tp"]  # from tp: all 12 ordered pairs
    got = run_two(model_dir, tmp_path, "tp", tour)
    assert [s[2] for s in got["switches"]] == ["done"] * len(tour), got["switches"]
    assert got["outputs"] == reference(model_dir, "tp")


@pytest.mark.slow
def test_orbax_snapshot_saved_by_two_processes_restores_anywhere(model_dir, tmp_path):
    from splash_jax.engine import Engine, EngineConfig

    snapshot = tmp_path / "snapshot"
    (tmp_path / "save").mkdir()
    run_two(model_dir, tmp_path / "save", "dp", (), "--save-snapshot", str(snapshot))
    # One process, 8 devices, another layout: the same weights as the checkpoint.
    a = Engine(EngineConfig(**engine_kwargs(model_dir, "tp", False)))
    b = Engine(EngineConfig(**engine_kwargs(str(snapshot), "tp", False)))
    for (path, x), (_, y) in zip(a.executor.param_items(), b.executor.param_items()):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=str(path))
    # Two processes restore it (each reads its shards) and generate as the original does.
    (tmp_path / "restore").mkdir()
    got = run_two(str(snapshot), tmp_path / "restore", "tp")
    assert got["outputs"] == workload(a, [])[0]


SERVER_ARGS = {"num_devices": 8, "layout": "dp", "page_size": 8, "max_num_seqs": 4, "max_num_batched_tokens": 16,
               "max_pages": 64, "max_model_len": 128}


@pytest.mark.slow
def test_two_hosts_serve_through_the_leaders_engine_core_process(tmp_path):
    """`python -m serve.main` on two processes (the bundled model, dp over 2 x 4 CPU devices): process
    0's engine core runs in its own process as the leader, process 1 follows it; a greedy completion
    equals the single-process engine's, and stopping process 0 stops both cleanly."""
    import httpx

    from splash_jax.engine import Engine, EngineConfig, SamplingParams

    coordinator, http = f"127.0.0.1:{_free_port()}", _free_port()
    env = {**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"},
           "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    engine_args = [f"--{k.replace('_', '-')}={v}" for k, v in SERVER_ARGS.items()] + ["--compile-cache-dir="]
    procs = []
    for pid in (1, 0):
        cmd = [sys.executable, "-m", "serve.main", "--coordinator-address", coordinator, "--num-processes", "2",
               "--process-id", str(pid), "--port", str(http), "--no-access-log", *engine_args]
        log = open(tmp_path / f"p{pid}.log", "w")
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT))
    follower, leader = procs
    base = f"http://127.0.0.1:{http}"
    prompt, n = "Latent attention caches one compressed vector per token", 12
    try:
        deadline = time.monotonic() + 600
        while True:
            assert leader.poll() is None and follower.poll() is None, (tmp_path / "p0.log").read_text()[-4000:]
            assert time.monotonic() < deadline, "the two-process server never became ready"
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        body = {"model": "splash-tiny", "prompt": prompt, "max_tokens": n, "temperature": 0.0, "ignore_eos": True}
        got = httpx.post(base + "/v1/completions", json=body, timeout=120).json()
        leader.send_signal(signal.SIGINT)
        rcs = [leader.wait(60), follower.wait(60)]
    finally:
        for p in procs:
            p.kill()
    log0 = (tmp_path / "p0.log").read_text()
    assert rcs == [0, 0], log0[-4000:]
    assert "engine core ready" in log0 and "process 0 of 2 joined" in log0, log0[-4000:]
    want = Engine(EngineConfig(**SERVER_ARGS, compile_cache_dir=None, warmup=False)).generate(
        [prompt], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))[0]
    assert got["choices"][0]["text"] == want.text, got


def test_the_leader_executor_takes_every_argument_of_the_executor():
    """The leader's wrapper forwards each device call to its followers: an argument the engine
    passes that the wrapper lacks is a TypeError inside the step, which the engine takes for a
    device failure (it recomputes every request and cancels a live switch)."""
    import inspect

    from splash_jax.distributed.leader import LeaderExecutor
    from splash_jax.engine.executor import StepExecutor

    for name in ("run", "sample"):
        want = list(inspect.signature(getattr(StepExecutor, name)).parameters)
        assert list(inspect.signature(getattr(LeaderExecutor, name)).parameters) == want, name
