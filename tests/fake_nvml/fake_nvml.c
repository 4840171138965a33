/*
 * fake_nvml.c - a fake NVIDIA Management Library (libnvidia-ml.so) for tests.
 *
 * memtrack's CI has no GPU.  This shared object exports the subset of the
 * NVML C ABI that memtrack (through nvml-wrapper 0.13 / nvml-wrapper-sys
 * 0.10) calls, and answers from a plain-text state file that a test can
 * rewrite while memtrack runs.  See README.md next to this file for the
 * state-file format and the environment variables.
 *
 * Build (C11, libc only):
 *   gcc -shared -fPIC -O2 -Wall -Wextra -Werror \
 *       -o libnvidia-ml-fake.so tests/fake_nvml/fake_nvml.c
 *
 * Struct layouts and signatures follow nvml.h as mirrored by
 * nvml-wrapper-sys (src/bindings.rs); the _Static_asserts below pin the
 * sizes/offsets that matter.
 */
#define _POSIX_C_SOURCE 200809L

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define NVML_API __attribute__((visibility("default")))

/* ------------------------------------------------------------------------ */
/* NVML ABI subset                                                          */
/* ------------------------------------------------------------------------ */

typedef enum nvmlReturn_enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NO_PERMISSION = 4,
    NVML_ERROR_ALREADY_INITIALIZED = 5,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_INSUFFICIENT_POWER = 8,
    NVML_ERROR_DRIVER_NOT_LOADED = 9,
    NVML_ERROR_TIMEOUT = 10,
    NVML_ERROR_IRQ_ISSUE = 11,
    NVML_ERROR_LIBRARY_NOT_FOUND = 12,
    NVML_ERROR_FUNCTION_NOT_FOUND = 13,
    NVML_ERROR_CORRUPTED_INFOROM = 14,
    NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_RESET_REQUIRED = 16,
    NVML_ERROR_OPERATING_SYSTEM = 17,
    NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18,
    NVML_ERROR_IN_USE = 19,
    NVML_ERROR_MEMORY = 20,
    NVML_ERROR_NO_DATA = 21,
    NVML_ERROR_VGPU_ECC_NOT_SUPPORTED = 22,
    NVML_ERROR_INSUFFICIENT_RESOURCES = 23,
    NVML_ERROR_FREQ_NOT_SUPPORTED = 24,
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25,
    NVML_ERROR_DEPRECATED = 26,
    NVML_ERROR_NOT_READY = 27,
    NVML_ERROR_GPU_NOT_FOUND = 28,
    NVML_ERROR_INVALID_STATE = 29,
    NVML_ERROR_RESET_TYPE_NOT_SUPPORTED = 30,
    NVML_ERROR_UNKNOWN = 999
} nvmlReturn_t;

typedef struct nvmlDevice_st {
    unsigned int slot; /* opaque to callers; == index */
} *nvmlDevice_t;

