"""NVML calls in the driver's own process, each bounded in time, on one NVML session opened at first use.

Why bounded: NVML calls cannot be interrupted, and on a GPU that fell off the bus or a wedged kernel driver one can
block for minutes inside the driver's ioctl. Each call therefore runs on a daemon thread of its own and the caller
waits at most its timeout; a call that overruns is left to finish in the background. Until it does, further calls
for the same key (a GPU) fail at once, naming the stuck call, instead of piling up threads behind it; other GPUs go
on. Such a call cannot be killed: its thread ends with the driver process (a hung GPU needs a reset anyway).

Why one session: NVML counts ``nvmlInit`` calls, so each user (compute modes, MIG partitioning) opens its own
session at first use and ends only that one (discovery and the health source keep theirs).

Used by ``computemode.py`` and ``nvmlmig.py``; their errors wrap :class:`NvmlCallError`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from driver.gpu.discovery.nvml import end_nvml_session
from driver.gpu.errors import DriverError

log = logging.getLogger(__name__)

T = TypeVar("T")


class NvmlCallError(DriverError):
    """The call was not made or not waited for: no time left, its GPU fenced, overran, or NVML cannot start."""


def no_library_to_load() -> None:
    """The library is already where pynvml finds it (driver root ``/``), or the NVML is simulated."""


class BoundedNvml:
    """Runs NVML work on a daemon thread per call, waiting at most a timeout; fences a key while its call hangs.

    ``nvml`` is the pynvml module (or a double with its names); ``load_library`` makes the driver root's
    ``libnvidia-ml.so.1`` loadable before the first ``nvmlInit``; ``purpose`` completes "NVML cannot be loaded
    to ..." messages; ``thread_name`` prefixes the worker threads' names (``"<thread_name> <key>"``).
    """

    def __init__(self, nvml: Any, purpose: str, thread_name: str,
                 load_library: Callable[[], None] = no_library_to_load) -> None:
        self._nvml = nvml
        self._purpose = purpose
        self._thread_name = thread_name
        self._load_library = load_library
        self._init_lock = threading.Lock()
        self._initialised = False
        self._lock = threading.Lock()
        self._stuck: dict[str, str] = {}  # key -> the call still running past its timeout

    def run(self, key: str, what: str, work: Callable[[], T], timeout: float,
            on_late_result: Callable[[T], None] | None = None) -> T:
        """``work()`` on its own thread within ``timeout`` seconds: its result, or what it raised, re-raised here.

        ``on_late_result`` gets the result of a call that returned after its caller stopped waiting (on the
        worker thread), so work that made something nobody will record can undo it.
        """
        if timeout <= 0:
            raise NvmlCallError(f"no time left to call NVML {what} for {key}")
        with self._lock:
            stuck = self._stuck.get(key)
        if stuck is not None:
            raise NvmlCallError(f"{what} for {key} not tried: NVML has not returned from {stuck} for this GPU, "
                                "which overran its timeout (a hung GPU or NVIDIA driver; see the kernel log)")
        outcome: list[tuple[bool, Any]] = []
        done = threading.Event()
        abandoned = threading.Event()

        def run() -> None:
            try:
                self._ensure_initialised()
                outcome.append((True, work()))
            except BaseException as exc:  # handed to the caller, which raises it in its own thread
                outcome.append((False, exc))
            with self._lock:
                done.set()
                late = abandoned.is_set()
            ok, value = outcome[0]
            if late and ok and on_late_result is not None:
                try:  # before the fence lifts, so no new call on this GPU runs beside the clean-up
                    on_late_result(value)
                except Exception:
                    log.exception("cleaning up after a late NVML call failed", extra={"key": key, "call": what})
            with self._lock:
                if self._stuck.get(key) == what:
                    del self._stuck[key]
                    log.warning("a stuck NVML call returned", extra={"key": key, "call": what})

        threading.Thread(target=run, name=f"{self._thread_name} {key}", daemon=True).start()
        done.wait(timeout)
        with self._lock:
            if not done.is_set():
                abandoned.set()
                self._stuck[key] = what
                raise NvmlCallError(f"NVML did not return from {what} for {key} within {timeout:.1f} s (a hung "
                                    "GPU or NVIDIA driver); the call goes on in the background and this GPU is "
                                    "not touched until it returns")
        ok, value = outcome[0]
        if ok:
            return value  # type: ignore[no-any-return]
        raise value

    def close(self) -> None:
        """End this object's NVML session (the others' stay: NVML counts them)."""
        with self._init_lock:
            if not self._initialised:
                return
            self._initialised = False
            end_nvml_session(self._nvml)

    def _ensure_initialised(self) -> None:
        with self._init_lock:
            if self._initialised:
                return
            try:
                self._load_library()
            except (RuntimeError, OSError) as exc:
                raise NvmlCallError(f"NVML cannot be loaded to {self._purpose}: {exc}") from exc
            try:
                self._nvml.nvmlInit()
            except self._nvml.NVMLError as err:
                raise NvmlCallError(f"NVML initialisation failed ({err}); cannot {self._purpose} "
                                    "(is the NVIDIA driver loaded?)") from err
            self._initialised = True
