#include "engine/run_folder.h"

#include "core/error.h"
#include "core/log.h"

#include <array>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <ctime>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>

#include <opencv2/imgproc.hpp>
#include <zlib.h>

namespace fs = std::filesystem;

namespace imgtrain::engine {

std::string default_experiment(const std::string& model, int64_t img_size) {
  std::time_t t = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y%m%d-%H%M%S", std::localtime(&t));
  return fmt::format("{}-{}-{}", buf, model, img_size);
}

// The run's folder is under --output: an --experiment may name a sub-folder ("ablation/lr0.1"), but
// not climb out of it or replace it ("../x", "/abs", "", ".").
const std::string& checked_experiment(const std::string& experiment) {
  const fs::path p(experiment);
  bool climbs = p.is_absolute() || p.has_root_name() || p.has_root_directory();
  bool named = false;
  for (const auto& part : p) {
    climbs = climbs || part == "..";
    named = named || (part != "." && !part.empty());
  }
  if (climbs || !named)
    throw UserError(fmt::format("--experiment '{}': a folder name under --output (no '..', not absolute)",
                                experiment));
  return experiment;
}

RunFolder::RunFolder(const std::string& output, const std::string& experiment, bool primary)
    : dir_((fs::path(output.empty() ? "./output/train" : output) / checked_experiment(experiment)).string()),
      primary_(primary) {
  if (!primary_) return;
  std::error_code ec;
  fs::create_directories(dir_, ec);
  if (ec) throw UserError(fmt::format("--output '{}': cannot create the folder ({})", dir_, ec.message()));
  const std::string lock_path = dir_ + "/.lock";
  // never through a link (it would overwrite the link's target) and never a FIFO or device
  const int fd = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK, 0644);
  if (fd < 0 && errno == ELOOP)
    throw UserError(fmt::format("'{}' is a symbolic link, not a regular file; remove it", lock_path));
  if (fd < 0) throw UserError(fmt::format("cannot create '{}' ({})", lock_path, std::strerror(errno)));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    throw UserError(fmt::format("'{}' is not a regular file; remove it", lock_path));
  }
  lock_ = std::shared_ptr<int>(new int(fd), [](int* p) {
    ::close(*p);
    delete p;
  });
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    char holder[256] = {0};
    const ssize_t n = ::pread(fd, holder, sizeof holder - 1, 0);
    std::string who = n > 0 ? std::string(holder, size_t(n)) : "unknown";
    while (!who.empty() && (who.back() == '\n' || who.back() == ' ')) who.pop_back();
    throw UserError(fmt::format("'{}' is in use by another run ({}): choose another --experiment or --output, or wait "
                                "for it to end",
                                dir_, who));
  }
  char host[256] = {0};
  ::gethostname(host, sizeof host - 1);
  const std::string me = fmt::format("pid {} on {}\n", ::getpid(), host);
  if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, me.data(), me.size(), 0) < 0) {
    // the lock holds without the note; only the message of a refused second run is poorer
  }
  // No other process writes here while we hold the lock: any temporary file is a killed writer's.
  std::vector<fs::path> stale;
  for (auto& e : fs::directory_iterator(dir_, ec)) {
    const std::string name = e.path().filename().string();
    const auto t = name.rfind(".tmp.");
    if (t != std::string::npos && t + 5 < name.size() &&
        name.find_first_not_of("0123456789", t + 5) == std::string::npos)
      stale.push_back(e.path());
  }
  for (auto& p : stale) {
    fs::remove(p, ec);
    log::info("Removed '{}', a temporary file an interrupted run left", p.string());
  }
}

namespace {
// The files a training run writes into its folder, and which of them mark a run that got as far
// as an epoch or a checkpoint (a run that failed at start-up leaves only args.yaml and log.txt).
bool is_run_file(const std::string& name, bool* progress) {
  const bool checkpoint = name.ends_with(".safetensors") &&
                          (name == "last.safetensors" || name == "model_best.safetensors" ||
                           name.rfind("checkpoint-", 0) == 0 || name.rfind("recovery-", 0) == 0);
  *progress = checkpoint || name == "summary.csv";
  return *progress || name == "args.yaml" || name == "log.txt" || name == "curves.png" ||
         name.rfind("events.out.tfevents.", 0) == 0;
}
}  // namespace

