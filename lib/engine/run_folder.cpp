#include "engine/run_folder.h"

#include "core/error.h"
#include "core/log.h"

#include <cerrno>
#include <cstring>
#include <ctime>
#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>
#include <filesystem>
#include <fstream>

namespace fs = std::filesystem;

namespace imgtrain::engine {

std::string default_experiment(const std::string& model, int64_t img_size) {
  std::time_t t = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y%m%d-%H%M%S", std::localtime(&t));
  return fmt::format("{}-{}-{}", buf, model, img_size);
}

namespace {
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
}  // namespace

RunFolder::RunFolder(const std::string& output, const std::string& experiment, const std::string& args_yaml,
                     bool primary)
    : dir_((fs::path(output.empty() ? "./output/train" : output) / checked_experiment(experiment)).string()),
      primary_(primary) {
  if (!primary_) return;
  std::error_code ec;
  fs::create_directories(dir_, ec);
  if (ec) throw UserError(fmt::format("--output '{}': cannot create the folder ({})", dir_, ec.message()));
  const std::string lock_path = dir_ + "/.lock";
  const int fd = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) throw UserError(fmt::format("cannot create '{}' ({})", lock_path, std::strerror(errno)));
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
  std::ofstream f(dir_ + "/args.yaml");
  f << args_yaml;
  if (!f) throw UserError(fmt::format("cannot write '{}/args.yaml'", dir_));
}

void RunFolder::open_log() const {
  if (primary_) log::set_file(dir_ + "/log.txt");
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

}  // namespace imgtrain::engine
