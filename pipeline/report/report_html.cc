#include "pipeline/report/report_html.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

namespace gpipe {
namespace pipeline {

namespace {

// ---- Small helpers: escaping, numbers, colours.

std::string esc(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      default: out += c;
    }
  }
  return out;
}

std::string num(double v, int digits = 2) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", digits, v);
  return buf;
}

std::string pct(double v) { return num(100 * v, 1) + "%"; }

// "+0.8%": how far `planned` is from `measured`.
std::string signed_pct(double planned, double measured) {
  if (measured <= 0) return "n/a";
  const double d = 100 * (planned - measured) / measured;
  return (d >= 0 ? "+" : "") + num(d, 1) + "%";
}

// Memory in MiB (2^20 bytes), as the terminal and the planner show it.
std::string mb(double bytes) {
  const double mib = bytes / (1024.0 * 1024.0);
  return num(mib, mib < 10 ? 2 : 1) + " MiB";
}

// The same colour for an instruction kind everywhere on the page (and the legend).
const char* colour(Op op) {
  switch (op) {
    case Op::kForward: return "#4e79a7";
    case Op::kRecompute: return "#f28e2b";
    case Op::kBackward: return "#59a14f";
    case Op::kBackwardWeight: return "#76b7b2";
    case Op::kOptimizerStep: return "#9c755f";
    case Op::kSendActivation:
    case Op::kSendGradient: return "#555555";
    case Op::kRecvActivation:
    case Op::kRecvGradient: return "#d4d4d4";
    case Op::kReduceGradients:
    case Op::kTiedGradients:
    case Op::kGradientNorm:
    case Op::kReduceScatterGradients:
    case Op::kGatherParameters: return "#b07aa1";
    case Op::kTensorSum:
    case Op::kTensorMax:
    case Op::kTensorGather:
    case Op::kTensorScatter: return "#e15759";
  }
  return "#000";
}

// One block of a timeline, whatever it came from.
struct Block {
  Instruction ins;
  double start, end;  // ms from the step's start
};

// ---- The timeline: one row per stage (compute lane, communication lane under it).

// The SVG is drawn in these units and scaled to the page's width by the style sheet
// (svg.timeline), so that it fits a 800 px window as well as a 1400 px one.
constexpr double kLeft = 118, kWidth = 800, kRight = 34, kLane = 24, kCommLane = 9, kRowGap = 10;

// A stage's chunk (virtual stage) as the page names it: a, b, c, ...
std::string chunk_letter(int chunk) { return std::string(1, static_cast<char>('a' + chunk % 26)); }

std::string timeline_svg(const Schedule& s, const std::vector<std::vector<Block>>& rows, double scale_ms,
                         const std::vector<std::string>& names) {
  const int K = static_cast<int>(rows.size());
  const double row_h = kLane + kCommLane + kRowGap;
  const double height = 22 + K * row_h + 6;
  const double px = kWidth / std::max(scale_ms, 1e-9);
  std::ostringstream o;
  const double total_w = kLeft + kWidth + kRight;
  o << "<svg class=\"timeline\" width=\"" << total_w << "\" height=\"" << height << "\" viewBox=\"0 0 " << total_w
    << " " << height << "\" role=\"img\">\n";
  // Time axis: about ten ticks at a round step.
  const double raw = scale_ms / 10;
  const double mag = std::pow(10.0, std::floor(std::log10(std::max(raw, 1e-9))));
  const double step = raw / mag < 2 ? 2 * mag : raw / mag < 5 ? 5 * mag : 10 * mag;
  for (double t = 0; t <= scale_ms + 1e-9; t += step) {
    const double x = kLeft + t * px;
    const std::string label = num(t, step < 1 ? 1 : 0) + " ms";
    // A label is centred on its tick unless that would run past the drawing's right edge.
    const bool at_end = x + 3.5 * static_cast<double>(label.size()) > total_w;
    o << "<line x1=\"" << x << "\" y1=\"14\" x2=\"" << x << "\" y2=\"" << height - 6
      << "\" class=\"grid\"/><text x=\"" << (at_end ? total_w - 1 : x) << "\" y=\"11\" class=\"tick"
      << (at_end ? " end" : "") << "\">" << label << "</text>\n";
  }
  const bool chunks = s.num_chunks() > 1;
  for (int k = 0; k < K; ++k) {
    const double y = 20 + k * row_h;
    o << "<text x=\"" << kLeft - 8 << "\" y=\"" << y + kLane / 2 + 4 << "\" class=\"rowname\">" << esc(names[k])
      << "</text>\n";
    o << "<rect x=\"" << kLeft << "\" y=\"" << y << "\" width=\"" << kWidth << "\" height=\"" << kLane + kCommLane
      << "\" class=\"lane\"/>\n";
    for (const Block& b : rows[k]) {
      // A tensor collective in the lane under the compute instruction that ran it.
      const bool comm = is_communication(b.ins.op) || is_collective(b.ins.op) || is_tensor_collective(b.ins.op);
      const double x = kLeft + b.start * px;
      const double w = std::max(0.0, (b.end - b.start) * px);
      if (w <= 0 && comm) continue;
      const double by = comm ? y + kLane + 1 : y;
      const double bh = comm ? kCommLane - 2 : kLane;
      const std::string name = instruction_str(s, k, b.ins);
      // With several chunks per stage, a later chunk's blocks are a lighter shade and
      // their labels carry the chunk's letter: "3a" is micro-batch 3 in chunk a.
      const bool later_chunk = chunks && is_compute(b.ins.op) && b.ins.chunk > 0;
      o << "<rect x=\"" << num(x, 2) << "\" y=\"" << by << "\" width=\"" << num(std::max(w, 0.6), 2) << "\" height=\""
        << bh << "\" fill=\"" << colour(b.ins.op) << "\"" << (later_chunk ? " class=\"later\"" : "") << "><title>"
        << esc(name) << " (" << op_name(b.ins.op) << (chunks && has_cell(b.ins.op) ? ", chunk " + chunk_letter(b.ins.chunk) : "")
        << "), stage " << k << ": " << num(b.start, 3) << " to " << num(b.end, 3) << " ms (" << num(b.end - b.start, 3)
        << " ms)</title></rect>\n";
      const std::string label =
          std::to_string(b.ins.micro_batch) +
          (b.ins.count > 1 ? "-" + std::to_string(b.ins.micro_batch + b.ins.count - 1) : "") +  // a batched W
          (chunks && has_cell(b.ins.op) ? chunk_letter(b.ins.chunk) : "");
      if (has_cell(b.ins.op) && !comm && b.ins.micro_batch >= 0 && w >= 5 + 7 * static_cast<double>(label.size())) {
        o << "<text x=\"" << num(x + w / 2, 2) << "\" y=\"" << y + kLane / 2 + 4 << "\" class=\"mb\">" << label
          << "</text>\n";
      }
    }
  }
  o << "</svg>\n";
  return o.str();
}

