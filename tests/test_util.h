// Small helpers shared by the tests: scratch folders and running the real binary.
#pragma once
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

namespace test {

// First line of a test that needs something this machine may lack (a GPU): without it the whole
// test process ends as skipped (exit 77, the SKIP_RETURN_CODE of those ctest entries).
inline void skip_unless(bool available, const char* why = "no CUDA device") {
  if (available) return;
  std::printf("skipped: %s\n", why);
  std::fflush(stdout);
  std::_Exit(77);
}

// The message of the exception of type E that f throws ("" when it throws none).
template <typename E>
std::string error_text(const std::function<void()>& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  return "";
}

// A fresh folder under the system temp dir, removed when the object dies.
struct TempDir {
  std::filesystem::path path;
  explicit TempDir(const std::string& tag = "t") {
    std::string tmpl = (std::filesystem::temp_directory_path() / ("imgtrain-" + tag + "-XXXXXX")).string();
    path = mkdtemp(tmpl.data());
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  std::string operator/(const std::string& p) const { return (path / p).string(); }
};

inline void write_file(const std::string& path, const std::string& bytes) {
  std::filesystem::create_directories(std::filesystem::path(path).parent_path());
  std::ofstream f(path, std::ios::binary);
  f << bytes;
}

inline std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// What f writes to this process's stderr (file descriptor 2, so C stdio and libraries' writes
// too) while it runs; an exception from f is caught and dropped. `dir`: a folder for the sink file.
inline std::string stderr_of(const std::function<void()>& f, const TempDir& dir) {
  const std::string sink_path = dir / "stderr-of.txt";
  std::fflush(stderr);
  const int saved = dup(2);
  FILE* sink = std::fopen(sink_path.c_str(), "w");
  dup2(fileno(sink), 2);
  try {
    f();
  } catch (...) {
  }
  std::fflush(stderr);
  dup2(saved, 2);
  close(saved);
  std::fclose(sink);
  return read_file(sink_path);
}

struct RunResult {
  int code;
  std::string output;  // stdout and stderr together
};

// Runs `cmd` through the shell with stderr merged into stdout (of every command in it).
inline RunResult run(const std::string& cmd) {
  std::string full = "{ " + cmd + "\n} 2>&1";
  FILE* p = popen(full.c_str(), "r");
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  int status = pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

// Binds a TCP socket to 127.0.0.1:port (0: the kernel's pick) and closes it: the port that was
// free a moment ago, or 0 when `port` is taken.
inline int bind_port(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(uint16_t(port));
  socklen_t len = sizeof a;
  int got = 0;
  if (fd >= 0 && bind(fd, (sockaddr*)&a, sizeof a) == 0 && getsockname(fd, (sockaddr*)&a, &len) == 0)
    got = ntohs(a.sin_port);
  if (fd >= 0) close(fd);
  return got;
}
inline int free_port() { return bind_port(0); }

}  // namespace test
