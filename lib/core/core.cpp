#include "core/log.h"
#include "core/registry.h"

#include <cstdio>
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

static size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j)
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] != b[j - 1])});
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

std::vector<std::string> closest_names(const std::string& name, const std::vector<std::string>& names,
                                       size_t n) {
  std::vector<std::pair<size_t, std::string>> scored;
  for (auto& c : names) scored.emplace_back(edit_distance(name, c), c);
  std::sort(scored.begin(), scored.end());
  std::vector<std::string> out;
  for (size_t i = 0; i < scored.size() && i < n; ++i) out.push_back(scored[i].second);
  return out;
}

namespace log {
namespace {
std::mutex g_mu;
int g_rank = 0;
FILE* g_file = nullptr;
}  // namespace

void set_rank(int rank) { g_rank = rank; }

void set_file(const std::string& path) {
  std::lock_guard<std::mutex> lk(g_mu);
  if (g_file) std::fclose(g_file);
  g_file = path.empty() ? nullptr : std::fopen(path.c_str(), "a");
}

void write_info(const std::string& line) {
  if (g_rank != 0) return;
  std::lock_guard<std::mutex> lk(g_mu);
  std::fprintf(stdout, "%s\n", line.c_str());
  std::fflush(stdout);
  if (g_file) std::fprintf(g_file, "%s\n", line.c_str()), std::fflush(g_file);
}

void write_warning(const std::string& line) {
  std::lock_guard<std::mutex> lk(g_mu);
  std::fprintf(stderr, "WARNING: %s\n", line.c_str());
  std::fflush(stderr);
  if (g_file) std::fprintf(g_file, "WARNING: %s\n", line.c_str()), std::fflush(g_file);
}

}  // namespace log
}  // namespace imgtrain
