#!/usr/bin/env python3
"""Reference numbers for tests/parity/test_coco_eval.cpp: pycocotools' COCOeval on a generated set.

Usage: make_coco_eval_refs.py OUT_DIR

Writes gt.json (ground truth) and dt_bbox.json / dt_segm.json (results) made with a fixed seed so
that every rule of COCOeval that changes a number is hit: crowds (uncompressed RLE, as COCO stores
them), gt areas of exactly 32**2 and 96**2 (the area field), an "ignore" field pycocotools
overwrites, a gt with id 0 (dtMatches == 0 reads as unmatched), equal scores within and across
images, images without gt or without detections, a category without gt (with detections), a
detection of a category not in the gt, more than 100 detections in one (image, category), tiny and
huge boxes, detection areas on the range bounds, segmentations as polygons (several parts),
uncompressed and compressed RLE. Then, for each case (bbox; segm; segm of the box results, whose
masks are loadRes' box polygons) it runs evaluate / accumulate / summarize and writes
<case>_{stats,precision,recall,scores,percat}.bin (float64, C order), <case>_summary.txt (what
summarize() prints) and shapes.json; plus mean_check.bin (arrays and np.mean of each, for numpy's
pairwise summation).
"""
import contextlib
import io
import json
import os
import sys

import numpy as np
from pycocotools import mask as mask_utils
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval


def make_set(rng):
    cats = [{"id": c, "name": "cat%d" % c, "supercategory": "thing"} for c in (1, 2, 3, 5, 7, 9)]
    # category 9 has no gt at all (its precision stays -1); detections of 4 are for no gt category
    gt_cats = [1, 2, 3, 5, 7]
    images, anns = [], []
    n_img = 48
    for i in range(n_img):
        h, w = int(rng.integers(40, 260)), int(rng.integers(40, 260))
        # ids not in file order, so the sort by id matters
        images.append({"id": int(1000 - 7 * i), "file_name": "img%03d.jpg" % i, "height": h, "width": w})
    rng.shuffle(images)
    next_id = [1]

    def new_id():
        v = next_id[0]
        next_id[0] += 1
        return v

    for im in images:
        h, w = im["height"], im["width"]
        if im["id"] % 5 == 0:
            continue  # images without gt
        for _ in range(int(rng.integers(1, 12))):
            cat = int(rng.choice(gt_cats))
            kind = rng.random()
            bw = float(rng.uniform(2, w * 0.8))
            bh = float(rng.uniform(2, h * 0.8))
            if kind < 0.08:
                bw, bh = float(rng.uniform(0.5, 3)), float(rng.uniform(0.5, 3))  # tiny
            x = float(rng.uniform(0, w - bw))
            y = float(rng.uniform(0, h - bh))
            x, y, bw, bh = [round(v, 2) for v in (x, y, bw, bh)]
            ann = {"id": new_id(), "image_id": im["id"], "category_id": cat, "bbox": [x, y, bw, bh], "iscrowd": 0}
            crowd = rng.random() < 0.1
            shape = rng.random()
            if crowd:
                # crowds carry uncompressed RLE, as in COCO
                poly = [x, y, x + bw, y, x + bw * 0.5, y + bh]
                rle = mask_utils.frPyObjects([poly], h, w)[0]
                m = mask_utils.decode(rle)
                counts = []
                flat = m.flatten(order="F")
                cur, run = 0, 0
                for v in flat:
                    if v != cur:
                        counts.append(run)
                        run, cur = 0, v
                    run += 1
                counts.append(run)
                ann["segmentation"] = {"size": [h, w], "counts": [int(c) for c in counts]}
                ann["iscrowd"] = 1
                ann["area"] = float(m.sum())
            elif shape < 0.6:
                # one or two polygon parts
                parts = []
                n_parts = 1 if rng.random() < 0.7 else 2
                for p in range(n_parts):
                    cx, cy = x + bw * (0.3 + 0.4 * p), y + bh * 0.5
                    k = int(rng.integers(3, 9))
                    ang = np.sort(rng.uniform(0, 2 * np.pi, k))
                    rx, ry = bw * 0.5, bh * 0.5
                    pts = []
                    for a in ang:
                        pts += [round(float(cx + rx * np.cos(a) * rng.uniform(0.5, 1)), 2),
                                round(float(cy + ry * np.sin(a) * rng.uniform(0.5, 1)), 2)]
                    parts.append(pts)
                ann["segmentation"] = parts
                rle = mask_utils.merge(mask_utils.frPyObjects(parts, h, w))
                ann["area"] = float(mask_utils.area(rle))
            else:
                # compressed RLE of an ellipse-ish blob
                m = np.zeros((h, w), dtype=np.uint8, order="F")
                yy, xx = np.mgrid[0:h, 0:w]
                cx, cy = x + bw / 2, y + bh / 2
                m[((xx - cx) / max(bw / 2, 0.5)) ** 2 + ((yy - cy) / max(bh / 2, 0.5)) ** 2 <= 1] = 1
                rle = mask_utils.encode(np.asfortranarray(m))
                ann["segmentation"] = {"size": [h, w], "counts": rle["counts"].decode("ascii")}
                ann["area"] = float(mask_utils.area(rle))
            r = rng.random()
            if r < 0.07:
                ann["area"] = 1024.0  # exactly 32**2: in small and in medium
            elif r < 0.14:
                ann["area"] = 9216  # exactly 96**2 (an int in the json)
            elif r < 0.18:
                ann["ignore"] = 1  # overwritten by pycocotools from iscrowd
            anns.append(ann)
    # a gt with id 0 on an image that has gt
    anns[3]["id"] = 0
    # a huge box
    big = images[1]
    anns.append({"id": new_id(), "image_id": big["id"], "category_id": 2, "bbox": [0, 0, big["width"], big["height"]],
                 "area": float(big["width"] * big["height"]), "iscrowd": 0,
                 "segmentation": [[0, 0, big["width"], 0, big["width"], big["height"], 0, big["height"]]]})
    rng.shuffle(anns)
    # equal IoUs: a detection between two overlapping gts takes the later one (file order), so a
    # second detection can still match the first; appended after the shuffle to keep their order
    tie = next(im for im in images if im["id"] % 5 == 0)
    for x in (0, 2):
        anns.append({"id": new_id(), "image_id": tie["id"], "category_id": 7, "bbox": [x, 0, 10, 10], "area": 100,
                     "iscrowd": 0, "segmentation": [[x, 0, x + 10, 0, x + 10, 10, x, 10]]})
    return {"info": {"description": "imgtrain parity"}, "licenses": [], "images": images,
            "annotations": anns, "categories": cats}


