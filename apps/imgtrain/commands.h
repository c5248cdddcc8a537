// One function per subcommand; each returns the exit code.
#pragma once
#include <string>
#include <vector>

namespace imgtrain::app {
int train(const std::vector<std::string>& args);
int validate(const std::vector<std::string>& args);
int benchmark(const std::vector<std::string>& args);
int models(const std::vector<std::string>& args);
int export_weights(const std::vector<std::string>& args);
int pack(const std::vector<std::string>& args);
int plot(const std::vector<std::string>& args);
int evaluate_coco(const std::vector<std::string>& args);
int coco_info(const std::vector<std::string>& args);
int version(const char* version);
}  // namespace imgtrain::app
