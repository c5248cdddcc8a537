#!/usr/bin/env python3
"""Loading an instances_train2017-sized json: pycocotools.COCO() against `imgtrain coco-info`.

Usage:
  bench/coco_load_bench.py --imgtrain build/bin/imgtrain [--images 118287] [--anns-per-image 7.3] [--work DIR]
                           [--repeats 3]

Writes a synthetic instances json of COCO train2017's size (118,287 images, ~860k annotations,
polygons of 6-60 points, 1% crowd RLE, 80 categories: ~450 MB like the real file), then loads it
with each tool in its own process, alternating, and reports wall time (median) and peak RSS
(ru_maxrss of the child). imgtrain's time includes its training view (torchvision's filtering of
images without usable annotations), which pycocotools' COCO() does not do.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np


def make(path, n_img, per_image, seed=0):
    rng = np.random.default_rng(seed)
    cats = [{"id": c, "name": "c%d" % c, "supercategory": "s"} for c in range(1, 91) if c % 9 != 0][:80]
    with open(path, "w") as f:
        f.write('{"info": {}, "licenses": [], "images": [')
        for i in range(n_img):
            f.write(("," if i else "") + json.dumps({"id": i + 1, "file_name": "%012d.jpg" % (i + 1),
                                                     "width": 640, "height": 480}))
        f.write('], "annotations": [')
        aid = 1
        for i in range(n_img):
            for _ in range(int(rng.poisson(per_image))):
                x, y = float(rng.uniform(0, 600)), float(rng.uniform(0, 440))
                w, h = float(rng.uniform(2, 640 - x)), float(rng.uniform(2, 480 - y))
                a = {"id": aid, "image_id": i + 1, "category_id": cats[int(rng.integers(80))]["id"],
                     "bbox": [round(x, 2), round(y, 2), round(w, 2), round(h, 2)], "area": round(w * h * 0.6, 2),
                     "iscrowd": 0}
                if rng.random() < 0.01:
                    a["iscrowd"] = 1
                    a["segmentation"] = {"size": [480, 640], "counts": [int(v) for v in rng.integers(1, 500, 40)]
                                         + [480 * 640 - 0]}
                    c = a["segmentation"]["counts"]
                    c[-1] = 480 * 640 - sum(c[:-1])
                else:
                    k = int(rng.integers(3, 31))
                    pts = np.stack([rng.uniform(x, x + w, k), rng.uniform(y, y + h, k)], 1).round(2).reshape(-1)
                    a["segmentation"] = [pts.tolist()]
                f.write(("," if aid > 1 else "") + json.dumps(a))
                aid += 1
        f.write('], "categories": ' + json.dumps(cats) + "}")
    return aid - 1


def peak(cmd):
    """Wall time and peak RSS (MiB) of one run of cmd, measured in a fresh wrapper process."""
    code = ("import resource,subprocess,sys,time;t=time.perf_counter();"
            "r=subprocess.run(sys.argv[1:],stdout=subprocess.DEVNULL,stderr=subprocess.DEVNULL);"
            "print(time.perf_counter()-t, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, r.returncode)")
    out = subprocess.run([sys.executable, "-c", code] + cmd, stdout=subprocess.PIPE, text=True, check=True).stdout
    t, kb, rc = out.split()
    if rc != "0":
        sys.exit("failed: " + " ".join(cmd))
    return float(t), int(kb) / 1024


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--imgtrain", required=True)
    ap.add_argument("--images", type=int, default=118287)
    ap.add_argument("--anns-per-image", type=float, default=7.3)
    ap.add_argument("--work", default="/tmp/coco_load_bench")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    path = os.path.join(a.work, "instances_synthetic_%d.json" % a.images)
    if not os.path.exists(path):
        n = make(path + ".tmp", a.images, a.anns_per_image)
        os.rename(path + ".tmp", path)
        print("wrote %s: %d images, %d annotations, %.0f MB" % (path, a.images, n, os.path.getsize(path) / 1e6))
    tools = {
        "pycocotools": [sys.executable, "-c", "import sys;from pycocotools.coco import COCO;COCO(sys.argv[1])", path],
        "imgtrain": [a.imgtrain, "coco-info", "--ann", path],
    }
    res = {k: [] for k in tools}
    for _ in range(a.repeats):
        for k, cmd in tools.items():
            res[k].append(peak(cmd))
    for k, v in res.items():
        print("%-12s time %.2f s (median of %d: %s)  peak RSS %.0f MiB" % (
            k, statistics.median(t for t, _ in v), len(v), " ".join("%.2f" % t for t, _ in v), max(m for _, m in v)))
    tp = statistics.median(t for t, _ in res["pycocotools"])
    ti = statistics.median(t for t, _ in res["imgtrain"])
    mp = max(m for _, m in res["pycocotools"])
    mi = max(m for _, m in res["imgtrain"])
    print("imgtrain / pycocotools: time %.3f, peak memory %.3f" % (ti / tp, mi / mp))


if __name__ == "__main__":
    main()
