path = f'/dev/shm/memtrack-busy-{os.getpid()}'
for r in range(3):
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, 200 << 20)
    m = mmap.mmap(fd, 200 << 20); touch(m)
    kids = []
    for i in range(3):
        pid = os.fork()
        if pid == 0:
            m2 = mmap.mmap(fd, 200 << 20, prot=mmap.PROT_READ)
            s = sum(m2[j] for j in range(0, len(m2), PAGE))
            hold_then_exit(6.5)
        kids.append(pid)
    time.sleep(3.5)
    steady([os.getpid()] + kids, hold=1.0)
    for k in kids: os.waitpid(k, 0)
    m.close(); os.close(fd); os.unlink(path)
    time.sleep(0.5)
