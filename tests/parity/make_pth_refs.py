"""torch.save files in every layout imgtrain reads, each beside the same tensors as safetensors.

Writes into <out> (test_pth.cpp reads them):
  resnet18_sd.pth             timm resnet18 state dict (seed 0, after one SGD step), as torch.save writes it
  resnet18.safetensors        its tensors; metadata 'keys': the state dict's order
  last.pth.tar                timm's CheckpointSaver file of that model: state_dict, state_dict_ema
                              (ModelEmaV3), optimizer (SGD with momentum, one real step), args
                              (argparse.Namespace), epoch, arch, metric, version, saver
  resnet18_ema.safetensors    the EMA's state dict; metadata: the checkpoint's arch, epoch, metric
  small.safetensors, small_ema.safetensors   a small conv net's state dict and its EMA's
  ddp.pth                     the small net's state dict through DataParallel ("module." names)
  small_legacy.pth            its plain state dict in the pre-1.6 (non-zip) format
  tv_ckpt.pth                 torchvision references' layout: model, model_ema (AveragedModel:
                              "module." names and n_averaged), optimizer, lr_scheduler, epoch, args
  tensors.pth, tensors_p4.pth, tensors_legacy.pth, tensors_legacy_p5.pth
                              every dtype, views (transposed, strided, a row at an offset, an
                              expanded one) sharing one storage, 0-dim and empty tensors: zip
                              (protocols 2 and 4) and legacy (protocols 2 and 5)
  tensors.safetensors         their tensors, contiguous; metadata 'keys': the dict's order
  resnet50_tv.pth             torchvision resnet50() state dict (seed 0, BN statistics randomised)
  resnet50_io.safetensors     an input and torchvision's eval output for it
  malicious.pth, malicious_legacy.pth   a __reduce__ to os.system('touch <out>/pwned')
"""
import argparse
import json
import os
import sys

import timm
import torch
import torchvision
from safetensors.torch import save_file
from timm.utils import CheckpointSaver, ModelEmaV3

out = sys.argv[1]
os.makedirs(out, exist_ok=True)
torch.set_num_threads(1)


def save_ref(tensors, name, **meta):
    save_file({k: v.detach().contiguous().clone() for k, v in tensors.items()}, os.path.join(out, name),
              metadata={'keys': json.dumps(list(tensors)), **meta})


# timm resnet18: one real SGD step with momentum, an EMA of it, then timm's own CheckpointSaver.
torch.manual_seed(0)
model = timm.create_model('resnet18')
ema = ModelEmaV3(model, decay=0.9)
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
model(torch.randn(2, 3, 32, 32)).logsumexp(1).mean().backward()
opt.step()
ema.update(model)
sd = model.state_dict()
torch.save(sd, os.path.join(out, 'resnet18_sd.pth'))
save_ref(sd, 'resnet18.safetensors')
args = argparse.Namespace(model='resnet18', num_classes=1000, in_chans=None, img_size=None, gp=None, lr=0.1,
                          momentum=0.9, sched='cosine', epochs=10, scale=[0.08, 1.0], ratio=[3 / 4, 4 / 3],
                          mean=None, amp=False, model_kwargs={}, device='cpu', seed=42)
saver = CheckpointSaver(model, opt, args=args, model_ema=ema, checkpoint_dir=out, recovery_dir=out, max_history=1)
saver.save_checkpoint(epoch=3, metric=71.5)  # writes last.pth.tar (and checkpoint-3 / model_best links)
save_ref(ema.module.state_dict(), 'resnet18_ema.safetensors', arch='resnet18', epoch='3', metric='71.5')

# A small net: DataParallel names, the legacy format, torchvision references' checkpoint.
torch.manual_seed(1)
small = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Flatten(),
                            torch.nn.Linear(4 * 6 * 6, 5))
small_opt = torch.optim.SGD(small.parameters(), lr=0.1, momentum=0.9)
small_sched = torch.optim.lr_scheduler.StepLR(small_opt, 30)
small_ema = torch.optim.swa_utils.AveragedModel(small, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9),
                                                use_buffers=True)
