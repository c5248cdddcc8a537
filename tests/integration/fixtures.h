// Fixtures shared by the integration tests: small real datasets written once per build folder.
#pragma once
#include "data/dataset.h"
#include "test_util.h"

#include <fmt/format.h>
#include <opencv2/imgcodecs.hpp>

#include <filesystem>
#include <sstream>
#include <string>
#include <vector>

namespace test {

// ImageFolder of the first `n_train` training and `n_val` test images of Fashion-MNIST, made
// once per build folder (written to a temporary name, then renamed, so parallel tests agree).
inline std::string fmnist_folder(size_t n_train = 2000, size_t n_val = 500) {
  std::filesystem::path root = std::filesystem::path(IMGTRAIN_PARITY_DIR).parent_path() / fmt::format("fmnist-{}-{}", n_train, n_val);
  if (std::filesystem::exists(root / "done")) return root.string();
  std::filesystem::path tmp = root.string() + ".tmp" + std::to_string(::getpid());
  for (auto [split, n] : {std::pair{std::string("train"), n_train}, std::pair{std::string("validation"), n_val}}) {
    auto ds = imgtrain::data::create_dataset("fashion-mnist", "", split);
    for (size_t i = 0; i < n; ++i) {
      auto dir = tmp / (split == "train" ? "train" : "val") / fmt::format("class_{}", ds->label(i));
      std::filesystem::create_directories(dir);
      cv::imwrite((dir / fmt::format("{:05d}.png", i)).string(), ds->image(i));
    }
  }
  write_file((tmp / "done").string(), "");
  std::error_code ec;
  std::filesystem::rename(tmp, root, ec);
  if (ec) std::filesystem::remove_all(tmp, ec);  // another test made it first
  return root.string();
}

inline std::vector<std::vector<std::string>> read_csv(const std::string& path) {
  std::vector<std::vector<std::string>> rows;
  std::stringstream ss(read_file(path));
  std::string line;
  while (std::getline(ss, line)) {
    std::vector<std::string> cells;
    std::stringstream ls(line);
    std::string c;
    while (std::getline(ls, c, ',')) cells.push_back(c);
    rows.push_back(cells);
  }
  return rows;
}

}  // namespace test
