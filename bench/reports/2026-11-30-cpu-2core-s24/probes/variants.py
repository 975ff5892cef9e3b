import time, sys
import mlx.core as mx
from engine.runtime.runner.backends.cpu import cpu_math
orig = mx.fast.scaled_dot_product_attention
def host(q, k, v, scale=None, mask=None, **kw):
    return cpu_math.attention(q, k, v, scale, mask)
def noeval(q, k, v, scale=None, mask=None, **kw):
    old = cpu_math.mx.eval
    cpu_math.mx.eval = lambda *a: None
    try:
        return cpu_math.attention(q, k, v, scale, mask)
    finally:
        cpu_math.mx.eval = old
def asyncev(q, k, v, scale=None, mask=None, **kw):
    old = cpu_math.mx.eval
    cpu_math.mx.eval = mx.async_eval
    try:
        return cpu_math.attention(q, k, v, scale, mask)
    finally:
        cpu_math.mx.eval = old
def zero(q, k, v, scale=None, mask=None, **kw):
    return q * 0
def unblocked(q, k, v, scale=None, mask=None, **kw):
    return cpu_math._attention(q, k, v, scale, mask)
from engine.runtime.runner.backends.cpu import host_softmax
host_softmax.ROW_SOFTMAX.warm_up()
def rows(q, k, v, scale=None, mask=None, **kw):
    if q.shape[2] > 1 and q.shape[0]*q.shape[1]*q.shape[2]*k.shape[2] > cpu_math.MAX_SCORES:
        return host_softmax.attention(q, k, v, scale, mask, cpu_math.softmax)
    return cpu_math.attention(q, k, v, scale, mask)
VARIANTS = {"rows": rows, "sdpa": orig, "host": host, "noeval": noeval, "zero": zero, "async": asyncev, "unblocked": unblocked}
mode = {"f": orig}
mx.fast.scaled_dot_product_attention = lambda q, k, v, **kw: mode["f"](q, k, v, **kw)
import mlx_lm.models.gated_delta as gdmod
from engine.runtime.runner.backends.cpu import host_gated_delta
_orig_ops = gdmod.gated_delta_ops
def _ops(q, *rest):
    out = host_gated_delta.steps(q, *rest)
    return out if out is not None else _orig_ops(q, *rest)
import os
if os.environ.get("GDN") == "1":
    gdmod.gated_delta_ops = _ops
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache, KVCache
model, tok = load(sys.argv[1])
n = int(sys.argv[2]); names = sys.argv[3].split(","); ctxs = [int(x) for x in sys.argv[4:]]
import random
random.seed(0)
toks = [random.randrange(1000, 40000) for _ in range(n)]
small = make_prompt_cache(model)
model(mx.array([[5]*8]), cache=small); mx.eval([c.state for c in small])
for ctx in ctxs:
    cache = make_prompt_cache(model)
    for c, s in zip(cache, small):
        if type(c) is KVCache:
            B, H, _, D = s.keys.shape
            c.keys = mx.random.normal((B, H, ctx, D)) * 0.1
            c.values = mx.random.normal((B, H, ctx, D)) * 0.1
            c.offset = ctx
        else:
            c.state = s.state; c.meta_state = s.meta_state if hasattr(s, "meta_state") else None
    mx.eval([c.state for c in cache])
    res = {k: [] for k in names}
    for rep in range(2):
        for name in (names if rep % 2 == 0 else names[::-1]):
            mode["f"] = VARIANTS[name]
            for c in cache:
                if type(c) is KVCache: c.offset = ctx
            t = time.perf_counter()
            model(mx.array([toks]), cache=cache)
            mx.eval([c.state for c in cache])
            res[name].append(time.perf_counter() - t)
    print(f"ctx {ctx:6d} n {n}: " + "  ".join(f"{k} {min(v):.3f}" for k, v in res.items()), flush=True)