small(torch.randn(2, 3, 8, 8)).sum().backward()
small_opt.step()
small_ema.update_parameters(small)
save_ref(small.state_dict(), 'small.safetensors')
save_ref(small_ema.module.state_dict(), 'small_ema.safetensors')
torch.save(torch.nn.DataParallel(small).state_dict(), os.path.join(out, 'ddp.pth'))
torch.save(small.state_dict(), os.path.join(out, 'small_legacy.pth'), _use_new_zipfile_serialization=False)
torch.save({'model': small.state_dict(), 'optimizer': small_opt.state_dict(), 'lr_scheduler': small_sched.state_dict(),
            'epoch': 7, 'args': argparse.Namespace(model='small', lr=0.1, data_path='/data'),
            'model_ema': small_ema.state_dict()}, os.path.join(out, 'tv_ckpt.pth'))

# Every dtype, and views into one storage.
torch.manual_seed(2)
base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
tensors = {
    'f64': torch.randn(3, 4, dtype=torch.float64),
    'f32': torch.randn(2, 3),
    'f16': torch.randn(5).half(),
    'bf16': torch.randn(2, 3).bfloat16(),
    'i64': torch.tensor([-2**62, -1, 0, 2**62]),
    'i32': torch.tensor([-2**31, -1, 0, 2**31 - 1], dtype=torch.int32),
    'i16': torch.tensor([-2**15, 7, 2**15 - 1], dtype=torch.int16),
    'i8': torch.tensor([-128, -1, 0, 127], dtype=torch.int8),
    'u8': torch.arange(256).to(torch.uint8),
    'bool': torch.tensor([True, False, True, True]),
    'base': base,
    'transposed': base.t(),          # non-contiguous
    'row': base[2],                  # storage offset 12
    'strided': base[1::2, 1::3],     # offset 7, strides (12, 3)
    'expanded': base[0, :3].expand(2, 3),  # stride 0
    'scalar': torch.tensor(3.25),
    'empty': torch.zeros(0, 3),
}
for name, kw in [('tensors.pth', {}), ('tensors_p4.pth', {'pickle_protocol': 4}),
                 ('tensors_legacy.pth', {'_use_new_zipfile_serialization': False}),
                 ('tensors_legacy_p5.pth', {'_use_new_zipfile_serialization': False, 'pickle_protocol': 5})]:
    torch.save(tensors, os.path.join(out, name), **kw)
save_ref(tensors, 'tensors.safetensors')

# torchvision's resnet50 (the layout of the resnet50-*.pth files torchvision hosts).
torch.manual_seed(0)
r50 = torchvision.models.resnet50()
g = torch.Generator().manual_seed(5)
for m in r50.modules():  # random BN statistics, so that the eval output depends on every buffer
    if isinstance(m, torch.nn.BatchNorm2d):
        m.running_mean.copy_(torch.randn(m.running_mean.shape, generator=g) * 0.1)
        m.running_var.copy_(torch.rand(m.running_var.shape, generator=g) + 0.5)
torch.save(r50.state_dict(), os.path.join(out, 'resnet50_tv.pth'))
x = torch.randn(2, 3, 64, 64, generator=g)
with torch.no_grad():
    y = r50.eval()(x)
save_file({'x': x, 'y': y}, os.path.join(out, 'resnet50_io.safetensors'))

# A pickle that runs a shell command when Python's unpickler loads it.
marker = os.path.join(out, 'pwned')


class Evil:
    def __reduce__(self):
        return (os.system, (f'touch {marker}',))


torch.save({'w': torch.zeros(2), 'evil': Evil()}, os.path.join(out, 'malicious.pth'))
torch.save({'w': torch.zeros(2), 'evil': Evil()}, os.path.join(out, 'malicious_legacy.pth'),
           _use_new_zipfile_serialization=False)
if os.path.exists(marker):
    os.remove(marker)
