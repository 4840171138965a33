import os, sys, struct, time, mmap
OUT = sys.argv[1]
PAGE = os.sysconf('SC_PAGE_SIZE')
def pfns(pid, out):
    try:
        maps = open(f'/proc/{pid}/maps').read().splitlines()
        fd = os.open(f'/proc/{pid}/pagemap', os.O_RDONLY)
    except OSError:
        return
    try:
        for line in maps:
            parts = line.split()
            a, b = (int(x, 16) for x in parts[0].split('-'))
            if a >= 0xffff000000000000: continue
            off, n = (a // PAGE) * 8, (b - a) // PAGE
            while n > 0:
                k = min(n, 1 << 16)
                try: data = os.pread(fd, k * 8, off)
                except OSError: break
                if not data: break
                for (v,) in struct.iter_unpack('<Q', data):
                    if v >> 63:
                        pfn = v & ((1 << 55) - 1)
                        if pfn == 0: raise SystemExit('PFNs read as 0: not root')
                        out.add(pfn)
                off += len(data); n -= len(data) // 8
    finally:
        os.close(fd)
def truth(pids):
    s = set()
    for p in pids: pfns(p, s)
    return len(s) * PAGE
def touch(buf):
    for i in range(0, len(buf), PAGE): buf[i] = 1
def steady(pids, hold=2.5):
    t0 = time.time(); a = truth(pids)
    time.sleep(hold)
    b = truth(pids); t1 = time.time()
    if abs(a - b) <= 0.03 * max(a, b):
        with open(OUT, 'a') as f: f.write(f'{t0} {t1} {(a + b) // 2}\n')
def hold_then_exit(sec):
    time.sleep(sec); os._exit(0)
