"""References for the detection resize and batching (test_detection_transform.cpp): torchvision's
GeneralizedRCNNTransform on pairs of images with boxes and masks.

Writes <out>/detection_transform.safetensors. Per case i and image j: the uint8 CHW input, the
normalised image (the transform's own normalize), boxes and dense masks; the transform's batched
tensor, image sizes, and the resized boxes and masks. The model transform runs in eval mode so the
min size is min_size[-1] (training draws it; imgtrain's loader draws per sample instead).
"""
import os, sys

import numpy as np

import torch
from safetensors.torch import save_file
from torchvision.models.detection.transform import GeneralizedRCNNTransform

out = sys.argv[1]
os.makedirs(out, exist_ok=True)
# ATen's bilinear resize rounds differently with different thread counts: one thread here and in
# the test, whatever the machine has
torch.set_num_threads(1)
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

# Large-scale jitter (torchvision's --data-augmentation lsj): references/detection/transforms.py's
# ScaleJitter followed by FixedSizeCrop(fill=mean), written here with torchvision's functional ops
# in the same arithmetic (the references are not part of the wheel), with torch.rand's two draws
# given. Inputs are PIL images (the references' default backend) and uint8 mask tensors.
from PIL import Image
import torchvision.transforms.functional as TF
from torchvision.transforms import InterpolationMode

FILL = (123.0, 117.0, 104.0)


def lsj_reference(pil, boxes, labels, masks, size, scale, crop):
    ow, oh = pil.size
    r = min(size / oh, size / ow) * torch.tensor([scale], dtype=torch.float32)
    nw, nh = int(ow * r), int(oh * r)
    pil = TF.resize(pil, [nh, nw], interpolation=InterpolationMode.BILINEAR)
    boxes = boxes.clone()
    boxes[:, 0::2] *= nw / ow
    boxes[:, 1::2] *= nh / oh
    masks = TF.resize(masks, [nh, nw], interpolation=InterpolationMode.NEAREST)
    ch, cw = min(nh, size), min(nw, size)
    if ch != nh or cw != nw:
        draw = torch.tensor([crop], dtype=torch.float32)
        top, left = int(max(nh - size, 0) * draw), int(max(nw - size, 0) * draw)
        pil = TF.crop(pil, top, left, ch, cw)
        boxes[:, 0::2] -= left
        boxes[:, 1::2] -= top
        boxes[:, 0::2].clamp_(min=0, max=cw)
        boxes[:, 1::2].clamp_(min=0, max=ch)
        ok = (boxes[:, 0] < boxes[:, 2]) & (boxes[:, 1] < boxes[:, 3])
        boxes, labels, masks = boxes[ok], labels[ok], TF.crop(masks[ok], top, left, ch, cw)
    if ch < size or cw < size:
        pad = [0, 0, size - cw, size - ch]
        pil = TF.pad(pil, pad, fill=FILL)
        masks = TF.pad(masks, pad, 0, "constant")
    return pil, boxes, labels, masks


# (h, w), size, scale, crop draw, where the boxes lie (1: bottom-right quarter only)
lsj_cases = [((37, 53), 64, 1.7, 0.3, 0), ((60, 41), 64, 0.35, 0.8, 0), ((480, 640), 256, 1.93, 0.999, 0),
             ((100, 90), 128, 1.0, 0.5, 0), ((33, 50), 40, 0.1, 0.2, 0), ((90, 120), 100, 2.0, 0.0, 1),
             ((64, 64), 64, 1.0, 0.7, 0), ((80, 80), 48, 2.0, 0.95, 0)]
t = {}
for i, ((h, w), size, scale, crop, corner) in enumerate(lsj_cases):
    u8 = torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8)
    n = 5
    lo = torch.tensor([w, h]) * (0.6 if corner else 0.0)
    xy = lo + torch.rand(n, 2, generator=g) * (torch.tensor([w, h]) - lo) * 0.7
    wh = torch.rand(n, 2, generator=g) * (torch.tensor([w, h]) - xy) * 0.9 + 0.5
    boxes = torch.cat([xy, xy + wh], 1).float()
    masks = torch.zeros(n, h, w, dtype=torch.uint8)
    for k in range(n):
        x1, y1, x2, y2 = boxes[k].int().tolist()
        masks[k, y1:y2 + 1, x1:x2 + 1] = (torch.rand(y2 + 1 - y1, x2 + 1 - x1, generator=g) > 0.4).to(torch.uint8)
    labels = torch.arange(1, n + 1)
    pil, ob, ol, om = lsj_reference(Image.fromarray(u8.numpy()), boxes, labels, masks, size, scale, crop)
    t[f"l{i}_in"] = u8
    t[f"l{i}_boxes"] = boxes
    t[f"l{i}_masks"] = masks
    t[f"l{i}_params"] = torch.tensor([size, scale, crop], dtype=torch.float64)
    t[f"l{i}_out"] = torch.from_numpy(np.asarray(pil).copy())
    t[f"l{i}_oboxes"] = ob.clone()
    t[f"l{i}_olabels"] = ol
    t[f"l{i}_omasks"] = om.clone()
save_file({k: v.contiguous() for k, v in t.items()}, os.path.join(out, "lsj.safetensors"))
print(f"wrote {len(lsj_cases)} large-scale jitter cases")
