"""References for the detection resize and batching (test_detection_transform.cpp): torchvision's
GeneralizedRCNNTransform on pairs of images with boxes and masks.

Writes <out>/detection_transform.safetensors. Per case i and image j: the uint8 CHW input, the
normalised image (the transform's own normalize), boxes and dense masks; the transform's batched
tensor, image sizes, and the resized boxes and masks. The model transform runs in eval mode so the
min size is min_size[-1] (training draws it; imgtrain's loader draws per sample instead).
"""
import os, sys

import torch
from safetensors.torch import save_file
from torchvision.models.detection.transform import GeneralizedRCNNTransform

out = sys.argv[1]
os.makedirs(out, exist_ok=True)
g = torch.Generator().manual_seed(11)
mean, std = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
# (h, w) pairs and (min_size, max_size): the max-size limit, odd sizes, upscaling, a 1-pixel side
cases = [([(37, 53), (60, 41)], (200, 333)), ([(480, 640), (427, 640)], (160, 200)),
         ([(50, 33), (33, 50)], (64, 100)), ([(427, 640), (100, 90)], (96, 96)),
         ([(1, 7), (9, 3)], (80, 133))]
t = {}
for i, (sizes, (mn, mx)) in enumerate(cases):
    tr = GeneralizedRCNNTransform(mn, mx, mean, std).eval()
    images, targets = [], []
    for j, (h, w) in enumerate(sizes):
        u8 = torch.randint(0, 256, (3, h, w), generator=g, dtype=torch.uint8)
        n = 3
        xy = torch.rand(n, 2, generator=g) * torch.tensor([w, h])
        wh = torch.rand(n, 2, generator=g) * torch.tensor([w, h]) * 0.5 + 0.1
        boxes = torch.cat([xy, xy + wh], 1).float()
        masks = (torch.rand(n, h, w, generator=g) > 0.6).to(torch.uint8)
        t[f"c{i}_in{j}"] = u8
        t[f"c{i}_boxes{j}"] = boxes
        t[f"c{i}_masks{j}"] = masks
        x = u8.float() / 255
        t[f"c{i}_norm{j}"] = tr.normalize(x)
        images.append(x)
        targets.append({"boxes": boxes.clone(), "masks": masks.clone(), "labels": torch.ones(n, dtype=torch.int64)})
    il, out_t = tr(images, targets)
    t[f"c{i}_minmax"] = torch.tensor([mn, mx])
    t[f"c{i}_batch"] = il.tensors
    t[f"c{i}_sizes"] = torch.tensor(il.image_sizes)
    for j, ot in enumerate(out_t):
        t[f"c{i}_oboxes{j}"] = ot["boxes"]
        t[f"c{i}_omasks{j}"] = ot["masks"]
save_file({k: v.contiguous() for k, v in t.items()}, os.path.join(out, "detection_transform.safetensors"))
print(f"wrote {len(cases)} cases")
