"""COCO RLE mask references from pycocotools.mask (test_coco_mask.cpp checks imgtrain::coco against them).

Writes <out>/coco_mask_refs.json: a fixed-seed set of masks, polygons, boxes and IoU sets with what
pycocotools makes of them. Masks are '0'/'1' strings in column-major order; IoU values are
float.hex() strings so they round-trip exactly.
"""
import json, os, sys

import numpy as np
import pycocotools._mask as _mask
import pycocotools.mask as mask_util

out = sys.argv[1]
os.makedirs(out, exist_ok=True)
rng = np.random.default_rng(20240611)


def counts_of(m):
    """Uncompressed counts in numpy (column-major runs starting with zeros), checked below
    against pycocotools' own string."""
    flat = np.asfortranarray(m).reshape(-1, order='F').astype(np.int64)
    if flat.size == 0:
        return [0]
    bounds = np.concatenate([[0], np.flatnonzero(np.diff(flat)) + 1, [flat.size]])
    counts = [int(v) for v in np.diff(bounds)]
    return [0] + counts if flat[0] else counts


def mask_str(m):
    return ''.join('1' if v else '0' for v in np.asfortranarray(m).reshape(-1, order='F'))


def s(rle):
    c = rle['counts']
    return c.decode() if isinstance(c, bytes) else c


def rle_obj(string, h, w):
    return {'size': [h, w], 'counts': string.encode()}


def random_mask(h, w, kind):
    if kind == 'zero':
        return np.zeros((h, w), np.uint8)
    if kind == 'one':
        return np.ones((h, w), np.uint8)
    if kind == 'noise':
        return (rng.random((h, w)) < rng.uniform(0.05, 0.95)).astype(np.uint8)
    # blobs: a few rectangles and discs
    m = np.zeros((h, w), np.uint8)
    yy, xx = np.mgrid[0:h, 0:w]
    for _ in range(rng.integers(1, 4)):
        if rng.random() < 0.5:
            y0, x0 = rng.integers(0, h), rng.integers(0, w)
            m[y0:y0 + rng.integers(1, h + 1), x0:x0 + rng.integers(1, w + 1)] = 1
        else:
            cy, cx, r = rng.uniform(0, h), rng.uniform(0, w), rng.uniform(0.5, max(h, w) / 2 + 0.5)
            m[(yy - cy) ** 2 + (xx - cx) ** 2 < r * r] = 1
    return m


refs = {}

# ---- encode / decode / area / toBbox ----
enc = []
shapes = [(1, 1), (1, 17), (23, 1), (1, 1), (2, 2), (5, 7), (64, 80), (200, 300), (7, 5)]
shapes += [(int(rng.integers(1, 50)), int(rng.integers(1, 50))) for _ in range(30)]
kinds = ['zero', 'one', 'noise', 'blob']
for i, (h, w) in enumerate(shapes):
    for kind in (kinds if i < 9 else [kinds[i % 4]]):
        m = random_mask(h, w, kind)
        r = mask_util.encode(np.asfortranarray(m))
        counts = counts_of(m)
        assert s(_mask.frUncompressedRLE([{'counts': counts, 'size': [h, w]}], h, w)[0]) == s(r)
        dec = mask_util.decode(r)
        assert (dec == m).all()
        enc.append({'h': h, 'w': w, 'mask': mask_str(m), 'counts': counts, 'string': s(r),
                    'area': int(mask_util.area(r)), 'bbox': [float(v) for v in mask_util.toBbox(r)]})
refs['encode'] = enc

# ---- uncompressed counts, incl. non-canonical ones (zero-length runs, no foreground) ----
cc = []
for h, w, counts in [(3, 4, [12, 0, 0]), (3, 4, [5, 0, 7]), (3, 4, [2, 5, 5]), (3, 4, [0, 12]),
                     (3, 4, [12]), (3, 4, [0, 0, 12]), (3, 4, [4, 0, 0, 3, 5]), (3, 4, [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]),
                     (4, 3, [3, 3, 3, 3]), (4, 3, [11, 1]), (1, 5, [0, 5]), (5, 1, [2, 1, 2]),
                     (6, 6, [2, 20, 0, 0, 14]), (40, 40, [100, 1000, 500])]:
    r = _mask.frUncompressedRLE([{'counts': counts, 'size': [h, w]}], h, w)[0]
    cc.append({'h': h, 'w': w, 'counts': counts, 'string': s(r), 'area': int(mask_util.area(r)),
               'bbox': [float(v) for v in mask_util.toBbox(r)]})
