#!/usr/bin/python3
"""Reads the JSON lines bench/run.sh collected (each tagged with "case" and "repeat"),
from one or more result files (pooled),
and prints the summary tables: K=1 vs K=2 speedup per checkpoint mode, measured vs
ideal bubble, the runtime's cost per instruction, and gpipe against PyTorch's Pipe.
Every figure is the median over repeats of each run's median step time; ranges are
the smallest and largest of the repeats."""
import json
import statistics
import sys
from collections import defaultdict


def load(paths):
    """Pools the runs of several result files; repeat r of file i becomes repeat 1000 i + r."""
    runs = defaultdict(list)
    for i, path in enumerate(paths):
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line.startswith("{"):
                    j = json.loads(line)
                    j["repeat"] += 1000 * i
                    runs[j["case"]].append(j)
    return runs


def vals(runs, case, key="step_ms"):
    return [r[key] for r in runs.get(case, []) if r.get(key) is not None]


def med(runs, case, key="step_ms"):
    v = vals(runs, case, key)
    return statistics.median(v) if v else None


def rng(v, spec=".0f"):
    return f"{min(v):{spec}}-{max(v):{spec}}" if v else "-"


def fmt(v, spec=".1f"):
    return "-" if v is None else format(v, spec)


def by_repeat(runs, case):
    return {r["repeat"]: r for r in runs.get(case, [])}


def pair_slowdowns(runs):
    s1, p0, p1 = by_repeat(runs, "speed_k1_never"), by_repeat(runs, "pair_k1_core0"), by_repeat(runs, "pair_k1_core1")
    return [100 * (statistics.mean([p0[r]["step_ms"], p1[r]["step_ms"]]) / s1[r]["step_ms"] - 1)
            for r in s1 if r in p0 and r in p1]


def speedup_section(runs):
    print("1. MLP 16 x Linear(1024)+ReLU + Linear(1024->10), batch 256, M=8, float32, 1 BLAS thread per stage")
    print("   speedup = median K=1 / median K=2; 'per repeat' = the K=1/K=2 ratios of each repeat's pair of runs")
    print(f"   {'checkpoint':<12} {'K=1 ms':>7} {'(range)':>9} {'K=2 ms':>7} {'(range)':>9} {'speedup':>7} "
          f"{'per repeat: median (range)':>26} {'>=1.6':>6} {'ideal':>5}  target>=1.6")
    for mode in ("never", "except_last", "always"):
        c1, c2 = f"speed_k1_{mode}", f"speed_k2_{mode}"
        k1, k2 = med(runs, c1), med(runs, c2)
        if k1 is None or k2 is None:
            continue
        r1, r2 = by_repeat(runs, c1), by_repeat(runs, c2)
        per = [r1[r]["step_ms"] / r2[r]["step_ms"] for r in r1 if r in r2]
        sp = k1 / k2
        per_txt = f"{statistics.median(per):.2f} ({rng(per, '.2f')})" if per else "-"
        hits = f"{sum(p >= 1.6 for p in per)}/{len(per)}"
        print(f"   {mode:<12} {k1:7.1f} {rng(vals(runs, c1)):>9} {k2:7.1f} {rng(vals(runs, c2)):>9} {sp:7.2f} "
              f"{per_txt:>26} {hits:>6} {2 * 8 / 9:5.2f}  {'met' if sp >= 1.6 else 'MISSED'}")
    solo = med(runs, "speed_k1_never")
    pair = vals(runs, "pair_k1_core0") + vals(runs, "pair_k1_core1")
    if solo is not None and pair:
        p = statistics.median(pair)
        print(f"   machine check: K=1 alone {solo:.1f} ms; two K=1 runs at once, one per core, {p:.1f} ms each "
              f"({100 * (p / solo - 1):+.1f}%; per repeat {rng(pair_slowdowns(runs), '+.0f')}%)")
        print("   speedup / (ideal x K=1 alone / K=1 in a pair), per repeat: how close K=2 came to what both cores")
        print("   could deliver at the time:")
        s1, p0, p1 = by_repeat(runs, "speed_k1_never"), by_repeat(runs, "pair_k1_core0"), by_repeat(runs, "pair_k1_core1")
        for mode in ("never", "except_last", "always"):
            k1, k2 = by_repeat(runs, f"speed_k1_{mode}"), by_repeat(runs, f"speed_k2_{mode}")
            eff = []
            for r in k1:
                if r in k2 and r in s1 and r in p0 and r in p1:
                    bound = (2 * 8 / 9) * s1[r]["step_ms"] / statistics.mean([p0[r]["step_ms"], p1[r]["step_ms"]])
                    eff.append(k1[r]["step_ms"] / k2[r]["step_ms"] / bound)
            if eff:
                print(f"     {mode:<12} median {statistics.median(eff):.2f} (range {rng(eff, '.2f')})")
    m1 = med(runs, "speed_k1_m1")
    if m1 is not None and solo is not None:
        print(f"   K=1 without micro-batches (M=1): {m1:.1f} ms; M=8 costs {100 * (solo / m1 - 1):+.0f}% on one core "
              f"(32-row GEMMs are less efficient than 256-row ones)")