typedef struct nvmlMemory_st {
    unsigned long long total;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_t;

typedef struct nvmlMemory_v2_st {
    unsigned int version;
    unsigned long long total;
    unsigned long long reserved;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_v2_t;

#define NVML_STRUCT_VERSION(data, ver) \
    (unsigned int)(sizeof(nvml##data##_v##ver##_t) | ((ver) << 24U))
#define nvmlMemory_v2 NVML_STRUCT_VERSION(Memory, 2)

typedef struct nvmlUtilization_st {
    unsigned int gpu;
    unsigned int memory;
} nvmlUtilization_t;

/* Used by the *_v1 ("legacy") process-list entry points. */
typedef struct nvmlProcessInfo_v1_st {
    unsigned int pid;
    unsigned long long usedGpuMemory;
} nvmlProcessInfo_v1_t;

/* Used by the _v2 and _v3 process-list entry points (nvmlProcessInfo_t). */
typedef struct nvmlProcessInfo_st {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlProcessInfo_t;

typedef struct nvmlProcessUtilizationSample_st {
    unsigned int pid;
    unsigned long long timeStamp;
    unsigned int smUtil;
    unsigned int memUtil;
    unsigned int encUtil;
    unsigned int decUtil;
} nvmlProcessUtilizationSample_t;

typedef enum nvmlTemperatureSensors_enum {
    NVML_TEMPERATURE_GPU = 0,
    NVML_TEMPERATURE_COUNT
} nvmlTemperatureSensors_t;

#define NVML_VALUE_NOT_AVAILABLE_ULL 0xFFFFFFFFFFFFFFFFULL
#define NVML_NO_INSTANCE_ID 0xFFFFFFFFU

_Static_assert(sizeof(nvmlReturn_t) == 4, "nvmlReturn_t is a 32-bit enum");
_Static_assert(sizeof(nvmlMemory_t) == 24, "nvmlMemory_t layout");
_Static_assert(sizeof(nvmlMemory_v2_t) == 40, "nvmlMemory_v2_t layout");
_Static_assert(offsetof(nvmlMemory_v2_t, total) == 8, "nvmlMemory_v2_t.total");
_Static_assert(offsetof(nvmlMemory_v2_t, used) == 32, "nvmlMemory_v2_t.used");
_Static_assert(sizeof(nvmlUtilization_t) == 8, "nvmlUtilization_t layout");
_Static_assert(sizeof(nvmlProcessInfo_v1_t) == 16, "nvmlProcessInfo_v1_t");
_Static_assert(sizeof(nvmlProcessInfo_t) == 24, "nvmlProcessInfo_t layout");
_Static_assert(offsetof(nvmlProcessInfo_t, usedGpuMemory) == 8, "pi.used");
_Static_assert(offsetof(nvmlProcessInfo_t, gpuInstanceId) == 16, "pi.gi");
_Static_assert(offsetof(nvmlProcessInfo_t, computeInstanceId) == 20, "pi.ci");
_Static_assert(sizeof(nvmlProcessUtilizationSample_t) == 32, "util sample");

/* ------------------------------------------------------------------------ */
/* Function table (names used for `fail`, `delay_us` and the call log)       */
/* ------------------------------------------------------------------------ */

#define FAKE_FUNCS(X)                                   \
    X(nvmlInit_v2)                                      \
    X(nvmlInit)                                         \
    X(nvmlInitWithFlags)                                \
    X(nvmlShutdown)                                     \
    X(nvmlErrorString)                                  \
    X(nvmlSystemGetDriverVersion)                       \
    X(nvmlSystemGetNVMLVersion)                         \
    X(nvmlDeviceGetCount_v2)                            \
    X(nvmlDeviceGetCount)                               \
    X(nvmlDeviceGetHandleByIndex_v2)                    \
    X(nvmlDeviceGetHandleByIndex)                       \
    X(nvmlDeviceGetHandleByUUID)                        \
    X(nvmlDeviceGetIndex)                               \
    X(nvmlDeviceGetName)                                \
    X(nvmlDeviceGetUUID)                                \
    X(nvmlDeviceGetMemoryInfo)                          \
    X(nvmlDeviceGetMemoryInfo_v2)                       \
    X(nvmlDeviceGetUtilizationRates)                    \
    X(nvmlDeviceGetTemperature)                         \
    X(nvmlDeviceGetComputeRunningProcesses_v3)          \
    X(nvmlDeviceGetComputeRunningProcesses_v2)          \
    X(nvmlDeviceGetComputeRunningProcesses)             \
    X(nvmlDeviceGetGraphicsRunningProcesses_v3)         \
    X(nvmlDeviceGetGraphicsRunningProcesses_v2)         \
    X(nvmlDeviceGetGraphicsRunningProcesses)            \
    X(nvmlDeviceGetMPSComputeRunningProcesses_v3)       \
    X(nvmlDeviceGetMPSComputeRunningProcesses_v2)       \
    X(nvmlDeviceGetMPSComputeRunningProcesses)          \
    X(nvmlDeviceGetProcessUtilization)

enum fn_id {
#define X(n) FN_##n,
    FAKE_FUNCS(X)
#undef X
    FN_COUNT
};

static const char *const fn_names[FN_COUNT] = {
#define X(n) #n,
    FAKE_FUNCS(X)
#undef X
};

/* ------------------------------------------------------------------------ */
/* State                                                                    */
/* ------------------------------------------------------------------------ */

#define MAX_DEVICES 64
#define STR_MAX 96 /* NVML_DEVICE_NAME_V2_BUFFER_SIZE / UUID_V2_BUFFER_SIZE */
#define VER_MAX 80 /* NVML_SYSTEM_*_VERSION_BUFFER_SIZE */
#define MIB 1048576ULL
#define MAX_MIB (1ULL << 40) /* keeps MiB->bytes far from overflow */
#define DRIVER_OVERHEAD_MIB 300ULL
#define MAX_DELAY_US 60000000LL

struct fake_proc {
    unsigned int pid;
    unsigned long long used; /* bytes, or NVML_VALUE_NOT_AVAILABLE_ULL */
};

struct proc_list {
    struct fake_proc *v;
    unsigned int n, cap;
};

struct fake_putil {
    unsigned int pid, sm, mem, enc, dec;
};

struct fake_dev {
    int defined;
    unsigned int def_line;     /* line of the `device` line */
    unsigned int ref_line;     /* first process line naming this index */
    char uuid[STR_MAX];
    char name[STR_MAX];
    unsigned long long total_mib, used_mib, reserved_mib;
    int has_used;
    unsigned int util_gpu, util_mem, temp;
    unsigned long long used_bytes; /* final device-level used */
    struct proc_list compute, graphics;
    struct fake_putil *putil;
    unsigned int n_putil, cap_putil;
};

struct fake_state {
    unsigned int n_dev;
    struct fake_dev dev[MAX_DEVICES];
    char driver_version[VER_MAX];
    char nvml_version[VER_MAX];
    long fail[FN_COUNT];       /* -1 = not set, else return code */
    long fail_all;             /* -1 = not set */
    long long delay[FN_COUNT]; /* -1 = not set, else microseconds */
    long long delay_all;       /* -1 = not set */
};

struct file_id {
    int valid;
    dev_t dev;
    ino_t ino;
    off_t size;
    time_t mtime_s;
    long mtime_ns;
};

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static unsigned int g_refcount;        /* nvmlInit / nvmlShutdown pairs */
static char *g_path;                   /* state file, captured at init */
static struct fake_state *g_state;     /* last successfully parsed state */
static int g_state_bad;                /* newest file version failed parse */
static struct file_id g_fid;           /* identity of the last parsed file */

static struct nvmlDevice_st g_handles[MAX_DEVICES];

static pthread_once_t g_log_once = PTHREAD_ONCE_INIT;
static int g_log_fd = -1;

/* ------------------------------------------------------------------------ */
/* Small helpers                                                            */
/* ------------------------------------------------------------------------ */

static void log_open(void)
{
    const char *p = getenv("FAKE_NVML_CALLS");
    if (p && *p)
        g_log_fd = open(p, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
}

static void log_call(enum fn_id id)
{
    pthread_once(&g_log_once, log_open);
    if (g_log_fd < 0)
        return;
    char buf[128];
    size_t n = strlen(fn_names[id]);
    memcpy(buf, fn_names[id], n);
    buf[n++] = '\n';
    /* O_APPEND + a single small write() keeps lines whole across threads
     * and processes. */
    if (write(g_log_fd, buf, n) < 0) {
        /* nothing sensible to do */
    }
}

static void sleep_us(long long us)
{
    struct timespec ts;
    ts.tv_sec = (time_t)(us / 1000000);
    ts.tv_nsec = (long)(us % 1000000) * 1000L;
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

static unsigned long long now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (unsigned long long)ts.tv_sec * 1000000ULL +
           (unsigned long long)ts.tv_nsec / 1000ULL;
}

static nvmlReturn_t copy_str(char *dst, unsigned int len, const char *src)
{
    if (dst == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    size_t n = strlen(src) + 1;
    if ((size_t)len < n)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(dst, src, n);
    return NVML_SUCCESS;
}

/* ------------------------------------------------------------------------ */
/* Error strings                                                            */
/* ------------------------------------------------------------------------ */

struct err_entry {
    int code;
    const char *name; /* without NVML_ERROR_ prefix */
    const char *text;
};

/* Texts as returned by a real driver (580.159.04). */
static const struct err_entry g_errors[] = {
    {0, "SUCCESS", "Success"},
    {1, "UNINITIALIZED", "Uninitialized"},
    {2, "INVALID_ARGUMENT", "Invalid Argument"},
    {3, "NOT_SUPPORTED", "Not Supported"},
    {4, "NO_PERMISSION", "Insufficient Permissions"},
    {5, "ALREADY_INITIALIZED", "Already Initialized"},
    {6, "NOT_FOUND", "Not Found"},
    {7, "INSUFFICIENT_SIZE", "Insufficient Size"},
    {8, "INSUFFICIENT_POWER", "Insufficient External Power"},
    {9, "DRIVER_NOT_LOADED", "Driver Not Loaded"},
    {10, "TIMEOUT", "Timeout"},
    {11, "IRQ_ISSUE", "Interrupt Request Issue"},
    {12, "LIBRARY_NOT_FOUND", "NVML Shared Library Not Found"},
    {13, "FUNCTION_NOT_FOUND", "Function Not Found"},
    {14, "CORRUPTED_INFOROM", "Corrupted infoROM"},
    {15, "GPU_IS_LOST", "GPU is lost"},
    {16, "RESET_REQUIRED", "GPU requires reset"},
    {17, "OPERATING_SYSTEM", "GPU access blocked by the operating system"},
    {18, "LIB_RM_VERSION_MISMATCH", "Driver/library version mismatch"},
    {19, "IN_USE", "In use by another client"},
    {20, "MEMORY", "Insufficient Memory"},
    {21, "NO_DATA", "No data"},
    {22, "VGPU_ECC_NOT_SUPPORTED", "vGPU ECC not supported"},
    {23, "INSUFFICIENT_RESOURCES", "Insufficient Resources"},
    {24, "FREQ_NOT_SUPPORTED", "Invalid Frequency"},
    {25, "ARGUMENT_VERSION_MISMATCH", "Argument version mismatch"},
    {26, "DEPRECATED", "Requested functionality has been deprecated"},
    {27, "NOT_READY", "System is not in ready state"},
    {28, "GPU_NOT_FOUND", "No supported GPUs were found"},
    {29, "INVALID_STATE", "Resource not in correct state to perform requested operation"},
    {30, "RESET_TYPE_NOT_SUPPORTED", "Reset type is not supported for given device"},
    {999, "UNKNOWN", "Unknown Error"},
};

#define N_ERRORS (sizeof(g_errors) / sizeof(g_errors[0]))

/* ------------------------------------------------------------------------ */
/* State-file parsing                                                       */
/* ------------------------------------------------------------------------ */

static void parse_error(const char *path, unsigned int line, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static void parse_error(const char *path, unsigned int line, const char *fmt, ...)
{
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    /* exactly one line, one write */
    fprintf(stderr, "fake_nvml: %s:%u: %s\n", path, line, msg);
}

static int parse_u64(const char *s, unsigned long long max, unsigned long long *out)
{
    if (s == NULL || *s < '0' || *s > '9')
        return -1;
    errno = 0;
    char *end = NULL;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno != 0 || end == s || *end != '\0' || v > max)
        return -1;
    *out = v;
    return 0;
}

static int parse_u32(const char *s, unsigned int *out)
{
    unsigned long long v;
    if (parse_u64(s, 0xFFFFFFFFULL, &v) != 0)
        return -1;
    *out = (unsigned int)v;
    return 0;
}

/* Returns function id, FN_COUNT for "*", -1 if unknown. */
static int lookup_fn(const char *name)
{
    if (strcmp(name, "*") == 0)
        return FN_COUNT;
    for (int i = 0; i < FN_COUNT; i++)
        if (strcmp(name, fn_names[i]) == 0)
            return i;
    return -1;
}

/* Accepts 15, GPU_IS_LOST, NVML_ERROR_GPU_IS_LOST, NVML_SUCCESS. */
static int parse_code(const char *s, long *out)
{
    unsigned long long v;
    if (parse_u64(s, 0x7FFFFFFFULL, &v) == 0) {
        *out = (long)v;
        return 0;
    }
    if (strncmp(s, "NVML_ERROR_", 11) == 0)
        s += 11;
    else if (strncmp(s, "NVML_", 5) == 0)
        s += 5;
    for (size_t i = 0; i < N_ERRORS; i++) {
        if (strcmp(s, g_errors[i].name) == 0) {
            *out = g_errors[i].code;
            return 0;
        }
    }
    return -1;
}

static int proc_push(struct proc_list *l, unsigned int pid, unsigned long long used)
{
    if (l->n == l->cap) {
        unsigned int cap = l->cap ? l->cap * 2 : 8;
        struct fake_proc *v = realloc(l->v, (size_t)cap * sizeof *v);
        if (v == NULL)
            return -1;
        l->v = v;
        l->cap = cap;
    }
    l->v[l->n].pid = pid;
    l->v[l->n].used = used;
    l->n++;
    return 0;
}

static int putil_push(struct fake_dev *d, const struct fake_putil *u)
{
    if (d->n_putil == d->cap_putil) {
        unsigned int cap = d->cap_putil ? d->cap_putil * 2 : 8;
        struct fake_putil *v = realloc(d->putil, (size_t)cap * sizeof *v);
        if (v == NULL)
            return -1;
        d->putil = v;
        d->cap_putil = cap;
    }
    d->putil[d->n_putil++] = *u;
    return 0;
}

static void state_free(struct fake_state *s)
{
    if (s == NULL)
        return;
    for (unsigned int i = 0; i < MAX_DEVICES; i++) {
        free(s->dev[i].compute.v);
        free(s->dev[i].graphics.v);
        free(s->dev[i].putil);
    }
    free(s);
}

static struct fake_state *state_new(void)
{
    struct fake_state *s = calloc(1, sizeof *s);
    if (s == NULL)
        return NULL;
    snprintf(s->driver_version, sizeof s->driver_version, "%s", "550.54.15");
    snprintf(s->nvml_version, sizeof s->nvml_version, "%s", "12.550.54.15");
    for (int i = 0; i < FN_COUNT; i++) {
        s->fail[i] = -1;
        s->delay[i] = -1;
    }
    s->fail_all = -1;
    s->delay_all = -1;
    return s;
}

static void dev_defaults(struct fake_dev *d, unsigned int idx)
{
    snprintf(d->uuid, sizeof d->uuid, "GPU-fa4e0000-0000-4000-8000-%012x", idx);
    snprintf(d->name, sizeof d->name, "%s", "NVIDIA Fake GPU");
    d->total_mib = 81559;
    d->used_mib = 0;
    d->reserved_mib = 0;
    d->has_used = 0;
    d->util_gpu = 0;
    d->util_mem = 0;
    d->temp = 40;
}

#define MAX_TOKENS 32

/* Parses one (comment-stripped, tokenised) line into s.  Returns 0 or -1
 * after printing the error. */
static int parse_line(struct fake_state *s, const char *path, unsigned int ln,
                      char **tok, int nt)
{
    const char *kw = tok[0];

    if (strcmp(kw, "device") == 0) {
        unsigned long long idx;
        if (nt < 2 || parse_u64(tok[1], MAX_DEVICES - 1, &idx) != 0) {
            parse_error(path, ln, "device: expected INDEX 0..%d", MAX_DEVICES - 1);
            return -1;
        }
        struct fake_dev *d = &s->dev[idx];
        if (d->defined) {
            parse_error(path, ln, "device %llu already defined on line %u", idx,
                        d->def_line);
            return -1;
        }
        d->defined = 1;
        d->def_line = ln;
        dev_defaults(d, (unsigned int)idx);
        for (int i = 2; i < nt; i++) {
            char *eq = strchr(tok[i], '=');
            if (eq == NULL || eq == tok[i]) {
                parse_error(path, ln, "device: expected key=value, got '%s'", tok[i]);
                return -1;
            }
            *eq = '\0';
            const char *k = tok[i], *v = eq + 1;
            int bad = 0;
            if (strcmp(k, "uuid") == 0 || strcmp(k, "name") == 0) {
                char *dst = (k[0] == 'u') ? d->uuid : d->name;
                size_t n = strlen(v);
                if (n == 0 || n >= STR_MAX) {
                    parse_error(path, ln, "device: %s must be 1..%d characters", k,
                                STR_MAX - 1);
                    return -1;
                }
                memcpy(dst, v, n + 1);
                if (k[0] == 'n')
                    for (char *p = dst; *p; p++)
                        if (*p == '_')
                            *p = ' ';
            } else if (strcmp(k, "total_mib") == 0) {
                bad = parse_u64(v, MAX_MIB, &d->total_mib);
            } else if (strcmp(k, "used_mib") == 0) {
                bad = parse_u64(v, MAX_MIB, &d->used_mib);
                d->has_used = 1;
            } else if (strcmp(k, "reserved_mib") == 0) {
                bad = parse_u64(v, MAX_MIB, &d->reserved_mib);
            } else if (strcmp(k, "util_gpu") == 0) {
                bad = parse_u32(v, &d->util_gpu);
            } else if (strcmp(k, "util_mem") == 0) {
                bad = parse_u32(v, &d->util_mem);
            } else if (strcmp(k, "temp") == 0) {
                bad = parse_u32(v, &d->temp);
            } else {
                parse_error(path, ln, "device: unknown key '%s'", k);
                return -1;
            }
            if (bad) {
                parse_error(path, ln, "device: bad value for %s: '%s'", k, v);
                return -1;
            }
        }
        return 0;
    }

    if (strcmp(kw, "process") == 0) {
        unsigned long long idx, mib;
        unsigned int pid;
        unsigned long long used;
        if (nt < 4 || nt > 5) {
            parse_error(path, ln,
                        "process: expected DEVICE_INDEX PID USED_MIB|na [graphics|compute]");
            return -1;
        }
        if (parse_u64(tok[1], MAX_DEVICES - 1, &idx) != 0) {
            parse_error(path, ln, "process: bad device index '%s'", tok[1]);
            return -1;
        }
        if (parse_u32(tok[2], &pid) != 0) {
            parse_error(path, ln, "process: bad pid '%s'", tok[2]);
            return -1;
        }
        if (strcmp(tok[3], "na") == 0) {
            used = NVML_VALUE_NOT_AVAILABLE_ULL;
        } else if (parse_u64(tok[3], MAX_MIB, &mib) == 0) {
            used = mib * MIB;
        } else {
            parse_error(path, ln, "process: bad USED_MIB '%s' (number or na)", tok[3]);
            return -1;
        }
        int graphics = 0;
        if (nt == 5) {
            if (strcmp(tok[4], "graphics") == 0) {
                graphics = 1;
            } else if (strcmp(tok[4], "compute") != 0) {
                parse_error(path, ln, "process: unknown list '%s' (graphics|compute)",
                            tok[4]);
                return -1;
            }
        }
        struct fake_dev *d = &s->dev[idx];
        if (d->ref_line == 0)
            d->ref_line = ln;
        if (proc_push(graphics ? &d->graphics : &d->compute, pid, used) != 0) {
            parse_error(path, ln, "out of memory");
            return -1;
        }
        return 0;
    }

    if (strcmp(kw, "process_util") == 0) {
        unsigned long long idx;
        struct fake_putil u = {0, 0, 0, 0, 0};
        if ((nt != 5 && nt != 7) || parse_u64(tok[1], MAX_DEVICES - 1, &idx) != 0 ||
            parse_u32(tok[2], &u.pid) != 0 || parse_u32(tok[3], &u.sm) != 0 ||
            parse_u32(tok[4], &u.mem) != 0 ||
            (nt == 7 && (parse_u32(tok[5], &u.enc) != 0 || parse_u32(tok[6], &u.dec) != 0))) {
            parse_error(path, ln, "process_util: expected DEVICE_INDEX PID SM MEM [ENC DEC]");
            return -1;
        }
        struct fake_dev *d = &s->dev[idx];
        if (d->ref_line == 0)
            d->ref_line = ln;
        if (putil_push(d, &u) != 0) {
            parse_error(path, ln, "out of memory");
            return -1;
        }
        return 0;
    }

    if (strcmp(kw, "fail") == 0 || strcmp(kw, "delay_us") == 0) {
        int is_fail = kw[0] == 'f';
        if (nt != 3) {
            parse_error(path, ln, "%s: expected FUNCTION_NAME|* %s", kw,
                        is_fail ? "CODE" : "MICROS");
            return -1;
        }
        int id = lookup_fn(tok[1]);
        if (id < 0) {
            parse_error(path, ln, "%s: unknown function '%s'", kw, tok[1]);
            return -1;
        }
        if (is_fail) {
            long code;
            if (id == FN_nvmlErrorString) {
                parse_error(path, ln, "fail: nvmlErrorString cannot fail");
                return -1;
            }
            if (parse_code(tok[2], &code) != 0) {
                parse_error(path, ln, "fail: bad code '%s'", tok[2]);
                return -1;
            }
            if (id == FN_COUNT)
                s->fail_all = code;
            else
                s->fail[id] = code;
        } else {
            unsigned long long us;
            if (parse_u64(tok[2], MAX_DELAY_US, &us) != 0) {
                parse_error(path, ln, "delay_us: bad MICROS '%s' (0..%lld)", tok[2],
                            MAX_DELAY_US);
                return -1;
            }
            if (id == FN_COUNT)
                s->delay_all = (long long)us;
            else
                s->delay[id] = (long long)us;
        }
        return 0;
    }

    if (strcmp(kw, "driver_version") == 0 || strcmp(kw, "nvml_version") == 0) {
        char *dst = kw[0] == 'd' ? s->driver_version : s->nvml_version;
        if (nt != 2 || strlen(tok[1]) >= VER_MAX) {
            parse_error(path, ln, "%s: expected one word (< %d chars)", kw, VER_MAX);
            return -1;
        }
        memcpy(dst, tok[1], strlen(tok[1]) + 1);
        return 0;
    }

    parse_error(path, ln, "unknown keyword '%s'", kw);
    return -1;
}

/* Post-parse checks and derived values.  Returns 0 or -1 (error printed). */
static int finalize(struct fake_state *s, const char *path)
{
    unsigned int n = 0;
    for (unsigned int i = 0; i < MAX_DEVICES; i++)
        if (s->dev[i].defined)
            n = i + 1;
    for (unsigned int i = 0; i < n; i++) {
        if (!s->dev[i].defined) {
            /* name the first device line beyond the gap */
            unsigned int ln = 0;
            for (unsigned int j = i + 1; j < n && ln == 0; j++)
                if (s->dev[j].defined)
                    ln = s->dev[j].def_line;
            parse_error(path, ln,
                        "device indices must be contiguous from 0: device %u is missing", i);
            return -1;
        }
    }
    for (unsigned int i = 0; i < MAX_DEVICES; i++) {
        struct fake_dev *d = &s->dev[i];
        if (!d->defined && d->ref_line != 0) {
            parse_error(path, d->ref_line, "refers to device %u, which is not defined", i);
            return -1;
        }
        if (!d->defined)
            continue;
        for (unsigned int j = 0; j < i; j++) {
            if (strcmp(s->dev[j].uuid, d->uuid) == 0) {
                parse_error(path, d->def_line, "uuid %s already used by device %u",
                            d->uuid, j);
                return -1;
            }
        }
        if (d->has_used) {
            d->used_bytes = d->used_mib * MIB;
        } else {
            /* Sum per unique pid (a pid may be in both lists; a real driver
             * reports the same per-process figure in each), ignoring `na`. */
            unsigned long long sum = DRIVER_OVERHEAD_MIB * MIB;
            struct proc_list *lists[2] = {&d->compute, &d->graphics};
            for (int a = 0; a < 2; a++) {
                for (unsigned int k = 0; k < lists[a]->n; k++) {
                    const struct fake_proc *p = &lists[a]->v[k];
                    int seen = 0;
                    unsigned long long best = 0;
                    /* skip if an earlier entry (any list) has this pid */
                    for (int b = 0; b <= a && !seen; b++) {
                        unsigned int lim = (b == a) ? k : lists[b]->n;
                        for (unsigned int m = 0; m < lim; m++)
                            if (lists[b]->v[m].pid == p->pid) {
                                seen = 1;
                                break;
                            }
                    }
                    if (seen)
                        continue;
                    for (int b = 0; b < 2; b++)
                        for (unsigned int m = 0; m < lists[b]->n; m++)
                            if (lists[b]->v[m].pid == p->pid &&
                                lists[b]->v[m].used != NVML_VALUE_NOT_AVAILABLE_ULL &&
                                lists[b]->v[m].used > best)
                                best = lists[b]->v[m].used;
                    sum += best;
                }
            }
            d->used_bytes = sum;
        }
    }
    s->n_dev = n;
    return 0;
}

/* Parses the open stream.  Returns a new state or NULL (error printed). */
static struct fake_state *parse_file(FILE *f, const char *path)
{
    struct fake_state *s = state_new();
    if (s == NULL) {
        parse_error(path, 0, "out of memory");
        return NULL;
    }
    char *line = NULL;
    size_t cap = 0;
    unsigned int ln = 0;
    int ok = 1;
    while (getline(&line, &cap, f) >= 0) {
        ln++;
        char *hash = strchr(line, '#');
        if (hash)
            *hash = '\0';
        char *tok[MAX_TOKENS];
        int nt = 0;
        char *save = NULL;
        for (char *t = strtok_r(line, " \t\r\n\v\f", &save); t != NULL;
             t = strtok_r(NULL, " \t\r\n\v\f", &save)) {
            if (nt == MAX_TOKENS) {
                parse_error(path, ln, "too many fields (max %d)", MAX_TOKENS);
                ok = 0;
                break;
            }
            tok[nt++] = t;
        }
        if (!ok)
            break;
        if (nt == 0)
            continue;
        if (parse_line(s, path, ln, tok, nt) != 0) {
            ok = 0;
            break;
        }
    }
    if (ok && ferror(f)) {
        parse_error(path, ln, "read error: %s", strerror(errno));
        ok = 0;
    }
    free(line);
    if (ok && finalize(s, path) != 0)
        ok = 0;
    if (!ok) {
        state_free(s);
        return NULL;
    }
    return s;
}

static void fid_from_stat(struct file_id *id, const struct stat *st)
{
    id->valid = 1;
    id->dev = st->st_dev;
    id->ino = st->st_ino;
    id->size = st->st_size;
    id->mtime_s = st->st_mtim.tv_sec;
    id->mtime_ns = st->st_mtim.tv_nsec;
}

static int fid_equal(const struct file_id *a, const struct file_id *b)
{
    return a->valid && b->valid && a->dev == b->dev && a->ino == b->ino &&
           a->size == b->size && a->mtime_s == b->mtime_s && a->mtime_ns == b->mtime_ns;
}

/* With g_lock held: re-read the state file if it changed.  Returns
 * NVML_SUCCESS, NVML_ERROR_DRIVER_NOT_LOADED (no file and no previous state)
 * or NVML_ERROR_UNKNOWN (newest file version does not parse). */
static nvmlReturn_t reload_locked(void)
{
    struct stat st;
    if (g_path == NULL || stat(g_path, &st) != 0) {
        /* File vanished: keep the last good state if there is one. */
        if (g_state == NULL && !g_state_bad)
            return NVML_ERROR_DRIVER_NOT_LOADED;
        return g_state_bad ? NVML_ERROR_UNKNOWN : NVML_SUCCESS;
    }
    struct file_id cur;
    fid_from_stat(&cur, &st);
    if (fid_equal(&cur, &g_fid))
        return g_state_bad ? NVML_ERROR_UNKNOWN : NVML_SUCCESS;

    FILE *f = fopen(g_path, "re");
    if (f == NULL) {
        if (g_state == NULL && !g_state_bad)
            return NVML_ERROR_DRIVER_NOT_LOADED;
        return g_state_bad ? NVML_ERROR_UNKNOWN : NVML_SUCCESS;
    }
    /* Identity of what we actually read (the path may have been renamed
     * over between stat and fopen). */
    if (fstat(fileno(f), &st) == 0)
        fid_from_stat(&cur, &st);
    struct fake_state *s = parse_file(f, g_path);
    fclose(f);
    g_fid = cur; /* do not re-parse (or re-print) the same bad version */
    if (s == NULL) {
        g_state_bad = 1;
        return NVML_ERROR_UNKNOWN;
    }
    state_free(g_state);
    g_state = s;
    g_state_bad = 0;
    return NVML_SUCCESS;
}

static long long delay_for(enum fn_id id)
{
    if (g_state == NULL || g_state_bad)
        return 0;
    if (g_state->delay[id] >= 0)
        return g_state->delay[id];
    if (g_state->delay_all >= 0 && id != FN_nvmlErrorString)
        return g_state->delay_all;
    return 0;
}

static nvmlReturn_t fail_for(enum fn_id id)
{
    if (g_state == NULL)
        return NVML_SUCCESS;
    if (g_state->fail[id] >= 0)
        return (nvmlReturn_t)g_state->fail[id];
    if (g_state->fail_all >= 0 && id != FN_nvmlShutdown && id != FN_nvmlErrorString)
        return (nvmlReturn_t)g_state->fail_all;
    return NVML_SUCCESS;
}

/* Common prologue of every non-init entry point.  On NVML_SUCCESS the lock
 * is HELD and the caller must unlock (use the LEAVE macro).  Otherwise the
 * lock is released and the code is what the function must return. */
static nvmlReturn_t enter(enum fn_id id)
{
    log_call(id);
    pthread_mutex_lock(&g_lock);
    if (g_refcount == 0) {
        pthread_mutex_unlock(&g_lock);
        return NVML_ERROR_UNINITIALIZED;
    }
    nvmlReturn_t rc = reload_locked();
    if (rc == NVML_SUCCESS) {
        long long d = delay_for(id);
        if (d > 0) {
            pthread_mutex_unlock(&g_lock); /* don't block other callers */
            sleep_us(d);
            pthread_mutex_lock(&g_lock);
            if (g_refcount == 0) {
                pthread_mutex_unlock(&g_lock);
                return NVML_ERROR_UNINITIALIZED;
            }
            rc = reload_locked();
        }
    }
    if (rc == NVML_SUCCESS)
        rc = fail_for(id);
    if (rc != NVML_SUCCESS) {
        pthread_mutex_unlock(&g_lock);
        return rc;
    }
    return NVML_SUCCESS;
}

#define ENTER(id)                          \
    do {                                   \
        nvmlReturn_t enter_rc_ = enter(id); \
        if (enter_rc_ != NVML_SUCCESS)     \
            return enter_rc_;              \
    } while (0)

#define LEAVE(rc)                          \
    do {                                   \
        nvmlReturn_t leave_rc_ = (rc);     \
        pthread_mutex_unlock(&g_lock);     \
        return leave_rc_;                  \
    } while (0)

/* With g_lock held: handle -> device, or NULL if invalid/stale. */
static struct fake_dev *dev_from_handle(nvmlDevice_t h)
{
    uintptr_t p = (uintptr_t)h, base = (uintptr_t)&g_handles[0];
    if (h == NULL || p < base || p >= base + sizeof g_handles ||
        (p - base) % sizeof g_handles[0] != 0)
        return NULL;
    unsigned int idx = (unsigned int)((p - base) / sizeof g_handles[0]);
    if (g_state == NULL || idx >= g_state->n_dev)
        return NULL;
    return &g_state->dev[idx];
}

/* ------------------------------------------------------------------------ */
/* Init / shutdown / errors                                                 */
/* ------------------------------------------------------------------------ */

static nvmlReturn_t do_init(enum fn_id id)
{
    log_call(id);
    pthread_mutex_lock(&g_lock);
    nvmlReturn_t rc;
    if (g_refcount == 0) {
        const char *p = getenv("FAKE_NVML_STATE");
        if (p == NULL || *p == '\0') {
            rc = NVML_ERROR_DRIVER_NOT_LOADED;
            goto out;
        }
        free(g_path);
        g_path = strdup(p);
        if (g_path == NULL) {
            rc = NVML_ERROR_MEMORY;
            goto out;
        }
        /* fresh start: always re-read */
        state_free(g_state);
        g_state = NULL;
        g_state_bad = 0;
        memset(&g_fid, 0, sizeof g_fid);
    }
    rc = reload_locked();
    if (rc != NVML_SUCCESS)
        goto out;
    long long d = delay_for(id);
    if (d > 0) {
        pthread_mutex_unlock(&g_lock);
        sleep_us(d);
        pthread_mutex_lock(&g_lock);
        rc = reload_locked();
        if (rc != NVML_SUCCESS)
            goto out;
    }
    rc = fail_for(id);
    if (rc != NVML_SUCCESS)
        goto out;
    for (unsigned int i = 0; i < MAX_DEVICES; i++)
        g_handles[i].slot = i;
    g_refcount++;
out:
    pthread_mutex_unlock(&g_lock);
    return rc;
}

NVML_API nvmlReturn_t nvmlInit_v2(void) { return do_init(FN_nvmlInit_v2); }

NVML_API nvmlReturn_t nvmlInit(void) { return do_init(FN_nvmlInit); }

NVML_API nvmlReturn_t nvmlInitWithFlags(unsigned int flags)
{
    (void)flags; /* NO_GPUS / NO_ATTACH make no difference here */
    return do_init(FN_nvmlInitWithFlags);
}

NVML_API nvmlReturn_t nvmlShutdown(void)
{
    log_call(FN_nvmlShutdown);
    pthread_mutex_lock(&g_lock);
    if (g_refcount == 0) {
        pthread_mutex_unlock(&g_lock);
        return NVML_ERROR_UNINITIALIZED;
    }
    (void)reload_locked(); /* a broken state file must not block shutdown */
    long long d = delay_for(FN_nvmlShutdown);
    if (d > 0) {
        pthread_mutex_unlock(&g_lock);
        sleep_us(d);
        pthread_mutex_lock(&g_lock);
        if (g_refcount == 0) {
            pthread_mutex_unlock(&g_lock);
            return NVML_ERROR_UNINITIALIZED;
        }
    }
    /* only an explicit `fail nvmlShutdown CODE` applies (not `fail *`) */
    nvmlReturn_t rc = fail_for(FN_nvmlShutdown);
    if (rc == NVML_SUCCESS && --g_refcount == 0) {
        state_free(g_state);
        g_state = NULL;
        g_state_bad = 0;
        memset(&g_fid, 0, sizeof g_fid);
        free(g_path);
        g_path = NULL;
    }
    pthread_mutex_unlock(&g_lock);
    return rc;
}

NVML_API const char *nvmlErrorString(nvmlReturn_t result)
{
    log_call(FN_nvmlErrorString);
    for (size_t i = 0; i < N_ERRORS; i++)
        if (g_errors[i].code == (int)result)
            return g_errors[i].text;
    return "Unknown Error";
}

/* ------------------------------------------------------------------------ */
/* System queries                                                           */
/* ------------------------------------------------------------------------ */

NVML_API nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length)
{
    ENTER(FN_nvmlSystemGetDriverVersion);
    LEAVE(copy_str(version, length, g_state->driver_version));
}

NVML_API nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length)
{
    ENTER(FN_nvmlSystemGetNVMLVersion);
    LEAVE(copy_str(version, length, g_state->nvml_version));
}

static nvmlReturn_t get_count(enum fn_id id, unsigned int *count)
{
    ENTER(id);
    if (count == NULL)
        LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    *count = g_state->n_dev;
    LEAVE(NVML_SUCCESS);
}

NVML_API nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *deviceCount)
{
    return get_count(FN_nvmlDeviceGetCount_v2, deviceCount);
}

NVML_API nvmlReturn_t nvmlDeviceGetCount(unsigned int *deviceCount)
{
    return get_count(FN_nvmlDeviceGetCount, deviceCount);
}

static nvmlReturn_t get_handle(enum fn_id id, unsigned int index, nvmlDevice_t *device)
{
    ENTER(id);
    if (device == NULL || index >= g_state->n_dev)
        LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    *device = &g_handles[index];
    LEAVE(NVML_SUCCESS);
}

NVML_API nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device)
{
    return get_handle(FN_nvmlDeviceGetHandleByIndex_v2, index, device);
}

NVML_API nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device)
{
    return get_handle(FN_nvmlDeviceGetHandleByIndex, index, device);
}

NVML_API nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device)
{
    ENTER(FN_nvmlDeviceGetHandleByUUID);
    if (uuid == NULL || device == NULL)
        LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    for (unsigned int i = 0; i < g_state->n_dev; i++) {
        if (strcmp(g_state->dev[i].uuid, uuid) == 0) {
            *device = &g_handles[i];
            LEAVE(NVML_SUCCESS);
        }
    }
    LEAVE(NVML_ERROR_NOT_FOUND);
}

/* ------------------------------------------------------------------------ */
/* Device queries                                                           */
/* ------------------------------------------------------------------------ */

#define ENTER_DEV(id, h, d)                         \
    ENTER(id);                                      \
    struct fake_dev *d = dev_from_handle(h);        \
    if (d == NULL)                                  \
        LEAVE(NVML_ERROR_INVALID_ARGUMENT)

NVML_API nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index)
{
    ENTER_DEV(FN_nvmlDeviceGetIndex, device, d);
    if (index == NULL)
        LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    *index = (unsigned int)(d - &g_state->dev[0]);
    LEAVE(NVML_SUCCESS);
}

