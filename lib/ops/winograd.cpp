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

// F(4x4, 3x3): 6x6 input patches, 4x4 outputs, 36 multiplications a channel pair where the direct
// convolution needs 144 (4x fewer). Toom-Cook at the points 0, 1, -1, 1/2, -2 and infinity, which
// Barabasz et al. (2020) found more accurate than Lavin and Gray's 0, +-1, +-2: in a float32
// simulation of one 128-channel tile, 2.4e-6 of the output's largest magnitude against 5.9e-6
// (oneDNN's direct convolution: 1-2e-6, bench/winograd_parts.cpp):
//   B^T = [1 -3/2 -2 3/2 1 0; 0 -1 1/2 5/2 1 0; 0 1 -5/2 1/2 1 0; 0 -2 -1 2 1 0; 0 1/2 -1 -1/2 1 0;
//          0 1 -3/2 -2 3/2 1],
//   G = [1 0 0; 1/3 1/3 1/3; -1/3 1/3 -1/3; -16/15 -8/15 -4/15; 1/15 -2/15 4/15; 0 0 1],
//   A^T = [1 1 1 1 1 0; 0 1 -1 1/2 -2 0; 0 1 1 1/4 4 0; 0 1 -1 1/8 -8 1].
constexpr double kG4[6][3] = {{1, 0, 0},          {1.0 / 3, 1.0 / 3, 1.0 / 3},   {-1.0 / 3, 1.0 / 3, -1.0 / 3},
                              {-16.0 / 15, -8.0 / 15, -4.0 / 15}, {1.0 / 15, -2.0 / 15, 4.0 / 15}, {0, 0, 1}};
// r = B^T d for six values d (stride ds in, rs out)
template <typename T>
IMGTRAIN_AI void bt6(const T* d, int ds, T* r, int rs) {
  const T d0 = d[0], d1 = d[ds], d2 = d[2 * ds], d3 = d[3 * ds], d4 = d[4 * ds], d5 = d[5 * ds];
  const T e42 = d4 - d2, e31 = d3 - d1;
  r[0] = (d0 + 1.5f * e31) + (d4 - 2.0f * d2);
  r[rs] = ((d4 - d1) + 0.5f * d2) + 2.5f * d3;
  r[2 * rs] = ((d4 + d1) - 2.5f * d2) + 0.5f * d3;
  r[3 * rs] = e42 + 2.0f * e31;
  r[4 * rs] = e42 - 0.5f * e31;
  r[5 * rs] = ((d5 + d1) + 1.5f * e42) - 2.0f * d3;
}
template <typename T, typename L, typename S>
IMGTRAIN_AI void input_transform6_at(const float* const* p, int64_t c, float* v, int64_t xs, L ld, S st) {
  T d[36], t[36], r[6];
  for (int e = 0; e < 36; ++e) d[e] = ld(p[e] + c);
  for (int j = 0; j < 6; ++j) bt6(d + j, 6, t + j, 6);  // t = B^T d, column by column
  for (int i = 0; i < 6; ++i) {                          // V = t B, row by row
    bt6(t + 6 * i, 1, r, 1);
    for (int j = 0; j < 6; ++j) st(v + (6 * i + j) * xs + c, r[j]);
  }
}
// s = A^T m for six values m (stride ms in, ss out)
template <typename T>
IMGTRAIN_AI void at6(const T* m, int ms, T* s, int ss) {
  const T m3 = m[3 * ms], m4 = m[4 * ms], p12 = m[ms] + m[2 * ms], n12 = m[ms] - m[2 * ms];
  s[0] = (m[0] + p12) + (m3 + m4);
  s[ss] = (n12 + 0.5f * m3) - 2.0f * m4;
  s[2 * ss] = (p12 + 0.25f * m3) + 4.0f * m4;
  s[3 * ss] = ((n12 + 0.125f * m3) - 8.0f * m4) + m[5 * ms];
}
// The 4x4 outputs y[4a+b] = (A^T m A)[a][b] + bias + res[4a+b], ReLU'd when relu
template <typename T, typename L, typename S>
IMGTRAIN_AI void output_transform4_at(const float* m, int64_t xs, int64_t k, const float* bias, T lo,
                                      const float* const* res, float* const* y, L ld, S st) {
  T q[36], s[24], r[4];
  for (int e = 0; e < 36; ++e) q[e] = ld(m + e * xs + k);
  for (int j = 0; j < 6; ++j) at6(q + j, 6, s + j, 6);  // s = A^T m (4 x 6)
  const T b = ld(bias + k);
  for (int a = 0; a < 4; ++a) {
    at6(s + 6 * a, 1, r, 1);
    for (int c = 0; c < 4; ++c) {
      T o = r[c] + b;
      if (res) o = o + ld(res[4 * a + c] + k);
      o = o > lo ? o : lo;
      st(y[4 * a + c] + k, o);
    }
  }
}

