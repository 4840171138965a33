b = bytearray(500 << 20); touch(b)
kids = []
for i in range(4):
    pid = os.fork()
    if pid == 0:
        t = time.time()
        while time.time() - t < 8:
            s = sum(b[j] for j in range(0, len(b), 1 << 16))
            time.sleep(0.2)
        os._exit(0)
    kids.append(pid)
time.sleep(0.3)
steady([os.getpid()] + kids)
for k in kids: os.waitpid(k, 0)
time.sleep(0.5)
steady([os.getpid()])