def bubble_section(runs):
    print("\n2. Bubble, K=2 (ReportBuilder's measured_bubble vs ideal_bubble = (K-1)/(M+K-1)). Diagnostic columns:")
    print("   'prologue' = the stages' mean time from the step's start to their first instruction (waking up,")
    print("   clearing their gradients), which ReportBuilder counts as idle; 'w/o prologue' = the bubble without it")
    print(f"   {'M':>3} {'model':<18} {'checkpoint':<12} {'measured':>8} {'ideal':>6} {'rel diff':>8} {'(range)':>11}  "
          f"{'<=15%':<6} {'prologue ms':>11} {'w/o prologue':>12}")
    rows = ((4, "spec", "never", "bubble_m4"), (8, "spec", "never", "speed_k2_never"),
            (16, "spec", "never", "bubble_m16"), (8, "spec", "except_last", "speed_k2_except_last"),
            (8, "spec", "always", "speed_k2_always"), (8, "lead ReLU", "never", "bubble_lead_relu_m8"),
            (16, "lead ReLU", "never", "bubble_lead_relu_m16"))
    for m, model, mode, case in rows:
        meas, ideal = med(runs, case, "measured_bubble"), med(runs, case, "ideal_bubble")
        if meas is None:
            continue
        rel = (meas - ideal) / ideal
        rels = [100 * (r["measured_bubble"] - r["ideal_bubble"]) / r["ideal_bubble"] for r in runs[case]]
        adj = []
        for r in runs[case]:
            pro = statistics.mean(st["prologue_ms"] for st in r["stages"])
            busy = sum(st["busy_ms"] for st in r["stages"])
            adj.append((pro, 1 - busy / (r["k"] * (r["span_ms_mean"] - pro))))
        pro, b = statistics.median(a[0] for a in adj), statistics.median(a[1] for a in adj)
        print(f"   {m:3d} {model:<18} {mode:<12} {meas:8.3f} {ideal:6.3f} {100 * rel:7.1f}% {rng(rels, '.0f') + '%':>11}  "
              f"{'met' if abs(rel) <= 0.15 else 'MISSED':<6} {pro:11.2f} {b:12.3f}")


