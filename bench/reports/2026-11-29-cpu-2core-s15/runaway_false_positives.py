"""Scratch: false positives of the repetition guard at a longer MAX_PERIOD, on bench_runaway's corpus."""
import sys, time
sys.path.insert(0, str(__import__('pathlib').Path(__file__).resolve().parents[3]) + "/bench"); sys.path.insert(0, str(__import__('pathlib').Path(__file__).resolve().parents[3]))
import engine.runtime.scheduler.repetition as rep
period = int(sys.argv[1])
rep.MAX_PERIOD = period
import bench_runaway as br
br.MAX_PERIOD = period
from pathlib import Path
from mlx_lm.tokenizer_utils import load
tok = load(Path(sys.argv[2]))
t = time.time()
read, fired, best, best_file = 0, 0, 0.0, ""
firing = []
for path in br.corpus_files():
    tokens = tok.encode(path.read_text(errors="ignore"))[:8000]
    if len(tokens) < 512:
        continue
    read += 1
    guard = rep.RepetitionGuard(512)
    hit = next((l for l in (guard.push(x) for x in tokens) if l is not None), None)
    if hit:
        fired += 1; firing.append((str(path), hit))
print(f"MAX_PERIOD {period}: read {read}, fired {fired}, {time.time()-t:.0f} s")
for f in firing: print(f)
