"""timm's eval output for imgtrain weights, loaded the way a user would load them.
Usage: timm_forward.py MODE FILE MODEL NUM_CLASSES IN_CHANS INPUT.safetensors OUT.safetensors
MODE checkpoint: strip "model." from an imgtrain checkpoint and load_state_dict(strict=True).
MODE export: timm.create_model(pretrained=True, pretrained_cfg_overlay=dict(file=FILE)) on an
`imgtrain export` file."""
import sys

import timm
import torch
from safetensors.torch import load_file, save_file

mode, path, name, num_classes, in_chans, inp, out = sys.argv[1:8]
num_classes, in_chans = int(num_classes), int(in_chans)
if mode == 'checkpoint':
    sd = {k[len('model.'):]: v for k, v in load_file(path).items() if k.startswith('model.')}
    model = timm.create_model(name, num_classes=num_classes, in_chans=in_chans)
    model.load_state_dict(sd, strict=True)
else:
    model = timm.create_model(name, pretrained=True, num_classes=num_classes, in_chans=in_chans,
                              pretrained_cfg_overlay=dict(file=path, num_classes=num_classes))
model.eval()
with torch.no_grad():
    y = model(load_file(inp)['x'])
save_file({'y': y}, out)
print('timm loaded', path)
