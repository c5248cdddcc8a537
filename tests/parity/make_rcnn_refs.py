"""References for Faster / Mask R-CNN (test_rcnn.cpp): torchvision's models with random weights.

Writes <out>/<arch>.safetensors per model: the state dict under "sd.", two images after
torchvision's own transform (the batched tensor and the image sizes), targets at that size, the
evaluation outputs before postprocess (boxes, scores, labels, mask probabilities per image) and
after it (boxes in the original size, pasted masks), the training losses with the balanced
samplers made deterministic (torch.randperm replaced by arange, imgtrain's
deterministic_sampling) and the gradients of a few parameters.

Models: torchvision's fasterrcnn_mobilenet_v3_large_fpn and _320_fpn (their builders' RPN
settings, images at 256..400 as the others), maskrcnn_resnet50_fpn_v2 (BatchNorm FPN, two-conv RPN head, conv heads) and a
v1 Mask R-CNN on resnet_fpn_backbone('resnet18') (imgtrain's maskrcnn_resnet18_fpn), both with 3
classes so that softmax scores pass the 0.05 threshold, and fasterrcnn_resnet18 (v1 box head only);
maskrcnn_resnet18_fpn_narrow is the R18 Mask R-CNN with other widths (imgtrain's --fpn-channels 96
--box-head-dim 384 --mask-head-dim 64 --mask-head-convs 2): BackboneWithFPN(out_channels=96),
TwoMLPHead(96 * 7 * 7, 384), MaskRCNNHeads(96, [64, 64], 1), MaskRCNNPredictor(64, 64, 3), and
its RoIs pooled with MultiScaleRoIAlign(canonical_scale=112) (imgtrain's --roi-canonical-size 112).
maskrcnn_resnet18_fpn also gets the mask loss and the pasted masks of Detectron2's mask conventions
(loss_mask_detectron2, loss_mask_aligned, post<j>_masks_grid; see below).
"""
import os, sys

import torch
from safetensors.torch import save_file
from torch import nn
from torchvision.models.detection import (FasterRCNN, MaskRCNN, fasterrcnn_mobilenet_v3_large_320_fpn,
                                          fasterrcnn_mobilenet_v3_large_fpn, maskrcnn_resnet50_fpn_v2)
from torchvision.models.detection import _utils as det_utils
from torchvision.models import resnet18
from torchvision.models.detection.backbone_utils import BackboneWithFPN, resnet_fpn_backbone
from torchvision.models.detection.faster_rcnn import FastRCNNPredictor, TwoMLPHead
from torchvision.models.detection.mask_rcnn import MaskRCNNHeads, MaskRCNNPredictor
from torchvision.models.detection import roi_heads as roi_heads_module
from torchvision.ops import MultiScaleRoIAlign, roi_align
from torch.nn import functional as F

out = sys.argv[1]
os.makedirs(out, exist_ok=True)
torch.manual_seed(0)
g = torch.Generator().manual_seed(3)


def calibrate_bn(model, x):
    """BatchNorm running statistics from one pass (random init leaves 0 / 1, which lets
    activations grow through 50 layers); momentum 1 so the stats are the batch's."""
    bns = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    for m in bns:
        m.momentum = 1.0
    model.backbone.train()
    with torch.no_grad():
        model.backbone(x)
    for m in bns:
        m.momentum = 0.1


def make(arch):
    if arch.startswith("fasterrcnn_mobilenet"):  # the builders' own rpn_score_thresh / top-n; smaller images
        b = fasterrcnn_mobilenet_v3_large_fpn if arch.endswith("large_fpn") else fasterrcnn_mobilenet_v3_large_320_fpn
        return b(weights=None, weights_backbone=None, num_classes=3, min_size=256, max_size=400)
    if arch == "maskrcnn_resnet50_fpn_v2":
        return maskrcnn_resnet50_fpn_v2(weights=None, weights_backbone=None, num_classes=3, min_size=256, max_size=400)
    if arch == "maskrcnn_resnet18_fpn_narrow":
        body = resnet18(weights=None, norm_layer=nn.BatchNorm2d)
        bb = BackboneWithFPN(body, {"layer1": "0", "layer2": "1", "layer3": "2", "layer4": "3"}, [64, 128, 256, 512], 96)
        return MaskRCNN(bb, num_classes=None, min_size=256, max_size=400, box_head=TwoMLPHead(96 * 7 * 7, 384),
                        box_predictor=FastRCNNPredictor(384, 3), mask_head=MaskRCNNHeads(96, [64, 64], 1),
                        mask_predictor=MaskRCNNPredictor(64, 64, 3),
                        box_roi_pool=MultiScaleRoIAlign(["0", "1", "2", "3"], 7, 2, canonical_scale=112),
                        mask_roi_pool=MultiScaleRoIAlign(["0", "1", "2", "3"], 14, 2, canonical_scale=112))
    bb = resnet_fpn_backbone(backbone_name="resnet18", weights=None, norm_layer=nn.BatchNorm2d, trainable_layers=5)
    cls = MaskRCNN if arch.startswith("mask") else FasterRCNN
    return cls(bb, num_classes=3, min_size=256, max_size=400)


