"""The same models and training step as ddm, written in plain PyTorch as a PyTorch 2.x user writes
them: the baseline that bench/compare_python.sh measures ddm against (the torch 2.11 of
scripts/setup.sh's virtual environment, the same LibTorch ddm is built on; same thread count, same
batch). Mirrors src/model/{layers,unet,dit}.cpp and src/train/step.cpp: flow matching, attention
through F.scaled_dot_product_attention, AdamW (torch.optim's default implementation), gradient
clipping, EMA. With --compile the model runs under torch.compile (inductor), and the time of the
warm-up steps, which include compiling, is reported as compile_s.

With --sample NFE it measures sampling instead, as `ddm_bench sample` does: --batch images from
noise in one batch with the Euler sampler of flow matching (NFE steps from t = 1 to 0, no guidance),
under torch.inference_mode(); the best of --steps timed runs after --warmup untimed ones.

On a GPU (--device cuda) with --precision bf16 the forward and the loss run under bfloat16
autocast (fp32 weights, gradients, AdamW state and EMA); the step's FLOPs are counted once by
torch.utils.flop_counter and reported with the achieved TFLOP/s and the MFU against the card's dense
bf16 peak (--peak TFLOPS, or known from the card's name).

usage: python bench/reference.py PRESET --batch 128 --threads 2 --steps 20 --warmup 3 [--compile]
         [--compile-mode default|reduce-overhead|max-autotune] [--sample NFE] [--trace FILE] [--device cpu|cuda] [--precision fp32|bf16] [--peak TFLOPS]
prints one JSON line: {"impl": "python" | "python-compile", "compile_mode" (compiled), "preset", "batch", "threads", "step_s",
"img_per_s", "compile_s", "device", "precision", "tflops", "mfu"} (with --sample: "mode": "sample", "nfe", "seconds" per batch)
"""
import argparse
import json
import math
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

PRESETS = {
    "unet-tiny": dict(arch="unet", channels=32, channel_mult=[1, 2, 2], res_blocks=1, attn_levels=[], groups=8, heads=4),
    "unet-small": dict(arch="unet", channels=64, channel_mult=[1, 2, 2], res_blocks=2, attn_levels=[2], groups=16, heads=4),
    "dit-tiny": dict(arch="dit", patch=4, width=128, depth=4, heads=4, mlp_ratio=4.0),
    "dit-small": dict(arch="dit", patch=2, width=192, depth=6, heads=6, mlp_ratio=4.0),
    # DiT-B/2 on 32x32x4 latents (ImageNet 256 through an 8x autoencoder), 1000 classes: the DDM and
    # DiT papers' backbone, the GPU benchmark's model
    "dit-b": dict(arch="dit", patch=2, width=768, depth=12, heads=12, mlp_ratio=4.0, cin=4, size=32, classes=1000),
}
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}  # dense, SXM; a name not here: --peak


def timestep_embedding(t, dim, max_period=10000.0):
    half = dim // 2
    freqs = torch.exp(torch.arange(half, dtype=t.dtype, device=t.device) * (-math.log(max_period) / half))
    args = (t * 1000.0)[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], 1)


