"""Reads imgtrain's TensorBoard event files back with TensorBoard's own reader (EventAccumulator,
which checks every record's CRC-32C) and compares the per-epoch scalars with summary.csv.

usage: tensorboard_check.py EVENTS_DIR SUMMARY_CSV TAG [TAG ...]   (TAGs: per-update scalars that must exist)
"""
import csv
import sys

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def main():
    events_dir, summary, required = sys.argv[1], sys.argv[2], sys.argv[3:]
    acc = EventAccumulator(events_dir, size_guidance={"scalars": 0})
    acc.Reload()
    tags = acc.Tags()["scalars"]
    rows = list(csv.DictReader(open(summary)))
    assert rows, "summary.csv has no rows"
    for col in rows[0]:
        if col == "epoch":
            continue
        events = acc.Scalars("epoch/" + col)
        assert [e.step for e in events] == [int(r["epoch"]) for r in rows], (col, [e.step for e in events])
        for e, r in zip(events, rows):
            want = float(r[col])
            assert abs(e.value - want) <= 1e-6 * max(1.0, abs(want)), (col, e.value, want)
    for t in required:
        assert t in tags, (t, tags)
        assert len(acc.Scalars(t)) > 0, t
    print("TENSORBOARD_OK", len(tags), "tags")


if __name__ == "__main__":
    main()
