import sys, time, numpy as np, numba
sys.path.insert(0, str(__import__('pathlib').Path(__file__).resolve().parents[4]))
from engine.runtime.runner.backends.cpu import softmax_kernel
from engine.runtime.runner.backends.cpu.host_kernels import LOWEST
import math
_FAST={"reassoc","contract"}
@numba.njit(nogil=True, fastmath=_FAST, cache=False)
def softmax_vis(scores, visible):
    rows, length = scores.shape
    for r in range(rows):
        s = scores[r]; n = visible[r]
        top = s[0]
        for p in range(1, n):
            if s[p] > top: top = s[p]
        den = np.float32(0.0)
        for p in range(n):
            e = np.float32(math.exp(s[p] - top)); s[p] = e; den += e
        for p in range(n):
            s[p] = s[p] / den
        for p in range(n, length):
            s[p] = np.float32(0.0)

def group_attend(q, K, V, L, w, rep, sm):
    # q (w, heads, dim); K,V (kv_heads, cap, dim) ; keys 0..L-1 (L includes the w new)
    kvh, _, dim = K.shape
    Q = q.reshape(w, kvh, rep, dim).transpose(1, 0, 2, 3).reshape(kvh, w * rep, dim)
    S = np.matmul(Q, K[:, :L, :].transpose(0, 2, 1))
    vis = np.repeat(np.arange(L - w + 1, L + 1), rep)
    vis = np.tile(vis, kvh).astype(np.int64)
    S2 = S.reshape(kvh * w * rep, L)
    sm(S2, vis)
    O = np.matmul(S, V[:, :L, :])
    return O.reshape(kvh, w, rep, dim).transpose(1, 0, 2, 3).reshape(w, kvh * rep, dim)

rng = np.random.default_rng(0)
kvh, rep, dim, cap = 3, 3, 64, 2048
K = rng.standard_normal((kvh, cap, dim)).astype(np.float32); V = rng.standard_normal((kvh, cap, dim)).astype(np.float32)
softmax_vis(np.zeros((2,4),np.float32), np.array([2,4]))
for L in (1000, 2000):
  for w in (1, 4, 8):
    q = rng.standard_normal((w, kvh*rep, dim)).astype(np.float32) * 0.125
    for name, sm in (("numba-math.exp", softmax_vis), ("softmax_rows", softmax_kernel.softmax_rows)):
        group_attend(q, K, V, L, w, rep, sm)
        t = time.perf_counter()
        for _ in range(300): o = group_attend(q, K, V, L, w, rep, sm)
        dt = (time.perf_counter() - t) / 300
        print(f"L {L} w {w} {name}: {dt*1e6:.0f} us per layer-seq ({dt*1e6/w:.0f} per token)")
    # reference: naive per row
    ref = []
    for j in range(w):
        n = L - w + 1 + j
        s = np.einsum("hrd,hpd->hrp", q[j].reshape(kvh, rep, dim).astype(np.float64), K[:, :n].astype(np.float64))
        s = np.exp(s - s.max(-1, keepdims=True)); s /= s.sum(-1, keepdims=True)
        ref.append(np.einsum("hrp,hpd->hrd", s, V[:, :n].astype(np.float64)).reshape(kvh*rep, dim))
    print("  max err", np.abs(np.array(ref) - o).max())
print("---- breakdown")
serial_rows = numba.njit(nogil=True, fastmath={"contract"}, cache=False)(softmax_kernel.softmax_rows.py_func)
for L in (1000,):
  for w in (1, 8):
    q = rng.standard_normal((w, kvh*rep, dim)).astype(np.float32) * 0.125
    group_attend(q, K, V, L, w, rep, serial_rows)
    t = time.perf_counter()
    for _ in range(300): o = group_attend(q, K, V, L, w, rep, serial_rows)
    print(f"L {L} w {w} serial poly: {(time.perf_counter()-t)/300*1e6:.0f} us")
    Q = q.reshape(w, kvh, rep, dim).transpose(1, 0, 2, 3).reshape(kvh, w * rep, dim)
    t = time.perf_counter()
    for _ in range(300): S = np.matmul(Q, K[:, :L, :].transpose(0, 2, 1))
    print("  QK", (time.perf_counter()-t)/300*1e6)
    S2 = S.reshape(-1, L).copy(); vis = np.full(S2.shape[0], L, np.int64)
    t = time.perf_counter()
    for _ in range(300): X = S2.copy(); softmax_vis(X, vis)
    print("  softmax mathexp", (time.perf_counter()-t)/300*1e6)
    t = time.perf_counter()
    for _ in range(300): X = S2.copy(); serial_rows(X, vis)
    print("  softmax poly", (time.perf_counter()-t)/300*1e6)
    t = time.perf_counter()
    for _ in range(300): O = np.matmul(S, V[:, :L, :])
    print("  PV", (time.perf_counter()-t)/300*1e6)
