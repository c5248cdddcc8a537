#include "ops/winograd.h"
#include "ops/kernel_util.h"

#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/bmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/record_function.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <limits>

namespace imgtrain::ops {
namespace {

// F(2x2, 3x3) (Lavin and Gray, 2016): Y = A^T [(G g G^T) . (B^T d B)] A with
//   B^T = [1 0 -1 0; 0 1 1 0; 0 -1 1 0; 0 1 0 -1], G = [1 0 0; .5 .5 .5; .5 -.5 .5; 0 0 1],
//   A^T = [1 1 1 0; 0 1 -1 -1].

// 16 floats as one value: GCC's vector extension, one AVX-512 register in the x86-64-v4 clone and
// pairs or quads of narrower ones in the others
typedef float f16v __attribute__((vector_size(64)));
IMGTRAIN_AI f16v load16(const float* p) {
  f16v v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
IMGTRAIN_AI void store16(float* p, f16v v) { std::memcpy(p, &v, sizeof v); }

// V[4i+j][c] = (B^T d B)[i][j] for the 4x4 patch whose 16 pixel rows (C channels each, NHWC) are p;
// T is one float or 16 of them
template <typename T, typename L, typename S>
IMGTRAIN_AI void input_transform_at(const float* const* p, int64_t c, float* v, int64_t xs, L ld, S st) {
  T d[16];
  for (int e = 0; e < 16; ++e) d[e] = ld(p[e] + c);
  // t = B^T d, column by column
  T t[16];
  for (int j = 0; j < 4; ++j) {
    t[j] = d[j] - d[8 + j];
    t[4 + j] = d[4 + j] + d[8 + j];
    t[8 + j] = d[8 + j] - d[4 + j];
    t[12 + j] = d[4 + j] - d[12 + j];
  }
  // V = t B, row by row
  for (int i = 0; i < 4; ++i) {
    const T* r = t + 4 * i;
    st(v + (4 * i + 0) * xs + c, r[0] - r[2]);
    st(v + (4 * i + 1) * xs + c, r[1] + r[2]);
    st(v + (4 * i + 2) * xs + c, r[2] - r[1]);
    st(v + (4 * i + 3) * xs + c, r[1] - r[3]);
  }
}
IMGTRAIN_CLONES void input_transform(const float* const* p, int64_t C, float* v, int64_t xs) {
  int64_t c = 0;
  for (; c + 16 <= C; c += 16) input_transform_at<f16v>(p, c, v, xs, load16, store16);
  for (; c < C; ++c)
    input_transform_at<float>(p, c, v, xs, [](const float* q) { return *q; }, [](float* q, float a) { *q = a; });
}

// The 2x2 outputs y[a][b] = (A^T m A)[a][b] + bias + res[a][b], ReLU'd when relu, from m[4i+j][k]
// (stride xs); res null for no residual
template <typename T, typename L, typename S>
IMGTRAIN_AI void output_transform_at(const float* m, int64_t xs, int64_t k, const float* bias, T lo,
                                     const float* const* res, float* const* y, L ld, S st) {
  T q[16];
  for (int e = 0; e < 16; ++e) q[e] = ld(m + e * xs + k);
  // s = A^T m (2 x 4)
  T s[8];
  for (int j = 0; j < 4; ++j) {
    s[j] = q[j] + q[4 + j] + q[8 + j];
    s[4 + j] = q[4 + j] - q[8 + j] - q[12 + j];
  }
  const T b = ld(bias + k);
  for (int a = 0; a < 2; ++a) {
    const T* r = s + 4 * a;
    T y0 = (r[0] + r[1] + r[2]) + b, y1 = (r[1] - r[2] - r[3]) + b;
    if (res) {
      y0 = y0 + ld(res[2 * a] + k);
      y1 = y1 + ld(res[2 * a + 1] + k);
    }
    y0 = y0 > lo ? y0 : lo;
    y1 = y1 > lo ? y1 : lo;
    st(y[2 * a] + k, y0);
    st(y[2 * a + 1] + k, y1);
  }
}
IMGTRAIN_CLONES void output_transform(const float* m, int64_t xs, int64_t K, const float* bias, bool relu,
                                      const float* const* res, float* const* y) {
  const float lo = relu ? 0.0f : -std::numeric_limits<float>::infinity();
  const f16v lov = f16v{} + lo;
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) output_transform_at<f16v>(m, xs, k, bias, lov, res, y, load16, store16);
  for (; k < K; ++k)
    output_transform_at<float>(m, xs, k, bias, lo, res, y, [](const float* q) { return *q; },
                               [](float* q, float a) { *q = a; });
}

// Tiles a block: about 64 (products of 64 rows keep MKL near its peak; the block's transformed
// inputs, 16 x 64 x C floats, stay in L2 up to C = 512), as many blocks for each thread.
int64_t block_tiles(int64_t tiles) {
  constexpr int64_t target = 64;  // 32 to 128 measured alike (bench/winograd_parts.cpp), 16 and 256 slower
  const int64_t threads = at::get_num_threads();
  int64_t blocks = (tiles + target - 1) / target;
  blocks = (blocks + threads - 1) / threads * threads;
  return (tiles + blocks - 1) / blocks;
}

// U[4i+j][n] = (G g G^T)[i][j] for the 3x3 filters g[a][b] = w[(3a+b) * plane + n] (rotated by 180
// degrees: g[a][b] = w[(3(2-a) + 2-b) * plane + n]), n in [n0, n1); float32 sums of halves.
IMGTRAIN_CLONES void pack_train(const float* w, float* U, int64_t plane, int64_t n0, int64_t n1, bool rotate) {
  for (int64_t n = n0; n < n1; ++n) {
    float g[3][3];
    for (int a = 0; a < 3; ++a)
      for (int b = 0; b < 3; ++b) g[a][b] = w[(rotate ? 3 * (2 - a) + 2 - b : 3 * a + b) * plane + n];
    float t[4][3];  // G g
    for (int b = 0; b < 3; ++b) {
      t[0][b] = g[0][b];
      t[1][b] = 0.5f * (g[0][b] + g[1][b] + g[2][b]);
      t[2][b] = 0.5f * (g[0][b] - g[1][b] + g[2][b]);
      t[3][b] = g[2][b];
    }
    for (int i = 0; i < 4; ++i) {  // (G g) G^T
      U[(4 * i + 0) * plane + n] = t[i][0];
      U[(4 * i + 1) * plane + n] = 0.5f * (t[i][0] + t[i][1] + t[i][2]);
      U[(4 * i + 2) * plane + n] = 0.5f * (t[i][0] - t[i][1] + t[i][2]);
      U[(4 * i + 3) * plane + n] = t[i][2];
    }
  }
}

}  // namespace

at::Tensor winograd_pack_3x3_train(const at::Tensor& weight, bool input_grad) {
  TORCH_CHECK(weight.dim() == 4 && weight.size(2) == 3 && weight.size(3) == 3 && weight.scalar_type() == at::kFloat &&
                  weight.device().is_cpu(),
              "winograd_pack_3x3_train: float32 CPU weight [K, C, 3, 3]");
  const int64_t K = weight.size(0), C = weight.size(1);
  // [3, 3, C, K] (or [3, 3, K, C] for the input gradient's filters): each tap a plane in U's order
  const auto taps = (input_grad ? weight.permute({2, 3, 0, 1}) : weight.permute({2, 3, 1, 0})).contiguous();
  const int64_t plane = C * K;
  auto U = input_grad ? at::empty({16, K, C}, taps.options()) : at::empty({16, C, K}, taps.options());
  const float* w = taps.const_data_ptr<float>();
  float* u = U.mutable_data_ptr<float>();
  at::parallel_for(0, plane, 4096, [&](int64_t n0, int64_t n1) { pack_train(w, u, plane, n0, n1, input_grad); });
  return U;
}

at::Tensor winograd_pack_3x3(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 4 && weight.size(2) == 3 && weight.size(3) == 3, "winograd_pack_3x3: weight [K, C, 3, 3]");
  const int64_t K = weight.size(0), C = weight.size(1);
  const auto g = weight.detach().to(at::kCPU, at::kDouble).contiguous();
  auto U = at::empty({16, C, K}, weight.options().dtype(at::kFloat).device(at::kCPU));
  const double* gp = g.data_ptr<double>();
  float* up = U.data_ptr<float>();
  static constexpr double G[4][3] = {{1, 0, 0}, {0.5, 0.5, 0.5}, {0.5, -0.5, 0.5}, {0, 0, 1}};
  for (int64_t k = 0; k < K; ++k)
    for (int64_t c = 0; c < C; ++c) {
      const double* w = gp + (k * C + c) * 9;
      double t[4][3];  // G g
      for (int i = 0; i < 4; ++i)
        for (int j = 0; j < 3; ++j) t[i][j] = G[i][0] * w[j] + G[i][1] * w[3 + j] + G[i][2] * w[6 + j];
      for (int i = 0; i < 4; ++i)
        for (int j = 0; j < 4; ++j)
          up[((4 * i + j) * C + c) * K + k] = float(t[i][0] * G[j][0] + t[i][1] * G[j][1] + t[i][2] * G[j][2]);
    }
  return U;
}

