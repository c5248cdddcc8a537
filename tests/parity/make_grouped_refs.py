"""Golden batches of torchvision's detection reference sampler (tests/data/grouped_batches.json).

torchvision's GroupedBatchSampler and create_aspect_ratio_groups live in its references/detection/
folder, which the torchvision wheel does not ship, so this script is not a ctest fixture: it is run
by hand against a torchvision source checkout and its output is committed.

    TORCHVISION_REFERENCES=/path/to/vision/references/detection \
        .venv/bin/python tests/parity/make_grouped_refs.py tests/data/grouped_batches.json

Each case: image sizes, a group factor k, batch size, world size and epoch; the groups from
create_aspect_ratio_groups and, per rank, the batches GroupedBatchSampler yields over
torch.utils.data.DistributedSampler(shuffle=True, seed=42) at that epoch.
"""
import json, os, sys

import torch
from torch.utils.data.distributed import DistributedSampler

sys.path.insert(0, os.environ["TORCHVISION_REFERENCES"])
from group_by_aspect_ratio import GroupedBatchSampler, create_aspect_ratio_groups  # noqa: E402


class Sizes(torch.utils.data.Dataset):
    def __init__(self, hw):
        self.hw = hw

    def __len__(self):
        return len(self.hw)

    def get_height_and_width(self, i):
        return self.hw[i]


g = torch.Generator().manual_seed(7)
cases = []
for n, k, bs, world, epoch, shuffle in [(37, 0, 2, 1, 0, True), (101, 3, 2, 2, 3, True), (101, 3, 4, 2, 0, True),
                                        (250, 1, 3, 3, 1, True), (64, 3, 5, 1, 2, False), (9, 3, 4, 2, 0, True)]:
    hw = [(int(h), int(w)) for h, w in torch.randint(16, 700, (n, 2), generator=g).tolist()]
    # a few exact bin edges: square, 2:1, 1:2
    hw[:3] = [(100, 100), (100, 200), (200, 100)]
    ds = Sizes(hw)
    groups = create_aspect_ratio_groups(ds, k=k)
    ranks = []
    for r in range(world):
        s = DistributedSampler(ds, num_replicas=world, rank=r, shuffle=shuffle, seed=42)
        s.set_epoch(epoch)
        ranks.append([list(map(int, b)) for b in GroupedBatchSampler(s, groups, bs)])
    cases.append({"hw": hw, "k": k, "batch_size": bs, "world": world, "epoch": epoch, "shuffle": shuffle,
                  "groups": groups, "batches": ranks})
with open(sys.argv[1], "w") as f:
    json.dump({"torch": torch.__version__, "cases": cases}, f)
print(f"wrote {len(cases)} cases to {sys.argv[1]}")
