#include "data/shards.h"

#include "core/error.h"
#include "core/log.h"
#include "core/parallel.h"

#include <fmt/format.h>
#include <opencv2/imgproc.hpp>
#include <turbojpeg.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>

namespace fs = std::filesystem;

namespace imgtrain::data {
namespace {

constexpr size_t kBlock = 512;
// Labels at or above this are refused (as --num-classes's limit): the class count is max + 1.
constexpr int64_t kMaxLabel = 1000000;

bool is_image_ext(std::string ext) {
  std::transform(ext.begin(), ext.end(), ext.begin(), [](unsigned char c) { return std::tolower(c); });
  return ext == "jpg" || ext == "jpeg" || ext == "png" || ext == "bmp" || ext == "webp" || ext == "gif";
}

// A tar number field: octal text, or GNU base-256 when the high bit of the first byte is set.
bool tar_number(const char* p, size_t n, uint64_t& out) {
  out = 0;
  if (uint8_t(p[0]) & 0x80) {
    for (size_t i = 1; i < n; ++i) {
      if (out >> 56) return false;  // more than 64 bits: no file is that large
      out = (out << 8) | uint8_t(p[i]);
    }
    return true;
  }
  size_t i = 0;
  while (i < n && (p[i] == ' ' || p[i] == 0)) ++i;
  bool any = false;
  for (; i < n && p[i] >= '0' && p[i] <= '7'; ++i) out = out * 8 + uint64_t(p[i] - '0'), any = true;
  return any || i == n;
}

std::string field(const char* p, size_t n) { return std::string(p, strnlen(p, n)); }

bool checksum_ok(const char* h) {
  uint64_t want;
  if (!tar_number(h + 148, 8, want)) return false;
  uint64_t sum = 0;
  for (size_t i = 0; i < kBlock; ++i) sum += (i >= 148 && i < 156) ? uint8_t(' ') : uint8_t(h[i]);
  return sum == want;
}

// path=... from a pax extended header's records ("<len> key=value\n").
std::string pax_path(const std::string& data) {
  size_t pos = 0;
  while (pos < data.size()) {
    const size_t sp = data.find(' ', pos);
    if (sp == std::string::npos) break;
    const size_t len = std::strtoull(data.c_str() + pos, nullptr, 10);
    if (len == 0 || pos + len > data.size()) break;
    const std::string rec = data.substr(sp + 1, pos + len - sp - 2);
    if (rec.rfind("path=", 0) == 0) return rec.substr(5);
    pos += len;
  }
  return "";
}

std::string read_range(std::ifstream& f, uint64_t off, uint64_t n) {
  std::string s(n, '\0');
  f.seekg(std::streamoff(off));
  f.read(s.data(), std::streamsize(n));
  if (uint64_t(f.gcount()) != n) throw DecodeError("short read");
  return s;
}

// The samples of one shard: an image member and a label per key.
struct ShardSamples {
  std::string path;
  std::vector<TarMember> images;
  std::vector<int64_t> labels;
  int64_t skipped = 0;
  std::string error;
};

ShardSamples scan_shard(const std::string& path) {
  ShardSamples out;
  out.path = path;
  std::string err;
  auto members = list_tar(path, &err);
  if (!err.empty()) out.error = err;
  std::ifstream f(path, std::ios::binary);
  // Members of one sample are consecutive and share the key: the name up to the first dot of
  // its last path component (WebDataset's rule).
  auto key_ext = [](const std::string& name) {
    const size_t slash = name.rfind('/');
    const size_t dot = name.find('.', slash == std::string::npos ? 0 : slash + 1);
    if (dot == std::string::npos) return std::pair<std::string, std::string>{name, ""};
    return std::pair<std::string, std::string>{name.substr(0, dot), name.substr(dot + 1)};
  };
  for (size_t i = 0; i < members.size();) {
    const std::string key = key_ext(members[i].name).first;
    const TarMember* image = nullptr;
    std::optional<int64_t> label;
    for (; i < members.size() && key_ext(members[i].name).first == key; ++i) {
      const auto ext = key_ext(members[i].name).second;
      if (is_image_ext(ext) && !image) image = &members[i];
      if (ext == "cls" && members[i].size < 64) {
        try {
          // WebDataset's int(): optional surrounding whitespace and sign, then digits only ("1e2",
          // "1.5", "0x1", "2abc" are refused, not read by their prefix)
          std::string text = read_range(f, members[i].offset, members[i].size);
          const size_t b = text.find_first_not_of(" \t\r\n"), e = text.find_last_not_of(" \t\r\n");
          text = b == std::string::npos ? "" : text.substr(b, e - b + 1);
          const size_t digits = text.find_first_not_of("+-") == 1 || text.empty() ? 1 : 0;
          if (!text.empty() && text.find_first_not_of("0123456789", digits) == std::string::npos &&
              text.size() > digits) {
            size_t used = 0;
            const long long v = std::stoll(text, &used);
            if (v >= 0 && v < kMaxLabel) label = v;  // (a label of 2^63-1 would make the class count wrap)
          }
        } catch (const std::exception&) {
        }
      }
    }
    if (image && label) {
      out.images.push_back(*image);
      out.labels.push_back(*label);
    } else {
      ++out.skipped;
    }
  }
  return out;
}

class TarShards : public Dataset {
 public:
  TarShards(const std::string& folder, int threads) {
    const auto paths = find_shards(folder);
    if (paths.empty()) throw UserError(fmt::format("no .tar shards in '{}'", folder));
    std::vector<ShardSamples> shards(paths.size());
    parallel_for(paths.size(), size_t(std::max(threads, 1)), [&](size_t i) { shards[i] = scan_shard(paths[i]); });
    int64_t skipped = 0;
    for (auto& sh : shards) {
      if (!sh.error.empty()) log::warn("shard '{}': {}; using the {} samples before it", sh.path, sh.error, sh.images.size());
      starts_.push_back(files_.size());
      for (size_t i = 0; i < sh.images.size(); ++i) {
        files_.push_back(paths_.size());
        members_.push_back(sh.images[i]);
        labels_.push_back(sh.labels[i]);
        num_classes_ = std::max(num_classes_, sh.labels[i] + 1);
      }
      paths_.push_back(sh.path);
      skipped += sh.skipped;
    }
    starts_.push_back(files_.size());
    if (skipped)
      log::warn("shards in '{}': skipped {} key(s) without an image or a .cls label in [0, {}]", folder, skipped,
                kMaxLabel - 1);
    if (files_.empty()) throw UserError(fmt::format("no samples (<key>.jpg + <key>.cls) in the shards of '{}'", folder));
    std::ifstream names(fs::path(folder) / "classes.txt");
    for (std::string line; std::getline(names, line);) class_names_.push_back(line);
    if (int64_t(class_names_.size()) < num_classes_) {
      class_names_.clear();
      for (int64_t c = 0; c < num_classes_; ++c) class_names_.push_back(std::to_string(c));
    }
  }
  size_t size() const override { return members_.size(); }
  int64_t label(size_t i) const override { return labels_[i]; }
  cv::Mat image(size_t i) const override {
    std::string bytes;
    encoded(i, bytes);
    return decode_image(bytes, describe(i));
  }
  bool encoded(size_t i, std::string& bytes) const override {
    std::ifstream f(paths_[files_[i]], std::ios::binary);
    if (!f) throw DecodeError(fmt::format("cannot read '{}'", describe(i)));
    try {
      bytes = read_range(f, members_[i].offset, members_[i].size);
    } catch (const DecodeError&) {
      throw DecodeError(fmt::format("cannot read '{}' (truncated shard)", describe(i)));
    }
    return true;
  }
  std::string describe(size_t i) const override { return paths_[files_[i]] + ":" + members_[i].name; }
  int64_t num_classes() const override { return num_classes_; }
  std::vector<std::string> class_names() const override { return class_names_; }
  std::vector<size_t> shard_starts() const override { return starts_; }

