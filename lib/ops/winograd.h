// 3x3 convolutions with stride 1 and padding 1 by Winograd's minimal filtering, for inference on
// the CPU (and in training, F(2x2, 3x3) only: the forward and input gradient of
// ops::dense_conv_train; F(4x4, 3x3)'s forward moved a Mask R-CNN's gradients by up to 15x ATen's
// float32 error where BatchNorm trained on two images amplified it, tests/parity/test_rcnn.cpp). F(2x2, 3x3):
// each 2x2 block of outputs from a 4x4 input patch with 16 multiplications a channel pair where the
// direct convolution needs 36 (2.25x fewer); the transforms are additions and halvings (float
// rounding of the same order as the direct sum's). F(4x4, 3x3): 4x4 outputs from a 6x6 patch with
// 36 multiplications where the direct convolution needs 144 (4x fewer); its transforms' larger
// coefficients give about twice oneDNN's rounding error (bench/winograd_parts.cpp).
#pragma once
#include <ATen/core/Tensor.h>

namespace imgtrain::ops {

// The transformed filters of a weight [K, C, 3, 3] for output tiles of tile x tile: 2, F(2x2, 3x3),
// U [16, C, K], U[4i + j] = (G g G^T)[i][j]; 4, F(4x4, 3x3) over the part of a map that 4x4 tiles
// divide and F(2x2, 3x3) over the rest (the last rows and columns), U [52, C, K]: F(4x4)'s 36
// planes, then F(2x2)'s 16. Computed in float64, rounded once.
at::Tensor winograd_pack_3x3(const at::Tensor& weight, int tile = 2);

// The output tile (2 or 4) for a convolution of N maps H x W from C to K channels on the CPU: 4 where
// it needs at most 3/4 of 2x2 tiles' multiplications (so not at 7x7; at 14x14 0.68), each thread
// gets at least 16 4x4 tiles and the filters (52 C K floats) stay within 13.6 MB of cache
// (bench/winograd_parts.cpp); 2 elsewhere.
int winograd_tile(int64_t N, int64_t H, int64_t W, int64_t C, int64_t K);

// The same in float32 sums (halves: rounding of the same order), for training, which packs every
// step: U [16, C, K] of a float32 CPU weight [K, C, 3, 3]; with input_grad, the filters of the
// input gradient of conv2d(x, weight, stride 1, padding 1), weight transposed to [C, K] and each
// 3x3 rotated by 180 degrees: U [16, K, C], so that winograd_conv3x3(gy, U, zeros) is that gradient.
// tile 4 (the forward's filters only): U [52, C, K] as winograd_pack_3x3's, for inference's convolutions
// that pack on every call (model_zoo's dense_infer: weights that may change between calls).
at::Tensor winograd_pack_3x3_train(const at::Tensor& weight, bool input_grad, int tile = 2);

// Whether winograd_conv3x3 takes x with the filters U and the residual (undefined for none): x a
// float32 CPU [N, C, H, W] in channels-last memory, U [16 or 52, C, K] float32 contiguous, the residual
// [N, K, H, W] float32 channels-last.
bool winograd_conv3x3_supported(const at::Tensor& x, const at::Tensor& U, const at::Tensor& residual = {});

// y = conv2d(x, weight, bias, stride 1, padding 1) + residual, with ReLU after it when `relu`, from
// the packed filters U = winograd_pack_3x3(weight) and bias [K] (float32; undefined for none);
// residual undefined for none. x, residual and y channels-last [N, C|K|K, H, W]. into_residual: y is the residual, overwritten.
// The tiles of outputs are shared among at::parallel_for's threads in blocks whose transformed
// inputs and products stay in cache; each block's 16 products run as one batched GEMM.
at::Tensor winograd_conv3x3(const at::Tensor& x, const at::Tensor& U, const at::Tensor& bias, bool relu,
                            const at::Tensor& residual = {}, bool into_residual = false);

}  // namespace imgtrain::ops
