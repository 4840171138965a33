#!/usr/bin/env python3
"""The headline against the distinct-page truth on a busy machine.

    HOGS=4 bench/busy_truth.py MEMTRACK tests/it/jobs/busy_JOB.py [memtrack args, e.g. --host-source pss]

Runs JOB (the jobs tests/it/busy.rs runs: busy_readers.py,
busy_subprocesses.py, busy_restart.py, busy_shm_churn.py; each counts its
tree's distinct PFNs from pagemap in steady windows, with
tests/it/jobs/prelude.py) under `memtrack run --interval 100ms` at the default
budget, with HOGS busy loops beside it, and prints the lowest and highest
ratio of any timer sample in a window to that window's truth, and the peak
against the largest truth. Root needed (PFNs). DUMP=1 prints the samples
outside 5 % and keeps memtrack's debug log in the run folder.
"""
import json, os, subprocess, sys, tempfile, time, glob
mt, job = sys.argv[1], sys.argv[2]
extra = sys.argv[3:]
hogs = int(os.environ.get('HOGS', '4'))
d = tempfile.mkdtemp(prefix='busy-')
win = os.path.join(d, 'windows')
script = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'tests', 'it', 'jobs', 'prelude.py')).read() + '\n' + open(job).read()
hp = [subprocess.Popen(['sh', '-c', 'while :; do :; done']) for _ in range(hogs)]
try:
    env = {k: v for k, v in os.environ.items() if not k.startswith('MEMTRACK_')}
    r = subprocess.run([mt, 'run', '--interval', '100ms', '--listen', 'off', '--output', d + '/runs', *extra, *(['--log-level', 'debug'] if os.environ.get('DUMP') else []),
                        '--', sys.executable, '-c', script, win], env=env, capture_output=True, text=True)
finally:
    for h in hp: h.kill()
    for h in hp: h.wait()
if os.environ.get('DUMP'): open(os.path.join(d, 'memtrack.log'),'w').write(r.stderr)
if r.returncode != 0:
    print(r.stderr[-3000:]); sys.exit(1)
doc = json.load(open(glob.glob(d + '/runs/*/memory_usage.json')[0]))
ws = [tuple(float(x) for x in l.split()) for l in open(win)] if os.path.exists(win) else []
worst = 1.0; lo, hi = 9, 0
for t0, t1, tr in ws:
    tr /= 1 << 20
    for e in doc['detailed_log']:
        if e.get('kind', 'timer') == 'timer' and t0 <= e['timestamp'] <= t1:
            q = e['cpu_ram_used_mb'] / tr
            lo, hi = min(lo, q), max(hi, q)
            if os.environ.get('DUMP') and (q < 0.95 or q > 1.05): print(f"  t={e['timestamp']-t0:.2f} used={e['cpu_ram_used_mb']:.1f} truth={tr:.1f}")
most = max((w[2] for w in ws), default=0) / (1 << 20)
peak = doc['peak_usage']['cpu_ram_used_mb']
print(f"{os.path.basename(job)} {' '.join(extra)}: windows {len(ws)} ratio min {lo:.3f} max {hi:.3f}; peak {peak:.1f} vs {most:.1f} ({peak/most if most else 0:.3f}) source {doc['host']['source']} reads {doc['host'].get('pss_reads')}")