def overhead_section(runs):
    print("\n3. Runtime cost per instruction: 16 x Linear(64)+ReLU + Linear(64->10), batch 64, checkpoint never")
    print("   us/instr = (executor step - ideal time of the same work done directly on one thread, stage k's")
    print("   part on core k, replayed through the schedule with free communication) / instructions per stage")
    print("   'wake-up us' = the slowest stage's time to its first instruction minus its direct gradient zeroing,")
    print("   i.e. waking the stage threads at the start of the step (included in us/instr)")
    print(f"   {'K':>2} {'M':>3} {'exec ms':>8} {'ideal ms':>8} {'instr/stage':>11} {'us/instr':>8} {'(range)':>9}  "
          f"{'<20us':<6} {'wake-up us':>10}")
    for k in (1, 2):
        for m in (8, 16):
            case = f"overhead_k{k}_m{m}"
            if case not in runs:
                continue
            us = med(runs, case, "overhead_us_per_instruction")
            n = max(runs[case][0]["instructions_per_stage"])
            wake = statistics.median(max(1000 * (st["prologue_ms"] - st["direct_zero_grad_ms"]) for st in r["stages"])
                                     for r in runs[case])
            print(f"   {k:2d} {m:3d} {fmt(med(runs, case), '.3f'):>8} {fmt(med(runs, case, 'ideal_ms'), '.3f'):>8} "
                  f"{n:11d} {us:8.1f} {rng(vals(runs, case, 'overhead_us_per_instruction'), '.1f'):>9}  "
                  f"{'met' if us < 20 else 'MISSED':<6} {wake:10.0f}")


def torch_section(runs):
    if not any(c.startswith("torch_") for c in runs):
        return
    print("\n4. gpipe vs PyTorch's GPipe (torch.distributed.pipeline.sync.Pipe), same MLP, batch 256, CPU, 1 thread")
    print(f"   {'gpipe run':<22} {'PyTorch run':<32} {'gpipe ms':>8} {'torch ms':>8} {'gpipe/torch':>11}")
    rows = [("K=1 M=8", "K=1 plain nn.Sequential", "speed_k1_never", "torch_k1"),
            ("K=1 M=1", "K=1 plain nn.Sequential", "speed_k1_m1", "torch_k1"),
            ("K=1 M=8", "K=1 Pipe, 1 partition, chunks=8", "speed_k1_never", "torch_k1_pipe"),
            ("K=2 M=8 never", "K=2 Pipe chunks=8 never", "speed_k2_never", "torch_k2_never"),
            ("K=2 M=8 except_last", "K=2 Pipe chunks=8 except_last", "speed_k2_except_last", "torch_k2_except_last"),
            ("K=2 M=8 always", "K=2 Pipe chunks=8 always", "speed_k2_always", "torch_k2_always")]
    for gl, tl, g, t in rows:
        gv, tv = med(runs, g), med(runs, t)
        if gv is None or tv is None:
            continue
        print(f"   {gl:<22} {tl:<32} {gv:8.1f} {tv:8.1f} {gv / tv:11.2f}")
    tk1 = med(runs, "torch_k1")
    for mode in ("never", "except_last", "always"):
        tv = med(runs, f"torch_k2_{mode}")
        if tk1 is not None and tv is not None:
            print(f"   PyTorch's own K=2 speedup over its plain K=1 step ({mode}): {tk1 / tv:.2f}")
    t2 = med(runs, "torch_k1_2threads")
    if t2 is not None:
        print(f"   context: PyTorch plain nn.Sequential with 2 threads (OpenMP + OpenBLAS): {t2:.1f} ms")


def main():
    if len(sys.argv) < 2:
        sys.exit("usage: summarize.py RESULTS.jsonl [MORE.jsonl ...]")
    runs = load(sys.argv[1:])
    reps = max((len(v) for v in runs.values()), default=0)
    print(f"Times in ms: median over {reps} repeat(s) of each run's median step time.")
    foreign = [(r["foreign_cores"], c) for c, rs in runs.items() if not c.startswith("pair_") for r in rs
               if "foreign_cores" in r]
    if foreign:
        f, c = max(foreign)
        print(f"Other programs used at most {f:.2f} cores during any timed run that recorded it ({c}).")
    print()
    speedup_section(runs)
    bubble_section(runs)
    overhead_section(runs)
    torch_section(runs)


if __name__ == "__main__":
    main()
