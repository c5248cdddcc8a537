"""CI benchmark jobs: run a suite of `imgtrain benchmark` settings (with timm eager as an in-run
reference where the suite asks for it) into one JSON file of records, and compare such a file with
a baseline, failing when a ratio falls below a threshold.

  ci_bench.py run --suite bench/suites/ci-cpu.yaml [--repeats 3] [--out results.json] [--imgtrain BIN]
  ci_bench.py compare BASELINE.json NOW.json [--threshold 0.90]
  ci_bench.py table RESULTS.json      (a markdown table: scripts/gpu_check.sh's report)

A suite (bench/suites/*.yaml) names its `device` (cpu unless said; --device overrides) and entries:
`name`, `args` (imgtrain benchmark flags, the same for timm's script), `reference: timm` (timm
eager measured in the same round), `cuda_graph: true` (imgtrain also with --cuda-graph),
`compiled: true` (timm also under torch.compile, after every other command of the round).

A record per entry and mode (infer / train): imgtrain's median samples/s over the repeats and its
spread (min, max), the reference's median and the ratio imgtrain / reference, plus what the
numbers depend on (imgtrain version and commit, torch version, CPU, threads, batch, image size,
AMP / channels-last). Repeats alternate over the entries and between imgtrain and the reference
(round 1: all entries, round 2: all entries, ...), so slow drift of a noisy machine hits every
entry alike; the ratio is the median of the rounds' ratios (each round's two sides ran back to
back). `compare` judges the ratio to the reference where both files have one (a faster or
slower machine moves both sides), else samples/s, and exits 1 naming each entry below threshold.
The environment variable IMGTRAIN_BENCH_SLOWDOWN=F (test hook, read by `imgtrain benchmark`)
makes every timed step F x slower, to check that a regression is caught. With --keep-going a
failed command is recorded (`errors` in the record) and the rest still run; --deadline stops
starting commands after that many seconds and keeps what was measured (the GPU check's budget).
A run exits 1 when a command failed (without --keep-going) or when nothing at all was measured.
Every user error (a missing or malformed suite, an unknown entry key, a bad flag value) is one
line on stderr, `ci_bench: ...`, and exit 2. Flags that start with a dash go to --extra-args with
`=`: --extra-args='--num-bench-iter 50'.
"""
import argparse
import json
import math
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


class SideFailed(RuntimeError):
    pass


class UsageError(RuntimeError):
    """A mistake of the caller: one line on stderr, exit 2."""


ENTRY_KEYS = {'name': str, 'args': str, 'reference': str, 'cuda_graph': bool, 'compiled': bool}
MODEL_BENCHES = ('both', 'train', 'inference')


def parse_file(path, parse):
    """parse(open file) of `path`; a file that cannot be read is a one-line UsageError."""
    try:
        with open(path) as f:
            return parse(f)
    except OSError as e:
        raise UsageError('{}: {}'.format(path, e.strerror))


def load_json_records(path):
    """A results file: a list of records, each a mapping with name and mode."""
    try:
        records = parse_file(path, json.load)
    except ValueError as e:
        raise UsageError('{}: not JSON ({})'.format(path, e))
    if not isinstance(records, list) or not all(isinstance(r, dict) and 'name' in r and 'mode' in r
                                                for r in records):
        raise UsageError('{}: not a ci_bench results file (a list of records with name and mode)'.format(path))
    seen = set()
    for r in records:
        key = (r['name'], r['mode'])
        if key in seen:
            raise UsageError('{}: {} {} appears twice'.format(path, *key))
        seen.add(key)
        for k in ('samples_per_sec', 'ratio', 'reference_samples_per_sec'):
            if k in r and (isinstance(r[k], bool) or not isinstance(r[k], (int, float))):
                raise UsageError('{}: {} {}: {} is not a number'.format(path, key[0], key[1], k))
        if not isinstance(r.get('errors', {}), dict):
            raise UsageError('{}: {} {}: errors is not a mapping'.format(path, *key))
    return records