 private:
  std::vector<std::string> paths_;
  std::vector<size_t> files_;  // shard of each sample
  std::vector<TarMember> members_;
  std::vector<int64_t> labels_;
  std::vector<size_t> starts_;
  std::vector<std::string> class_names_;
  int64_t num_classes_ = 0;
};

// --- writing ---

void write_header(std::ofstream& f, const std::string& name, uint64_t size) {
  char h[kBlock] = {};
  if (name.size() > 99) throw std::logic_error("tar member name too long: " + name);
  std::memcpy(h, name.data(), name.size());
  std::snprintf(h + 100, 8, "%07o", 0644);
  std::snprintf(h + 108, 8, "%07o", 0);
  std::snprintf(h + 116, 8, "%07o", 0);
  std::snprintf(h + 124, 12, "%011llo", (unsigned long long)size);
  std::snprintf(h + 136, 12, "%011o", 0);
  h[156] = '0';
  std::memcpy(h + 257, "ustar", 6);
  std::memcpy(h + 263, "00", 2);
  std::memset(h + 148, ' ', 8);
  unsigned sum = 0;
  for (size_t i = 0; i < kBlock; ++i) sum += uint8_t(h[i]);
  std::snprintf(h + 148, 8, "%06o", sum);
  h[155] = ' ';
  f.write(h, kBlock);
}

void write_member(std::ofstream& f, const std::string& name, const std::string& data) {
  write_header(f, name, data.size());
  f.write(data.data(), std::streamsize(data.size()));
  static const char zeros[kBlock] = {};
  if (data.size() % kBlock) f.write(zeros, std::streamsize(kBlock - data.size() % kBlock));
}

std::string encode_jpeg(const cv::Mat& img, int quality) {
  tjhandle h = tjInitCompress();
  unsigned char* buf = nullptr;
  unsigned long size = 0;
  const bool gray = img.channels() == 1;
  const int rc = tjCompress2(h, img.data, img.cols, int(img.step), img.rows, gray ? TJPF_GRAY : TJPF_RGB, &buf, &size,
                             gray ? TJSAMP_GRAY : TJSAMP_420, quality, TJFLAG_ACCURATEDCT);
  std::string out;
  if (rc == 0) out.assign(reinterpret_cast<char*>(buf), size);
  std::string err = rc ? tjGetErrorStr2(h) : "";
  tjFree(buf);
  tjDestroy(h);
  if (rc) throw std::runtime_error("JPEG encoding failed: " + err);
  return out;
}

}  // namespace

std::vector<TarMember> list_tar(const std::string& path, std::string* error) {
  std::vector<TarMember> out;
  std::ifstream f(path, std::ios::binary | std::ios::ate);
  if (!f) throw UserError(fmt::format("cannot open '{}'", path));
  const uint64_t file_size = uint64_t(f.tellg());
  f.seekg(0);
  auto fail = [&](const std::string& why, uint64_t at) {
    if (error) *error = fmt::format("{} at byte {}", why, at);
    return out;
  };
  std::string long_name;
  uint64_t pos = 0;
  while (pos + kBlock <= file_size) {
    char h[kBlock];
    f.seekg(std::streamoff(pos));
    f.read(h, kBlock);
    if (!f) return fail("unreadable header", pos);
    if (std::all_of(h, h + kBlock, [](char c) { return c == 0; })) return out;  // end of archive
    if (!checksum_ok(h)) return fail("bad header checksum (corrupt or not a tar file)", pos);
    uint64_t size;
    if (!tar_number(h + 124, 12, size)) return fail("bad size field", pos);
    const uint64_t data = pos + kBlock;
    // (compared without adding: a size near 2^64 must not wrap around)
    if (size > file_size - data) return fail("member extends past the end of the file (truncated)", pos);
    const char type = h[156];
    if ((type == 'L' || type == 'x') && size > (1u << 20))
      return fail(fmt::format("a {}-byte {} header (at most 1 MiB is accepted)", size, type == 'L' ? "long-name" : "pax"),
                  pos);
    if (type == 'L' || type == 'x') {  // GNU long name / pax header: the next member's name
      std::string payload(size, '\0');
      f.seekg(std::streamoff(data));
      f.read(payload.data(), std::streamsize(size));
      long_name = type == 'L' ? std::string(payload.c_str()) : pax_path(payload);
    } else if (type == '0' || type == 0 || type == '7') {
      std::string name = field(h, 100);
      if (std::memcmp(h + 257, "ustar", 5) == 0 && h[345]) name = field(h + 345, 155) + "/" + name;
      if (!long_name.empty()) name = long_name;
      out.push_back({name, data, size});
      long_name.clear();
    } else {
      long_name.clear();  // directories, links, global headers: nothing to read
    }
    pos = data + (size + kBlock - 1) / kBlock * kBlock;
  }
  // Every tar writer ends the archive with zero blocks; a file that stops before them (even
  // exactly at a member boundary) was cut short, and the members after the cut are lost.
  return fail(pos < file_size ? "a partial header block (truncated)" : "no end-of-archive blocks (the file is cut short)",
              std::min(pos, file_size));
}

std::vector<std::string> find_shards(const std::string& folder) {
  std::vector<std::string> out;
  std::error_code ec;
  for (auto& e : fs::directory_iterator(folder, ec))
    if (e.is_regular_file() && e.path().extension() == ".tar") out.push_back(e.path().string());
  std::sort(out.begin(), out.end());
  return out;
}

std::shared_ptr<Dataset> open_shards(const std::string& folder, int threads) {
  return std::make_shared<TarShards>(folder, threads);
}

PackResult pack_image_folder(const PackOptions& o) {
  if (o.out.empty()) throw UserError("pack needs --out FOLDER");
  std::error_code ec;
  if (!fs::is_directory(o.data_dir, ec)) throw UserError(fmt::format("--data-dir '{}': no such folder", o.data_dir));
  static const std::vector<std::string> kSplits = {"train", "training", "val", "valid", "validation",
                                                   "eval", "evaluation", "test"};
  std::vector<std::pair<std::string, std::string>> splits;  // (input folder, output folder)
  for (auto& s : kSplits)
    if (fs::is_directory(fs::path(o.data_dir) / s, ec))
      splits.emplace_back((fs::path(o.data_dir) / s).string(), (fs::path(o.out) / s).string());
  if (splits.empty()) splits.emplace_back(o.data_dir, o.out);
  // Shards already in an output folder would be read with the new ones (a second pack into the same
  // --out trained on both sets): refused, or removed first with --overwrite, before anything is written
  for (auto& [in, out_dir] : splits) {
    std::vector<fs::path> old;
    for (auto& e : fs::directory_iterator(out_dir, ec)) {
      const auto name = e.path().filename().string();
      const bool tmp = name.size() > 8 && name.compare(name.size() - 8, 8, ".tar.tmp") == 0;
      if ((e.path().extension() == ".tar" || tmp) && !e.is_directory()) old.push_back(e.path());
    }
    if (old.empty()) continue;
    if (!o.overwrite)
      throw UserError(fmt::format("--out: '{}' already holds {} .tar file(s), which would be read with the new "
                                  "shards; give an empty folder, or --overwrite to remove them first",
                                  out_dir, old.size()));
    for (auto& f : old) {
      std::error_code rec;
      if (!fs::remove(f, rec) || rec)
        throw UserError(fmt::format("--overwrite: cannot remove '{}' ({})", f.string(), rec ? rec.message() : "gone"));
    }
    if (o.log) o.log(fmt::format("{}: removed {} earlier .tar file(s) (--overwrite)", out_dir, old.size()));
  }
  ec.clear();
  PackResult res;
  for (auto& [in, out_dir] : splits) {
    auto ds = create_dataset("", in, "", FolderOptions{o.input_key, ""});
    fs::create_directories(out_dir, ec);
    if (ec) throw UserError(fmt::format("--out '{}': cannot create the folder ({})", out_dir, ec.message()));
    {
      std::ofstream names(fs::path(out_dir) / "classes.txt");
      for (auto& c : ds->class_names()) names << c << "\n";
    }
    std::ofstream shard;
    uint64_t written = 0;
    int64_t shard_idx = -1;
    std::string shard_path;
    auto finish = [&]() {
      if (!shard.is_open()) return;
      static const char zeros[2 * kBlock] = {};
      shard.write(zeros, sizeof zeros);
      shard.close();
      std::error_code rec;
      if (shard) fs::rename(shard_path + ".tmp", shard_path, rec);
      if (!shard || rec) {
        fs::remove(shard_path + ".tmp", rec);  // no partial shard left behind
        throw UserError(fmt::format("cannot write '{}' (disk full?)", shard_path));
      }
    };
    const int64_t samples_before = res.samples;
    for (size_t i = 0; i < ds->size(); ++i) {
      std::string bytes, ext;
      try {
        ds->encoded(i, bytes);
        ext = fs::path(ds->describe(i)).extension().string().substr(1);
        std::transform(ext.begin(), ext.end(), ext.begin(), [](unsigned char c) { return std::tolower(c); });
        if (o.max_size > 0) {
          cv::Mat img = decode_image(bytes, ds->describe(i));
          if (std::max(img.rows, img.cols) > o.max_size) {
            const double s = double(o.max_size) / std::max(img.rows, img.cols);
            cv::Mat small;
            cv::resize(img, small, {std::max(1, int(std::lround(img.cols * s))), std::max(1, int(std::lround(img.rows * s)))},
                       0, 0, cv::INTER_AREA);
            bytes = encode_jpeg(small, 90);
            ext = "jpg";
            ++res.reencoded;
          }
        }
      } catch (const DecodeError& e) {
        if (o.log) o.log(fmt::format("WARNING: skipping unreadable image: {}", e.what()));
        ++res.skipped;
        continue;
      }
      if (!shard.is_open() || (written > 0 && written + bytes.size() > o.shard_size)) {
        finish();
        shard_path = (fs::path(out_dir) / fmt::format("shard-{:06d}.tar", ++shard_idx)).string();
        shard.open(shard_path + ".tmp", std::ios::binary | std::ios::trunc);
        if (!shard) throw UserError(fmt::format("cannot write '{}'", shard_path));
        written = 0;
        ++res.shards;
      }
      const std::string key = fmt::format("{:09d}", i);
      write_member(shard, key + "." + ext, bytes);
      write_member(shard, key + ".cls", std::to_string(ds->label(i)));
      written += bytes.size() + 3 * kBlock;
      ++res.samples;
    }
    finish();
    if (o.log) o.log(fmt::format("{}: {} samples in {} shard(s)", out_dir, res.samples - samples_before, shard_idx + 1));
  }
  return res;
}

}  // namespace imgtrain::data