// One tile's transforms over all its channels, 16 at a time, then one by one: R = 2 for F(2x2, 3x3)'s,
// 4 for F(4x4, 3x3)'s
template <int R>
IMGTRAIN_AI void input_tile(const float* const* p, int64_t C, float* v, int64_t xs) {
  auto at = [&](int64_t c, auto one, auto ld, auto st) {
    using T = decltype(one);
    if constexpr (R == 2)
      input_transform_at<T>(p, c, v, xs, ld, st);
    else
      input_transform6_at<T>(p, c, v, xs, ld, st);
  };
  int64_t c = 0;
  for (; c + 16 <= C; c += 16) at(c, f16v{}, load16, store16);
  for (; c < C; ++c) at(c, 0.0f, [](const float* q) { return *q; }, [](float* q, float a) { *q = a; });
}
template <int R>
IMGTRAIN_AI void output_tile(const float* m, int64_t xs, int64_t K, const float* bias, bool relu,
                             const float* const* res, float* const* y) {
  const float lo = relu ? 0.0f : -std::numeric_limits<float>::infinity();
  auto at = [&](int64_t k, auto lo_t, auto ld, auto st) {
    using T = decltype(lo_t);
    if constexpr (R == 2)
      output_transform_at<T>(m, xs, k, bias, lo_t, res, y, ld, st);
    else
      output_transform4_at<T>(m, xs, k, bias, lo_t, res, y, ld, st);
  };
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) at(k, f16v{} + lo, load16, store16);
  for (; k < K; ++k) at(k, lo, [](const float* q) { return *q; }, [](float* q, float a) { *q = a; });
}
IMGTRAIN_CLONES void input_transform(const float* const* p, int64_t C, float* v, int64_t xs) { input_tile<2>(p, C, v, xs); }
IMGTRAIN_CLONES void input_transform6(const float* const* p, int64_t C, float* v, int64_t xs) {
  input_tile<4>(p, C, v, xs);
}
IMGTRAIN_CLONES void output_transform(const float* m, int64_t xs, int64_t K, const float* bias, bool relu,
                                      const float* const* res, float* const* y) {
  output_tile<2>(m, xs, K, bias, relu, res, y);
}
IMGTRAIN_CLONES void output_transform4(const float* m, int64_t xs, int64_t K, const float* bias, bool relu,
                                       const float* const* res, float* const* y) {
  output_tile<4>(m, xs, K, bias, relu, res, y);
}

// Tiles a block: about target (products of that many rows keep MKL near its peak; the block's
// transformed inputs stay in cache), as many blocks for each thread.
int64_t block_tiles(int64_t tiles, int64_t target) {
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

// The same for F(4x4, 3x3)'s G (U[6i+j][n]): float32 products and sums (rounded at every step, where
// winograd_pack_3x3 rounds once)
IMGTRAIN_CLONES void pack_train4(const float* w, float* U, int64_t plane, int64_t n0, int64_t n1) {
  float G[6][3];  // kG4 rounded to float
  for (int i = 0; i < 6; ++i)
    for (int j = 0; j < 3; ++j) G[i][j] = float(kG4[i][j]);
  for (int64_t n = n0; n < n1; ++n) {
    float g[3][3];
    for (int a = 0; a < 3; ++a)
      for (int b = 0; b < 3; ++b) g[a][b] = w[(3 * a + b) * plane + n];
    float t[6][3];  // G g
    for (int i = 0; i < 6; ++i)
      for (int b = 0; b < 3; ++b) t[i][b] = G[i][0] * g[0][b] + G[i][1] * g[1][b] + G[i][2] * g[2][b];
    for (int i = 0; i < 6; ++i)  // (G g) G^T
      for (int j = 0; j < 6; ++j) U[(6 * i + j) * plane + n] = t[i][0] * G[j][0] + t[i][1] * G[j][1] + t[i][2] * G[j][2];
  }
}

}  // namespace

