"""Loads an imgtrain checkpoint into timm (strict) and writes timm's eval output for an input.
Usage: timm_forward.py CHECKPOINT MODEL NUM_CLASSES IN_CHANS INPUT.safetensors OUT.safetensors"""
import sys

import timm
import torch
from safetensors.torch import load_file, save_file

ckpt, name, num_classes, in_chans, inp, out = sys.argv[1:7]
sd = {k[len('model.'):]: v for k, v in load_file(ckpt).items() if k.startswith('model.')}
model = timm.create_model(name, num_classes=int(num_classes), in_chans=int(in_chans))
model.load_state_dict(sd, strict=True)
model.eval()
with torch.no_grad():
    y = model(load_file(inp)['x'])
save_file({'y': y}, out)
print('timm loaded', len(sd), 'tensors strictly')
