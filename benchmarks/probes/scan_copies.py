"""Which large buffers the compiled decode step copies, scanned vs unrolled (run on a GPU).

Lists every copy / copy-start / memcpy-like instruction of the optimized HLO whose result is
over 1 MB, with its shape and bytes, for a small V2-Lite slice. Usage:
  python -m benchmarks.probes.scan_copies LAYERS SCAN(0|1) [KV_GB [HLO_OUT [MIN_BUCKET]]]
"""
import re
import sys

import numpy as np

from benchmarks.shapes import shape_folder
from splash_jax.engine import Engine, EngineConfig

BYTES = {"bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4, "s8": 1, "u8": 1, "pred": 1, "f8e4m3fn": 1}
layers, scan = int(sys.argv[1]), sys.argv[2] == "1"
kv_gb = float(sys.argv[3]) if len(sys.argv) > 3 else 4.0
min_bucket = int(sys.argv[5]) if len(sys.argv) > 5 else 64
eng = Engine(EngineConfig(model=str(shape_folder("v2-lite", num_hidden_layers=layers)), load_format="dummy",
                          dtype="bfloat16", num_devices=1, kv_memory_gb=kv_gb, max_model_len=1536, max_num_seqs=64,
                          max_num_batched_tokens=64, min_token_bucket=min_bucket, warmup=False, compile_cache_dir=None,
                          scan_layers=scan))
ex = eng.executor
bucket = ex.buckets(ex.layout)[0]
compiled = ex.lower(ex.layout, bucket).compile()
hlo = compiled.as_text()
mem = compiled.memory_analysis()
pool_bytes = sum(x.nbytes for x in __import__("jax").tree.leaves(ex.kv))
print(f"memory: pool {pool_bytes / 1e9:.2f} GB, temp {mem.temp_size_in_bytes / 1e9:.2f} GB, "
      f"args {mem.argument_size_in_bytes / 1e9:.2f} GB, outputs {mem.output_size_in_bytes / 1e9:.2f} GB, "
      f"aliased {mem.alias_size_in_bytes / 1e9:.2f} GB")
print(f"layers={layers} scan={scan} bucket={bucket} pool={[x.shape for x in __import__('jax').tree.leaves(ex.kv)]}")
total = 0
for line in hlo.splitlines():
    m = re.match(r"\s*(?:ROOT )?(\S+) = (\w+)\[([0-9,]*)\]\S* (copy|copy-start|custom-call|fusion)\(", line)
    if not m:
        continue
    name, dt, dims, op = m.groups()
    n = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
    size = n * BYTES.get(dt, 4)
    is_copy = op.startswith("copy") or (op == "fusion" and "kind=kLoop" in line and "copy" in name)
    if is_copy and size > 1e6:
        total += size
        print(f"  {op:10s} {dt}[{dims}] {size / 1e6:9.1f} MB  {name}  <- {line.split('(', 1)[1][:120]}")
if len(sys.argv) > 4:  # where to keep the optimized HLO
    open(sys.argv[4], "w").write(hlo)
print(f"large copies: {total / 1e9:.2f} GB per step (if each runs once)")
