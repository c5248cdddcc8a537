"""Writes reference data for the C++ parity tests with the Python tools they must agree with
(timm, torch). Usage: make_refs.py OUT_DIR. Everything is seeded, nothing is downloaded."""
import json
import math
import os
import sys

import torch
import timm
from safetensors.torch import save_file
from timm.optim._param_groups import param_groups_weight_decay
from timm.scheduler import create_scheduler_v2

out = sys.argv[1]
os.makedirs(out, exist_ok=True)
torch.set_num_threads(1)


def randomize_bn(model, g):
    # timm zero-inits the last BN of each block, which would hide half the network from the test.
    # Those get small random scales so the residual stream (and the output) stays O(1) and an
    # absolute tolerance of 1e-4 means something.
    last = set()
    for m in model.modules():
        if hasattr(m, 'zero_init_last'):
            last.add(id(getattr(m, 'bn3', None) or m.bn2))
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            with torch.no_grad():
                lo, span = (0.05, 0.25) if id(m) in last else (0.5, 1.0)
                m.weight.copy_(torch.rand(m.weight.shape, generator=g) * span + lo)
                m.bias.copy_(torch.randn(m.bias.shape, generator=g) * 0.05)
                m.running_mean.copy_(torch.randn(m.running_mean.shape, generator=g) * 0.1)
                m.running_var.copy_(torch.rand(m.running_var.shape, generator=g) + 0.5)


def randomize_norms(model, g):
    # LayerNorm starts at ones/zeros; random affine parameters make the test see them.
    for m in model.modules():
        if isinstance(m, torch.nn.LayerNorm):
            with torch.no_grad():
                m.weight.copy_(torch.rand(m.weight.shape, generator=g) + 0.5)
                m.bias.copy_(torch.randn(m.bias.shape, generator=g) * 0.1)


def robust_stats(v):
    # mean and std without values more than 6 std from the mean: torch's trunc_normal_ puts about
    # one weight in 4 million exactly on its bound (+-2, i.e. 100 std for std .02), which would
    # otherwise dominate the std of a large tensor. test_parity.cpp computes the same statistic.
    v = v.double().flatten()
    if v.numel() < 2:
        return [v.mean().item(), 0.0, v.numel()]
    m, s = v.mean(), v.std()
    v = v[(v - m).abs() <= 6 * s]
    return [v.mean().item(), v.std().item(), v.numel()]


def model_refs(name, train_grads, init_stats, input_size=64, features=True, file=None, **kwargs):
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = timm.create_model(name, num_classes=10, **kwargs)
    randomize_bn(model, g)
    randomize_norms(model, g)
    tensors = {'model.' + k: v.clone().contiguous() for k, v in model.state_dict().items()}
    x = torch.randn(2, 3, input_size, input_size, generator=g)
    model.eval()
    with torch.no_grad():
        tensors['ref.input'] = x
        tensors['ref.eval_out'] = model(x)
    meta = {'keys': json.dumps([[k, list(v.shape)] for k, v in model.state_dict().items()]),
            'param_count': str(sum(p.numel() for p in model.parameters()))}
    if features:  # the features API: every level timm's feature_info lists, from forward_intermediates
        info = model.feature_info
        levels = list(range(len(info)))
        kw = dict(norm=False) if name.startswith('vit_') else {}
        with torch.no_grad():
            feats = model.forward_intermediates(x, indices=levels, intermediates_only=True, **kw)
        for i, f in enumerate(feats):
            tensors[f'feat.{i}'] = f.contiguous()
        fo = timm.create_model(name, features_only=True, pretrained=False, **kwargs)
        meta['feature_info'] = json.dumps([[f['num_chs'], f['reduction'], f['module']] for f in info])
        meta['out_indices'] = json.dumps(list(fo.feature_info.out_indices))
    if train_grads:
        model.train()
        xt = torch.randn(4, 3, input_size, input_size, generator=g)
        y = torch.tensor([1, 3, 5, 7])
        outp = model(xt)
        loss = torch.nn.functional.cross_entropy(outp, y, label_smoothing=0.1)
        loss.backward()
        tensors['ref.train_input'] = xt
        tensors['ref.train_target'] = y
        tensors['ref.train_loss'] = loss.detach().reshape(1)
        for k, p in model.named_parameters():
            tensors['grad.' + k] = p.grad.contiguous()
        # BN running stats after one train-mode forward (momentum 0.1).
        for k, b in model.named_buffers():
            tensors['after.' + k] = b.clone().contiguous()
    if init_stats:  # of a fresh model (1000 classes, timm defaults)
        fresh = timm.create_model(name, **kwargs)
        stats = {k: robust_stats(v) for k, v in fresh.state_dict().items() if v.dtype.is_floating_point}
        meta['init_stats'] = json.dumps(stats)
    save_file(tensors, os.path.join(out, f'{file or name}.safetensors'), metadata=meta)