at::Tensor winograd_pack_3x3_train(const at::Tensor& weight, bool input_grad, int tile) {
  TORCH_CHECK(weight.dim() == 4 && weight.size(2) == 3 && weight.size(3) == 3 && weight.scalar_type() == at::kFloat &&
                  weight.device().is_cpu(),
              "winograd_pack_3x3_train: float32 CPU weight [K, C, 3, 3]");
  TORCH_CHECK(tile == 2 || (tile == 4 && !input_grad),
              "winograd_pack_3x3_train: output tiles of 2x2, or 4x4 for the forward's filters");
  const int64_t K = weight.size(0), C = weight.size(1);
  // [3, 3, C, K] (or [3, 3, K, C] for the input gradient's filters): each tap a plane in U's order
  const auto taps = (input_grad ? weight.permute({2, 3, 0, 1}) : weight.permute({2, 3, 1, 0})).contiguous();
  const int64_t plane = C * K;
  auto U = input_grad ? at::empty({16, K, C}, taps.options()) : at::empty({tile == 2 ? 16 : 52, C, K}, taps.options());
  const float* w = taps.const_data_ptr<float>();
  float* u = U.mutable_data_ptr<float>();
  at::parallel_for(0, plane, 4096, [&](int64_t n0, int64_t n1) {
    if (tile == 4) {  // F(4x4)'s 36 planes, then F(2x2)'s 16 for the map's edges
      pack_train4(w, u, plane, n0, n1);
      pack_train(w, u + 36 * plane, plane, n0, n1, false);
    } else {
      pack_train(w, u, plane, n0, n1, input_grad);
    }
  });
  return U;
}

at::Tensor winograd_pack_3x3(const at::Tensor& weight, int tile) {
  TORCH_CHECK(weight.dim() == 4 && weight.size(2) == 3 && weight.size(3) == 3, "winograd_pack_3x3: weight [K, C, 3, 3]");
  TORCH_CHECK(tile == 2 || tile == 4, "winograd_pack_3x3: output tiles of 2x2 or 4x4");
  const int64_t K = weight.size(0), C = weight.size(1);
  const auto g = weight.detach().to(at::kCPU, at::kDouble).contiguous();
  auto U = at::empty({tile == 2 ? 16 : 52, C, K}, weight.options().dtype(at::kFloat).device(at::kCPU));
  const double* gp = g.data_ptr<double>();
  static constexpr double G2[4][3] = {{1, 0, 0}, {0.5, 0.5, 0.5}, {0.5, -0.5, 0.5}, {0, 0, 1}};
  // U[A i + j] from the first plane of up: (G g G^T)[i][j] for the A x 3 matrix G
  auto pack = [&](const double(*G)[3], int A, float* up) {
    for (int64_t k = 0; k < K; ++k)
      for (int64_t c = 0; c < C; ++c) {
        const double* w = gp + (k * C + c) * 9;
        double t[6][3];  // G g
        for (int i = 0; i < A; ++i)
          for (int j = 0; j < 3; ++j) t[i][j] = G[i][0] * w[j] + G[i][1] * w[3 + j] + G[i][2] * w[6 + j];
        for (int i = 0; i < A; ++i)
          for (int j = 0; j < A; ++j)
            up[((A * i + j) * C + c) * K + k] = float(t[i][0] * G[j][0] + t[i][1] * G[j][1] + t[i][2] * G[j][2]);
      }
  };
  float* up = U.data_ptr<float>();
  if (tile == 4) {  // F(4x4)'s 36 planes, then F(2x2)'s 16 for the map's edges
    pack(kG4, 6, up);
    up += 36 * C * K;
  }
  pack(G2, 4, up);
  return U;
}

