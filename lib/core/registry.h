// A name -> entry registry with shell-style wildcard listing and "did you mean" suggestions.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace imgtrain {

// fnmatch-style match supporting '*' and '?' (what `imgtrain models 'resnet*'` takes).
bool wildcard_match(const std::string& pattern, const std::string& name);
// The edit distance (Levenshtein) between a and b; once every path exceeds `limit`, some value above it.
size_t edit_distance(const std::string& a, const std::string& b, size_t limit = SIZE_MAX);
// Up to `n` names closest to `name` by edit distance (ties broken by name).
std::vector<std::string> closest_names(const std::string& name, const std::vector<std::string>& names,
                                       size_t n = 3);

template <typename Entry>
class Registry {
 public:
  void add(const std::string& name, Entry e) { entries_[name] = std::move(e); }
  const Entry* find(const std::string& name) const {
    auto it = entries_.find(name);
    return it == entries_.end() ? nullptr : &it->second;
  }
  std::vector<std::string> names(const std::string& pattern = "*") const {
    std::vector<std::string> out;
    for (auto& [k, v] : entries_)
      if (wildcard_match(pattern, k)) out.push_back(k);
    return out;
  }

 private:
  std::map<std::string, Entry> entries_;
};

}  // namespace imgtrain
