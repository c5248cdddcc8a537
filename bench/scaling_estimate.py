"""Paper estimate of data-parallel scaling efficiency on 8 and 64 GPUs.

Inputs measured by imgtrain (pass them in; the defaults are what `imgtrain benchmark --bench train
--nproc-per-node 2` reported on the CPU machine, see docs/performance.md): gradient bytes per step
and the bucket sizes DDP's reducer uses. Inputs NOT measured here (no GPU on the machine): the
single-GPU step time and the collective bandwidths; the defaults are published figures, named
below, and can be replaced with measured ones (--step-ms, --busbw-intra, --busbw-inter).

Model: ring all-reduce of S bytes on p GPUs takes 2 (p - 1) / p * S / busbw + 2 (p - 1) * latency
(nccl-tests' "bus bandwidth" convention); buckets are launched as backward produces them, backward is
2/3 of the step, and the last bucket (the first layers' gradients, the 1 MiB first bucket) cannot
overlap. Exposed time = max(total comm - backward window, last bucket); efficiency = step / (step +
exposed). Data loading, stragglers and optimizer differences are ignored, so this is an upper
bound to compare with measured anchors (DDP on 8 V100 ~ 93%; NVIDIA ResNet-50 A100 TF32 8x = 96.5%).
"""
import argparse

MiB = 1024 * 1024


def buckets(total_bytes, cap=25 * MiB, first=1 * MiB):
    out, left = [min(first, total_bytes)], total_bytes - min(first, total_bytes)
    while left > 0:
        out.append(min(cap, left))
        left -= out[-1]
    return out


def allreduce_s(size, p, busbw, latency):
    return 2 * (p - 1) / p * size / busbw + 2 * (p - 1) * latency


def efficiency(step_s, grad_bytes, p, busbw, latency):
    bs = buckets(grad_bytes)
    comm = sum(allreduce_s(b, p, busbw, latency) for b in bs)
    last = allreduce_s(bs[0], p, busbw, latency)
    exposed = max(comm - 2 / 3 * step_s, last)
    return step_s / (step_s + exposed), comm, exposed


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--latency-us', type=float, default=10.0, help='per ring step (NVLink/IB, typical)')
    a = ap.parse_args()
    lat = a.latency_us * 1e-6
    # (model, gradient bytes measured from imgtrain's reducer, GPU, single-GPU step ms at the batch,
    #  source of the step time)
    cases = [
        ('resnet50', 25557032 * 4, 'V100 AMP b256', 256 / 1350 * 1e3, 'NVIDIA DLE RN50 v1.5 V100 AMP ~1350 img/s'),
        ('resnet50', 25557032 * 4, 'A100 TF32 b256', 256 / 1016 * 1e3, 'NVIDIA DLE RN50 v1.5 A100 TF32 ~1016 img/s'),
        ('mobilenetv3_large_100', 5483032 * 4, 'V100 AMP b128', 128 / 3000 * 1e3, 'assumed ~3000 img/s (timm-scale)'),
        ('mobilenetv3_large_100', 5483032 * 4, 'A100 AMP b128', 128 / 6000 * 1e3, 'assumed ~6000 img/s (timm-scale)'),
    ]
    # busbw (bytes/s): DGX-1 V100 NVLink ~130 GB/s in 1 node, ~45 GB/s across nodes (4x EDR);
    # DGX A100 NVSwitch ~230 GB/s, ~180 GB/s across nodes (8x HDR) - nccl-tests orders of magnitude.
    bw = {'V100': (130e9, 45e9), 'A100': (230e9, 180e9)}
    print(f"{'model':24s} {'GPU':15s} {'step ms':>8s} {'grad MB':>8s} {'buckets':>7s} "
          f"{'8 GPU comm/exposed ms':>22s} {'eff 8':>6s} {'64 GPU comm/exposed ms':>23s} {'eff 64':>6s}")
    for model, gb, gpu, step_ms, src in cases:
        intra, inter = bw[gpu.split()[0]]
        e8, c8, x8 = efficiency(step_ms / 1e3, gb, 8, intra, lat)
        e64, c64, x64 = efficiency(step_ms / 1e3, gb, 64, inter, lat)
        print(f"{model:24s} {gpu:15s} {step_ms:8.1f} {gb / 1e6:8.1f} {len(buckets(gb)):7d} "
              f"{c8 * 1e3:10.2f} / {x8 * 1e3:8.2f} {100 * e8:5.1f}% {c64 * 1e3:11.2f} / {x64 * 1e3:8.2f} "
              f"{100 * e64:5.1f}%   ({src})")


if __name__ == '__main__':
    main()