std::string legend(int num_chunks, bool tensor) {
  std::ostringstream o;
  o << "<div class=\"legend\">";
  const std::pair<Op, const char*> items[] = {
      {Op::kForward, "forward"},           {Op::kRecompute, "recompute"},
      {Op::kBackward, "backward"},         {Op::kBackwardWeight, "weight gradient (W)"},
      {Op::kOptimizerStep, "optimizer"},   {Op::kSendActivation, "send"},
      {Op::kRecvActivation, "receive (waiting for the neighbour)"},
      {Op::kReduceGradients, "collective (replicas' gradient sum or RS/AG, tied weight, gradient norm)"}};
  for (const auto& [op, text] : items) {
    o << "<span><i style=\"background:" << colour(op) << "\"></i>" << text << "</span>";
  }
  if (tensor) {
    o << "<span><i style=\"background:" << colour(Op::kTensorSum)
      << "\"></i>tensor group (tAR, tMAX, tAG, tRS: the split layers' collectives, which run inside their F, R, B or W)</span>";
  }
  o << "<span><i class=\"gap\"></i>idle (gap)</span>";
  if (num_chunks > 1) {
    o << "<span>3a, 3b: micro-batch 3 in the stage's chunk a or b (virtual stages; see Stages); a later chunk's "
         "blocks are lighter</span>";
  }
  o << "</div>\n";
  return o.str();
}

std::vector<std::vector<Block>> from_simulation(const std::vector<std::vector<TimedInstruction>>& timeline) {
  std::vector<std::vector<Block>> rows;
  for (const auto& stage : timeline) {
    rows.emplace_back();
    for (const auto& t : stage) rows.back().push_back({t.ins, t.start, t.end});
  }
  return rows;
}

double extent(const std::vector<std::vector<Block>>& rows) {
  double e = 0;
  for (const auto& r : rows) {
    for (const auto& b : r) e = std::max(e, b.end);
  }
  return e;
}

// ---- Per-stage bars: where the span went, measured and planned.

std::string stage_bar(double compute, double recompute, double comm, double idle, double span) {
  std::ostringstream o;
  const double w = 110;
  const double total = std::max(span, compute + recompute + comm + idle);
  double x = 0;
  o << "<svg width=\"" << w << "\" height=\"14\" class=\"bar\">";
  const std::pair<double, const char*> parts[] = {
      {compute, colour(Op::kBackward)}, {recompute, colour(Op::kRecompute)}, {comm, colour(Op::kSendActivation)}};
  for (const auto& [v, c] : parts) {
    const double pw = total > 0 ? v / total * w : 0;
    o << "<rect x=\"" << num(x, 2) << "\" y=\"0\" width=\"" << num(pw, 2) << "\" height=\"14\" fill=\"" << c << "\"/>";
    x += pw;
  }
  o << "<rect x=\"" << num(x, 2) << "\" y=\"0\" width=\"" << num(std::max(0.0, w - x), 2)
    << "\" height=\"14\" class=\"idlebar\"/></svg>";
  return o.str();
}

