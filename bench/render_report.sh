#!/usr/bin/env bash
# Renders a run's report.html to a PNG with headless Chromium (Debian's `chromium`
# package), as a person would see it: for checking the page, and for the README's
# screenshot (docs/report.png).
#   bench/render_report.sh runs/default/report.html docs/report.png [WIDTH] [HEIGHT]
# The page loads nothing from the network; --no-sandbox is for running as root.
set -euo pipefail
html="${1:?usage: bench/render_report.sh REPORT.html OUT.png [WIDTH] [HEIGHT]}"
png="${2:?usage: bench/render_report.sh REPORT.html OUT.png [WIDTH] [HEIGHT]}"
width="${3:-1300}" height="${4:-2200}"
browser="$(command -v chromium || command -v chromium-browser || true)"
if [ -z "$browser" ]; then
  echo "render_report.sh: no chromium here; install it with: apt-get install -y chromium" >&2
  exit 3
fi
[ -r "$html" ] || { echo "render_report.sh: cannot read $html" >&2; exit 2; }
out="$(readlink -f "$(dirname "$png")")/$(basename "$png")"
"$browser" --headless --no-sandbox --disable-gpu --hide-scrollbars --force-device-scale-factor=1 \
  --window-size="$width,$height" --screenshot="$out" "file://$(readlink -f "$html")" >/dev/null 2>&1
[ -s "$out" ] || { echo "render_report.sh: chromium wrote no $out" >&2; exit 1; }
echo "$out"