# ViTs at 32 px (2x2 or 1x1 patches) keep the references small; the shapes follow img_size.
VITS = ['vit_tiny_patch16_224', 'vit_small_patch16_224', 'vit_base_patch16_224', 'vit_base_patch32_224']
for name in VITS:
    model_refs(name, train_grads=name == 'vit_tiny_patch16_224',
               init_stats=name in ('vit_tiny_patch16_224', 'vit_base_patch16_224'), input_size=32, img_size=32)
RESNETS = ['resnet18', 'resnet34', 'resnet50', 'resnet101', 'resnet152', 'resnext50_32x4d', 'resnet50d', 'resnet26d']
for name in RESNETS:
    model_refs(name, train_grads=name in ('resnet18', 'resnet26d'),
               init_stats=name in ('resnet18', 'resnet50', 'resnext50_32x4d', 'resnet26d'))

# MobileNet / EfficientNet / ConvNeXt. tf_ models at odd sizes, so TF 'same' padding is asymmetric.
EFFNETS = ['mobilenetv3_large_100', 'mobilenetv3_small_100', 'mobilenetv3_large_075', 'mobilenetv2_100',
           *[f'efficientnet_b{i}' for i in range(5)], *[f'tf_efficientnet_b{i}' for i in range(5)]]
for name in EFFNETS:
    model_refs(name, train_grads=name in ('mobilenetv3_large_100', 'efficientnet_b0', 'tf_efficientnet_b0'),
               init_stats=name in ('mobilenetv3_large_100', 'mobilenetv2_100', 'efficientnet_b0', 'tf_efficientnet_b2'),
               input_size=63 if name.startswith('tf_') else 64)
for name in ['convnext_tiny', 'convnext_small']:
    model_refs(name, train_grads=name == 'convnext_tiny', init_stats=name == 'convnext_tiny')

# Global pool types other than the default (--gp): the head's input width and names follow them.
for name, gp, kw in [('resnet18', 'catavgmax', {}), ('mobilenetv3_small_100', 'avgmax', {}),
                     ('efficientnet_b0', 'max', {}), ('convnext_tiny', 'max', {}),
                     ('vit_tiny_patch16_224', 'avg', dict(img_size=32, input_size=32))]:
    size = kw.pop('input_size', 64)
    model_refs(name, train_grads=False, init_stats=False, features=False, file=f'{name}-{gp}', global_pool=gp,
               input_size=size, **kw)

# timm's optimizer factory (parameter groups, defaults) on a tiny module, three steps each.
from timm.optim import create_optimizer_v2
g2 = torch.Generator().manual_seed(2)
lin = torch.nn.Linear(3, 5)
w0, b0 = torch.randn(5, 3, generator=g2), torch.randn(5, generator=g2)
fac = {'w0': w0, 'b0': b0}
for i in range(3):
    fac[f'gw{i}'] = torch.randn(5, 3, generator=g2)
    fac[f'gb{i}'] = torch.randn(5, generator=g2)
