"""A tiny CUDA client through ctypes: SM counts of whole GPUs, and what an MPS client is allowed.

Run as a child process (``python -m driver.gpu.discovery.cudaprobe ...``, see ``driver/gpu/discovery/cudarun.py``),
never inside the plugin: loading ``libcuda`` starts driver threads and opens device nodes, a
broken GPU can make ``cuInit`` hang, and an MPS client that crashes must take only itself down.
It prints one JSON object on stdout.

The probe logic (:func:`sm_counts`, :func:`mps_client`) talks to a :class:`CudaApi`; the real one
is :class:`LibCuda` (ctypes), tests pass a plain fake object.

CUDA driver API facts used here (CUDA Driver API reference, docs.nvidia.com/cuda/cuda-driver-api,
and ``cuda.h``):

* ``cuda.h`` maps several API names to versioned symbols with ``#define``; a ``dlsym`` caller must
  use the symbol: ``cuMemAlloc`` -> ``cuMemAlloc_v2``, ``cuMemFree`` -> ``cuMemFree_v2``,
  ``cuDevicePrimaryCtxRelease`` -> ``cuDevicePrimaryCtxRelease_v2``. ``cuDeviceGetUuid_v2``
  (CUDA 11.4+) returns the MIG UUID of a MIG device, the plain one its parent GPU's UUID.
* ``CUresult cuInit(unsigned int Flags)``; Flags must be 0.
* ``CUresult cuDeviceGetCount(int *count)``, ``cuDeviceGet(CUdevice *device, int ordinal)``;
  ``CUdevice`` is an ``int``.
* ``CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice dev)``; ``CUuuid`` is ``char bytes[16]``,
  the same 16 bytes NVML prints as ``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx``.
* ``CUresult cuDeviceGetAttribute(int *pi, CUdevice_attribute attrib, CUdevice dev)``;
  ``CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16``. No context is needed.
* ``CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)`` and
  ``cuCtxSetCurrent(CUcontext ctx)``: the primary context, whose signature did not change across
  CUDA versions (``cuCtxCreate`` did: ``_v2``, ``_v3``, ``_v4``).
* ``CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)``, ``cuMemFree_v2(CUdeviceptr)``;
  ``CUdeviceptr`` is an ``unsigned long long`` on 64-bit Linux.
* ``CUresult cuCtxGetExecAffinity(CUexecAffinityParam *p, CUexecAffinityType type)`` (CUDA 11.4+),
  for the current context; ``CU_EXEC_AFFINITY_TYPE_SM_COUNT = 0``; ``CUexecAffinityParam`` is
  ``{CUexecAffinityType type; union {CUexecAffinitySmCount smCount;} param;}`` with
  ``CUexecAffinitySmCount = {unsigned int val;}``: "the number of SMs the context is limited to
  use". Execution affinity is the per-context form of MPS's SM provisioning (contexts created with
  an SM count through ``cuCtxCreate_v3`` under MPS); that this query shows the daemon's default
  active thread percentage is UNCONFIRMED until ``check-node`` has run on a GPU.
* ``CUresult cuGetErrorName(CUresult error, const char **pStr)`` names a code.
* The ``CUresult`` codes printed by name: ``CUDA_ERROR_NAMES`` below (``cuda.h``).
* MPS: "When CUDA is first initialized in a program, the CUDA driver attempts to connect to the MPS
  control daemon. If the connection attempt fails, the program continues to run as it normally
  would without MPS" (nvidia-cuda-mps-control(1)). So the caller points the SM-count probe at an
  empty pipe directory, and the MPS client check tells from the device it sees and from the exec
  affinity whether it really ran under the daemon.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
from collections.abc import Sequence
from typing import Protocol

from pydantic import BaseModel, ConfigDict

from driver.units import MIB

CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16
CU_EXEC_AFFINITY_TYPE_SM_COUNT = 0
CUDA_SUCCESS = 0
CUDA_ERROR_OUT_OF_MEMORY = 2
CUDA_ERROR_NAMES: dict[int, str] = {
    0: "CUDA_SUCCESS",
    1: "CUDA_ERROR_INVALID_VALUE",
    2: "CUDA_ERROR_OUT_OF_MEMORY",
    3: "CUDA_ERROR_NOT_INITIALIZED",
    100: "CUDA_ERROR_NO_DEVICE",
    101: "CUDA_ERROR_INVALID_DEVICE",
    801: "CUDA_ERROR_NOT_SUPPORTED",
    805: "CUDA_ERROR_MPS_CONNECTION_FAILED",
    806: "CUDA_ERROR_MPS_RPC_FAILURE",
    807: "CUDA_ERROR_MPS_SERVER_NOT_READY",
    808: "CUDA_ERROR_MPS_MAX_CLIENTS_REACHED",
    809: "CUDA_ERROR_MPS_MAX_CONNECTIONS_REACHED",
    810: "CUDA_ERROR_MPS_CLIENT_TERMINATED",
}


class CudaError(Exception):
    """A CUDA driver call returned something other than CUDA_SUCCESS."""

    def __init__(self, call: str, code: int, name: str) -> None:
        super().__init__(f"{call} returned {name} ({code})")
        self.call = call
        self.code = code
        self.name = name


class CudaApi(Protocol):
    """The driver API calls the probes make, each raising :class:`CudaError` on failure."""

    def init(self) -> None: ...

    def device_count(self) -> int: ...

    def device(self, ordinal: int) -> int: ...

    def device_uuid(self, device: int) -> bytes: ...

    def attribute(self, attribute: int, device: int) -> int: ...

    def use_primary_context(self, device: int) -> None: ...

    def exec_affinity_sm_count(self) -> int: ...

    def mem_alloc(self, size: int) -> int: ...

    def mem_free(self, pointer: int) -> None: ...


def format_uuid(raw: bytes) -> str:
    """16 UUID bytes as NVML prints them after its ``GPU-``/``MIG-`` prefix: 8-4-4-4-12 lower-case hex.

    The prefix is left to the caller: ``cuDeviceGetUuid_v2`` gives a MIG device's own UUID, and the
    bytes alone do not say which kind they are.
    """
    if len(raw) != 16:
        raise ValueError(f"a CUDA UUID has 16 bytes, got {len(raw)}")
    h = raw.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def bare_uuid(uuid: str) -> str:
    """``GPU-…``/``MIG-…`` without its prefix, lower-cased, for comparing with :func:`format_uuid`."""
    return uuid.split("-", 1)[1].lower() if uuid[:4] in ("GPU-", "MIG-") else uuid.lower()


class SmCounts(BaseModel):
    """What ``sm-counts`` prints: SM count per device, keyed by :func:`format_uuid` (no prefix)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    counts: dict[str, int] = {}
    error: str | None = None


