// dist::Context in one process: two ranks on threads, each a client of a store the test hosts.
// SyncBatchNorm and the reducer against one BatchNorm / one model on the union batch, in float64
// (so any difference is a formula error, not rounding).
#ifndef USE_C10D_GLOO
#define USE_C10D_GLOO
#endif
#include "core/batch_norm.h"
#include "dist/dist.h"
#include "two_ranks.h"

#include "test_util.h"

#include <catch2/catch.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <thread>

using namespace imgtrain;


TEST_CASE("SyncBatchNorm on 2 ranks equals BatchNorm on the union batch (float64)", "[dist]") {
  torch::manual_seed(3);
  const auto opts = torch::TensorOptions().dtype(torch::kFloat64);
  auto x = torch::randn({8, 3, 5, 4}, opts) * 2 + 1, dy = torch::randn({8, 3, 5, 4}, opts);
  auto w = torch::rand({3}, opts) + 0.5, b = torch::randn({3}, opts);
  // Reference: one BatchNorm, all 8 samples.
  BatchNorm2d ref(3);
  ref->to(torch::kFloat64);
  {
    torch::NoGradGuard ng;
    ref->weight.copy_(w);
    ref->bias.copy_(b);
  }
  auto xr = x.clone().requires_grad_(true);
  (ref(xr) * dy).sum().backward();
  std::vector<at::Tensor> gx(2), gw(2), gb(2), rm(2), rv(2);
  test::two_ranks([&](int rank, dist::Context& ctx) {
    BatchNorm2d bn(3);
    bn->to(torch::kFloat64);
    {
      torch::NoGradGuard ng;
      bn->weight.copy_(w);
      bn->bias.copy_(b);
    }
    ctx.convert_sync_batchnorm(*bn);
    REQUIRE(bn->sync != nullptr);
    auto xi = x.narrow(0, 4 * rank, 4).clone().requires_grad_(true);
    (bn(xi) * dy.narrow(0, 4 * rank, 4)).sum().backward();
    gx[size_t(rank)] = xi.grad();
    gw[size_t(rank)] = bn->weight.grad();
    gb[size_t(rank)] = bn->bias.grad();
    rm[size_t(rank)] = bn->running_mean.clone();
    rv[size_t(rank)] = bn->running_var.clone();
  });
  CHECK(torch::allclose(torch::cat({gx[0], gx[1]}), xr.grad(), 1e-10, 1e-12));
  // Weight and bias gradients are per rank (the reducer averages them): their sum is the union's.
  CHECK(torch::allclose(gw[0] + gw[1], ref->weight.grad(), 1e-10, 1e-12));
  CHECK(torch::allclose(gb[0] + gb[1], ref->bias.grad(), 1e-10, 1e-12));
  for (int r = 0; r < 2; ++r) {
    CHECK(torch::allclose(rm[size_t(r)], ref->running_mean, 1e-12, 1e-14));
    CHECK(torch::allclose(rv[size_t(r)], ref->running_var, 1e-12, 1e-14));
  }
}

TEST_CASE("the reducer averages gradients over ranks and skips no-sync micro-steps (float64)", "[dist]") {
  torch::manual_seed(5);
  const auto opts = torch::TensorOptions().dtype(torch::kFloat64);
  auto x = torch::randn({4, 6}, opts), y = torch::randn({4, 2}, opts);
  torch::nn::Linear ref(6, 2);
  ref->to(torch::kFloat64);
  // Reference: the mean loss over the union batch.
  torch::nn::functional::mse_loss(ref(x), y).backward();
  std::vector<at::Tensor> gw(2), gw_local(2);
  std::vector<int64_t> reduces(2);
  test::two_ranks([&](int rank, dist::Context& ctx) {
    torch::manual_seed(100 + rank);  // different initial weights: broadcast_model makes them rank 0's
    torch::nn::Linear m(6, 2);
    m->to(torch::kFloat64);
    if (rank == 0) {
      torch::NoGradGuard ng;
      m->weight.copy_(ref->weight);
      m->bias.copy_(ref->bias);
    }
    ctx.broadcast_model(*m);
    auto sync = ctx.grad_sync(*m, 25, true);
    const int64_t before = ctx.allreduce_calls();
    auto xi = x.narrow(0, 2 * rank, 2), yi = y.narrow(0, 2 * rank, 2);
    // A no-sync micro-step: the gradient stays local.
    sync->before_forward(false);
    auto loss = torch::nn::functional::mse_loss(m(xi), yi);
    sync->after_forward(false);
    loss.backward();
    gw_local[size_t(rank)] = m->weight.grad().clone();
    reduces[size_t(rank)] = ctx.allreduce_calls() - before;
    m->zero_grad();
    sync->before_forward(true);
    loss = torch::nn::functional::mse_loss(m(xi), yi);
    sync->after_forward(true);
    loss.backward();
    gw[size_t(rank)] = m->weight.grad().clone();
  });
  CHECK(reduces[0] == 0);
  CHECK(reduces[1] == 0);
  CHECK(!torch::allclose(gw_local[0], gw_local[1]));
  // Each rank's loss is the mean over its 2 samples; the average over ranks is the union's mean.
  CHECK(torch::allclose(gw[0], ref->weight.grad(), 1e-12, 1e-14));
  CHECK(torch::allclose(gw[1], ref->weight.grad(), 1e-12, 1e-14));
}

TEST_CASE("CUDA: the stop agreement answers one call late without a host synchronisation (NCCL, one rank)",
          "[cuda][dist]") {
  test::skip_unless(torch::cuda::is_available());
  c10d::TCPStoreOptions so;
  so.port = 0;
  so.isServer = true;
  so.waitWorkers = false;
  auto server = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", so);
  dist::DistEnv env;
  env.world_size = 1;
  env.local_world_size = 1;
  env.master_port = server->getPort();
  env.use_agent_store = true;
  env.run_id = "unit-cuda";
  dist::InitOptions io;
  io.device = torch::Device(torch::kCUDA, 0);
  auto ctx = dist::Context::init(env, io);
  REQUIRE(ctx->backend() == "nccl");
  CHECK_FALSE(ctx->any_lagged(true));  // no answer yet
  CHECK(ctx->any_lagged(false));       // the previous call's flag
  CHECK_FALSE(ctx->any_lagged(false));
  ctx->any_lagged(true);
  ctx->reset_lagged();  // an epoch starts: the pending answer is dropped
  CHECK_FALSE(ctx->any_lagged(false));
  CHECK(ctx->any(true));
}