for name, lr in [('sgd', 0.1), ('momentum', 0.1), ('adam', 1e-2), ('adamw', 1e-2), ('rmsproptf', 1e-2),
                 ('lamb', 1e-2), ('lambc', 1e-2), ('lars', 0.1), ('larc', 0.1), ('nlars', 0.1)]:
    with torch.no_grad():
        lin.weight.copy_(w0)
        lin.bias.copy_(b0)
    opt = create_optimizer_v2(lin, name, lr=lr, weight_decay=1e-2, momentum=0.9)
    for i in range(3):
        lin.weight.grad = fac[f'gw{i}'].clone()
        lin.bias.grad = fac[f'gb{i}'].clone()
        opt.step()
        fac[f'{name}.w{i}'] = lin.weight.detach().clone()
        fac[f'{name}.b{i}'] = lin.bias.detach().clone()
save_file(fac, os.path.join(out, 'optim_factory.safetensors'))

# Schedules from many flag combinations, per epoch and per update (--sched-on-updates), and the
# epoch count create_scheduler_v2 returns. The C++ test rebuilds each from `kw`.
sched_cases = []
for kw in [
    dict(sched='tanh', num_epochs=10, warmup_epochs=2, warmup_lr=1e-4, min_lr=1e-5),
    dict(sched='tanh', num_epochs=6, warmup_epochs=2, warmup_lr=1e-4, warmup_prefix=True, cooldown_epochs=2),
    dict(sched='cosine', num_epochs=4, warmup_epochs=1, warmup_lr=1e-4, min_lr=1e-5, cycle_mul=2.0, cycle_decay=0.5,
         cycle_limit=3, k_decay=1.5, cooldown_epochs=1),
    dict(sched='cosine', num_epochs=3, cycle_limit=4, cycle_decay=0.7),
    dict(sched='poly', num_epochs=5, cycle_limit=2, cycle_decay=0.7, decay_rate=0.5, k_decay=2.0, min_lr=1e-4),
    dict(sched='tanh', num_epochs=3, cycle_mul=1.5, cycle_limit=3, warmup_epochs=1, warmup_lr=1e-3),
    dict(sched='cosine', num_epochs=3, warmup_epochs=1, warmup_lr=1e-4, min_lr=1e-5, step_on_epochs=False,
         updates_per_epoch=7),
    dict(sched='step', decay_epochs=1.5, decay_rate=0.5, warmup_epochs=1, warmup_lr=1e-4, step_on_epochs=False,
         updates_per_epoch=4, num_epochs=5),
    dict(sched='multistep', decay_milestones=[1, 3], decay_rate=0.3, step_on_epochs=False, updates_per_epoch=5,
         num_epochs=5),
    dict(sched='poly', num_epochs=4, decay_rate=2.0, warmup_epochs=1, warmup_prefix=True, step_on_epochs=False,
         updates_per_epoch=3, cooldown_epochs=1),
    dict(sched='step', decay_epochs=2, decay_rate=0.5, warmup_epochs=2, warmup_lr=1e-4, warmup_prefix=True,
         num_epochs=9),
]:
    dummy = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    sch, n = create_scheduler_v2(dummy, **kw)
    per = kw.get('updates_per_epoch', 1) if kw.get('step_on_epochs', True) is False else 1
    lrs = [sch._get_lr(t)[0] for t in range((n + 3) * per)]
    sched_cases.append(dict(kw=kw, lrs=lrs, num_epochs=n))
# plateau: train.py's sequence (step(epoch + 1, metric) after each epoch), metrics that stall
plateau_cases = []
for kw, metrics in [
    (dict(sched='plateau', warmup_epochs=2, warmup_lr=1e-4, patience_epochs=1, decay_rate=0.5, min_lr=0.02),
     [10, 20, 30, 30, 30, 31, 30, 29, 28, 40, 40, 40, 40, 40]),
    (dict(sched='plateau', patience_epochs=2, decay_rate=0.1, plateau_mode='min'),
     [5.0, 4.0, 4.0, 4.0, 4.0, 3.9999, 3.0, 3.0, 3.0, 3.0]),
]:
    dummy = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    sch, n = create_scheduler_v2(dummy, **kw)
    lrs = [dummy.param_groups[0]['lr']]
    for e, m in enumerate(metrics):
        sch.step(e + 1, m)
        lrs.append(dummy.param_groups[0]['lr'])
    plateau_cases.append(dict(kw=kw, metrics=metrics, lrs=lrs, num_epochs=n))
