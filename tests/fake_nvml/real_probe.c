/*
 * real_probe.c - asks an NVML library the protocol questions the fake has to
 * answer the same way (size queries, NULL buffers, struct versions,
 * process-utilization buffer size, ...).  Run it on a GPU machine against
 * the real libnvidia-ml.so.1, and here against the fake, and diff:
 *
 *   gcc -std=gnu11 -O1 -Wall -Wextra -Werror -o /tmp/real_probe \
 *       tests/fake_nvml/real_probe.c -ldl
 *   /tmp/real_probe busy                       # GPU box: real driver
 *
 *   mkdir -p /tmp/fn/lib && ln -sf /tmp/fn/libnvidia-ml-fake.so \
 *       /tmp/fn/lib/libnvidia-ml.so.1
 *   printf 'device 0 total_mib=81559 used_mib=2574 reserved_mib=480\n'\
 *          'process 0 459 2566\nprocess_util 0 459 41 41\n' > /tmp/fn/st
 *   FAKE_NVML_STATE=/tmp/fn/st LD_LIBRARY_PATH=/tmp/fn/lib /tmp/real_probe busy
 *
 * A forked child holds a CUDA context (driver API via libcuda.so.1, no
 * toolkit needed) and, with "busy", keeps the GPU busy with cuMemsetD8 so
 * that process-utilization samples exist.  Without libcuda (CI) the child
 * just exits and the state file supplies the process.
 */
#define _DEFAULT_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>
#include <signal.h>
#include <time.h>
#include <sys/wait.h>
typedef unsigned r_t; typedef void *dv;
struct pinfo { unsigned pid; unsigned long long used; unsigned gi, ci; };
struct mem1 { unsigned long long total, free, used; };
struct mem2 { unsigned version; unsigned long long total, reserved, free, used; };
struct ps { unsigned pid; unsigned long long ts; unsigned sm, mem, enc, dec; };
#define S(T,n) T n = (T)dlsym(l, #n); if(!n){printf("nosym %s\n",#n);return 1;}
typedef r_t (*fc)(unsigned*); typedef r_t (*f0)(void); typedef r_t (*fh)(unsigned,dv*);
typedef r_t (*fl)(dv,unsigned*,struct pinfo*); typedef r_t (*fm)(dv,struct mem2*); typedef r_t (*fm1)(dv,struct mem1*);
typedef r_t (*fu)(dv,struct ps*,unsigned*,unsigned long long);
static unsigned long long now_us(void){struct timespec t; clock_gettime(CLOCK_REALTIME,&t); return t.tv_sec*1000000ULL+t.tv_nsec/1000;}
int main(int argc, char **argv){
  (void)argv;
  int busy = argc > 1;
  void *l = dlopen("libnvidia-ml.so.1", RTLD_NOW); if(!l) return 1;
  S(f0,nvmlInit_v2) S(fh,nvmlDeviceGetHandleByIndex_v2) S(fl,nvmlDeviceGetComputeRunningProcesses_v3)
  S(fm,nvmlDeviceGetMemoryInfo_v2) S(fm1,nvmlDeviceGetMemoryInfo) S(fu,nvmlDeviceGetProcessUtilization)
  unsigned n; r_t r; dv d; struct pinfo p[16]; struct mem2 m; struct mem1 m1; struct ps u[256];
  pid_t child = fork();
  if (child == 0) {
    void *c = dlopen("libcuda.so.1", RTLD_NOW); if(!c) _exit(3);
    int (*cuInit)(unsigned) = (int(*)(unsigned))dlsym(c,"cuInit");
    int (*cuDeviceGet)(int*,int) = (int(*)(int*,int))dlsym(c,"cuDeviceGet");
    int (*cuCtxCreate)(void**,unsigned,int) = (int(*)(void**,unsigned,int))dlsym(c,"cuCtxCreate_v2");
    int (*cuMemAlloc)(unsigned long long*,size_t) = (int(*)(unsigned long long*,size_t))dlsym(c,"cuMemAlloc_v2");
    int (*cuMemsetD8)(unsigned long long,unsigned char,size_t) = (int(*)(unsigned long long,unsigned char,size_t))dlsym(c,"cuMemsetD8_v2");
    int dev; void *ctx; unsigned long long ptr;
    cuInit(0); cuDeviceGet(&dev,0); cuCtxCreate(&ctx,0,dev); cuMemAlloc(&ptr, 2ULL<<30);
    for (;;) { if (busy) cuMemsetD8(ptr, 1, 2ULL<<30); else sleep(1); }
  }
  r = nvmlInit_v2(); printf("busy=%d init %u\n", busy, r); nvmlDeviceGetHandleByIndex_v2(0,&d);
  for (int t=0;t<80;t++){ n=0; r=nvmlDeviceGetComputeRunningProcesses_v3(d,&n,NULL); if(r==7) break; usleep(100000);}
  sleep(2);
  for (int k=0;k<3;k++){ n=0; r=nvmlDeviceGetComputeRunningProcesses_v3(d,&n,NULL); printf("compute cap0 NULL: rc=%u n=%u\n", r, n); }
  n=0; r=nvmlDeviceGetComputeRunningProcesses_v3(d,&n,p); printf("compute cap0 buf: rc=%u n=%u\n", r, n);
  n=8; r=nvmlDeviceGetComputeRunningProcesses_v3(d,&n,NULL); printf("compute cap8 NULL: rc=%u n=%u\n", r, n);
  n=1; r=nvmlDeviceGetComputeRunningProcesses_v3(d,&n,p); printf("compute cap1 buf: rc=%u n=%u pid=%u(child %d) used=%llu gi=%x ci=%x\n", r, n, p[0].pid, (int)child, p[0].used, p[0].gi, p[0].ci);
  unsigned vers[4] = {0, 40u|1u<<24, 32u|2u<<24, 40u|2u<<24};
  for (int k=0;k<4;k++){ memset(&m,0,sizeof m); m.version=vers[k]; r=nvmlDeviceGetMemoryInfo_v2(d,&m); printf("mem2 version=0x%08x rc=%u total=%llu reserved=%llu free=%llu used=%llu\n", vers[k], r, m.total, m.reserved, m.free, m.used); }
  r=nvmlDeviceGetMemoryInfo(d,&m1); printf("mem1 rc=%u total=%llu free=%llu used=%llu\n", r, m1.total, m1.free, m1.used);
  for (int k=0;k<3;k++){
    unsigned long long last = k==2 ? now_us() : 0;
    n=0; r=nvmlDeviceGetProcessUtilization(d,NULL,&n,last); printf("putil[last=%s] NULL cap0: rc=%u n=%u\n", k==2?"now":"0", r, n);
    unsigned want = n; n = want; r=nvmlDeviceGetProcessUtilization(d,u,&n,last); printf("   cap=%u: rc=%u n=%u\n", want, r, n);
    for (unsigned i=0;i<n && r==0 && i<3;i++) printf("   sample pid=%u ts=%llu (now %llu) sm=%u mem=%u enc=%u dec=%u\n",u[i].pid,u[i].ts,now_us(),u[i].sm,u[i].mem,u[i].enc,u[i].dec);
    if (r==0 && n>0) { unsigned long long ts=u[0].ts; n=256; r=nvmlDeviceGetProcessUtilization(d,u,&n,ts); printf("   again last=sample.ts: rc=%u n=%u\n", r, n); }
    n=1; r=nvmlDeviceGetProcessUtilization(d,u,&n,0); printf("   cap1 buf: rc=%u n=%u\n", r, n);
    usleep(300000);
  }
  kill(child,SIGKILL); waitpid(child,NULL,0);
  return 0; }
