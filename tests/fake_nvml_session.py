"""The NVML session part of the fake NVML module (``tests/fake_nvml.py``), split out by role:
``nvmlInit`` / ``nvmlShutdown`` reference counting, what a *new* session changes, and the
by-UUID handle lookup used to find a GPU again after one.

What it models (nvml.h: ``nvmlInit_v2``, ``nvmlShutdown``, ``nvmlDeviceGetHandleByUUID``):

* init is reference-counted: only the shutdown matching the first init ends the session;
* ending the session frees every event set (waits on them raise InvalidArgument, as on any freed
  set); a new session hands out **new** device handles: a handle from an earlier session answers
  ``NVMLError_InvalidArgument``, as a handle NVML no longer knows does;
* a GPU that fell off the bus (``FakeGpu.lose``) and was then reset or rebound
  (``FakeGpu.reset``) is still lost for the session that saw it fall: an initialised NVML keeps
  its view of the device. Only a new session (every holder shut down, then an init) sees it
  answer again. ``FakeGpu.recover`` is the other case: back within the same session;
* ``init_error`` makes every init fail with that code (a driver being unloaded:
  ``NVML_ERROR_DRIVER_NOT_LOADED``; a driver upgraded under a running process:
  ``NVML_ERROR_LIB_RM_VERSION_MISMATCH``, the loaded library no longer matches the kernel module).

``FakeNvml`` inherits :class:`SessionMixin`.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Any

import pynvml as _real

if TYPE_CHECKING:
    from tests.fake_nvml import FakeGpu


def _err(code: int) -> _real.NVMLError:
    return _real.NVMLError(code)


class SessionMixin:
    """``nvmlInit*``, ``nvmlShutdown`` and ``nvmlDeviceGetHandleByUUID`` of the fake."""

    if TYPE_CHECKING:  # provided by FakeNvml
        gpus: list[FakeGpu]
        calls: Any
        init_error: int | None
        _handles: dict[int, Any]
        _gpu_handle: dict[int, Any]
        _slice_handle: dict[tuple[int, int], Any]

        def _check_init(self) -> None: ...
        def _pointer(self, ptr_type: Any, target: Any = None) -> Any: ...
        def _register_slices(self, gpu: FakeGpu) -> None: ...
        def _free_all_event_sets(self) -> None: ...
        @staticmethod
        def _addr(ptr: Any) -> int | None: ...

    #: NVML's init reference count.
    init_count = 0
    #: Sessions begun (inits from a count of 0): a test can tell a re-initialisation happened.
    sessions = 0

    def nvmlInitWithFlags(self, flags: int) -> None:
        self.calls[("nvmlInit", None)] += 1
        if self.init_error is not None:
            raise _err(self.init_error)
        if self.init_count == 0:
            self._new_session()
        self.init_count += 1

    def nvmlInit(self) -> None:
        self.nvmlInitWithFlags(0)

    def nvmlShutdown(self) -> None:
        self.calls[("nvmlShutdown", None)] += 1
        self._check_init()
        self.init_count -= 1
        if self.init_count == 0:
            self._free_all_event_sets()

    def _new_session(self) -> None:
        if self.sessions:
            for gpu in self.gpus:  # handles of the session that ended are unknown from now on
                self._handles.pop(self._addr(self._gpu_handle[gpu.index]), None)  # type: ignore[arg-type]
                self._gpu_handle[gpu.index] = self._pointer(_real.c_nvmlDevice_t, (gpu, None))
                for key in [k for k in self._slice_handle if k[0] == gpu.index]:
                    self._handles.pop(self._addr(self._slice_handle.pop(key)), None)  # type: ignore[arg-type]
                self._register_slices(gpu)
        for gpu in self.gpus:
            if gpu.reset_pending:
                gpu.reset_pending = False
                gpu.lost = False
        self.sessions += 1

    def nvmlDeviceGetHandleByUUID(self, uuid: Any) -> Any:
        self._check_init()
        want = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
        self.calls[("nvmlDeviceGetHandleByUUID", None)] += 1
        for gpu in self.gpus:
            if gpu.uuid == want:
                if gpu.lost:
                    raise _err(_real.NVML_ERROR_GPU_IS_LOST)
                return ctypes.cast(self._gpu_handle[gpu.index], _real.c_nvmlDevice_t)
        raise _err(_real.NVML_ERROR_NOT_FOUND)
