"""The same models and training step as ddm, written in plain PyTorch as a PyTorch 2.x user writes
them: the baseline that bench/compare_python.sh measures ddm against (the torch 2.11 of
scripts/setup.sh's virtual environment, the same LibTorch ddm is built on; same thread count, same
batch). Mirrors src/model/{layers,unet,dit}.cpp and src/train/step.cpp: flow matching, attention
through F.scaled_dot_product_attention, AdamW (torch.optim's default implementation), gradient
clipping, EMA. With --compile the model runs under torch.compile (inductor), and the time of the
warm-up steps, which include compiling, is reported as compile_s.

With --text T:D the preset attends to T text token states of width D instead of class labels, as
`ddm_bench --text T:D` builds it (model.text_dim): PixArt-alpha's cross-attention after each DiT
block's self-attention, Stable Diffusion's spatial transformer at a U-Net's attention levels, with
caption dropout 0.1 in training (the empty prompt's states instead). No text encoder runs: the states
are given (random, fixed), each sample attending to its first min(T, 8 + 13 i mod 24) tokens.

With --sample NFE it measures sampling instead, as `ddm_bench sample` does: --batch images from
noise in one batch with the Euler sampler of flow matching (NFE steps from t = 1 to 0, no guidance),
under torch.inference_mode(); the best of --steps timed runs after --warmup untimed ones.

On a GPU (--device cuda) with --precision bf16 the forward and the loss run under bfloat16
autocast (fp32 weights, gradients, AdamW state and EMA); the step's FLOPs are counted once by
torch.utils.flop_counter and reported with the achieved TFLOP/s and the MFU against the card's dense
bf16 peak (--peak TFLOPS, or known from the card's name).

With --check FILE (`ddm_bench forward PRESET --out FILE`'s weights, inputs and output) it loads ddm's
random weights into this model under ddm's parameter names, runs the same forward in float32 and
exits non-zero unless it gives ddm's output within float32 rounding: the model measured here is
ddm's (tests/integration/test_bench_reference.cpp; the safetensors package of the reference
environment reads the file).

usage: python bench/reference.py PRESET --batch 128 --threads 2 --steps 20 --warmup 3 [--compile] [--text T:D]
         [--compile-mode default|reduce-overhead|max-autotune] [--sample NFE] [--trace FILE] [--device cpu|cuda] [--precision fp32|bf16] [--peak TFLOPS]
prints one JSON line: {"impl": "python" | "python-compile", "compile_mode" (compiled), "preset", "batch", "threads", "step_s",
"img_per_s", "compile_s", "device", "precision", "tflops", "mfu"} (with --sample: "mode": "sample", "nfe", "seconds" per batch)
"""
import argparse
import json
import math
import re
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


class CrossAttention(nn.Module):
    """x [B, N, dim] attends to the text states ctx [B, T, cdim] where mask [B, 1, 1, T] is True."""
    def __init__(self, dim, cdim, heads):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v = nn.Linear(dim, dim, bias=False), nn.Linear(cdim, dim, bias=False), nn.Linear(cdim, dim, bias=False)
        self.out = nn.Linear(dim, dim)
        nn.init.zeros_(self.out.weight), nn.init.zeros_(self.out.bias)

    def forward(self, x, ctx, mask):
        B, N, W = x.shape
        T, d = ctx.shape[1], W // self.heads
        q = self.q(x).view(B, N, self.heads, d).transpose(1, 2)
        k = self.k(ctx).view(B, T, self.heads, d).transpose(1, 2)
        v = self.v(ctx).view(B, T, self.heads, d).transpose(1, 2)
        return self.out(F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(B, N, W))


class SpatialTransformer(nn.Module):
    """Stable Diffusion's transformer block on a U-Net's features: self-attention, cross-attention on
    the text, a GEGLU feed-forward, between linear projections in and out."""
    def __init__(self, ch, cdim, heads, groups):
        super().__init__()
        self.heads = heads
        self.norm, self.proj_in = nn.GroupNorm(groups, ch, eps=1e-6), nn.Linear(ch, ch)
        self.ln1, self.qkv, self.attn_out = nn.LayerNorm(ch), nn.Linear(ch, 3 * ch, bias=False), nn.Linear(ch, ch)
        self.ln2, self.cross = nn.LayerNorm(ch), CrossAttention(ch, cdim, heads)
        self.ln3, self.ff_in, self.ff_out = nn.LayerNorm(ch), nn.Linear(ch, 8 * ch), nn.Linear(4 * ch, ch)
        self.proj_out = nn.Linear(ch, ch)
        nn.init.zeros_(self.proj_out.weight), nn.init.zeros_(self.proj_out.bias)

    def forward(self, x, ctx, mask):
        B, C, H, W = x.shape
        h = self.proj_in(self.norm(x).flatten(2).transpose(1, 2))
        q, k, v = self.qkv(self.ln1(h)).view(B, H * W, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        h = h + self.attn_out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, H * W, C))
        h = h + self.cross(self.ln2(h), ctx, mask)
        a, g = self.ff_in(self.ln3(h)).chunk(2, -1)
        h = h + self.ff_out(a * F.gelu(g))
        return x + self.proj_out(h).transpose(1, 2).reshape(B, C, H, W)


