// The benches' timer: the best of `passes` runs of f, in milliseconds (header only: each bench
// compiles alone, with the build line in its own header).
#pragma once
#include <algorithm>
#include <chrono>

template <typename F>
double best_ms(F f, int passes) {
  double best = 1e30;
  for (int i = 0; i < passes; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    best = std::min(best, std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}
