#!/usr/bin/python3
"""The slow-links experiment's table and plot from two invocations of bench/slow_links.sh.

A full budget at every link rate takes many hours here (data parallel alone needs about 49 minutes
for the quickstart's 1217 steps at 10 Mbit/s), so the experiment is two invocations:
  FULL   the whole budget on the unlimited link, every mode, with EVAL=1: the quality of every mode,
         the bytes each sends for the budget, and the measured time to finish it;
  SHORT  a short budget (e.g. 200 steps) at every link rate, the communicating modes and the
         independent reference: the speed of each mode at each rate.
A mode's weights, quality and bytes do not depend on the link (the schedule counts steps, not
seconds; slow_links.sh shows it with a hash of the weights), so only time needs the rate. The time
to finish the full budget B at a rate is the FULL measurement plus what the link adds, measured side
by side in the SHORT invocation (S steps) as the difference to the same mode on the unlimited link:
    T(rate, B) = T_full(unlimited, B) + [fixed(rate) - fixed(unlimited)] + [loop(rate) - loop(unlimited)] * B / S
where loop is the training loop's seconds and fixed the rest (process start, data loading, the
end-of-run checkpoint, which a DiLoCo run gathers over the link). The link's cost per step is
constant by construction (data parallel: one gradient all-reduce per step; DiLoCo: one all-reduce
per H steps, H dividing S), so scaling it by B / S is exact up to noise; the compute comes from the
whole-budget measurement. SHORT must include the unlimited link. Decentralized islands send no
bytes: their FULL time stands for every rate.

usage: bench/slow_links_report.py FULL_DIR SHORT_DIR OUT_DIR
writes OUT_DIR/slow_links.md (the table) and OUT_DIR/slow_links.png (gnuplot); needs gnuplot.
"""
import json, os, statistics as st, subprocess, sys

if len(sys.argv) != 4:
    sys.exit(__doc__)
full_dir, short_dir, out = sys.argv[1:]
os.makedirs(out, exist_ok=True)


def load(d):
    path = os.path.join(d, "results.jsonl")
    if not os.path.exists(path):
        sys.exit("slow_links_report.py: %s not found: run bench/slow_links.sh %s first" % (path, d))
    rows = [json.loads(l) for l in open(path)]
    return [r for r in rows if r["rc"] == 0]


def quality(d, mode, h):  # the ddm eval summary of these weights, if slow_links.sh evaluated them
    ed = os.path.join(d, "eval", "%s-%s" % (mode, h))
    for f in sorted(os.listdir(ed)) if os.path.isdir(ed) else []:
        if f.endswith(".json"):
            e = json.load(open(os.path.join(ed, f)))
            if "fd_fmnist" in e:
                return e
    return None


def bps(r):
    if r == "unlimited":
        return 0
    for u, m in (("kbit", 1e3), ("mbit", 1e6), ("gbit", 1e9)):
        if r.endswith(u):
            return float(r[: -len(u)]) * m
    sys.exit("slow_links_report.py: unknown rate %r" % r)


def label(r):
    return "unlimited" if r == "unlimited" else r.replace("gbit", " Gbit/s").replace("mbit", " Mbit/s").replace("kbit", " kbit/s")


full, short = [r for r in load(full_dir) if r["rate"] == "unlimited"], load(short_dir)
if not full or not short:
    sys.exit("slow_links_report.py: no finished runs in %s" % (full_dir if not full else short_dir))
med = lambda v: st.median(v) if v else None
F = {}  # mode -> medians of the FULL runs (unlimited link)
for m in dict.fromkeys(r["mode"] for r in full):
    v = [r for r in full if r["mode"] == m]
    F[m] = {k: med([r[k] for r in v if r.get(k) is not None]) for k in ("wall_s", "loop_s", "steps", "sent_rank0", "sent_max_rank")}
    F[m]["hash"], F[m]["q"] = v[-1]["hash"], quality(full_dir, m, v[-1]["hash"])
budget = int(F[next(iter(F))]["steps"])
rates = sorted(dict.fromkeys(r["rate"] for r in short), key=lambda r: -bps(r) if bps(r) else -1e30)
S = {}  # (rate, mode) -> medians of the SHORT runs and the projection
for rate in rates:
    for m in dict.fromkeys(r["mode"] for r in short if r["rate"] == rate):
        v = [r for r in short if r["rate"] == rate and r["mode"] == m]
        s = {k: med([r[k] for r in v]) for k in ("wall_s", "loop_s", "steps", "img_per_s")}
        S[(rate, m)] = s
for (rate, m), s in S.items():  # the full measurement plus what this link adds, per step and fixed
    base = S.get(("unlimited", m))
    if base is None or m not in F:
        sys.exit("slow_links_report.py: mode %s needs a run on the unlimited link in %s and one in %s" % (m, short_dir, full_dir))
    fixed = (s["wall_s"] - s["loop_s"]) - (base["wall_s"] - base["loop_s"])
    s["T"] = F[m]["wall_s"] + fixed + (s["loop_s"] - base["loop_s"]) * budget / s["steps"]
modes = [m for m in F if m != "independent"] + (["independent"] if "independent" in F else [])


