BF, F32 = 2, 4
def gdn(hk, hv, dk, dv, K=4): return [((K-1, 2*hk*dk + hv*dv), BF), ((hv, dv, dk), F32)]
def m2(h, p, n, g, K=4): return [((K-1, h*p + 2*g*n), BF), ((h, p, n), F32)]
pat = "M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-"
print("nemotron pattern len", len(pat), "M", pat.count("M"), "*", pat.count("*"))
rows = [
 ("Qwen3.5-0.8B", 18, gdn(16,16,128,128), 6*2*2*256*BF),
 ("Qwen3.5-4B", 24, gdn(16,32,128,128), 8*2*4*256*BF),
 ("Qwen3.5-27B", 48, gdn(16,48,128,128), 16*2*4*256*BF),
 ("Qwen3-Next-80B-A3B", 36, gdn(16,32,128,128), 12*2*2*256*BF),
 ("Nemotron-Nano-9B-v2", pat.count("M"), m2(128,80,128,8), pat.count("*")*2*8*128*BF),
 ("Granite-4.0-H-Small", 36, m2(128,64,128,1), 4*2*8*128*BF),
 ("LFM2-1.2B", 10, [((2,2048),BF)], 6*2*8*64*BF),
 ("mamba2-2.7b", 64, m2(80,64,128,1), 0),
 ("Mamba-Codestral-7B", 64, m2(128,64,128,8), 0),
 ("RWKV7-1.5B", 24, [((1,2048),BF),((32,64,64),BF),((1,2048),BF)], 0),
 ("Kimi-Linear-48B-A3B", 20, [((3,4096),BF)]*3+[((32,128,128),F32)], 7*(512+64)*BF),
 ("Falcon-H1-1.5B", 24, m2(48,64,256,1), 24*2*2*128*BF),
 ("Falcon-H1-7B", 44, m2(24,128,256,1), 44*2*2*128*BF),
 ("Jamba-v0.1", 28, [((3,8192),BF),((8192,16),BF)], 4*2*8*128*BF),
]
import math
for name, n, arrs, kv in rows:
    per = sum(math.prod(s)*b for s,b in arrs)
    tot = n*per
    ratio = f"{tot/kv:,.0f}" if kv else "n/a"
    print(f"{name:22s} n={n:3d} arrs={[ (s,'bf16' if b==2 else 'f32', math.prod(s)*b) for s,b in arrs]} per_layer={per:,} total={tot:,} ({tot/2**20:.2f} MiB) kv/tok={kv:,} ratio={ratio}")
