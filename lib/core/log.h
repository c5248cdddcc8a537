// The logger: timm-style lines on stdout (info) and stderr (warnings), optionally mirrored to a
// file in the run's output folder. Only rank 0 logs info in a distributed run.
#pragma once
#include <fmt/core.h>
#include <string>

namespace imgtrain::log {

void set_rank(int rank);
void set_file(const std::string& path);  // empty closes
void write_info(const std::string& line);
void write_warning(const std::string& line);
// A live progress line on an interactive terminal (rank 0, stdout a tty, IMGTRAIN_PROGRESS not 0):
// rewritten in place by status(), cleared before the next log line, never in log.txt. Files and
// pipes get only the plain log lines.
bool status_enabled();
void status(const std::string& text);

template <typename... Args>
void info(fmt::format_string<Args...> f, Args&&... args) {
  write_info(fmt::format(f, std::forward<Args>(args)...));
}
template <typename... Args>
void warn(fmt::format_string<Args...> f, Args&&... args) {
  write_warning(fmt::format(f, std::forward<Args>(args)...));
}

}  // namespace imgtrain::log
