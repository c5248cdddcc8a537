"""The reference side of `imgtrain benchmark --model <detector>`: torchvision's model (weights=None,
weights_backbone=None, the builder's own keyword defaults) timed on the calls GeneralizedRCNN makes
after its transform (backbone, rpn, roi_heads), on a batch of synthetic normalised images with 4
random boxes (and masks) each, as imgtrain's detection benchmark does; train: the loss dict summed,
backward and SGD (lr 1e-4). Prints the same `--result` JSON fields.
Usage: torchvision_detection.py --model maskrcnn_resnet50_fpn --bench both -b 2 --img-size 512
       [--num-warm-iter 2] [--num-bench-iter 5] [--amp] [--amp-dtype bfloat16] [--weights SD.safetensors]
--weights: load a state dict (e.g. one saved with --save-weights, then given to imgtrain's
--pretrained-path) so both sides run the same weights and so the same detections;
infer_detections_per_image says how many the mask head ran on.
--trainable-backbone-layers N: the fine-tuning configuration, the builder's path for a body started
from weights (FrozenBatchNorm2d, the layers before the last N frozen) with random weights in place
of the download (imgtrain's benchmark takes the same flag)."""
import argparse
import json
import time

import torch
import torchvision
from torch import nn
from torchvision.models.detection import FasterRCNN, MaskRCNN
from torchvision.models.detection.backbone_utils import resnet_fpn_backbone
from torchvision.models.detection.image_list import ImageList

p = argparse.ArgumentParser()
p.add_argument('--model', default='maskrcnn_resnet50_fpn')
p.add_argument('--bench', default='both', choices=['inference', 'train', 'both'])
p.add_argument('-b', '--batch-size', type=int, default=2)
p.add_argument('--img-size', type=int, default=512)
p.add_argument('--num-warm-iter', type=int, default=10)
p.add_argument('--num-bench-iter', type=int, default=40)
p.add_argument('--num-classes', type=int, default=91)
p.add_argument('--amp', action='store_true')
p.add_argument('--amp-dtype', default='float16')
p.add_argument('--opt', default='sgd')
p.add_argument('--weights', '--pretrained-path', default='', help='a safetensors state dict to load')
p.add_argument('--save-weights', default='', help='write the (random) initial state dict here and exit')
p.add_argument('--trainable-backbone-layers', type=int, default=None)
p.add_argument('--channels-last', action='store_true')
p.add_argument('--profile', action='store_true', help='print the ops with the most self CPU time over the timed steps')
args = p.parse_args()
dtype = torch.bfloat16 if args.amp_dtype == 'bfloat16' else torch.float16


def build():
    name = args.model
    kw = dict(weights=None, weights_backbone=None, num_classes=args.num_classes)
    if args.trainable_backbone_layers is not None:
        # the builder's is_trained path (FrozenBatchNorm2d, _validate_trainable_layers), with the
        # backbone constructor made to ignore the weights it is given (no download, random init)
        import torchvision.models.detection.faster_rcnn as frcnn
        import torchvision.models.detection.mask_rcnn as mrcnn
        for mod in (frcnn, mrcnn):
            for ctor in ('resnet50', 'mobilenet_v3_large'):
                if hasattr(mod, ctor):
                    real = getattr(torchvision.models, ctor)
                    setattr(mod, ctor, lambda weights=None, progress=True, _real=real, **k: _real(weights=None, **k))
        bb = ('MobileNet_V3_Large_Weights' if 'mobilenet' in name else 'ResNet50_Weights')
        kw['weights_backbone'] = getattr(torchvision.models, bb).IMAGENET1K_V1
        kw['trainable_backbone_layers'] = args.trainable_backbone_layers
    if hasattr(torchvision.models.detection, name):
        return getattr(torchvision.models.detection, name)(**kw)
    # imgtrain's R18/R34/R101 detectors: torchvision's v1 heads on resnet_fpn_backbone
    depth = name.split('_resnet')[1].split('_')[0]
    bb = resnet_fpn_backbone(backbone_name='resnet' + depth, weights=None, norm_layer=nn.BatchNorm2d,
                             trainable_layers=5)
    return (MaskRCNN if name.startswith('mask') else FasterRCNN)(bb, num_classes=args.num_classes)


