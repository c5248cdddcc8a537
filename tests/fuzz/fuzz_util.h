// Shared by the libFuzzer harnesses: what a harness may see from a parser fed hostile bytes.
// A user error (UserError, DecodeError: one line naming the input) is the parser doing its job;
// any other exception escaping is a finding, reported by aborting so libFuzzer keeps the input.
#pragma once
#include "core/error.h"
#include "data/dataset.h"

#include <cstdio>
#include <cstdlib>
#include <algorithm>
#include <exception>
#include <filesystem>
#include <fstream>
#include <string>
#include <unistd.h>
#include <vector>

namespace imgtrain::fuzz {

template <typename F>
void expect_user_errors_only(F&& f) {
  try {
    f();
  } catch (const UserError&) {
  } catch (const data::DecodeError&) {
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fuzz finding: not a user error: %s\n", e.what());
    std::abort();
  }
}

// A path of this process's own for `suffix` (in /dev/shm when there is one), removed at exit with
// everything under it.
inline std::string scratch_path(const char* suffix) {
  struct Scratch {
    std::vector<std::string> paths;
    ~Scratch() {
      std::error_code ec;
      for (auto& p : paths) std::filesystem::remove_all(p, ec);
    }
  };
  static Scratch scratch;
  static const std::string dir = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
  const std::string path = dir + "/imgtrain-fuzz-" + std::to_string(getpid()) + suffix;
  if (std::find(scratch.paths.begin(), scratch.paths.end(), path) == scratch.paths.end()) scratch.paths.push_back(path);
  return path;
}

// For readers that take a path: the input as a file of this process.
inline std::string as_file(const uint8_t* data, size_t size, const char* suffix) {
  const std::string path = scratch_path(suffix);
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(data), std::streamsize(size));
  return path;
}

}  // namespace imgtrain::fuzz
