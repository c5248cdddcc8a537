// Depthwise convolution for training on the CPU (groups = channels, one k x k filter per channel).
// The forward is ATen's own convolution (the same values as torch's Conv2d); the input gradient is
// ATen's too, at stride 1 as the forward convolution of the output gradient with the flipped filter
// (half the time of ATen's backward on this CPU); the weight and bias gradients are imgtrain's: on this CPU ATen's (oneDNN's) depthwise
// weight gradient took 10-20x its forward (ConvNeXt's 7x7: 385 ms a step against 17 ms forward at
// batch 8, 224 px, 2 threads, NCHW; 197 ms channels-last). Here the sums run along the channels,
// which channels-last memory holds side by side, so each vector lane is one channel and every
// channel is summed in the same order (positions in order, a float sum per tap per output row
// added into a double): the same bits for any thread count and vector width.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <utility>

namespace imgtrain::ops {

// Whether depthwise_conv_train takes this convolution: x 4-D float32 or float64 on the CPU, w
// [C, 1, k, k] of x's dtype with k 3, 5 or 7, groups = C, square stride 1 or 2, square padding
// below k, dilation 1.
bool depthwise_conv_supported(const at::Tensor& x, const at::Tensor& w, int64_t stride, int64_t padding,
                              int64_t dilation, int64_t groups);

// conv2d(x, w, bias, stride, padding, groups = C) with the backward above; bias may be undefined.
at::Tensor depthwise_conv_train(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, int64_t stride,
                                int64_t padding);

// The weight gradient [C, 1, k, k] and the bias gradient [C] (the sum of gy over N, H, W) of that
// convolution for input x and output gradient gy (any layout).
std::pair<at::Tensor, at::Tensor> depthwise_conv_weight_grad(const at::Tensor& x, const at::Tensor& gy, int64_t k,
                                                             int64_t stride, int64_t padding);

// Dense (ungrouped) convolutions in training on the CPU: the weight gradient is imgtrain's, as k*k
// GEMMs over the input's phases laid out so that each tap is a fixed row offset (depthwise.cpp); on
// ResNet-50's 3x3 shapes oneDNN's weight gradient ran at 54-126 GFLOP/s on a Zen 3 CPU, the GEMMs
// at 115-150 (docs/performance.md). The forward and the input gradient are Winograd's F(2x2, 3x3)
// (ops/winograd.h, the filters packed each call) at stride 1 with at most
// kDenseWinogradMaxChannels channels in and out (at 512 the packing cost what the kernel saved),
// else oneDNN's (ATen's convolution). Rounding differs from oneDNN's (other sums).
constexpr int64_t kDenseWgradMinChannels = 64;
constexpr int64_t kDenseWinogradMaxChannels = 256;
// Whether dense_conv_train takes it: x float32 channels-last on the CPU, w [Co, Ci, 3, 3] float32,
// stride 1 or 2, padding 1, dilation 1, one group, Ci and Co at least kDenseWgradMinChannels, and
// the path on (set_dense_conv_enabled: on by default; the tests turn it off to compare a model's
// step with ATen's convolutions in the same memory format).
void set_dense_conv_enabled(bool on);
bool dense_conv_supported(const at::Tensor& x, const at::Tensor& w, int64_t stride, int64_t padding,
                          int64_t dilation, int64_t groups);
// conv2d(x, w, bias, stride, padding) with the weight gradient above; bias may be undefined.
at::Tensor dense_conv_train(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, int64_t stride,
                            int64_t padding);
// The weight gradient (channels-last [Co, Ci, k, k]) of conv2d(x, w, stride, padding) for the
// output gradient gy, any k, stride and padding (the tests check it against ATen's).
at::Tensor dense_conv_weight_grad(const at::Tensor& x, const at::Tensor& gy, int64_t k, int64_t stride,
                                  int64_t padding);

}  // namespace imgtrain::ops