def pos_embed_2d(dim, grid):
    q = dim // 4
    omega = torch.pow(10000.0, -torch.arange(q, dtype=torch.float64) / q)
    ang = torch.arange(grid, dtype=torch.float64)[:, None] * omega[None]
    one = torch.cat([torch.sin(ang), torch.cos(ang)], 1)
    rows = one[:, None].expand(grid, grid, dim // 2)
    cols = one[None].expand(grid, grid, dim // 2)
    return torch.cat([rows, cols], 2).reshape(grid * grid, dim).float()


class TimeEmbedder(nn.Module):
    def __init__(self, freq_dim, dim):
        super().__init__()
        self.freq_dim = freq_dim
        self.fc1, self.fc2 = nn.Linear(freq_dim, dim), nn.Linear(dim, dim)

    def forward(self, t):
        return self.fc2(F.silu(self.fc1(timestep_embedding(t, self.freq_dim))))


class ResBlock(nn.Module):
    def __init__(self, cin, cout, emb, groups):
        super().__init__()
        self.cout = cout
        self.norm1, self.conv1 = nn.GroupNorm(groups, cin), nn.Conv2d(cin, cout, 3, padding=1)
        self.emb = nn.Linear(emb, 2 * cout)
        self.norm2, self.conv2 = nn.GroupNorm(groups, cout), nn.Conv2d(cout, cout, 3, padding=1)
        nn.init.zeros_(self.conv2.weight), nn.init.zeros_(self.conv2.bias)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else None

    def forward(self, x, emb_act):
        h = self.conv1(F.silu(self.norm1(x)))
        scale, shift = self.emb(emb_act)[:, :, None, None].chunk(2, 1)
        h = torch.addcmul(shift, self.norm2(h), scale + 1.0)
        h = self.conv2(F.silu(h))
        return (self.skip(x) if self.skip is not None else x) + h


class AttentionBlock(nn.Module):
    def __init__(self, ch, heads, groups):
        super().__init__()
        self.heads = heads
        self.norm, self.qkv, self.proj = nn.GroupNorm(groups, ch), nn.Conv2d(ch, 3 * ch, 1), nn.Conv2d(ch, ch, 1)
        nn.init.zeros_(self.proj.weight), nn.init.zeros_(self.proj.bias)

    def forward(self, x):
        B, C, H, W = x.shape
        qkv = self.qkv(self.norm(x)).reshape(B, 3, self.heads, C // self.heads, H * W)
        q, k, v = (qkv[:, i].transpose(-1, -2) for i in range(3))
        a = F.scaled_dot_product_attention(q, k, v).transpose(-1, -2).reshape(B, C, H, W)
        return x + self.proj(a)


class Stage(nn.Module):
    def __init__(self, cin, cout, emb, cfg, level):
        super().__init__()
        self.res = ResBlock(cin, cout, emb, cfg["groups"])
        self.attn = AttentionBlock(cout, cfg["heads"], cfg["groups"]) if level in cfg["attn_levels"] else None

    def forward(self, h, e):
        h = self.res(h, e)
        return self.attn(h) if self.attn is not None else h


class UNet(nn.Module):
    def __init__(self, cfg, cin=1, classes=10):
        super().__init__()
        L, ch = len(cfg["channel_mult"]), [cfg["channels"] * m for m in cfg["channel_mult"]]
        emb = 4 * cfg["channels"]
        self.time, self.label = TimeEmbedder(cfg["channels"], emb), nn.Embedding(classes + 1, emb)
        self.in_conv = nn.Conv2d(cin, ch[0], 3, padding=1)
        cur, skip_ch = ch[0], []
        self.enc, self.down = nn.ModuleList(), nn.ModuleList()
        for l in range(L - 1):
            stages = nn.ModuleList()
            for _ in range(cfg["res_blocks"]):
                stages.append(Stage(cur, ch[l], emb, cfg, l))
                cur = ch[l]
                skip_ch.append(cur)
            self.enc.append(stages)
            self.down.append(nn.Conv2d(ch[l], ch[l], 3, stride=2, padding=1))
        self.mid = nn.ModuleList()
        for _ in range(cfg["res_blocks"]):
            self.mid.append(Stage(cur, ch[L - 1], emb, cfg, L - 1))
            cur = ch[L - 1]
        self.up, self.dec = nn.ModuleList(), nn.ModuleList()
        for l in reversed(range(L - 1)):
            self.up.append(nn.Conv2d(cur, ch[l], 3, padding=1))
            cur = ch[l]
            stages = nn.ModuleList()
            for _ in range(cfg["res_blocks"]):
                stages.append(Stage(cur + skip_ch.pop(), ch[l], emb, cfg, l))
                cur = ch[l]
            self.dec.append(stages)
        self.out_norm, self.out_conv = nn.GroupNorm(cfg["groups"], cur), nn.Conv2d(cur, cin, 3, padding=1)
        nn.init.zeros_(self.out_conv.weight), nn.init.zeros_(self.out_conv.bias)

    def forward(self, x, t, y):
        e = F.silu(self.time(t) + self.label(y))
        h, skips = self.in_conv(x), []
        for stages, down in zip(self.enc, self.down):
            for s in stages:
                h = s(h, e)
                skips.append(h)
            h = down(h)
        for s in self.mid:
            h = s(h, e)
        for up, stages in zip(self.up, self.dec):
            h = up(F.interpolate(h, scale_factor=2, mode="nearest"))
            for s in stages:
                h = s(torch.cat([h, skips.pop()], 1), e)
        return self.out_conv(F.silu(self.out_norm(h)))


class DiTBlock(nn.Module):
    def __init__(self, w, heads, ratio):
        super().__init__()
        self.heads, hidden = heads, round(w * ratio)
        self.norm1 = nn.LayerNorm(w, elementwise_affine=False, eps=1e-6)
        self.qkv, self.proj = nn.Linear(w, 3 * w), nn.Linear(w, w)
        self.norm2 = nn.LayerNorm(w, elementwise_affine=False, eps=1e-6)
        self.fc1, self.fc2 = nn.Linear(w, hidden), nn.Linear(hidden, w)
        self.ada = nn.Linear(w, 6 * w)
        nn.init.zeros_(self.ada.weight), nn.init.zeros_(self.ada.bias)

    def forward(self, x, c):
        B, N, W = x.shape
        m = self.ada(c)[:, None].chunk(6, -1)
        h = torch.addcmul(m[0], self.norm1(x), m[1] + 1.0)
        q, k, v = self.qkv(h).view(B, N, 3, self.heads, W // self.heads).unbind(2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        a = self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, N, W))
        out = torch.addcmul(x, m[2], a)
        h = torch.addcmul(m[3], self.norm2(out), m[4] + 1.0)
        return torch.addcmul(out, m[5], self.fc2(F.gelu(self.fc1(h))))


class DiT(nn.Module):
    def __init__(self, cfg, cin=1, size=28, classes=10):
        super().__init__()
        p, w = cfg["patch"], cfg["width"]
        self.p, self.cin, self.size = p, cin, size
        self.patch_embed = nn.Linear(cin * p * p, w)
        self.register_buffer("pos", pos_embed_2d(w, size // p)[None])
        self.time, self.label = TimeEmbedder(256, w), nn.Embedding(classes + 1, w)
        self.blocks = nn.ModuleList([DiTBlock(w, cfg["heads"], cfg["mlp_ratio"]) for _ in range(cfg["depth"])])
        self.final_norm = nn.LayerNorm(w, elementwise_affine=False, eps=1e-6)
        self.final_ada, self.final_linear = nn.Linear(w, 2 * w), nn.Linear(w, p * p * cin)
        for lin in (self.final_ada, self.final_linear):
            nn.init.zeros_(lin.weight), nn.init.zeros_(lin.bias)

    def forward(self, x, t, y):
        B, C, S, p = x.shape[0], self.cin, self.size, self.p
        tok = x.reshape(B, C, S // p, p, S // p, p).permute(0, 2, 4, 1, 3, 5).reshape(B, -1, C * p * p)
        h = self.patch_embed(tok) + self.pos
        c = F.silu(self.time(t) + self.label(y))
        for b in self.blocks:
            h = b(h, c)
        m = self.final_ada(c)[:, None].chunk(2, -1)
        h = self.final_linear(torch.addcmul(m[0], self.final_norm(h), m[1] + 1.0))
        return h.reshape(B, S // p, S // p, C, p, p).permute(0, 3, 1, 4, 2, 5).reshape(B, C, S, S)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("preset", choices=sorted(PRESETS))
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--compile", action="store_true", help="torch.compile the model (inductor)")
    ap.add_argument("--compile-mode", choices=["default", "reduce-overhead", "max-autotune"],
                    help="torch.compile's mode (implies --compile); reduce-overhead: CUDA graphs of the compiled model")
    ap.add_argument("--trace", help="write a profiler trace (Chrome JSON) of 3 steps after the warm-up (with --sample: of one run)")
    ap.add_argument("--sample", type=int, metavar="NFE", help="measure Euler sampling with NFE steps instead")
    ap.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"], help="bf16: autocast forward and loss")
    ap.add_argument("--peak", type=float, help="the device's dense bf16 peak in TFLOP/s, for the MFU (default: by the card's name)")
    a = ap.parse_args()
    a.compile = a.compile or a.compile_mode is not None
    a.mode = a.compile_mode or "default"
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    cfg = PRESETS[a.preset]
    cin, size, classes = cfg.get("cin", 1), cfg.get("size", 28), cfg.get("classes", 10)
    model = UNet(cfg, cin, classes) if cfg["arch"] == "unet" else DiT(cfg, cin, size, classes)
    dev = torch.device(a.device)
    model.to(dev)
    a.shape, a.classes, a.dev = (cin, size, size), classes, dev
    a.autocast = lambda: torch.autocast(dev.type, dtype=torch.bfloat16, enabled=a.precision == "bf16")
    a.sync = (lambda: torch.cuda.synchronize()) if dev.type == "cuda" else (lambda: None)
    if a.sample:
        return sample(a, model)
    ema = [p.detach().clone() for p in model.parameters()]
    run = torch.compile(model, mode=a.mode) if a.compile else model
    opt = torch.optim.AdamW(model.parameters(), lr=2e-4, weight_decay=0.0)
    x0 = torch.rand(a.batch, *a.shape, device=dev) * 2 - 1
    y0 = torch.randint(0, a.classes, (a.batch,), device=dev)

    def step(net=None):
        eps = torch.randn_like(x0)
        t = torch.rand(a.batch, device=dev)
        y = torch.where(torch.rand(a.batch, device=dev) < 0.1, torch.full_like(y0, a.classes), y0)
        xt = (1 - t)[:, None, None, None] * x0 + t[:, None, None, None] * eps
        with a.autocast():
            loss = F.mse_loss((net or run)(xt, t, y).float(), eps - x0)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            for e, p in zip(ema, model.parameters()):
                e.mul_(0.999).add_(p, alpha=0.001)
        return loss.item()

    flops = count_flops(lambda: step(model))  # one step on the eager model (it also warms up)
    t0 = time.perf_counter()
    for _ in range(max(a.warmup, 2 if a.compile else 0)):  # compiled: the forward and backward graphs
        step()
    compile_s = time.perf_counter() - t0 if a.compile else 0.0
    if a.trace:  # as ddm_bench's DDM_BENCH_TRACE: 3 steps, for bench/op_profile.py
        with torch.profiler.profile(activities=profiled(a)) as prof:
            for _ in range(3):
                step()
        prof.export_chrome_trace(a.trace)
        if dev.type == "cuda":  # where the GPU's time goes, by kernel-launching op, to stderr
            print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=30), file=sys.stderr)
    times = []  # median step time, as ddm_bench reports: robust to bursts from other processes
    for _ in range(a.steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    dt = sorted(times)[len(times) // 2]
    print(json.dumps({"impl": "python-compile" if a.compile else "python", "preset": a.preset, "batch": a.batch, "threads": a.threads,
                      **({"compile_mode": a.mode} if a.compile else {}),
                      "params": sum(p.numel() for p in model.parameters()), "step_s": dt,
                      "img_per_s": a.batch / dt, "compile_s": compile_s, **speed(a, flops, dt)}))


def profiled(a):
    acts = [torch.profiler.ProfilerActivity.CPU]
    return acts + [torch.profiler.ProfilerActivity.CUDA] if a.dev.type == "cuda" else acts


def count_flops(fn):
    """The FLOPs of one call of fn (matrix products, convolutions and attention, as counted by
    torch.utils.flop_counter: the "model FLOPs" of MFU)."""
    from torch.utils.flop_counter import FlopCounterMode
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def speed(a, flops, seconds):
    peak = a.peak
    if peak is None and a.dev.type == "cuda":
        name = torch.cuda.get_device_name(a.dev)
        peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)
    tflops = flops / seconds / 1e12
    return {"device": torch.cuda.get_device_name(a.dev) if a.dev.type == "cuda" else "cpu", "precision": a.precision,
            "flops": flops, "tflops": tflops, "mfu": tflops / peak if peak else None}


def sample(a, model):
    model.eval()
    run = torch.compile(model, mode=a.mode) if a.compile else model
    y = torch.arange(a.batch, device=a.dev) % a.classes

    @torch.inference_mode()
    def generate(net=None):
        x = torch.randn(a.batch, *a.shape, device=a.dev)
        for i in range(a.sample):  # Euler on the flow-matching ODE, t from 1 (noise) to 0 (data)
            t, t_next = 1 - i / a.sample, 1 - (i + 1) / a.sample
            with a.autocast():
                v = (net or run)(x, torch.full((a.batch,), t, device=a.dev), y).float()
            x = x + (t_next - t) * v
        a.sync()
        return x

    flops = count_flops(lambda: generate(model))

    t0 = time.perf_counter()
    for _ in range(max(a.warmup, 1 if a.compile else 0)):
        generate()
    compile_s = time.perf_counter() - t0 if a.compile else 0.0
    best = float("inf")
    for _ in range(a.steps):
        t0 = time.perf_counter()
        generate()
        best = min(best, time.perf_counter() - t0)
    if a.trace:  # one sampling run, as ddm_bench sample's DDM_BENCH_TRACE
        with torch.profiler.profile(activities=profiled(a)) as prof:
            generate()
        prof.export_chrome_trace(a.trace)
    print(json.dumps({"impl": "python-compile" if a.compile else "python", "mode": "sample", "preset": a.preset,
                      **({"compile_mode": a.mode} if a.compile else {}),
                      "batch": a.batch, "threads": a.threads, "nfe": a.sample, "seconds": best,
                      "img_per_s": a.batch / best, "compile_s": compile_s, **speed(a, flops, best)}))


if __name__ == "__main__":
    main()
