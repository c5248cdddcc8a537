#!/usr/bin/env python3
"""Make a small, deterministic COCO-format instance-segmentation dataset from
real Fashion-MNIST pictures (no download; reads the local gzip IDX files).

Each canvas (width/height drawn within +-25% of --size) gets a dark background
(noise or a soft gradient) and 1-5 Fashion-MNIST items (train IDX for train2017,
t10k for val2017), each scaled 1-3x (bilinear), optionally tinted, pasted fully
inside the canvas.  Mask = scaled pixels > 40 minus what later items cover; an item
is placed elsewhere (up to 20 draws, else left out) where it would cover more than
--max-cover (default 25%) of an earlier item, so items overlap sometimes and none is
mostly hidden.  An item
is opaque inside its mask (colour x the picture's intensity), so what its mask hides
is hidden in the picture too; the faint rim below the threshold blends in.  Items
with < 30 visible pixels are dropped.  About half of the annotations carry polygons
(Moore-neighbour traced outer boundaries, checked with pycocotools to have IoU > 0.6
with the true mask, else RLE), the rest uncompressed RLE.  About 5% of images hold one iscrowd=1 region: a tight cluster of 3-4
small items of one class, annotated as a single RLE union mask.

Writes OUT_DIR/{train2017,val2017}/NNNNNNNNNNNN.png and
OUT_DIR/annotations/instances_{train2017,val2017}.json.  Same seed -> identical
bytes.  Usage:
  python scripts/make_fashion_coco.py OUT_DIR [--train N] [--val M] [--seed S]
         [--size W H] [--classes K] [--max-cover F]
"""
import argparse
import contextlib
import gzip
import io
import json
import os
import struct
import sys

import numpy as np
from PIL import Image
from pycocotools import mask as mask_utils
from pycocotools.coco import COCO

IDX_DIR = "/usr/share/datasets/fashion-mnist"
CLASS_NAMES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
               "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"]
THRESH = 40        # pixel value (of 255) above which an item pixel is "object"
MIN_VISIBLE = 30   # items with fewer visible pixels are dropped
MIN_COMPONENT = 6  # polygon components smaller than this are dropped
PLACE_TRIES = 20   # placements drawn for an item before it is left out (see --max-cover)
# 8 neighbours, clockwise on screen (y down), starting west: (dx, dy)
DIRS = [(-1, 0), (-1, -1), (0, -1), (1, -1), (1, 0), (1, 1), (0, 1), (-1, 1)]
DIR_INDEX = {d: i for i, d in enumerate(DIRS)}


def load_idx(kind):
    with gzip.open(os.path.join(IDX_DIR, f"{kind}-images-idx3-ubyte.gz")) as f:
        _, n, h, w = struct.unpack(">IIII", f.read(16))
        images = np.frombuffer(f.read(), np.uint8).reshape(n, h, w)
    with gzip.open(os.path.join(IDX_DIR, f"{kind}-labels-idx1-ubyte.gz")) as f:
        _, n2 = struct.unpack(">II", f.read(8))
        labels = np.frombuffer(f.read(), np.uint8)
    assert n == n2 == len(labels)
    return images, labels


def components(mask):
    """8-connected components of a bool mask -> list of lists of (y, x)."""
    seen = np.zeros_like(mask)
    h, w = mask.shape
    comps = []
    for y0, x0 in zip(*np.nonzero(mask)):  # raster order: first pixel is top-left-most
        if seen[y0, x0]:
            continue
        seen[y0, x0] = True
        stack, comp = [(y0, x0)], []
        while stack:
            y, x = stack.pop()
            comp.append((y, x))
            for dx, dy in DIRS:
                yy, xx = y + dy, x + dx
                if 0 <= yy < h and 0 <= xx < w and mask[yy, xx] and not seen[yy, xx]:
                    seen[yy, xx] = True
                    stack.append((yy, xx))
        comps.append((int(y0), int(x0), comp))
    return comps


