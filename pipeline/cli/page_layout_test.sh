#!/usr/bin/env bash
# report.html read as a person reads it, at 800 px and at 1400 px: headless Chromium
# (Debian's chromium, which `./gpipe test` installs) lays out the pages of real runs
# (interleaved 1F1B with two chunks per stage and long layer names; zero bubble on three
# stages with the gradient norm's collective; a stage split over a tensor group of two
# processes under mpirun, whose table has a tensor group column) and a script measures
# the result: nothing
# wider than the window (no horizontal scrolling, no cut table column), every label of
# a chart inside its drawing, the timeline's text no smaller than 80% of its size, and
# every stage's layers in full on the page.
set -uo pipefail
gpipe="$1"
browser="$(command -v chromium || command -v chromium-browser || true)"
if [ -z "$browser" ]; then
  echo "GPIPE_TEST_SKIPPED: no chromium here (apt-get install -y chromium; ./gpipe test installs it)"
  exit 0
fi
tmp="${TEST_TMPDIR:-/tmp}/page_layout_test"
rm -rf "$tmp" && mkdir -p "$tmp"
export HOME="$tmp/home"  # chromium keeps its profile there
mkdir -p "$HOME"
fail() { echo "FAIL: $*"; exit 1; }

python3 -c "print('the pipeline keeps every stage busy while the bubble shrinks as micro-batches grow. ' * 80)" \
  > "$tmp/text.txt"
cat > "$tmp/lm.yaml" <<YAML
model:
  input: [16]
  layers:
    - {type: embedding, vocab: 256, dim: 32}
    - repeat: 6
      layers:
        - {type: transformer_block, heads: 4, dropout: 0.1}
    - {type: layernorm}
    - {type: linear, out: 256}
  loss: {type: softmax_cross_entropy}
data: {type: text, path: $tmp/text.txt, seq_len: 16}
pipeline: {partitions: 2, micro_batches: 8, schedule: interleaved_1f1b, virtual_stages: 2, recompute: never}
optimizer: {type: adam, lr: 0.001, clip_grad_norm: 1.0}
train: {steps: 4, batch_size: 16, log_interval: 10}
YAML

# The probe: every element's box against the window, every SVG text against its SVG.
probe='<script>window.addEventListener("load", () => {
  const W = window.innerWidth, bad = [];
  for (const e of document.querySelectorAll("body *")) {
    const r = e.getBoundingClientRect();
    if (r.width > 0 && (r.right > W + 0.5 || r.left < -0.5)) bad.push(e.tagName + " " + (e.getAttribute("class") || "") + " " + Math.round(r.left) + ".." + Math.round(r.right) + " " + (e.textContent || "").slice(0, 30));
  }
  for (const svg of document.querySelectorAll("svg")) {
    const b = svg.getBoundingClientRect();
    for (const t of svg.querySelectorAll("text")) {
      const r = t.getBoundingClientRect();
      if (r.right > b.right + 0.5 || r.left < b.left - 0.5) bad.push("text outside its chart: " + t.textContent + " " + Math.round(r.left) + ".." + Math.round(r.right) + " in " + Math.round(b.left) + ".." + Math.round(b.right));
    }
  }
  if (document.documentElement.scrollWidth > W) {  // name the widest elements, whatever their box
    const all = [...document.querySelectorAll("*")].map(e => [e.getBoundingClientRect().right, e.tagName + " " + (e.getAttribute("class") || "")]);
    all.sort((a, b) => b[0] - a[0]);
    bad.push("widest: " + all.slice(0, 6).map(a => a[1] + " to " + Math.round(a[0])).join(", "));
    for (const e of document.querySelectorAll("body *")) {  // content wider than its box: a word that does not wrap
      if (e.scrollWidth > e.clientWidth + 1 && e.clientWidth > 0 && !e.closest(".wide") && !(e instanceof SVGElement)) {
        bad.push(e.tagName + " " + (e.getAttribute("class") || "") + " holds " + e.scrollWidth + " px in " + e.clientWidth + ": " + e.textContent.slice(0, 40));
      }
    }
  }
  const tl = document.querySelector("svg.timeline");
  const scale = tl ? tl.getBoundingClientRect().width / tl.viewBox.baseVal.width : 0;
  const out = document.createElement("pre");
  out.id = "layout-probe";
  out.textContent = JSON.stringify({width: W, scrollWidth: document.documentElement.scrollWidth, timelineScale: scale, overflowing: bad});
  document.body.appendChild(out);
});</script>'

