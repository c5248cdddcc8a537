// A float32 GEMM for inference linears on AVX2 CPUs, tried for ViT-S's inference and left out
// (docs/performance.md, 2026-12-07, sixth session): y = act(x W^T + b) or x W^T + b + residual, W
// packed once into 16-column panels, 6 x 16 output tiles accumulated in registers over K in blocks
// of 384, rows split between threads (evenly, or blocks taken in turn). Against oneDNN's linear
// with its weight in oneDNN's own layout (mkldnn::_linear_pointwise after
// mkldnn::_reorder_linear_weight, what imgtrain's inference runs) and ATen's linear (MKL's sgemm):
// ViT-S's four linears at batch 8 (1576 tokens) and ConvNeXt-T's first-stage MLP, best of 5 passes
// in each of 5 alternating rounds; the epilogues ViT uses (GELU, the residual add); and a chain of
// 12 ViT-S blocks' linears with their own weights (88 MB: read from memory every pass, as in the
// model), 30 alternating passes, minimum and median. Milliseconds and GFLOP/s at the thread count
// OMP_NUM_THREADS gives; errors against float64 relative to the output's largest magnitude.
// Then ResNet-50's stride-1 1x1 convolutions (channels-last maps are [M, C] matrices) against
// oneDNN's fused convolution with its own weight layout (mkldnn::_convolution_pointwise, the
// residual ones in place by mkldnn::_convolution_pointwise_, as imgtrain's inference runs them),
// with the ReLU epilogue and the residual accumulated into the output (2026-12-07, seventh session).
//   g++ -O3 -std=gnu++20 -fno-trapping-math -fno-thread-jumps -Ilib -isystem $T/include \
//       -isystem $T/include/torch/csrc/api/include bench/gemm_parts.cpp -o /tmp/gemm_parts \
//       -L$T/lib -ltorch -ltorch_cpu -lc10 -Wl,-rpath,$T/lib -Wno-psabi -fopenmp
//       (T=$(.venv/bin/python -c 'import torch, os; print(os.path.dirname(torch.__file__))'))
//   OMP_NUM_THREADS=2 /tmp/gemm_parts
#include "best_ms.h"
#include "ops/kernel_util.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <vector>

#if defined(__GNUC__) && defined(__x86_64__)
#define IMGTRAIN_GEMM_X86 1
#include <immintrin.h>
#endif