int winograd_tile(int64_t N, int64_t H, int64_t W, int64_t C, int64_t K) {
  // multiplications a channel pair: 2x2 tiles over the map, or 4x4 tiles over the part of it they
  // divide and 2x2 tiles over the rest
  auto tiles2 = [](int64_t h, int64_t w) { return ((h + 1) / 2) * ((w + 1) / 2); };
  const int64_t h4 = H / 4 * 4, w4 = W / 4 * 4, tiles4 = N * (h4 / 4) * (w4 / 4);
  const int64_t cost2 = 16 * tiles2(H, W), cost4 = 36 * (h4 / 4) * (w4 / 4) + 16 * (tiles2(H - h4, W) + tiles2(h4, W - w4));
  // at most 3/4: 14x14 maps as 3x3 4x4 tiles and 13 2x2 ones, 0.68 of 49 2x2 tiles
  return 4 * cost4 <= 3 * cost2 && tiles4 >= 16 * at::get_num_threads() && C * K <= 256 * 256 ? 4 : 2;
}

bool winograd_conv3x3_supported(const at::Tensor& x, const at::Tensor& U, const at::Tensor& residual) {
  const auto cl = at::MemoryFormat::ChannelsLast;
  if (x.dim() != 4 || x.scalar_type() != at::kFloat || !x.device().is_cpu() || !x.is_contiguous(cl) ||
      x.size(2) == 0 || x.size(3) == 0)
    return false;
  if (U.dim() != 3 || (U.size(0) != 16 && U.size(0) != 52) || U.size(1) != x.size(1) || !U.is_contiguous() ||
      U.scalar_type() != at::kFloat || !U.device().is_cpu())
    return false;
  return !residual.defined() ||
         (residual.sizes() == at::IntArrayRef{x.size(0), U.size(2), x.size(2), x.size(3)} &&
          residual.scalar_type() == at::kFloat && residual.device().is_cpu() && residual.is_contiguous(cl));
}

namespace {
// y = the convolution of x by the packed filters U (R x R output tiles: F(R x R, 3x3), A = R + 2) +
// bias + residual (rp null for none), ReLU'd when relu, over the outputs [y0, y1) x [x0, x1) of
// every map, in tiles from (y0, x0); the tiles' outputs past y1 or x1 are not written
template <int R>
void winograd_run(const at::Tensor& x, const at::Tensor& U, const float* bias_p, bool relu, const float* rp,
                  at::Tensor& y, int64_t y0, int64_t y1, int64_t x0, int64_t x1) {
  constexpr int A = R + 2, AA = A * A;
  // tiles a block: 32 of 4x4 (48 and 64 measured alike), 64 of 2x2 (32 to 128 alike, 16 and 256 slower)
  constexpr int64_t target = R == 2 ? 64 : 32;
  const int64_t N = x.size(0), C = x.size(1), H = x.size(2), W = x.size(3), K = U.size(2);
  const int64_t th = (y1 - y0 + R - 1) / R, tw = (x1 - x0 + R - 1) / R, tiles = N * th * tw;
  if (tiles == 0) return;
  const int64_t T = block_tiles(tiles, target), blocks = (tiles + T - 1) / T;
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    c10::AutoGradMode no_grad(false);
    thread_local AlignedVector<float> scratch;
    const size_t need = size_t(AA * T * (C + K) + std::max(C, K) + K);
    if (scratch.size() < need) scratch.resize(need);
    float* V = scratch.data();
    float* M = V + AA * T * C;
    float* zeros = M + AA * T * K;         // zeros: the padding's pixels, the residual past the edge
    float* sink = zeros + std::max(C, K);  // K floats: outputs past the region's edge
    std::fill(zeros, sink, 0.0f);
    const float* bp = bias_p ? bias_p : zeros;  // no bias: K zeros
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t t0 = blk * T, nt = std::min(T, tiles - t0);
      for (int64_t i = 0; i < nt; ++i) {
        const int64_t t = t0 + i, n = t / (th * tw), r = t % (th * tw), ty = r / tw, tx = r % tw;
        const float* p[AA];
        for (int a = 0; a < A; ++a)
          for (int b = 0; b < A; ++b) {
            const int64_t h = y0 + R * ty - 1 + a, w = x0 + R * tx - 1 + b;
            p[A * a + b] = (h >= 0 && h < H && w >= 0 && w < W) ? xp + ((n * H + h) * W + w) * C : zeros;
          }
        if constexpr (R == 2)
          input_transform(p, C, V + i * C, nt * C);
        else
          input_transform6(p, C, V + i * C, nt * C);
      }
      auto Vt = at::from_blob(V, {AA, nt, C}, x.options());
      auto Mt = at::from_blob(M, {AA, nt, K}, x.options());
      at::bmm_out(Mt, Vt, U);
      for (int64_t i = 0; i < nt; ++i) {
        const int64_t t = t0 + i, n = t / (th * tw), r = t % (th * tw), ty = r / tw, tx = r % tw;
        float* o[R * R];
        const float* ro[R * R];
        for (int a = 0; a < R; ++a)
          for (int b = 0; b < R; ++b) {
            const int64_t h = y0 + R * ty + a, w = x0 + R * tx + b, off = ((n * H + h) * W + w) * K;
            const bool in = h < y1 && w < x1;
            o[R * a + b] = in ? yp + off : sink;
            ro[R * a + b] = in && rp ? rp + off : zeros;
          }
        if constexpr (R == 2)
          output_transform(M + i * K, nt * K, K, bp, relu, rp ? ro : nullptr, o);
        else
          output_transform4(M + i * K, nt * K, K, bp, relu, rp ? ro : nullptr, o);
      }
    }
  });
}
}  // namespace

