"""lm-evaluation-harness against the server, offline, and its loglikelihoods checked against the engine.

Starts `python -m serve.main` on the bundled model, runs lm-eval 0.4.x from its own venv
(`--model local-completions` with `tokenizer_backend=remote`: lm-eval tokenizes through the
server's /tokenize and reads /tokenizer_info) on the local tasks in benchmarks/lm_eval_tasks/ (a
loglikelihood, a multiple_choice and a generate_until task over small JSONL files; nothing is
downloaded: HF_HUB_OFFLINE / HF_DATASETS_OFFLINE are set), with --log_samples. Each loglikelihood
request is then sent again alone (as lm-eval sends it: echo, logprobs 1), and, with the server
stopped, an in-process Engine recomputes every request lm-eval made from the same token ids, one
at a time: the sum of the continuation's prompt logprobs (SamplingParams.prompt_logprobs), whether
each continuation token was the argmax (lm-eval's is_greedy), and the greedy generations with
lm-eval's stop strings. A loglikelihood (lm-eval's or the lone request's) off by more than
--tolerance, a different is_greedy or a different generation fails the run (exit 1). Prints a
table; writes JSON (machine, versions, commands, per-request numbers) to
benchmarks/results/lm_eval_offline.json.

  python -m venv .venv-lmeval && .venv-lmeval/bin/pip install "lm_eval[api]==0.4.13"   # once
  .venv/bin/python benchmarks/lm_eval_offline.py
  .venv/bin/python benchmarks/lm_eval_offline.py --limit 5 --tasks splash_py_loglikelihood
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import pathlib
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import httpx

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.common import machine_info, table  # noqa: E402

log = logging.getLogger("lm_eval_offline")
TASKS_DIR = REPO / "benchmarks" / "lm_eval_tasks"
TASKS = ("splash_py_loglikelihood", "splash_py_multiple_choice", "splash_py_generate_until")
ENGINE_ARGS = {"max_model_len": 512, "max_num_seqs": 16, "max_num_batched_tokens": 256, "page_size": 16}
MODEL = "splash-tiny"
OUT = REPO / "benchmarks" / "results" / "lm_eval_offline.json"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def launched_server(port: int, extra: list[str], log_path: pathlib.Path, ready_timeout: float) -> Iterator[list[str]]:
    """The server on the bundled model until the block ends (SIGINT, then a grace period)."""
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE_ARGS.items()]
    cmd = [sys.executable, "-m", "serve.main", "--port", str(port), "--served-model-name", MODEL, "--no-access-log",
           *flags, *extra]
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log_file, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + ready_timeout
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"server exited ({proc.returncode}); see {log_path}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"server not ready in {ready_timeout}s; see {log_path}")
                time.sleep(0.5)
            log.info("server ready on port %d", port)
            yield cmd
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def lm_eval_command(args, port: int, out_dir: pathlib.Path) -> list[str]:
    model_args = ",".join([
        f"model={MODEL}", f"base_url=http://127.0.0.1:{port}/v1/completions", "tokenizer_backend=remote",
        f"max_length={ENGINE_ARGS['max_model_len']}", f"num_concurrent={args.num_concurrent}", "max_retries=1",
        "timeout=600",
    ])
    cmd = [str(args.lmeval_venv / "bin" / "lm_eval"), "--model", "local-completions", "--model_args", model_args,
           "--tasks", ",".join(args.tasks), "--include_path", str(TASKS_DIR.relative_to(REPO)),
           "--batch_size", str(args.batch_size), "--output_path", str(out_dir), "--log_samples"]
    return cmd + (["--limit", str(args.limit)] if args.limit else [])


def lm_eval_env(home: pathlib.Path) -> dict:
    """Offline: no hub or dataset downloads; a private HF cache so no stale dataset is reused."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "HF_HOME": str(home), "HF_DATASETS_CACHE": str(home / "datasets"), "TOKENIZERS_PARALLELISM": "false"}


def read_outputs(out_dir: pathlib.Path) -> tuple[dict, dict[str, list[dict]]]:
    (results_path,) = sorted(out_dir.rglob("results_*.json"))[-1:]
    samples = {}
    for path in out_dir.rglob("samples_*.jsonl"):
        task = path.name.removeprefix("samples_").rsplit("_", 1)[0]
        samples[task] = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return json.loads(results_path.read_text()), samples


class Tokenize:
    """The server's /tokenize without special tokens: what lm-eval's RemoteTokenizer.encode calls."""

    def __init__(self, base: str):
        self.client, self.base = httpx.Client(timeout=60), base

    def __call__(self, text: str) -> list[int]:
        r = self.client.post(self.base + "/tokenize", json={"prompt": text, "add_special_tokens": False})
        r.raise_for_status()
        return r.json()["tokens"]