namespace imgtrain::ops {
enum class GemmAct { None, GELU, ReLU };
namespace {
constexpr int64_t kNR = 16;   // columns of a panel and of a tile: two 8-float registers
constexpr int64_t kMR = 6;    // rows of a tile: 12 accumulators, 2 panel registers, 1 broadcast
constexpr int64_t kKC = 384;  // K per pass: a panel's 384 x 16 floats (24 KB) stay in L1
constexpr int64_t kMB = 16;   // tiles' rows per block (96 rows of x, 144 KB at K 384, in L2)
constexpr int64_t kPC = 12;   // panels per block when blocks are taken in turn (192 columns)
}  // namespace

#ifdef IMGTRAIN_GEMM_X86
namespace avx2 {
#pragma GCC push_options
#pragma GCC target("avx2,fma")

struct Epilogue {
  const float* residual;  // [M, N] or null
  GemmAct act;
};

// The 16 outputs of one row of a tile: the sums so far, the bias, the residual, the activation
inline void finish_row(float* c, __m256 x0, __m256 x1, bool accumulate, bool last, const Epilogue& e,
                       const float* bias, const float* res) {
  if (accumulate) {
    x0 = _mm256_add_ps(x0, _mm256_loadu_ps(c));
    x1 = _mm256_add_ps(x1, _mm256_loadu_ps(c + 8));
  }
  if (last) {
    if (bias) {
      x0 = _mm256_add_ps(x0, _mm256_loadu_ps(bias));
      x1 = _mm256_add_ps(x1, _mm256_loadu_ps(bias + 8));
    }
    if (res) {
      x0 = _mm256_add_ps(x0, _mm256_loadu_ps(res));
      x1 = _mm256_add_ps(x1, _mm256_loadu_ps(res + 8));
    }
    if (e.act == GemmAct::ReLU) {
      x0 = _mm256_max_ps(x0, _mm256_setzero_ps());
      x1 = _mm256_max_ps(x1, _mm256_setzero_ps());
    }
    if (e.act == GemmAct::GELU) {
      alignas(32) float t[kNR];
      _mm256_store_ps(t, x0);
      _mm256_store_ps(t + 8, x1);
      for (int j = 0; j < kNR; ++j) t[j] = gelu_of(t[j], erf_parts(t[j] * kAlpha).erf);
      x0 = _mm256_load_ps(t);
      x1 = _mm256_load_ps(t + 8);
    }
  }
  _mm256_storeu_ps(c, x0);
  _mm256_storeu_ps(c + 8, x1);
}

// one row of a tile at one k: lo, hi += a[k] * (b0, b1)
__attribute__((always_inline)) inline void step(const float* a, __m256 b0, __m256 b1, __m256& lo, __m256& hi) {
  const __m256 x = _mm256_broadcast_ss(a);
  lo = _mm256_fmadd_ps(x, b0, lo);
  hi = _mm256_fmadd_ps(x, b1, hi);
}

// C[MR rows, 16] (+)= A[MR rows, K] B-panel[K, 16]: A's rows at stride lda, read by broadcasts;
// the K products of each output summed in order, one fused multiply-add each
template <int MR>
inline void tile(const float* A, int64_t lda, const float* B, int64_t K, float* C, int64_t ldc, bool accumulate,
                 bool last, const Epilogue& e, const float* bias, const float* res) {
  const float* a0 = A;
  const float* a1 = A + (MR > 1 ? lda : 0);
  const float* a2 = A + (MR > 2 ? 2 * lda : 0);
  const float* a3 = A + (MR > 3 ? 3 * lda : 0);
  const float* a4 = A + (MR > 4 ? 4 * lda : 0);
  const float* a5 = A + (MR > 5 ? 5 * lda : 0);
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, c31 = c00,
         c40 = c00, c41 = c00, c50 = c00, c51 = c00;
#pragma GCC unroll 4
  for (int64_t k = 0; k < K; ++k) {
    const __m256 b0 = _mm256_load_ps(B + k * kNR), b1 = _mm256_load_ps(B + k * kNR + 8);
    step(a0 + k, b0, b1, c00, c01);
    if constexpr (MR > 1) step(a1 + k, b0, b1, c10, c11);
    if constexpr (MR > 2) step(a2 + k, b0, b1, c20, c21);
    if constexpr (MR > 3) step(a3 + k, b0, b1, c30, c31);
    if constexpr (MR > 4) step(a4 + k, b0, b1, c40, c41);
    if constexpr (MR > 5) step(a5 + k, b0, b1, c50, c51);
  }
  const int64_t ldr = res ? ldc : 0;
  finish_row(C, c00, c01, accumulate, last, e, bias, res);
  if constexpr (MR > 1) finish_row(C + ldc, c10, c11, accumulate, last, e, bias, res ? res + ldr : nullptr);
  if constexpr (MR > 2) finish_row(C + 2 * ldc, c20, c21, accumulate, last, e, bias, res ? res + 2 * ldr : nullptr);
  if constexpr (MR > 3) finish_row(C + 3 * ldc, c30, c31, accumulate, last, e, bias, res ? res + 3 * ldr : nullptr);
  if constexpr (MR > 4) finish_row(C + 4 * ldc, c40, c41, accumulate, last, e, bias, res ? res + 4 * ldr : nullptr);
  if constexpr (MR > 5) finish_row(C + 5 * ldc, c50, c51, accumulate, last, e, bias, res ? res + 5 * ldr : nullptr);
}

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, bool, bool, const Epilogue&,
                        const float*, const float*);
constexpr TileFn kTiles[kMR + 1] = {nullptr, tile<1>, tile<2>, tile<3>, tile<4>, tile<5>, tile<6>};

// Rows [m0, m1) and panels [p0, p1) of C [M, N] = A [M, K] B^T with B's panels [P, K, 16], the
// epilogue at the last K block. bias [N] or null. into: C holds the residual, the sums are added to it.
void block(const float* A, int64_t K, const float* panels, int64_t N, float* C, int64_t m0, int64_t m1, int64_t p0,
           int64_t p1, const Epilogue& e, const float* bias, bool into = false) {
  for (int64_t k0 = 0; k0 < K; k0 += kKC) {
    const int64_t kc = std::min(kKC, K - k0);
    const bool accumulate = into || k0 > 0, last = k0 + kc == K;
    for (int64_t p = p0; p < p1; ++p) {
      const float* B = panels + (p * K + k0) * kNR;
      const int64_t n0 = p * kNR;
      for (int64_t m = m0; m < m1; m += kMR) {
        const int64_t mr = std::min(kMR, m1 - m);
        kTiles[mr](A + m * K + k0, K, B, kc, C + m * N + n0, N, accumulate, last, e, bias ? bias + n0 : nullptr,
                   e.residual ? e.residual + m * N + n0 : nullptr);
      }
    }
  }
}

#pragma GCC pop_options
}  // namespace avx2
#endif  // IMGTRAIN_GEMM_X86

