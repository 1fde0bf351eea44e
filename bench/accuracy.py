#!/usr/bin/env python3
"""How close the planner's predictions come to what runs measure (issue 11's accuracy
table in bench/RESULTS.md).

For each config, `gpipe profile` first measures its layers at every micro-batch size
the cases use; then each case (K stages, M micro-batches, a recompute mode) trains a
few steps, and its report.json holds both the measurement and the prediction made
before the run from that profile: step time (report.json step_ms, the mean of the
timed steps, the first left out) and each stage's peak activation memory (the
executor's meter against estimate_memory). Then, per config, the measured bubble of a
run balanced by the profile (pipeline.balance_by: profile) against one balanced by
the cost model's estimates.

  bench/accuracy.py [--gpipe bazel-bin/pipeline/gpipe] [--configs mlp,default,gpt]
                    [--k 1,2] [--m 4,8,16] [--steps 8] [--out FILE.jsonl]

Prints markdown tables. Run it when the machine is quiet (uptime); each case is short.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

MODES = ["never", "except_last", "always"]


def busy_cores(seconds=0.5):
    """Cores' worth of CPU time the whole machine used over `seconds` (from /proc/stat)."""
    def snap():
        f = open("/proc/stat").readline().split()[1:]
        v = [int(x) for x in f]
        return sum(v) - v[3] - v[4], sum(v)  # busy (all but idle, iowait), total
    b0, t0 = snap()
    time.sleep(seconds)
    b1, t1 = snap()
    return (b1 - b0) / max(1, t1 - t0) * os.cpu_count()


def wait_quiet(limit, max_wait):
    """Waits up to max_wait seconds for the machine to use less than `limit` cores; returns the last reading."""
    start = time.time()
    while True:
        b = busy_cores()
        if b < limit or time.time() - start > max_wait:
            return b


def cpu_jiffies():
    v = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    return sum(v) - v[3] - v[4], sum(v)


def run(cmd, log):
    """Runs cmd; returns the cores' worth of CPU that other programs used meanwhile."""
    import resource
    b0, t0 = cpu_jiffies()
    c0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    w0 = time.time()
    with open(log, "w") as f:
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT)
    if r.returncode != 0:
        sys.stderr.write(open(log).read()[-3000:])
        raise SystemExit("accuracy.py: failed: " + " ".join(cmd))
    b1, t1 = cpu_jiffies()
    c1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    mine = (c1.ru_utime + c1.ru_stime) - (c0.ru_utime + c0.ru_stime)
    wall = max(1e-6, time.time() - w0)
    machine = (b1 - b0) / max(1, t1 - t0) * os.cpu_count()
    return max(0.0, machine - mine / wall)


def run_quietly(cmd, log, a):
    """Runs cmd until no other program used more than a.quiet cores meanwhile (at most 4 tries)."""
    foreign = 0
    for attempt in range(4):
        wait_quiet(a.quiet, a.max_wait)
        foreign = run(cmd, log)
        if foreign <= a.quiet:
            break
        sys.stderr.write("  other programs used %.2f cores during %s; again\n" % (foreign, os.path.basename(log)))
    return foreign