std::string RunFolder::set_aside(const std::vector<std::string>& files) const {
  if (!primary_ || files.empty()) return "";
  std::error_code ec;
  int n = 1;
  while (fs::exists(fs::symlink_status(path(fmt::format("earlier-run-{}", n)), ec))) ++n;
  const std::string to = path(fmt::format("earlier-run-{}", n));
  fs::create_directory(to, ec);
  if (ec) throw UserError(fmt::format("cannot create '{}' ({})", to, ec.message()));
  for (auto& f : files) {
    fs::rename(f, fs::path(to) / fs::path(f).filename(), ec);
    if (ec) throw UserError(fmt::format("cannot move '{}' into '{}' ({})", f, to, ec.message()));
  }
  return to;
}

std::string RunFolder::begin(const std::string& args_yaml, bool continues) const {
  if (!primary_) return "";
  // files the run opens by name: a FIFO or a folder there would block or fail a write (the
  // checkpoints' only after a whole epoch)
  for (const char* name : {"args.yaml", "log.txt", "summary.csv", "last.safetensors", "model_best.safetensors"}) {
    std::error_code ec;
    const auto st = fs::status(path(name), ec);
    if (fs::exists(st) && !fs::is_regular_file(st))
      throw UserError(fmt::format("'{}' is not a regular file; remove it or choose another --experiment", path(name)));
  }
  std::string moved_to;
  if (!continues) {
    std::error_code ec;
    std::vector<std::string> files;
    int64_t checkpoints = 0;
    bool progress = false, summary = false;
    for (auto& e : fs::directory_iterator(dir_, ec)) {
      const std::string name = e.path().filename().string();
      bool p = false;
      if (!e.is_regular_file(ec) || !is_run_file(name, &p)) continue;
      files.push_back(e.path().string());
      progress = progress || p;
      summary = summary || name == "summary.csv";
      checkpoints += name.ends_with(".safetensors");
    }
    if (progress) moved_to = set_aside(files);
    std::string held = checkpoints ? fmt::format("{} checkpoint file(s)", checkpoints) : "";
    if (summary) held += held.empty() ? "summary.csv" : " and summary.csv";
    if (progress)
      log::warn("'{}' held an earlier run ({}); this run does not resume it, so that run's files are moved to '{}' "
                "(--resume auto continues a run instead)",
                dir_, held, moved_to);
  }
  std::ofstream f(dir_ + "/args.yaml");
  f << args_yaml;
  if (!f) throw UserError(fmt::format("cannot write '{}/args.yaml'", dir_));
  log::set_file(dir_ + "/log.txt");
  return moved_to;
}

void RunFolder::append_summary(int64_t epoch, const NamedValues& train, const NamedValues& eval, double lr) const {
  if (!primary_) return;
  const std::string summary = path("summary.csv");
  const bool header = !fs::exists(summary);
  std::ofstream f(summary, std::ios::app);
  if (header) {
    std::string h = "epoch";
    for (auto& [k, v] : train) h += ",train_" + k;
    for (auto& [k, v] : eval) h += ",eval_" + k;
    f << h << ",lr\n";
  }
  std::string row = std::to_string(epoch);
  for (auto& [k, v] : train) row += fmt::format(",{}", v);
  for (auto& [k, v] : eval) row += fmt::format(",{}", v);
  f << row << fmt::format(",{}\n", lr);
  if (!f.flush()) log::warn("cannot write '{}': epoch {}'s row is not saved (disk full?)", summary, epoch);
}

void RunFolder::truncate_summary(int64_t from_epoch) const {
  if (!primary_) return;
  const std::string summary = path("summary.csv");
  std::ifstream in(summary);
  if (!in) return;
  std::string kept, line;
  bool dropped = false, first = true;
  while (std::getline(in, line)) {
    bool keep = first;  // the header
    if (!first) {
      char* end = nullptr;
      const long long e = std::strtoll(line.c_str(), &end, 10);
      keep = end != line.c_str() && *end == ',' && e < from_epoch;
    }
    first = false;
    if (keep) kept += line + "\n";
    else dropped = true;
  }
  in.close();
  if (!dropped) return;
  const std::string tmp = summary + fmt::format(".tmp.{}", ::getpid());
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << kept;
    if (!out.flush()) {
      std::error_code ec;
      fs::remove(tmp, ec);
      throw UserError(fmt::format("cannot write '{}' (disk full?)", tmp));
    }
  }
  std::error_code ec;
  fs::rename(tmp, summary, ec);
  if (ec) throw UserError(fmt::format("cannot replace '{}' ({})", summary, ec.message()));
}

uint32_t crc32c(const void* data, size_t n) {
  static const auto table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;  // reflected Castagnoli
      t[i] = c;
    }
    return t;
  }();
  uint32_t crc = 0xFFFFFFFFu;
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) crc = table[(crc ^ p[i]) & 0xFF] ^ (crc >> 8);
  return crc ^ 0xFFFFFFFFu;
}