NVML_API nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length)
{
    ENTER_DEV(FN_nvmlDeviceGetName, device, d);
    LEAVE(copy_str(name, length, d->name));
}

NVML_API nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length)
{
    ENTER_DEV(FN_nvmlDeviceGetUUID, device, d);
    LEAVE(copy_str(uuid, length, d->uuid));
}

static unsigned long long sat_sub(unsigned long long a, unsigned long long b)
{
    return a > b ? a - b : 0;
}

NVML_API nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory)
{
    ENTER_DEV(FN_nvmlDeviceGetMemoryInfo, device, d);
    if (memory == NULL)
        LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    unsigned long long total = d->total_mib * MIB, reserved = d->reserved_mib * MIB;
    /* v1 semantics: "used" includes the driver-reserved memory */
    memory->total = total;
    memory->used = d->used_bytes + reserved;
    memory->free = sat_sub(total, d->used_bytes + reserved);
    LEAVE(NVML_SUCCESS);
}

NVML_API nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory)
{
    ENTER_DEV(FN_nvmlDeviceGetMemoryInfo_v2, device, d);
    if (memory == NULL)
        LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    /* A real 580 driver answers a wrong struct version with
     * NVML_ERROR_FUNCTION_NOT_FOUND (13), not ARGUMENT_VERSION_MISMATCH. */
    if (memory->version != nvmlMemory_v2)
        LEAVE(NVML_ERROR_FUNCTION_NOT_FOUND);
    unsigned long long total = d->total_mib * MIB, reserved = d->reserved_mib * MIB;
    memory->total = total;
    memory->reserved = reserved;
    memory->used = d->used_bytes;
    memory->free = sat_sub(total, d->used_bytes + reserved);
    LEAVE(NVML_SUCCESS);
}

