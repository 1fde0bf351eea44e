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

std::string mb(double bytes) { return num(bytes / 1e6, bytes < 1e7 ? 2 : 1) + " MB"; }

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
    case Op::kGradientNorm: return "#b07aa1";
  }
  return "#000";
}

// One block of a timeline, whatever it came from.
struct Block {
  Instruction ins;
  double start, end;  // ms from the step's start
};

// ---- The timeline: one row per stage (compute lane, communication lane under it).

constexpr double kLeft = 150, kWidth = 1000, kLane = 24, kCommLane = 9, kRowGap = 10;

std::string timeline_svg(const Schedule& s, const std::vector<std::vector<Block>>& rows, double scale_ms,
                         const std::vector<std::string>& names) {
  const int K = static_cast<int>(rows.size());
  const double row_h = kLane + kCommLane + kRowGap;
  const double height = 22 + K * row_h + 6;
  const double px = kWidth / std::max(scale_ms, 1e-9);
  std::ostringstream o;
  o << "<svg class=\"timeline\" width=\"" << kLeft + kWidth + 20 << "\" height=\"" << height << "\" viewBox=\"0 0 "
    << kLeft + kWidth + 20 << " " << height << "\" role=\"img\">\n";
  // Time axis: about ten ticks at a round step.
  const double raw = scale_ms / 10;
  const double mag = std::pow(10.0, std::floor(std::log10(std::max(raw, 1e-9))));
  const double step = raw / mag < 2 ? 2 * mag : raw / mag < 5 ? 5 * mag : 10 * mag;
  for (double t = 0; t <= scale_ms + 1e-9; t += step) {
    const double x = kLeft + t * px;
    o << "<line x1=\"" << x << "\" y1=\"14\" x2=\"" << x << "\" y2=\"" << height - 6
      << "\" class=\"grid\"/><text x=\"" << x << "\" y=\"11\" class=\"tick\">" << num(t, step < 1 ? 1 : 0)
      << " ms</text>\n";
  }
  for (int k = 0; k < K; ++k) {
    const double y = 20 + k * row_h;
    o << "<text x=\"" << kLeft - 8 << "\" y=\"" << y + kLane / 2 + 4 << "\" class=\"rowname\">" << esc(names[k])
      << "</text>\n";
    o << "<rect x=\"" << kLeft << "\" y=\"" << y << "\" width=\"" << kWidth << "\" height=\"" << kLane + kCommLane
      << "\" class=\"lane\"/>\n";
    for (const Block& b : rows[k]) {
      const bool comm = is_communication(b.ins.op) || is_collective(b.ins.op);
      const double x = kLeft + b.start * px;
      const double w = std::max(0.0, (b.end - b.start) * px);
      if (w <= 0 && comm) continue;
      const double by = comm ? y + kLane + 1 : y;
      const double bh = comm ? kCommLane - 2 : kLane;
      const std::string name = instruction_str(s, k, b.ins);
      o << "<rect x=\"" << num(x, 2) << "\" y=\"" << by << "\" width=\"" << num(std::max(w, 0.6), 2) << "\" height=\""
        << bh << "\" fill=\"" << colour(b.ins.op) << "\"><title>" << esc(name) << " (" << op_name(b.ins.op)
        << "), stage " << k << ": " << num(b.start, 3) << " to " << num(b.end, 3) << " ms (" << num(b.end - b.start, 3)
        << " ms)</title></rect>\n";
      if (has_cell(b.ins.op) && !comm && b.ins.micro_batch >= 0 && w >= 12) {
        o << "<text x=\"" << num(x + w / 2, 2) << "\" y=\"" << y + kLane / 2 + 4 << "\" class=\"mb\">"
          << b.ins.micro_batch << "</text>\n";
      }
    }
  }
  o << "</svg>\n";
  return o.str();
}