refs['counts'] = cc

# ---- merge ----
merges = []
for i in range(40):
    h, w = int(rng.integers(1, 40)), int(rng.integers(1, 40))
    n = 1 + i % 4
    ms = [random_mask(h, w, kinds[int(rng.integers(0, 4))] if i % 5 else 'blob') for _ in range(n)]
    rs = [mask_util.encode(np.asfortranarray(m)) for m in ms]
    u, x = mask_util.merge(rs, intersect=False), mask_util.merge(rs, intersect=True)
    merges.append({'h': h, 'w': w, 'inputs': [s(r) for r in rs], 'union': s(u), 'intersect': s(x)})
refs['merge'] = merges

# ---- frBbox ----
boxes = []
for i in range(40):
    h, w = int(rng.integers(1, 60)), int(rng.integers(1, 60))
    if i % 4 == 0:
        bb = list(rng.integers(-10, 70, 4).astype(float))
    elif i % 4 == 1:
        bb = list(np.round(rng.uniform(-10, 70, 4) * 2) / 2)  # .5 steps
    else:
        bb = list(rng.uniform(-10, 70, 4))
    boxes.append([h, w, [float(v) for v in bb]])
boxes += [[10, 10, [0.0, 0.0, 10.0, 10.0]], [10, 10, [0.0, 0.0, 0.0, 0.0]], [10, 10, [3.0, 3.0, 0.0, 5.0]],
          [10, 10, [-5.0, -5.0, 3.0, 3.0]], [10, 10, [20.0, 2.0, 5.0, 5.0]], [10, 10, [2.5, 2.5, 4.5, 4.5]],
          [10, 10, [0.1, 0.1, 0.1, 0.1]], [10, 10, [2.0, 3.0, -2.0, -3.0]], [480, 640, [-1e5, -1e5, 3e5, 3e5]],
          [7, 9, [0.3, 0.7, 8.4, 6.2]]]
fb = []
for h, w, bb in boxes:
    r = mask_util.frPyObjects(np.array([bb], dtype=np.double), h, w)[0]
    fb.append({'h': h, 'w': w, 'bbox': bb, 'string': s(r)})
refs['frbbox'] = fb

# ---- polygons ----
def poly_case(name, h, w, polys):
    singles = [s(_mask.frPoly([np.array(p, dtype=np.double)], h, w)[0]) for p in polys]
    case = {'name': name, 'h': h, 'w': w, 'polys': [[float(v) for v in p] for p in polys], 'strings': singles}
    if len(polys[0]) > 4:  # what COCO.annToRLE does; frPyObjects refuses shorter first polygons
        rs = mask_util.frPyObjects(polys, h, w)
        assert [s(r) for r in rs] == singles
        case['merged'] = s(mask_util.merge(rs))
    return case


def rand_poly(n, lo_x, hi_x, lo_y, hi_y, step=None):
    x, y = rng.uniform(lo_x, hi_x, n), rng.uniform(lo_y, hi_y, n)
    if step:
        x, y = np.round(x / step) * step, np.round(y / step) * step
    return list(np.stack([x, y], 1).reshape(-1))


def star(n, cx, cy, r0, r1):
    a = np.linspace(0, 2 * np.pi, n, endpoint=False)
    r = np.where(np.arange(n) % 2 == 0, r0, r1)
    return list(np.stack([cx + r * np.cos(a), cy + r * np.sin(a)], 1).reshape(-1))


polys = []
for i in range(30):  # random point sets: mostly self-intersecting
    h, w = int(rng.integers(1, 60)), int(rng.integers(1, 60))
    polys.append(poly_case('random', h, w, [rand_poly(int(rng.integers(3, 12)), -2, w + 2, -2, h + 2)]))
for i in range(15):  # half-pixel grid: exactly on the rounding ties
    h, w = int(rng.integers(2, 40)), int(rng.integers(2, 40))
    polys.append(poly_case('half', h, w, [rand_poly(int(rng.integers(3, 8)), -1, w + 1, -1, h + 1, 0.5)]))
for i in range(10):  # tenth-pixel grid (5x upsampling lands on .5 ties)
    h, w = int(rng.integers(2, 40)), int(rng.integers(2, 40))
    polys.append(poly_case('tenth', h, w, [rand_poly(int(rng.integers(3, 8)), -1, w + 1, -1, h + 1, 0.1)]))