def trace_outer(mask, y0, x0):
    """Moore-neighbour tracing (Jacob's stopping criterion) of the outer boundary
    of the component whose raster-first pixel is (y0, x0). Returns [(x, y)]."""
    h, w = mask.shape

    def fg(x, y):
        return 0 <= x < w and 0 <= y < h and mask[y, x]

    def step(cur, back):
        for k in range(1, 9):
            d = (back + k) % 8
            nx, ny = cur[0] + DIRS[d][0], cur[1] + DIRS[d][1]
            if fg(nx, ny):
                bx, by = DIRS[(d - 1) % 8]   # last background cell checked
                return (nx, ny), DIR_INDEX[(bx - DIRS[d][0], by - DIRS[d][1])]
        return None, None

    start = (x0, y0)
    first = step(start, 0)  # west of the raster-first pixel is background
    if first[0] is None:
        return [start]      # isolated pixel
    pts, state = [start], first
    for _ in range(8 * mask.size):
        pts.append(state[0])
        state = step(*state)
        if state == first:  # back in the state after the first move: closed
            return pts[:-1] if pts[-1] == start else pts
    raise AssertionError("contour tracing did not close")


def simplify(pts):
    """Drop vertices where the boundary goes straight on."""
    out, n = [], len(pts)
    for i in range(n):
        (ax, ay), (bx, by), (cx, cy) = pts[i - 1], pts[i], pts[(i + 1) % n]
        if (bx - ax, by - ay) != (cx - bx, cy - by):
            out.append((bx, by))
    return out


def outline(pts, d=0.5):
    """Move each vertex of a clockwise pixel-centre contour outward by d (mitred,
    miter capped at 2d; a 180-degree turn becomes two tip vertices), so the
    polygon follows the pixels' outer edges. Returns flat [x0, y0, x1, ...]."""
    out, n = [], len(pts)
    for i in range(n):
        a, b, c = (np.array(pts[j % n], float) for j in (i - 1, i, i + 1))
        t1, t2 = (b - a) / np.hypot(*(b - a)), (c - b) / np.hypot(*(c - b))
        n1, n2 = np.array([t1[1], -t1[0]]), np.array([t2[1], -t2[0]])  # outward (y down, cw)
        den = 1.0 + float(n1 @ n2)
        if den > 0.25:
            off = d * (n1 + n2) / den
            offs = [off * min(1.0, 2 * d / max(np.hypot(*off), 1e-9))]
        else:                                  # reversal: go round the tip
            offs = [d * (n1 + t1), d * (n2 + t1)]
        for o in offs:
            out += [round(float(b[0] + 0.5 + o[0]), 2), round(float(b[1] + 0.5 + o[1]), 2)]
    return out


def mask_to_polygons(mask):
    polys = []
    for y0, x0, comp in components(mask):
        if len(comp) < MIN_COMPONENT:
            continue
        pts = simplify(trace_outer(mask, y0, x0))
        if len(pts) >= 2:
            polys.append(outline(pts))
    return polys


def rle_uncompressed(mask):
    flat = mask.flatten(order="F").astype(np.int8)
    change = np.flatnonzero(np.diff(flat)) + 1
    bounds = np.concatenate([[0], change, [flat.size]])
    counts = np.diff(bounds).tolist()
    if flat[0]:
        counts = [0] + counts
    return {"counts": counts, "size": [int(mask.shape[0]), int(mask.shape[1])]}


def decode_polys(polys, h, w):
    return mask_utils.decode(mask_utils.merge(mask_utils.frPyObjects(polys, h, w))).astype(bool)


def background(rng, h, w):
    if rng.random() < 0.5:
        return rng.integers(0, 40, (h, w, 3)).astype(np.float32)
    c0, c1 = rng.integers(0, 60, 3), rng.integers(0, 60, 3)
    ang = rng.uniform(0, 2 * np.pi)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    t = xx * np.cos(ang) + yy * np.sin(ang)
    t = (t - t.min()) / max(float(t.max() - t.min()), 1.0)
    bg = c0 * (1 - t[..., None]) + c1 * t[..., None] + rng.normal(0, 4, (h, w, 3))
    return np.clip(bg, 0, 70).astype(np.float32)