torch.manual_seed(42)
img, b = args.img_size, args.batch_size
padded = (img + 31) // 32 * 32
x = torch.zeros(b, 3, padded, padded)
x[:, :, :img, :img].normal_()
sizes = [(img, img)] * b
targets = []
for _ in range(b):
    n = 4
    xy = torch.rand(n, 2) * (0.6 * img)
    wh = torch.rand(n, 2) * (0.4 * img) + 8
    t = {'boxes': torch.cat([xy, xy + wh], 1), 'labels': torch.randint(1, args.num_classes, (n,))}
    if args.model.startswith('mask'):
        m = torch.zeros(n, img, img, dtype=torch.uint8)
        for k in range(n):
            x0, y0, x1, y1 = t['boxes'][k].long().tolist()
            m[k, y0:min(img, y1), x0:min(img, x1)] = 1
        t['masks'] = m
    targets.append(t)

results = {'model': args.model}
param_count = 0
for prefix in (['infer', 'train'] if args.bench == 'both' else ['infer' if args.bench == 'inference' else 'train']):
    torch.manual_seed(42)
    model = build()
    if args.save_weights:
        from safetensors.torch import save_file
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, args.save_weights)
        raise SystemExit(0)
    if args.weights:
        from safetensors.torch import load_file
        model.load_state_dict(load_file(args.weights))
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    param_count = sum(q.numel() for q in model.parameters())
    train = prefix == 'train'
    model.train(train)
    opt = torch.optim.SGD([q for q in model.parameters() if q.requires_grad], lr=1e-4) if train else None
    il = ImageList(x.contiguous(memory_format=torch.channels_last) if args.channels_last else x, sizes)
    seen = [0, 0]  # detections, inference steps

    def step():
        t0 = time.perf_counter()
        if train:
            opt.zero_grad(set_to_none=True)
            with torch.autocast('cpu', dtype=dtype, enabled=args.amp):
                feats = model.backbone(il.tensors)
                props, rpn_losses = model.rpn(il, feats, targets)
                _, det_losses = model.roi_heads(feats, props, il.image_sizes, targets)
                loss = sum({**det_losses, **rpn_losses}.values())
            loss.backward()
            opt.step()
        else:
            with torch.no_grad(), torch.autocast('cpu', dtype=dtype, enabled=args.amp):
                feats = model.backbone(il.tensors)
                props, _ = model.rpn(il, feats)
                dets, _ = model.roi_heads(feats, props, il.image_sizes)
                seen[0] += sum(len(d['boxes']) for d in dets)
                seen[1] += 1
        return time.perf_counter() - t0

    for _ in range(args.num_warm_iter):
        step()
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if args.profile else None
    if prof:
        prof.__enter__()
    total, start = 0.0, time.perf_counter()
    for _ in range(args.num_bench_iter):
        total += step()
    elapsed = time.perf_counter() - start
    if prof:
        prof.__exit__(None, None, None)
        print(prof.key_averages().table(sort_by='self_cpu_time_total', row_limit=25))
    results[prefix + '_samples_per_sec'] = round(b * args.num_bench_iter / elapsed, 3)
    results[prefix + '_step_time'] = round(1000 * total / args.num_bench_iter, 3)
    results[prefix + '_batch_size'] = b
    results[prefix + '_img_size'] = img
    if not train and seen[1]:
        results['infer_detections_per_image'] = round(seen[0] / (seen[1] * b), 1)
results['param_count'] = round(param_count / 1e6, 2)
print('--result')
print(json.dumps(results, indent=4))