NVML_API nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device,
                                                    nvmlUtilization_t *utilization)
{
    ENTER_DEV(FN_nvmlDeviceGetUtilizationRates, device, d);
    if (utilization == NULL)
        LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    utilization->gpu = d->util_gpu;
    utilization->memory = d->util_mem;
    LEAVE(NVML_SUCCESS);
}

NVML_API nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t device,
                                               nvmlTemperatureSensors_t sensorType,
                                               unsigned int *temp)
{
    ENTER_DEV(FN_nvmlDeviceGetTemperature, device, d);
    if (temp == NULL || sensorType != NVML_TEMPERATURE_GPU)
        LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    *temp = d->temp;
    LEAVE(NVML_SUCCESS);
}

/* ------------------------------------------------------------------------ */
/* Process lists                                                            */
/* ------------------------------------------------------------------------ */

enum list_kind { LIST_COMPUTE, LIST_GRAPHICS, LIST_MPS };

/* NVML's size protocol:
 *   *infoCount in = capacity of infos.
 *   n > capacity  -> *infoCount = n, NVML_ERROR_INSUFFICIENT_SIZE
 *                    (this is the "how many?" query with infos=NULL, cap=0)
 *   n == 0        -> *infoCount = 0, NVML_SUCCESS
 *   infos == NULL with capacity >= n > 0 -> *infoCount = n,
 *                    NVML_ERROR_INVALID_ARGUMENT
 *   otherwise     -> fill n entries, *infoCount = n, NVML_SUCCESS
 * (each case checked against a real 580.159.04 driver on an H100) */
