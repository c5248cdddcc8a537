"""The reference input pipeline for `imgtrain benchmark --bench data`: torchvision's ImageFolder +
DataLoader (PIL decode, RandomResizedCrop, RandomHorizontalFlip, uint8 collation) with the same
worker count, batch size and images; with --mode eval, for `--bench data-eval`: timm's eval
transform (Resize(floor(size / crop_pct)) + CenterCrop, PILToTensor), as validate.py runs it. Also writes the test images when asked (--make N): photo-like
content (smooth colour fields, shapes, texture noise), JPEG quality 90, about 500x375 as in ImageNet.
"""
import argparse, json, os, time

import numpy as np


def make_images(root, n, seed=0):
    from PIL import Image, ImageDraw, ImageFilter
    rng = np.random.default_rng(seed)
    for i in range(n):
        w, h = int(rng.integers(440, 560)), int(rng.integers(330, 420))
        if rng.random() < 0.3:
            w, h = h, w
        yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
        img = np.zeros((h, w, 3), np.float32)
        for _ in range(4):  # smooth colour blobs
            cx, cy, s = rng.uniform(0, w), rng.uniform(0, h), rng.uniform(60, 250)
            img += rng.uniform(0, 255, 3) * np.exp(-((xx - cx) ** 2 + (yy - cy) ** 2) / (2 * s * s))[..., None]
        img = img / max(img.max(), 1) * 200 + rng.normal(0, 12, (h, w, 3))  # texture noise
        pil = Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))
        d = ImageDraw.Draw(pil)
        for _ in range(6):
            x0, y0 = rng.uniform(0, w), rng.uniform(0, h)
            box = [x0, y0, x0 + rng.uniform(20, 150), y0 + rng.uniform(20, 150)]
            colour = tuple(int(c) for c in rng.integers(0, 255, 3))
            (d.ellipse if rng.random() < 0.5 else d.rectangle)(box, fill=colour)
        pil = pil.filter(ImageFilter.GaussianBlur(0.8))
        folder = os.path.join(root, 'train', f'class_{i % 10}')
        os.makedirs(folder, exist_ok=True)
        pil.save(os.path.join(folder, f'{i:06d}.jpg'), quality=90)


def main():
    p = argparse.ArgumentParser()
    p.add_argument('--data-dir', required=True)
    p.add_argument('--make', type=int, default=0, help='write this many test images first (if none are there)')
    p.add_argument('-j', '--workers', type=int, default=1)
    p.add_argument('-b', '--batch-size', type=int, default=64)
    p.add_argument('--img-size', type=int, default=224)
    p.add_argument('--num-warm-iter', type=int, default=2)
    p.add_argument('--num-bench-iter', type=int, default=20)
    p.add_argument('--mode', default='train', choices=['train', 'eval'])
    p.add_argument('--crop-pct', type=float, default=0.875)
    p.add_argument('--interpolation', default='bilinear')
    a = p.parse_args()
    if a.make and not os.path.isdir(os.path.join(a.data_dir, 'train')):
        make_images(a.data_dir, a.make)
        print(json.dumps({'made': a.make}))
        return
    import torch
    from torchvision import datasets, transforms
    torch.set_num_threads(1)
    if a.mode == 'eval':
        import math
        tf = transforms.Compose([
            transforms.Resize(math.floor(a.img_size / a.crop_pct),
                              interpolation=transforms.InterpolationMode(a.interpolation)),
            transforms.CenterCrop(a.img_size),
            transforms.PILToTensor(),
        ])
    else:
        tf = transforms.Compose([
            transforms.RandomResizedCrop(a.img_size, interpolation=transforms.InterpolationMode.BILINEAR),
            transforms.RandomHorizontalFlip(),
            transforms.PILToTensor(),
        ])
    ds = datasets.ImageFolder(os.path.join(a.data_dir, 'train'), transform=tf)
    dl = torch.utils.data.DataLoader(ds, batch_size=a.batch_size, shuffle=True, drop_last=True,
                                     num_workers=a.workers, persistent_workers=a.workers > 0)
    it = iter(dl)

    def nxt():
        nonlocal it
        try:
            return next(it)
        except StopIteration:
            it = iter(dl)
            return next(it)

    for _ in range(a.num_warm_iter):
        nxt()
    t0 = time.perf_counter()
    n = 0
    for _ in range(a.num_bench_iter):
        n += nxt()[0].shape[0]
    el = time.perf_counter() - t0
    print('--result')
    print(json.dumps({'data_samples_per_sec': round(n / el, 2),
                      'data_samples_per_sec_per_thread': round(n / el / max(1, a.workers), 2),
                      'workers': a.workers, 'images': len(ds)}, indent=4))


if __name__ == '__main__':
    main()
