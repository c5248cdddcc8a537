"""Writes references for tests/parity/test_augment.cpp with timm, PIL and torchvision.

usage: make_aug_refs.py OUT_DIR

OUT_DIR/aug_policies.json  how timm decodes --aa strings (ops, layers, weights, AugMix settings,
                           the hparams create_transform passes), or the error it raises; and the
                           level_fn arguments of every op at a sweep of magnitudes, with the
                           random sign forced either way.
OUT_DIR/aug_images.json    the pixel cases: input, op, arguments, output file.
OUT_DIR/*.png, *.bin       the synthetic inputs and PIL's outputs (PNG to look at, .bin = raw
                           HWC uint8 for the test, which then needs no image codec).
"""
import json
import math
import os
import sys

import numpy as np
from PIL import Image

import timm
from timm.data import auto_augment as aa
from timm.data import create_transform
from timm.data.constants import IMAGENET_DEFAULT_MEAN
import torchvision.transforms.functional as TF

POLICY_STRINGS = [
    'rand-m9-mstd0.5-inc1', 'rand-m7-n3-mstd0.5', 'rand-m9-mstd0.5-inc1-mmax12', 'rand-m10-w0',
    'v0', 'v0r', 'original', 'originalr', '3a', 'augmix-m5-w3', 'augmix-m3-w2-d2-a0.5',
    # the other corners of timm's parser
    'rand-m9-n3-mstd101', 'rand-m9-tweights', 'rand-m9-t3a', 'rand-m9-t3aw-inc1', 'rand-m9-p0.3',
    'rand-m9-mstd0.5-mstd1.0', 'rand-m9-m5', 'rand-m9-foo', 'rand-m9-tfoo-inc1', 'rand-mmax0-m12',
    'rand-m1_0-p1e-1', 'rand-m1_0-p1e0', 'rand-n0', 'original-mstd0.5', '3a-mstd1', 'v0-foo',
    'augmix-m5-w3-b1', 'augmix-m5-mstd0.3', 'augmix-m5-mstd0.3-mstd0.9',
    # rejected by timm
    'autoaug-v0', 'v1', 'rand-q3', 'rand-m9x', 'rand-m-1', 'randaug-m9', 'augmix-z2', 'augmixfoo',
    'v0-mstdx1', 'rand-m9.5',
]
# --train-interpolation other than 'random' reaches the ops as a fixed filter.
INTERP_CASES = {'rand-m9-mstd0.5-inc1': 'bicubic', 'augmix-m5-w3': 'bilinear'}

MAGNITUDES = list(range(11)) + [0.5, 2.5, 4.99, 7.3, 12, 15, 20, 30]
IMG_SIZE = 224


def num(v):
    """JSON has no infinity."""
    if isinstance(v, float) and math.isinf(v):
        return 'inf' if v > 0 else '-inf'
    return v


def op_json(op):
    return dict(name=op.name, prob=float(op.prob), magnitude=num(float(op.magnitude)),
                magnitude_std=num(float(op.magnitude_std)),
                magnitude_max=None if op.magnitude_max is None else int(op.magnitude_max))


def interp_name(v):
    if v is None:
        return None
    return {Image.Resampling.NEAREST: 'nearest', Image.Resampling.BILINEAR: 'bilinear',
            Image.Resampling.BICUBIC: 'bicubic'}[v]


def decode(s, interpolation):
    try:
        tf = create_transform(IMG_SIZE, is_training=True, auto_augment=s, interpolation=interpolation,
                              mean=IMAGENET_DEFAULT_MEAN)
    except Exception as e:  # timm asserts, int()/float() raise
        return dict(error=f'{type(e).__name__}: {e}')
    t = [x for x in tf.transforms if isinstance(x, (aa.RandAugment, aa.AutoAugment, aa.AugMixAugment))]
    assert len(t) == 1, tf
    t = t[0]
    first = t.policy[0][0] if isinstance(t, aa.AutoAugment) else t.ops[0]
    hp = first.hparams
    out = dict(hparams=dict(translate_const=hp['translate_const'], translate_pct=hp.get('translate_pct', 0.45),
                            img_mean=list(hp['img_mean']), interpolation=interp_name(hp.get('interpolation'))))
    if isinstance(t, aa.RandAugment):
        out.update(kind='rand', ops=[op_json(o) for o in t.ops], num_layers=t.num_layers,
                   choice_weights=None if t.choice_weights is None else [float(w) for w in t.choice_weights])
    elif isinstance(t, aa.AutoAugment):
        out.update(kind='auto', sub_policies=[[op_json(o) for o in sp] for sp in t.policy])
    else:
        out.update(kind='augmix', ops=[op_json(o) for o in t.ops], width=t.width, depth=t.depth,
                   alpha=float(t.alpha), blended=bool(t.blended))
    return out