for i in range(10):  # integer vertices, often on the border
    h, w = int(rng.integers(2, 30)), int(rng.integers(2, 30))
    polys.append(poly_case('integer', h, w, [rand_poly(int(rng.integers(3, 8)), 0, w, 0, h, 1.0)]))
polys += [
    poly_case('triangle', 10, 12, [[1.0, 1.0, 8.0, 2.0, 4.0, 9.0]]),
    poly_case('border', 10, 12, [[0.0, 0.0, 12.0, 0.0, 12.0, 10.0, 0.0, 10.0]]),
    poly_case('border_inner', 10, 12, [[0.0, 0.0, 11.0, 0.0, 11.0, 9.0, 0.0, 9.0]]),
    poly_case('touch_left', 10, 12, [[0.0, 2.0, 5.0, 5.0, 0.0, 8.0]]),
    poly_case('partly_outside', 10, 12, [[-5.0, -3.0, 8.0, 4.0, 20.0, 15.0, 2.0, 30.0]]),
    poly_case('outside_right', 10, 12, [[15.0, 1.0, 20.0, 1.0, 18.0, 8.0]]),
    poly_case('outside_left', 10, 12, [[-9.0, 1.0, -2.0, 1.0, -4.0, 8.0]]),
    poly_case('outside_below', 10, 12, [[1.0, 12.0, 8.0, 12.0, 4.0, 20.0]]),
    poly_case('outside_above', 10, 12, [[1.0, -12.0, 8.0, -12.0, 4.0, -2.0]]),
    poly_case('around', 10, 12, [[-100.0, -100.0, 100.0, -100.0, 100.0, 100.0, -100.0, 100.0]]),
    poly_case('huge', 30, 40, [[-2e5, -1e5, 3e5, 5.0, 10.0, 2e5]]),
    poly_case('huge2', 480, 640, [[-9e5, 100.5, 320.0, -7e5, 9.5e5, 240.25, 300.0, 8e5]]),
    poly_case('huge_thin', 30, 40, [[-1e6, 10.0, 1e6, 12.0, 1e6, 13.0]]),
    poly_case('negative_frac', 10, 12, [[-0.1, -0.3, 5.0, -0.15, 4.0, 6.0, -0.7, 4.0]]),
    poly_case('repeated_vertex', 10, 12, [[2.0, 2.0, 2.0, 2.0, 8.0, 3.0, 5.0, 8.0]]),
    poly_case('repeated_vertex2', 10, 12, [[2.0, 2.0, 8.0, 3.0, 8.0, 3.0, 5.0, 8.0, 5.0, 8.0]]),
    poly_case('collinear', 10, 12, [[1.0, 1.0, 5.0, 5.0, 9.0, 9.0]]),
    poly_case('bowtie', 10, 12, [[1.0, 1.0, 10.0, 8.0, 10.0, 1.0, 1.0, 8.0]]),
    poly_case('star', 50, 60, [star(40, 30.3, 24.7, 22.0, 8.0)]),
    poly_case('circle', 64, 64, [star(300, 31.5, 31.5, 20.25, 20.25)]),
    poly_case('big_image', 480, 640, [star(100, 320.2, 240.7, 230.0, 120.0)]),
    poly_case('wide', 3, 200, [[0.0, 0.0, 199.0, 1.0, 150.0, 3.0, 4.0, 2.5]]),
    poly_case('tall', 200, 3, [[0.0, 0.0, 1.0, 199.0, 3.0, 150.0, 2.5, 4.0]]),
    poly_case('one_row', 1, 20, [[0.0, 0.0, 20.0, 0.0, 20.0, 1.0, 0.0, 1.0]]),
    poly_case('one_col', 20, 1, [[0.0, 0.0, 1.0, 0.0, 1.0, 20.0, 0.0, 20.0]]),
    # fewer than 3 points through frPoly (frPyObjects refuses them as the first polygon)
    poly_case('two_points', 10, 12, [[1.0, 1.0, 5.0, 5.0]]),
    poly_case('one_point', 10, 12, [[3.0, 4.0]]),
    poly_case('no_points', 10, 12, [[]]),
    # objects of several polygons, as COCO.annToRLE merges them
    poly_case('multi2', 30, 40, [[1.0, 1.0, 10.0, 1.0, 5.0, 12.0], [20.0, 5.0, 35.0, 5.0, 30.0, 25.0]]),
    poly_case('multi_overlap', 30, 40, [[1.0, 1.0, 20.0, 1.0, 10.0, 20.0], [5.0, 5.0, 30.0, 5.0, 15.0, 28.0],
                                        [0.0, 15.0, 40.0, 15.0, 20.0, 30.0]]),
    poly_case('multi_short_tail', 30, 40, [[1.0, 1.0, 20.0, 1.0, 10.0, 20.0], [5.0, 5.0, 30.0, 25.0], [3.0, 3.0], []]),
    poly_case('multi_outside', 30, 40, [[1.0, 1.0, 20.0, 1.0, 10.0, 20.0], [50.0, 5.0, 60.0, 5.0, 55.0, 28.0]]),
]
for i in range(10):
    h, w = int(rng.integers(5, 80)), int(rng.integers(5, 80))
    ps = [rand_poly(int(rng.integers(3, 20)), -3, w + 3, -3, h + 3) for _ in range(int(rng.integers(1, 5)))]
    polys.append(poly_case('multi_random', h, w, ps))
