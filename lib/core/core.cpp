#include "core/log.h"
#include "core/registry.h"
#include "core/rng.h"

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <unistd.h>
#include <numbers>
#include <stdexcept>
#include <mutex>

namespace imgtrain {

bool wildcard_match(const std::string& p, const std::string& s) {
  // Iterative glob with backtracking to the last '*'.
  size_t i = 0, j = 0, star = std::string::npos, mark = 0;
  while (j < s.size()) {
    if (i < p.size() && (p[i] == '?' || p[i] == s[j])) {
      ++i, ++j;
    } else if (i < p.size() && p[i] == '*') {
      star = i++, mark = j;
    } else if (star != std::string::npos) {
      i = star + 1, j = ++mark;
    } else {
      return false;
    }
  }
  while (i < p.size() && p[i] == '*') ++i;
  return i == p.size();
}

// Levenshtein distance, or some value above `limit` as soon as every cell of a row exceeds it (the
// candidate has lost). Outside the fuzzers' coverage instrumentation: its comparisons carry no
// input structure, and instrumented they were most of each fuzz_config execution.
#if defined(__clang__)
__attribute__((no_sanitize("coverage")))
#endif
size_t edit_distance(const std::string& a, const std::string& b, size_t limit) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    size_t row_min = cur[0];
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t v = prev[j - 1] + (a[i - 1] != b[j - 1]);  // plain code: std::min's helpers would be instrumented
      if (prev[j] + 1 < v) v = prev[j] + 1;
      if (cur[j - 1] + 1 < v) v = cur[j - 1] + 1;
      cur[j] = v;
      if (v < row_min) row_min = v;
    }
    if (row_min > limit) return row_min;
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

std::vector<std::string> closest_names(const std::string& name, const std::vector<std::string>& names,
                                       size_t n) {
  if (n == 0) return {};
  std::vector<std::pair<size_t, std::string>> scored;  // the best n so far, sorted
  // a typo is short; a 10,000-character "name" (a pasted file) is scored by its start
  const std::string head = name.substr(0, 64);
  for (auto& c : names) {
    // the length difference bounds the distance from below: most candidates need no table
    const size_t bound = head.size() > c.size() ? head.size() - c.size() : c.size() - head.size();
    if (scored.size() >= n && std::pair{bound, c} >= scored.back()) continue;
    const size_t limit = scored.size() >= n ? scored.back().first : SIZE_MAX;
    scored.emplace_back(edit_distance(head, c, limit), c);
    std::sort(scored.begin(), scored.end());
    if (scored.size() > n) scored.pop_back();
  }
  std::vector<std::string> out;
  for (size_t i = 0; i < scored.size() && i < n; ++i) out.push_back(scored[i].second);
  return out;
}

namespace log {
namespace {
std::mutex g_mu;
int g_rank = 0;
FILE* g_file = nullptr;
// Lines logged before the run folder exists (set-up, model, learning rate) are kept and written
// first when the first log file opens, so log.txt holds the whole run. Bounded: a command that
// never opens a file keeps only its first lines.
bool g_buffering = true;
std::vector<std::string> g_early;
constexpr size_t kMaxEarly = 512;

void to_file(const std::string& text) {
  if (g_file) std::fprintf(g_file, "%s\n", text.c_str()), std::fflush(g_file);
  else if (g_buffering && g_early.size() < kMaxEarly) g_early.push_back(text);
}

bool g_status_shown = false;
void clear_status() {
  if (!g_status_shown) return;
  std::fputs("\r\033[K", stdout);
  std::fflush(stdout);
  g_status_shown = false;
}
}  // namespace

bool status_enabled() {
  static const bool tty = [] {
    const char* env = std::getenv("IMGTRAIN_PROGRESS");
    if (env && std::string(env) == "0") return false;
    return ::isatty(::fileno(stdout)) == 1;
  }();
  return tty && g_rank == 0;
}

void status(const std::string& text) {
  if (!status_enabled()) return;
  std::lock_guard<std::mutex> lk(g_mu);
  std::fprintf(stdout, "\r\033[K%s", text.c_str());
  std::fflush(stdout);
  g_status_shown = true;
}

void set_rank(int rank) { g_rank = rank; }

void set_file(const std::string& path) {
  std::lock_guard<std::mutex> lk(g_mu);
  if (g_file) std::fclose(g_file);
  g_file = path.empty() ? nullptr : std::fopen(path.c_str(), "a");
  if (!g_file) return;
  for (const auto& l : g_early) std::fprintf(g_file, "%s\n", l.c_str());
  std::fflush(g_file);
  g_early.clear();
  g_early.shrink_to_fit();
  g_buffering = false;
}

void write_info(const std::string& line) {
  if (g_rank != 0) return;
  std::lock_guard<std::mutex> lk(g_mu);
  clear_status();
  std::fprintf(stdout, "%s\n", line.c_str());
  std::fflush(stdout);
  to_file(line);
}

void write_warning(const std::string& line) {
  std::lock_guard<std::mutex> lk(g_mu);
  clear_status();
  std::fprintf(stderr, "WARNING: %s\n", line.c_str());
  std::fflush(stderr);
  to_file("WARNING: " + line);
}

}  // namespace log

// Marsaglia & Tsang's gamma sampler (boosted below shape 1).
namespace {
double gamma_ge1(double shape, std::mt19937_64& rng) {
  const double d = shape - 1.0 / 3.0, c = 1.0 / std::sqrt(9.0 * d);
  for (;;) {
    double x = sample_gauss(0, 1, rng);
    double v = 1.0 + c * x;
    if (v <= 0) continue;
    v = v * v * v;
    double u = uniform01(rng);
    if (u < 1.0 - 0.0331 * x * x * x * x) return d * v;
    if (std::log(u) < 0.5 * x * x + d * (1.0 - v + std::log(v))) return d * v;
  }
}


}  // namespace

double uniform01(std::mt19937_64& rng) { return double(rng() >> 11) * 0x1.0p-53; }

double sample_gauss(double mean, double std, std::mt19937_64& rng) {
  // Box-Muller without a cached second value, so each draw depends on the generator state only.
  const double u1 = 1.0 - uniform01(rng), u2 = uniform01(rng);
  return mean + std * std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
}

double sample_gamma(double shape, std::mt19937_64& rng) {
  if (!(shape > 0)) throw std::invalid_argument("sample_gamma: shape must be > 0");
  if (shape >= 1) return gamma_ge1(shape, rng);
  double g = gamma_ge1(shape + 1.0, rng);
  return g * std::pow(1.0 - uniform01(rng), 1.0 / shape);
}

double sample_beta(double a, double b, std::mt19937_64& rng) {
  double x = sample_gamma(a, rng), y = sample_gamma(b, rng);
  if (x + y == 0) return uniform01(rng) < a / (a + b) ? 1.0 : 0.0;  // both underflowed: tiny a, b
  return x / (x + y);
}

std::vector<float> sample_dirichlet(double alpha, int n, std::mt19937_64& rng) {
  std::vector<double> g(size_t(std::max(n, 0)));
  double sum = 0;
  for (auto& v : g) sum += (v = sample_gamma(alpha, rng));
  std::vector<float> out;
  for (double v : g) out.push_back(sum > 0 ? float(v / sum) : float(1.0 / n));
  return out;
}


}  // namespace imgtrain
