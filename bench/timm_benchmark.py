"""The reference side of `imgtrain benchmark`: the measurement timm's benchmark.py makes (synthetic
input, warm-up, then timed inference steps and/or train steps with cross entropy on random targets
and create_optimizer_v2(opt, lr=1e-4)), written out here because benchmark.py is not part of the
timm wheel. Prints the same `--result` JSON fields.
Usage: timm_benchmark.py --model resnet50 --bench both -b 8 --img-size 160 [--num-warm-iter 10]
       [--num-bench-iter 40] [--amp] [--amp-dtype bfloat16] [--channels-last] [--opt sgd]
       [--device cuda] [--torchcompile [MODE]]
--torchcompile compiles the model as benchmark.py's --torchcompile does (torch.compile, default
mode unless one is named); on CUDA the step is timed with a device synchronisation and the
caching allocator's peaks over the timed steps are reported (<prefix>_max_allocated_mb /
_max_reserved_mb, as imgtrain benchmark)."""
import argparse
import json
import time

import timm
import torch
from timm.optim import create_optimizer_v2

p = argparse.ArgumentParser()
p.add_argument('--model', default='resnet50')
p.add_argument('--bench', default='both', choices=['inference', 'train', 'both'])
p.add_argument('-b', '--batch-size', type=int, default=256)
p.add_argument('--img-size', type=int, default=224)
p.add_argument('--num-warm-iter', type=int, default=10)
p.add_argument('--num-bench-iter', type=int, default=40)
p.add_argument('--amp', action='store_true')
p.add_argument('--amp-dtype', default='float16')
p.add_argument('--channels-last', action='store_true')
p.add_argument('--opt', default='sgd')
p.add_argument('--device', default='cpu')
p.add_argument('--torchcompile', nargs='?', const='default', default=None)
args = p.parse_args()
device = torch.device(args.device).type
cuda = device == 'cuda'
if cuda:
    torch.backends.cudnn.benchmark = True  # as timm's benchmark.py (and imgtrain on CUDA)


def now():
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter()
dtype = torch.bfloat16 if args.amp_dtype == 'bfloat16' else torch.float16


def autocast():
    return torch.autocast(device_type=device, dtype=dtype, enabled=args.amp)


results = {'model': args.model}
param_count = 0
for prefix in (['infer', 'train'] if args.bench == 'both' else ['infer' if args.bench == 'inference' else 'train']):
    torch.manual_seed(42)
    model = timm.create_model(args.model)
    param_count = sum(q.numel() for q in model.parameters())
    num_classes = model.num_classes
    model = model.to(args.device)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    x = torch.randn(args.batch_size, 3, args.img_size, args.img_size, device=args.device)
    if args.channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    train = prefix == 'train'
    if train:
        model.train()
        opt = create_optimizer_v2(model, opt=args.opt, lr=1e-4)
        loss_fn = torch.nn.CrossEntropyLoss()
    else:
        model.eval()
    if args.torchcompile:
        model = torch.compile(model, mode=None if args.torchcompile == 'default' else args.torchcompile)

    def step():
        if train:
            opt.zero_grad()
        t0 = now()
        if train:
            with autocast():
                out = model(x)
                target = torch.empty(out.shape[0], dtype=torch.long, device=args.device).random_(num_classes)
                loss_fn(out, target).backward()
            opt.step()
        else:
            with torch.no_grad(), autocast():
                model(x)
        return now() - t0

    for _ in range(args.num_warm_iter):
        step()
    total, samples = 0.0, 0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    start = now()
    for _ in range(args.num_bench_iter):
        total += step()
        samples += args.batch_size
    elapsed = now() - start
    if cuda:
        results[f'{prefix}_max_allocated_mb'] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
        results[f'{prefix}_max_reserved_mb'] = round(torch.cuda.max_memory_reserved() / 2**20, 1)
    results[f'{prefix}_samples_per_sec'] = round(samples / elapsed, 2)
    results[f'{prefix}_step_time'] = round(1000 * total / args.num_bench_iter, 3)
    results[f'{prefix}_batch_size'] = args.batch_size
    results[f'{prefix}_img_size'] = args.img_size
results['param_count'] = round(param_count / 1e6, 2)
print(f'--result\n{json.dumps(results, indent=4)}')