def make_split(name, n, first_id, images, labels, rng, size, k, max_cover, out_dir):
    pool = np.flatnonzero(labels < k)
    by_class = [np.flatnonzero(labels == c) for c in range(k)]
    crowd_imgs = set(rng.choice(n, max(1, round(0.05 * n)), replace=False).tolist()) if n else set()
    img_dir = os.path.join(out_dir, name)
    os.makedirs(img_dir, exist_ok=True)
    coco_imgs, anns, n_crowd = [], [], 0
    for i in range(n):
        img_id = first_id + i
        w = int(round(size[0] * rng.uniform(0.75, 1.25)))
        h = int(round(size[1] * rng.uniform(0.75, 1.25)))
        canvas = background(rng, h, w)
        owner = np.full((h, w), -1, np.int32)
        # plan: list of (category, is_crowd, [(src_index, side_px, x, y)])
        plans, max_side = [], min(h, w)
        for _ in range(int(rng.integers(1, 6))):
            side = min(int(round(28 * rng.uniform(1.0, 3.0))), max_side)
            src = int(pool[rng.integers(len(pool))])
            plans.append((int(labels[src]), False,
                          [(src, side, int(rng.integers(0, w - side + 1)), int(rng.integers(0, h - side + 1)))]))
        if i in crowd_imgs:  # 3-4 small items of one class on a jittered 2x2 grid
            c, side = int(rng.integers(k)), min(int(round(28 * rng.uniform(0.9, 1.2))), max_side // 2)
            step = int(round(side * 0.75))
            cx = int(rng.integers(0, w - side - step + 1))
            cy = int(rng.integers(0, h - side - step + 1))
            parts = []
            for j in rng.permutation(4)[:int(rng.integers(3, 5))]:
                x = int(np.clip(cx + (j % 2) * step + rng.integers(-3, 4), 0, w - side))
                y = int(np.clip(cy + (j // 2) * step + rng.integers(-3, 4), 0, h - side))
                parts.append((int(by_class[c][rng.integers(len(by_class[c]))]), side, x, y))
            plans.insert(int(rng.integers(len(plans) + 1)), (c, True, parts))
        # Paint in plan order. A placement that would leave an earlier item (a crowd region: its
        # union) with less than 1 - max_cover of its pixels visible is drawn again, up to
        # PLACE_TRIES times, then the item is left out: items overlap sometimes, and no item is
        # mostly hidden (max_cover 1 places every item where it was first drawn).
        full, kept = [], []
        for cat, crowd, parts in plans:
            patches = [np.asarray(Image.fromarray(images[src]).resize((side, side), Image.BILINEAR))
                       for src, side, _, _ in parts]
            color = rng.integers(40, 256, 3) if rng.random() < 0.6 else np.array([255, 255, 255])
            color = color * (255.0 / color.max())  # bright tint: max channel 255
            oid = len(kept)
            for attempt in range(PLACE_TRIES):
                if attempt:  # move the item (a crowd region as a whole) somewhere else
                    x0 = min(x for _, _, x, _ in parts)
                    y0 = min(y for _, _, _, y in parts)
                    span_w = max(x + side for _, side, x, _ in parts) - x0
                    span_h = max(y + side for _, side, _, y in parts) - y0
                    dx = int(rng.integers(0, w - span_w + 1)) - x0
                    dy = int(rng.integers(0, h - span_h + 1)) - y0
                    parts = [(src, side, x + dx, y + dy) for src, side, x, y in parts]
                trial = owner.copy()
                for (src, side, x, y), patch in zip(parts, patches):
                    trial[y:y + side, x:x + side][patch > THRESH] = oid
                counts = np.bincount(trial[trial >= 0], minlength=oid + 1)
                if all(counts[j] >= (1.0 - max_cover) * full[j] for j in range(oid)):
                    break
            else:
                continue
            owner = trial
            full.append(int(counts[oid]))
            kept.append((cat, crowd, parts))
            for (src, side, x, y), patch in zip(parts, patches):
                shade = (patch.astype(np.float32) / 255.0)[..., None]
                # Opaque inside the item's mask (what lies below is hidden, as its mask says),
                # shaded by the picture's intensity; the faint rim outside the mask blends in.
                a = np.where(patch[..., None] > THRESH, np.float32(1.0), shade)
                region = canvas[y:y + side, x:x + side]
                canvas[y:y + side, x:x + side] = region * (1 - a) + color.astype(np.float32) * shade
        plans = kept
        visible = np.bincount(owner[owner >= 0], minlength=len(kept))
        assert all(visible[j] >= (1.0 - max_cover) * full[j] for j in range(len(kept))), "--max-cover broken"
        Image.fromarray(np.clip(np.rint(canvas), 0, 255).astype(np.uint8), "RGB").save(
            os.path.join(img_dir, f"{img_id:012d}.png"))
        coco_imgs.append({"id": img_id, "file_name": f"{img_id:012d}.png", "width": w, "height": h})
        for oid, (cat, crowd, _) in enumerate(plans):
            m = owner == oid
            area = int(m.sum())
            if area < MIN_VISIBLE:
                continue
            ys, xs = np.nonzero(m)
            bbox = [float(xs.min()), float(ys.min()),
                    float(xs.max() - xs.min() + 1), float(ys.max() - ys.min() + 1)]
            seg = None
            if not crowd and rng.random() < 0.5:
                polys = mask_to_polygons(m)
                if polys:
                    dec = decode_polys(polys, h, w)
                    iou = (dec & m).sum() / float((dec | m).sum())
                    if iou > 0.6:  # else (a thin, fragmented item) the exact RLE below
                        seg = polys
            if seg is None:
                seg = rle_uncompressed(m)
            anns.append({"id": len(anns) + 1, "image_id": img_id, "category_id": cat + 1,
                         "bbox": bbox, "area": area, "iscrowd": int(crowd), "segmentation": seg})
            n_crowd += int(crowd)
    return {"info": {"description": f"Fashion-MNIST COCO-style {name}", "version": "1.0",
                     "year": 2017, "contributor": "imgtrain scripts/make_fashion_coco.py"},
            "licenses": [{"id": 1, "name": "MIT (Fashion-MNIST)",
                          "url": "https://github.com/zalandoresearch/fashion-mnist"}],
            "images": coco_imgs, "annotations": anns,
            "categories": [{"id": c + 1, "name": CLASS_NAMES[c], "supercategory": "fashion"}
                           for c in range(k)]}, n_crowd


def validate(path):
    with contextlib.redirect_stdout(io.StringIO()):
        coco = COCO(path)
    for ann in coco.dataset["annotations"]:
        img = coco.imgs[ann["image_id"]]
        m = coco.annToMask(ann).astype(bool)
        assert m.shape == (img["height"], img["width"]), ann["id"]
        assert m.any(), f"empty mask for annotation {ann['id']}"
        if isinstance(ann["segmentation"], dict):
            assert int(m.sum()) == ann["area"], f"area mismatch for annotation {ann['id']}"
        x, y, bw, bh = (int(v) for v in ann["bbox"])
        inside = np.zeros_like(m)
        inside[y:y + bh, x:x + bw] = True
        assert not (m & ~inside).any(), f"mask outside bbox for annotation {ann['id']}"
    return len(coco.imgs), len(coco.anns)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--train", type=int, default=600)
    ap.add_argument("--val", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--size", type=int, nargs=2, default=[160, 128], metavar=("W", "H"))
    ap.add_argument("--classes", type=int, default=10, choices=range(1, 11))
    ap.add_argument("--max-cover", type=float, default=0.25,
                    help="the most of an item's pixels that later items may cover (default 0.25; "
                         "1 = no limit, the placement of datasets made before 2026-12-05)")
    args = ap.parse_args()
    assert min(args.size) >= 48, "--size too small"
    if not 0.0 <= args.max_cover <= 1.0:
        ap.error("--max-cover must be within [0, 1]")
    os.makedirs(os.path.join(args.out_dir, "annotations"), exist_ok=True)
    summary = []
    for si, (name, kind, n, first_id) in enumerate([("train2017", "train", args.train, 1),
                                                     ("val2017", "t10k", args.val, args.train + 1)]):
        images, labels = load_idx(kind)
        rng = np.random.default_rng([args.seed, si])
        data, n_crowd = make_split(name, n, first_id, images, labels, rng, args.size,
                                   args.classes, args.max_cover, args.out_dir)
        path = os.path.join(args.out_dir, "annotations", f"instances_{name}.json")
        with open(path, "w") as f:
            json.dump(data, f, separators=(",", ":"))
        n_img, n_ann = validate(path)
        summary.append(f"{name}: {n_img} images, {n_ann} annotations, {n_crowd} crowds")
    print("; ".join(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