def T(rate, m):  # time to finish the full budget at this rate: (seconds, how it was obtained)
    if m == "islands":
        return F[m]["wall_s"], "measured (sends nothing)"
    if rate == "unlimited" and m in F:
        return F[m]["wall_s"], "measured"
    if (rate, m) in S:
        return S[(rate, m)]["T"], "projected"
    return None, ""


L = ["Time to finish the budget of %d steps (global batch 128) per link rate, in seconds; "
     "\"measured\" over the whole budget on the unlimited link; (p): that measurement plus the time the link "
     "added to a %d-step run of the same mode, measured side by side with one on the unlimited link and scaled "
     "to the budget (bench/slow_links_report.py). The quality and the bytes do not depend on the rate.\n" % (
         budget, int(next(iter(S.values()))["steps"])),
     "| mode | " + " | ".join(label(r) for r in rates) + " | rank 0 sent MB | most any rank sent MB | FD-fmnist | KID | precision | recall | class acc |",
     "|---|" + "---|" * len(rates) + "---|---|---|---|---|---|---|"]
for m in modes:
    cells = []
    for r in rates:
        t, how = T(r, m)
        cells.append("—" if t is None else ("%.0f" % t) + ("" if how.startswith("measured") else " (p)"))
    q = F[m]["q"]
    qc = ["—"] * 5 if q is None else ["%.3f" % q["fd_fmnist"], "%.5f" % q["kid_mean"], "%.3f" % q["precision"],
                                     "%.3f" % q["recall"], "%.3f" % q["mean_class_accuracy"] if q.get("mean_class_accuracy") is not None else "—"]
    L.append("| %s | %s | %.2f | %.2f | %s |" % (m, " | ".join(cells), F[m]["sent_rank0"] / 1e6,
                                                 (F[m]["sent_max_rank"] or 0) / 1e6, " | ".join(qc)))
L.append("\nTraining-loop throughput of the short runs, img/s (measured), and its ratio to data "
         "parallel at the same rate:\n")
L.append("| mode | " + " | ".join(label(r) for r in rates) + " |")
L.append("|---|" + "---|" * len(rates))
for m in modes:
    cells = []
    for r in rates:
        s, dp = S.get((r, m)), S.get((r, "dp"))
        cells.append("—" if s is None else "%.0f" % s["img_per_s"] + ("" if dp is None else " (%.2fx)" % (s["img_per_s"] / dp["img_per_s"])))
    L.append("| %s | %s |" % (m, " | ".join(cells)))
text = "\n".join(L) + "\n"
open(os.path.join(out, "slow_links.md"), "w").write(text)
print(text)

# The plot: time to finish against link rate, and quality against time to finish (one point per rate).
finite = [bps(r) for r in rates if bps(r)]
unl = 10 * max(finite) if finite else 1e10
x = lambda r: bps(r) or unl
dat = os.path.join(out, "slow_links.dat")
left, right = [], []
with open(dat, "w") as f:
    i = 0
    for k, m in enumerate(modes):
        pts = [(x(r), T(r, m)[0]) for r in rates if T(r, m)[0] is not None]
        if not pts:
            continue
        f.write("# %s\n" % m)
        q = F[m]["q"]
        for xr, t in sorted(pts):
            f.write("%g %g %s\n" % (xr, t, q["fd_fmnist"] if q else "nan"))
        f.write("\n\n")
        dash = "dt 2 " if m == "islands" else ""
        left.append("'%s' index %d using 1:2 with linespoints lw 2 %spt 7 lt %d title '%s'" % (dat, i, dash, k + 1, m))
        if q:
            right.append("'%s' index %d using 2:3 with linespoints lw 2 %spt 7 lt %d notitle" % (dat, i, dash, k + 1))
        i += 1
tics = ", ".join('"%s" %g' % (label(r), x(r)) for r in rates)
gp = os.path.join(out, "slow_links.gp")
with open(gp, "w") as f:
    f.write("set terminal pngcairo size 1400,560 font 'sans,10'\nset output '%s'\n" % os.path.join(out, "slow_links.png"))
    f.write("set multiplot layout 1,2\nset grid\nset key top left\n")
    f.write("set logscale xy\nset xrange [%g:%g]\nset xtics (%s)\n" % (min(finite or [unl]) / 2, 2 * unl, tics))
    f.write("set xlabel 'link rate (tbf on a veth pair; unlimited drawn at 10x the fastest)'\n")
    f.write("set ylabel 'time to finish %d steps, s'\n" % budget)
    f.write("set title 'Time to finish the same training budget (islands: no communication)'\nplot %s\n" % ", \\\n  ".join(left))
    if right:
        f.write("unset logscale y\nset xtics auto\nset autoscale x\nset xlabel 'time to finish, s (one point per link rate)'\n")
        f.write("set ylabel 'FD-fmnist, 2000 samples (lower is better)'\n")
        f.write("set title 'Quality at equal training FLOPs against time to finish (colours as on the left; a point per link rate)'\nplot %s\n" % ", \\\n  ".join(right))
    f.write("unset multiplot\n")
subprocess.run(["gnuplot", gp], check=True)
print("wrote %s and %s" % (os.path.join(out, "slow_links.md"), os.path.join(out, "slow_links.png")))