bool winograd_conv3x3_supported(const at::Tensor& x, const at::Tensor& U, const at::Tensor& residual) {
  const auto cl = at::MemoryFormat::ChannelsLast;
  if (x.dim() != 4 || x.scalar_type() != at::kFloat || !x.device().is_cpu() || !x.is_contiguous(cl) ||
      x.size(2) == 0 || x.size(3) == 0)
    return false;
  if (U.dim() != 3 || U.size(0) != 16 || U.size(1) != x.size(1) || !U.is_contiguous() ||
      U.scalar_type() != at::kFloat || !U.device().is_cpu())
    return false;
  return !residual.defined() ||
         (residual.sizes() == at::IntArrayRef{x.size(0), U.size(2), x.size(2), x.size(3)} &&
          residual.scalar_type() == at::kFloat && residual.device().is_cpu() && residual.is_contiguous(cl));
}

at::Tensor winograd_conv3x3(const at::Tensor& x, const at::Tensor& U, const at::Tensor& bias, bool relu,
                            const at::Tensor& residual, bool into_residual) {
  TORCH_CHECK(winograd_conv3x3_supported(x, U, residual),
              "winograd_conv3x3: x, U and the residual must be float32 on the CPU, x and the residual channels-last, "
              "U [16, C, K], the residual [N, K, H, W]");
  const int64_t N = x.size(0), C = x.size(1), H = x.size(2), W = x.size(3), K = U.size(2);
  TORCH_CHECK(!bias.defined() || (bias.numel() == K && bias.is_contiguous() && bias.scalar_type() == at::kFloat),
              "winograd_conv3x3: bias [K] or undefined");
  TORCH_CHECK(!into_residual || residual.defined(), "winograd_conv3x3: into_residual without a residual");
  // in place: each output element is written after the residual's value at its place is read
  auto y = into_residual ? residual : at::empty({N, K, H, W}, x.options().memory_format(at::MemoryFormat::ChannelsLast));
  if (y.numel() == 0) return y;
  const float* rp = residual.defined() ? residual.data_ptr<float>() : nullptr;
  const int64_t th = (H + 1) / 2, tw = (W + 1) / 2, tiles = N * th * tw;
  const int64_t T = block_tiles(tiles), blocks = (tiles + T - 1) / T;
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float* bias_p = bias.defined() ? bias.data_ptr<float>() : nullptr;
  RECORD_FUNCTION("imgtrain::winograd_conv3x3", std::vector<c10::IValue>());
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    c10::AutoGradMode no_grad(false);
    thread_local AlignedVector<float> scratch;
    const size_t need = size_t(16 * T * (C + K) + std::max(C, K) + K);
    if (scratch.size() < need) scratch.resize(need);
    float* V = scratch.data();
    float* M = V + 16 * T * C;
    float* zeros = M + 16 * T * K;         // zeros: the padding's pixels, the residual past the edge
    float* sink = zeros + std::max(C, K);  // K floats: outputs past the map's edge
    std::fill(zeros, sink, 0.0f);
    const float* bp = bias_p ? bias_p : zeros;  // no bias: K zeros
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t t0 = blk * T, nt = std::min(T, tiles - t0);
      for (int64_t i = 0; i < nt; ++i) {
        const int64_t t = t0 + i, n = t / (th * tw), r = t % (th * tw), ty = r / tw, tx = r % tw;
        const float* p[16];
        for (int a = 0; a < 4; ++a)
          for (int b = 0; b < 4; ++b) {
            const int64_t h = 2 * ty - 1 + a, w = 2 * tx - 1 + b;
            p[4 * a + b] = (h >= 0 && h < H && w >= 0 && w < W) ? xp + ((n * H + h) * W + w) * C : zeros;
          }
        input_transform(p, C, V + i * C, nt * C);
      }
      auto Vt = at::from_blob(V, {16, nt, C}, x.options());
      auto Mt = at::from_blob(M, {16, nt, K}, x.options());
      at::bmm_out(Mt, Vt, U);
      for (int64_t i = 0; i < nt; ++i) {
        const int64_t t = t0 + i, n = t / (th * tw), r = t % (th * tw), ty = r / tw, tx = r % tw;
        float* o[4];
        const float* ro[4];
        for (int a = 0; a < 2; ++a)
          for (int b = 0; b < 2; ++b) {
            const int64_t h = 2 * ty + a, w = 2 * tx + b, off = ((n * H + h) * W + w) * K;
            const bool in = h < H && w < W;
            o[2 * a + b] = in ? yp + off : sink;
            ro[2 * a + b] = in && rp ? rp + off : zeros;
          }
        output_transform(M + i * K, nt * K, K, bp, relu, rp ? ro : nullptr, o);
      }
    }
  });
  return y;
}

}  // namespace imgtrain::ops