class Stage(nn.Module):
    def __init__(self, cin, cout, emb, cfg, level):
        super().__init__()
        self.res = ResBlock(cin, cout, emb, cfg["groups"])
        self.attn = None
        if level in cfg["attn_levels"]:
            text = cfg.get("text_dim", 0)
            self.attn = (SpatialTransformer(cout, text, cfg["heads"], cfg["groups"]) if text
                         else AttentionBlock(cout, cfg["heads"], cfg["groups"]))

    def forward(self, h, e, ctx=None, mask=None):
        h = self.res(h, e)
        if self.attn is None:
            return h
        return self.attn(h, ctx, mask) if ctx is not None else self.attn(h)


class UNet(nn.Module):
    def __init__(self, cfg, cin=1, classes=10):
        super().__init__()
        L, ch = len(cfg["channel_mult"]), [cfg["channels"] * m for m in cfg["channel_mult"]]
        emb = 4 * cfg["channels"]
        self.time = TimeEmbedder(cfg["channels"], emb)
        self.label = nn.Embedding(classes + 1, emb) if classes else None  # a text model: none
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

    def forward(self, x, t, y, ctx=None, mask=None):
        e = F.silu(self.time(t) + self.label(y) if self.label is not None else self.time(t))
        h, skips = self.in_conv(x), []
        for stages, down in zip(self.enc, self.down):
            for s in stages:
                h = s(h, e, ctx, mask)
                skips.append(h)
            h = down(h)
        for s in self.mid:
            h = s(h, e, ctx, mask)
        for up, stages in zip(self.up, self.dec):
            h = up(F.interpolate(h, scale_factor=2, mode="nearest"))
            for s in stages:
                h = s(torch.cat([h, skips.pop()], 1), e, ctx, mask)
        return self.out_conv(F.silu(self.out_norm(h)))