def jitter_box(rng, b, scale):
    x, y, w, h = b
    return [x + rng.normal(0, scale) * w, y + rng.normal(0, scale) * h,
            max(0.5, w * (1 + rng.normal(0, scale))), max(0.5, h * (1 + rng.normal(0, scale)))]


def make_results(rng, gt):
    imgs = {im["id"]: im for im in gt["images"]}
    by_img = {}
    for a in gt["annotations"]:
        by_img.setdefault(a["image_id"], []).append(a)
    boxes, segms = [], []
    tie_scores = [0.5, 0.25, 0.75]
    img_list = sorted(imgs)
    for n, iid in enumerate(img_list):
        im = imgs[iid]
        h, w = im["height"], im["width"]
        dets = []
        if iid == gt["annotations"][-1]["image_id"]:
            dets.append((7, [1.0, 0.0, 10.0, 10.0]))  # equal IoU with both tie gts, scored first
            dets.append((7, [0.0, 0.0, 10.0, 10.0]))
        elif n % 7 == 3:
            continue  # images without detections
        for a in by_img.get(iid, []):
            for _ in range(int(rng.integers(0, 4))):
                dets.append((a["category_id"], jitter_box(rng, a["bbox"], float(rng.choice([0.02, 0.1, 0.3])))))
        # false positives, the category without gt and one not in the gt
        for _ in range(int(rng.integers(0, 6))):
            bw, bh = float(rng.uniform(1, w)), float(rng.uniform(1, h))
            dets.append((int(rng.choice([1, 2, 3, 5, 7, 9, 4])), [float(rng.uniform(0, w - bw)),
                                                                  float(rng.uniform(0, h - bh)), bw, bh]))
        if n == 5:
            # > 100 detections in one (image, category), many with equal scores
            for _ in range(130):
                bw, bh = float(rng.uniform(1, w / 2)), float(rng.uniform(1, h / 2))
                dets.append((2, [float(rng.uniform(0, w - bw)), float(rng.uniform(0, h - bh)), bw, bh]))
        if n == 6:
            # areas exactly on the range bounds
            dets.append((1, [1.0, 2.0, 32.0, 32.0]))
            dets.append((1, [3.0, 1.0, 96.0, 96.0]))
            dets.append((3, [0.0, 0.0, 16.0, 64.0]))
        for j, (cat, b) in enumerate(dets):
            b = [round(float(v), 3) for v in b]
            r = rng.random()
            score = float(rng.choice(tie_scores)) if r < 0.25 else round(float(rng.random()), 3 if r < 0.6 else 12)
            if cat == 7 and b in ([1.0, 0.0, 10.0, 10.0], [0.0, 0.0, 10.0, 10.0]):
                score = 0.999 - 0.001 * (b[0] == 0.0)
            boxes.append({"image_id": iid, "category_id": cat, "bbox": b, "score": score})
            # a mask: the box polygon, or an ellipse inside the box
            if rng.random() < 0.5:
                x1, y1, x2, y2 = b[0], b[1], b[0] + b[2], b[1] + b[3]
                rle = mask_utils.frPyObjects([[x1, y1, x2, y1, x2, y2, x1, y2]], h, w)[0]
            else:
                m = np.zeros((h, w), dtype=np.uint8, order="F")
                yy, xx = np.mgrid[0:h, 0:w]
                cx, cy = b[0] + b[2] / 2, b[1] + b[3] / 2
                m[((xx - cx) / max(b[2] / 2, 0.5)) ** 2 + ((yy - cy) / max(b[3] / 2, 0.5)) ** 2 <= 1] = 1
                rle = mask_utils.encode(np.asfortranarray(m))
            segms.append({"image_id": iid, "category_id": cat, "score": score,
                          "segmentation": {"size": [h, w], "counts": rle["counts"].decode("ascii")}})
    return boxes, segms