bool gemm_supported() {
#ifdef IMGTRAIN_GEMM_X86
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return ok;
#else
  return false;
#endif
}

at::Tensor gemm_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.device().is_cpu(),
              "gemm_pack: a float32 CPU weight [N, K]");
  const int64_t N = weight.size(0), K = weight.size(1), P = N / kNR;
  TORCH_CHECK(N % kNR == 0, "gemm_pack: N a multiple of 16");
  auto out = at::empty({P, K, kNR}, weight.options());
  const auto w = weight.contiguous();
  const float* src = w.const_data_ptr<float>();
  float* dst = out.data_ptr<float>();
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) dst[((n / kNR) * K + k) * kNR + n % kNR] = src[n * K + k];
  return out;
}

at::Tensor gemm_linear(const at::Tensor& x, const at::Tensor& panels, int64_t N, const at::Tensor& bias,
                       GemmAct act = GemmAct::None, const at::Tensor& residual = {}, bool dynamic = false,
                       bool into = false) {  // into: the sums added to the residual, in place
  TORCH_CHECK(gemm_supported(), "gemm_linear: this CPU has no AVX2 and FMA");
  const int64_t K = x.size(-1), P = N / kNR;
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.device().is_cpu() && K > 0 && N % kNR == 0 &&
                  panels.sizes() == at::IntArrayRef({P, K, kNR}) && panels.is_contiguous() &&
                  (!bias.defined() || bias.numel() == N) && (!residual.defined() || act != GemmAct::GELU) &&
                  (!into || (residual.defined() && residual.is_contiguous())),
              "gemm_linear: float32 CPU x [..., K], panels [N / 16, K, 16], bias [N], a residual without GELU "
              "(contiguous when written in place)");
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  auto out = into ? residual : at::empty(sizes, x.options());
  TORCH_CHECK(!residual.defined() || residual.sizes() == out.sizes(), "gemm_linear: residual shaped as the output");
  const int64_t M = x.numel() / K;
