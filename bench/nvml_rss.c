// What loading NVML and taking samples through it costs any process in
// resident memory: the floor for memtrack's RSS with NVML on.
//
//   gcc -O2 -o nvml_rss bench/nvml_rss.c -ldl && ./nvml_rss [SAMPLES]
//
// Prints RssAnon and RssFile (KiB) before NVML is loaded, after nvmlInit,
// and after SAMPLES samples of what memtrack reads per GPU (memory info,
// the compute and graphics process lists), one line each.
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int (*init_fn)(void);
typedef int (*count_fn)(unsigned *);
typedef int (*handle_fn)(unsigned, void **);
typedef int (*procs_fn)(void *, unsigned *, void *);
typedef int (*mem_fn)(void *, void *);

static void show(const char *when) {
  FILE *f = fopen("/proc/self/status", "r");
  char line[256];
  long anon = -1, file = -1;
  while (f && fgets(line, sizeof line, f)) {
    if (!strncmp(line, "RssAnon:", 8)) anon = atol(line + 8);
    if (!strncmp(line, "RssFile:", 8)) file = atol(line + 8);
  }
  if (f) fclose(f);
  printf("%-24s RssAnon %6ld KiB  RssFile %6ld KiB\n", when, anon, file);
}

int main(int argc, char **argv) {
  int samples = argc > 1 ? atoi(argv[1]) : 100;
  show("before NVML");
  void *lib = dlopen("libnvidia-ml.so.1", RTLD_NOW);
  if (!lib) {
    fprintf(stderr, "dlopen: %s\n", dlerror());
    return 1;
  }
  show("after dlopen");
  init_fn init = (init_fn)dlsym(lib, "nvmlInit_v2");
  count_fn count = (count_fn)dlsym(lib, "nvmlDeviceGetCount_v2");
  handle_fn handle = (handle_fn)dlsym(lib, "nvmlDeviceGetHandleByIndex_v2");
  procs_fn compute = (procs_fn)dlsym(lib, "nvmlDeviceGetComputeRunningProcesses_v3");
  procs_fn graphics = (procs_fn)dlsym(lib, "nvmlDeviceGetGraphicsRunningProcesses_v3");
  mem_fn memory = (mem_fn)dlsym(lib, "nvmlDeviceGetMemoryInfo");
  if (!init || !count || !handle || !compute || !graphics || !memory || init() != 0) {
    fprintf(stderr, "nvmlInit failed\n");
    return 1;
  }
  show("after nvmlInit");
  unsigned n = 0;
  count(&n);
  static unsigned char buf[64 * 64];  // room for 64 process entries
  unsigned long long mem[3];
  for (int s = 0; s < samples; s++) {
    for (unsigned d = 0; d < n; d++) {
      void *h;
      if (handle(d, &h) != 0) continue;
      unsigned k = 64;
      compute(h, &k, buf);
      k = 64;
      graphics(h, &k, buf);
      memory(h, mem);
    }
  }
  char when[64];
  snprintf(when, sizeof when, "after %d samples", samples);
  show(when);
  return 0;
}
