b = bytearray(200 << 20); touch(b)
for epoch in range(3):
    kids = []
    for i in range(4):
        pid = os.fork()
        if pid == 0:
            c = bytearray(15 << 20); touch(c)
            hold_then_exit(6)
        kids.append(pid)
    time.sleep(0.6)
    steady([os.getpid()] + kids, hold=1.0)
    for k in kids: os.waitpid(k, 0)
    time.sleep(0.3)
