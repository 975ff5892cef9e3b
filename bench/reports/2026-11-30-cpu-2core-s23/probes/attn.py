import time, sys
import mlx.core as mx
from engine.runtime.runner.backends.cpu import cpu_math
H, KV, D = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
n, L = int(sys.argv[4]), int(sys.argv[5])
q = mx.random.normal((1, H, n, D)); k = mx.random.normal((1, KV, L, D)); v = mx.random.normal((1, KV, L, D))
mx.eval(q, k, v)
for name, f in (("sdpa", lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=D**-0.5, mask="causal")),
                ("host", lambda: cpu_math.attention(q, k, v, D**-0.5, "causal")),
                ("sdpa", lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=D**-0.5, mask="causal")),
                ("host", lambda: cpu_math.attention(q, k, v, D**-0.5, "causal"))):
    t = time.perf_counter(); mx.eval(f()); print(name, n, L, f"{time.perf_counter()-t:.3f}s")
