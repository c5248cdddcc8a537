"""Writes the fuzz harnesses' seed corpora (tests/fuzz/corpus/<harness>/): small valid inputs of
every form each parser reads, so the fuzzer starts inside the formats rather than at their magic.
Run with the project's venv (torch, safetensors, PIL): .venv/bin/python tests/fuzz/make_corpus.py"""
import gzip, io, json, os, struct, tarfile, zlib
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from safetensors.torch import save as st_save

root = Path(__file__).parent / "corpus"
rng = np.random.default_rng(0)


def put(h, name, data):
    d = root / h
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_bytes(data if isinstance(data, bytes) else data.encode())


# safetensors: dtypes, shapes (scalar, empty), metadata as a checkpoint has it
put("safetensors", "checkpoint", st_save({"model.w": torch.randn(2, 3), "model.b": torch.zeros(3, dtype=torch.float16),
                                          "optim.0.step": torch.tensor(3.0), "rng.cpu": torch.zeros(8, dtype=torch.uint8)},
                                         {"arch": "resnet18", "epoch": "3", "num_updates": "40", "metric": "91.5"}))
put("safetensors", "dtypes", st_save({"a": torch.arange(4, dtype=torch.int64), "b": torch.ones(2, 2, dtype=torch.bfloat16),
                                      "c": torch.zeros(0, 5), "d": torch.tensor([True, False]),
                                      "e": torch.arange(3, dtype=torch.int8)}))

# torch.save: the zip container and the legacy stream, with views, shared storages and nesting
t = torch.arange(12.0).reshape(3, 4)
obj = {"state_dict": {"w": t, "v": t[1:, ::2], "h": torch.ones(2, dtype=torch.float16)}, "epoch": 3,
       "arch": "resnet18", "args": [1, 2.5, None, True, "x"], "nested": {"t": (1, 2)}}
b = io.BytesIO(); torch.save(obj, b); put("torch_save", "zip", b.getvalue())
b = io.BytesIO(); torch.save(obj, b, _use_new_zipfile_serialization=False); put("torch_save", "legacy", b.getvalue())
b = io.BytesIO(); torch.save({"w": torch.zeros(2, 2, dtype=torch.int32)}, b); put("torch_save", "small", b.getvalue())

# config: imgtrain / timm args.yaml keys, lists, a Detectron2 file
put("config", "timm", "model: resnet18\nbatch_size: 64\nlr: 0.1\nsched: cosine\nepochs: 3\nmixup: 0.2\n"
                      "aa: rand-m9-mstd0.5\nscale: [0.08, 1.0]\ndecay_milestones: [90, 180]\nopt_betas: null\n")
put("config", "imgtrain", "dataset: fashion-mnist\nmodel: resnet18\nin_chans: 1\nimg_size: 28\nwarmup_epochs: 1\n"
                          "model_ema: true\nmodel_ema_decay: 0.999\namp: false\n")
put("config", "detectron2", "MODEL:\n  META_ARCHITECTURE: GeneralizedRCNN\n  MASK_ON: true\n  RESNETS:\n    DEPTH: 50\n"
                            "  RPN:\n    NMS_THRESH: 0.7\nSOLVER:\n  BASE_LR: 0.02\n  IMS_PER_BATCH: 16\n"
                            "  STEPS: (210000, 250000)\n  MAX_ITER: 270000\nINPUT:\n  MIN_SIZE_TRAIN: (640, 672, 704)\n")

# IDX: images and labels, raw and gzip (the harness gzips too)
put("idx", "images", b"\0\0\x08\x03" + struct.pack(">III", 2, 4, 4) + bytes(range(32)))
put("idx", "labels", b"\0\0\x08\x01" + struct.pack(">I", 3) + bytes([0, 1, 9]))
put("idx", "labels.gz", gzip.compress(b"\0\0\x08\x01" + struct.pack(">I", 2) + bytes([4, 5])))


def jpeg(w=16, h=12, **kw):
    b = io.BytesIO(); Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(b, "JPEG", **kw)
    return b.getvalue()


# tar shards: ustar, GNU long names, pax headers, labels
def tar(fmt, long_names=False):
    b = io.BytesIO()
    with tarfile.open(fileobj=b, mode="w", format=fmt) as tf:
        for i in range(2):
            key = ("k" * 120 + str(i)) if long_names else f"{i:04d}"
            for ext, data in ((".jpg", jpeg(8, 8)), (".cls", str(i).encode())):
                ti = tarfile.TarInfo(key + ext); ti.size = len(data); tf.addfile(ti, io.BytesIO(data))
    return b.getvalue()


put("tar", "ustar", tar(tarfile.USTAR_FORMAT))
put("tar", "gnu-longname", tar(tarfile.GNU_FORMAT, long_names=True))
put("tar", "pax", tar(tarfile.PAX_FORMAT, long_names=True))

# images: each format the decoder reads, baseline and progressive JPEG, grey, palette, alpha
put("image", "baseline.jpg", jpeg(17, 9))
put("image", "progressive.jpg", jpeg(20, 14, progressive=True))
b = io.BytesIO(); Image.fromarray(rng.integers(0, 255, (9, 7), dtype=np.uint8)).save(b, "JPEG"); put("image", "grey.jpg", b.getvalue())
for fmt, mode in (("PNG", "RGBA"), ("PNG", "P"), ("GIF", "P"), ("BMP", "RGB"), ("WEBP", "RGB")):
    im = Image.fromarray(rng.integers(0, 255, (6, 5, 3), dtype=np.uint8)).convert(mode)
    b = io.BytesIO(); im.save(b, fmt); put("image", f"{mode.lower()}.{fmt.lower()}", b.getvalue())

# COCO: gt json, a NUL byte, a results json (boxes, then masks)
gt = {"images": [{"id": 1, "file_name": "a.jpg", "height": 20, "width": 30},
                 {"id": 2, "file_name": "b.jpg", "height": 10, "width": 10}],
      "categories": [{"id": 1, "name": "x", "supercategory": "s"}, {"id": 3, "name": "y"}],
      "annotations": [{"id": 1, "image_id": 1, "category_id": 1, "bbox": [2, 3, 10, 5], "area": 50, "iscrowd": 0,
                       "segmentation": [[2, 3, 12, 3, 12, 8, 2, 8]]},
                      {"id": 2, "image_id": 2, "category_id": 3, "bbox": [0, 0, 4, 4], "area": 16, "iscrowd": 1,
                       "segmentation": {"size": [10, 10], "counts": [0, 4, 6, 4, 86]}},
                      {"id": 3, "image_id": 1, "category_id": 3, "bbox": [1, 1, 3, 3], "area": 9, "iscrowd": 0,
                       "segmentation": {"size": [20, 30], "counts": "04000"}}]}
boxes = [{"image_id": 1, "category_id": 1, "bbox": [2, 3, 9, 5], "score": 0.9},
         {"image_id": 2, "category_id": 3, "bbox": [0, 1, 4, 4], "score": 0.5}]
masks = [{"image_id": 1, "category_id": 1, "score": 0.7, "segmentation": {"size": [20, 30], "counts": "0450"}}]
put("coco_json", "gt-boxes", json.dumps(gt) + "\0" + json.dumps(boxes))
put("coco_json", "gt-masks", json.dumps(gt) + "\0" + json.dumps(masks))
put("coco_json", "gt-only", json.dumps(gt))