for arch in ["maskrcnn_resnet18_fpn", "fasterrcnn_resnet18_fpn", "maskrcnn_resnet50_fpn_v2",
             "fasterrcnn_mobilenet_v3_large_fpn", "fasterrcnn_mobilenet_v3_large_320_fpn", "maskrcnn_resnet18_fpn_narrow"]:
    model = make(arch)
    t = {}
    # two images of different sizes with objects (boxes and masks)
    images, targets = [], []
    for (h, w) in [(190, 250), (240, 170)]:
        img = torch.rand(3, h, w, generator=g)
        n = 4
        xy = torch.rand(n, 2, generator=g) * torch.tensor([w * 0.6, h * 0.6])
        wh = torch.rand(n, 2, generator=g) * torch.tensor([w * 0.4, h * 0.4]) + 8
        boxes = torch.cat([xy, xy + wh], 1)
        masks = torch.zeros(n, h, w, dtype=torch.uint8)
        for k in range(n):
            x0, y0, x1, y1 = boxes[k].long().tolist()
            masks[k, y0 + 2:y1 - 1, x0 + 1:x1 - 2] = 1
        images.append(img)
        targets.append({"boxes": boxes, "labels": torch.randint(1, 3, (n,), generator=g), "masks": masks})
    model.eval()
    il, tt = model.transform(images, [dict(d) for d in targets])
    calibrate_bn(model, il.tensors)
    model.eval()
    t["images"] = il.tensors.contiguous()
    t["sizes"] = torch.tensor(il.image_sizes, dtype=torch.int64)
    t["orig_sizes"] = torch.tensor([list(im.shape[-2:]) for im in images], dtype=torch.int64)
    for j, d in enumerate(tt):
        t[f"t{j}_boxes"], t[f"t{j}_labels"], t[f"t{j}_masks"] = d["boxes"], d["labels"], d["masks"]
    with torch.no_grad():
        feats = model.backbone(il.tensors)
        props, _ = model.rpn(il, feats)
        dets, _ = model.roi_heads(feats, props, il.image_sizes)
        for j, d in enumerate(dets):
            t[f"proposals{j}"] = props[j]
            for k, v in d.items():
                t[f"det{j}_{k}"] = v.contiguous()
        post = model.transform.postprocess([dict(d) for d in dets], il.image_sizes, [tuple(im.shape[-2:]) for im in images])
        for j, d in enumerate(post):
            t[f"post{j}_boxes"] = d["boxes"].contiguous()
            if "masks" in d:
                t[f"post{j}_masks"] = d["masks"].contiguous()
    # training: deterministic samplers, the same batch and targets
    sd = {k: v.clone().contiguous() for k, v in model.state_dict().items()}
    model.train()
    orig = torch.randperm
    det_utils.torch.randperm = lambda n, device=None, **kw: torch.arange(n, device=device)
    try:
        il2 = type(il)(il.tensors, il.image_sizes)
        feats = model.backbone(il2.tensors)
        props, rpn_losses = model.rpn(il2, feats, tt)
        _, det_losses = model.roi_heads(feats, props, il2.image_sizes, tt)
    finally:
        det_utils.torch.randperm = orig
    losses = {**det_losses, **rpn_losses}
    total = sum(losses.values())
    total.backward()
    for k, v in losses.items():
        t["loss_" + k.removeprefix("loss_")] = v.detach().reshape(1)
    named = dict(model.named_parameters())
    first = "backbone.body.0.0.weight" if "mobilenet" in arch else "backbone.body.conv1.weight"
    for k in [first, "backbone.body.13.block.2.fc1.weight" if "mobilenet" in arch else first,
              "backbone.fpn.layer_blocks.0.0.weight", "rpn.head.cls_logits.weight",
              "roi_heads.box_predictor.bbox_pred.weight"] + (["roi_heads.mask_predictor.mask_fcn_logits.weight"]
                                                            if arch.startswith("mask") else []):
        t["grad." + k] = named[k].grad.contiguous()
    if arch in ("maskrcnn_resnet18_fpn", "fasterrcnn_resnet18_fpn"):
        # the second image without objects (a crop can remove them all): its RoIs are all background
        empty = [tt[0], {"boxes": torch.zeros(0, 4), "labels": torch.zeros(0, dtype=torch.int64),
                         "masks": torch.zeros(0, *tt[1]["masks"].shape[-2:], dtype=torch.uint8)}]
        det_utils.torch.randperm = lambda n, device=None, **kw: torch.arange(n, device=device)
        try:
            feats = model.backbone(il2.tensors)
            props, rpn_losses = model.rpn(il2, feats, empty)
            _, det_losses = model.roi_heads(feats, props, il2.image_sizes, empty)
        finally:
            det_utils.torch.randperm = orig
        for k, v in {**det_losses, **rpn_losses}.items():
            t["empty_loss_" + k.removeprefix("loss_")] = v.detach().reshape(1)
    if arch == "maskrcnn_resnet18_fpn":
        # imgtrain's --mask-convention detectron2 / aligned. Detectron2 is not on PyPI, so its two
        # steps are written here as it documents them: the targets are roi_align of the gt mask with
        # aligned=True and adaptive sampling (BitMasks.crop_and_resize), binarised at 0.5
        # ("detectron2") or kept as fractions ("aligned"), in place of torchvision's
        # project_masks_on_boxes; the paste samples each mask by grid_sample (bilinear, zeros
        # outside, align_corners=False) at the centres of the pixels floor(x0) - 1 .. ceil(x1) + 1
        # mapped into the float box (detectron2.layers.paste_masks_in_image on a CPU), float32.
        def aligned_targets(binary):
            def project(gt_masks, boxes, matched_idxs, M):
                rois = torch.cat([matched_idxs.to(boxes)[:, None], boxes], 1)
                m = roi_align(gt_masks[:, None].to(rois), rois, (M, M), 1.0, 0, True)[:, 0]
                return (m >= 0.5).to(m.dtype) if binary else m
            return project

        saved = roi_heads_module.project_masks_on_boxes
        for name, binary in [("detectron2", True), ("aligned", False)]:
            roi_heads_module.project_masks_on_boxes = aligned_targets(binary)
            det_utils.torch.randperm = lambda n, device=None, **kw: torch.arange(n, device=device)
            try:
                feats = model.backbone(il2.tensors)
                props, _ = model.rpn(il2, feats, tt)
                _, det_losses = model.roi_heads(feats, props, il2.image_sizes, tt)
            finally:
                det_utils.torch.randperm = orig
                roi_heads_module.project_masks_on_boxes = saved
            t[f"loss_mask_{name}"] = det_losses["loss_mask"].detach().reshape(1)

        def grid_paste(masks, boxes, h, w):
            out_masks = torch.zeros(len(masks), 1, h, w)
            for i in range(len(masks)):
                x0, y0, x1, y1 = boxes[i:i + 1].unbind(1)
                xa = max(int(torch.floor(x0)) - 1, 0)
                ya = max(int(torch.floor(y0)) - 1, 0)
                xb = min(int(torch.ceil(x1)) + 1, w)
                yb = min(int(torch.ceil(y1)) + 1, h)
                if xb <= xa or yb <= ya:
                    continue
                gx = (torch.arange(xa, xb, dtype=torch.float32) + 0.5 - x0) / (x1 - x0) * 2 - 1
                gy = (torch.arange(ya, yb, dtype=torch.float32) + 0.5 - y0) / (y1 - y0) * 2 - 1
                grid = torch.stack([gx[None, :].expand(yb - ya, xb - xa), gy[:, None].expand(yb - ya, xb - xa)], 2)
                out_masks[i, 0, ya:yb, xa:xb] = F.grid_sample(masks[i:i + 1], grid[None], align_corners=False)[0, 0]
            return out_masks

        for j, d in enumerate(dets):
            h, w = images[j].shape[-2:]
            t[f"post{j}_masks_grid"] = grid_paste(d["masks"], post[j]["boxes"], h, w)
    for k, v in sd.items():
        t["sd." + k] = v
    save_file(t, os.path.join(out, arch + ".safetensors"))
    print(arch, {k: round(float(v), 5) for k, v in losses.items()}, [len(d["boxes"]) for d in dets])
