"""A dense convolution's weight gradient: oneDNN's (torch's convolution_backward) against the GEMMs
imgtrain runs instead (ops::dense_conv_train, lib/ops/depthwise.cpp): one [Co, P] x [P, Ci] product per
tap over the output gradient and the input laid out on a padded grid, so that each tap is a row offset.
Here the GEMMs run on ready grids (torch.mm, MKL, the same call imgtrain makes); imgtrain's grid
copies come on top (~1 ms a layer at 56 px). ResNet-50's 3x3 shapes at batch 8, channels-last,
best of REPEAT, milliseconds and GFLOP/s.

    OMP_NUM_THREADS=2 .venv/bin/python bench/conv_weight_grad.py [BATCH] [REPEAT]
"""
import sys
import time

import torch


def best_ms(f, repeat):
    f()
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    repeat = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    cl = torch.channels_last
    # (channels, input size, stride, how many in ResNet-50)
    shapes = [(64, 56, 1, 3), (128, 56, 2, 1), (128, 28, 1, 3), (256, 28, 2, 1), (256, 14, 1, 5),
              (512, 14, 2, 1), (512, 7, 1, 2)]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, batch {n}")
    print("| channels, map, stride (count) | oneDNN weight gradient ms (GFLOP/s) | 9 GEMMs ms (GFLOP/s) | ratio |")
    print("|---|---|---|---|")
    tot = [0.0, 0.0]
    for c, h, s, count in shapes:
        x = torch.randn(n, c, h, h).contiguous(memory_format=cl)
        w = torch.randn(c, c, 3, 3).contiguous(memory_format=cl)
        gy = torch.randn_like(torch.nn.functional.conv2d(x, w, None, s, 1)).contiguous(memory_format=cl)
        ho = gy.shape[2]
        ref = best_ms(lambda: torch.ops.aten.convolution_backward(
            gy, x, w, None, [s, s], [1, 1], [1, 1], False, [0, 0], 1, [False, True, False]), repeat)
        wg = ho + 1  # the grid imgtrain lays out: one shared zero column and row
        p = n * wg * wg
        a = torch.randn(p, c)
        b = torch.randn(p + 3 * wg, c)
        at = a.t()

        def gemms():
            for ky in range(3):
                for kx in range(3):
                    off = (ky if s == 1 else (ky + 1) // 2) * wg + (kx if s == 1 else (kx + 1) // 2)
                    torch.mm(at, b[off:off + p])

        ours = best_ms(gemms, repeat)
        gf = 2 * n * c * c * 9 * ho * ho / 1e9
        tot[0] += ref * count
        tot[1] += ours * count
        print(f"| {c}, {h}, {s} ({count}) | {ref:.1f} ({gf / ref * 1e3:.0f}) | {ours:.1f} ({gf / ours * 1e3:.0f}) |"
              f" {ref / ours:.2f} |")
    print(f"| all 16 | {tot[0]:.0f} | {tot[1]:.0f} | {tot[0] / tot[1]:.2f} |")


if __name__ == "__main__":
    main()
