import sys, time, collections
sys.path.insert(0, str(__import__('pathlib').Path(__file__).resolve().parents[4]) + "/bench"); sys.path.insert(0, str(__import__('pathlib').Path(__file__).resolve().parents[4]))
import mlx.core as mx, numpy as np
from common import base_parser, load
from bench_forward_split import _Rows, back_to_the_step, cpu_backend, filled_rows
from engine.runtime.runner.backends.cpu import host_forward, host_decode, host_linear
acc = collections.Counter()
def timed(name, f):
    def g(*a, **k):
        t = time.perf_counter(); r = f(*a, **k); acc[name] += time.perf_counter() - t; return r
    return g
host_forward._linear = timed("linear", host_forward._linear)
host_forward._times = timed("times(all incl head)", host_forward._times)
host_forward.host_decode.attend_host = timed("attend", host_decode.attend_host)
host_forward._rms_norm = timed("norm", host_forward._rms_norm)
host_forward._rotate = timed("rotate", host_forward._rotate)
host_forward._swiglu = timed("swiglu", host_forward._swiglu)
p = base_parser("x"); p.add_argument("--context", type=int, default=1000)
args = p.parse_args(["--cache-dir", "/tmp/dbg/mc"])
loaded = load(args); model = loaded.model
backend = cpu_backend(); backend.attach(model); time.sleep(15)
import os
if os.environ.get("NPONE"):
    from threadpoolctl import ThreadpoolController; ThreadpoolController().select(prefix="libscipy_openblas").limit(limits=1)
    import engine.runtime.runner.backends.cpu.host_verify_attention as hva, contextlib; hva.one_blas_thread = contextlib.nullcontext
for batch, widths in ((1, (1, 8)), (8, (1, 2, 4))):
    rows = [_Rows(l) for l in filled_rows(loaded, batch, args.context, backend.kinds)]
    for r in rows:
        for l in r.layers: l.reserve(args.context + 24)
    for w in widths:
        ts = []
        for rep in range(6):
            back_to_the_step([r.layers for r in rows], args.context)
            flat = mx.array([5] * (w * batch), dtype=mx.uint32)
            if rep == 1: acc.clear()
            t = time.perf_counter()
            mx.eval(host_forward.decode(model, flat, rows, backend._tables, backend._workers, backend._linear_ok, [w] * batch).argmax(-1))
            if rep >= 1: ts.append(time.perf_counter() - t)
        n = len(ts)
        print(f"batch {batch} width {w}: {1000*np.median(ts):.1f} ms; " + ", ".join(f"{k} {1000*v/n:.1f}" for k, v in acc.items()), flush=True)
