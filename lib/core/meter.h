// timm's AverageMeter: the last value and the count-weighted running average (log lines, metrics).
#pragma once
#include <cstdint>

namespace imgtrain {

struct AverageMeter {
  double val = 0, sum = 0;
  int64_t count = 0;
  void update(double v, int64_t n = 1) {
    val = v;
    sum += v * double(n);
    count += n;
  }
  double avg() const { return count ? sum / double(count) : 0.0; }
};

}  // namespace imgtrain