namespace {
uint32_t masked_crc(const std::string& b) {
  const uint32_t c = crc32c(b.data(), b.size());
  return ((c >> 15) | (c << 17)) + 0xA282EAD8u;
}
// protobuf wire format: what an Event with a scalar Summary needs
void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) out += char((v & 0x7F) | 0x80), v >>= 7;
  out += char(v);
}
template <typename T>
void put_fixed(std::string& out, T v) {  // little-endian, as protobuf's fixed32 / fixed64
  unsigned char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));
  out.append(reinterpret_cast<const char*>(b), sizeof(T));
}
void put_bytes(std::string& out, int field, const std::string& bytes) {
  put_varint(out, uint64_t(field) << 3 | 2);
  put_varint(out, bytes.size());
  out += bytes;
}
std::string event_header(double wall_time, int64_t step) {
  std::string e;
  put_varint(e, 1 << 3 | 1);  // Event.wall_time: double
  put_fixed(e, wall_time);
  put_varint(e, 2 << 3 | 0);  // Event.step: int64
  put_varint(e, uint64_t(step));
  return e;
}
double wall_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}
}  // namespace

EventWriter::EventWriter(const std::string& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw UserError(fmt::format("--log-tensorboard '{}': cannot create the folder ({})", dir, ec.message()));
  char host[256] = {0};
  ::gethostname(host, sizeof host - 1);
  path_ = fmt::format("{}/events.out.tfevents.{}.{}.{}", dir, int64_t(wall_seconds()), host, ::getpid());
  std::FILE* f = std::fopen(path_.c_str(), "ab");
  if (!f) throw UserError(fmt::format("--log-tensorboard: cannot create '{}' ({})", path_, std::strerror(errno)));
  file_ = std::shared_ptr<std::FILE>(f, [](std::FILE* p) { std::fclose(p); });
  std::string e = event_header(wall_seconds(), 0);
  put_bytes(e, 3, "brain.Event:2");  // Event.file_version: the first record of every events file
  record(e);
  flush();
}

void EventWriter::record(const std::string& event) {
  std::string len;
  put_fixed(len, uint64_t(event.size()));
  std::string framed = len;
  put_fixed(framed, masked_crc(len));
  framed += event;
  put_fixed(framed, masked_crc(event));
  std::fwrite(framed.data(), 1, framed.size(), file_.get());
}

void EventWriter::scalar(const std::string& tag, double value, int64_t step) {
  if (!file_) return;
  std::string v;  // Summary.Value{tag = 1, simple_value = 2 (float)}
  put_bytes(v, 1, tag);
  put_varint(v, 2 << 3 | 5);
  put_fixed(v, float(value));
  std::string summary;  // Summary{repeated Value value = 1}
  put_bytes(summary, 1, v);
  std::string e = event_header(wall_seconds(), step);
  put_bytes(e, 5, summary);  // Event.summary
  record(e);
}

void EventWriter::flush() {
  if (file_) std::fflush(file_.get());
}

void write_png(const std::string& path, int width, int height, const unsigned char* bgr) {
  std::string raw;  // each row: filter byte 0, then R G B per pixel
  raw.reserve(size_t(height) * (size_t(width) * 3 + 1));
  for (int y = 0; y < height; ++y) {
    raw += '\0';
    const unsigned char* row = bgr + size_t(y) * size_t(width) * 3;
    for (int x = 0; x < width; ++x) raw += char(row[3 * x + 2]), raw += char(row[3 * x + 1]), raw += char(row[3 * x]);
  }
  uLongf zn = compressBound(uLong(raw.size()));
  std::string z(zn, '\0');
  if (compress2(reinterpret_cast<Bytef*>(z.data()), &zn, reinterpret_cast<const Bytef*>(raw.data()), uLong(raw.size()),
                6) != Z_OK)
    throw std::runtime_error("write_png: zlib compress2 failed");
  z.resize(zn);
  auto be32 = [](std::string& out, uint32_t v) {
    for (int k = 3; k >= 0; --k) out += char((v >> (8 * k)) & 0xFF);
  };
  std::string png = "\x89PNG\r\n\x1a\n";
  auto chunk = [&](const char* type, const std::string& data) {
    be32(png, uint32_t(data.size()));
    const std::string body = std::string(type, 4) + data;
    png += body;
    be32(png, uint32_t(crc32(0, reinterpret_cast<const Bytef*>(body.data()), uInt(body.size()))));
  };
  std::string ihdr;
  be32(ihdr, uint32_t(width));
  be32(ihdr, uint32_t(height));
  ihdr += std::string("\x08\x02\x00\x00\x00", 5);  // 8-bit, truecolour, deflate, no filter choice, no interlace
  chunk("IHDR", ihdr);
  chunk("IDAT", z);
  chunk("IEND", "");
  const std::string tmp = path + fmt::format(".tmp.{}", ::getpid());
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    if (!f) {  // a missing or read-only folder: said as such, not as a full disk
      std::error_code ec;
      const auto dir = fs::path(path).parent_path();
      throw UserError(fmt::format("cannot write '{}': {}", path,
                                  !dir.empty() && !fs::is_directory(dir, ec) ? "no such folder" : "cannot create the file"));
    }
    f << png;
    if (!f.flush()) {
      std::error_code ec;
      fs::remove(tmp, ec);
      throw UserError(fmt::format("cannot write '{}' (disk full?)", path));
    }
  }
  fs::rename(tmp, path);
}

