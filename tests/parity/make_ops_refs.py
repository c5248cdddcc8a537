"""References for the detection ops (test_ops.cpp): torchvision.ops on random inputs.

Writes <out>/ops.safetensors: box_iou, nms and batched_nms (both of torchvision's paths: the
coordinate trick up to 4,000 box values and the per-class loop above) with ties in score,
degenerate and out-of-image boxes, and roi_align forward and input gradient for aligned
True/False, sampling ratios 0/1/2, several scales, RoIs outside the map and degenerate RoIs, in
float32 and float64.
"""
import os, sys

import torch
import torchvision
from safetensors.torch import save_file
from torchvision.ops import batched_nms, box_iou, nms, roi_align

out = sys.argv[1]
os.makedirs(out, exist_ok=True)
g = torch.Generator().manual_seed(5)
t = {}


def boxes(n, size=100.0, dtype=torch.float32):
    xy = torch.rand(n, 2, generator=g, dtype=torch.float64) * size
    wh = torch.rand(n, 2, generator=g, dtype=torch.float64) * size * 0.4
    b = torch.cat([xy, xy + wh], 1)
    b[: n // 10, 2:] = b[: n // 10, :2]  # degenerate: zero size
    b[n // 10: n // 5] -= size * 0.3     # partly outside
    return b.round(decimals=1).to(dtype)


for i, (n, dtype) in enumerate([(0, torch.float32), (1, torch.float32), (50, torch.float32), (300, torch.float32),
                                (300, torch.float64), (1500, torch.float32)]):
    b = boxes(n, dtype=dtype)
    s = (torch.rand(n, generator=g) * 10).floor().to(dtype) / 10  # many ties
    c = torch.randint(0, 5, (n,), generator=g)
    t[f"nms{i}_boxes"], t[f"nms{i}_scores"], t[f"nms{i}_idxs"] = b, s, c
    for thr in (0.3, 0.5, 0.7):
        t[f"nms{i}_keep_{int(thr * 10)}"] = nms(b, s, thr)
        t[f"nms{i}_bkeep_{int(thr * 10)}"] = batched_nms(b, s, c, thr)
# box_iou: degenerate, outside and identical boxes (the first 5 of b in a)
a, b = boxes(40), boxes(11)
b[:5] = a[:5]
t["iou_a"], t["iou_b"], t["iou_ab"] = a, b, box_iou(a, b)

cases = []
for dtype in (torch.float32, torch.float64):
    for aligned in (False, True):
        for sampling in (0, 1, 2):
            for scale, (ph, pw) in ((1.0, (7, 7)), (0.25, (14, 14)), (0.125, (3, 5))):
                cases.append((dtype, aligned, sampling, scale, ph, pw))
for i, (dtype, aligned, sampling, scale, ph, pw) in enumerate(cases):
    x = torch.randn(2, 3, 13, 17, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    k = 9
    r = boxes(k, size=17.0 / scale, dtype=torch.float64)
    r[0] = torch.tensor([-30, -30, -10, -10])            # entirely outside
    r[1] = torch.tensor([2.0, 3.0, 2.0, 3.0])             # a point
    r[2] = torch.tensor([1.0, 1.0, 200.0 / scale, 2.0])   # past the right edge
    rois = torch.cat([torch.randint(0, 2, (k, 1), generator=g).double(), r], 1).to(dtype)
    y = roi_align(x, rois, (ph, pw), spatial_scale=scale, sampling_ratio=sampling, aligned=aligned)
    gy = torch.randn(y.shape, generator=g, dtype=torch.float64).to(dtype)
    (gx,) = torch.autograd.grad(y, x, gy)
    p = f"ra{i}_"
    t[p + "x"], t[p + "rois"], t[p + "y"], t[p + "gy"], t[p + "gx"] = x.detach(), rois, y.detach(), gy, gx
    t[p + "args"] = torch.tensor([scale, ph, pw, sampling, float(aligned)], dtype=torch.float64)
save_file({k: v.contiguous() for k, v in t.items()}, os.path.join(out, "ops.safetensors"),
          metadata={"torchvision": torchvision.__version__})
print(f"wrote {len(t)} tensors")