run() {  # name, then --set overrides
  local name="$1"
  shift
  "$gpipe" train "$tmp/lm.yaml" --set output.dir="$tmp/$name" "$@" > "$tmp/$name.log" 2>&1 ||
    { cat "$tmp/$name.log"; fail "$name did not run"; }
}
look() {  # name, width
  local page="$tmp/$1/report.html" probed="$tmp/$1/probed-$2.html"
  python3 - "$page" "$probed" "$probe" <<'PY'
import sys
html = open(sys.argv[1]).read()
open(sys.argv[2], "w").write(html.replace("</body>", sys.argv[3] + "</body>"))
PY
  timeout 120 "$browser" --headless --no-sandbox --disable-gpu --disable-dev-shm-usage --hide-scrollbars \
    --force-device-scale-factor=1 --window-size="$2,1200" --virtual-time-budget=5000 --dump-dom "file://$probed" \
    > "$tmp/$1/dom-$2.html" 2> "$tmp/$1/chromium-$2.log"
  python3 - "$tmp/$1/dom-$2.html" "$1" "$2" <<'PY' || { tail -5 "$tmp/$1/chromium-$2.log"; fail "$1's page at $2 px"; }
import html, json, re, sys
dom, name, width = open(sys.argv[1]).read(), sys.argv[2], int(sys.argv[3])
m = re.search(r'<pre id="layout-probe">(.*?)</pre>', dom, re.S)
assert m, "the probe did not run (chromium printed no page)"
p = json.loads(html.unescape(m.group(1)))
assert p["width"] == width, p
assert not p["overflowing"], "%d elements leave the window or their chart: %s" % (len(p["overflowing"]), p["overflowing"][:8])
assert p["scrollWidth"] <= width, "the page is %d px wide in a %d px window" % (p["scrollWidth"], width)
assert p["timelineScale"] >= 0.8, "the timeline is drawn at %.2f of its size: its text is too small" % p["timelineScale"]
print("ok: %s at %d px: %d px wide, timeline at %.2f" % (name, width, p["scrollWidth"], p["timelineScale"]))
PY
}

# The plan names its profile's path on the page: a long one must wrap, not widen the page.
run interleaved --set pipeline.profile="$tmp/a-rather-long-directory-name-without-any-spaces-in-it-at-all/$(printf 'x%.0s' {1..80})/profile.json"
run zero_bubble --set pipeline.schedule=zero_bubble --set pipeline.virtual_stages=1 --set pipeline.partitions=3 \
  --set pipeline.micro_batches=6
# A tensor group: K=2 x T=2 under mpirun, with sequence parallelism.
timeout 300 mpirun --allow-run-as-root --oversubscribe -np 4 "$gpipe" train "$tmp/lm.yaml" --set output.dir="$tmp/tensor" \
  --set pipeline.schedule=1f1b --set pipeline.virtual_stages=1 --set pipeline.tensor_parallel=2 \
  --set pipeline.sequence_parallel=true > "$tmp/tensor.log" 2>&1 || { cat "$tmp/tensor.log"; fail "tensor did not run"; }
grep -q "<th>tensor group</th>" "$tmp/tensor/report.html" || fail "the tensor group's page has no tensor group column"
for name in interleaved zero_bubble tensor; do
  for width in 800 1400; do look "$name" "$width"; done
done
# Every stage's layers in full (the second chunk's too), as the log names them.
python3 - "$tmp/interleaved.log" "$tmp/interleaved/report.html" <<'PY' || fail "a stage's layers are not on the page in full"
import html, re, sys
log, page = open(sys.argv[1]).read(), html.unescape(open(sys.argv[2]).read())
stages = re.findall(r"stage (\d+) on \S+: layers (.*)", log)
assert len(stages) == 2, stages
for k, text in stages:
    chunks = text.strip().split(" | ")
    assert len(chunks) == 2, chunks
    want = "chunk a: layers %s; chunk b: layers %s" % tuple(chunks)
    assert want in page, (k, want)
PY
echo "the pages read at 800 and 1400 px"