def run_eval(gt_path, dt_path, iou_type):
    with contextlib.redirect_stdout(io.StringIO()):
        coco_gt = COCO(gt_path)
        coco_dt = coco_gt.loadRes(dt_path)
        ev = COCOeval(coco_gt, coco_dt, iou_type)
        ev.evaluate()
        ev.accumulate()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        ev.summarize()
    # detectron2's per-category AP (without the * 100)
    prec = ev.eval["precision"]
    percat = []
    for k in range(prec.shape[2]):
        p = prec[:, :, k, 0, -1]
        p = p[p > -1]
        percat.append(np.mean(p) if p.size else float("nan"))
    return ev, out.getvalue(), np.array(percat, dtype=np.float64)


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    rng = np.random.default_rng(20240611)
    gt = make_set(rng)
    boxes, segms = make_results(rng, gt)
    with open(os.path.join(out, "gt.json"), "w") as f:
        json.dump(gt, f)
    with open(os.path.join(out, "dt_bbox.json"), "w") as f:
        json.dump(boxes, f)
    with open(os.path.join(out, "dt_segm.json"), "w") as f:
        json.dump(segms, f)
    shapes = {}
    for case, dt_file, iou_type in (("bbox", "dt_bbox.json", "bbox"), ("segm", "dt_segm.json", "segm"),
                                    ("segm_boxres", "dt_bbox.json", "segm")):
        ev, summary, percat = run_eval(os.path.join(out, "gt.json"), os.path.join(out, dt_file), iou_type)
        e = ev.eval
        for name, arr in (("stats", np.asarray(ev.stats, dtype=np.float64)), ("precision", e["precision"]),
                          ("recall", e["recall"]), ("scores", e["scores"]), ("percat", percat)):
            np.ascontiguousarray(arr, dtype=np.float64).tofile(os.path.join(out, "%s_%s.bin" % (case, name)))
        with open(os.path.join(out, case + "_summary.txt"), "w") as f:
            f.write(summary)
        shapes[case] = {"precision": list(e["precision"].shape), "recall": list(e["recall"].shape),
                        "iou_thrs": [float(v) for v in ev.params.iouThrs],
                        "rec_thrs": [float(v) for v in ev.params.recThrs]}
        print("%s: AP %.6f AP50 %.6f AR100 %.6f" % (case, ev.stats[0], ev.stats[1], ev.stats[8]))
    # numpy's mean on lengths around its pairwise-summation block sizes: [n, values..., mean] each
    chk = []
    for n in (1, 7, 8, 9, 127, 128, 129, 255, 256, 1010, 8192, 8193, 30000):
        v = rng.random(n) * rng.choice([1.0, 1e-3, 1e4], n)
        chk += [float(n)] + [float(x) for x in v] + [float(np.mean(v))]
    np.array(chk, dtype=np.float64).tofile(os.path.join(out, "mean_check.bin"))
    with open(os.path.join(out, "shapes.json"), "w") as f:
        json.dump(shapes, f)
    print("wrote %s: %d images, %d gt, %d detections" % (out, len(gt["images"]), len(gt["annotations"]), len(boxes)))


if __name__ == "__main__":
    main()
