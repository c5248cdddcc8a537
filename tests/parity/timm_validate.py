"""What timm's validate.py computes, through the same timm calls (the script itself is not in the
timm wheel): create_dataset on a folder split, create_loader with the prefetcher and the model's
resolved data config, CrossEntropyLoss, timm.utils.accuracy and AverageMeter, and validate.py's
results dict and ' * Acc@1' line.

Usage: timm_validate.py MODEL WEIGHTS DATA_DIR SPLIT NUM_CLASSES BATCH [--crop-pct P] [--interpolation I]
       [--crop-mode M] [--img-size S]
WEIGHTS: a safetensors or torch.save file of a plain state dict (timm names), or '-' for timm's
random init with torch.manual_seed(0). Prints the results as JSON on the last line, with 'loss'.

make-weights MODEL NUM_CLASSES OUT.safetensors OUT.pth: timm's random init (seed 0) saved both ways.
make-folder DIR N: DIR/val/c<k>/ with N JPEG and PNG images of varied sizes in 5 classes.
"""
import argparse
import json
import sys

import timm
import torch
from timm.data import create_dataset, create_loader, resolve_data_config
from timm.utils import AverageMeter, accuracy

if len(sys.argv) < 2 or sys.argv[1] in ('-h', '--help'):
    print(__doc__)
    sys.exit(0 if len(sys.argv) > 1 else 2)
if sys.argv[1] == 'make-weights':
    name, num_classes, st_out, pth_out = sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
    torch.manual_seed(0)
    m = timm.create_model(name, num_classes=num_classes)
    # timm's init makes near-constant logits (zero-init last norms, small heads); a wider head
    # spreads them so predictions differ per image and a changed pixel can change the result.
    with torch.no_grad():
        head = m.get_classifier()
        head.weight.normal_(0, 4.0 / head.weight.shape[1] ** 0.5)
    from safetensors.torch import save_file
    sd = {k: v.contiguous() for k, v in m.state_dict().items()}
    save_file(sd, st_out)
    torch.save(sd, pth_out)
    sys.exit(0)

if sys.argv[1] == 'make-folder':
    import os
    import numpy as np
    from PIL import Image
    root, n = sys.argv[2], int(sys.argv[3])
    rng = np.random.default_rng(0)
    for i in range(n):
        h, w = int(rng.integers(60, 700)), int(rng.integers(60, 700))
        yy, xx = np.mgrid[0:h, 0:w].astype(np.float64)
        img = np.stack([128 + 100 * np.sin(xx / w * rng.uniform(1, 9) + c) * np.cos(yy / h * rng.uniform(1, 9))
                        for c in range(3)], -1)
        img = np.clip(img + rng.normal(0, 10, img.shape), 0, 255).astype(np.uint8)
        d = os.path.join(root, 'val', f'c{i % 5}')
        os.makedirs(d, exist_ok=True)
        ext = 'png' if i % 4 == 3 else 'jpg'
        Image.fromarray(img).save(os.path.join(d, f'{i:03d}.{ext}'), **({'quality': 85} if ext == 'jpg' else {}))
    sys.exit(0)

p = argparse.ArgumentParser()
for a in ['model', 'weights', 'data_dir', 'split']:
    p.add_argument(a)
p.add_argument('num_classes', type=int)
p.add_argument('batch_size', type=int)
p.add_argument('--crop-pct', type=float)
p.add_argument('--interpolation', default='')
p.add_argument('--crop-mode')
p.add_argument('--img-size', type=int)
args = p.parse_args()
torch.set_num_threads(2)

model = timm.create_model(args.model, num_classes=args.num_classes)
if args.weights != '-':
    if args.weights.endswith('.safetensors'):
        from safetensors.torch import load_file
        sd = load_file(args.weights)
    else:
        sd = torch.load(args.weights, map_location='cpu', weights_only=True)
    model.load_state_dict(sd, strict=True)
param_count = sum(m.numel() for m in model.parameters())
# validate.py: resolve_data_config(vars(args), model=model, use_test_size=not args.use_train_size)
data_config = resolve_data_config(vars(args), model=model, use_test_size=True)
model.eval()
dataset = create_dataset(root=args.data_dir, name='', split=args.split)
loader = create_loader(dataset, input_size=data_config['input_size'], batch_size=args.batch_size,
                       use_prefetcher=True, interpolation=data_config['interpolation'], mean=data_config['mean'],
                       std=data_config['std'], num_workers=0, crop_pct=data_config['crop_pct'],
                       crop_mode=data_config['crop_mode'], device=torch.device('cpu'))
criterion = torch.nn.CrossEntropyLoss()
losses, top1, top5 = AverageMeter(), AverageMeter(), AverageMeter()
with torch.no_grad():
    for inp, target in loader:
        out = model(inp)
        loss = criterion(out, target)
        acc1, acc5 = accuracy(out.detach(), target, topk=(1, min(5, args.num_classes)))
        losses.update(loss.item(), inp.size(0))
        top1.update(acc1.item(), inp.size(0))
        top5.update(acc5.item(), inp.size(0))
r = dict(model=args.model, top1=round(top1.avg, 4), top1_err=round(100 - top1.avg, 4), top5=round(top5.avg, 4),
         top5_err=round(100 - top5.avg, 4), param_count=round(param_count / 1e6, 2),
         img_size=data_config['input_size'][-1], crop_pct=data_config['crop_pct'],
         interpolation=data_config['interpolation'], loss=round(losses.avg, 4))
print(' * Acc@1 {:.3f} ({:.3f}) Acc@5 {:.3f} ({:.3f})'.format(r['top1'], r['top1_err'], r['top5'], r['top5_err']))
print(json.dumps(r))
