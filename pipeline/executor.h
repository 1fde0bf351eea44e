// The Executor API (a schedule run with one worker thread per stage): a public entry
// point of pipeline/ (target //pipeline:executor). It lives in pipeline/executor/executor.h.
#pragma once

#include "pipeline/executor/executor.h"