namespace {
struct Summary {
  std::string name;
  std::vector<std::string> columns;
  std::vector<std::vector<double>> rows;  // NaN where a cell is not a number
  int column(const std::string& c) const {
    for (size_t i = 0; i < columns.size(); ++i)
      if (columns[i] == c) return int(i);
    return -1;
  }
};

std::vector<std::string> split_csv(const std::string& line) {
  std::vector<std::string> out;
  std::string cell;
  std::istringstream in(line);
  while (std::getline(in, cell, ',')) out.push_back(cell);
  return out;
}

std::optional<Summary> read_summary(const std::string& dir) {
  std::ifstream in(dir + "/summary.csv");
  std::string line;
  if (!in || !std::getline(in, line)) return std::nullopt;
  Summary s;
  s.name = fs::path(dir).filename().string();
  if (s.name.empty() || s.name == ".") s.name = fs::path(dir).parent_path().filename().string();
  s.columns = split_csv(line);
  if (s.columns.empty() || s.columns[0] != "epoch") return std::nullopt;
  while (std::getline(in, line)) {
    const auto cells = split_csv(line);
    if (cells.size() != s.columns.size()) continue;
    std::vector<double> row;
    for (auto& c : cells) {
      char* end = nullptr;
      const double v = std::strtod(c.c_str(), &end);
      row.push_back(end != c.c_str() && *end == '\0' ? v : std::nan(""));
    }
    if (std::isfinite(row[0])) s.rows.push_back(std::move(row));
  }
  if (s.rows.empty()) return std::nullopt;
  return s;
}

std::string short_number(double v) { return fmt::format("{:.4g}", v); }
}  // namespace