static nvmlReturn_t proc_list_query(enum fn_id id, enum list_kind kind, int v1,
                                    nvmlDevice_t device, unsigned int *infoCount,
                                    void *infos)
{
    ENTER_DEV(id, device, d);
    if (infoCount == NULL)
        LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    static const struct proc_list empty = {NULL, 0, 0};
    const struct proc_list *l = kind == LIST_COMPUTE    ? &d->compute
                                : kind == LIST_GRAPHICS ? &d->graphics
                                                        : &empty;
    unsigned int n = l->n;
    if (*infoCount < n) {
        *infoCount = n;
        LEAVE(NVML_ERROR_INSUFFICIENT_SIZE);
    }
    if (n == 0) {
        *infoCount = 0;
        LEAVE(NVML_SUCCESS);
    }
    if (infos == NULL) {
        *infoCount = n;
        LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    }
    for (unsigned int i = 0; i < n; i++) {
        if (v1) {
            nvmlProcessInfo_v1_t *o = (nvmlProcessInfo_v1_t *)infos + i;
            o->pid = l->v[i].pid;
            o->usedGpuMemory = l->v[i].used;
        } else {
            nvmlProcessInfo_t *o = (nvmlProcessInfo_t *)infos + i;
            o->pid = l->v[i].pid;
            o->usedGpuMemory = l->v[i].used;
            o->gpuInstanceId = NVML_NO_INSTANCE_ID;
            o->computeInstanceId = NVML_NO_INSTANCE_ID;
        }
    }
    *infoCount = n;
    LEAVE(NVML_SUCCESS);
}