def load_suite(path):
    """The suite file, checked: every mistake is a one-line UsageError naming the file and entry."""
    try:
        suite = parse_file(path, yaml.safe_load)
    except yaml.YAMLError as e:
        mark = getattr(e, 'problem_mark', None)
        where = ' (line {})'.format(mark.line + 1) if mark else ''
        raise UsageError('{}: not valid YAML{}: {}'.format(path, where, getattr(e, 'problem', None) or e))
    if not isinstance(suite, dict):
        raise UsageError('{}: a suite is a mapping with `entries` (and optionally `device`)'.format(path))
    unknown = sorted(set(suite) - {'entries', 'device'})
    if unknown:
        raise UsageError('{}: unknown key {} (a suite has `device` and `entries`)'.format(path, unknown[0]))
    device = suite.get('device', 'cpu')
    if not isinstance(device, str) or not device.strip():
        raise UsageError('{}: `device` must be a device name such as cpu or cuda'.format(path))
    entries = suite.get('entries')
    if not isinstance(entries, list) or not entries:
        raise UsageError('{}: `entries` must be a non-empty list of entries (- name: ..., args: ...)'.format(path))
    seen = set()
    for i, e in enumerate(entries):
        where = '{}: entry {}'.format(path, i + 1)
        if not isinstance(e, dict):
            raise UsageError('{}: an entry is a mapping with `name` and `args`'.format(where))
        for k, v in e.items():
            if k not in ENTRY_KEYS:
                raise UsageError('{}: unknown key `{}` (known: {})'.format(where, k, ', '.join(ENTRY_KEYS)))
            if not isinstance(v, ENTRY_KEYS[k]):
                kind = 'true or false' if ENTRY_KEYS[k] is bool else 'a string'
                if k == 'args' and isinstance(v, list):
                    kind += " (one line of flags: args: --model resnet50 -b 8)"
                raise UsageError('{}: `{}` must be {}, not {!r}'.format(where, k, kind, v))
        for k in ('name', 'args'):
            if not str(e.get(k, '')).strip():
                raise UsageError('{}: `{}` is missing'.format(where, k))
        where = '{}: entry {}'.format(path, e['name'])
        if e['name'] in seen:
            raise UsageError('{}: the name is used twice (records are keyed by name)'.format(where))
        seen.add(e['name'])
        if e.get('reference', 'timm') != 'timm':
            raise UsageError('{}: reference {!r}: the only reference is timm'.format(where, e['reference']))
        try:
            args = shlex.split(e['args'])
        except ValueError as err:
            raise UsageError('{}: args: {}'.format(where, err))
        if not arg_value(args, '--model'):
            raise UsageError('{}: args need --model'.format(where))
        if arg_value(args, '--bench', default='both') not in MODEL_BENCHES:
            raise UsageError('{}: --bench {}: ci_bench measures models (both, train, inference); run data '
                             'benchmarks with imgtrain benchmark directly'.format(where, arg_value(args, '--bench')))
    return device, entries


def run_cmd(cmd, timeout=None):
    try:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise SideFailed('{} ran past the deadline ({:.0f} s left)'.format(' '.join(cmd[:2]), timeout))
    if p.returncode != 0:
        print(p.stdout[-3000:], flush=True)
        last = [l for l in p.stdout.splitlines() if l.strip()]
        raise SideFailed('{} exited {}: {}'.format(os.path.basename(cmd[1] if cmd[0] == sys.executable else cmd[0]),
                                                   p.returncode, last[-1][:300] if last else 'no output'))
    try:
        return result_json(p.stdout)
    except (RuntimeError, ValueError) as e:
        raise SideFailed(str(e))


