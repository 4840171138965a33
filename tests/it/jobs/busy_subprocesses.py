import subprocess
b = bytearray(600 << 20); touch(b)
shm = f'/dev/shm/memtrack-busy-{os.getpid()}'
stop = OUT + '.stop'
kids = []
for i in range(2):
    pid = os.fork()
    if pid == 0:
        while not os.path.exists(stop):
            fd = os.open(f'{shm}-{i}', os.O_RDWR | os.O_CREAT, 0o600)
            os.ftruncate(fd, 4 << 20)
            m = mmap.mmap(fd, 4 << 20); touch(m); m.close(); os.close(fd)
            os.unlink(f'{shm}-{i}')
            time.sleep(0.1)
        os._exit(0)
    kids.append(pid)
time.sleep(1.0)
for r in range(3):
    t0 = time.time(); a = truth([os.getpid()] + kids)
    subprocess.run([sys.executable, '-c', 'pass'])
    os.system('true')
    subprocess.run('ls /proc/self/ | wc -l > /dev/null', shell=True)
    os.system(sys.executable + ' -c pass')
    subprocess.run('grep -c Vm /proc/self/status | sort > /dev/null', shell=True)
    b2 = truth([os.getpid()] + kids); t1 = time.time()
    if abs(a - b2) <= 0.03 * max(a, b2):
        with open(OUT, 'a') as f: f.write(f'{t0} {t1} {(a + b2) // 2}\n')
open(stop, 'w').close()
for k in kids: os.waitpid(k, 0)