// ---- Loss and validation curves.

// The whole run's curves: a dashed marker with a label where each later launch (a
// resume, a restart) took over; labels that would overlap go on the next line down.
std::string loss_svg(const std::vector<std::pair<int, double>>& losses,
                     const std::vector<ReportBuilder::Validation>& validations,
                     const std::vector<LaunchSummary>& launches) {
  if (losses.empty()) return "<p>No steps ran.</p>";
  const double w = 720, h = 260, l = 56, r = 16, b = 30;
  int marker_rows = 0;  // worked out below, before the plot's top is known
  std::vector<std::pair<const LaunchSummary*, int>> markers;  // launch, label row
  double lo = 1e300, hi = -1e300;
  int last_step = 1;  // steps are numbered from 1; the x axis runs from step 1 to the last
  for (const auto& [s, v] : losses) {
    lo = std::min(lo, v);
    hi = std::max(hi, v);
    last_step = std::max(last_step, s);
  }
  for (const auto& v : validations) {
    lo = std::min(lo, v.loss);
    hi = std::max(hi, v.loss);
  }
  if (hi - lo < 1e-9) {
    hi += 0.5;
    lo -= 0.5;
  }
  const double pad = 0.05 * (hi - lo);
  lo -= pad;
  hi += pad;
  auto X = [&](double s) { return l + (last_step > 1 ? (s - 1) / (last_step - 1) : 0.5) * (w - l - r); };
  // Marker labels sit above the plot, about 6 px a character; each row keeps its rightmost end.
  std::vector<double> row_end;
  auto label = [](const LaunchSummary& ls) {
    return "launch " + std::to_string(ls.launch) + ": resumed at step " + std::to_string(ls.first_step);
  };
  for (size_t i = 1; i < launches.size(); ++i) {
    const LaunchSummary& ls = launches[i];
    if (ls.first_step < 1 || ls.first_step > last_step) continue;
    const double x = X(ls.first_step), len = 6.0 * static_cast<double>(label(ls).size());
    const bool left = x + 4 + len > w;  // no room to the right: the label ends at the marker
    const double a = left ? x - 4 - len : x + 4 - 2, e = left ? x - 4 + 2 : x + 4 + len;
    int row = 0;
    while (row < static_cast<int>(row_end.size()) && row_end[row] > a) ++row;
    if (row == static_cast<int>(row_end.size())) row_end.push_back(0);
    row_end[row] = std::max(row_end[row], e);
    markers.emplace_back(&ls, row);
  }
  marker_rows = static_cast<int>(row_end.size());
  const double t = 12 + 14.0 * marker_rows;
  const double height = h + 14.0 * marker_rows;
  auto Y = [&](double v) { return t + (hi - v) / (hi - lo) * (height - t - b); };
  std::ostringstream o;
  o << "<svg class=\"chart\" width=\"" << w << "\" height=\"" << height << "\" viewBox=\"0 0 " << w << " " << height
    << "\">\n";
  for (int i = 0; i <= 4; ++i) {
    const double v = lo + (hi - lo) * i / 4;
    o << "<line x1=\"" << l << "\" x2=\"" << w - r << "\" y1=\"" << num(Y(v), 1) << "\" y2=\"" << num(Y(v), 1)
      << "\" class=\"grid\"/><text x=\"" << l - 6 << "\" y=\"" << num(Y(v) + 4, 1) << "\" class=\"ytick\">"
      << num(v, 3) << "</text>\n";
  }
  o << "<text x=\"" << l << "\" y=\"" << height - 8 << "\" class=\"tick\">step 1</text><text x=\"" << w - r
    << "\" y=\"" << height - 8 << "\" class=\"ytick\">step " << last_step << "</text>\n";
  for (const auto& [ls, row] : markers) {
    const double x = X(ls->first_step);
    const bool left = x + 4 + 6.0 * static_cast<double>(label(*ls).size()) > w;
    o << "<line x1=\"" << num(x, 1) << "\" x2=\"" << num(x, 1) << "\" y1=\"" << 14 + 14 * row << "\" y2=\""
      << num(height - b, 1) << "\" class=\"launchmark\"/><text x=\"" << num(left ? x - 4 : x + 4, 1) << "\" y=\""
      << 22 + 14 * row << "\" class=\"launchlabel" << (left ? " end" : "") << "\">" << esc(label(*ls))
      << "<title>launch " << ls->launch << ": steps " << ls->first_step << " to " << ls->last_step
      << ", resumed from the checkpoint saved after step " << ls->first_step - 1 << "</title></text>\n";
  }
  o << "<polyline class=\"loss\" points=\"";
  for (const auto& [s, v] : losses) o << num(X(s), 1) << "," << num(Y(v), 1) << " ";
  o << "\"/>\n";
  if (!validations.empty()) {
    o << "<polyline class=\"val\" points=\"";
    for (const auto& v : validations) o << num(X(v.step), 1) << "," << num(Y(v.loss), 1) << " ";
    o << "\"/>\n";
    for (const auto& v : validations) {
      o << "<circle cx=\"" << num(X(v.step), 1) << "\" cy=\"" << num(Y(v.loss), 1)
        << "\" r=\"3.5\" class=\"valdot\"><title>validation after step " << v.step << ": loss " << num(v.loss, 4)
        << ", accuracy " << pct(v.accuracy) << "</title></circle>\n";
    }
  }
  o << "</svg>\n<div class=\"legend\"><span><i style=\"background:#4e79a7\"></i>training loss (per step)</span>"
    << (validations.empty() ? "" : "<span><i style=\"background:#e15759\"></i>validation loss</span>")
    << (markers.empty() ? "" : "<span><i class=\"mark\"></i>a later launch (resume or restart) begins</span>")
    << "</div>\n";
  if (launches.size() > 1) {
    o << "<p class=\"note\">The run in " << launches.size() << " launches:";
    for (const LaunchSummary& ls : launches) {
      o << (ls.launch > 1 ? ";" : "") << " launch " << ls.launch << ", steps " << ls.first_step << " to " << ls.last_step
        << " (" << ls.steps << (ls.steps == 1 ? " step" : " steps") << ")";
    }
    o << ". The timings on this page are the last launch's only.</p>\n";
  }
  return o.str();
}

