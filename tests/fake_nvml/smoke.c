/*
 * smoke.c - exercises every entry point of the fake NVML library.
 *
 * The library is loaded with dlopen()/dlsym() by name, the way
 * nvml-wrapper-sys does, so a missing export is caught too.  Struct layouts
 * are written out here independently of fake_nvml.c (copied from
 * nvml-wrapper-sys 0.10 bindings.rs) as a second ABI check.
 *
 *   gcc -shared -fPIC -O2 -Wall -Wextra -Werror \
 *       -o /tmp/fn/libnvidia-ml-fake.so tests/fake_nvml/fake_nvml.c
 *   gcc -std=c11 -O2 -Wall -Wextra -Werror -o /tmp/fn/smoke \
 *       tests/fake_nvml/smoke.c -ldl -lpthread
 *   /tmp/fn/smoke /tmp/fn/libnvidia-ml-fake.so /tmp/fn/work
 *
 * Exit status 0 and "ALL OK" on success.
 */
#define _POSIX_C_SOURCE 200809L

#include <dlfcn.h>
#include <fcntl.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

typedef unsigned int ret_t;
typedef void *dev_t_;

struct mem_v1 { unsigned long long total, free, used; };
struct mem_v2 { unsigned int version; unsigned long long total, reserved, free, used; };
struct util { unsigned int gpu, memory; };
struct pinfo_v1 { unsigned int pid; unsigned long long used; };
struct pinfo { unsigned int pid; unsigned long long used; unsigned int gi, ci; };
struct psample {
    unsigned int pid; unsigned long long ts;
    unsigned int sm, mem, enc, dec;
};
_Static_assert(sizeof(struct mem_v2) == 40, "mem_v2");
_Static_assert(sizeof(struct pinfo) == 24, "pinfo");
_Static_assert(sizeof(struct pinfo_v1) == 16, "pinfo_v1");
_Static_assert(sizeof(struct psample) == 32, "psample");

#define NA 0xFFFFFFFFFFFFFFFFULL
#define MIB 1048576ULL
#define MEM_V2_VERSION ((unsigned int)(sizeof(struct mem_v2) | (2u << 24)))

typedef ret_t (*f_void)(void);
typedef ret_t (*f_flags)(unsigned int);
typedef const char *(*f_errstr)(ret_t);
typedef ret_t (*f_str)(char *, unsigned int);
typedef ret_t (*f_count)(unsigned int *);
typedef ret_t (*f_handle)(unsigned int, dev_t_ *);
typedef ret_t (*f_handle_uuid)(const char *, dev_t_ *);
typedef ret_t (*f_dev_uint)(dev_t_, unsigned int *);
typedef ret_t (*f_dev_str)(dev_t_, char *, unsigned int);
typedef ret_t (*f_mem1)(dev_t_, struct mem_v1 *);
typedef ret_t (*f_mem2)(dev_t_, struct mem_v2 *);
typedef ret_t (*f_util)(dev_t_, struct util *);
typedef ret_t (*f_temp)(dev_t_, unsigned int, unsigned int *);
typedef ret_t (*f_plist)(dev_t_, unsigned int *, void *);
typedef ret_t (*f_putil)(dev_t_, struct psample *, unsigned int *, unsigned long long);

static void *lib;
static int failures, checks;

static void *sym(const char *name)
{
    void *p = dlsym(lib, name);
    if (p == NULL) {
        fprintf(stderr, "missing symbol %s\n", name);
        exit(2);
    }
    return p;
}

