#!/usr/bin/env python3
"""COCO evaluation speed: pycocotools' COCOeval.evaluate() + accumulate() against imgtrain's
evaluator on the same files, and a check that the 12 stats are identical.

Usage:
  bench/coco_eval_bench.py --imgtrain build/bin/imgtrain [--images 5000] [--cats 80] [--dets 100] [--work DIR]

imgtrain runs `evaluate-coco --iou-type bbox|segm --results-file ...` with --threads 1 (pycocotools'
one thread) and --threads 0 (all cores); its time is the results file's eval_seconds (evaluate +
accumulate + summarize, json loading excluded, as for pycocotools) and its stats are compared
exactly with pycocotools'. The
synthetic set is COCO-sized by default: 5,000 images of 640x480, 80 categories, ~7.2 gt per image
(~36,000, 1% crowd, COCO-like size spread), 100 detections per image (jittered gt plus false
positives, random scores). Prints both times and the ratio; exits 1 when the stats differ.
"""
import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
import time

import numpy as np
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval


def make(n_img, n_cat, n_det, seed=0):
    rng = np.random.default_rng(seed)
    W, H = 640, 480
    images = [{"id": i + 1, "file_name": "%012d.jpg" % (i + 1), "width": W, "height": H} for i in range(n_img)]
    cats = [{"id": c + 1, "name": "c%d" % (c + 1)} for c in range(n_cat)]
    anns, dets = [], []
    aid = 1
    for im in images:
        n_gt = int(rng.poisson(7.2))
        gts = []
        for _ in range(n_gt):
            side = float(np.exp(rng.uniform(np.log(4), np.log(400))))
            ar = float(np.exp(rng.normal(0, 0.5)))
            w, h = min(W - 1, side * ar), min(H - 1, side / ar)
            x, y = float(rng.uniform(0, W - w)), float(rng.uniform(0, H - h))
            cat = int(rng.integers(1, n_cat + 1))
            crowd = int(rng.random() < 0.01)
            box = [round(x, 2), round(y, 2), round(w, 2), round(h, 2)]
            x2, y2 = round(x + w, 2), round(y + h, 2)
            anns.append({"id": aid, "image_id": im["id"], "category_id": cat, "bbox": box,
                         "area": round(w * h * 0.7, 2), "iscrowd": crowd,
                         # an octagon inside the box: what segm scores (box results become box polygons)
                         "segmentation": [[box[0] + w * 0.3, box[1], box[0] + w * 0.7, box[1], x2, box[1] + h * 0.3,
                                           x2, box[1] + h * 0.7, box[0] + w * 0.7, y2, box[0] + w * 0.3, y2,
                                           box[0], box[1] + h * 0.7, box[0], box[1] + h * 0.3]]})
            gts.append((cat, box))
            aid += 1
        out = []
        for cat, (x, y, w, h) in gts:
            for _ in range(int(rng.integers(1, 4))):
                s = float(rng.choice([0.03, 0.1, 0.3]))
                out.append((cat if rng.random() < 0.9 else int(rng.integers(1, n_cat + 1)),
                            [x + rng.normal(0, s) * w, y + rng.normal(0, s) * h,
                             max(1.0, w * (1 + rng.normal(0, s))), max(1.0, h * (1 + rng.normal(0, s)))]))
        while len(out) < n_det:
            side = float(np.exp(rng.uniform(np.log(4), np.log(400))))
            x, y = float(rng.uniform(0, W - side)), float(rng.uniform(0, H - side))
            out.append((int(rng.integers(1, n_cat + 1)), [x, y, side, side * float(rng.uniform(0.5, 1.5))]))
        for cat, b in out[:n_det]:
            dets.append({"image_id": im["id"], "category_id": cat, "bbox": [round(float(v), 2) for v in b],
                         "score": round(float(rng.random()), 4)})
    return {"images": images, "annotations": anns, "categories": cats}, dets


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--imgtrain", required=True, help="the imgtrain binary")
    ap.add_argument("--images", type=int, default=5000)
    ap.add_argument("--cats", type=int, default=80)
    ap.add_argument("--dets", type=int, default=100)
    ap.add_argument("--work", default="/tmp/imgtrain_coco_eval_bench")
    ap.add_argument("--iou-type", default="bbox", choices=["bbox", "segm"])
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    gt_path, dt_path = os.path.join(a.work, "gt.json"), os.path.join(a.work, "dt.json")
    gt, dets = make(a.images, a.cats, a.dets)
    with open(gt_path, "w") as f:
        json.dump(gt, f)
    with open(dt_path, "w") as f:
        json.dump(dets, f)
    print("set: %d images, %d categories, %d gt, %d detections" % (a.images, a.cats, len(gt["annotations"]), len(dets)))

    with contextlib.redirect_stdout(io.StringIO()):
        coco_gt = COCO(gt_path)
        coco_dt = coco_gt.loadRes(dt_path)
        ev = COCOeval(coco_gt, coco_dt, a.iou_type)
        t0 = time.perf_counter()
        ev.evaluate()
        t1 = time.perf_counter()
        ev.accumulate()
        t2 = time.perf_counter()
        ev.summarize()
    py_s = t2 - t0
    print("%s: pycocotools: evaluate %.2f s + accumulate %.2f s = %.2f s" % (a.iou_type, t1 - t0, t2 - t1, py_s))

    ref = [float(v) for v in ev.stats]
    ok = True
    for threads in (1, 0):
        res_path = os.path.join(a.work, "res.json")
        proc = subprocess.run([a.imgtrain, "evaluate-coco", "--gt", gt_path, "--results", dt_path, "--iou-type", a.iou_type,
                               "--results-file", res_path, "--threads", str(threads)], capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit("imgtrain failed (%d): %s" % (proc.returncode, proc.stderr.strip()))
        with open(res_path) as f:
            res = json.load(f)[a.iou_type]
        ours_s = res["eval_seconds"]
        stats = [res["stats"][k] for k in ("AP", "AP50", "AP75", "APs", "APm", "APl", "AR1", "AR10", "AR100",
                                           "ARs", "ARm", "ARl")]
        label = "1 thread" if threads == 1 else "all %d cores" % os.cpu_count()
        same = stats == ref
        print("imgtrain (%s): evaluate + accumulate + summarize %.3f s, pycocotools / imgtrain %.1fx, "
              "stats identical: %s" % (label, ours_s, py_s / max(ours_s, 1e-9), same))
        for i, (o, r) in enumerate(zip(stats, ref)):
            if o != r:
                print("  stats[%d]: ours %r pycocotools %r" % (i, o, r))
        ok = ok and same
    if not ok:
        sys.exit(1)

if __name__ == "__main__":
    main()
