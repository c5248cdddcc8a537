// `imgtrain train` and `imgtrain validate`: the classification task end to end, from a validated
// Config to a trained model, timm's logs, summary.csv, args.yaml and checkpoints.
#pragma once
#include "cli/config.h"

namespace imgtrain::engine {

// Both return the process exit code; user errors are thrown as UserError.
int train(const cli::Config& cfg);
int validate(const cli::Config& cfg);

}  // namespace imgtrain::engine
