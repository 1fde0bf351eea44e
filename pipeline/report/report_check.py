#!/usr/bin/env python3
"""Checks a gpipe report.html as a browser would need it.

  report_check.py REPORT.html STAGES FIRST,LAST

Checks: the page parses as HTML with every element closed (SVG's self-closing ones
included) and holds nothing that reaches the network (no http:// or https://, no src
or href attribute, no script, link, img, iframe, object or embed element); it has three
timelines (measured, simulated from measured op times, planned), each with one row per
stage; the measured one is of a step within FIRST..LAST; the stage table has a measured
and a planned row per stage; the loss chart has a point per step of report.json beside
it. In report.json, every step and validation is in the launch that began last at or
before it, the launches' first and last steps and counts agree with the steps, the
timings are the last launch's (timed_launch), and the chart has a marker labelled
"launch N: resumed at step S" for each launch after the first. Exits non-zero naming the
first problem.
"""
import html.parser
import json
import os
import re
import sys

VOID = {"meta", "br", "hr", "img", "input", "link", "area", "base", "col", "embed", "source", "track", "wbr"}
FORBIDDEN = {"script", "link", "img", "iframe", "object", "embed", "audio", "video", "source"}


def fail(msg):
    print("FAIL: " + msg)
    sys.exit(1)


class Page(html.parser.HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.stack = []
        self.timelines = []  # per timeline svg: its row names
        self.in_rowname = False
        self.text = []
        self.loss_points = 0
        self.measured_rows = self.planned_rows = 0
        self.cells = []
        self.in_launchlabel = False
        self.launch_labels = []

    def handle_starttag(self, tag, attrs):
        self._open(tag, attrs, closes=False)

    def handle_startendtag(self, tag, attrs):
        self._open(tag, attrs, closes=True)

    def _open(self, tag, attrs, closes):
        if tag in FORBIDDEN:
            fail("the page has a <%s> element" % tag)
        a = dict(attrs)
        for name in a:
            if name in ("src", "href", "xlink:href", "srcset", "action"):
                fail("<%s> has a %s attribute: %r" % (tag, name, a[name]))
        if tag == "svg" and "timeline" in (a.get("class") or ""):
            self.timelines.append([])
        if tag == "text" and a.get("class") == "rowname":
            self.in_rowname = True
        if tag == "text" and (a.get("class") or "").split(" ")[0] == "launchlabel":
            self.in_launchlabel = True
            self.launch_labels.append("")
        if tag == "title":
            self.in_launchlabel = False  # the label's tooltip is not its text
        if tag == "polyline" and a.get("class") == "loss":
            self.loss_points = len(a.get("points", "").split())
        if not closes and tag not in VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag):
        if tag in VOID:
            return
        if not self.stack or self.stack[-1] != tag:
            fail("</%s> closes <%s>" % (tag, self.stack[-1] if self.stack else "nothing"))
        self.stack.pop()
        if tag == "text":
            self.in_rowname = False
            self.in_launchlabel = False

    def handle_data(self, data):
        if self.in_launchlabel:
            self.launch_labels[-1] += data
        if self.in_rowname and self.timelines:
            self.timelines[-1].append(data.strip())
        if self.stack and self.stack[-1] == "td":
            if data.strip() == "measured":
                self.measured_rows += 1
            if data.strip() == "planned":
                self.planned_rows += 1
        self.text.append(data)


def check_launches(j, labels):
    launches = j["launches"]
    if [l["launch"] for l in launches] != list(range(1, len(launches) + 1)):
        fail("launches numbered %r" % [l["launch"] for l in launches])
    firsts = [l["first_step"] for l in launches]
    if any(f < 1 for f in firsts) or any(s["step"] < 1 for s in j["steps"]):
        fail("steps numbered from 0; the terminal numbers them from 1 (launches start at %r)" % firsts)
    if firsts != sorted(set(firsts)):
        fail("launches start at %r, not increasing" % firsts)
    if j["timed_launch"] != len(launches):
        fail("timed_launch %r, want the last launch, %d" % (j["timed_launch"], len(launches)))

    def launch_of(step):
        return max([1] + [i + 1 for i, f in enumerate(firsts) if f <= step])

    seen = {}
    for s in j["steps"]:
        if s["launch"] != launch_of(s["step"]):
            fail("step %d is in launch %r, want %d" % (s["step"], s["launch"], launch_of(s["step"])))
        seen.setdefault(s["launch"], []).append(s["step"])
    for v in j["validation"]:
        if v["launch"] != launch_of(v["step"]):
            fail("the validation after step %d is in launch %r, want %d" % (v["step"], v["launch"], launch_of(v["step"])))
    for l in launches:
        mine = seen.get(l["launch"], [])
        want = (l["first_step"], max(mine) if mine else l["first_step"] - 1, len(mine))
        if (l["first_step"], l["last_step"], l["steps"]) != want:
            fail("launch %d has first, last step and count %r, the steps give %r" % (
                l["launch"], (l["first_step"], l["last_step"], l["steps"]), want))
    last = max(s["step"] for s in j["steps"]) if j["steps"] else -1
    want = ["launch %d: resumed at step %d" % (l["launch"], l["first_step"])
            for l in launches[1:] if 1 <= l["first_step"] <= last]
    if sorted(labels) != sorted(want):
        fail("the loss chart marks %r, want %r" % (labels, want))


def main():
    path, stages = sys.argv[1], int(sys.argv[2])
    first, last = (int(x) for x in sys.argv[3].split(","))
    raw = open(path, encoding="utf-8").read()
    for scheme in ("http://", "https://"):
        if scheme in raw:
            fail("the page mentions %s" % scheme)
    if "@import" in raw or "url(" in raw:
        fail("the style sheet loads something (@import or url())")
    page = Page()
    page.feed(raw)
    page.close()
    if page.stack:
        fail("unclosed elements at the end: %r" % page.stack)
    if len(page.timelines) != 3:
        fail("%d timelines, want 3 (measured, simulated, planned)" % len(page.timelines))
    for i, rows in enumerate(page.timelines):
        want = ["stage %d" % k for k in range(stages)]
        got = [r.split(" ")[0] + " " + r.split(" ")[1] for r in rows]
        if got != want:
            fail("timeline %d has rows %r, want %r" % (i, rows, want))
    text = "".join(page.text)
    m = re.search(r"Measured: step (\d+) \(the median wall time of steps (\d+) to (\d+)\)", text)
    if not m:
        fail("no measured step heading")
    step, lo, hi = (int(x) for x in m.groups())
    if (lo, hi) != (first, last) or not first <= step <= last:
        fail("measured step %d of %d..%d, want one of %d..%d" % (step, lo, hi, first, last))
    if page.measured_rows != stages or page.planned_rows != stages:
        fail("the stage table has %d measured and %d planned rows for %d stages" % (
            page.measured_rows, page.planned_rows, stages))
    report = os.path.join(os.path.dirname(path), "report.json")
    j = json.load(open(report))
    steps = len(j["steps"])
    if page.loss_points != steps:
        fail("the loss curve has %d points for %d steps" % (page.loss_points, steps))
    check_launches(j, page.launch_labels)
    print("ok: %s: %d stages, step %d of %d..%d, self-contained" % (path, stages, step, first, last))


if __name__ == "__main__":
    main()
