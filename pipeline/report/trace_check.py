#!/usr/bin/env python3
"""Checks a gpipe trace.json as Perfetto would read it, and against the schedule.

  trace_check.py TRACE.json STEPS COUNTS [--all-reduce]
    STEPS   the recorded steps, "first,last" (as trace.steps)
    COUNTS  instructions per stage and step, "20,28,20" (one slice per instruction)
    --all-reduce  every stage sums gradients with peers (replicas): each has one
                  reduce_gradients (RG) slice per step, counted in COUNTS

Checks: the file is JSON with traceEvents; every stage has a named process with a
compute and a communication track; on every track the slices nest (none overlaps
another partially); every flow has one start and one end, each inside a slice of its
track (the send's and the receive's); every stage has COUNTS[k] instruction slices per
recorded step, and every send one flow to its receive; timestamps are finite and the
activation counter never goes negative; a collective (RG, TIE, NORM) is a slice of the
communication track that ends before its stage's optimizer step of the same step
begins. Exits non-zero naming the first problem.
"""
import collections
import json
import math
import sys


def fail(msg):
    print("FAIL: " + msg)
    sys.exit(1)


def main():
    path, steps_arg, counts_arg = sys.argv[1], sys.argv[2], sys.argv[3]
    want_reduce = "--all-reduce" in sys.argv[4:]
    first, last = (int(x) for x in steps_arg.split(","))
    counts = [int(x) for x in counts_arg.split(",")]
    K = len(counts)
    with open(path) as f:
        trace = json.load(f)
    events = trace.get("traceEvents")
    if not isinstance(events, list) or not events:
        fail("no traceEvents list")

    names = {}
    threads = collections.defaultdict(dict)
    slices = collections.defaultdict(list)  # (pid, tid) -> [(ts, end, event)]
    flows = collections.defaultdict(dict)  # id -> {"s": event, "f": event}
    for e in events:
        ph = e.get("ph")
        if ph == "M":
            if e["name"] == "process_name":
                names[e["pid"]] = e["args"]["name"]
            elif e["name"] == "thread_name":
                threads[e["pid"]][e["tid"]] = e["args"]["name"]
            continue
        ts = e.get("ts")
        if not isinstance(ts, (int, float)) or not math.isfinite(ts):
            fail("an event without a finite ts: %r" % e)
        if ph == "X":
            dur = e.get("dur")
            if not isinstance(dur, (int, float)) or dur < 0:
                fail("a slice with a bad dur: %r" % e)
            slices[(e["pid"], e["tid"])].append((ts, ts + dur, e))
        elif ph in ("s", "f"):
            if ph in flows[e["id"]]:
                fail("flow %r has two '%s' events" % (e["id"], ph))
            flows[e["id"]][ph] = e
        elif ph == "C":
            for v in e["args"].values():
                if v < 0:
                    fail("negative counter %r" % e)
        else:
            fail("unexpected phase %r" % ph)

    for k in range(K):
        if k not in names or not names[k].startswith("stage %d " % k):
            fail("stage %d has no process name (got %r)" % (k, names.get(k)))
        if sorted(threads[k].values()) != ["communication", "compute"]:
            fail("stage %d's tracks are %r" % (k, threads[k]))

    # Nesting per track: sorted by start (longer first), every slice ends before the
    # enclosing one does. A tolerance of 1 ns for rounding.
    eps = 1e-3
    for key, items in slices.items():
        items.sort(key=lambda x: (x[0], -x[1]))
        stack = []
        for ts, end, e in items:
            while stack and stack[-1][1] <= ts + eps:
                stack.pop()
            if stack and end > stack[-1][1] + eps:
                fail("slices overlap on track %r: %s [%g, %g] and %s [%g, %g]" % (
                    key, stack[-1][2]["name"], stack[-1][0], stack[-1][1], e["name"], ts, end))
            stack.append((ts, end, e))

    def inside(e):
        for ts, end, s in slices[(e["pid"], e["tid"])]:
            if ts - eps <= e["ts"] <= end + eps and s.get("cat") != "step":
                return s
        return None

    sends = 0
    for fid, pair in flows.items():
        if set(pair) != {"s", "f"}:
            fail("flow %r lacks its %s" % (fid, "start" if "s" not in pair else "end"))
        a, b = inside(pair["s"]), inside(pair["f"])
        if a is None or b is None:
            fail("flow %r has an end outside every slice" % fid)
        if not a["cat"].startswith("send") or not b["cat"].startswith("recv"):
            fail("flow %r goes from %s to %s, not from a send to a receive" % (fid, a["cat"], b["cat"]))
        if a["args"]["micro_batch"] != b["args"]["micro_batch"] or a["args"]["peer"] != b["pid"]:
            fail("flow %r joins %s on stage %d and %s on stage %d" % (fid, a["name"], a["pid"], b["name"], b["pid"]))
        if pair["f"].get("bp") != "e":
            fail("flow %r's end does not bind to its enclosing slice" % fid)
        # The arrow leaves at the send's end (or, a sender noting its end late, when the
        # receive completed) and arrives when the receive completed: never back in time.
        if pair["f"]["ts"] < pair["s"]["ts"]:
            fail("flow %r goes back in time: leaves %s at %.3f us, arrives in %s at %.3f us" %
                 (fid, a["name"], pair["s"]["ts"], b["name"], pair["f"]["ts"]))
        if abs(pair["f"]["ts"] - (b["ts"] + b["dur"])) > 0.0015:
            fail("flow %r arrives at %.3f us, not when %s completed (%.3f us)" %
                 (fid, pair["f"]["ts"], b["name"], b["ts"] + b["dur"]))
        send_end = a["ts"] + a["dur"]
        leave = max(a["ts"], min(send_end, b["ts"] + b["dur"]) - 0.001)
        if abs(pair["s"]["ts"] - leave) > 0.0015:
            fail("flow %r leaves at %.3f us, not when %s ended (%.3f us)" % (fid, pair["s"]["ts"], a["name"], send_end))

    steps = list(range(first, last + 1))
    for k in range(K):
        per_step = collections.Counter()
        for key in ((k, 0), (k, 1)):
            for _, _, e in slices[key]:
                per_step[e["args"]["step"]] += 1
                if e["cat"].startswith("send"):
                    sends += 1
        for s in steps:
            if per_step[s] != counts[k]:
                fail("stage %d has %d slices in step %d, its program %d instructions" % (k, per_step[s], s, counts[k]))
        extra = set(per_step) - set(steps)
        if extra:
            fail("stage %d has slices of unrecorded steps %r" % (k, sorted(extra)))
    # Collectives: on the communication track, before the optimizer step (compute track).
    collective_cats = ("reduce_gradients", "tied_gradients", "gradient_norm")
    for k in range(K):
        opt = {e["args"]["step"]: (ts, end) for ts, end, e in slices[(k, 0)] if e["cat"] == "optimizer_step"}
        for tid in (0, 1):
            for ts, end, e in slices[(k, tid)]:
                if e["cat"] in collective_cats and tid != 1:
                    fail("stage %d's %s of step %d is not on the communication track" % (k, e["name"], e["args"]["step"]))
        coll = [(ts, end, e) for ts, end, e in slices[(k, 1)] if e["cat"] in collective_cats]
        for ts, end, e in coll:
            o = opt.get(e["args"]["step"])
            if o is None or end > o[0] + eps:
                fail("stage %d's %s of step %d [%g, %g] does not end before its optimizer step %r" % (
                    k, e["name"], e["args"]["step"], ts, end, o))
        got = sorted(e["args"]["step"] for _, _, e in coll if e["cat"] == "reduce_gradients")
        if want_reduce and got != steps:
            fail("stage %d has reduce_gradients slices for steps %r, not one per step %r" % (k, got, steps))
        if not want_reduce and got:
            fail("stage %d has reduce_gradients slices without replicas" % k)
    if sends != len(flows):
        fail("%d sends but %d flows" % (sends, len(flows)))
    step_slices = [e for _, _, e in slices[(K, 0)]]
    if sorted(e["args"]["step"] for e in step_slices) != steps:
        fail("the steps track holds %r, not steps %d..%d" % ([e["args"]["step"] for e in step_slices], first, last))
    print("ok: %s: %d stages, steps %d..%d, %d slices, %d flows" % (
        path, K, first, last, sum(len(v) for v in slices.values()), len(flows)))


if __name__ == "__main__":
    main()