# layer-wise lr decay groups (timm's param_groups_layer_decay through create_optimizer_v2)
layer_decay = {}
for name, kw in [('vit_tiny_patch16_224', dict(img_size=32)), ('convnext_tiny', {}), ('resnet18', {}),
                 ('efficientnet_b0', {}), ('mobilenetv3_small_100', {})]:
    m = timm.create_model(name, num_classes=10, **kw)
    names = {id(p): k for k, p in m.named_parameters()}
    opt = create_optimizer_v2(m, 'adamw', lr=1.0, weight_decay=0.05, layer_decay=0.75)
    layer_decay[name] = {names[id(p)]: [grp['lr_scale'], grp['weight_decay']] for grp in opt.param_groups
                         for p in grp['params']}
save_file({'dummy': torch.zeros(1)}, os.path.join(out, 'sched.safetensors'),
          metadata={'sched_cases': json.dumps(sched_cases), 'plateau_cases': json.dumps(plateau_cases),
                    'layer_decay': json.dumps(layer_decay)})

# Gradient clipping: torch's norm / value clipping and timm's adaptive clipping.
from timm.utils import dispatch_clip_grad
clip = {}
pw, pb = torch.randn(6, 4, generator=g2), torch.randn(6, generator=g2) * 0.01
gw, gb = torch.randn(6, 4, generator=g2), torch.randn(6, generator=g2)
clip.update(pw=pw, pb=pb, gw=gw, gb=gb)
for mode, value in [('norm', 1.5), ('value', 0.3), ('agc', 0.05)]:
    ps = [torch.nn.Parameter(pw.clone()), torch.nn.Parameter(pb.clone())]
    ps[0].grad, ps[1].grad = gw.clone(), gb.clone()
    dispatch_clip_grad(ps, value=value, mode=mode)
    clip[f'{mode}.gw'], clip[f'{mode}.gb'] = ps[0].grad, ps[1].grad
save_file(clip, os.path.join(out, 'clip.safetensors'))

# ModelEmaV3 on a toy model with a BatchNorm (buffers lerped, num_batches_tracked copied).
from timm.utils import ModelEmaV3
ema_t = {}
for warm in (False, True):
    torch.manual_seed(4)
    toy = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    for k, v in toy.state_dict().items():
        ema_t[f'{warm}.init.{k}'] = v.clone()
    ema = ModelEmaV3(toy, decay=0.9, use_warmup=warm)
    ema_t[f'{warm}.decay'] = torch.tensor([ema.get_decay(s) for s in range(12)], dtype=torch.float64)
    for step in range(1, 6):
        with torch.no_grad():
            for p in toy.parameters():
                p.add_(0.1 * step)
        toy.train()
        toy(torch.randn(8, 3, generator=g2))  # moves the BN running stats
        ema.update(toy, step=step)
        for k, v in toy.state_dict().items():
            ema_t[f'{warm}.model{step}.{k}'] = v.clone()
        for k, v in ema.module.state_dict().items():
            ema_t[f'{warm}.ema{step}.{k}'] = v.clone()
save_file(ema_t, os.path.join(out, 'ema.safetensors'))

# Optimizers: three steps on fixed parameters and gradients, with weight decay.
g = torch.Generator().manual_seed(1)
p0 = torch.randn(5, 3, generator=g)
grads = [torch.randn(5, 3, generator=g) for _ in range(3)]
opt_t = {'p0': p0.clone()}
for i, gr in enumerate(grads):
    opt_t[f'g{i}'] = gr
configs = {
    'sgd': lambda p: torch.optim.SGD([p], lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-2),
    'momentum': lambda p: torch.optim.SGD([p], lr=0.1, momentum=0.9, nesterov=False, weight_decay=1e-2),
    'adamw': lambda p: torch.optim.AdamW([p], lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=5e-2),
}
for name, make in configs.items():
    p = torch.nn.Parameter(p0.clone())
    opt = make(p)
    for i, gr in enumerate(grads):
        p.grad = gr.clone()
        opt.step()
        opt_t[f'{name}.step{i}'] = p.detach().clone()
save_file(opt_t, os.path.join(out, 'optim.safetensors'))