def cpu_name():
    try:
        with open('/proc/cpuinfo') as f:
            for line in f:
                if line.startswith('model name'):
                    return line.split(':', 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or 'unknown'


def gpu_name():
    try:
        import torch
        if torch.cuda.is_available():
            return torch.cuda.get_device_name()
    except ImportError:
        pass
    try:
        out = subprocess.run(['nvidia-smi', '--query-gpu=name', '--format=csv,noheader'], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True, timeout=30).stdout.strip().splitlines()
        if out:
            return out[0].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return 'unknown (no CUDA in this Python, no nvidia-smi)'


def device_name(device):
    return (device + ': ' + gpu_name()) if device.startswith('cuda') else (device + ': ' + cpu_name())


def environment(imgtrain, device):
    """What the numbers depend on. The device is the one the commands were given, not this Python's."""
    lines = subprocess.run([imgtrain, '--version'], stdout=subprocess.PIPE, text=True).stdout.strip().splitlines()
    version = lines[0] if lines else 'unknown'
    # the second line says which GEMM kernels MKL took (Intel's paths on AMD CPUs: docs/performance.md)
    mkl = next((l[len('MKL: '):] for l in lines[1:] if l.startswith('MKL: ')), 'unknown')
    commit = os.environ.get('GIT_COMMIT') or subprocess.run(
        ['git', '-C', HERE, 'rev-parse', '--short', 'HEAD'], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        text=True).stdout.strip()
    try:
        import torch
        torch_version, threads = torch.__version__, torch.get_num_threads()
    except ImportError:
        torch_version, threads = 'not installed', os.cpu_count()
    name = device_name(device)
    return {'imgtrain_version': version, 'git_commit': commit or 'unknown', 'torch_version': torch_version,
            'device': name, 'threads': threads, 'mkl': mkl}


def arg_value(args, *names, default=None):
    value = default
    for i, a in enumerate(args):  # the last occurrence wins, as in both command lines
        for n in names:
            if a == n and i + 1 < len(args):
                value = args[i + 1]
            elif a.startswith(n + '='):
                value = a.split('=', 1)[1]
    return value


def flag_on(args, name):
    """A boolean flag as both command lines read it: --x, --x=true/false; the last occurrence wins."""
    on = False
    for a in args:
        if a == name:
            on = True
        elif a.startswith(name + '='):
            on = a.split('=', 1)[1].lower() in ('1', 'true', 'yes', 'on')
    return on


# The sides an entry measures: (side, extra flags, runs timm's script, runs after every other side
# of the round). imgtrain always; the others where the entry asks for them.
def entry_sides(e):
    sides = [('imgtrain', [], False, False)]
    if e.get('cuda_graph'):
        sides.append(('graph', ['--cuda-graph'], False, False))
    if e.get('reference') == 'timm':
        sides.append(('reference', [], True, False))
    if e.get('compiled'):  # timm under torch.compile: its compilation is slow, so last in a round
        sides.append(('compiled', ['--torchcompile'], True, True))
    return sides


def entry_args(e, opts):
    return shlex.split(e['args']) + shlex.split(opts.extra_args or '')


def make_records(entries, samples, extras, errors, env, opts):
    records = []
    for e in entries:
        args = entry_args(e, opts)
        bench = arg_value(args, '--bench', default='both')
        for mode in {'train': ('train',), 'inference': ('infer',)}.get(bench, MODES):
            side = {s: samples.get((e['name'], mode, s), {}) for s in ('imgtrain', 'reference', 'graph', 'compiled')}
            ours = list(side['imgtrain'].values())
            errs = {s: m for (n, s), m in errors.items() if n == e['name']}
            if not ours and not errs:
                continue
            rec = {'name': e['name'], 'mode': mode, 'model': arg_value(args, '--model')}
            if ours:
                rec.update({'samples_per_sec': round(statistics.median(ours), 3),
                            'spread': [round(min(ours), 3), round(max(ours), 3)], 'repeats': len(ours)})
            ref = side['reference']
            if ref:
                rec['reference'] = e['reference']
                rec['reference_samples_per_sec'] = round(statistics.median(ref.values()), 3)
                # the median of each round's ratio (the two sides of a round ran back to back), over
                # the rounds where both sides have a number
                paired = [side['imgtrain'][r] / ref[r] for r in sorted(ref) if r in side['imgtrain'] and ref[r]]
                if paired:
                    rec['ratio'] = round(statistics.median(paired), 4)
                    rec['ratio_rounds'] = len(paired)
            graph = side['graph']
            if graph:
                rec['graph_samples_per_sec'] = round(statistics.median(graph.values()), 3)
            comp = side['compiled']
            if comp:
                rec['compiled_samples_per_sec'] = round(statistics.median(comp.values()), 3)
                best = max(rec.get('samples_per_sec', 0), rec.get('graph_samples_per_sec', 0))
                if best:
                    rec['ratio_best_to_compiled'] = round(best / rec['compiled_samples_per_sec'], 4)
            if errs:
                rec['errors'] = errs
            batch = arg_value(args, '-b', '--batch-size', default='256')
            amp = flag_on(args, '--amp')
            rec.update({'batch_size': int(batch) if batch.isdigit() else batch,
                        'img_size': arg_value(args, '--img-size'), 'amp': amp,
                        'amp_dtype': arg_value(args, '--amp-dtype') if amp else None,
                        'channels_last': flag_on(args, '--channels-last'), 'cuda_graph': bool(graph)})
            # what the commands ran (imgtrain's own result: its CPU defaults may be channels-last)
            # over what their flags say
            for k, v in extras.get((e['name'], mode), {}).items():
                if k != 'reference_channels_last' or ref:
                    rec[k] = v
            rec.update(env)
            # the device this entry's commands ran on: ci_bench's --device, unless the entry's own
            # flags (or --extra-args) name another; the last --device wins
            dev = arg_value(args, '--device', default=opts.run_device)
            if dev != opts.run_device:
                rec['device'] = device_name(dev)
            records.append(rec)
    return records


def cmd_run(opts):
    if opts.repeats < 1:
        raise UsageError('--repeats {}: at least 1'.format(opts.repeats))
    if opts.deadline is not None and not (math.isfinite(opts.deadline) and opts.deadline >= 10):
        raise UsageError('--deadline {:g}: seconds, at least 10 (no command starts in its last 5 s; leave it out '
                         'for no deadline)'.format(opts.deadline))
    if opts.device is not None and not opts.device.strip():
        raise UsageError('--device is empty')
    device, entries = load_suite(opts.suite)
    device = opts.device or device
    opts.run_device = device
    if opts.only is not None:
        wanted = set(opts.only.replace(',', ' ').split())
        if not wanted:
            raise UsageError('--only names no entry')
        unknown = wanted - {e['name'] for e in entries} - {arg_value(shlex.split(e['args']), '--model') for e in entries}
        if unknown:
            raise UsageError('--only: {} has no entry or model {}'.format(opts.suite, ', '.join(sorted(unknown))))
        entries = [e for e in entries if e['name'] in wanted or arg_value(shlex.split(e['args']), '--model') in wanted]
    try:
        extra = shlex.split(opts.extra_args or '')
    except ValueError as err:
        raise UsageError('--extra-args: {}'.format(err))
    for e in entries:
        args = shlex.split(e['args']) + extra
        if arg_value(args, '--bench', default='both') not in MODEL_BENCHES:
            raise UsageError('--extra-args: --bench {}: ci_bench measures models'.format(arg_value(args, '--bench')))
        if e.get('compiled'):
            warm = arg_value(args, '--num-warm-iter', default='10')
            if not warm.isdigit() or int(warm) < 1:
                raise UsageError('entry {}: --num-warm-iter {}: `compiled: true` needs warm-up steps (torch.compile '
                                 'compiles in the first ones, which would be timed)'.format(e['name'], warm))
    imgtrain = opts.imgtrain or os.path.join(HERE, 'build', 'bin', 'imgtrain')
    if not (os.path.isfile(imgtrain) and os.access(imgtrain, os.X_OK)):
        raise UsageError('{}: no imgtrain binary there (build it with scripts/build.sh, or pass --imgtrain)'.format(
            imgtrain))
    if opts.out is not None:
        parent = os.path.dirname(os.path.abspath(opts.out))
        if not opts.out or os.path.isdir(opts.out) or not os.path.isdir(parent):
            raise UsageError('--out {}: a file in an existing folder'.format(opts.out))
        if os.path.exists(opts.out) and os.path.samefile(opts.out, opts.suite):
            raise UsageError('--out {}: that is the suite file'.format(opts.out))
    if opts.out and os.path.exists(opts.out):
        os.remove(opts.out)  # a run that fails early must not leave an older run's numbers behind
    env = environment(imgtrain, device)
    samples = {}  # (name, mode, side) -> {round: samples/s}
    extras = {}  # (name, mode) -> imgtrain's memory fields and the layout it ran
    errors = {}  # (name, side) -> the first failure
    start = time.time()
    deadline = start + opts.deadline if opts.deadline else None

    def write():
        records = make_records(entries, samples, extras, errors, env, opts)
        if opts.out:
            with open(opts.out + '.tmp', 'w') as f:
                f.write(json.dumps(records, indent=2) + '\n')
            os.replace(opts.out + '.tmp', opts.out)
        return records

    for r in range(opts.repeats):
        late = []
        for e in entries:
            sides = entry_sides(e)
            now, after = [s for s in sides if not s[3]], [s for s in sides if s[3]]
            if r % 2:
                now.reverse()  # alternate which side runs first
            late += [(e, s) for s in after]
            for side in now:
                try:
                    measure(e, side, r, device, imgtrain, samples, extras, errors, deadline, opts)
                except SideFailed as err:
                    write()
                    sys.exit('ci_bench: {} {}: {}'.format(e['name'], side[0], err))
            print('round {}/{} {:<24s} done ({:.0f} s)'.format(r + 1, opts.repeats, e['name'], time.time() - start),
                  flush=True)
            write()
        for e, side in late:
            try:
                measure(e, side, r, device, imgtrain, samples, extras, errors, deadline, opts)
            except SideFailed as err:
                write()
                sys.exit('ci_bench: {} {}: {}'.format(e['name'], side[0], err))
            write()
    records = write()
    print(json.dumps(records, indent=2))
    skipped = [k for k, m in errors.items() if m.startswith(NOT_RUN)]
    if skipped:
        print('ci_bench: the deadline ({:g} s) passed: {} command(s) not run ({})'.format(
            opts.deadline, len(skipped), ', '.join('{} {}'.format(*k) for k in skipped)), file=sys.stderr)
    failed = [k for k, m in errors.items() if not m.startswith(NOT_RUN)]
    if failed:
        print('ci_bench: {} command(s) failed: {}'.format(len(failed), ', '.join('{} {}'.format(*k) for k in failed)),
              file=sys.stderr)
    if not any('samples_per_sec' in rec for rec in records):
        sys.exit('ci_bench: nothing was measured')
    if failed and not opts.keep_going:
        sys.exit(1)


NOT_RUN = 'not run: '


def measure(e, side, rnd, device, imgtrain, samples, extras, errors, deadline, opts):
    name, flags, timm, _ = side
    if (e['name'], name) in errors:
        return  # failed in an earlier round: not again
    left = None
    if deadline:
        left = deadline - time.time()
        if left < 5:
            errors[(e['name'], name)] = NOT_RUN + 'the deadline ({:g} s) had passed'.format(opts.deadline)
            return
    base = [sys.executable, os.path.join(HERE, 'bench', 'timm_benchmark.py')] if timm else [imgtrain, 'benchmark']
    args = entry_args(e, opts)
    cmd = base + ['--device', device] + args + flags
    if timm:
        # the same memory format on both sides: where imgtrain ran channels-last by its own default
        # (CPU training of the ResNet, EfficientNet and MobileNetV3 families) in every mode it
        # measured, timm gets --channels-last too (imgtrain runs first in the first round)
        ran = [v['channels_last'] for (n, _), v in extras.items() if n == e['name'] and 'channels_last' in v]
        if ran and all(ran) and not flag_on(args, '--channels-last'):
            cmd.append('--channels-last')
        for (n, _), v in extras.items():
            if n == e['name']:
                v['reference_channels_last'] = flag_on(cmd, '--channels-last')
    try:
        res = run_cmd(cmd, timeout=left)
    except SideFailed as err:
        if not opts.keep_going:
            raise
        errors[(e['name'], name)] = str(err)
        print('{} {}: FAILED: {}'.format(e['name'], name, err), flush=True)
        return
    for mode in MODES:
        v = res.get(mode + '_samples_per_sec')
        if v is not None:
            samples.setdefault((e['name'], mode, name), {})[rnd] = float(v)
        if name == 'imgtrain':
            for k in ('max_allocated_mb', 'max_reserved_mb', 'channels_last', 'fuse_bn'):
                if mode + '_' + k in res:
                    extras.setdefault((e['name'], mode), {})[k] = res[mode + '_' + k]


def fmt(v, digits=1):
    return '{:.{}f}'.format(v, digits) if isinstance(v, (int, float)) else (v if v else '-')


def cmd_table(opts):
    records = load_json_records(opts.results)
    print('| entry | mode | imgtrain /s | imgtrain --cuda-graph /s | timm eager /s | timm compiled /s | '
          'imgtrain / eager | best imgtrain / compiled | imgtrain max alloc MB |')
    print('| --- | --- | --- | --- | --- | --- | --- | --- | --- |')
    for r in records:
        errs = r.get('errors', {})

        def cell(key, side, digits=1):
            if key in r:
                return fmt(r.get(key), digits)
            if side in errs:
                return 'not run' if errs[side].startswith(NOT_RUN) else 'failed'
            return '-'
        print('| {} | {} | {} | {} | {} | {} | {} | {} | {} |'.format(
            r['name'], r['mode'], cell('samples_per_sec', 'imgtrain'), cell('graph_samples_per_sec', 'graph'),
            cell('reference_samples_per_sec', 'reference'), cell('compiled_samples_per_sec', 'compiled'),
            fmt(r.get('ratio'), 3), fmt(r.get('ratio_best_to_compiled'), 3), fmt(r.get('max_allocated_mb'), 0)))
    failures = {}
    for r in records:
        for side, msg in r.get('errors', {}).items():
            failures[(r['name'], side)] = msg
    if failures:
        print()
    for (name, side), msg in failures.items():
        print('- {} {}: {}'.format(name, side, msg))


def cmd_compare(opts):
    if not (math.isfinite(opts.threshold) and opts.threshold > 0):
        raise UsageError('--threshold {:g}: a ratio above 0, e.g. 0.90'.format(opts.threshold))
    base_list, now_list = load_json_records(opts.baseline), load_json_records(opts.now)
    if not any('samples_per_sec' in r for r in base_list):
        raise UsageError('{}: the baseline has no measured record'.format(opts.baseline))
    base = {(r['name'], r['mode']): r for r in base_list}
    now = {(r['name'], r['mode']): r for r in now_list}
    below, missing, failed = [], [], []
    print('{:<24s} {:<6s} {:>8s} {:>12s} {:>12s} {:>7s}'.format('entry', 'mode', 'measure', 'baseline', 'now',
                                                              'ratio'))
    for key, b in base.items():
        n = now.get(key)
        if 'samples_per_sec' not in b:
            print('{:<24s} {:<6s} not measured in the baseline: skipped'.format(*key))
            continue
        if n is None:
            print('{:<24s} {:<6s} missing from {}'.format(key[0], key[1], opts.now))
            missing.append('{} {}'.format(*key))
            continue
        if 'samples_per_sec' not in n:
            why = '; '.join('{}: {}'.format(s, m) for s, m in n.get('errors', {}).items()) or 'no number'
            print('{:<24s} {:<6s} failed: {}'.format(key[0], key[1], why[:200]))
            failed.append('{} {}'.format(*key))
            continue
        differ = ['{} {} -> {}'.format(k, b[k], n[k]) for k in ('channels_last', 'reference_channels_last', 'fuse_bn')
                  if k in b and k in n and b[k] != n[k]]
        if differ:
            print('{:<24s} {:<6s} failed: not comparable, the commands ran another way ({}); refresh the baseline '
                  '(docs/benchmarks.md)'.format(key[0], key[1], ', '.join(differ)))
            failed.append('{} {} (layout)'.format(*key))
            continue
        if 'ratio' in b and 'ratio' not in n:
            why = n.get('errors', {}).get('reference', 'no reference number')
            print('{:<24s} {:<6s} failed: the reference did not measure: {}'.format(key[0], key[1], why[:200]))
            failed.append('{} {} (reference)'.format(*key))
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
            below.append('{} {} ({:.3f})'.format(key[0], key[1], ratio))
    for key in now:
        if key not in base:
            print('{:<24s} {:<6s} new: not in the baseline'.format(*key))
    problems = []
    if below:
        problems.append('below {:.2f} of the baseline: {}'.format(opts.threshold, ', '.join(below)))
    if missing:
        problems.append('missing: {}'.format(', '.join(missing)))
    if failed:
        problems.append('failed: {}'.format(', '.join(failed)))
    if problems:
        print('FAILED: ' + '; '.join(problems))
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
    r.add_argument('--device', help="the device of every command (default: the suite's `device`, else cpu)")
    r.add_argument('--only', help='entries (names or models, comma- or space-separated) to run')
    r.add_argument('--extra-args', help="flags appended to every command (the last of a repeated flag wins); "
                   "give them with =: --extra-args='--num-bench-iter 50'")
    r.add_argument('--deadline', type=float, help='seconds: no command starts after this, records so far are kept')
    r.add_argument('--keep-going', action='store_true', help='record a failed command and go on (exit 0 unless nothing was measured)')
    t = sub.add_parser('table')
    t.add_argument('results')
    c = sub.add_parser('compare')
    c.add_argument('baseline')
    c.add_argument('now')
    c.add_argument('--threshold', type=float, default=0.90)
    opts = p.parse_args()
    try:
        {'run': cmd_run, 'compare': cmd_compare, 'table': cmd_table}[opts.cmd](opts)
    except UsageError as err:
        print('ci_bench: {}'.format(err), file=sys.stderr)
        sys.exit(2)


if __name__ == '__main__':
    main()
