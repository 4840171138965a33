# Non-persistent DataLoader workers: each epoch forks 4 workers beside a
# 64 MiB parent; each grows to 24 MiB of its own in about a second, holds
# it for 3 s and exits. Just before it exits each writes its PID, birth,
# end and its own USS (Private_Clean + Private_Dirty of its smaps_rollup).
def my_uss():
    kib = 0
    for line in open('/proc/self/smaps_rollup'):
        f = line.split()
        if f[0] in ('Private_Clean:', 'Private_Dirty:'): kib += int(f[1])
    return kib * 1024
b = bytearray(64 << 20); touch(b)
for epoch in range(3):
    kids = []
    for i in range(4):
        pid = os.fork()
        if pid == 0:
            born = time.time()
            parts = []
            for step in range(6):
                c = bytearray(4 << 20); touch(c); parts.append(c)
                time.sleep(0.15)
            time.sleep(3.0)
            u = my_uss()
            with open(OUT, 'a') as f: f.write(f'{os.getpid()} {born} {time.time()} {u}\n')
            os._exit(0)
        kids.append(pid)
    for k in kids: os.waitpid(k, 0)
    time.sleep(0.3)
