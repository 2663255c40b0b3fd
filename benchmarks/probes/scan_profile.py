"""Top GPU kernels per decode step, scanned vs unrolled (V2-Lite, 1 GPU, batch 64, ctx 1K)."""
import collections, glob, os, sys
import jax
from benchmarks.harness import inject_decoding, clear
from benchmarks.shapes import shape_folder
from splash_jax.engine import Engine, EngineConfig
layers, scan = int(sys.argv[1]), sys.argv[2] == "1"
eng = Engine(EngineConfig(model=str(shape_folder("v2-lite", num_hidden_layers=layers)), load_format="dummy", dtype="bfloat16",
    num_devices=1, kv_memory_gb=10, max_model_len=1536, max_num_seqs=64, max_num_batched_tokens=64, min_token_bucket=64,
    compile_cache_dir=None, scan_layers=scan))
reqs = inject_decoding(eng, 64, 1024)
for _ in range(5): eng.step()
eng.flush()
d = f"/tmp/prof{int(scan)}"; os.system(f"rm -rf {d}")
with jax.profiler.trace(d):
    for _ in range(5): eng.step()
    eng.flush()
pd = jax.profiler.ProfileData.from_file(glob.glob(f"{d}/**/*.xplane.pb", recursive=True)[0])
kern = collections.Counter(); n = collections.Counter(); busy = 0.0
for plane in pd.planes:
    if "gpu" not in plane.name.lower(): continue
    for line in plane.lines:
        if "stream" not in line.name.lower(): continue
        for ev in line.events:
            busy += ev.duration_ns; kern[ev.name[:90]] += ev.duration_ns; n[ev.name[:90]] += 1
print(f"layers={layers} scan={scan}: GPU busy/step {busy/5/1e6:.2f} ms, kernels/step {sum(n.values())/5:.0f}")
for k, v in kern.most_common(14): print(f"  {v/5/1e3:8.1f} us/step x{n[k]/5:.0f}  {k}")
