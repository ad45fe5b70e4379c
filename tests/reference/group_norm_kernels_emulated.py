# The GroupNorm kernels of src/model/fused_cuda.cu (group_norm_forward_kernel, group_norm_backward_kernel),
# transliterated thread by thread into float32 numpy (both memory orders: each thread's strided loops,
# GroupLayout's offsets, the per-channel sums, the block sums in warp order; a warp's own sum is
# np.sum's, not the kernel's butterfly, so only the rounding order differs) and compared with PyTorch's
# float64 autograd of GroupNorm -> (1 + scale), shift -> SiLU. Written to check the kernels' index
# arithmetic and gradient formulas on a machine without a GPU; tests/gpu/test_cuda.cpp checks the
# kernels themselves. Keep it in step with the .cu file. Run: "$(bash scripts/reference-env.sh)" THIS
import numpy as np, torch
T = 256
def block_sum(vals):
    w = [np.float32(np.sum(vals[k*32:(k+1)*32], dtype=np.float32)) for k in range(T//32)]
    t = w[0]
    for k in range(1, T//32): t = np.float32(t + w[k])
    return t
def silu(z): return z/(1+np.exp(-z))
def silu_grad(z):
    s = 1/(1+np.exp(-z)); return s*(1+z*(1-s))
class Layout:
    def __init__(s, nhwc, b, g, G, Cg, HW):
        s.nhwc, s.Cg, s.HW, s.C = nhwc, Cg, HW, G*Cg
        s.start = b*HW*G*Cg + g*Cg if nhwc else (b*G+g)*Cg*HW
    def at(s, i):
        if s.nhwc:
            p = i // s.Cg; ci = i - p*s.Cg
            return s.start + p*s.C + ci, ci
        return s.start + i, i // s.HW
def coeffs(gamma, beta, scale, shift, mod_row, c0, Cg):
    ca = np.zeros(Cg, np.float32); ck = np.zeros(Cg, np.float32)
    for ci in range(Cg):
        c = c0+ci
        m = np.float32(1) + (np.float32(0) if scale is None else scale[mod_row + c])
        ca[ci] = (1 if gamma is None else gamma[c]) * m
        ck[ci] = (0 if beta is None else beta[c]) * m + (0 if shift is None else shift[mod_row+c])
    return ca, ck
def forward(x, gamma, beta, scale, shift, ms, B, C, G, HW, nhwc, use_silu, eps):
    Cg = C//G; L = Cg*HW
    out = np.full(B*C*HW, np.nan, np.float32); mo = np.zeros(B*G, np.float32); ro = np.zeros(B*G, np.float32)
    for bg in range(B*G):
        b, g = bg//G, bg % G
        at = Layout(nhwc, b, g, G, Cg, HW)
        part = np.zeros(T, np.float32)
        for t in range(T):
            for i in range(t, L, T): part[t] += x[at.at(i)[0]]
        mean = np.float32(block_sum(part)/np.float32(L))
        part = np.zeros(T, np.float32)
        for t in range(T):
            for i in range(t, L, T): part[t] += (x[at.at(i)[0]]-mean)**2
        rstd = np.float32(1/np.sqrt(block_sum(part)/np.float32(L) + np.float32(eps)))
        mo[bg] = mean; ro[bg] = rstd
        ca, ck = coeffs(gamma, beta, scale, shift, b*ms, g*Cg, Cg)
        for t in range(T):
            for i in range(t, L, T):
                o, ci = at.at(i)
                z = (x[o]-mean)*rstd*ca[ci] + ck[ci]
                out[o] = silu(z) if use_silu else z
    return out, mo, ro
def backward(gy, x, mean, rstd, gamma, beta, scale, shift, ms, B, C, G, HW, nhwc, use_silu):
    Cg = C//G; L = Cg*HW
    gx = np.full(B*C*HW, np.nan, np.float32); P = np.zeros(B*C, np.float32); Q = np.zeros(B*C, np.float32)
    for bg in range(B*G):
        b, g = bg//G, bg % G
        at = Layout(nhwc, b, g, G, Cg, HW)
        mu, r = mean[bg], rstd[bg]
        ca, ck = coeffs(gamma, beta, scale, shift, b*ms, g*Cg, Cg)
        pc = np.zeros(Cg, np.float32); qc = np.zeros(Cg, np.float32)
        def dz_at(o, a, k):
            xh = (x[o]-mu)*r
            return (gy[o]*silu_grad(xh*a+k) if use_silu else gy[o]), xh
        if not nhwc and HW < T:
            for c in range(Cg):  # a warp a channel: lanes step by 32
                pp = np.zeros(32, np.float32); qq = np.zeros(32, np.float32)
                for lane in range(32):
                    for i in range(c*HW + lane, (c+1)*HW, 32):
                        o, ci = at.at(i); assert ci == c
                        dz, xh = dz_at(o, ca[c], ck[c]); pp[lane] += dz*xh; qq[lane] += dz
                pc[c] = np.sum(pp, dtype=np.float32); qc[c] = np.sum(qq, dtype=np.float32)
        elif not nhwc:
            for c in range(Cg):
                pp = np.zeros(T, np.float32); qq = np.zeros(T, np.float32)
                for t in range(T):
                    for i in range(c*HW + t, (c+1)*HW, T):
                        o, ci = at.at(i); assert ci == c
                        dz, xh = dz_at(o, ca[c], ck[c]); pp[t] += dz*xh; qq[t] += dz
                pc[c] = block_sum(pp); qc[c] = block_sum(qq)
        else:
            used = T // Cg * Cg
            tp = np.zeros(T, np.float32); tq = np.zeros(T, np.float32)
            for t in range(used):
                for i in range(t, L, used):
                    o, ci = at.at(i); assert ci == t % Cg
                    dz, xh = dz_at(o, ca[ci], ck[ci]); tp[t] += dz*xh; tq[t] += dz
            for c in range(Cg):
                for t in range(c, used, Cg): pc[c] += tp[t]; qc[c] += tq[t]
        s1 = np.float32(0); s2 = np.float32(0)
        for c in range(Cg): s1 += ca[c]*qc[c]; s2 += ca[c]*pc[c]
        for c in range(Cg): P[b*G*Cg + g*Cg + c] = pc[c]; Q[b*G*Cg + g*Cg + c] = qc[c]
        m1 = s1/np.float32(L); m2 = s2/np.float32(L)
        for t in range(T):
            for i in range(t, L, T):
                o, ci = at.at(i)
                dz, xh = dz_at(o, ca[ci], ck[ci])
                gx[o] = r*(dz*ca[ci] - m1 - xh*m2)
    return gx, P, Q
torch.manual_seed(0)
for (B, C, G, H, W, use_silu, mod, affine, nhwc) in [(2, 8, 2, 3, 5, True, True, True, False), (2, 8, 2, 3, 5, True, True, True, True),
        (3, 12, 4, 7, 7, True, False, True, True), (2, 6, 3, 4, 4, False, False, False, True),
        (1, 20, 2, 17, 17, True, True, True, True), (1, 4, 2, 17, 17, True, True, True, False), (2, 36, 3, 5, 6, True, True, True, True), (2, 4, 1, 2, 3, False, True, True, False)]:
    HW = H*W
    x0 = torch.randn(B, C, H, W, dtype=torch.float64)*3+1
    gamma0 = torch.randn(C, dtype=torch.float64) if affine else None
    beta0 = torch.randn(C, dtype=torch.float64) if affine else None
    ss0 = torch.randn(B, 2*C, dtype=torch.float64)*0.5
    gy0 = torch.randn(B, C, H, W, dtype=torch.float64)
    x = x0.clone().requires_grad_(); ss = ss0.clone().requires_grad_()
    ga = gamma0.clone().requires_grad_() if affine else None; be = beta0.clone().requires_grad_() if affine else None
    h = torch.nn.functional.group_norm(x, G, ga, be, 1e-5)
    if mod: h = h*(1+ss[:, :C, None, None]) + ss[:, C:, None, None]
    y = torch.nn.functional.silu(h) if use_silu else h
    y.backward(gy0)
    # memory order of the kernels' buffers
    mem = (lambda t: t.permute(0, 2, 3, 1)) if nhwc else (lambda t: t)
    unmem = (lambda a: a.reshape(B, H, W, C).transpose(0, 3, 1, 2)) if nhwc else (lambda a: a.reshape(B, C, H, W))
    f = lambda t: t.detach().contiguous().numpy().astype(np.float32).ravel()
    ssf = f(ss0)
    sc = ssf if mod else None; sh = ssf[C:] if mod else None
    out, mean, rstd = forward(f(mem(x0)), f(gamma0) if affine else None, f(beta0) if affine else None, sc, sh, 2*C, B, C, G, HW, nhwc, use_silu, 1e-5)
    gx, P, Q = backward(f(mem(gy0)), f(mem(x0)), mean, rstd, f(gamma0) if affine else None, f(beta0) if affine else None, sc, sh, 2*C, B, C, G, HW, nhwc, use_silu)
    assert not np.isnan(out).any() and not np.isnan(gx).any()
    P = P.reshape(B, C).astype(np.float64); Q = Q.reshape(B, C).astype(np.float64)
    m = 1 + ssf.reshape(B, 2*C)[:, :C].astype(np.float64) if mod else np.ones((B, C))
    rel = lambda a, b: np.abs(a - b.detach().numpy()).max() / (np.abs(b.detach().numpy()).max() + 1e-30)
    res = [rel(unmem(out), y), rel(unmem(gx), x.grad)]
    if affine: res += [rel((P*m).sum(0), ga.grad), rel((Q*m).sum(0), be.grad)]
    if mod:
        u = P*(f(gamma0) if affine else 1) + (Q*f(beta0) if affine else 0)
        res += [rel(u, ss.grad[:, :C]), rel(Q, ss.grad[:, C:])]
    print((B, C, G, H, W, use_silu, mod, affine, "nhwc" if nhwc else "nchw"), ["%.1e" % v for v in res])
    assert max(res) < 1e-4, res
print("ok")
