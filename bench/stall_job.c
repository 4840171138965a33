/* A job for bench/stall: holds GIB GiB of anonymous memory (touched), forks
 * PROCS-1 workers that share it (copy on write, never written), then times
 * its own mmap + first touch + munmap of 1 MiB every millisecond until
 * SECONDS have passed or SIGUSR1 arrives, and writes what it measured to
 * OUT as one line of JSON:
 *
 *   {"n": calls, "max_ms": ..., "p999_ms": ..., "p99_ms": ..., "p50_ms": ...}
 *
 * It writes "ready" to OUT.ready once its memory is touched and its workers
 * exist.
 *
 *   stall_job GIB PROCS SECONDS OUT
 */
#define _GNU_SOURCE
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static volatile sig_atomic_t stop;
static void on_usr1(int sig) { (void)sig; stop = 1; }

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv) {
    if (argc != 5) {
        fprintf(stderr, "usage: %s GIB PROCS SECONDS OUT\n", argv[0]);
        return 2;
    }
    double gib = atof(argv[1]);
    int procs = atoi(argv[2]);
    double seconds = atof(argv[3]);
    const char *out = argv[4];
    signal(SIGUSR1, on_usr1);
    size_t len = (size_t)(gib * (double)(1UL << 30));
    char *mem = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mem == MAP_FAILED) {
        perror("mmap");
        return 1;
    }
    for (size_t i = 0; i < len; i += 4096) mem[i] = (char)i;
    pid_t parent = getpid();
    for (int i = 1; i < procs; i++) {
        pid_t pid = fork();
        if (pid == 0) {
            prctl(PR_SET_PDEATHSIG, SIGKILL);
            if (getppid() != parent) _exit(0);
            signal(SIGUSR1, SIG_DFL);
            for (;;) pause();
        }
    }
    char ready[4096];
    snprintf(ready, sizeof ready, "%s.ready", out);
    FILE *r = fopen(ready, "w");
    if (r) {
        fprintf(r, "ready %d\n", (int)getpid());
        fclose(r);
    }
    size_t cap = (size_t)(seconds * 1000.0) + 16, n = 0;
    double *lat = malloc(cap * sizeof(double));
    double end = now() + seconds;
    while (!stop && n < cap && now() < end) {
        double t0 = now();
        char *q = mmap(NULL, 1 << 20, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (q == MAP_FAILED) {
            perror("mmap");
            return 1;
        }
        q[0] = 1;
        munmap(q, 1 << 20);
        lat[n++] = now() - t0;
        usleep(1000);
    }
    qsort(lat, n, sizeof(double), cmp);
    FILE *f = fopen(out, "w");
    if (!f) return 1;
    fprintf(f, "{\"n\": %zu, \"max_ms\": %.3f, \"p999_ms\": %.3f, \"p99_ms\": %.3f, \"p50_ms\": %.3f}\n", n,
            n ? lat[n - 1] * 1e3 : 0.0, n ? lat[(size_t)((double)n * 0.999)] * 1e3 : 0.0,
            n ? lat[(size_t)((double)n * 0.99)] * 1e3 : 0.0, n ? lat[n / 2] * 1e3 : 0.0);
    fclose(f);
    /* The workers die with it (PR_SET_PDEATHSIG). */
    return 0;
}
