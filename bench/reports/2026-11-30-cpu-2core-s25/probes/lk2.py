import numpy as np, time, sys
sys.path.insert(0, str(__import__('pathlib').Path(__file__).resolve().parents[4]))
from engine.runtime.runner.backends.cpu import linear_kernel as new
rng = np.random.default_rng(0)
shapes = [(576, 576)] * 2 + [(192, 576)] * 2 + [(1536, 576)] * 2 + [(576, 1536)]
W = [rng.standard_normal(s).astype(np.float32) for s in shapes for _ in range(30)] + [rng.standard_normal((49152, 576)).astype(np.float32)]
for rows in (1, 3, 4, 8, 9, 16, 32, 48, 64):
    xs = {w.shape[1]: rng.standard_normal((rows, w.shape[1])).astype(np.float32) for w in W}
    for name, f in (("new", new.times_transposed), ("blas", None)):
        outs = [np.empty((rows, w.shape[0]), np.float32) for w in W]
        ts = []
        for rep in range(5):
            t = time.perf_counter()
            for w, o in zip(W, outs):
                if f is None: np.matmul(xs[w.shape[1]], w.T, out=o)
                else: f(xs[w.shape[1]], w, o, 2)
            ts.append(time.perf_counter() - t)
        if f is None: err = max(np.abs(o - r).max() / np.abs(r).max() for o, r in zip(outs, prev))
        prev = outs
        print(rows, name, f"{min(ts)*1000:.1f} ms", "" if f else f"relerr {err:.1e}", flush=True)
