// Errors a user can cause (flags, files, data): one line naming the thing and what is accepted.
// The binary prints them without a stack and exits with code 2. Anything else is a bug.
#pragma once
#include <stdexcept>
#include <string>

namespace imgtrain {

class UserError : public std::runtime_error {
 public:
  explicit UserError(const std::string& msg) : std::runtime_error(msg) {}
};

}  // namespace imgtrain