#ifdef IMGTRAIN_GEMM_X86
  const auto xc = x.contiguous();
  const auto rc = residual.defined() ? residual.contiguous() : residual;
  const auto bc = bias.defined() ? bias.contiguous() : bias;
  const avx2::Epilogue e{rc.defined() && !into ? rc.const_data_ptr<float>() : nullptr, act};
  const float* A = xc.const_data_ptr<float>();
  const float* B = panels.const_data_ptr<float>();
  float* C = out.data_ptr<float>();
  const float* bp = bc.defined() ? bc.const_data_ptr<float>() : nullptr;
  if (dynamic) {  // blocks of 96 rows x 192 columns taken in turn by whichever thread is free
    const int64_t mblocks = (M + kMB * kMR - 1) / (kMB * kMR), pchunks = (P + kPC - 1) / kPC;
    std::atomic<int64_t> next{0};
    at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
      for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < mblocks * pchunks;) {
        const int64_t m0 = (i / pchunks) * kMB * kMR, p0 = (i % pchunks) * kPC;
        avx2::block(A, K, B, N, C, m0, std::min(M, m0 + kMB * kMR), p0, std::min(P, p0 + kPC), e, bp, into);
      }
    });
  } else {  // rows split evenly between the threads
    const int64_t tiles = (M + kMR - 1) / kMR;
    at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
      const int64_t r0 = t0 * kMR, r1 = std::min(M, t1 * kMR);
      for (int64_t m0 = r0; m0 < r1; m0 += kMB * kMR)
        avx2::block(A, K, B, N, C, m0, std::min(r1, m0 + kMB * kMR), 0, P, e, bp, into);
    });
  }
#endif
  return out;
}

}  // namespace imgtrain::ops