NVML_API nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device,
                                                              unsigned int *infoCount,
                                                              nvmlProcessInfo_t *infos)
{
    return proc_list_query(FN_nvmlDeviceGetComputeRunningProcesses_v3, LIST_COMPUTE, 0,
                           device, infoCount, infos);
}

NVML_API nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t device,
                                                              unsigned int *infoCount,
                                                              nvmlProcessInfo_t *infos)
{
    return proc_list_query(FN_nvmlDeviceGetComputeRunningProcesses_v2, LIST_COMPUTE, 0,
                           device, infoCount, infos);
}

NVML_API nvmlReturn_t nvmlDeviceGetComputeRunningProcesses(nvmlDevice_t device,
                                                           unsigned int *infoCount,
                                                           nvmlProcessInfo_v1_t *infos)
{
    return proc_list_query(FN_nvmlDeviceGetComputeRunningProcesses, LIST_COMPUTE, 1,
                           device, infoCount, infos);
}

NVML_API nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v3(nvmlDevice_t device,
                                                               unsigned int *infoCount,
                                                               nvmlProcessInfo_t *infos)
{
    return proc_list_query(FN_nvmlDeviceGetGraphicsRunningProcesses_v3, LIST_GRAPHICS, 0,
                           device, infoCount, infos);
}

