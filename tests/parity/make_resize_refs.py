"""PIL's resize and timm's eval transform on the same inputs, for tests/parity/test_resize.cpp.

Writes <out>/resize_refs.safetensors:
  resize.<i>.src / resize.<i>.out   uint8 HWC (C = 3, or 1 for mode L) and Image.resize's result,
  resize.<i>.args                   int64 [filter id, out width, out height]
  l.src / l.out                     an RGB image and its convert('L')
and <out>/images/<name> (JPEG / PNG files of several sizes) with
  eval.<name>.<cfg>                 uint8 HWC: timm.data.create_transform(is_training=False,
                                    use_prefetcher=True) output for that file and config
  eval.cfg.<cfg>                    float64 [size, crop_pct, interpolation id, crop mode id, channels]
"""
import os
import sys

import numpy as np
import torch
from PIL import Image
from safetensors.torch import save_file
from timm.data import create_transform

FILTERS = ['nearest', 'box', 'bilinear', 'hamming', 'bicubic', 'lanczos']  # ids as in the C++ test
PIL_FILTER = {'nearest': Image.NEAREST, 'box': Image.BOX, 'bilinear': Image.BILINEAR, 'hamming': Image.HAMMING,
              'bicubic': Image.BICUBIC, 'lanczos': Image.LANCZOS}
MODES = ['center', 'squash', 'border']

out = sys.argv[1]
os.makedirs(os.path.join(out, 'images'), exist_ok=True)
rng = np.random.default_rng(0)
refs = {}


def photo(h, w, seed):
    """Smooth colour fields, edges and noise: what makes resampling filters differ."""
    r = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float64)
    img = np.zeros((h, w, 3))
    for c in range(3):
        fx, fy, ph = r.uniform(0.5, 6, 2).tolist() + [r.uniform(0, 6)]
        img[..., c] = 128 + 90 * np.sin(xx / w * fx * np.pi + ph) * np.cos(yy / h * fy * np.pi)
    for _ in range(6):  # hard-edged rectangles
        y0, x0 = r.integers(0, h), r.integers(0, w)
        img[y0:y0 + r.integers(1, h // 3 + 2), x0:x0 + r.integers(1, w // 3 + 2)] = r.integers(0, 256, 3)
    img += r.normal(0, 12, img.shape)
    return np.clip(img, 0, 255).astype(np.uint8)


def side(r):
    k = r.integers(0, 5)
    if k == 0:
        return int(r.integers(1, 4))  # 1..3 pixel sides
    if k == 1:
        return int(r.integers(4, 40))
    return int(r.integers(40, 400))


# Image.resize on random sizes, factors (up and down, large and odd) and every filter.
i = 0
for mode in ['RGB', 'L']:
    for fi, f in enumerate(FILTERS):
        for _ in range(14):
            h, w = side(rng), side(rng)
            if rng.random() < 0.25:  # strong downscale
                oh, ow = max(1, h // int(rng.integers(5, 40))), max(1, w // int(rng.integers(5, 40)))
            else:
                oh, ow = side(rng), side(rng)
            src = photo(h, w, i)
            im = Image.fromarray(src)
            if mode == 'L':
                im = im.convert('L')
            res = im.resize((ow, oh), PIL_FILTER[f])
            a = np.asarray(im)
            refs[f'resize.{i}.src'] = torch.from_numpy(a.reshape(h, w, -1).copy())
            refs[f'resize.{i}.out'] = torch.from_numpy(np.asarray(res).reshape(oh, ow, -1).copy())
            refs[f'resize.{i}.args'] = torch.tensor([fi, ow, oh], dtype=torch.int64)
            i += 1

rgb = photo(37, 53, 999)
refs['l.src'] = torch.from_numpy(rgb)
refs['l.out'] = torch.from_numpy(np.asarray(Image.fromarray(rgb).convert('L'))[..., None].copy())

# timm's eval transform on encoded files: landscape, portrait, square, upscaled, tiny, grayscale.
files = []
for name, (h, w), kind in [('land.jpg', (375, 500), 'jpg'), ('port.jpg', (500, 333), 'jpg'),
                           ('big.jpg', (683, 1024), 'jpg'), ('odd.png', (173, 231), 'png'),
                           ('small.jpg', (48, 64), 'jpg'), ('square.png', (300, 300), 'png'),
                           ('gray.jpg', (260, 390), 'gray')]:
    arr = photo(h, w, len(files) + 100)
    path = os.path.join(out, 'images', name)
    if kind == 'gray':
        Image.fromarray(arr).convert('L').save(path, quality=90)
    elif kind == 'jpg':
        Image.fromarray(arr).save(path, quality=90)
    else:
        Image.fromarray(arr).save(path)
    files.append(name)

configs = [  # (size, crop_pct, interpolation, crop_mode, channels): the zoo's defaults and the modes
    (224, 0.875, 'bilinear', 'center', 3),  # timm's default
    (224, 0.95, 'bicubic', 'center', 3),  # resnet50.a1_in1k, convnext_tiny
    (224, 0.9, 'bicubic', 'center', 3),  # vit_small_patch16_224
    (224, 0.875, 'bicubic', 'center', 3),  # efficientnet_b0
    (160, 1.0, 'lanczos', 'squash', 3),
    (192, 0.9, 'bicubic', 'border', 3),
    (128, 1.15, 'bilinear', 'center', 3),  # crop_pct > 1: torchvision pads
    (96, 0.875, 'hamming', 'center', 3),
    (64, 0.875, 'box', 'squash', 3),
    (80, 0.875, 'nearest', 'center', 3),
    (112, 0.875, 'bicubic', 'center', 1),  # in_chans 1: timm loads convert('L')
]
mean = (0.485, 0.456, 0.406)
for ci, (size, pct, interp, cmode, ch) in enumerate(configs):
    refs[f'eval.cfg.{ci}'] = torch.tensor([size, pct, FILTERS.index(interp), MODES.index(cmode), ch],
                                          dtype=torch.float64)
    t = create_transform(input_size=(ch, size, size), is_training=False, use_prefetcher=True,
                         interpolation=interp, crop_pct=pct, crop_mode=cmode, mean=mean[:ch] if ch == 3 else mean)
    for name in files:
        with Image.open(os.path.join(out, 'images', name)) as im:
            img = im.convert('RGB' if ch == 3 else 'L')
        x = t(img)  # uint8 CHW tensor
        if x.ndim == 2:
            x = x[None]
        refs[f'eval.{name}.{ci}'] = x.permute(1, 2, 0).contiguous()

save_file(refs, os.path.join(out, 'resize_refs.safetensors'))
print(f'wrote {len(refs)} references to {out}')
