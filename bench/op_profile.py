#!/usr/bin/env python3
"""Where a training step's time goes, per op, side by side: reads Chrome-format traces (ddm_bench's
DDM_BENCH_TRACE, LibTorch's profiler; reference.py --trace, PyTorch's) and prints each op's self
time (its duration less that of the ops it called) per step, summed over threads.

With --gpu it sums the GPU's kernels instead (events of category "kernel", by kernel name): what
the device spent its time on, from Kineto traces (ddm_bench train --device cuda, reference.py --device
cuda --trace); then the kernels launched per step and the share of the GPU's span (first kernel to
last) in which no kernel ran: time the GPU waited for the host. With --by-op as well, each kernel's
time goes to the CPU op that launched it (the innermost op around its launch on the launching thread,
found through the launch's correlation id), as "op: kernel": which op of a program a kernel is.

usage: bench/op_profile.py [--steps N] [--top K] [--gpu [--by-op]] NAME=TRACE.json [NAME=TRACE.json ...]
       (each trace holds N steps, 3 by default: ddm_bench and reference.py record 3)
"""
import argparse
import collections
import json


def load_trace(path):
    """(events, kineto): a Chrome trace's events, and whether it is a dict with categories (Kineto's
    and torch.profiler's) rather than a bare list (LibTorch's legacy profiler)."""
    with open(path) as f:
        data = json.load(f)
    return (data["traceEvents"], True) if isinstance(data, dict) else (data, False)


def self_times(path):
    """{op name: total self time in ms} over every CPU op event of a trace."""
    events, kineto = load_trace(path)
    by_thread = collections.defaultdict(list)
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        if kineto and e.get("cat") not in ("cpu_op", "user_annotation", None):
            continue  # PyTorch's traces also hold Python-function and runtime events
        if e.get("cat") == "user_annotation" or e["name"].startswith("ProfilerStep"):
            continue
        by_thread[(e.get("pid"), e.get("tid"))].append((float(e["ts"]), float(e["dur"]), e["name"]))
    out = collections.defaultdict(float)
    for evs in by_thread.values():
        evs.sort(key=lambda x: (x[0], -x[1]))  # parents before their children
        stack = []  # [end, name, child time]
        def close(until):
            while stack and stack[-1][0] <= until:
                end, name, dur, child = stack.pop()
                out[name] += dur - child
                if stack:
                    stack[-1][3] += dur
        for ts, dur, name in evs:
            close(ts)
            stack.append([ts + dur, name, dur, 0.0])
        close(float("inf"))
    return {k: v / 1000.0 for k, v in out.items()}


def launching_ops(events):
    """{correlation id: the name of the innermost CPU op around the runtime call (a kernel's launch)
    with that id}, by a sweep over each thread's ops and runtime calls in time order."""
    by_thread = collections.defaultdict(list)
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        if e.get("cat") == "cpu_op":
            by_thread[(e.get("pid"), e.get("tid"))].append((float(e["ts"]), 0, -float(e["dur"]), e["name"]))
        elif e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {}):
            by_thread[(e.get("pid"), e.get("tid"))].append((float(e["ts"]), 1, 0.0, e["args"]["correlation"]))
    out = {}
    for evs in by_thread.values():
        evs.sort()  # by start; an op before a call that starts with it, an outer op before its inner ones
        stack = []  # [(end, name)] of the ops open at the sweep's time
        for ts, kind, neg_dur, what in evs:
            while stack and stack[-1][0] <= ts:
                stack.pop()
            if kind == 0:
                stack.append((ts - neg_dur, what))
            else:
                out[what] = stack[-1][1] if stack else "(no op)"
    return out


def kernel_times(path, by_op=False):
    """{kernel name: total GPU time in ms} over every kernel event of a trace; by_op: keyed by
    "launching op: kernel name" instead."""
    events, _ = load_trace(path)
    ops = launching_ops(events) if by_op else {}
    out = collections.defaultdict(float)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "kernel" and "dur" in e:
            if by_op:
                op = ops.get(e.get("args", {}).get("correlation"), "(no op)")
                out[f"{op}: {e['name'][:60]}"] += float(e["dur"])
            else:
                out[e["name"][:90]] += float(e["dur"])
    return {k: v / 1000.0 for k, v in out.items()}


def kernel_span(path):
    """(kernels, span ms, busy ms): how many kernels a trace holds, the time from the first one's start
    to the last one's end, and the part of it some kernel was running (the union of their intervals):
    span less busy is the GPU waiting for the host (launches, synchronizations, host work)."""
    events, _ = load_trace(path)
    ivs = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events
                 if e.get("ph") == "X" and e.get("cat") == "kernel" and "dur" in e)
    if not ivs:
        return 0, 0.0, 0.0
    busy, (lo, hi) = 0.0, ivs[0]
    for a, b in ivs[1:]:
        if a > hi:
            busy, lo, hi = busy + hi - lo, a, b
        else:
            hi = max(hi, b)
    busy += hi - lo
    return len(ivs), (max(b for _, b in ivs) - ivs[0][0]) / 1000.0, busy / 1000.0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="+", help="NAME=TRACE.json")
    ap.add_argument("--steps", type=int, default=3, help="steps each trace holds")
    ap.add_argument("--top", type=int, default=25, help="ops shown (by the largest time in any trace)")
    ap.add_argument("--gpu", action="store_true", help="sum the GPU's kernels, not the CPU's ops")
    ap.add_argument("--by-op", action="store_true", help="with --gpu: key each kernel by the op that launched it")
    a = ap.parse_args()
    if a.by_op and not a.gpu:
        ap.error("--by-op goes with --gpu")
    names, tables = [], []
    for t in a.traces:
        name, _, path = t.partition("=")
        if not path:
            ap.error(f"'{t}': expected NAME=TRACE.json")
        names.append(name)
        times = kernel_times(path, a.by_op) if a.gpu else self_times(path)
        tables.append({k: v / a.steps for k, v in times.items()})
    ops = sorted({k for t in tables for k in t}, key=lambda k: -max(t.get(k, 0.0) for t in tables))
    what = ("launching op: kernel (GPU time" if a.by_op else "kernel (GPU time") if a.gpu else "op (self time"
    print(f"| {what}, ms per step) | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for k in ops[: a.top]:
        print(f"| {k} | " + " | ".join(f"{t.get(k, 0.0):.1f}" for t in tables) + " |")
    rest = [sum(v for kk, v in t.items() if kk not in ops[: a.top]) for t in tables]
    print("| (all other ops) | " + " | ".join(f"{r:.1f}" for r in rest) + " |")
    total = "sum of kernel times" if a.gpu else "sum of op self times"
    print(f"| **{total}** | " + " | ".join(f"**{sum(t.values()):.1f}**" for t in tables) + " |")
    if a.gpu:  # per step: launches, and how much of the GPU's span it sat idle
        spans = [kernel_span(t.partition("=")[2]) for t in a.traces]
        print("| kernels launched | " + " | ".join(f"{n / a.steps:.0f}" for n, _, _ in spans) + " |")
        print("| GPU span, first kernel to last (ms) | " + " | ".join(f"{sp / a.steps:.1f}" for _, sp, _ in spans) + " |")
        print("| of it idle (no kernel running) | " +
              " | ".join(f"{100 * (1 - b / sp):.1f}%" if sp else "-" for _, sp, b in spans) + " |")


if __name__ == "__main__":
    main()
