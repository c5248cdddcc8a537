"""Unusual image files and what PIL (timm's decoder, through .convert('RGB') / 'L') makes of them.

Writes <out>/<name>.<ext> and <out>/<name>.npy-like raw references as safetensors
(<out>/decode_refs.safetensors: one uint8 HWC tensor per file, PIL's decode).
"""
import io, os, struct, sys, zlib

import numpy as np
import torch
from PIL import Image
from safetensors.torch import save_file

out = sys.argv[1]
os.makedirs(out, exist_ok=True)
rng = np.random.default_rng(0)
h, w = 61, 83
yy, xx = np.mgrid[0:h, 0:w]
base = np.stack([(xx * 255 // w), (yy * 255 // h), ((xx + yy) * 2) % 256], -1).astype(np.uint8)
base = np.clip(base.astype(int) + rng.integers(-20, 20, base.shape), 0, 255).astype(np.uint8)
rgb = Image.fromarray(base)
refs = {}


def add(name, img, **save):
    path = os.path.join(out, name)
    img.save(path, **save)
    with Image.open(path) as im:  # timm: Image.open(f).convert('RGB'); L for grayscale files here
        ref = im.convert('L' if im.mode in ('L', 'I;16', 'I') and 'gray' in name else 'RGB')
        refs[name] = torch.from_numpy(np.asarray(ref).copy())


add('baseline.jpg', rgb, quality=90)
add('progressive.jpg', rgb, quality=90, progressive=True)
add('cmyk.jpg', rgb.convert('CMYK'), quality=95)
add('gray.jpg', rgb.convert('L'), quality=90)
exif = Image.Exif()
exif[0x0112] = 6  # orientation: rotate 90 CW when displayed; PIL's open() does not apply it
add('exif_rotated.jpg', rgb, quality=90, exif=exif)
rgba = rgb.convert('RGBA')
rgba.putalpha(Image.fromarray((base[..., 0] // 2).astype(np.uint8)))
add('alpha2.png', rgba)
add('palette.png', rgb.convert('P', palette=Image.ADAPTIVE, colors=64))
add('gray.png', rgb.convert('L'))
add('plain.bmp', rgb)
add('lossless.webp', rgb, lossless=True)
# GIF: the first of two frames, PIL's convert('RGB').
frames = [rgb.convert('P', palette=Image.ADAPTIVE, colors=128), rgb.rotate(90).convert('P', palette=Image.ADAPTIVE)]
add('frames.gif', frames[0], save_all=True, append_images=frames[1:], duration=100)
# 16-bit grayscale PNG: PIL's convert('L') of mode I;16 clips at 255 instead of scaling, so the
# reference here is the 16-bit data itself (its top byte, rounded: v / 257).
g16 = (base[..., 0].astype(np.uint16) * 257 + rng.integers(0, 257, (h, w))).astype(np.uint16)
Image.fromarray(g16).save(os.path.join(out, 'gray16.png'))
refs['gray16.png'] = torch.from_numpy(np.round(g16 / 257.0).astype(np.uint8))
# 16-bit RGB PNG (written by hand: PIL does not write one): PIL opens it as RGB, each sample's high
# byte, and that is the reference.
rgb16 = (base.astype(np.uint16) * 256 + rng.integers(0, 256, base.shape)).astype('>u2')
rows = b''.join(b'\x00' + rgb16[y].tobytes() for y in range(h))
def chunk(kind, payload):
    return struct.pack('>I', len(payload)) + kind + payload + struct.pack('>I', zlib.crc32(kind + payload) & 0xffffffff)
with open(os.path.join(out, 'rgb16.png'), 'wb') as f:
    f.write(b'\x89PNG\r\n\x1a\n' + chunk(b'IHDR', struct.pack('>IIBBBBB', w, h, 16, 2, 0, 0, 0)) +
            chunk(b'IDAT', zlib.compress(rows)) + chunk(b'IEND', b''))
with Image.open(os.path.join(out, 'rgb16.png')) as im:
    assert im.mode == 'RGB', im.mode
    refs['rgb16.png'] = torch.from_numpy(np.asarray(im.convert('RGB')).copy())
save_file(refs, os.path.join(out, 'decode_refs.safetensors'))

# An ImageFolder split with the names that order differently by bytes and by timm's natural_key
# (digit runs, case, a class name that is a prefix of another), files of extensions timm does not
# read, a class folder holding only such files, and an empty folder: timm's own scan of it is the
# reference (folder_refs.txt: the classes in index order, then each sample's path and target).
from timm.data.readers.reader_image_folder import find_images_and_targets

split = os.path.join(out, 'folder', 'train')
tiny = Image.fromarray(base[:4, :4])
for rel in ['class10/img10.png', 'class10/img9.jpg', 'class10/IMG2.JPEG', 'class2/b.png', 'Class1/a.PNG',
            'a01b/x.jpg', 'a1/y.jpg', 'a1 b/z.png', 'cat/1.png', 'cat2/2.png', 'zeta/keep.png',
            'zeta/skip.webp', 'zeta/skip.bmp', 'zeta/skip.gif', 'onlywebp/w.webp']:
    path = os.path.join(split, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fmt = {'.png': 'PNG', '.jpg': 'JPEG', '.jpeg': 'JPEG', '.webp': 'WEBP', '.bmp': 'BMP', '.gif': 'GIF'}
    tiny.save(path, format=fmt[os.path.splitext(rel)[1].lower()])
os.makedirs(os.path.join(split, 'empty'), exist_ok=True)
samples, class_to_idx = find_images_and_targets(split)
with open(os.path.join(out, 'folder_refs.txt'), 'w') as f:
    f.write('\t'.join(sorted(class_to_idx, key=class_to_idx.get)) + '\n')
    for path, target in samples:
        f.write(f'{os.path.relpath(path, split)}\t{target}\n')
