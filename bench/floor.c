/* The floor of a host memory sampler: exactly the /proc reads memtrack's
 * samples need, and nothing else. Every tick: one pread of a kept-open
 * /proc/PID/statm per process. Once per second: one read of
 * /proc/PID/status per process (the VmHWM high-water mark). Runs for the
 * given seconds at the given interval, then exits.
 *
 *   floor INTERVAL_MS SECONDS PID...
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static void add_ms(struct timespec *t, long ms) {
    t->tv_nsec += ms * 1000000L;
    while (t->tv_nsec >= 1000000000L) {
        t->tv_nsec -= 1000000000L;
        t->tv_sec += 1;
    }
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s INTERVAL_MS SECONDS PID...\n", argv[0]);
        return 2;
    }
    long interval = atol(argv[1]);
    long seconds = atol(argv[2]);
    int n = argc - 3;
    int *statm = calloc((size_t)n, sizeof(int));
    char path[64], buf[4096];
    for (int i = 0; i < n; i++) {
        snprintf(path, sizeof path, "/proc/%s/statm", argv[3 + i]);
        statm[i] = open(path, O_RDONLY | O_CLOEXEC);
    }
    struct timespec next, end;
    clock_gettime(CLOCK_MONOTONIC, &next);
    end = next;
    end.tv_sec += seconds;
    long ticks = 0, per_second = interval >= 1000 ? 1 : 1000 / interval;
    unsigned long sink = 0;
    for (;;) {
        for (int i = 0; i < n; i++) {
            if (statm[i] >= 0) {
                ssize_t r = pread(statm[i], buf, sizeof buf, 0);
                sink += (unsigned long)r;
            }
        }
        if (ticks % per_second == 0) {
            for (int i = 0; i < n; i++) {
                snprintf(path, sizeof path, "/proc/%s/status", argv[3 + i]);
                int fd = open(path, O_RDONLY | O_CLOEXEC);
                if (fd >= 0) {
                    sink += (unsigned long)read(fd, buf, sizeof buf);
                    close(fd);
                }
            }
        }
        ticks++;
        add_ms(&next, interval);
        if (next.tv_sec > end.tv_sec || (next.tv_sec == end.tv_sec && next.tv_nsec > end.tv_nsec)) {
            break;
        }
        clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &next, NULL);
    }
    printf("%ld ticks %lu\n", ticks, sink);
    return 0;
}