at::Tensor winograd_conv3x3(const at::Tensor& x, const at::Tensor& U, const at::Tensor& bias, bool relu,
                            const at::Tensor& residual, bool into_residual) {
  TORCH_CHECK(winograd_conv3x3_supported(x, U, residual),
              "winograd_conv3x3: x, U and the residual must be float32 on the CPU, x and the residual channels-last, "
              "U [16 or 52, C, K], the residual [N, K, H, W]");
  const int64_t N = x.size(0), H = x.size(2), W = x.size(3), K = U.size(2);
  TORCH_CHECK(!bias.defined() || (bias.numel() == K && bias.is_contiguous() && bias.scalar_type() == at::kFloat),
              "winograd_conv3x3: bias [K] or undefined");
  TORCH_CHECK(!into_residual || residual.defined(), "winograd_conv3x3: into_residual without a residual");
  // in place: each output element is written after the residual's value at its place is read
  auto y = into_residual ? residual : at::empty({N, K, H, W}, x.options().memory_format(at::MemoryFormat::ChannelsLast));
  if (y.numel() == 0) return y;
  const float* rp = residual.defined() ? residual.data_ptr<float>() : nullptr;
  const float* bias_p = bias.defined() ? bias.data_ptr<float>() : nullptr;
  RECORD_FUNCTION("imgtrain::winograd_conv3x3", std::vector<c10::IValue>());
  if (U.size(0) == 16) {
    winograd_run<2>(x, U, bias_p, relu, rp, y, 0, H, 0, W);
  } else {  // 4x4 tiles over the largest part of the map they divide, 2x2 tiles over the rest
    const int64_t h4 = H / 4 * 4, w4 = W / 4 * 4;
    const auto U4 = U.narrow(0, 0, 36), U2 = U.narrow(0, 36, 16);
    winograd_run<4>(x, U4, bias_p, relu, rp, y, 0, h4, 0, w4);
    winograd_run<2>(x, U2, bias_p, relu, rp, y, h4, H, 0, W);   // the rows below
    winograd_run<2>(x, U2, bias_p, relu, rp, y, 0, h4, w4, W);  // the columns to the right
  }
  return y;
}

}  // namespace imgtrain::ops