int main() {
  c10::InferenceMode guard;
  if (!imgtrain::ops::gemm_supported()) {
    std::printf("this CPU has no AVX2 and FMA\n");
    return 0;
  }
  const auto linear = c10::Dispatcher::singleton()
                          .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                            c10::string_view, c10::List<std::optional<c10::Scalar>>,
                                            std::optional<c10::string_view>)>();
  const auto reorder = c10::Dispatcher::singleton()
                           .findSchemaOrThrow("mkldnn::_reorder_linear_weight", "")
                           .typed<at::Tensor(const at::Tensor&, std::optional<int64_t>)>();
  std::printf("%5s %5s %5s | %17s %17s %17s | %8s %8s %8s\n", "M", "K", "N", "ATen ms (GF/s)", "oneDNN ms (GF/s)",
              "imgtrain ms (GF/s)", "err ATen", "err dnn", "err ours");
  const std::vector<std::array<int64_t, 3>> shapes = {
      {1576, 384, 1152}, {1576, 384, 384}, {1576, 384, 1536}, {1576, 1536, 384}, {25088, 96, 384}, {25088, 384, 96}};
  double sums[3] = {0, 0, 0};
  for (auto [M, K, N] : shapes) {
    const auto x = at::randn({M, K});
    const auto w = at::randn({N, K}) / std::sqrt(double(K));
    const auto b = at::randn({N}) * 0.1;
    const auto wd = reorder.call(w, std::optional<int64_t>(M));
    const auto panels = imgtrain::ops::gemm_pack(w);
    at::Tensor ya, yd, yo;
    double ta = 1e30, td = 1e30, to = 1e30;
    for (int round = 0; round < 5; ++round) {
      ta = std::min(ta, best_ms([&] { ya = at::linear(x, w, b); }, 5));
      td = std::min(td, best_ms([&] { yd = linear.call(x, wd, b, "none", c10::List<std::optional<c10::Scalar>>(), std::nullopt); }, 5));
      to = std::min(to, best_ms([&] { yo = imgtrain::ops::gemm_linear(x, panels, N, b); }, 5));
    }
    const auto ref = at::linear(x.to(at::kDouble), w.to(at::kDouble), b.to(at::kDouble));
    const double scale = ref.abs().max().item<double>();
    auto err = [&](const at::Tensor& y) { return (y.to(at::kDouble) - ref).abs().max().item<double>() / scale; };
    const double gf = 2e-6 * double(M) * double(K) * double(N);
    std::printf("%5ld %5ld %5ld | %7.2f (%6.1f)  %7.2f (%6.1f)  %7.2f (%6.1f)  | %.2e %.2e %.2e\n", long(M), long(K),
                long(N), ta, gf / ta, td, gf / td, to, gf / to, err(ya), err(yd), err(yo));
    if (M == 1576) sums[0] += ta, sums[1] += td, sums[2] += to;
  }
  // with the epilogues ViT's blocks use: fc1 with the exact GELU, fc2 with the residual add
  const auto binary = c10::Dispatcher::singleton()
                          .findSchemaOrThrow("mkldnn::_linear_pointwise", "binary")
                          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                            const std::optional<at::Tensor>&, c10::string_view)>();
  for (auto [K, N] : std::vector<std::array<int64_t, 2>>{{384, 1536}, {1536, 384}}) {
    const int64_t M = 1576;
    const bool gelu = N > K;
    const auto x = at::randn({M, K});
    const auto w = at::randn({N, K}) / std::sqrt(double(K));
    const auto b = at::randn({N}) * 0.1;
    const auto r = at::randn({M, N});
    const auto wd = reorder.call(w, std::optional<int64_t>(M));
    const auto panels = imgtrain::ops::gemm_pack(w);
    at::Tensor yd, yo;
    double td = 1e30, to = 1e30;
    for (int round = 0; round < 5; ++round) {
      td = std::min(td, best_ms([&] {
             yd = gelu ? linear.call(x, wd, b, "gelu", c10::List<std::optional<c10::Scalar>>(), "none")
                       : binary.call(x, r, wd, b, "add");
           }, 5));
      to = std::min(to, best_ms([&] {
             yo = gelu ? imgtrain::ops::gemm_linear(x, panels, N, b, imgtrain::ops::GemmAct::GELU)
                       : imgtrain::ops::gemm_linear(x, panels, N, b, imgtrain::ops::GemmAct::None, r);
           }, 5));
    }
    const double gf = 2e-6 * double(M) * double(K) * double(N);
    std::printf("%5ld %5ld %5ld %s | oneDNN %7.2f (%6.1f)  imgtrain %7.2f (%6.1f)  max diff %.2e\n", long(M), long(K),
                long(N), gelu ? "+ GELU    " : "+ residual", td, gf / td, to, gf / to,
                (yd - yo).abs().max().item<double>());
  }
  std::printf("ViT-S's four linears: ATen %.2f ms, oneDNN %.2f ms, imgtrain %.2f ms (%.3fx oneDNN, %.3fx ATen)\n",
              sums[0], sums[1], sums[2], sums[1] / sums[2], sums[0] / sums[2]);

  {  // the chain
  const int64_t M = 1576, C = 384;
    struct L { at::Tensor w, b, wd, p; int64_t N; };
    std::vector<std::array<L, 4>> blocks;
    auto mk = [&](int64_t N, int64_t K) { L l; l.w = at::randn({N, K}) / std::sqrt(double(K)); l.b = at::randn({N}) * 0.1; l.wd = reorder.call(l.w, std::optional<int64_t>(M)); l.p = imgtrain::ops::gemm_pack(l.w); l.N = N; return l; };
    for (int i = 0; i < 12; ++i) blocks.push_back({mk(3 * C, C), mk(C, C), mk(4 * C, C), mk(C, 4 * C)});
    auto x0 = at::randn({M, C});
    auto run = [&](bool ours, bool dyn) {
      auto x = x0;
      for (auto& bl : blocks) {
        at::Tensor t, h;
        if (ours) {
          t = imgtrain::ops::gemm_linear(x, bl[0].p, bl[0].N, bl[0].b, imgtrain::ops::GemmAct::None, {}, dyn);
          x = imgtrain::ops::gemm_linear(t.narrow(1, 0, C).contiguous(), bl[1].p, C, bl[1].b,
                                         imgtrain::ops::GemmAct::None, x, dyn);
          h = imgtrain::ops::gemm_linear(x, bl[2].p, bl[2].N, bl[2].b, imgtrain::ops::GemmAct::GELU, {}, dyn);
          x = imgtrain::ops::gemm_linear(h, bl[3].p, C, bl[3].b, imgtrain::ops::GemmAct::None, x, dyn);
        } else {
          t = linear.call(x, bl[0].wd, bl[0].b, "none", c10::List<std::optional<c10::Scalar>>(), std::nullopt);
          x = binary.call(t.narrow(1, 0, C).contiguous(), x, bl[1].wd, bl[1].b, "add");
          h = linear.call(x, bl[2].wd, bl[2].b, "gelu", c10::List<std::optional<c10::Scalar>>(), "none");
          x = binary.call(h, x, bl[3].wd, bl[3].b, "add");
        }
      }
      return x;
    };
    std::vector<double> td, to, ts;
    for (int r = 0; r < 30; ++r)
      for (int v : {0, 1, 2}) {
        bool ours = v > 0;
              auto t0 = std::chrono::steady_clock::now();
        run(ours, v == 2);
        double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
        (v == 0 ? td : v == 1 ? ts : to).push_back(ms);
      }
    std::sort(td.begin(), td.end()); std::sort(to.begin(), to.end()); std::sort(ts.begin(), ts.end());
    
  std::printf("12 blocks' linears: oneDNN min %.1f median %.1f ms | imgtrain, rows split evenly: min %.1f median %.1f "
                "(%.3fx, %.3fx) | blocks taken in turn: min %.1f median %.1f (%.3fx, %.3fx)\n",
                td[0], td[15], ts[0], ts[15], td[0] / ts[0], td[15] / ts[15], to[0], to[15], td[0] / to[0],
                td[15] / to[15]);
  }

  {  // ResNet-50's stride-1 1x1 convolutions: channels-last, batch 8, folded BatchNorm as the bias,
     // ReLU; the ones that end a block add the residual, into a new map and in place (what the
     // model runs). Medians of 9 alternating rounds (best of 2 passes each).
    auto& disp = c10::Dispatcher::singleton();
    const auto unary = disp.findSchemaOrThrow("mkldnn::_convolution_pointwise", "");
    const auto binary = disp.findSchemaOrThrow("mkldnn::_convolution_pointwise", "binary");
    const auto inplace = disp.findSchemaOrThrow("mkldnn::_convolution_pointwise_", "binary");
    const auto reorder = disp.findSchemaOrThrow("mkldnn::_reorder_convolution_weight", "");
    struct Shape { int64_t hw, cin, cout, count; bool residual; };  // count: how many per forward
    const std::vector<Shape> shapes = {{56, 64, 64, 1, false},    {56, 256, 64, 2, false},  {56, 64, 256, 3, true},
                                       {56, 64, 256, 1, false},   {56, 256, 128, 1, false}, {28, 512, 128, 3, false},
                                       {28, 128, 512, 4, true},   {28, 512, 256, 1, false}, {14, 1024, 256, 5, false},
                                       {14, 256, 1024, 6, true},  {14, 1024, 512, 1, false}, {7, 2048, 512, 2, false},
                                       {7, 512, 2048, 3, true}};
    const std::vector<int64_t> pad{0, 0}, one{1, 1};
    const c10::List<std::optional<at::Scalar>> none;
    auto median = [](std::vector<double> v) {
      std::sort(v.begin(), v.end());
      return v[v.size() / 2];
    };
    std::printf("ResNet-50's 1x1 convolutions, batch 8: ms (GFLOP/s); residual ones: new map | in place\n");
    double total_dnn = 0, total_ours = 0;
    for (const auto& s : shapes) {
      const int64_t B = 8, M = B * s.hw * s.hw;
      const auto cl = at::MemoryFormat::ChannelsLast;
      const auto x = at::randn({B, s.cin, s.hw, s.hw}).contiguous(cl);
      const auto w = (at::randn({s.cout, s.cin, 1, 1}) / std::sqrt(double(s.cin))).contiguous(cl);
      const auto b = at::randn({s.cout}) * 0.1;
      const auto r = at::randn({B, s.cout, s.hw, s.hw}).contiguous(cl);
      torch::jit::Stack st{w, pad, one, one, int64_t(1), x.sizes().vec()};
      reorder.callBoxed(&st);
      const auto wd = st[0].toTensor();
      const auto panels = imgtrain::ops::gemm_pack(w.reshape({s.cout, s.cin}));
      const auto x2 = x.permute({0, 2, 3, 1}).reshape({M, s.cin});  // the NHWC bytes as [M, C]
      const auto r2 = r.permute({0, 2, 3, 1}).reshape({M, s.cout});
      auto rd = r.clone(), ro = r2.clone();  // written in place over and over (timing only)
      at::Tensor yd, yo;
      std::vector<double> dnn, ours, dnn_in, ours_in;
      for (int round = 0; round < 9; ++round) {
        dnn.push_back(best_ms([&] {
          torch::jit::Stack q = s.residual
              ? torch::jit::Stack{x, r, wd, b, pad, one, one, int64_t(1), std::string("add"), c10::IValue(),
                                  c10::IValue(std::string("relu")), none, c10::IValue()}
              : torch::jit::Stack{x, wd, b, pad, one, one, int64_t(1), std::string("relu"), none, std::string()};
          (s.residual ? binary : unary).callBoxed(&q);
          yd = q[0].toTensor();
        }, 2));
        ours.push_back(best_ms([&] {
          yo = imgtrain::ops::gemm_linear(x2, panels, s.cout, b, imgtrain::ops::GemmAct::ReLU, s.residual ? r2 : at::Tensor());
        }, 2));
        if (!s.residual) continue;
        dnn_in.push_back(best_ms([&] {
          torch::jit::Stack q{rd, x, wd, b, pad, one, one, int64_t(1), std::string("add"), c10::IValue(),
                              c10::IValue(std::string("relu")), none, c10::IValue()};
          inplace.callBoxed(&q);
        }, 2));
        ours_in.push_back(best_ms([&] {
          imgtrain::ops::gemm_linear(x2, panels, s.cout, b, imgtrain::ops::GemmAct::ReLU, ro, false, true);
        }, 2));
      }
      const double gf = 2e-6 * double(M) * double(s.cin) * double(s.cout);
      const double diff = (yd - yo.reshape({B, s.hw, s.hw, s.cout}).permute({0, 3, 1, 2})).abs().max().item<double>();
      const double td = median(dnn), to = median(ours);
      std::printf("%2ld x %2ld, %4ld -> %4ld (x%ld): oneDNN %6.2f (%5.1f) ours %6.2f (%5.1f) %.3fx", long(s.hw),
                  long(s.hw), long(s.cin), long(s.cout), long(s.count), td, gf / td, to, gf / to, td / to);
      if (s.residual) {
        const double ti = median(dnn_in), tj = median(ours_in);
        std::printf(" | in place: oneDNN %6.2f (%5.1f) ours %6.2f (%5.1f) %.3fx", ti, gf / ti, tj, gf / tj, ti / tj);
        total_dnn += ti * double(s.count), total_ours += tj * double(s.count);
      } else {
        total_dnn += td * double(s.count), total_ours += to * double(s.count);
      }
      std::printf(" | max diff %.1e\n", diff);
    }
    std::printf("one forward's 1x1 convolutions as the model runs them: oneDNN %.1f ms, ours %.1f ms (%.3fx)\n",
                total_dnn, total_ours, total_dnn / total_ours);
  }
}