def level_args(hparams):
    real_negate = aa._randomly_negate
    res = {}
    try:
        for name, fn in aa.LEVEL_TO_ARG.items():
            entry = dict(magnitudes=MAGNITUDES, args=[], args_neg=[])
            for key, sign in (('args', lambda v: v), ('args_neg', lambda v: -v)):
                aa._randomly_negate = sign  # the level functions look it up at call time
                for m in MAGNITUDES:
                    entry[key].append([] if fn is None else [float(x) for x in fn(m, hparams)])
            res[name] = entry
    finally:
        aa._randomly_negate = real_negate
    return res


def synthetic_rgb(h=80, w=96, seed=1234):
    """Photo-like: smooth gradients, a few shapes, noise; channels never span all of 0..255."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float64)
    r = 40 + 150 * xx / (w - 1) + 20 * np.sin(yy / 7.0)
    g = 60 + 120 * yy / (h - 1) + 15 * np.cos(xx / 9.0)
    b = 90 + 60 * np.sin((xx + yy) / 15.0)
    img = np.stack([r, g, b], -1)
    disk = (xx - 30) ** 2 + (yy - 28) ** 2 < 14 ** 2
    img[disk] = [205, 45, 60]
    rect = (xx > 55) & (xx < 85) & (yy > 45) & (yy < 70)
    img[rect] = [35, 175, 95]
    tri = (yy > 50) & (xx < 30) & (xx > yy - 50)
    img[tri] = img[tri] * 0.5 + np.array([20, 20, 160]) * 0.5
    img += rng.normal(0, 6, img.shape)
    return np.clip(np.round(img), 12, 238).astype(np.uint8)


def synthetic_gray(h=72, w=64, seed=99):
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float64)
    img = 70 + 90 * (xx + yy) / (h + w) + 25 * np.sin(xx / 5.0) * np.cos(yy / 8.0)
    img[(xx - 40) ** 2 + (yy - 20) ** 2 < 100] = 200
    img += rng.normal(0, 5, img.shape)
    return np.clip(np.round(img), 20, 230).astype(np.uint8)


NEAREST, BILINEAR, BICUBIC = Image.Resampling.NEAREST, Image.Resampling.BILINEAR, Image.Resampling.BICUBIC
FILL = (124, 116, 104)


def image_cases():
    """(name, input, op, args, interp, fill, fn) with fn running timm's op function on a PIL image."""
    cases = []

    def add(name, inp, op, args, fn, interp=None, fill=None):
        cases.append((name, inp, op, args, interp, fill, fn))

    for inp in ('rgb', 'gray'):
        add(f'{inp}_autocontrast', inp, 'autocontrast', [], aa.auto_contrast)
        add(f'{inp}_equalize', inp, 'equalize', [], aa.equalize)
        add(f'{inp}_invert', inp, 'invert', [], aa.invert)
        for bits in (1, 4, 7):
            add(f'{inp}_posterize{bits}', inp, 'posterize', [bits], lambda im, b=bits: aa.posterize(im, b))
        for t in (0, 128, 200, 256):
            add(f'{inp}_solarize{t}', inp, 'solarize', [t], lambda im, t=t: aa.solarize(im, t))
        for add_, t in ((40, 128), (110, 128), (30, 200)):
            add(f'{inp}_solarize_add{add_}_{t}', inp, 'solarize_add', [add_, t],
                lambda im, a=add_, t=t: aa.solarize_add(im, a, thresh=t))
        for op, fn in (('color', aa.color), ('contrast', aa.contrast), ('brightness', aa.brightness),
                       ('sharpness', aa.sharpness)):
            for f in (0.0, 0.3, 1.0, 1.7, 2.5):
                add(f'{inp}_{op}{f}', inp, op, [f], lambda im, fn=fn, f=f: fn(im, f))
        for r in (0.4, 1.5, 4.0):
            add(f'{inp}_gaussian_blur{r}', inp, 'gaussian_blur', [r], lambda im, r=r: aa.gaussian_blur(im, r))
        add(f'{inp}_desaturate0.6', inp, 'desaturate', [0.6], lambda im: aa.desaturate(im, 0.6))

    geo = [('rotate', [30.0], aa.rotate), ('rotate', [-17.5], aa.rotate), ('rotate', [90.0], aa.rotate),
           ('rotate', [180.0], aa.rotate), ('rotate', [400.0], aa.rotate),
           ('shear_x', [0.3], aa.shear_x), ('shear_y', [-0.2], aa.shear_y),
           ('translate_x', [10.0], aa.translate_x_abs), ('translate_y', [-7.0], aa.translate_y_abs),
           ('translate_x', [12.48], aa.translate_x_abs), ('translate_y', [3.7], aa.translate_y_abs),
           ('translate_x_rel', [0.13], aa.translate_x_rel), ('translate_y_rel', [-0.1], aa.translate_y_rel)]
    for inp, fill in (('rgb', FILL), ('gray', 124)):
        for op, args, fn in geo:
            for interp, iname in ((NEAREST, 'nearest'), (BILINEAR, 'bilinear'), (BICUBIC, 'bicubic')):
                if inp == 'gray' and op not in ('rotate', 'shear_x'):
                    continue
                add(f'{inp}_{op}{args[0]}_{iname}', inp, op, args,
                    lambda im, fn=fn, a=args[0], i=interp, f=fill: fn(im, a, resample=i, fillcolor=f),
                    interp=iname, fill=[fill] * 3 if isinstance(fill, int) else list(fill))
    return cases


