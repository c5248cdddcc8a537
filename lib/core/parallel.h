// fn(i) for i in [0, n) on up to `threads` threads, each taking the next index (file-system scans,
// where many requests in flight help more than cores do).
#pragma once
#include <algorithm>
#include <atomic>
#include <cstddef>
#include <thread>
#include <vector>

namespace imgtrain {

template <typename Fn>
void parallel_for(size_t n, size_t threads, Fn&& fn) {
  std::atomic<size_t> next{0};
  std::vector<std::thread> pool;
  for (size_t t = 0; t < std::max<size_t>(1, std::min(threads, n)); ++t)
    pool.emplace_back([&] {
      for (size_t i; (i = next++) < n;) fn(i);
    });
  for (auto& t : pool) t.join();
}

}  // namespace imgtrain