std::string legend() {
  std::ostringstream o;
  o << "<div class=\"legend\">";
  const std::pair<Op, const char*> items[] = {
      {Op::kForward, "forward"},           {Op::kRecompute, "recompute"},
      {Op::kBackward, "backward"},         {Op::kBackwardWeight, "weight gradient (W)"},
      {Op::kOptimizerStep, "optimizer"},   {Op::kSendActivation, "send"},
      {Op::kRecvActivation, "receive (waiting for the neighbour)"},
      {Op::kReduceGradients, "collective (replicas' gradient sum, tied weight, gradient norm)"}};
  for (const auto& [op, text] : items) {
    o << "<span><i style=\"background:" << colour(op) << "\"></i>" << text << "</span>";
  }
  o << "<span><i class=\"gap\"></i>idle (gap)</span></div>\n";
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
  const double w = 220;
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
  int last_step = 0;
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
  auto X = [&](double s) { return l + (last_step > 0 ? s / last_step : 0.5) * (w - l - r); };
  // Marker labels sit above the plot, about 6 px a character; each row keeps its rightmost end.
  std::vector<double> row_end;
  auto label = [](const LaunchSummary& ls) {
    return "launch " + std::to_string(ls.launch) + ": resumed at step " + std::to_string(ls.first_step);
  };
  for (size_t i = 1; i < launches.size(); ++i) {
    const LaunchSummary& ls = launches[i];
    if (ls.first_step < 0 || ls.first_step > last_step) continue;
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
  o << "<text x=\"" << l << "\" y=\"" << height - 8 << "\" class=\"tick\">step 0</text><text x=\"" << w - r
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
h1 { font-size: 22px; margin: 0 0 4px; } h2 { font-size: 17px; margin: 28px 0 8px; border-bottom: 1px solid #ddd; padding-bottom: 4px; }
h3 { font-size: 14px; margin: 14px 0 4px; font-weight: 600; }
.sub { color: #555; margin-bottom: 14px; }
.cards { display: flex; flex-wrap: wrap; gap: 12px; }
.card { border: 1px solid #ddd; border-radius: 6px; padding: 8px 14px; min-width: 170px; }
.card .k { color: #666; font-size: 12px; } .card .v { font-size: 20px; font-weight: 600; } .card .p { color: #555; font-size: 12px; }
table { border-collapse: collapse; margin: 6px 0; font-size: 13px; } th, td { padding: 3px 7px; text-align: right; border-bottom: 1px solid #eee; white-space: nowrap; }
th { background: #f6f6f6; font-weight: 600; } td.l, th.l { text-align: left; }
svg text { font: 11px system-ui, sans-serif; }
.tick { fill: #666; text-anchor: middle; } .ytick { fill: #666; text-anchor: end; }
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
    << esc(recompute_mode_name(s.recompute)) << ", batch " << s.batch_size << " &middot; " << s.timed_steps << " timed steps";
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

// Writes the headline figures (step time, throughput, bubble, peak activations), measured against the plan.
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
  int64_t peak = 0;
  for (const auto& st : s.stages) peak = std::max(peak, st.peak_activation_bytes);
  int64_t planned_peak = 0;
  if (plan) {
    for (const auto& st : s.plan.stages) planned_peak = std::max(planned_peak, st.activation_bytes);
  }
  write_card(o, "peak activations (largest stage)", mb(static_cast<double>(peak)),
             plan ? "planned " + mb(static_cast<double>(planned_peak)) : "");
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
  o << legend();
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

// Writes the per-stage table: where each stage's span went and its times, measured and planned.
void write_stage_table(std::ostream& o, const RunSummary& s, bool plan) {
  o << "<h2>Stages</h2>\n<div class=\"legend\"><span><i style=\"background:" << colour(Op::kBackward)
    << "\"></i>compute (forward, backward, W)</span><span><i style=\"background:" << colour(Op::kRecompute)
    << "\"></i>recompute</span><span><i style=\"background:" << colour(Op::kSendActivation)
    << "\"></i>communication (sends)</span><span><i class=\"gap\"></i>idle</span></div>\n";
  o << "<table>\n<tr><th class=\"l\">stage</th><th class=\"l\">layers</th><th class=\"l\"></th><th "
       "class=\"l\">where the span went</th><th>fwd ms</th><th>recomp ms</th><th>bwd ms</th><th>comm ms</th><th>idle "
       "ms</th><th>opt ms</th><th>util</th><th>peak act</th></tr>\n";
  for (int k = 0; k < s.partitions; ++k) {
    const StageSummary& m = s.stages[k];
    o << "<tr><td class=\"l\" rowspan=\"" << (plan ? 2 : 1) << "\">" << k << " &middot; " << esc(m.device)
      << "</td><td class=\"l\" rowspan=\"" << (plan ? 2 : 1) << "\">" << esc(m.layers.size() > 40 ? m.layers.substr(0, 38) + "…" : m.layers) << "</td><td class=\"l\">measured</td><td class=\"l\">"
      << stage_bar(m.busy_ms - m.recompute_ms, m.recompute_ms, m.comm_ms, m.idle_ms, s.span_ms) << "</td><td>"
      << num(m.forward_ms) << "</td><td>" << num(m.recompute_ms) << "</td><td>" << num(m.backward_ms) << "</td><td>"
      << num(m.comm_ms) << "</td><td>" << num(m.idle_ms) << "</td><td>" << num(m.optimizer_ms) << "</td><td>"
      << pct(m.utilization) << "</td><td>" << mb(static_cast<double>(m.peak_activation_bytes)) << "</td></tr>\n";
    if (plan) {
      const PlannedStage& p = s.plan.stages[k];
      o << "<tr><td class=\"l\">planned</td><td class=\"l\">"
        << stage_bar(p.busy_ms - p.recompute_ms, p.recompute_ms, p.comm_ms, p.idle_ms, s.plan.span_ms) << "</td><td>"
        << num(p.forward_ms) << "</td><td>" << num(p.recompute_ms) << "</td><td>" << num(p.backward_ms) << "</td><td>"
        << num(p.comm_ms) << "</td><td>" << num(p.idle_ms) << "</td><td>" << num(p.optimizer_ms) << "</td><td>"
        << pct(p.utilization) << "</td><td>" << mb(static_cast<double>(p.activation_bytes)) << "</td></tr>\n";
    }
  }
  o << "</table>\n";
}

// Writes the plan's memory per stage (weights, gradients, optimizer state, activations) and the activations measured.
void write_planned_memory(std::ostream& o, const RunSummary& s) {
  o << "<h3>Planned memory per stage</h3>\n<table><tr><th class=\"l\">stage</th><th>weights</th><th>gradients</th>"
       "<th>optimizer state</th><th>activations (peak)</th><th>total</th><th>activations measured</th></tr>\n";
  for (int k = 0; k < s.partitions; ++k) {
    const PlannedStage& p = s.plan.stages[k];
    o << "<tr><td class=\"l\">" << k << "</td><td>" << mb(static_cast<double>(p.weight_bytes)) << "</td><td>"
      << mb(static_cast<double>(p.gradient_bytes)) << "</td><td>" << mb(static_cast<double>(p.optimizer_bytes))
      << "</td><td>" << mb(static_cast<double>(p.activation_bytes)) << "</td><td>"
      << mb(static_cast<double>(p.total_bytes())) << "</td><td>"
      << mb(static_cast<double>(s.stages[k].peak_activation_bytes)) << "</td></tr>\n";
  }
  o << "</table>\n";
}

// Writes the step as a whole: step time, span, bubble and samples/s, measured, planned, simulated and by formula.
void write_step_table(std::ostream& o, const RunSummary& s, bool plan) {
  o << "<h2>Step</h2>\n<table>\n<tr><th class=\"l\"></th><th>measured</th><th>planned</th><th>simulated from "
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
    << (plan ? num(s.plan.samples_per_second, 1) : "") << "</td><td></td><td></td></tr>\n</table>\n";
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
  write_cards(o, s, plan);
  write_timelines(o, in, plan);
  write_stage_table(o, s, plan);
  if (plan) write_planned_memory(o, s);
  write_step_table(o, s, plan);
  write_loss_and_end(o, in);
  return o.str();
}

}  // namespace pipeline
}  // namespace gpipe