NVML_API nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v2(nvmlDevice_t device,
                                                               unsigned int *infoCount,
                                                               nvmlProcessInfo_t *infos)
{
    return proc_list_query(FN_nvmlDeviceGetGraphicsRunningProcesses_v2, LIST_GRAPHICS, 0,
                           device, infoCount, infos);
}

NVML_API nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses(nvmlDevice_t device,
                                                            unsigned int *infoCount,
                                                            nvmlProcessInfo_v1_t *infos)
{
    return proc_list_query(FN_nvmlDeviceGetGraphicsRunningProcesses, LIST_GRAPHICS, 1,
                           device, infoCount, infos);
}

NVML_API nvmlReturn_t nvmlDeviceGetMPSComputeRunningProcesses_v3(nvmlDevice_t device,
                                                                 unsigned int *infoCount,
                                                                 nvmlProcessInfo_t *infos)
{
    return proc_list_query(FN_nvmlDeviceGetMPSComputeRunningProcesses_v3, LIST_MPS, 0,
                           device, infoCount, infos);
}

NVML_API nvmlReturn_t nvmlDeviceGetMPSComputeRunningProcesses_v2(nvmlDevice_t device,
                                                                 unsigned int *infoCount,
                                                                 nvmlProcessInfo_t *infos)
{
    return proc_list_query(FN_nvmlDeviceGetMPSComputeRunningProcesses_v2, LIST_MPS, 0,
                           device, infoCount, infos);
}

