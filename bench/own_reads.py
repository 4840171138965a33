#!/usr/bin/env python3
"""Own-cost readings of short-lived workers on a busy machine.

    HOGS=4 PARENT_MB=64 STEP_MB=4 HOLD_S=3 bench/own_reads.py MEMTRACK [memtrack args]

Runs tests/it/jobs/busy_epoch_own.py (3 epochs of 4 forked workers, each
growing by 6 steps of STEP_MB beside a PARENT_MB parent and holding HOLD_S
seconds; each writes the USS it reads itself just before it exits) under
`memtrack run --interval 100ms` at the default budget with HOGS busy loops
beside it, and prints each worker's own-cost readings (seconds after its
birth, USS MiB), the reader thread's reads and CPU time, and how many
workers have a peak own cost, and a figure at their end, within 10 % of
their own USS (an estimate counts, and is counted apart: marked `~`).
Defaults are the test's sizes; PARENT_MB=200 STEP_MB=8 HOLD_S=2 is the
larger job of docs/host-figure.md. COPY=1 makes each step copy STEP_MB of
the parent's pages (a write to each: copy on write, as Python's reference
counts do on read) instead of allocating it: RSS does not move.
"""
import json, os, subprocess, sys, tempfile, glob
mt = sys.argv[1]
extra = sys.argv[2:]
hogs = int(os.environ.get('HOGS', '4'))
here = os.path.dirname(os.path.abspath(__file__))
jobs = os.path.join(here, '..', 'tests', 'it', 'jobs')
job = open(os.path.join(jobs, 'busy_epoch_own.py')).read()
if os.environ.get('COPY') == '1':
    step = int(os.environ.get('STEP_MB', '4'))
    copy = job.replace('c = bytearray(4 << 20); touch(c); parts.append(c)',
                      f'touch(memoryview(b)[step * ({step} << 20):(step + 1) * ({step} << 20)])')
    assert copy != job, 'the job steps as this bench expects'
    job = copy
job = job.replace('bytearray(64 << 20)', f"bytearray({int(os.environ.get('PARENT_MB', '64'))} << 20)")
job = job.replace('bytearray(4 << 20)', f"bytearray({int(os.environ.get('STEP_MB', '4'))} << 20)")
job = job.replace('time.sleep(3.0)', f"time.sleep({float(os.environ.get('HOLD_S', '3'))})")
script = open(os.path.join(jobs, 'prelude.py')).read() + '\n' + job
d = tempfile.mkdtemp(prefix='own-reads-')
out = os.path.join(d, 'workers')
me = os.getpid()
hp = [subprocess.Popen(['sh', '-c', f'while kill -0 {me} 2>/dev/null; do :; done']) for _ in range(hogs)]
try:
    env = {k: v for k, v in os.environ.items() if not k.startswith('MEMTRACK_')}
    r = subprocess.run([mt, 'run', '--interval', '100ms', '--listen', 'off', '--output', d + '/runs', *extra,
                        '--', sys.executable, '-c', script, out], env=env, capture_output=True, text=True)
finally:
    for h in hp: h.kill()
    for h in hp: h.wait()
if r.returncode:
    sys.exit(r.stderr)
doc = json.load(open(glob.glob(d + '/runs/*/memory_usage.json')[0]))
rows = {t['pid']: t for t in doc['targets']}
near = n = at_end = estimated = 0
for line in open(out):
    pid, born, end, uss = line.split()
    pid, born, end, uss = int(pid), float(born), float(end), int(uss) / 2**20
    t = rows.get(pid, {})
    reads = [(round(p[0] - born, 2), round(p[1], 1)) for p in t.get('own_series', [])]
    best = t.get('peak_uss_mb') or 0.0
    last = t.get('uss_mb') or 0.0
    ok = abs(best - uss) <= 0.1 * uss
    ok_end = abs(last - uss) <= 0.1 * uss
    est = t.get('peak_uss_estimated', False)
    near += ok; n += 1; at_end += ok_end; estimated += ok and est
    print(f"worker {pid}: lived {end - born:.2f} s, USS {uss:.1f} MiB, readings {reads}, "
          f"peak {'~' if est else ''}{best:.1f}, at its end {'~' if t.get('own_estimated') else ''}{last:.1f}"
          f"{'' if ok else '  <- none near'}{'' if ok_end else '  <- off at its end'}")
h = doc.get('host') or {}
if h.get('pss_reads'):
    print(f"reader: {h['pss_reads']} process reads (own cost and page count), "
          f"{h['pss_read_s'] * 1e3:.0f} ms of CPU over {doc['summary']['duration_s']:.1f} s")
print(f"{near}/{n} workers have a peak within 10 % of their USS ({estimated} of them estimated), "
      f"{at_end}/{n} a figure at their end within 10 %")
