/* The floor of a sampler that follows a process tree: exactly the /proc
 * reads its samples need, and nothing else. Every tick: one pread of a
 * kept-open /proc/PID/statm per process (its memory), and one of its
 * kept-open /proc/PID/task/PID/children (the new processes it started:
 * a tree sampler has to find them). Once per second: one pread of a
 * kept-open /proc/PID/status per process (the VmHWM high-water mark).
 * Runs for the given seconds at the given interval, then exits.
 *
 * With --no-children it skips the children lists: the reads of the
 * samples alone, a floor that would never see a new process.
 *
 *   floor [--no-children] INTERVAL_MS SECONDS PID...
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
    int children = 1;
    if (argc > 1 && strcmp(argv[1], "--no-children") == 0) {
        children = 0;
        argv++;
        argc--;
    }
    if (argc < 4) {
        fprintf(stderr, "usage: %s [--no-children] INTERVAL_MS SECONDS PID...\n", argv[0]);
        return 2;
    }
    long interval = atol(argv[1]);
    long seconds = atol(argv[2]);
    int n = argc - 3;
    int *statm = calloc((size_t)n, sizeof(int));
    int *kids = calloc((size_t)n, sizeof(int));
    int *status = calloc((size_t)n, sizeof(int));
    char path[64], buf[4096];
    for (int i = 0; i < n; i++) {
        snprintf(path, sizeof path, "/proc/%s/statm", argv[3 + i]);
        statm[i] = open(path, O_RDONLY | O_CLOEXEC);
        snprintf(path, sizeof path, "/proc/%s/task/%s/children", argv[3 + i], argv[3 + i]);
        kids[i] = children ? open(path, O_RDONLY | O_CLOEXEC) : -1;
        snprintf(path, sizeof path, "/proc/%s/status", argv[3 + i]);
        status[i] = open(path, O_RDONLY | O_CLOEXEC);
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
            if (kids[i] >= 0) {
                ssize_t r = pread(kids[i], buf, sizeof buf, 0);
                sink += (unsigned long)r;
            }
        }
        if (ticks % per_second == 0) {
            for (int i = 0; i < n; i++) {
                if (status[i] >= 0) {
                    ssize_t r = pread(status[i], buf, sizeof buf, 0);
                    sink += (unsigned long)r;
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