# Schedules: timm's lr per epoch.
sched = {}
dummy = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
s, _ = create_scheduler_v2(dummy, 'cosine', num_epochs=10, warmup_epochs=2, warmup_lr=1e-4, min_lr=1e-5)
sched['cosine'] = torch.tensor([s._get_lr(t)[0] for t in range(13)], dtype=torch.float64)
dummy = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
s, _ = create_scheduler_v2(dummy, 'step', num_epochs=10, decay_epochs=3, decay_rate=0.5, warmup_epochs=1,
                           warmup_lr=1e-4)
sched['step'] = torch.tensor([s._get_lr(t)[0] for t in range(13)], dtype=torch.float64)
more = [('multistep', dict(decay_milestones=[2, 5], decay_rate=0.5, warmup_epochs=1, warmup_lr=1e-4)),
        ('poly', dict(num_epochs=8, decay_rate=2.0, warmup_epochs=2, warmup_lr=1e-4, warmup_prefix=True,
                      min_lr=1e-5, cooldown_epochs=2)),
        ('cosine', dict(num_epochs=6, warmup_epochs=2, warmup_prefix=True, warmup_lr=1e-4, min_lr=1e-5,
                        cooldown_epochs=3))]
for i, (kind, kw) in enumerate(more):
    dummy = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    s, n = create_scheduler_v2(dummy, kind, **kw)
    sched[f'more{i}'] = torch.tensor([s._get_lr(t)[0] for t in range(14)], dtype=torch.float64)
    sched[f'more{i}.num_epochs'] = torch.tensor([n])
# torch.utils.data.DistributedSampler / timm's training order: randperm seeded with seed + epoch.
gen = torch.Generator().manual_seed(42 + 3)
sched['randperm'] = torch.randperm(10, generator=gen)
# torch's DistributedSampler (4 ranks, 10 samples, padded) and timm's OrderedDistributedSampler
from torch.utils.data.distributed import DistributedSampler
from timm.data.distributed_sampler import OrderedDistributedSampler
for r in range(4):
    ds = DistributedSampler(list(range(10)), num_replicas=4, rank=r, shuffle=True, seed=42)
    ds.set_epoch(3)
    sched[f'dsampler.{r}'] = torch.tensor(list(iter(ds)))
    sched[f'osampler.{r}'] = torch.tensor(list(iter(OrderedDistributedSampler(list(range(10)), num_replicas=4, rank=r))))
# The same for several dataset sizes and world sizes, and timm's RepeatAugSampler (--aug-repeats).
from timm.data.distributed_sampler import RepeatAugSampler
for n in (1, 7, 10, 300, 515):
    for w in (2, 3, 4, 8):
        for r in range(w):
            ds = DistributedSampler(list(range(n)), num_replicas=w, rank=r, shuffle=True, seed=7)
            ds.set_epoch(5)
            sched[f'dsampler.{n}.{w}.{r}'] = torch.tensor(list(iter(ds)), dtype=torch.int64)
            sched[f'osampler.{n}.{w}.{r}'] = torch.tensor(
                list(iter(OrderedDistributedSampler(list(range(n)), num_replicas=w, rank=r))), dtype=torch.int64)
            for reps in (3, 2.5):
                ra = RepeatAugSampler(list(range(n)), num_replicas=w, rank=r, num_repeats=reps)
                ra.set_epoch(5)
                sched[f'rsampler.{n}.{w}.{r}.{reps}'] = torch.tensor(list(iter(ra)), dtype=torch.int64)
# timm's no-weight-decay parameter group of resnet18.
model = timm.create_model('resnet18', num_classes=10)
names = {id(p): k for k, p in model.named_parameters()}
groups = param_groups_weight_decay(model, 1e-4)
no_decay = sorted(names[id(p)] for grp in groups if grp['weight_decay'] == 0 for p in grp['params'])
vit = timm.create_model('vit_tiny_patch16_224', img_size=32)
vnames = {id(p): k for k, p in vit.named_parameters()}
no_decay_vit = sorted(vnames[id(p)] for grp in param_groups_weight_decay(vit, 1e-4, no_weight_decay_list=vit.no_weight_decay())
                      if grp['weight_decay'] == 0 for p in grp['params'])
