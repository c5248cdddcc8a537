// Which ops a piece of code calls (RecordFunction on this thread): to see which kernel ran.
#pragma once
#include <ATen/record_function.h>

#include <functional>
#include <map>
#include <set>
#include <string>

namespace test {

// How many times `f` calls each op on this thread. The callback goes away however f ends (a
// failed REQUIRE throws), so it never writes into a finished call's map.
inline std::map<std::string, int> op_counts(const std::function<void()>& f) {
  static thread_local std::map<std::string, int>* counts_now = nullptr;
  std::map<std::string, int> counts;
  struct Tracing {
    at::CallbackHandle handle;
    explicit Tracing(std::map<std::string, int>* c) {
      counts_now = c;
      handle = at::addThreadLocalCallback(at::RecordFunctionCallback(
          [](const at::RecordFunction& r) -> std::unique_ptr<at::ObserverContext> {
            if (counts_now) ++(*counts_now)[r.name()];
            return nullptr;
          }));
    }
    ~Tracing() {
      at::removeCallback(handle);
      counts_now = nullptr;
    }
  } tracing(&counts);
  f();
  return counts;
}

// The names of the ops `f` calls on this thread.
inline std::set<std::string> ops_called(const std::function<void()>& f) {
  std::set<std::string> names;
  for (const auto& [name, n] : op_counts(f)) names.insert(name);
  return names;
}

// Whether one of `names` contains `part` (autograd nodes carry their C++ type in the name).
inline bool any_contains(const std::set<std::string>& names, const std::string& part) {
  for (const auto& n : names)
    if (n.find(part) != std::string::npos) return true;
  return false;
}

}  // namespace test