def steps_for(spec, name):
    if "=" not in spec:
        return int(spec)
    table = dict(item.split("=") for item in spec.split(","))
    return int(table.get(name, 8))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpipe", default="bazel-bin/pipeline/gpipe")
    ap.add_argument("--configs", default="mlp,default,gpt")
    ap.add_argument("--k", default="1,2")
    ap.add_argument("--m", default="4,8,16")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--steps", default="mlp=40,default=10,gpt=6", help="steps per run: N, or CONFIG=N,...")
    ap.add_argument("--repeats", type=int, default=10, help="profile repetitions")
    ap.add_argument("--out", default="")
    ap.add_argument("--no-balance", action="store_true")
    ap.add_argument("--balance-m", type=int, default=8, help="micro-batches of the balance comparison")
    ap.add_argument("--runs", type=int, default=2, help="runs per case; the fastest is kept (others' work only slows)")
    ap.add_argument("--quiet", type=float, default=0.3, help="wait for the machine to use fewer cores than this")
    ap.add_argument("--max-wait", type=float, default=180)
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="gpipe-accuracy.")
    out = open(a.out or os.path.join(work, "results.jsonl"), "w")
    ks = [int(x) for x in a.k.split(",")]
    ms = [int(x) for x in a.m.split(",")]
    modes = a.modes.split(",")
    rows = []
    for name in a.configs.split(","):
        config = "configs/%s.yaml" % name
        d = os.path.join(work, name)
        os.makedirs(d, exist_ok=True)
        profile = os.path.join(d, "profile.json")
        common = ["--set", "pipeline.profile=" + profile, "--set", "train.eval_interval=0",
                  "--set", "train.eval_samples=8", "--set", "data.eval_samples=64",
                  "--set", "train.log_interval=1000", "--set", "train.steps=%d" % steps_for(a.steps, name)]
        batch = None
        for line in open(config):
            if line.strip().startswith("batch_size:"):
                batch = int(line.split(":")[1].split("#")[0])
        sizes = sorted({(batch + m - 1) // m for m in ms})
        t0 = time.time()
        foreign = run_quietly([a.gpipe, "profile", config, "--set", "pipeline.profile=" + profile,
                               "--micro-batches", ",".join(str(s) for s in sizes), "--repeats", str(a.repeats)],
                              os.path.join(d, "profile.log"), a)
        sys.stderr.write("%s: profiled micro-batches %s in %.0f s (other work %.2f cores)\n" % (
            name, sizes, time.time() - t0, foreign))
        for k in ks:
            for m in ms:
                for mode in modes:
                    tag = "%s_k%d_m%d_%s" % (name, k, m, mode)
                    best, before, walls = None, 0, []
                    for i in range(a.runs):
                        od = os.path.join(d, "%s_%d" % (tag, i))
                        before = max(before, run_quietly([a.gpipe, "train", config, "--set", "output.dir=" + od, "--set",
                             "pipeline.partitions=%d" % k, "--set", "pipeline.micro_batches=%d" % m, "--set",
                             "pipeline.checkpoint=" + mode, "--set", "pipeline.balance_by=profile"] + common,
                            od + ".log", a))
                        r = json.load(open(os.path.join(od, "report.json")))
                        walls.append(r["step_ms"])
                        if best is None or r["step_ms"] < best["step_ms"]:
                            best = r
                    r = best
                    p = r["prediction"]
                    row = {"config": name, "k": k, "m": m, "mode": mode, "step_ms": r["step_ms"],
                           "pred_step_ms": p["step_ms"], "bubble": r["bubble"]["measured"],
                           "pred_bubble": p["bubble"], "source": p["source"],
                           "act": [s["peak_activation_bytes"] for s in r["stages"]],
                           "pred_act": [s["activation_bytes"] for s in p["stages"]],
                           "foreign_cores": round(before, 2), "runs_ms": walls}
                    rows.append(row)
                    out.write(json.dumps(row) + "\n")
                    out.flush()
                    sys.stderr.write("%s: measured %.2f ms, predicted %.2f ms (%+.1f%%), other work %.2f cores\n" % (
                        tag, row["step_ms"], row["pred_step_ms"], 100 * (row["pred_step_ms"] / row["step_ms"] - 1),
                        row["foreign_cores"]))
        if a.no_balance:
            continue
        for k in [k for k in ks if k > 1]:
            for by in ["estimate", "profile"]:
                tag = "%s_balance_k%d_%s" % (name, k, by)
                steps, bubbles, balance = [], [], None
                for i in range(a.runs):
                    od = os.path.join(d, "%s_%d" % (tag, i))
                    run_quietly([a.gpipe, "train", config, "--set", "output.dir=" + od, "--set",
                                 "pipeline.partitions=%d" % k, "--set", "pipeline.micro_batches=%d" % a.balance_m,
                                 "--set", "pipeline.checkpoint=except_last", "--set", "pipeline.balance_by=" + by] + common,
                                od + ".log", a)
                    r = json.load(open(os.path.join(od, "report.json")))
                    steps.append(r["step_ms"])
                    bubbles.append(r["bubble"]["measured"])
                    balance = r["balance"]
                row = {"config": name, "k": k, "m": a.balance_m, "balance_by": by, "balance": balance, "runs_ms": steps,
                       "bubbles": bubbles, "step_ms": min(steps), "bubble": sum(bubbles) / len(bubbles)}
                sys.stderr.write("%s: balance %s, bubbles %s\n" % (tag, balance, bubbles))
                out.write(json.dumps(row) + "\n")
                out.flush()
                rows.append(row)
    print_tables(rows)
    sys.stderr.write("raw results: %s\n" % out.name)


def load_rows(paths):
    rows = []
    for p in paths:
        rows += [json.loads(line) for line in open(p) if line.strip()]
    return rows


def print_tables(rows):
    print("| config | K | M | recompute | step ms measured (fastest of runs) | run-to-run spread | predicted | error | "
          "peak activations measured (MB, per stage) | predicted | error |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "balance_by" in r:
            continue
        err = 100 * (r["pred_step_ms"] / r["step_ms"] - 1)
        mem_err = max(abs(p / a - 1) if a else 0 for a, p in zip(r["act"], r["pred_act"])) * 100
        runs = r.get("runs_ms") or [r["step_ms"]]
        spread = 100 * (max(runs) / min(runs) - 1)
        print("| %s | %d | %d | %s | %.2f | %.0f%% | %.2f | %+.1f%% | %s | %s | %.1f%% |" % (
            r["config"], r["k"], r["m"], r["mode"], r["step_ms"], spread, r["pred_step_ms"], err,
            " / ".join("%.2f" % (x / 1e6) for x in r["act"]), " / ".join("%.2f" % (x / 1e6) for x in r["pred_act"]),
            mem_err))
    bal = [r for r in rows if "balance_by" in r]
    if bal:
        print()
        print("| config | K | M | balanced by | balance | step ms (runs) | measured bubble (runs) |")
        print("|---|---|---|---|---|---|---|")
        for r in bal:
            print("| %s | %d | %s | %s | %s | %s | %s |" % (
                r["config"], r["k"], r.get("m", 8), r["balance_by"], r["balance"],
                " / ".join("%.1f" % x for x in r.get("runs_ms", [r["step_ms"]])),
                " / ".join("%.3f" % x for x in r.get("bubbles", [r["bubble"]]))))


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--table":  # accuracy.py --table RESULTS.jsonl ...: tables only
        print_tables(load_rows(sys.argv[2:]))
    else:
        main()
