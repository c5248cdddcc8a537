// Precompiled header for every imgtrain translation unit: the heavy, never-changing includes.
#pragma once
#include <torch/torch.h>
#include <fmt/core.h>
#include <fmt/format.h>
#include <algorithm>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>