# Label-smoothed cross entropy as timm computes it (LabelSmoothingCrossEntropy).
from timm.loss import LabelSmoothingCrossEntropy
logits = torch.randn(6, 10, generator=g)
target = torch.tensor([0, 1, 2, 3, 4, 9])
sched['ce.logits'] = logits
sched['ce.target'] = target
sched['ce.loss'] = LabelSmoothingCrossEntropy(0.1)(logits, target).reshape(1)
# timm's adapt_input_conv for a pretrained 3-channel first conv.
from timm.models._manipulate import adapt_input_conv
w3 = torch.randn(4, 3, 3, 3, generator=g)
sched['adapt.w3'] = w3
for c in (1, 2, 4, 7):
    sched[f'adapt.c{c}'] = adapt_input_conv(c, w3.clone()).contiguous()
# timm's resample_abs_pos_embed (ViT weights loaded at another image size).
from timm.layers import resample_abs_pos_embed
pe = torch.randn(1, 1 + 4 * 4, 8, generator=g)
sched['posemb.in'] = pe
for side in (6, 3, 2):
    sched[f'posemb.{side}'] = resample_abs_pos_embed(pe, [side, side], num_prefix_tokens=1).contiguous()
# Mixup targets and the losses train.py picks with mixup / --bce-loss.
from timm.data.mixup import mixup_target
from timm.loss import BinaryCrossEntropy, SoftTargetCrossEntropy
tgt = torch.tensor([0, 3, 9, 3, 5, 1])
sched['mix.target'] = tgt
sched['mix.batch'] = mixup_target(tgt, 10, lam=0.7, smoothing=0.1)
lam_elem = torch.tensor([[0.9], [0.2], [1.0], [0.5], [0.33], [0.75]])
sched['mix.lam_elem'] = lam_elem
sched['mix.elem'] = mixup_target(tgt, 10, lam=lam_elem, smoothing=0.1)
lg = torch.randn(6, 10, generator=g)
sched['loss.logits'] = lg
sched['loss.soft'] = SoftTargetCrossEntropy()(lg, sched['mix.batch']).reshape(1)
sched['loss.bce_idx'] = BinaryCrossEntropy(smoothing=0.1)(lg, tgt).reshape(1)
sched['loss.bce_dense_thresh'] = BinaryCrossEntropy(target_threshold=0.2)(lg, sched['mix.batch']).reshape(1)
sched['loss.bce_sum'] = BinaryCrossEntropy(smoothing=0.1, sum_classes=True)(lg, tgt).reshape(1)
save_file(sched, os.path.join(out, 'misc.safetensors'), metadata={'no_decay': json.dumps(no_decay),
                                                                 'no_decay_vit': json.dumps(no_decay_vit)})

# An offline Hugging Face hub cache holding timm-format resnet18 weights (random, 1000 classes).
snap = os.path.join(out, 'hub', 'models--timm--resnet18.a1_in1k', 'snapshots', '0123abcd')
os.makedirs(snap, exist_ok=True)
os.makedirs(os.path.join(out, 'hub', 'models--timm--resnet18.a1_in1k', 'refs'), exist_ok=True)
with open(os.path.join(out, 'hub', 'models--timm--resnet18.a1_in1k', 'refs', 'main'), 'w') as f:
    f.write('0123abcd')
torch.manual_seed(3)
hub_model = timm.create_model('resnet18')
save_file({k: v.contiguous() for k, v in hub_model.state_dict().items()}, os.path.join(snap, 'model.safetensors'))

# A file written by the reference safetensors library, with several dtypes.
save_file({'f32': torch.arange(6, dtype=torch.float32).reshape(2, 3),
           'f16': torch.arange(4, dtype=torch.float16),
           'bf16': torch.arange(4, dtype=torch.bfloat16),
           'i64': torch.arange(3, dtype=torch.int64) - 1,
           'u8': torch.arange(5, dtype=torch.uint8),
           'b': torch.tensor([True, False])},
          os.path.join(out, 'dtypes.safetensors'), metadata={'hello': 'world'})
print('wrote references to', out)