void plot_runs(const std::vector<std::string>& run_dirs, const std::string& png_path) {
  std::vector<Summary> runs;
  std::vector<std::string> missing;
  for (auto& d : run_dirs)
    if (auto s = read_summary(d)) runs.push_back(std::move(*s));
    else missing.push_back(d);
  if (runs.empty())
    throw UserError(fmt::format("plot: no run with a readable summary.csv (in '{}'{})", missing.front(),
                                missing.size() > 1 ? fmt::format(" and {} more", missing.size() - 1) : ""));
  for (auto& d : missing) log::warn("plot: '{}' has no readable summary.csv; left out", d);
  // The eval curves: top-1 and top-5 when the evaluator has them, else its first two non-loss numbers.
  std::vector<std::string> eval_cols;
  if (runs[0].column("eval_top1") >= 0) eval_cols = {"eval_top1", "eval_top5"};
  else
    for (auto& c : runs[0].columns)
      if (c.rfind("eval_", 0) == 0 && c.find("loss") == std::string::npos && eval_cols.size() < 2) eval_cols.push_back(c);
  struct Panel {
    std::string title;
    std::vector<std::string> cols;
  };
  const std::vector<Panel> panels = {{"train loss", {"train_loss"}},
                                     {eval_cols.empty() ? "eval" : "eval " + eval_cols[0].substr(5) +
                                                                      (eval_cols.size() > 1 ? " / " + eval_cols[1].substr(5) : ""),
                                      eval_cols},
                                     {"lr", {"lr"}}};
  const int pw = 420, ph = 360, top = 40, left = 70, right = 20, bottom = 50;
  const int legend = runs.size() > 1 ? 22 * int(runs.size()) + 10 : 0;
  cv::Mat img(ph + legend, pw * int(panels.size()), CV_8UC3, cv::Scalar(255, 255, 255));
  const cv::Scalar axis(60, 60, 60), grid(225, 225, 225);
  static const unsigned char run_colours[8][3] = {{31, 119, 180}, {214, 39, 40},  {44, 160, 44},  {148, 103, 189},
                                                  {255, 127, 14}, {140, 86, 75}, {227, 119, 194}, {23, 190, 207}};
  auto bgr = [](const unsigned char* rgb) { return cv::Scalar(rgb[2], rgb[1], rgb[0]); };
  auto text = [&](const std::string& t, int x, int y, double scale = 0.45) {
    cv::putText(img, t, {x, y}, cv::FONT_HERSHEY_SIMPLEX, scale, axis, 1, cv::LINE_AA);
  };
  int series = 0;  // the single-run colour index: train loss, eval 1, eval 2, lr
  for (size_t p = 0; p < panels.size(); ++p) {
    const int x0 = int(p) * pw + left, x1 = int(p + 1) * pw - right, y0 = top, y1 = ph - bottom;
    double xmin = 1e300, xmax = -1e300, ymin = 1e300, ymax = -1e300;
    for (auto& r : runs)
      for (auto& c : panels[p].cols)
        if (const int k = r.column(c); k >= 0)
          for (auto& row : r.rows)
            if (std::isfinite(row[size_t(k)])) {
              xmin = std::min(xmin, row[0]), xmax = std::max(xmax, row[0]);
              ymin = std::min(ymin, row[size_t(k)]), ymax = std::max(ymax, row[size_t(k)]);
            }
    text(panels[p].title, x0, top - 14, 0.6);
    cv::rectangle(img, {x0, y0}, {x1, y1}, axis, 1);
    if (xmin > xmax) {
      text("(no values)", x0 + 10, (y0 + y1) / 2);
      series += int(panels[p].cols.size());
      continue;
    }
    if (xmax == xmin) xmin -= 0.5, xmax += 0.5;
    if (ymax == ymin) ymin -= std::max(1e-12, std::abs(ymin) * 0.05), ymax += std::max(1e-12, std::abs(ymax) * 0.05);
    const double pad = 0.05 * (ymax - ymin);
    const double ylo = ymin - pad, yhi = ymax + pad;
    for (int g = 1; g < 4; ++g) {
      const int y = y0 + (y1 - y0) * g / 4;
      cv::line(img, {x0 + 1, y}, {x1 - 1, y}, grid, 1);
    }
    auto px = [&](double x, double y) {
      return cv::Point(x0 + int(std::lround((x - xmin) / (xmax - xmin) * (x1 - x0 - 10))) + 5,
                       y1 - int(std::lround((y - ylo) / (yhi - ylo) * (y1 - y0))));
    };
    text(short_number(ymax), int(p) * pw + 4, px(xmin, ymax).y + 4, 0.4);  // the y range, at its ends
    text(short_number(ymin), int(p) * pw + 4, px(xmin, ymin).y + 4, 0.4);
    text(fmt::format("{:g}", xmin), x0, y1 + 18);
    text(fmt::format("{:g}", xmax), x1 - 20, y1 + 18);
    text("epoch", (x0 + x1) / 2 - 20, y1 + 36);
    for (size_t ci = 0; ci < panels[p].cols.size(); ++ci, ++series) {
      for (size_t ri = 0; ri < runs.size(); ++ri) {
        const int k = runs[ri].column(panels[p].cols[ci]);
        if (k < 0) continue;
        const cv::Scalar colour = runs.size() == 1 ? bgr(kCurveColours[std::min(series, 3)]) : bgr(run_colours[ri % 8]);
        const int thickness = ci == 0 ? 2 : 1;  // a second eval curve (top-5) is the thinner one
        std::optional<cv::Point> prev;
        for (auto& row : runs[ri].rows) {
          if (!std::isfinite(row[size_t(k)])) continue;
          const cv::Point pt = px(row[0], row[size_t(k)]);
          if (prev) cv::line(img, *prev, pt, colour, thickness, cv::LINE_8);
          cv::circle(img, pt, 3, colour, cv::FILLED, cv::LINE_8);
          prev = pt;
        }
      }
    }
  }
  if (runs.size() == 1) {  // the run's name, top right (the panel titles are top left)
    int base = 0;
    const cv::Size ts = cv::getTextSize(runs[0].name, cv::FONT_HERSHEY_SIMPLEX, 0.45, 1, &base);
    text(runs[0].name, std::max(0, img.cols - ts.width - 8), 16, 0.45);
  } else {
    for (size_t ri = 0; ri < runs.size(); ++ri) {
      const int y = ph + 16 + 22 * int(ri);
      cv::rectangle(img, {left, y - 10}, {left + 24, y}, bgr(run_colours[ri % 8]), cv::FILLED);
      text(runs[ri].name, left + 32, y);
    }
  }
  write_png(png_path, img.cols, img.rows, img.data);
}

}  // namespace imgtrain::engine
