// safetensors reader/writer: an 8-byte little-endian header length, a JSON header naming each
// tensor's dtype, shape and byte range, then the raw little-endian data. Files are untrusted
// input: every offset, size and dtype is checked against the file before anything is read.
#pragma once
#include <ATen/core/Tensor.h>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace imgtrain::io {

struct SafeTensors {
  std::vector<std::pair<std::string, at::Tensor>> tensors;  // in file order
  std::map<std::string, std::string> metadata;              // the header's __metadata__
  const at::Tensor* find(const std::string& name) const;
};

// Reads a whole file; throws UserError naming the file and the defect if it is malformed.
SafeTensors load_safetensors(const std::string& path);
// Only the header's __metadata__ (checkpoint discovery without reading the tensors).
std::map<std::string, std::string> load_safetensors_metadata(const std::string& path);
SafeTensors parse_safetensors(const std::string& bytes, const std::string& what);
// Writes to PATH.tmp in the same folder, then renames, so a crash never leaves a broken file.
void save_safetensors(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata = {});
std::string serialize_safetensors(const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                                  const std::map<std::string, std::string>& metadata);

}  // namespace imgtrain::io