def server_alone(base: str, scores: list[dict]) -> None:
    """Each loglikelihood request again, alone, through /v1/completions as lm-eval sends it (echo,
    logprobs 1, max_tokens 1): tells a batching or scheduling effect from a parsing one."""
    with httpx.Client(timeout=120) as client:
        for rec in scores:
            body = {"model": MODEL, "prompt": [rec["ids"]], "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0}
            r = client.post(base + "/v1/completions", json=body)
            r.raise_for_status()
            lps = r.json()["choices"][0]["logprobs"]["token_logprobs"]
            rec["server_alone_entries"] = len(lps)  # len(ids) + 1 expected: every prompt token and the generated one
            rec["server_alone_ll"] = float(sum(lps[rec["ctxlen"]:-1]))


def encode_pair(tokenize: Tokenize, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """Context and continuation ids as lm-eval's TemplateLM forms them: trailing spaces of the
    context move to the continuation, the pair is encoded whole and split at the context's length."""
    stripped = context.rstrip()
    context, continuation = stripped, context[len(stripped):] + continuation
    whole, ctx = tokenize(context + continuation), tokenize(context)
    return ctx, whole[len(ctx):]


def _args_of(sample: dict) -> list[dict]:
    return [sample["arguments"][k] for k in sorted(sample["arguments"], key=lambda k: int(k.rsplit("_", 1)[1]))]


def collect(samples: dict[str, list[dict]], tokenize: Tokenize, eos: str, max_length: int) -> tuple[list[dict], list[dict]]:
    """Every loglikelihood and generation request lm-eval made, with the token ids it sent."""
    scores, gens = [], []
    for task, rows in samples.items():
        for row in rows:
            for i, (arg, resp) in enumerate(zip(_args_of(row), row["resps"])):
                if isinstance(arg.get("arg_1"), dict):  # generate_until: (context, gen kwargs)
                    kw = arg["arg_1"]
                    until = [kw["until"]] if isinstance(kw.get("until"), str) else list(kw.get("until") or [])
                    max_gen = int(kw.get("max_gen_toks", 256))
                    ids = tokenize(arg["arg_0"])[-(max_length - 1 - max_gen):]
                    gens.append({"task": task, "doc_id": row["doc_id"], "prompt_ids": ids, "max_tokens": max_gen,
                                 "stop": until + ([eos] if eos and eos not in until else []), "lm_eval_text": resp[0]})
                    continue
                ctx, cont = encode_pair(tokenize, arg["arg_0"], arg["arg_1"])
                if len(ctx) + len(cont) > max_length - 1:
                    raise ValueError(f"{task} doc {row['doc_id']}: {len(ctx) + len(cont)} tokens; lm-eval would truncate")
                ll, greedy = resp[0]  # the samples file writes both as strings ("-1.97", "False")
                scores.append({"task": task, "doc_id": row["doc_id"], "request": i, "ctxlen": len(ctx), "ids": ctx + cont,
                               "lm_eval_ll": float(ll), "lm_eval_greedy": str(greedy) == "True"})
    return scores, gens


def engine_reference(scores: list[dict], gens: list[dict]) -> None:
    """The engine's own numbers for the same ids (filled into each record), in this process, one
    request at a time: each sequence's prompt logprobs alone, whatever batches the server formed."""
    from splash_jax.engine import Engine, EngineConfig, SamplingParams

    engine = Engine(EngineConfig(**ENGINE_ARGS, warmup=False))
    for rec in scores:
        (out,) = engine.generate([rec["ids"]], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))
        lps, tops = out.prompt_logprobs, out.prompt_top_logprobs
        if out.error or lps is None or len(lps) != len(rec["ids"]):
            raise RuntimeError(f"{rec['task']} doc {rec['doc_id']}: the engine gave {len(lps or [])} prompt logprobs "
                               f"for {len(rec['ids'])} prompt tokens ({out.error})")
        cont = range(rec["ctxlen"], len(rec["ids"]))
        rec["engine_ll"] = float(sum(lps[j] for j in cont))
        rec["engine_greedy"] = all(lps[j] >= max(tops[j].values()) for j in cont)
        rec["abs_diff"] = abs(rec["engine_ll"] - rec["lm_eval_ll"])
    for rec in gens:
        params = SamplingParams(max_tokens=rec["max_tokens"], temperature=0, stop=rec["stop"], seed=1234)
        (out,) = engine.generate([rec["prompt_ids"]], params)
        rec["engine_text"] = out.text


def summarize(results: dict, scores: list[dict], gens: list[dict], tolerance: float) -> list[dict]:
    rows = []
    for task, res in results["results"].items():
        mine = [s for s in scores if s["task"] == task]
        my_gens = [g for g in gens if g["task"] == task]
        metrics = {k.split(",")[0]: v for k, v in res.items() if "," in k and "_stderr" not in k}
        rows.append({
            "task": task, "docs": res.get("sample_len", results.get("n-samples", {}).get(task, {}).get("effective")),
            "ll_requests": len(mine), "max_abs_diff": max((s["abs_diff"] for s in mine), default=None),
            "ll_mismatches": sum(s["abs_diff"] > tolerance for s in mine),
            "alone_mismatches": sum(abs(s["server_alone_ll"] - s["engine_ll"]) > tolerance
                                    or s["server_alone_entries"] != len(s["ids"]) + 1 for s in mine),
            "greedy_mismatches": sum(s["lm_eval_greedy"] != s["engine_greedy"] for s in mine),
            "generations": len(my_gens), "gen_mismatches": sum(g["lm_eval_text"] != g["engine_text"] for g in my_gens),
            "metrics": ", ".join(f"{k} {v:.4g}" for k, v in metrics.items()),
        })
    return rows


def _venv_versions(venv: pathlib.Path) -> dict:
    code = ("import json, sys, importlib.metadata as m; print(json.dumps({'python': sys.version.split()[0], "
            "**{p: m.version(p) for p in ('lm_eval', 'datasets', 'requests', 'aiohttp')}}))")
    return json.loads(subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True, check=True).stdout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lmeval-venv", type=pathlib.Path, default=REPO / ".venv-lmeval", help="venv with lm_eval 0.4.x")
    parser.add_argument("--tasks", type=lambda s: s.split(","), default=list(TASKS), help="comma-separated task names")
    parser.add_argument("--limit", type=int, default=0, help="docs per task (0: all)")
    parser.add_argument("--batch-size", type=int, default=4, help="lm-eval prompts per /v1/completions request")
    parser.add_argument("--num-concurrent", type=int, default=2, help="lm-eval requests in flight")
    parser.add_argument("--tolerance", type=float, default=1e-4, help="largest |lm-eval ll - engine ll| that passes")
    parser.add_argument("--server-args", default="", help="extra `serve.main` flags")
    parser.add_argument("--ready-timeout", type=float, default=600.0)
    parser.add_argument("--lm-eval-timeout", type=float, default=1800.0)
    parser.add_argument("--out", type=pathlib.Path, default=OUT, help="result JSON")
    parser.add_argument("--work-dir", type=pathlib.Path, default=None, help="keep lm-eval's output here (default: a temp dir)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per /tokenize call otherwise
    if not (args.lmeval_venv / "bin" / "lm_eval").exists():
        parser.error(f"no lm_eval in {args.lmeval_venv}; install it there (see the module docstring)")

    with contextlib.ExitStack() as stack:
        work = args.work_dir or pathlib.Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="lm_eval_offline_")))
        work.mkdir(parents=True, exist_ok=True)
        port = _free_port()
        base = f"http://127.0.0.1:{port}"
        with launched_server(port, shlex.split(args.server_args), work / "server.log", args.ready_timeout) as server_cmd:
            shutil.rmtree(work / "lm_eval_out", ignore_errors=True)  # a kept work dir: only this run's files
            cmd = lm_eval_command(args, port, work / "lm_eval_out")
            log.info("running %s", shlex.join(cmd))
            start = time.monotonic()
            proc = subprocess.run(cmd, cwd=REPO, env=lm_eval_env(work / "hf"), capture_output=True, text=True,
                                  timeout=args.lm_eval_timeout)
            lm_eval_s = time.monotonic() - start
            (work / "lm_eval.log").write_text(proc.stdout + proc.stderr)
            if proc.returncode != 0:
                log.error("lm_eval failed (%d):\n%s", proc.returncode, (proc.stdout + proc.stderr)[-6000:])
                return 1
            results, samples = read_outputs(work / "lm_eval_out")
            tokenize = Tokenize(base)
            info = httpx.get(base + "/tokenizer_info", timeout=30).json()
            scores, gens = collect(samples, tokenize, info.get("eos_token"), ENGINE_ARGS["max_model_len"])
            server_alone(base, scores)
            tokenize.client.close()
        log.info("lm_eval took %.1f s; recomputing %d loglikelihoods and %d generations on the engine",
                 lm_eval_s, len(scores), len(gens))
        engine_reference(scores, gens)

    rows = summarize(results, scores, gens, args.tolerance)
    print(table(rows, ["task", "docs", "ll_requests", "max_abs_diff", "ll_mismatches", "alone_mismatches",
                       "greedy_mismatches",
                       "generations", "gen_mismatches", "metrics"]))
    ok = not any(r["ll_mismatches"] or r["alone_mismatches"] or r["greedy_mismatches"] or r["gen_mismatches"] for r in rows)
    import jax
    import splash_jax

    payload = {
        "machine": machine_info(), "command": shlex.join([sys.executable, *sys.argv]), "time": time.strftime("%Y%m%d-%H%M%S"),
        "versions": {"splash_jax": getattr(splash_jax, "__version__", "0.1.0"), "jax": jax.__version__,
                     "lm_eval_venv": _venv_versions(args.lmeval_venv)},
        "server_command": shlex.join(server_cmd), "lm_eval_command": shlex.join(cmd), "lm_eval_seconds": lm_eval_s,
        "engine_args": ENGINE_ARGS, "tolerance": args.tolerance, "passed": ok, "tasks": rows,
        "lm_eval_results": results["results"], "loglikelihoods": scores, "generations": gens,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=2))
    log.info("wrote %s; %s", args.out, "every loglikelihood and generation equals the engine's" if ok else "MISMATCHES")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
