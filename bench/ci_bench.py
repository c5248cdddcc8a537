"""CI benchmark jobs: run a suite of `imgtrain benchmark` settings (with timm eager as an in-run
reference where the suite asks for it) into one JSON file of records, and compare such a file with
a baseline, failing when a ratio falls below a threshold.

  ci_bench.py run --suite bench/suites/ci-cpu.yaml [--repeats 3] [--out results.json] [--imgtrain BIN]
  ci_bench.py compare BASELINE.json NOW.json [--threshold 0.90]

A record per entry and mode (infer / train): imgtrain's median samples/s over the repeats and its
spread (min, max), the reference's median and the ratio imgtrain / reference, plus what the
numbers depend on (imgtrain version and commit, torch version, CPU, threads, batch, image size,
AMP / channels-last). Repeats alternate over the entries and between imgtrain and the reference
(round 1: all entries, round 2: all entries, ...), so slow drift of a noisy machine hits every
entry alike; the ratio is the median of the rounds' ratios (each round's two sides ran back to
back). `compare` judges the ratio to the reference where both files have one (a faster or
slower machine moves both sides), else samples/s, and exits 1 naming each entry below threshold.
The environment variable IMGTRAIN_BENCH_SLOWDOWN=F (test hook, read by `imgtrain benchmark`)
makes every timed step F x slower, to check that a regression is caught.
"""
import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time

import yaml

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = ('infer', 'train')


def result_json(text):
    """The JSON after the `--result` line that imgtrain benchmark and timm_benchmark.py print."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.strip() == '--result':
            return json.loads('\n'.join(lines[i + 1:]))
    raise RuntimeError('no --result in the output:\n' + text[-2000:])


def run_cmd(cmd):
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if p.returncode != 0:
        raise RuntimeError('{} exited {}:\n{}'.format(' '.join(cmd), p.returncode, p.stdout[-3000:]))
    return result_json(p.stdout)


def cpu_name():
    try:
        with open('/proc/cpuinfo') as f:
            for line in f:
                if line.startswith('model name'):
                    return line.split(':', 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or 'unknown'


def environment(imgtrain):
    version = subprocess.run([imgtrain, '--version'], stdout=subprocess.PIPE, text=True).stdout.strip()
    commit = subprocess.run(['git', '-C', HERE, 'rev-parse', '--short', 'HEAD'], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True).stdout.strip()
    import torch
    return {'imgtrain_version': version, 'git_commit': commit or 'unknown', 'torch_version': torch.__version__,
            'device': 'cpu: ' + cpu_name(), 'threads': torch.get_num_threads()}


def arg_value(args, *names, default=None):
    for i, a in enumerate(args):
        for n in names:
            if a == n and i + 1 < len(args):
                return args[i + 1]
            if a.startswith(n + '='):
                return a.split('=', 1)[1]
    return default


def cmd_run(opts):
    suite = yaml.safe_load(open(opts.suite))
    entries = suite.get('entries') if isinstance(suite, dict) else None
    if not entries:
        sys.exit('{}: no entries'.format(opts.suite))
    imgtrain = opts.imgtrain or os.path.join(HERE, 'build', 'bin', 'imgtrain')
    env = environment(imgtrain)
    samples = {}  # (name, mode, side) -> [samples/s per repeat]
    start = time.time()
    for r in range(opts.repeats):
        for e in entries:
            args = shlex.split(e['args'])
            sides = [('imgtrain', [imgtrain, 'benchmark', '--device', 'cpu'] + args)]
            if e.get('reference') == 'timm':
                sides.append(('reference', [sys.executable, os.path.join(HERE, 'bench', 'timm_benchmark.py')] + args))
            if r % 2:
                sides.reverse()  # alternate which side runs first
            for side, cmd in sides:
                res = run_cmd(cmd)
                for mode in MODES:
                    v = res.get(mode + '_samples_per_sec')
                    if v is not None:
                        samples.setdefault((e['name'], mode, side), []).append(float(v))
            print('round {}/{} {:<24s} done ({:.0f} s)'.format(r + 1, opts.repeats, e['name'], time.time() - start),
                  flush=True)
    records = []
    for e in entries:
        args = shlex.split(e['args'])
        for mode in MODES:
            ours = samples.get((e['name'], mode, 'imgtrain'))
            if not ours:
                continue
            rec = {'name': e['name'], 'mode': mode, 'model': arg_value(args, '--model'),
                   'samples_per_sec': round(statistics.median(ours), 3),
                   'spread': [round(min(ours), 3), round(max(ours), 3)], 'repeats': len(ours)}
            ref = samples.get((e['name'], mode, 'reference'))
            if ref:
                rec['reference'] = e['reference']
                rec['reference_samples_per_sec'] = round(statistics.median(ref), 3)
                # the median of each round's ratio: the two sides of a round ran back to back
                rec['ratio'] = round(statistics.median(o / r for o, r in zip(ours, ref)), 4)
            rec.update({'batch_size': int(arg_value(args, '-b', '--batch-size', default=256)),
                        'img_size': arg_value(args, '--img-size'), 'amp': '--amp' in args,
                        'channels_last': '--channels-last' in args})
            rec.update(env)
            records.append(rec)
    text = json.dumps(records, indent=2)
    if opts.out:
        with open(opts.out, 'w') as f:
            f.write(text + '\n')
    print(text)


def cmd_compare(opts):
    base = {(r['name'], r['mode']): r for r in json.load(open(opts.baseline))}
    now = {(r['name'], r['mode']): r for r in json.load(open(opts.now))}
    failed = []
    print('{:<24s} {:<6s} {:>8s} {:>12s} {:>12s} {:>7s}'.format('entry', 'mode', 'measure', 'baseline', 'now',
                                                              'ratio'))
    for key, b in base.items():
        n = now.get(key)
        if n is None:
            print('{:<24s} {:<6s} missing from {}'.format(key[0], key[1], opts.now))
            failed.append('{} {} (missing)'.format(*key))
            continue
        if 'ratio' in b and 'ratio' in n:
            measure, bv, nv = 'vs ' + b.get('reference', 'ref'), b['ratio'], n['ratio']
        else:
            measure, bv, nv = 'samples/s', b['samples_per_sec'], n['samples_per_sec']
        ratio = nv / bv if bv else float('inf')
        flag = '' if ratio >= opts.threshold else '  << below {:.2f}'.format(opts.threshold)
        print('{:<24s} {:<6s} {:>8s} {:>12.4f} {:>12.4f} {:>7.3f}{}'.format(key[0], key[1], measure, bv, nv, ratio,
                                                                          flag))
        if ratio < opts.threshold:
            failed.append('{} {} ({:.3f})'.format(key[0], key[1], ratio))
    if failed:
        print('FAILED: below {:.2f} of the baseline: {}'.format(opts.threshold, ', '.join(failed)))
        sys.exit(1)
    print('OK: every entry at or above {:.2f} of the baseline'.format(opts.threshold))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest='cmd', required=True)
    r = sub.add_parser('run')
    r.add_argument('--suite', required=True)
    r.add_argument('--repeats', type=int, default=3)
    r.add_argument('--out')
    r.add_argument('--imgtrain')
    c = sub.add_parser('compare')
    c.add_argument('baseline')
    c.add_argument('now')
    c.add_argument('--threshold', type=float, default=0.90)
    opts = p.parse_args()
    (cmd_run if opts.cmd == 'run' else cmd_compare)(opts)


if __name__ == '__main__':
    main()