refs['polygons'] = polys


# ---- IoU of RLE sets ----
def hexes(a):
    return [[float(v).hex() for v in row] for row in np.asarray(a, dtype=np.double)]


ious = []
for i in range(25):
    h, w = int(rng.integers(1, 40)), int(rng.integers(1, 40))
    nd, ng = int(rng.integers(1, 6)), int(rng.integers(1, 6))
    def pick():
        k = rng.random()
        if k < 0.1:
            return random_mask(h, w, 'zero')
        if k < 0.15:
            return random_mask(h, w, 'one')
        return random_mask(h, w, 'blob' if k < 0.8 else 'noise')
    dms, gms = [pick() for _ in range(nd)], [pick() for _ in range(ng)]
    if i % 3 == 0:
        dms[0] = gms[0].copy()  # an exact match
    dt = [mask_util.encode(np.asfortranarray(m)) for m in dms]
    gt = [mask_util.encode(np.asfortranarray(m)) for m in gms]
    if i % 4 == 1 and len(gt) > 1:  # an empty mask with zero-length runs (intersection of disjoint masks)
        gt[1] = mask_util.merge([mask_util.encode(np.asfortranarray(random_mask(h, w, 'zero'))), gt[1]], intersect=True)
    crowd = [int(v) for v in rng.integers(0, 2, ng)]
    o = mask_util.iou(dt, gt, crowd)
    ious.append({'dt': [[h, w, s(r)] for r in dt], 'gt': [[h, w, s(r)] for r in gt], 'iscrowd': crowd,
                 'iou': hexes(o)})
# masks of different sizes: -1 where the boxes overlap
dt = [mask_util.encode(np.asfortranarray(np.ones((10, 12), np.uint8))),
      mask_util.encode(np.asfortranarray(random_mask(8, 12, 'blob')))]
gt = [mask_util.encode(np.asfortranarray(random_mask(10, 12, 'blob'))),
      mask_util.encode(np.asfortranarray(np.ones((8, 12), np.uint8)))]
o = mask_util.iou(dt, gt, [0, 1])
ious.append({'dt': [[r['size'][0], r['size'][1], s(r)] for r in dt],
             'gt': [[r['size'][0], r['size'][1], s(r)] for r in gt], 'iscrowd': [0, 1], 'iou': hexes(o)})
refs['rle_iou'] = ious

# ---- IoU of boxes ----
bious = []
for i in range(25):
    nd, ng = int(rng.integers(1, 7)), int(rng.integers(1, 7))
    def box():
        k = rng.random()
        b = rng.uniform(0, 50, 4)
        if k < 0.1:
            b[2] = 0.0  # zero width
        elif k < 0.2:
            b[3] = 0.0
        elif k < 0.35:
            b = np.round(b)
        elif k < 0.4:
            b[2] = -b[2]  # negative width: no overlap by construction
        return [float(v) for v in b]
    dt, gt = [box() for _ in range(nd)], [box() for _ in range(ng)]
    if i % 3 == 0:
        dt[0] = list(gt[0])
    if i % 5 == 0:  # touching boxes
        g = gt[0]
        dt[-1] = [g[0] + g[2], g[1], 5.0, 5.0]
    crowd = [int(v) for v in rng.integers(0, 2, ng)]
    o = mask_util.iou(dt, gt, crowd)
    bious.append({'dt': dt, 'gt': gt, 'iscrowd': crowd, 'iou': hexes(o)})
refs['bbox_iou'] = bious

path = os.path.join(out, 'coco_mask_refs.json')
with open(path, 'w') as f:
    json.dump(refs, f, separators=(',', ':'))
print(f'wrote {path}: {os.path.getsize(path)} bytes')