def save(out_dir, name, arr):
    Image.fromarray(arr).save(os.path.join(out_dir, name + '.png'))
    arr = np.ascontiguousarray(arr)
    arr.tofile(os.path.join(out_dir, name + '.bin'))
    return dict(file=name + '.bin', height=arr.shape[0], width=arr.shape[1],
                channels=1 if arr.ndim == 2 else arr.shape[2])


def main():
    out_dir = sys.argv[1]
    os.makedirs(out_dir, exist_ok=True)

    policies = {s: decode(s, 'random') for s in POLICY_STRINGS}
    interp_policies = {s: decode(s, i) for s, i in INTERP_CASES.items()}
    factory_hp = dict(translate_const=int(IMG_SIZE * 0.45), translate_pct=0.3)
    refs = dict(timm=timm.__version__, img_size=IMG_SIZE, mean=list(IMAGENET_DEFAULT_MEAN),
                policies=policies, interp_policies=[dict(config=s, interpolation=i, **interp_policies[s])
                                                    for s, i in INTERP_CASES.items()],
                level_args=dict(default=dict(hparams=dict(translate_const=250, translate_pct=0.45),
                                             ops=level_args(aa._HPARAMS_DEFAULT)),
                                factory=dict(hparams=factory_hp, ops=level_args(factory_hp))))
    with open(os.path.join(out_dir, 'aug_policies.json'), 'w') as f:
        json.dump(refs, f, indent=1)

    inputs = dict(rgb=synthetic_rgb(), gray=synthetic_gray())
    manifest = dict(inputs={k: save(out_dir, 'input_' + k, v) for k, v in inputs.items()}, cases=[])
    for name, inp, op, args, interp, fill, fn in image_cases():
        out = np.asarray(fn(Image.fromarray(inputs[inp])))
        manifest['cases'].append(dict(name=name, input=inp, op=op, args=args, interp=interp, fill=fill,
                                      **save(out_dir, name, out)))

    # AugMix's mixing step on fixed chains and weights (timm's _apply_basic, minus its draws).
    img = Image.fromarray(inputs['rgb'])
    chains = [aa.rotate(img, 10.0, resample=NEAREST, fillcolor=FILL), aa.equalize(img), aa.solarize(img, 128)]
    ws = np.float32([0.2, 0.5, 0.3])
    m = np.float32(0.6)
    mixed = np.zeros_like(inputs['rgb'], dtype=np.float32)
    for mw, c in zip(ws, chains):
        mixed += mw * np.asarray(c, dtype=np.float32)
    np.clip(mixed, 0, 255., out=mixed)
    out = np.asarray(Image.blend(img, Image.fromarray(mixed.astype(np.uint8)), m))
    manifest['augmix'] = dict(weights=[float(w) for w in ws], m=float(m), **save(out_dir, 'augmix_mix', out))

    # ColorJitter with drawn values fixed: contrast 1.25, then brightness 0.8, then saturation 1.3.
    j = TF.adjust_saturation(TF.adjust_brightness(TF.adjust_contrast(img, 1.25), 0.8), 1.3)
    manifest['color_jitter'] = dict(order=[1, 0, 2], brightness=0.8, contrast=1.25, saturation=1.3,
                                    **save(out_dir, 'color_jitter', np.asarray(j)))

    with open(os.path.join(out_dir, 'aug_images.json'), 'w') as f:
        json.dump(manifest, f, indent=1)
    print(f'wrote {len(manifest["cases"])} image cases and {len(policies)} policies to {out_dir}')


if __name__ == '__main__':
    main()