const char* kStyle = R"(
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; margin: 24px 32px; color: #222; max-width: 1240px; }
.wide { overflow-x: auto; max-width: 100%; }
h1, h3, .sub, .note, .stages li { overflow-wrap: anywhere; }  /* a long path or name wraps instead of widening the page */
svg.timeline { width: 100%; height: auto; max-width: 1240px; display: block; }
svg.chart { width: 100%; height: auto; max-width: 720px; display: block; }
.later { fill-opacity: 0.6; }
.stages { margin: 4px 0 8px; padding-left: 18px; font-size: 13px; } .stages li { margin: 2px 0; }
h1 { font-size: 22px; margin: 0 0 4px; } h2 { font-size: 17px; margin: 28px 0 8px; border-bottom: 1px solid #ddd; padding-bottom: 4px; }
h3 { font-size: 14px; margin: 14px 0 4px; font-weight: 600; }
.sub { color: #555; margin-bottom: 14px; }
.cards { display: flex; flex-wrap: wrap; gap: 12px; }
.card { border: 1px solid #ddd; border-radius: 6px; padding: 8px 14px; min-width: 170px; }
.card .k { color: #666; font-size: 12px; } .card .v { font-size: 20px; font-weight: 600; } .card .p { color: #555; font-size: 12px; }
table { border-collapse: collapse; margin: 6px 0; font-size: 12.5px; } th, td { padding: 3px 6px; text-align: right; border-bottom: 1px solid #eee; white-space: nowrap; }
th { white-space: normal; vertical-align: bottom; }
th { background: #f6f6f6; font-weight: 600; } td.l, th.l { text-align: left; }
svg text { font: 11px system-ui, sans-serif; }
.tick { fill: #666; text-anchor: middle; } .ytick { fill: #666; text-anchor: end; } .tick.end { text-anchor: end; }
.rowname { fill: #222; text-anchor: end; font-size: 12px; }
.mb { fill: #fff; text-anchor: middle; font-weight: 600; }
.grid { stroke: #e8e8e8; stroke-width: 1; } .lane { fill: #fafafa; stroke: #e2e2e2; }
.legend { display: flex; flex-wrap: wrap; gap: 14px; margin: 4px 0 8px; font-size: 12px; color: #333; }
.legend i { display: inline-block; width: 12px; height: 12px; margin-right: 5px; vertical-align: -2px; border: 1px solid #bbb; }
.legend i.gap { background: #fafafa; }
.idlebar { fill: #fff; stroke: #ccc; } .bar { vertical-align: middle; }
.loss { fill: none; stroke: #4e79a7; stroke-width: 1.5; } .val { fill: none; stroke: #e15759; stroke-width: 1.5; stroke-dasharray: 4 3; }
.valdot { fill: #e15759; }
.launchmark { stroke: #6b6b6b; stroke-width: 1; stroke-dasharray: 3 3; }
.launchlabel { fill: #333; font-size: 11.5px; paint-order: stroke; stroke: #fff; stroke-width: 3px; }
.launchlabel.end { text-anchor: end; }
.legend i.mark { width: 0; border: 0; border-left: 1px dashed #6b6b6b; height: 12px; }
.note { color: #555; font-size: 12.5px; max-width: 1100px; }
code { background: #f3f3f3; padding: 0 3px; border-radius: 3px; }
/* Last, so that it overrides the rules above in a narrow window (the same specificity). */
@media (max-width: 900px) {
  body { margin: 12px; } th, td { padding: 3px 4px; }
  .barcell { display: none; }  /* the bar repeats its row's figures; a narrow window keeps the figures */
}
)";

// ---- The page's sections, in the order render_report_html writes them.

// Whether the page shows the plan beside the measurements: one made for this run's stages.
bool shows_plan(const RunSummary& s) { return s.has_plan && static_cast<int>(s.plan.stages.size()) == s.partitions; }

// Writes the document's head (title, style) and the page's heading with the run's config and shape.
void write_heading(std::ostream& o, const HtmlReportInput& in) {
  const RunSummary& s = in.summary;
  o << "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n<title>gpipe report: "
    << esc(in.title) << "</title>\n<style>" << kStyle << "</style>\n</head>\n<body>\n";
  o << "<h1>gpipe run report: " << esc(in.title) << "</h1>\n<div class=\"sub\">" << esc(in.config) << " &middot; K="
    << s.partitions << " stages, M=" << s.micro_batches << " micro-batches, schedule " << esc(s.schedule)
    << ", recompute "
    << esc(recompute_mode_name(s.recompute)) << ", batch " << s.batch_size << esc(layout_text(s)) << " &middot; "
    << s.timed_steps << " timed steps";
  if (s.launches.size() > 1) {
    const LaunchSummary& now = s.launches.back();
    o << " of launch " << s.timed_launch << " (steps " << now.first_step << " to " << now.last_step
      << "); the loss chart covers all " << s.launches.size() << " launches";
  }
  o << "</div>\n";
}

// Writes one headline figure: what it is, its value, and the plan's under it.
void write_card(std::ostream& o, const std::string& k, const std::string& v, const std::string& p) {
  o << "<div class=\"card\"><div class=\"k\">" << k << "</div><div class=\"v\">" << v << "</div><div class=\"p\">" << p
    << "</div></div>\n";
}

// Writes the headline figures (step time, throughput, bubble, MFU, peak activations), measured against the plan.
void write_cards(std::ostream& o, const RunSummary& s, bool plan) {
  o << "<div class=\"cards\">\n";
  write_card(
      o, "step time (measured)", num(s.step_ms) + " ms",
      plan ? "planned " + num(s.plan.step_ms) + " ms (" + signed_pct(s.plan.step_ms, s.step_ms) + ")" : "no plan");
  write_card(o, "throughput (measured)", num(s.samples_per_second, 1) + " samples/s",
             plan ? "planned " + num(s.plan.samples_per_second, 1) + " samples/s" : "");
  write_card(o, "bubble (measured)", num(s.measured_bubble, 3),
             "formula " + num(s.formula_bubble, 3) + (plan ? " &middot; planned " + num(s.plan.bubble, 3) : "") +
                 (s.predicted_bubble >= 0 ? " &middot; simulated " + num(s.predicted_bubble, 3) : ""));
  if (s.mfu >= 0) {  // report.json's mfu; per stage below it
    std::string per_stage;
    for (const StageSummary& st : s.stages) {
      per_stage += (per_stage.empty() ? "" : " &middot; ") + std::string("stage ") + std::to_string(st.stage) + " " +
                   pct(st.mfu) + " of " + num(st.peak_flops_per_second / 1e9, 1) + " GFLOP/s";
    }
    write_card(o, "MFU (model FLOPs utilization)", pct(s.mfu),
               num(s.useful_flops / (s.step_ms / 1e3) / 1e9, 1) + " of " + num(s.peak_flops_per_second / 1e9, 1) +
                   " GFLOP/s peak<br>" + per_stage);
  }
  // The stage that held the most activations, measured, beside the plan for that same
  // stage (and the plan's own largest, where that is another stage).
  int top = 0;
  for (int k = 0; k < static_cast<int>(s.stages.size()); ++k) {
    if (s.stages[k].peak_activation_bytes > s.stages[top].peak_activation_bytes) top = k;
  }
  std::string planned_text;
  if (plan && !s.stages.empty()) {
    int plan_top = 0;
    for (int k = 0; k < static_cast<int>(s.plan.stages.size()); ++k) {
      if (s.plan.stages[k].activation_bytes > s.plan.stages[plan_top].activation_bytes) plan_top = k;
    }
    const double want = static_cast<double>(s.plan.stages[top].activation_bytes);
    planned_text = "planned " + mb(want) + " for stage " + std::to_string(top) + " (" +
                   signed_pct(want, static_cast<double>(s.stages[top].peak_activation_bytes)) + ")";
    if (s.plan.stages[plan_top].activation_bytes > s.plan.stages[top].activation_bytes) {
      planned_text += " &middot; the plan's largest: stage " + std::to_string(plan_top) + ", " +
                      mb(static_cast<double>(s.plan.stages[plan_top].activation_bytes));
    }
  }
  if (!s.stages.empty()) {
    write_card(o, "peak activations (stage " + std::to_string(top) + ", the largest)",
               mb(static_cast<double>(s.stages[top].peak_activation_bytes)), planned_text);
  }
  o << "</div>\n";
}

// The recorded step's blocks, on the earliest stage's clock; none without a recorded step of this run's stages.
std::vector<std::vector<Block>> measured_rows(const HtmlReportInput& in) {
  const int K = in.summary.partitions;
  std::vector<std::vector<Block>> measured;
  if (in.step != nullptr && static_cast<int>(in.step->stages.size()) == K) {
    double t0 = 1e300;
    for (const auto& st : in.step->stages) t0 = std::min(t0, st.start_ms);
    for (int k = 0; k < K; ++k) {
      measured.emplace_back();
      const StageTrace& t = in.step->stages[k];
      for (size_t i = 0; i < t.ops.size() && i < in.schedule.stages[k].size(); ++i) {
        const double shift = t.start_ms - t0;
        measured.back().push_back({in.schedule.stages[k][i], shift + t.ops[i].start_ms, shift + t.ops[i].end_ms});
      }
    }
  }
  return measured;
}

// Writes the timelines (measured, simulated, planned) on one time scale, with their legend and a note on reading them.
void write_timelines(std::ostream& o, const HtmlReportInput& in, bool plan) {
  const RunSummary& s = in.summary;
  const Schedule& sched = in.schedule;
  o << "<h2>Timeline</h2>\n";
  std::vector<std::string> names;
  for (const auto& st : s.stages) names.push_back("stage " + std::to_string(st.stage) + " · " + st.device);
  const std::vector<std::vector<Block>> measured = measured_rows(in);
  const auto simulated = from_simulation(in.measured_simulation.timeline);
  const auto planned = plan ? from_simulation(s.plan.timeline) : std::vector<std::vector<Block>>{};
  const double scale = std::max({extent(measured), extent(simulated), extent(planned), 1e-6}) * 1.01;
  o << legend(sched.num_chunks(), sched.tensor_lowered && sched.tensor.members > 1);
  if (!measured.empty()) {
    o << "<h3>Measured: step " << in.step->step << " (the median wall time of steps " << in.recorded_first << " to "
      << in.recorded_last << "), " << num(in.step->wall_ms) << " ms</h3>\n"
      << timeline_svg(sched, measured, scale, names);
  } else {
    o << "<p class=\"note\">No step was recorded (trace.steps), so there is no measured timeline.</p>\n";
  }
  if (!simulated.empty() && !simulated[0].empty()) {
    o << "<h3>Simulated: the schedule with the measured mean time of each instruction kind per stage, "
      << num(in.measured_simulation.makespan) << " ms to the last backward (each message delivered in its receiving stage's measured mean delivery time)</h3>\n"
      << timeline_svg(sched, simulated, scale, names);
  }
  if (plan) {
    o << "<h3>Planned before the run: " << num(s.plan.step_ms) << " ms (" << esc(s.plan.source) << ")</h3>\n"
      << timeline_svg(sched, planned, scale, names);
  }
  o << "<p class=\"note\">Gaps are idle time: a stage waiting for a neighbour's message or with nothing to do (the "
       "bubble). The thin lane under each row is communication: sends, and receives that wait for their message. "
       "Hover a block for its times.";
  if (!in.trace_file.empty()) {
    o << " Every recorded step, with message arrows and activation memory, is in <code>" << esc(in.trace_file)
      << "</code>: open it in Perfetto (ui.perfetto.dev) or chrome://tracing.";
  }
  o << "</p>\n";
}

// Writes what each stage runs: its device and its layers in full, chunk by chunk (the
// stage's layer text separates its cells with kChunkSeparator).
void write_stage_list(std::ostream& o, const RunSummary& s) {
  o << "<h2>Stages</h2>\n<ul class=\"stages\">\n";
  for (const StageSummary& m : s.stages) {
    std::vector<std::string> parts;
    const std::string separator = kChunkSeparator;
    for (size_t at = 0;;) {
      const size_t bar = m.layers.find(separator, at);
      parts.push_back(m.layers.substr(at, bar == std::string::npos ? std::string::npos : bar - at));
      if (bar == std::string::npos) break;
      at = bar + separator.size();
    }
    o << "<li><b>stage " << m.stage << "</b> &middot; " << esc(m.device) << ": ";
    for (size_t j = 0; j < parts.size(); ++j) {
      o << (j ? "; " : "") << (parts.size() > 1 ? "chunk " + chunk_letter(static_cast<int>(j)) + ": layers " : "layers ")
        << esc(parts[j]);
    }
    o << "</li>\n";
  }
  o << "</ul>\n";
}

// One row of the stage table: a stage's times, measured or planned; `group`: with the
// tensor group's column.
void write_stage_times(std::ostream& o, const StageTime& t, double span_ms, bool group) {
  o << "<td class=\"l barcell\">" << stage_bar(t.busy_ms - t.recompute_ms, t.recompute_ms, t.comm_ms, t.idle_ms, span_ms)
    << "</td><td>" << num(t.forward_ms) << "</td><td>" << num(t.recompute_ms) << "</td><td>"
    << num(t.backward_ms - t.weight_ms) << "</td><td>" << num(t.weight_ms) << "</td><td>"
    << num(t.comm_ms - t.collective_ms - t.group_ms) << "</td><td>" << num(t.collective_ms) << "</td><td>"
    << (group ? num(t.group_ms) + "</td><td>" : std::string()) << num(t.idle_ms)
    << "</td><td>" << num(t.optimizer_ms) << "</td><td>" << pct(t.utilization) << "</td></tr>\n";
}

// Writes the per-stage table: where each stage's span went and its times, measured and planned.
void write_stage_table(std::ostream& o, const RunSummary& s, bool plan) {
  o << "<h3>Where each stage's time went, per step (ms)</h3>\n<div class=\"legend barcell\"><span><i style=\"background:"
    << colour(Op::kBackward) << "\"></i>compute (forward, backward, W)</span><span><i style=\"background:"
    << colour(Op::kRecompute) << "\"></i>recompute</span><span><i style=\"background:"
    << colour(Op::kSendActivation) << "\"></i>communication (sends, collectives)</span><span><i "
    << "class=\"gap\"></i>idle</span></div>\n";
  // A tensor-parallel run's stages spend time in their tensor group's collectives (inside
  // F, R, B and W, counted as communication): a column of its own, apart from the sends.
  bool group = false;
  for (int k = 0; k < s.partitions; ++k) {
    group = group || s.stages[k].group_ms > 0 || (plan && s.plan.stages[k].group_ms > 0);
  }
  o << "<div class=\"wide\"><table>\n<tr><th class=\"l\">stage</th><th class=\"l\"></th><th class=\"l barcell\">where "
       "the span went</th><th>forward</th><th>recompute</th><th>backward (B)</th><th>weight grad (W)</th><th>sends</th>"
       "<th>collectives</th>"
    << (group ? "<th>tensor group</th>" : "") << "<th>idle</th><th>optimizer</th><th>util</th></tr>\n";
  for (int k = 0; k < s.partitions; ++k) {
    const StageSummary& m = s.stages[k];
    o << "<tr><td class=\"l\" rowspan=\"" << (plan ? 2 : 1) << "\">" << k << "</td><td class=\"l\">measured</td>";
    write_stage_times(o, m, s.span_ms, group);
    if (plan) {
      o << "<tr><td class=\"l\">planned</td>";
      write_stage_times(o, s.plan.stages[k], s.plan.span_ms, group);
    }
  }
  o << "</table></div>\n<p class=\"note\">backward (B) is the input gradient; W, the weight gradient, is its own "
       "instruction under zero bubble and part of B otherwise. Collectives (the replicas' gradient sum, a tied weight's "
       "two gradients, the gradient norm): their own time; a stage's wait for the others to arrive is idle.</p>\n";
}

// Writes each stage's memory: the activations measured at their peak beside the plan's
// prediction, the plan's weights, gradients and optimizer state, and the optimizer state
// measured (one replica's).
void write_memory_table(std::ostream& o, const RunSummary& s, bool plan) {
  o << "<h3>Memory per stage</h3>\n<div class=\"wide\"><table><tr><th class=\"l\">stage</th><th>activations "
       "measured (peak)</th>";
  if (plan) {
    o << "<th>activations planned</th><th>planned vs measured</th><th>weights</th><th>gradients</th><th>optimizer "
         "state planned</th>";
  }
  o << "<th>optimizer state measured</th>";
  if (plan) o << "<th>total planned</th>";
  // The stage's device's allocator at its most (StageTrace::device_peak_bytes): every tensor
  // of the process there; stages sharing a device in one process read one count.
  o << "<th>device at its most, measured</th>";
  o << "</tr>\n";
  for (int k = 0; k < s.partitions; ++k) {
    const double measured = static_cast<double>(s.stages[k].peak_activation_bytes);
    o << "<tr><td class=\"l\">" << k << "</td><td>" << mb(measured) << "</td>";
    if (plan) {
      const PlannedStage& p = s.plan.stages[k];
      o << "<td>" << mb(static_cast<double>(p.activation_bytes)) << "</td><td>"
        << signed_pct(static_cast<double>(p.activation_bytes), measured) << "</td><td>"
        << mb(static_cast<double>(p.weight_bytes)) << "</td><td>" << mb(static_cast<double>(p.gradient_bytes))
        << "</td><td>" << mb(static_cast<double>(p.optimizer_bytes)) << "</td>";
    }
    o << "<td>" << mb(static_cast<double>(s.stages[k].optimizer_bytes)) << "</td>";
    if (plan) o << "<td>" << mb(static_cast<double>(s.plan.stages[k].total_bytes())) << "</td>";
    const int64_t device = s.stages[k].device_peak_bytes;
    o << "<td>" << (device > 0 ? mb(static_cast<double>(device)) + " (" + s.stages[k].device + ")" : "-") << "</td>";
    o << "</tr>\n";
  }
  o << "</table></div>\n";
}

// Writes the step as a whole: step time, span, bubble and samples/s, measured, planned, simulated and by formula.
void write_step_table(std::ostream& o, const RunSummary& s, bool plan) {
  o << "<h2>Step</h2>\n<div class=\"wide\"><table>\n<tr><th class=\"l\"></th><th>measured</th><th>planned</th><th>simulated from "
       "measured op times</th><th>schedule's formula</th></tr>\n";
  o << "<tr><td class=\"l\">step time</td><td>" << num(s.step_ms) << " ms</td><td>"
    << (plan ? num(s.plan.step_ms) + " ms" : "") << "</td><td></td><td></td></tr>\n";
  o << "<tr><td class=\"l\">span (to the last backward)</td><td>" << num(s.span_ms) << " ms</td><td>"
    << (plan ? num(s.plan.span_ms) + " ms" : "") << "</td><td>" << num(s.predicted_span_ms) << " ms</td><td></td></tr>\n";
  o << "<tr><td class=\"l\">bubble</td><td>" << num(s.measured_bubble, 3) << "</td><td>"
    << (plan ? num(s.plan.bubble, 3) : "") << "</td><td>"
    << (s.predicted_bubble >= 0 ? num(s.predicted_bubble, 3) : "") << "</td><td>" << num(s.formula_bubble, 3)
    << "</td></tr>\n";
  o << "<tr><td class=\"l\">samples/s</td><td>" << num(s.samples_per_second, 1) << "</td><td>"
    << (plan ? num(s.plan.samples_per_second, 1) : "") << "</td><td></td><td></td></tr>\n</table></div>\n";
  // A measured step more than 15% off the plan's prediction is said, as gpipe plan --sweep says it.
  if (plan && s.plan.step_ms > 0 && s.step_ms > 0 && std::fabs(s.step_ms / s.plan.step_ms - 1.0) > 0.15) {
    char pct[32];
    std::snprintf(pct, sizeof pct, "%+.0f%%", 100.0 * (s.step_ms / s.plan.step_ms - 1.0));
    o << "<p class=\"note\" id=\"prediction-off\">The measured step time is " << pct << " off the planned "
      << num(s.plan.step_ms) << " ms (costs: " << esc(s.plan.source) << "): the plan's ranking of other "
      << "configurations may be off as much; <code>gpipe profile CONFIG --sweep</code> measures the costs, and "
      << "<code>gpipe plan CONFIG --sweep</code> times its best plans before it recommends one.</p>\n";
  }
}

// Writes the loss chart of the whole run, the note on how the page's figures were made, and the document's end.
void write_loss_and_end(std::ostream& o, const HtmlReportInput& in) {
  o << "<h2>Loss</h2>\n" << loss_svg(in.losses, in.validations, in.summary.launches);
  o << "<p class=\"note\">Written by gpipe with report.json beside it. Bubble: 1 - (sum of the stages' busy time) / "
       "(K x span); measured from the timed steps, planned by simulating the schedule with the plan's op costs, "
       "simulated with the measured mean op times, and by the schedule's formula (K-1)/(vM+K-1).</p>\n";
  o << "</body>\n</html>\n";
}

}  // namespace

std::string render_report_html(const HtmlReportInput& in) {
  const RunSummary& s = in.summary;
  const bool plan = shows_plan(s);
  std::ostringstream o;
  write_heading(o, in);
  if (s.timed_steps == 0 && in.step == nullptr && in.measured_simulation.timeline.empty()) {
    // No step of this launch was timed (a finished run's resume writes its page again from
    // the checkpoint's history): no figure of time or memory to show, not zeros.
    o << "<p class=\"note\" id=\"no-timings\">No step of this launch was timed, so this page shows no times, "
         "memory or bubble: it holds the run's losses and validations, from its checkpoint's history. The "
         "launch that ran the steps ended before it wrote its report.</p>\n";
    write_stage_list(o, s);
    write_loss_and_end(o, in);
    return o.str();
  }
  write_cards(o, s, plan);
  write_timelines(o, in, plan);
  write_stage_list(o, s);
  write_stage_table(o, s, plan);
  write_memory_table(o, s, plan);
  write_step_table(o, s, plan);
  write_loss_and_end(o, in);
  return o.str();
}

}  // namespace pipeline
}  // namespace gpipe
