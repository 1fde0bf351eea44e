// report.html: one self-contained page per run (inline SVG and CSS, no script, nothing
// fetched from the network) that shows where each stage's time went: the measured
// timeline of one step (the median of the recorded ones), one row per stage, coloured
// by instruction with micro-batch numbers (and chunk letters: 3a, 3b), idle time as
// gaps; under it the same step as the simulator plans it from the measured mean op
// times and from the plan's own costs; each stage's layers in full; per stage forward,
// recompute, B, W, sends, collectives, idle and optimizer time, measured and planned;
// activation memory per stage measured beside planned (MiB); the bubble measured, by the
// schedule's formula and as planned; samples/s; the loss and validation curves of the
// whole run, with a marker where each later launch (a resume, a restart) began. Every
// timing is the last launch's (RunSummary::timed_launch). It reads from 800 px wide up.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "pipeline/report/report.h"
#include "pipeline/report/trace.h"
#include "pipeline/schedule/schedule.h"

namespace gpipe {
namespace pipeline {

struct HtmlReportInput {
  std::string title;   // the config's name
  std::string config;  // its file
  RunSummary summary;  // measured, with the plan's prediction when it has one
  Schedule schedule;
  const RecordedStep* step = nullptr;  // the step whose timeline is drawn; none: no timeline
  int recorded_first = 0, recorded_last = -1;  // the steps it was chosen from
  Simulation measured_simulation;  // ReportBuilder::measured_simulation()
  std::vector<std::pair<int, double>> losses;  // every launch's (ReportBuilder::losses())
  std::vector<ReportBuilder::Validation> validations;
  std::string trace_file;  // "trace.json" when one was written next to the page
};

std::string render_report_html(const HtmlReportInput& input);

}  // namespace pipeline
}  // namespace gpipe
