// The engine's commands: `imgtrain train` (engine/fit.cpp), `validate` (engine/validate.cpp)
// and `benchmark` (engine/benchmark.cpp), each from a validated Config. Each returns the process
// exit code; user errors are thrown as UserError.
#pragma once

namespace imgtrain::cli {
struct Config;
}

namespace imgtrain::engine {

int train(const cli::Config& cfg);
// timm validate.py: one checkpoint or pretrained model over one split, timm's result row.
int validate(const cli::Config& cfg);
// timm benchmark.py: synthetic inputs, inference and/or train steps, timm's result fields.
int benchmark(const cli::Config& cfg);

}  // namespace imgtrain::engine
