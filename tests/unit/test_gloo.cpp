// The distributed issue builds on c10d's Gloo backend. The torch wheel lacks gloo's headers;
// Debian's libgloo-dev provides them. This proves that pairing compiles, links and runs.
#include "test_util.h"

#include <catch2/catch.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <thread>

TEST_CASE("c10d Gloo all-reduce across two ranks on loopback", "[dist][gloo]") {
  c10d::TCPStoreOptions so;
  so.port = 0;  // any free port
  so.isServer = true;
  so.numWorkers = 2;
  so.waitWorkers = false;
  auto server = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", so);
  const auto port = server->getPort();
  std::vector<at::Tensor> results(2);
  auto rank_main = [&](int rank) {
    c10d::TCPStoreOptions co;
    co.port = port;
    co.isServer = false;
    c10::intrusive_ptr<c10d::Store> store = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", co);
    store = c10::make_intrusive<c10d::PrefixStore>("test", store);
    auto opts = c10d::ProcessGroupGloo::Options::create();
    opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
    auto pg = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, 2, opts);
    std::vector<at::Tensor> t{at::arange(4, at::kFloat) * (rank + 1)};
    pg->allreduce(t)->wait();
    results[size_t(rank)] = t[0];
  };
  std::thread r1(rank_main, 1);
  rank_main(0);
  r1.join();
  auto want = at::arange(4, at::kFloat) * 3;  // 1x + 2x
  CHECK(at::equal(results[0], want));
  CHECK(at::equal(results[1], want));
}