class DiTBlock(nn.Module):
    def __init__(self, w, heads, ratio, text_dim=0):
        super().__init__()
        self.cross = CrossAttention(w, text_dim, heads) if text_dim else None  # PixArt-alpha's
        self.heads, hidden = heads, round(w * ratio)
        self.norm1 = nn.LayerNorm(w, elementwise_affine=False, eps=1e-6)
        self.qkv, self.proj = nn.Linear(w, 3 * w), nn.Linear(w, w)
        self.norm2 = nn.LayerNorm(w, elementwise_affine=False, eps=1e-6)
        self.fc1, self.fc2 = nn.Linear(w, hidden), nn.Linear(hidden, w)
        self.ada = nn.Linear(w, 6 * w)
        nn.init.zeros_(self.ada.weight), nn.init.zeros_(self.ada.bias)

    def forward(self, x, c, ctx=None, mask=None):
        B, N, W = x.shape
        m = self.ada(c)[:, None].chunk(6, -1)
        h = torch.addcmul(m[0], self.norm1(x), m[1] + 1.0)
        q, k, v = self.qkv(h).view(B, N, 3, self.heads, W // self.heads).unbind(2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        a = self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, N, W))
        out = torch.addcmul(x, m[2], a)
        if self.cross is not None:
            out = out + self.cross(out, ctx, mask)
        h = torch.addcmul(m[3], self.norm2(out), m[4] + 1.0)
        return torch.addcmul(out, m[5], self.fc2(F.gelu(self.fc1(h))))


class DiT(nn.Module):
    def __init__(self, cfg, cin=1, size=28, classes=10):
        super().__init__()
        p, w = cfg["patch"], cfg["width"]
        self.p, self.cin, self.size = p, cin, size
        self.patch_embed = nn.Linear(cin * p * p, w)
        self.register_buffer("pos", pos_embed_2d(w, size // p)[None])
        self.time = TimeEmbedder(256, w)
        self.label = nn.Embedding(classes + 1, w) if classes else None  # a text model: none
        self.blocks = nn.ModuleList([DiTBlock(w, cfg["heads"], cfg["mlp_ratio"], cfg.get("text_dim", 0))
                                     for _ in range(cfg["depth"])])
        self.final_norm = nn.LayerNorm(w, elementwise_affine=False, eps=1e-6)
        self.final_ada, self.final_linear = nn.Linear(w, 2 * w), nn.Linear(w, p * p * cin)
        for lin in (self.final_ada, self.final_linear):
            nn.init.zeros_(lin.weight), nn.init.zeros_(lin.bias)

    def forward(self, x, t, y, ctx=None, mask=None):
        B, C, S, p = x.shape[0], self.cin, self.size, self.p
        tok = x.reshape(B, C, S // p, p, S // p, p).permute(0, 2, 4, 1, 3, 5).reshape(B, -1, C * p * p)
        h = self.patch_embed(tok) + self.pos
        c = F.silu(self.time(t) + self.label(y) if self.label is not None else self.time(t))
        for b in self.blocks:
            h = b(h, c, ctx, mask)
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
    ap.add_argument("--text", metavar="T:D", help="a text model: attend to T token states of width D instead of class labels")
    ap.add_argument("--check", metavar="FILE", help="compare a forward with ddm's (ddm_bench forward's file) and exit")
    a = ap.parse_args()
    a.compile = a.compile or a.compile_mode is not None
    a.mode = a.compile_mode or "default"
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    cfg = dict(PRESETS[a.preset])
    cin, size, classes = cfg.get("cin", 1), cfg.get("size", 28), cfg.get("classes", 10)
    text, a.name, a.text = a.text, a.preset, None
    if text:
        tokens, dim = (int(v) for v in text.split(":"))
        if cfg["arch"] == "unet" and not cfg["attn_levels"]:
            sys.exit(f"--text: {a.preset} has no attention level to attend to the text from")
        cfg["text_dim"], classes = dim, 0
        a.name, a.text = f"{a.preset}+text{tokens}x{dim}", (tokens, dim)
    model = UNet(cfg, cin, classes) if cfg["arch"] == "unet" else DiT(cfg, cin, size, classes)
    dev = torch.device(a.device)
    model.to(dev)
    a.shape, a.classes, a.dev = (cin, size, size), classes, dev
    a.autocast = lambda: torch.autocast(dev.type, dtype=torch.bfloat16, enabled=a.precision == "bf16")
    a.sync = (lambda: torch.cuda.synchronize()) if dev.type == "cuda" else (lambda: None)
    a.ctx = a.mask = None
    if a.text:  # each sample's token states and mask, and the empty prompt's (ddm_bench's bench_text_cond)
        a.ctx, a.mask = text_states(a.batch, *a.text, dev, null=False)
        a.null_ctx, a.null_mask = text_states(1, *a.text, dev, null=True)
    if a.check:
        return check(a, model, cfg)
    if a.sample:
        return sample(a, model)
    ema = [p.detach().clone() for p in model.parameters()]
    run = torch.compile(model, mode=a.mode) if a.compile else model
    opt = torch.optim.AdamW(model.parameters(), lr=2e-4, weight_decay=0.0)
    x0 = torch.rand(a.batch, *a.shape, device=dev) * 2 - 1
    y0 = torch.randint(0, max(a.classes, 1), (a.batch,), device=dev)

    def step(net=None):
        eps = torch.randn_like(x0)
        t = torch.rand(a.batch, device=dev)
        ctx = mask = None
        if a.text:  # caption dropout: the empty prompt's states instead
            drop = torch.rand(a.batch, device=dev) < 0.1
            ctx = torch.where(drop[:, None, None], a.null_ctx, a.ctx)
            mask = torch.where(drop[:, None, None, None], a.null_mask, a.mask)
            y = y0
        else:
            y = torch.where(torch.rand(a.batch, device=dev) < 0.1, torch.full_like(y0, a.classes), y0)
        xt = (1 - t)[:, None, None, None] * x0 + t[:, None, None, None] * eps
        with a.autocast():
            loss = F.mse_loss((net or run)(xt, t, y, ctx, mask).float(), eps - x0)
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
    print(json.dumps({"impl": "python-compile" if a.compile else "python", "preset": a.name, "batch": a.batch, "threads": a.threads,
                      **({"compile_mode": a.mode} if a.compile else {}),
                      "params": sum(p.numel() for p in model.parameters()), "step_s": dt,
                      "img_per_s": a.batch / dt, "compile_s": compile_s, **speed(a, flops, dt)}))


def ddm_name(model, cfg, name):
    """The name ddm gives this model's parameter `name` (its modules' registered names)."""
    attn = "xattn" if cfg.get("text_dim") else "attn"
    rules = [(r"label\.weight", "label.table.weight"), (r"blocks\.(\d+)\.", r"block\1."),
             (r"final_ada\.", "final.ada."), (r"final_linear\.", "final.linear."),
             (r"(enc)\.(\d+)\.(\d+)\.res\.", r"enc\2_\3."), (r"enc\.(\d+)\.(\d+)\.attn\.", rf"enc\1_\2_{attn}."),
             (r"down\.(\d+)\.", r"down\1."), (r"mid\.(\d+)\.res\.", r"mid_\1."), (r"mid\.(\d+)\.attn\.", rf"mid_\1_{attn}.")]
    for pattern, repl in rules:
        if re.match(pattern, name):
            return re.sub("^" + pattern, repl, name)
    m = re.match(r"(up|dec)\.(\d+)\.(?:(\d+)\.(res|attn)\.)?(.*)", name)
    if m:  # this model keeps the decoder's levels from the deepest up, ddm by level
        level = len(model.up) - 1 - int(m[2])
        if m[1] == "up":
            return f"up{level}.{m[5]}"
        return f"dec{level}_{m[3]}" + ("." if m[4] == "res" else f"_{attn}.") + m[5]
    return name


def check(a, model, cfg):
    from safetensors.torch import load_file
    f = load_file(a.check)
    params = dict(model.named_parameters())
    names = {ddm_name(model, cfg, n): n for n in params}
    theirs = {k[len("param/"):] for k in f if k.startswith("param/")}
    if set(names) != theirs:
        sys.exit(f"--check {a.check}: the parameters differ: only here {sorted(set(names) - theirs)}, "
                 f"only in ddm's {sorted(theirs - set(names))}")
    with torch.no_grad():
        for d, n in names.items():
            if params[n].shape != f["param/" + d].shape:
                sys.exit(f"--check: {n} is {tuple(params[n].shape)} here, ddm's {d} {tuple(f['param/' + d].shape)}")
            params[n].copy_(f["param/" + d])
        mask = (f["mask"] != 0)[:, None, None] if "mask" in f else None
        out = model.eval()(f["x"], f["t"], f["y"], f.get("context"), mask)
    ref = f["out"]
    err = ((out - ref).abs().max() / ref.abs().max()).item()
    print(json.dumps({"impl": "python", "mode": "check", "preset": a.name, "params": sum(p.numel() for p in params.values()),
                      "max_abs_out": ref.abs().max().item(), "rel_err": err}))
    if not err <= 1e-5:  # float32 rounding through the net (different kernels, different orders)
        sys.exit(f"--check: {a.name}'s forward differs from ddm's by {err:.3g} of its largest value")


def text_states(n, tokens, dim, dev, null):
    """n samples' text states [n, T, D] (standard normal, seeded) and masks bool [n, 1, 1, T]: sample i
    attends to its first min(T, 8 + 13 i mod 24) tokens; null: the empty prompt's, its first 2."""
    g = torch.Generator().manual_seed(2 if null else 1)
    ctx = torch.randn(n, tokens, dim, generator=g)
    length = torch.full((n, 1), 2) if null else (8 + (13 * torch.arange(n)) % 24).clamp(max=tokens)[:, None]
    mask = torch.arange(tokens)[None] < length
    return ctx.to(dev), mask[:, None, None].to(dev)


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
    y = torch.arange(a.batch, device=a.dev) % max(a.classes, 1)

    @torch.inference_mode()
    def generate(net=None):
        x = torch.randn(a.batch, *a.shape, device=a.dev)
        for i in range(a.sample):  # Euler on the flow-matching ODE, t from 1 (noise) to 0 (data)
            t, t_next = 1 - i / a.sample, 1 - (i + 1) / a.sample
            with a.autocast():
                v = (net or run)(x, torch.full((a.batch,), t, device=a.dev), y, a.ctx, a.mask).float()
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
    print(json.dumps({"impl": "python-compile" if a.compile else "python", "mode": "sample", "preset": a.name,
                      **({"compile_mode": a.mode} if a.compile else {}),
                      "batch": a.batch, "threads": a.threads, "nfe": a.sample, "seconds": best,
                      "img_per_s": a.batch / best, "compile_s": compile_s, **speed(a, flops, best)}))


if __name__ == "__main__":
    main()