class ClientReport(BaseModel):
    """What ``mps-client`` prints: what one CUDA client could use on device 0."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    device_uuid: str | None = None  # :func:`format_uuid` form
    multiprocessors: int | None = None  # CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT as this client sees it
    affinity_sm_count: int | None = None  # cuCtxGetExecAffinity(SM_COUNT): what its context may use
    allocated_bytes: int = 0  # cuMemAlloc succeeded for this much in total before it stopped
    allocation_error: str | None = None  # the CUresult name that stopped the allocations; None = hit the cap
    error: str | None = None  # a failure before the allocations (no device, no context, ...)


def sm_counts(api: CudaApi) -> SmCounts:
    """SM count of every device CUDA enumerates, keyed by its UUID without prefix."""
    try:
        api.init()
        counts: dict[str, int] = {}
        for ordinal in range(api.device_count()):
            device = api.device(ordinal)
            counts[format_uuid(api.device_uuid(device))] = api.attribute(
                CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, device)
    except CudaError as exc:
        return SmCounts(error=str(exc))
    return SmCounts(counts=counts)


def mps_client(api: CudaApi, step_bytes: int, cap_bytes: int) -> ClientReport:
    """Open device 0 the way an MPS client does, read its SM limit, then allocate ``step_bytes`` at a
    time until an allocation fails or ``cap_bytes`` are held; everything is freed before returning."""
    report: dict[str, object] = {}
    try:
        api.init()
        device = api.device(0)
        report["device_uuid"] = format_uuid(api.device_uuid(device))
        report["multiprocessors"] = api.attribute(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, device)
        # Retained for the life of this short process; its exit releases it.
        api.use_primary_context(device)
        report["affinity_sm_count"] = api.exec_affinity_sm_count()
    except CudaError as exc:
        return ClientReport.model_validate({**report, "error": str(exc)})
    held: list[int] = []
    allocation_error: str | None = None
    try:
        while len(held) * step_bytes + step_bytes <= cap_bytes:
            try:
                held.append(api.mem_alloc(step_bytes))
            except CudaError as exc:
                allocation_error = exc.name
                break
    finally:
        for pointer in held:
            try:
                api.mem_free(pointer)
            except CudaError:
                break  # the context is gone; the process exit frees the rest
    return ClientReport.model_validate({**report, "allocated_bytes": len(held) * step_bytes,
                                        "allocation_error": allocation_error})


class _ExecAffinitySmCount(ctypes.Structure):
    _fields_ = [("val", ctypes.c_uint)]


class _ExecAffinityUnion(ctypes.Union):
    _fields_ = [("smCount", _ExecAffinitySmCount)]


class _ExecAffinityParam(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("param", _ExecAffinityUnion)]


class LibCuda:
    """:class:`CudaApi` over ``libcuda.so.1`` at ``path`` (the driver root's, not the loader's choice)."""

    def __init__(self, path: str) -> None:
        self._lib = ctypes.CDLL(path)

    def _call(self, name: str, *args: object) -> None:
        function = getattr(self._lib, name)  # AttributeError: a driver too old for the call
        function.restype = ctypes.c_int
        code = int(function(*args))
        if code != CUDA_SUCCESS:
            raise CudaError(name, code, self._error_name(code))

    def _error_name(self, code: int) -> str:
        text = ctypes.c_char_p()
        try:
            self._lib.cuGetErrorName.restype = ctypes.c_int
            if self._lib.cuGetErrorName(ctypes.c_int(code), ctypes.byref(text)) == CUDA_SUCCESS and text.value:
                return text.value.decode(errors="replace")
        except AttributeError:
            pass
        return CUDA_ERROR_NAMES.get(code, f"CUresult {code}")

    def init(self) -> None:
        self._call("cuInit", ctypes.c_uint(0))

    def device_count(self) -> int:
        count = ctypes.c_int()
        self._call("cuDeviceGetCount", ctypes.byref(count))
        return count.value

    def device(self, ordinal: int) -> int:
        device = ctypes.c_int()
        self._call("cuDeviceGet", ctypes.byref(device), ctypes.c_int(ordinal))
        return device.value

    def device_uuid(self, device: int) -> bytes:
        raw = (ctypes.c_char * 16)()
        name = "cuDeviceGetUuid_v2" if hasattr(self._lib, "cuDeviceGetUuid_v2") else "cuDeviceGetUuid"
        self._call(name, ctypes.byref(raw), ctypes.c_int(device))
        return bytes(raw.raw)

    def attribute(self, attribute: int, device: int) -> int:
        value = ctypes.c_int()
        self._call("cuDeviceGetAttribute", ctypes.byref(value), ctypes.c_int(attribute), ctypes.c_int(device))
        return value.value

    def use_primary_context(self, device: int) -> None:
        context = ctypes.c_void_p()
        self._call("cuDevicePrimaryCtxRetain", ctypes.byref(context), ctypes.c_int(device))
        self._call("cuCtxSetCurrent", context)

    def exec_affinity_sm_count(self) -> int:
        param = _ExecAffinityParam()
        self._call("cuCtxGetExecAffinity", ctypes.byref(param), ctypes.c_int(CU_EXEC_AFFINITY_TYPE_SM_COUNT))
        return int(param.param.smCount.val)

    def mem_alloc(self, size: int) -> int:
        pointer = ctypes.c_ulonglong()
        self._call("cuMemAlloc_v2", ctypes.byref(pointer), ctypes.c_size_t(size))
        return pointer.value

    def mem_free(self, pointer: int) -> None:
        self._call("cuMemFree_v2", ctypes.c_ulonglong(pointer))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m driver.gpu.discovery.cudaprobe",
                                     description="CUDA probes run as a child process by the driver")
    sub = parser.add_subparsers(dest="probe", required=True)
    counts = sub.add_parser("sm-counts", help="SM count of every device CUDA enumerates, by UUID")
    counts.add_argument("--libcuda", required=True)
    client = sub.add_parser("mps-client", help="what a CUDA client may use on device 0 (run with the MPS env)")
    client.add_argument("--libcuda", required=True)
    client.add_argument("--step-mib", type=int, default=128)
    client.add_argument("--cap-mib", type=int, required=True)
    args = parser.parse_args(argv)
    try:
        api = LibCuda(args.libcuda)
    except OSError as exc:
        print(json.dumps({"error": f"cannot load {args.libcuda}: {exc}"}))
        return 0
    try:
        if args.probe == "sm-counts":
            print(sm_counts(api).model_dump_json())
        else:
            print(mps_client(api, args.step_mib * MIB, args.cap_mib * MIB).model_dump_json())
    except AttributeError as exc:  # a libcuda without one of the calls (older than CUDA 11.4)
        print(json.dumps({"error": f"{args.libcuda} lacks a needed call: {exc}"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
