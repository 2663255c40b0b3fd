"""One start-up cell: build a V2-Lite (27 layers, dummy bf16) engine cold, serve a 1K-token prompt and the
longest prompt max_model_len allows, print one RESULT line (start-up seconds, KV tokens, the largest
step-program temporaries). Usage: python benchmarks/startup_check.py MBT MAX_MODEL_LEN KV_GB|- MAX_NUM_SEQS
(docs/startup.md, "Memory at start-up")."""
import logging, sys, time, json, tempfile
t0 = time.perf_counter()
logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
import numpy as np
from benchmarks.shapes import shape_folder
from splash_jax.engine import Engine, EngineConfig, SamplingParams
mbt, mml, kv, seqs = (int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]) if sys.argv[3] != "-" else None, int(sys.argv[4]))
eng = Engine(EngineConfig(model=str(shape_folder("v2-lite")), load_format="dummy", dtype="bfloat16", num_devices=1,
                          max_num_batched_tokens=mbt, max_model_len=mml, kv_memory_gb=kv, max_num_seqs=seqs,
                          compile_cache_dir=tempfile.mkdtemp()))
startup = time.perf_counter() - t0
rng = np.random.default_rng(0)
res = {}
for n in (1024, eng.max_model_len - 16):
    t = time.perf_counter()
    out = eng.generate([rng.integers(10, 100000, n).tolist()], SamplingParams(max_tokens=8, temperature=0))[0]
    res[n] = (round(time.perf_counter() - t, 2), len(out.token_ids))
s = eng.stats()
print("RESULT", json.dumps({"mbt": mbt, "mml": mml, "kv": kv, "startup_s": round(startup, 1), "kv_tokens": eng.kv_capacity_tokens(),
      "max_temp_gib": round(s["program_memory"]["max_temp_bytes"] / 2**30, 3), "max_temp_program": s["program_memory"]["max_temp_program"],
      "programs": s["program_memory"]["programs"], "served": res}))