#define CHECK(cond)                                                          \
    do {                                                                     \
        checks++;                                                            \
        if (!(cond)) {                                                       \
            failures++;                                                      \
            fprintf(stderr, "FAIL %s:%d: %s\n", __FILE__, __LINE__, #cond);  \
        }                                                                    \
    } while (0)
#define CHECK_RC(expr, want)                                                 \
    do {                                                                     \
        ret_t got_ = (expr);                                                 \
        checks++;                                                            \
        if (got_ != (ret_t)(want)) {                                         \
            failures++;                                                      \
            fprintf(stderr, "FAIL %s:%d: %s = %u, want %u\n", __FILE__,      \
                    __LINE__, #expr, got_, (ret_t)(want));                   \
        }                                                                    \
    } while (0)

static char state_path[512], tmp_path[512], calls_path[512], err_path[512];

/* write-then-rename, as tests are told to do */
static void write_state(const char *text)
{
    FILE *f = fopen(tmp_path, "w");
    if (!f || fputs(text, f) < 0 || fclose(f) != 0) {
        perror("write_state");
        exit(2);
    }
    if (rename(tmp_path, state_path) != 0) {
        perror("rename");
        exit(2);
    }
}

/* in-place rewrite (same inode) */
static void overwrite_state(const char *text)
{
    FILE *f = fopen(state_path, "w");
    if (!f || fputs(text, f) < 0 || fclose(f) != 0) {
        perror("overwrite_state");
        exit(2);
    }
}

static int saved_stderr = -1;
static void capture_stderr_begin(void)
{
    fflush(stderr);
    saved_stderr = dup(2);
    int fd = open(err_path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(fd, 2);
    close(fd);
}
static void capture_stderr_end(char *buf, size_t n)
{
    fflush(stderr);
    dup2(saved_stderr, 2);
    close(saved_stderr);
    FILE *f = fopen(err_path, "r");
    size_t got = f ? fread(buf, 1, n - 1, f) : 0;
    buf[got] = '\0';
    if (f)
        fclose(f);
}

static int count_lines(const char *text, char ch)
{
    int n = 0;
    for (; *text; text++)
        n += (*text == ch);
    return n;
}

static int count_calls(const char *fn)
{
    FILE *f = fopen(calls_path, "r");
    if (!f)
        return -1;
    char line[256];
    int n = 0;
    while (fgets(line, sizeof line, f)) {
        line[strcspn(line, "\n")] = '\0';
        n += strcmp(line, fn) == 0;
    }
    fclose(f);
    return n;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* ---- threads: concurrent readers while the file is rewritten ---------- */
static f_handle p_handle;
static f_plist p_compute_v3;
static int stop_threads;
static int thread_bad;

static void *reader(void *arg)
{
    (void)arg;
    for (int it = 0; it < 3000 && !__atomic_load_n(&stop_threads, __ATOMIC_RELAXED); it++) {
        dev_t_ h;
        if (p_handle(0, &h) != 0) {
            __atomic_add_fetch(&thread_bad, 1, __ATOMIC_RELAXED);
            continue;
        }
        struct pinfo buf[16];
        unsigned int n = 16;
        ret_t rc = p_compute_v3(h, &n, buf);
        /* states alternate between 1 and 2 processes; pids 100/200 */
        if (rc != 0 || n < 1 || n > 2 || buf[0].pid != 100 ||
            (n == 2 && (buf[1].pid != 200 || buf[1].used != 2 * MIB)))
            __atomic_add_fetch(&thread_bad, 1, __ATOMIC_RELAXED);
    }
    return NULL;
}

int main(int argc, char **argv)
{
    if (argc != 3) {
        fprintf(stderr, "usage: %s LIB.so WORKDIR\n", argv[0]);
        return 2;
    }
    const char *work = argv[2];
    mkdir(work, 0755);
    snprintf(state_path, sizeof state_path, "%s/state.txt", work);
    snprintf(tmp_path, sizeof tmp_path, "%s/state.txt.tmp", work);
    snprintf(calls_path, sizeof calls_path, "%s/calls.log", work);
    snprintf(err_path, sizeof err_path, "%s/stderr.txt", work);
    unlink(state_path);
    unlink(calls_path);

    /* call log must be configured before the first call into the library */
    setenv("FAKE_NVML_CALLS", calls_path, 1);
    unsetenv("FAKE_NVML_STATE");

    lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        fprintf(stderr, "dlopen: %s\n", dlerror());
        return 2;
    }
    f_void init_v2 = (f_void)sym("nvmlInit_v2");
    f_void init_v1 = (f_void)sym("nvmlInit");
    f_flags init_flags = (f_flags)sym("nvmlInitWithFlags");
    f_void shutdown = (f_void)sym("nvmlShutdown");
    f_errstr errstr = (f_errstr)sym("nvmlErrorString");
    f_str drv = (f_str)sym("nvmlSystemGetDriverVersion");
    f_str nvmlver = (f_str)sym("nvmlSystemGetNVMLVersion");
    f_count count_v2 = (f_count)sym("nvmlDeviceGetCount_v2");
    f_count count_v1 = (f_count)sym("nvmlDeviceGetCount");
    f_handle handle_v2 = (f_handle)sym("nvmlDeviceGetHandleByIndex_v2");
    f_handle handle_v1 = (f_handle)sym("nvmlDeviceGetHandleByIndex");
    f_handle_uuid by_uuid = (f_handle_uuid)sym("nvmlDeviceGetHandleByUUID");
    f_dev_uint get_index = (f_dev_uint)sym("nvmlDeviceGetIndex");
    f_dev_str get_name = (f_dev_str)sym("nvmlDeviceGetName");
    f_dev_str get_uuid = (f_dev_str)sym("nvmlDeviceGetUUID");
    f_mem1 mem1 = (f_mem1)sym("nvmlDeviceGetMemoryInfo");
    f_mem2 mem2 = (f_mem2)sym("nvmlDeviceGetMemoryInfo_v2");
    f_util util = (f_util)sym("nvmlDeviceGetUtilizationRates");
    f_temp temp = (f_temp)sym("nvmlDeviceGetTemperature");
    f_plist comp_v3 = (f_plist)sym("nvmlDeviceGetComputeRunningProcesses_v3");
    f_plist comp_v2 = (f_plist)sym("nvmlDeviceGetComputeRunningProcesses_v2");
    f_plist comp_v1 = (f_plist)sym("nvmlDeviceGetComputeRunningProcesses");
    f_plist gfx_v3 = (f_plist)sym("nvmlDeviceGetGraphicsRunningProcesses_v3");
    f_plist gfx_v2 = (f_plist)sym("nvmlDeviceGetGraphicsRunningProcesses_v2");
    f_plist gfx_v1 = (f_plist)sym("nvmlDeviceGetGraphicsRunningProcesses");
    f_plist mps_v3 = (f_plist)sym("nvmlDeviceGetMPSComputeRunningProcesses_v3");
    f_plist mps_v2 = (f_plist)sym("nvmlDeviceGetMPSComputeRunningProcesses_v2");
    f_plist mps_v1 = (f_plist)sym("nvmlDeviceGetMPSComputeRunningProcesses");
    f_putil putil = (f_putil)sym("nvmlDeviceGetProcessUtilization");
    p_handle = handle_v2;
    p_compute_v3 = comp_v3;

    unsigned int n;
    dev_t_ d0 = NULL, d1 = NULL;
    char buf[256];

    /* ---- not initialised / no driver ---------------------------------- */
    CHECK_RC(count_v2(&n), 1);
    CHECK_RC(shutdown(), 1);
    CHECK_RC(init_v2(), 9); /* env var unset */
    setenv("FAKE_NVML_STATE", state_path, 1);
    CHECK_RC(init_v2(), 9); /* file missing */
    CHECK_RC(init_v1(), 9);
    CHECK_RC(init_flags(0), 9);
    CHECK_RC(count_v2(&n), 1);

    /* ---- parse error at init ----------------------------------------- */
    write_state("# comment\n\ndevice 0 bogus=1\n");
    capture_stderr_begin();
    CHECK_RC(init_v2(), 999);
    capture_stderr_end(buf, sizeof buf);
    CHECK(strstr(buf, "state.txt:3:") != NULL);
    CHECK(strstr(buf, "bogus") != NULL);
    CHECK(count_lines(buf, '\n') == 1);
    fprintf(stderr, "  (parse error line was: %s", buf);

    write_state("device 1\n"); /* non-contiguous */
    capture_stderr_begin();
    CHECK_RC(init_v2(), 999);
    capture_stderr_end(buf, sizeof buf);
    CHECK(strstr(buf, ":1:") != NULL && count_lines(buf, '\n') == 1);

    write_state("process 0 5 10\n"); /* undefined device */
    capture_stderr_begin();
    CHECK_RC(init_v2(), 999);
    capture_stderr_end(buf, sizeof buf);
    CHECK(strstr(buf, ":1:") != NULL && count_lines(buf, '\n') == 1);

    write_state("fail nvmlDeviceGetComputeRunningProcess_v3 15\n"); /* typo */
    capture_stderr_begin();
    CHECK_RC(init_v2(), 999);
    capture_stderr_end(buf, sizeof buf);
    CHECK(strstr(buf, ":1:") != NULL);

    /* ---- good state ---------------------------------------------------- */
    const char *state1 =
        "# two fake GPUs\n"
        "device 0 uuid=GPU-11111111-2222-3333-4444-555555555555 name=NVIDIA_Fake_H100 "
        "total_mib=81559 util_gpu=37 util_mem=12 temp=41\n"
        "device 1 uuid=GPU-aaaa total_mib=1000 used_mib=900 reserved_mib=50\n"
        "process 0 1234 1000\n"
        "process 0 1235 na          # NVML_VALUE_NOT_AVAILABLE\n"
        "process 0 1236 2048 compute\n"
        "process 0 1234 1000 graphics\n"
        "driver_version 560.35.03\n";
    write_state(state1);
    CHECK_RC(init_v2(), 0);
    CHECK_RC(init_flags(3), 0); /* refcount 2 */

    CHECK_RC(drv(buf, 80), 0);
    CHECK(strcmp(buf, "560.35.03") == 0);
    CHECK_RC(drv(buf, 5), 7);
    CHECK_RC(drv(NULL, 80), 2);
    CHECK_RC(nvmlver(buf, 80), 0);
    CHECK(strcmp(buf, "12.550.54.15") == 0);

    CHECK_RC(count_v2(&n), 0);
    CHECK(n == 2);
    CHECK_RC(count_v1(&n), 0);
    CHECK(n == 2);
    CHECK_RC(count_v2(NULL), 2);
    CHECK_RC(handle_v2(0, &d0), 0);
    CHECK_RC(handle_v1(1, &d1), 0);
    CHECK(d0 != NULL && d1 != NULL && d0 != d1);
    dev_t_ dx;
    CHECK_RC(handle_v2(2, &dx), 2);
    CHECK_RC(handle_v2(0, NULL), 2);
    CHECK_RC(by_uuid("GPU-aaaa", &dx), 0);
    CHECK(dx == d1);
    CHECK_RC(by_uuid("GPU-nope", &dx), 6);
    CHECK_RC(by_uuid(NULL, &dx), 2);

    CHECK_RC(get_index(d1, &n), 0);
    CHECK(n == 1);
    CHECK_RC(get_index(d0, NULL), 2);
    CHECK_RC(get_name(d0, buf, 96), 0);
    CHECK(strcmp(buf, "NVIDIA Fake H100") == 0);
    CHECK_RC(get_name(d0, buf, 16), 7); /* needs 17 */
    CHECK_RC(get_name(d0, buf, 17), 0);
    CHECK_RC(get_name(d1, buf, 96), 0);
    CHECK(strcmp(buf, "NVIDIA Fake GPU") == 0);
    CHECK_RC(get_uuid(d0, buf, 96), 0);
    CHECK(strcmp(buf, "GPU-11111111-2222-3333-4444-555555555555") == 0);
    CHECK_RC(get_uuid(d0, buf, 10), 7);

    /* invalid handles */
    int junk;
    CHECK_RC(get_index(NULL, &n), 2);
    CHECK_RC(get_index((dev_t_)&junk, &n), 2);
    CHECK_RC(get_index((dev_t_)((char *)d0 + 1), &n), 2);

    struct mem_v1 m1;
    struct mem_v2 m2;
    CHECK_RC(mem1(d0, &m1), 0);
    /* used = unique pids 1234(1000) + 1235(na->0) + 1236(2048) + 300 overhead */
    CHECK(m1.total == 81559 * MIB);
    CHECK(m1.used == (1000 + 2048 + 300) * MIB);
    CHECK(m1.free == m1.total - m1.used);
    memset(&m2, 0, sizeof m2);
    CHECK_RC(mem2(d0, &m2), 13); /* version not set: FUNCTION_NOT_FOUND, like a real driver */
    m2.version = 40u | (1u << 24);
    CHECK_RC(mem2(d0, &m2), 13);
    m2.version = MEM_V2_VERSION;
    CHECK_RC(mem2(d0, &m2), 0);
    CHECK(m2.total == 81559 * MIB && m2.reserved == 0 && m2.used == 3348 * MIB &&
          m2.free == (81559 - 3348) * MIB);
    CHECK_RC(mem2(d1, &m2), 0);
    CHECK(m2.total == 1000 * MIB && m2.reserved == 50 * MIB && m2.used == 900 * MIB &&
          m2.free == 50 * MIB);
    CHECK_RC(mem1(d1, &m1), 0);
    CHECK(m1.used == 950 * MIB && m1.free == 50 * MIB);
    CHECK_RC(mem2(d0, NULL), 2);

    struct util u;
    CHECK_RC(util(d0, &u), 0);
    CHECK(u.gpu == 37 && u.memory == 12);
    CHECK_RC(util(d1, &u), 0);
    CHECK(u.gpu == 0 && u.memory == 0);
    CHECK_RC(temp(d0, 0, &n), 0);
    CHECK(n == 41);
    CHECK_RC(temp(d1, 0, &n), 0);
    CHECK(n == 40);
    CHECK_RC(temp(d0, 1, &n), 2);

    /* ---- process lists: size protocol --------------------------------- */
    struct pinfo pi[8];
    n = 0;
    CHECK_RC(comp_v3(d0, &n, NULL), 7); /* the "how many?" query */
    CHECK(n == 3);
    n = 2;
    CHECK_RC(comp_v3(d0, &n, pi), 7); /* too small */
    CHECK(n == 3);
    n = 8;
    CHECK_RC(comp_v3(d0, &n, NULL), 2); /* big enough but NULL */
    CHECK(n == 3);                      /* real driver writes the count here too */
    CHECK_RC(comp_v3(d0, NULL, pi), 2);
    memset(pi, 0xAB, sizeof pi);
    n = 8;
    CHECK_RC(comp_v3(d0, &n, pi), 0);
    CHECK(n == 3);
    CHECK(pi[0].pid == 1234 && pi[0].used == 1000 * MIB);
    CHECK(pi[1].pid == 1235 && pi[1].used == NA);
    CHECK(pi[2].pid == 1236 && pi[2].used == 2048 * MIB);
    CHECK(pi[0].gi == 0xFFFFFFFFu && pi[0].ci == 0xFFFFFFFFu && pi[2].ci == 0xFFFFFFFFu);
    CHECK(pi[3].pid == 0xABABABABu); /* nothing written past n */
    n = 3;
    CHECK_RC(comp_v2(d0, &n, pi), 0);
    CHECK(n == 3 && pi[2].pid == 1236);
    struct pinfo_v1 p1[4];
    n = 4;
    CHECK_RC(comp_v1(d0, &n, p1), 0);
    CHECK(n == 3 && p1[1].pid == 1235 && p1[1].used == NA && p1[2].pid == 1236 &&
          p1[2].used == 2048 * MIB);
    n = 0;
    CHECK_RC(comp_v1(d0, &n, NULL), 7);
    CHECK(n == 3);

    n = 0;
    CHECK_RC(gfx_v3(d0, &n, NULL), 7);
    CHECK(n == 1);
    n = 1;
    CHECK_RC(gfx_v3(d0, &n, pi), 0);
    CHECK(n == 1 && pi[0].pid == 1234 && pi[0].used == 1000 * MIB);
    n = 1;
    CHECK_RC(gfx_v2(d0, &n, pi), 0);
    CHECK(n == 1);
    n = 1;
    CHECK_RC(gfx_v1(d0, &n, p1), 0);
    CHECK(n == 1 && p1[0].pid == 1234);

    n = 0;
    CHECK_RC(comp_v3(d1, &n, NULL), 0); /* empty: SUCCESS, 0 */
    CHECK(n == 0);
    n = 5;
    CHECK_RC(comp_v3(d1, &n, pi), 0);
    CHECK(n == 0);
    n = 0;
    CHECK_RC(mps_v3(d0, &n, NULL), 0);
    CHECK(n == 0);
    n = 0;
    CHECK_RC(mps_v2(d0, &n, NULL), 0);
    n = 0;
    CHECK_RC(mps_v1(d0, &n, NULL), 0);
    CHECK_RC(mps_v3(NULL, &n, NULL), 2);

    /* ---- process utilization ------------------------------------------ */
    struct psample ps[80];
    /* real-driver protocol: size query always says 72 (buffer size); no
     * samples -> NOT_FOUND from the second call */
    n = 0;
    CHECK_RC(putil(d0, NULL, &n, 0), 7);
    CHECK(n == 72);
    n = 72;
    CHECK_RC(putil(d0, ps, &n, 0), 6);
    CHECK(n == 72);

    /* ---- live re-read (rename) ---------------------------------------- */
    write_state("device 0 uuid=GPU-x name=Renamed total_mib=2000 util_gpu=99\n"
                "process 0 42 na\n"
                "process_util 0 42 55 11\n"
                "process_util 0 43 5 1 2 3\n");
    n = 0;
    CHECK_RC(comp_v3(d0, &n, NULL), 7);
    CHECK(n == 1);
    n = 1;
    CHECK_RC(comp_v3(d0, &n, pi), 0);
    CHECK(pi[0].pid == 42 && pi[0].used == NA);
    CHECK_RC(get_name(d0, buf, 96), 0);
    CHECK(strcmp(buf, "Renamed") == 0);
    CHECK_RC(count_v2(&n), 0);
    CHECK(n == 1);
    CHECK_RC(get_index(d1, &n), 2); /* device 1 vanished: stale handle */
    CHECK_RC(mem1(d0, &m1), 0);
    CHECK(m1.used == 300 * MIB); /* na counts as 0, plus overhead */
    n = 0;
    CHECK_RC(putil(d0, NULL, &n, 0), 7);
    CHECK(n == 72);
    n = 2;
    CHECK_RC(putil(d0, ps, &n, 0), 7); /* 2 samples, but capacity must be 72 */
    CHECK(n == 72);
    n = 80;
    CHECK_RC(putil(d0, ps, &n, 0), 0);
    CHECK(n == 2 && ps[0].pid == 42 && ps[0].sm == 55 && ps[0].mem == 11 &&
          ps[1].pid == 43 && ps[1].enc == 2 && ps[1].dec == 3 && ps[0].ts > 0 &&
          ps[0].ts % 200000 == 0 && ps[1].ts == ps[0].ts);
    unsigned long long seen = ps[0].ts;
    n = 80;
    ret_t prc = putil(d0, ps, &n, seen); /* same 200 ms period -> NOT_FOUND */
    CHECK(prc == 6 || (prc == 0 && ps[0].ts >= seen + 200000));
    n = 80;
    CHECK_RC(putil(d0, ps, &n, seen + 3600ULL * 1000000ULL), 6); /* future ts */
    CHECK_RC(putil(d0, ps, NULL, 0), 2);

    /* ---- live re-read (in-place, same size, same inode) -------------- */
    write_state("device 0 temp=50\n");
    CHECK_RC(temp(d0, 0, &n), 0);
    CHECK(n == 50);
    overwrite_state("device 0 temp=60\n");
    CHECK_RC(temp(d0, 0, &n), 0);
    CHECK(n == 60);

    /* ---- fail --------------------------------------------------------- */
    write_state("device 0\nprocess 0 7 1\n"
                "fail nvmlDeviceGetComputeRunningProcesses_v3 15\n"
                "fail nvmlDeviceGetUtilizationRates NVML_ERROR_NOT_SUPPORTED\n");
    n = 0;
    CHECK_RC(comp_v3(d0, &n, NULL), 15);
    n = 0;
    CHECK_RC(comp_v2(d0, &n, NULL), 7); /* only the named function fails */
    CHECK_RC(util(d0, &u), 3);
    CHECK_RC(temp(d0, 0, &n), 0);
    CHECK(strcmp(errstr(15), "GPU is lost") == 0);

    write_state("device 0\nfail * GPU_IS_LOST\nfail nvmlDeviceGetCount_v2 0\n");
    CHECK_RC(handle_v2(0, &dx), 15);
    CHECK_RC(temp(d0, 0, &n), 15);
    CHECK_RC(drv(buf, 80), 15);
    CHECK_RC(count_v2(&n), 0); /* explicit override of `*` */
    CHECK_RC(init_v2(), 15);   /* `*` also fails init */
    CHECK(errstr(0) != NULL);

    /* ---- delay_us ------------------------------------------------------ */
    write_state("device 0\ndelay_us nvmlDeviceGetTemperature 200000\n");
    double t0 = now_s();
    CHECK_RC(temp(d0, 0, &n), 0);
    double dt = now_s() - t0;
    CHECK(dt >= 0.19 && dt < 2.0);
    t0 = now_s();
    CHECK_RC(util(d0, &u), 0);
    CHECK(now_s() - t0 < 0.1);

    /* ---- parse error while running, then recovery -------------------- */
    write_state("device 0\nprocess 0 1 lots\n");
    capture_stderr_begin();
    CHECK_RC(temp(d0, 0, &n), 999);
    CHECK_RC(count_v2(&n), 999); /* same bad version: no second message */
    capture_stderr_end(buf, sizeof buf);
    CHECK(strstr(buf, ":2:") != NULL && count_lines(buf, '\n') == 1);
    write_state("device 0 temp=70\n");
    CHECK_RC(temp(d0, 0, &n), 0);
    CHECK(n == 70);

    /* ---- file removed while running: last state kept ------------------ */
    unlink(state_path);
    CHECK_RC(temp(d0, 0, &n), 0);
    CHECK(n == 70);

    /* ---- threads: readers vs. a writer -------------------------------- */
    write_state("device 0\nprocess 0 100 1\n");
    pthread_t th[3];
    for (int i = 0; i < 3; i++)
        pthread_create(&th[i], NULL, reader, NULL);
    for (int i = 0; i < 200; i++) {
        write_state(i % 2 ? "device 0\nprocess 0 100 1\n"
                          : "device 0\nprocess 0 100 1\nprocess 0 200 2\n");
        nanosleep(&(struct timespec){0, 500000}, NULL);
    }
    __atomic_store_n(&stop_threads, 1, __ATOMIC_RELAXED);
    for (int i = 0; i < 3; i++)
        pthread_join(th[i], NULL);
    CHECK(thread_bad == 0);

    /* ---- error strings ------------------------------------------------ */
    CHECK(strcmp(errstr(0), "Success") == 0);
    CHECK(strcmp(errstr(7), "Insufficient Size") == 0);
    CHECK(strcmp(errstr(9), "Driver Not Loaded") == 0);
    CHECK(strcmp(errstr(16), "GPU requires reset") == 0);
    CHECK(strcmp(errstr(999), "Unknown Error") == 0);
    CHECK(strcmp(errstr(12345), "Unknown Error") == 0);

    /* ---- shutdown refcount -------------------------------------------- */
    write_state("device 0\n");
    CHECK_RC(shutdown(), 0); /* refcount 2 -> 1 */
    CHECK_RC(count_v2(&n), 0);
    CHECK_RC(shutdown(), 0); /* -> 0 */
    CHECK_RC(count_v2(&n), 1);
    CHECK_RC(shutdown(), 1);

    /* ---- init again after shutdown; env var re-read ------------------- */
    unsetenv("FAKE_NVML_STATE");
    CHECK_RC(init_v2(), 9);
    setenv("FAKE_NVML_STATE", state_path, 1);
    CHECK_RC(init_v1(), 0);
    CHECK_RC(shutdown(), 0);

    /* ---- call log ------------------------------------------------------ */
    CHECK(count_calls("nvmlDeviceGetProcessUtilization") == 8);
    CHECK(count_calls("nvmlInit_v2") == 9);
    CHECK(count_calls("nvmlShutdown") == 5);
    CHECK(count_calls("nvmlDeviceGetMemoryInfo_v2") == 5);
    fprintf(stderr, "  call log: %d ProcessUtilization, %d Init_v2, %d ComputeV3 lines\n",
            count_calls("nvmlDeviceGetProcessUtilization"), count_calls("nvmlInit_v2"),
            count_calls("nvmlDeviceGetComputeRunningProcesses_v3"));

    printf("%d checks, %d failures\n", checks, failures);
    if (failures == 0)
        printf("ALL OK\n");
    return failures ? 1 : 0;
}
