#include "io/safetensors.h"

#include "core/error.h"

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <unistd.h>

namespace imgtrain::io {
namespace {

struct DtypeInfo {
  const char* name;
  at::ScalarType type;
};
const DtypeInfo kDtypes[] = {
    {"F64", at::kDouble}, {"F32", at::kFloat}, {"F16", at::kHalf}, {"BF16", at::kBFloat16},
    {"I64", at::kLong},   {"I32", at::kInt},   {"I16", at::kShort}, {"I8", at::kChar},
    {"U8", at::kByte},    {"BOOL", at::kBool},
};

const char* dtype_name(at::ScalarType t) {
  for (auto& d : kDtypes)
    if (d.type == t) return d.name;
  throw std::runtime_error(std::string("safetensors: unsupported dtype ") + c10::toString(t));
}

}  // namespace

const at::Tensor* SafeTensors::find(const std::string& name) const {
  for (auto& [k, v] : tensors)
    if (k == name) return &v;
  return nullptr;
}

std::string serialize_safetensors(const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                                  const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::vector<at::Tensor> cpu;
  uint64_t offset = 0;
  for (auto& [name, t] : tensors) {
    auto c = t.detach().to(at::kCPU).contiguous();
    uint64_t n = uint64_t(c.numel()) * c.element_size();
    header[name] = {{"dtype", dtype_name(c.scalar_type())},
                    {"shape", c.sizes().vec()},
                    {"data_offsets", {offset, offset + n}}};
    offset += n;
    cpu.push_back(c);
  }
  std::string h = header.dump();
  while ((h.size() + 8) % 8) h.push_back(' ');  // data starts 8-byte aligned
  std::string out;
  out.reserve(8 + h.size() + offset);
  uint64_t hn = h.size();
  for (int i = 0; i < 8; ++i) out.push_back(char((hn >> (8 * i)) & 0xff));
  out += h;
  for (auto& c : cpu) out.append(static_cast<const char*>(c.data_ptr()), c.numel() * c.element_size());
  return out;
}

void save_safetensors(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  std::string bytes = serialize_safetensors(tensors, metadata);
  // a name of this process's own: two writers of one path never share a temporary file
  std::string tmp = path + ".tmp." + std::to_string(::getpid());
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    if (!f) throw UserError("cannot write '" + tmp + "'");
    f.write(bytes.data(), std::streamsize(bytes.size()));
    f.flush();
    if (!f) {
      f.close();
      std::remove(tmp.c_str());  // no partial file left behind
      throw UserError("failed writing '" + tmp + "' (disk full?)");
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string why = std::strerror(errno);
    std::remove(tmp.c_str());  // no temporary file left behind
    throw UserError("cannot rename '" + tmp + "' to '" + path + "' (" + why + ")");
  }
}

namespace {
// The little-endian u64 that starts every safetensors file: the JSON header's length.
uint64_t header_length(const char* first8) {
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t(uint8_t(first8[i])) << (8 * i);
  return n;
}
}  // namespace

SafeTensors parse_safetensors(const std::string& bytes, const std::string& what) {
  auto bad = [&](const std::string& why) -> UserError {
    return UserError(fmt::format("'{}' is not a valid safetensors file: {}", what, why));
  };
  if (bytes.size() < 8) throw bad("shorter than the 8-byte header length");
  const uint64_t hn = header_length(bytes.data());
  if (hn > bytes.size() - 8) throw bad(fmt::format("header length {} exceeds the file size {}", hn, bytes.size()));
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(bytes.begin() + 8, bytes.begin() + 8 + long(hn));
  } catch (const nlohmann::json::exception& e) {
    throw bad(std::string("header is not JSON (") + e.what() + ")");
  }
  if (!header.is_object()) throw bad("header is not a JSON object");
  const uint64_t data_size = bytes.size() - 8 - hn;
  const char* data = bytes.data() + 8 + hn;
  SafeTensors out;
  std::vector<std::pair<uint64_t, std::string>> order;
  for (auto& [name, v] : header.items()) {
    if (name == "__metadata__") {
      if (!v.is_object()) throw bad("__metadata__ is not an object");
      for (auto& [k, mv] : v.items()) {
        if (!mv.is_string()) throw bad("__metadata__ value of '" + k + "' is not a string");
        out.metadata[k] = mv.get<std::string>();
      }
      continue;
    }
    if (!v.is_object() || !v.contains("dtype") || !v.contains("shape") || !v.contains("data_offsets") ||
        !v["dtype"].is_string() || !v["shape"].is_array() || !v["data_offsets"].is_array() ||
        v["data_offsets"].size() != 2)
      throw bad("entry '" + name + "' lacks dtype, shape or data_offsets");
    std::string dt = v["dtype"].get<std::string>();
    const DtypeInfo* info = nullptr;
    for (auto& d : kDtypes)
      if (dt == d.name) info = &d;
    if (!info) throw bad("entry '" + name + "' has unsupported dtype '" + dt + "'");
    std::vector<int64_t> shape;
    uint64_t numel = 1;
    for (auto& s : v["shape"]) {
      if (!s.is_number_unsigned()) throw bad("entry '" + name + "' has a non-integer or negative dimension");
      uint64_t d = s.get<uint64_t>();
      if (d > (uint64_t(1) << 40) || (d && numel > (uint64_t(1) << 48) / d))
        throw bad("entry '" + name + "' has an absurd shape");
      numel *= d;
      shape.push_back(int64_t(d));
    }
    auto& offs = v["data_offsets"];
    if (!offs[0].is_number_unsigned() || !offs[1].is_number_unsigned())
      throw bad("entry '" + name + "' has non-integer data_offsets");
    uint64_t b = offs[0].get<uint64_t>(), e = offs[1].get<uint64_t>();
    uint64_t esize = c10::elementSize(info->type);
    if (b > e || e > data_size)
      throw bad(fmt::format("entry '{}' spans bytes [{}, {}) outside the {}-byte data section", name, b, e, data_size));
    if (e - b != numel * esize)
      throw bad(fmt::format("entry '{}' has {} bytes for {} elements of {}", name, e - b, numel, dt));
    auto t = torch::empty(shape, at::TensorOptions().dtype(info->type));
    if (numel) std::memcpy(t.data_ptr(), data + b, e - b);
    order.emplace_back(b, name);
    out.tensors.emplace_back(name, t);
  }
  // Keep file order (the JSON object has no order of its own).
  std::vector<size_t> idx(out.tensors.size());
  for (size_t i = 0; i < idx.size(); ++i) idx[i] = i;
  std::stable_sort(idx.begin(), idx.end(), [&](size_t a, size_t b) { return order[a] < order[b]; });
  std::vector<std::pair<std::string, at::Tensor>> sorted;
  for (auto i : idx) sorted.push_back(out.tensors[i]);
  out.tensors = std::move(sorted);
  return out;
}

