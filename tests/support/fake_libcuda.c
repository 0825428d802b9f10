/* A stand-in for libcuda.so.1 with the CUDA driver API's C signatures (cuda.h), for testing the
 * ctypes client in driver/gpu/discovery/cudaprobe.py: argument and struct layouts, versioned symbol names,
 * error names. Not NVIDIA software; touches no GPU. Two devices with 132 SMs each; contexts are
 * limited to 34 SMs; allocations beyond 2048 MiB in total fail with CUDA_ERROR_OUT_OF_MEMORY.
 * With FAKE_CUDA_HANG set, cuInit never returns (a driver stuck on a broken GPU). */
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef struct { char bytes[16]; } CUuuid;
typedef struct { unsigned int val; } CUexecAffinitySmCount;
typedef struct { int type; union { CUexecAffinitySmCount smCount; } param; } CUexecAffinityParam;

#define LIMIT (2048ULL << 20)
static int initialised;
static void *current;
static unsigned long long held;

CUresult cuInit(unsigned int flags) {
    while (getenv("FAKE_CUDA_HANG") != NULL) pause();
    if (flags != 0) return 1;
    initialised = 1;
    return 0;
}
CUresult cuDeviceGetCount(int *count) { if (!initialised) return 3; *count = 2; return 0; }
CUresult cuDeviceGet(CUdevice *device, int ordinal) {
    if (!initialised) return 3;
    if (ordinal < 0 || ordinal > 1) return 101;
    *device = ordinal;
    return 0;
}
static CUresult uuid(CUuuid *out, CUdevice dev, char first) {
    if (dev < 0 || dev > 1) return 101;
    for (int i = 0; i < 16; i++) out->bytes[i] = (char)(i + 16 * dev);
    out->bytes[0] = first;
    return 0;
}
/* The plain call gives the parent GPU's UUID, _v2 the MIG device's own: tell them apart by byte 0. */
CUresult cuDeviceGetUuid(CUuuid *out, CUdevice dev) { return uuid(out, dev, 0x11); }
CUresult cuDeviceGetUuid_v2(CUuuid *out, CUdevice dev) { return uuid(out, dev, (char)0xaa); }
CUresult cuDeviceGetAttribute(int *pi, int attribute, CUdevice dev) {
    if (dev < 0 || dev > 1) return 101;
    if (attribute != 16) return 1; /* CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT only */
    *pi = 132;
    return 0;
}
CUresult cuDevicePrimaryCtxRetain(void **ctx, CUdevice dev) {
    if (dev < 0 || dev > 1) return 101;
    *ctx = (void *)0x1234;
    return 0;
}
CUresult cuCtxSetCurrent(void *ctx) { if (ctx != (void *)0x1234) return 201; current = ctx; return 0; }
CUresult cuCtxGetExecAffinity(CUexecAffinityParam *p, int type) {
    if (current == NULL) return 201;
    if (type != 0) return 1; /* CU_EXEC_AFFINITY_TYPE_SM_COUNT only */
    p->type = type;
    p->param.smCount.val = 34;
    return 0;
}
CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t size) {
    if (current == NULL) return 201;
    if (held + size > LIMIT) return 2;
    held += size;
    *dptr = 0x100000000ULL + held;
    return 0;
}
CUresult cuMemFree_v2(CUdeviceptr dptr) { if (dptr < 0x100000000ULL) return 1; return 0; }
CUresult cuGetErrorName(CUresult error, const char **name) {
    switch (error) {
    case 2: *name = "CUDA_ERROR_OUT_OF_MEMORY"; return 0;
    case 201: *name = "CUDA_ERROR_INVALID_CONTEXT"; return 0;
    default: return 1;
    }
}
