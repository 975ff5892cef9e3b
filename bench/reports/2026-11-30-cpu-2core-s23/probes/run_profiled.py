"""semantic --serve with each prefill pass and each decode step timed (stderr)."""
import sys, time
import mlx.core as mx
from engine.runtime.runner import batch as B

orig_group = B.SequenceBatch._prefill_group
def timed_group(self, group, n, out):
    t = time.perf_counter()
    offs = [s.kv.offset for s, _ in group]
    orig_group(self, group, n, out)
    sys.stderr.write(f"PREFILL rows={len(group)} n={n} sizes={[m for _, m in group]} offset={offs} {time.perf_counter()-t:.3f}s\n")
B.SequenceBatch._prefill_group = timed_group

orig_launch = B.SequenceBatch._launch
def timed_launch(self, out):
    t = time.perf_counter()
    r = orig_launch(self, out)
    if r is not None:
        mx.eval(r.sampled if r.sampled is not None else r.logits)
        sys.stderr.write(f"DECODE rows={len(r.rows)} offset={[s.kv.offset for s in r.rows]} {time.perf_counter()-t:.3f}s\n")
    return r
B.SequenceBatch._launch = timed_launch

from semantic_cli.main import main
sys.argv = ["semantic", *sys.argv[1:]]
main()