SafeTensors load_safetensors(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw UserError(fmt::format("cannot open '{}'", path));
  std::stringstream ss;
  ss << f.rdbuf();
  return parse_safetensors(ss.str(), path);
}

std::map<std::string, std::string> load_safetensors_metadata(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw UserError(fmt::format("cannot open '{}'", path));
  char len[8];
  if (!f.read(len, 8)) throw UserError(fmt::format("'{}' is not a valid safetensors file: shorter than 8 bytes", path));
  const uint64_t hn = header_length(len);
  f.seekg(0, std::ios::end);
  const uint64_t size = uint64_t(f.tellg());
  if (hn > size - 8) throw UserError(fmt::format("'{}' is not a valid safetensors file: header length {} exceeds the file size", path, hn));
  std::string bytes(8 + hn, '\0');
  f.seekg(0);
  f.read(bytes.data(), std::streamsize(bytes.size()));
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(bytes.begin() + 8, bytes.end());
  } catch (const nlohmann::json::exception& e) {
    throw UserError(fmt::format("'{}' is not a valid safetensors file: header is not JSON", path));
  }
  std::map<std::string, std::string> md;
  if (header.is_object() && header.contains("__metadata__") && header["__metadata__"].is_object())
    for (auto& [k, v] : header["__metadata__"].items())
      if (v.is_string()) md[k] = v.get<std::string>();
  return md;
}

}  // namespace imgtrain::io
