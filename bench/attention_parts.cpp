// Where ops/attention.cpp's kernels spend their time: one thread, the 48 heads of ViT-S at batch 8
// (n tokens, 197 by default), each part timed alone over every head (best of 15 passes). Forward:
// the key transpose, the value copy, the scores, the softmax, the value products, the whole head.
// Backward: the key and value transposes, the key copy, the two score products (q k^T, dO V^T),
// the probabilities and dS, the three gradient products, the whole head. It compiles the kernels'
// translation unit into itself to reach its internal parts.
//   g++ -O3 -std=gnu++20 -Ilib -isystem $T/include -isystem $T/include/torch/csrc/api/include \
//       bench/attention_parts.cpp -o /tmp/attention_parts -L$T/lib -ltorch -ltorch_cpu -lc10 \
//       -Wl,-rpath,$T/lib -Wno-psabi      (T=$(.venv/bin/python -c 'import torch, os; print(os.path.dirname(torch.__file__))'))
//   taskset -c 1 /tmp/attention_parts [TOKENS]
#include "ops/attention.cpp"

#include <chrono>
#include <cstdio>
#include <random>

int main(int argc, char** argv) {
  using namespace imgtrain::ops;
#ifdef IMGTRAIN_ATTENTION_AVX512
  if (!cpu_has_avx512()) {
    std::puts("attention_parts: this CPU has no AVX-512; the kernel does not run here");
    return 1;
  }
  const int64_t n = argc > 1 ? std::atoll(argv[1]) : 197, heads = 6, imgs = 8, c = heads * kHead, ld = 3 * c;
  if (n < 1 || n > kMaxTokens) {
    std::printf("attention_parts: tokens in 1..%ld\n", long(kMaxTokens));
    return 1;
  }
  std::vector<float> qkv(size_t(imgs * n * ld)), out(size_t(imgs * n * c));
  std::mt19937 gen(1);
  std::normal_distribution<float> normal;
  for (auto& x : qkv) x = normal(gen);
  AlignedVector<float> scratch(size_t(scratch_size(n)));
  const int64_t np = padded(n);
  float *kt = scratch.data(), *s = kt + kHead * np, *vb = s + n * np, *rmax = vb + n * kHead, *inv = rmax + n;
  auto head = [&](int64_t t) { return qkv.data() + (t / heads) * n * ld + (t % heads) * kHead; };
  auto dst = [&](int64_t t) { return out.data() + (t / heads) * n * c + (t % heads) * kHead; };
  auto time = [&](auto&& f) {
    double best = 1e30;
    for (int rep = 0; rep < 15; ++rep) {
      const auto t0 = std::chrono::steady_clock::now();
      for (int64_t t = 0; t < imgs * heads; ++t) f(t);
      best = std::min(best, std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    return best;
  };
  const float scale = 1.0f / std::sqrt(float(kHead));
  const double whole = time([&](int64_t t) {
    const float* b = head(t);
    attend_head(b, b + c, b + 2 * c, ld, n, scale, dst(t), c, nullptr, scratch.data());
  });
  const double tr = time([&](int64_t t) { transpose_panels(head(t) + c, ld, n, scale, kt); });
  const double cp = time([&](int64_t t) { copy_rows(head(t) + 2 * c, ld, n, vb); });
  const double sc = time([&](int64_t t) { scores(head(t), ld, kt, n, s, rmax); });
  const double sm = time([&](int64_t) { softmax_rows(s, n, rmax, inv, nullptr); });
  const double pr = time([&](int64_t t) { products<false>(s, np, vb, kHead, n, dst(t), c, inv); });
  const double gflop = 2.0 * n * n * kHead * imgs * heads / 1e6;  // per product, in GFLOP * 1000
  std::printf("forward, %ld tokens, %ld heads, one thread, ms: whole %.3f | key transpose %.3f, value copy %.3f, "
              "scores %.3f (%.0f GFLOP/s), softmax %.3f, values %.3f (%.0f GFLOP/s)\n",
              long(n), long(imgs * heads), whole, tr, cp, sc, gflop / sc, sm, pr, gflop / pr);

  // backward: the output, its log-sum-exp and a random output gradient
  std::vector<float> lse(size_t(imgs * heads * n)), go(out.size()), dqkv(qkv.size());
  for (int64_t t = 0; t < imgs * heads; ++t) {
    const float* b = head(t);
    attend_head(b, b + c, b + 2 * c, ld, n, scale, dst(t), c, lse.data() + t * n, scratch.data());
  }
  for (auto& x : go) x = normal(gen);
  float *vt = kt + kHead * np, *p = vt + kHead * np, *ds = p + n * np, *kb = ds + n * np, *bmax = kb + n * kHead;
  std::vector<float> ones(size_t(n), 1.0f), scales(size_t(n), scale);
  auto grad = [&](int64_t t) { return dqkv.data() + (t / heads) * n * ld + (t % heads) * kHead; };
  auto gout = [&](int64_t t) { return go.data() + (t / heads) * n * c + (t % heads) * kHead; };
  const double bwhole = time([&](int64_t t) {
    const float* b = head(t);
    float* d = grad(t);
    attend_head_backward(b, b + c, b + 2 * c, ld, dst(t), gout(t), c, lse.data() + t * n, n, scale, d, d + c,
                         d + 2 * c, scratch.data());
  });
  const double btr = time([&](int64_t t) {
    transpose_panels(head(t) + c, ld, n, scale, kt);
    transpose_panels(head(t) + 2 * c, ld, n, 1.0f, vt);
  });
  const double bcp = time([&](int64_t t) { copy_rows(head(t) + c, ld, n, kb); });
  const double bsc = time([&](int64_t t) {
    scores(head(t), ld, kt, n, p, bmax);
    scores(gout(t), c, vt, n, ds, bmax);
  });
  const double bpg = time([&](int64_t t) { probability_grads(p, ds, n, dst(t), gout(t), c, lse.data() + t * n); });
  const double bdv = time([&](int64_t t) { products<true>(p, np, gout(t), c, n, grad(t) + 2 * c, ld, ones.data()); });
  const double bdq = time([&](int64_t t) { products<false>(ds, np, kb, kHead, n, grad(t), ld, scales.data()); });
  const double bdk = time([&](int64_t t) { products<true>(ds, np, head(t), ld, n, grad(t) + c, ld, scales.data()); });
  std::printf("backward, ms: whole %.3f | transposes %.3f, key copy %.3f, two score products %.3f (%.0f GFLOP/s), "
              "P and dS %.3f, dV %.3f, dQ %.3f, dK %.3f (%.0f, %.0f, %.0f GFLOP/s)\n",
              bwhole, btr, bcp, bsc, 2 * gflop / bsc, bpg, bdv, bdq, bdk, gflop / bdv, gflop / bdq, gflop / bdk);
  return 0;
#else
  std::puts("attention_parts: the kernel needs GCC on x86-64");
  return 1;
#endif
}