NVML_API nvmlReturn_t nvmlDeviceGetMPSComputeRunningProcesses(nvmlDevice_t device,
                                                              unsigned int *infoCount,
                                                              nvmlProcessInfo_v1_t *infos)
{
    return proc_list_query(FN_nvmlDeviceGetMPSComputeRunningProcesses, LIST_MPS, 1,
                           device, infoCount, infos);
}

/* Mirrors a real driver (580.159.04, H100):
 *   - the buffer must hold the driver's whole sample buffer (72 entries on
 *     real hardware), however few samples there are: utilization == NULL or
 *     *processSamplesCount < 72 -> *processSamplesCount = 72,
 *     NVML_ERROR_INSUFFICIENT_SIZE.  This is also the answer to the
 *     "how many?" query, even when there are no samples at all.
 *   - no sample newer than lastSeenTimeStamp -> NVML_ERROR_NOT_FOUND
 *     (count left alone), so an idle GPU fails on the *second* call.
 *   - otherwise one sample per `process_util` line, *count = that number.
 * Samples are "taken" every 200 ms: their timeStamp is the current
 * CLOCK_REALTIME in microseconds rounded down to 200 ms, so re-querying at
 * once with lastSeenTimeStamp = a returned timeStamp gives NOT_FOUND, as on
 * real hardware. */
#define PUTIL_BUFFER_SAMPLES 72U
#define PUTIL_PERIOD_US 200000ULL

NVML_API nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t device,
                                                      nvmlProcessUtilizationSample_t *utilization,
                                                      unsigned int *processSamplesCount,
                                                      unsigned long long lastSeenTimeStamp)
{
    ENTER_DEV(FN_nvmlDeviceGetProcessUtilization, device, d);
    if (processSamplesCount == NULL)
        LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    unsigned int n = d->n_putil;
    unsigned int need = n > PUTIL_BUFFER_SAMPLES ? n : PUTIL_BUFFER_SAMPLES;
    if (utilization == NULL || *processSamplesCount < need) {
        *processSamplesCount = need;
        LEAVE(NVML_ERROR_INSUFFICIENT_SIZE);
    }
    unsigned long long now = now_us();
    unsigned long long ts = now - now % PUTIL_PERIOD_US;
    if (n == 0 || ts <= lastSeenTimeStamp)
        LEAVE(NVML_ERROR_NOT_FOUND);
    for (unsigned int i = 0; i < n; i++) {
        utilization[i].pid = d->putil[i].pid;
        utilization[i].timeStamp = ts;
        utilization[i].smUtil = d->putil[i].sm;
        utilization[i].memUtil = d->putil[i].mem;
        utilization[i].encUtil = d->putil[i].enc;
        utilization[i].decUtil = d->putil[i].dec;
    }
    *processSamplesCount = n;
    LEAVE(NVML_SUCCESS);
}
