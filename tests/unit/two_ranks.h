// Two ranks of one job on two threads of this process, each a client of a store the test hosts.
#pragma once
#include "dist/dist.h"

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <exception>
#include <functional>
#include <thread>

namespace test {

// Runs f(rank, ctx) on two threads that form one job; returns when both are done.
inline void two_ranks(const std::function<void(int, imgtrain::dist::Context&)>& f) {
  c10d::TCPStoreOptions so;
  so.port = 0;
  so.isServer = true;
  so.waitWorkers = false;
  auto server = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", so);
  auto body = [&](int rank) {
    imgtrain::dist::DistEnv env;
    env.rank = rank;
    env.world_size = 2;
    env.local_rank = rank;
    env.local_world_size = 2;
    env.master_port = server->getPort();
    env.use_agent_store = true;
    env.run_id = "unit";
    auto ctx = imgtrain::dist::Context::init(env, {});
    f(rank, *ctx);
  };
  std::exception_ptr err;
  std::thread t([&] {
    try {
      body(1);
    } catch (...) {
      err = std::current_exception();
    }
  });
  body(0);
  t.join();
  if (err) std::rethrow_exception(err);
}

}  // namespace test
