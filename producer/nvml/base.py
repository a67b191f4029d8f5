"""What every NVML collector shares: the ``Collector`` protocol and the per-device context.

A collector reads one field group from one device and returns GpuSample fields in the contract's
units. It never imports ``pynvml``: the module object arrives injected (``DeviceContext.nvml``),
so tests hand in ``tests/fake_nvml.py``. Every NVML call goes through :meth:`DeviceContext.call`,
which applies one error policy for all collectors:

* ``NVMLError_NotSupported``, ``NVMLError_FunctionNotFound``, ``NVMLError_NoPermission``,
  ``NVMLError_ArgumentVersionMismatch``, ``NVMLLibraryMismatchError`` and a function missing
  from an older binding (``AttributeError`` on the module) mean "this device cannot answer
  this now": the call key is **learned** for the device (the field stays null). A hardware answer
  (NotSupported, a missing binding function) is learned for good; a refusal about rights or
  versions (NoPermission, FunctionNotFound, the version mismatches) is asked again after a
  back-off of minutes (:mod:`gpupipe_producer.nvml.learned`), so granting rights or upgrading the driver
  needs no restart. Link probes (``probe=True``) also learn ``NVMLError_InvalidArgument``:
  drivers reject link ids they do not have with it (GB200: links 18..35).
* ``NVMLError_GpuIsLost`` propagates: the source marks the whole GPU lost.
* Any other ``NVMLError`` is transient: counted by class name, the field is null this time,
  and the call is made again at the next interval.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from gpupipe_producer.nvml.convert import field_value
from gpupipe_producer.nvml.learned import RETRY_S, Learned, refusal_kind

log = logging.getLogger("gpupipe.nvml")


class NvmlErrors:
    """The error classes of one injected NVML module (the real ones, also in the fake)."""

    __slots__ = ("base", "lost", "not_found", "probe", "timeout", "unsupported")

    def __init__(self, nvml: Any) -> None:
        self.base: type[BaseException] = nvml.NVMLError
        self.lost: type[BaseException] = nvml.NVMLError_GpuIsLost
        self.not_found: type[BaseException] = nvml.NVMLError_NotFound
        self.timeout: type[BaseException] = nvml.NVMLError_Timeout
        unsupported: list[type[BaseException]] = [
            nvml.NVMLError_NotSupported,
            nvml.NVMLError_FunctionNotFound,
            nvml.NVMLError_NoPermission,
        ]
        for name in ("NVMLError_ArgumentVersionMismatch", "NVMLLibraryMismatchError"):
            cls = getattr(nvml, name, None)
            if isinstance(cls, type):
                unsupported.append(cls)
        self.unsupported: tuple[type[BaseException], ...] = tuple(unsupported)
        self.probe: tuple[type[BaseException], ...] = (*unsupported, nvml.NVMLError_InvalidArgument)


class Reporter(Protocol):
    """Where a context reports what it sees (the source's counters and hooks)."""

    def error(self, kind: str) -> None: ...

    def garbage(self, field: str) -> None: ...

    def learned(self, ctx: DeviceContext, key: str, reason: str) -> None: ...


class DeviceContext:
    """One device as the collectors see it: a whole GPU, or one MIG slice of it.

    ``handle`` is the NVML handle (MIG device handle for a slice); ``parent`` is the whole-GPU
    context of a slice. ``state`` is per-collector scratch that must survive between ticks (the
    previous GPM sample, the last per-process utilisation timestamp, cached process names).
    """

    __slots__ = (
        "compute_instance_id",
        "errors",
        "gpm_supported",
        "gpu_instance_id",
        "handle",
        "index",
        "is_mig",
        "mig_enabled",
        "model_name",
        "nvml",
        "parent",
        "pci_bus_id",
        "reporter",
        "state",
        "unsupported",
        "uuid",
    )

    def __init__(
        self,
        nvml: Any,
        index: int,
        handle: Any,
        reporter: Reporter,
        *,
        errors: NvmlErrors | None = None,
        parent: DeviceContext | None = None,
        gpu_instance_id: int | None = None,
        compute_instance_id: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        refused_retry_s: float = RETRY_S,
    ) -> None:
        self.nvml = nvml
        self.index = index
        self.handle = handle
        self.reporter = reporter
        self.errors = errors or NvmlErrors(nvml)
        self.parent = parent
        self.is_mig = parent is not None
        self.gpu_instance_id = gpu_instance_id
        self.compute_instance_id = compute_instance_id
        self.uuid = ""
        self.model_name = ""
        self.pci_bus_id = ""
        self.mig_enabled: bool | None = None
        self.gpm_supported: bool | None = None
        self.unsupported = Learned(clock, refused_retry_s)
        self.state: dict[str, Any] = {}

    def __repr__(self) -> str:
        kind = f"mig gi={self.gpu_instance_id} ci={self.compute_instance_id}" if self.is_mig else "gpu"
        return f"DeviceContext({self.index} {kind} {self.uuid or '?'})"

    # -- NVML calls under the shared error policy ---------------------------------------------
    def call(self, key: str, fn_name: str, *args: Any, probe: bool = False, **kwargs: Any) -> Any:
        """``nvml.<fn_name>(*args, **kwargs)``, or None if ``key`` is (or becomes) unsupported.

        Raises the module's ``NVMLError_GpuIsLost``; every other NVML error becomes None.
        """
        if key in self.unsupported:
            return None
        fn = getattr(self.nvml, fn_name, None)
        if fn is None:
            self.learn(key, f"{fn_name} missing from the NVML binding")
            return None
        learnable = self.errors.probe if probe else self.errors.unsupported
        try:
            value = fn(*args, **kwargs)
        except self.errors.lost:
            raise
        except learnable as exc:
            self.learn(key, f"{type(exc).__name__}: {exc}")
            return None
        except self.errors.base as exc:
            self.reporter.error(type(exc).__name__)
            return None
        self.unsupported.answered(key)
        return value

    def check(self, ret: int, key: str, *, probe: bool = False) -> bool:
        """Apply the call policy to a per-item return code (field values, GPM metrics).

        True when ``ret`` is success; raises the module's GpuIsLost error for that code.
        """
        if ret == 0:
            self.unsupported.answered(key)
            return True
        exc = self.errors.base(ret)
        if isinstance(exc, self.errors.lost):
            raise exc
        if isinstance(exc, self.errors.probe if probe else self.errors.unsupported):
            self.learn(key, f"{type(exc).__name__}: {exc}")
        else:
            self.reporter.error(type(exc).__name__)
        return False

    def supported(self, key: str) -> bool:
        return key not in self.unsupported

    def learn(self, key: str, reason: str) -> None:
        """Remember that this device cannot answer ``key``: for good, or until its retry time
        (:mod:`gpupipe_producer.nvml.learned`, by the refusal kind in ``reason``)."""
        if key not in self.unsupported:
            self.unsupported.add(key, refusal_kind(reason))
            self.reporter.learned(self, key, reason)

    def garbage(self, field: str) -> None:
        self.reporter.garbage(field)

    def put(self, out: dict[str, Any], field: str, convert: Callable[[Any], Any], raw: Any) -> None:
        """``out[field] = convert(raw)``; a raw value the converter rejects is counted as garbage."""
        if raw is None:
            return
        value = convert(raw)
        if value is None:
            self.reporter.garbage(field)
            return
        out[field] = value


FieldSpec = tuple[str, int, int | None, bool]
"""(key, NVML field id, scope id or None, probe): one entry of a field-values request."""


def read_field_values(ctx: DeviceContext, specs: Sequence[FieldSpec]) -> dict[str, Any]:
    """Read several ``NVML_FI_*`` fields in one ``nvmlDeviceGetFieldValues`` call.

    Each field has its own return code; an unsupported field is learned under its own key and
    left out of later requests. Returns {key: raw value} for the fields that answered.
    """
    wanted = [s for s in specs if s[0] not in ctx.unsupported]
    if not wanted:
        return {}
    ids = [fid if scope is None else (fid, scope) for _, fid, scope, _ in wanted]
    values = ctx.call("field_values", "nvmlDeviceGetFieldValues", ctx.handle, ids)
    if values is None:
        return {}
    out: dict[str, Any] = {}
    for (key, _, _, probe), fv in zip(wanted, values, strict=False):
        if ctx.check(int(fv.nvmlReturn), key, probe=probe):
            out[key] = field_value(fv)
    return out


@runtime_checkable
class Collector(Protocol):
    """One NVML field group, polled at its own interval.

    ``name`` is the group name (also the key in ``NvmlSource(intervals=...)``); ``fields`` the
    GpuSample fields it may set. ``collect`` returns only the fields it could read (the source
    fills the rest with null), raises the module's ``NVMLError_GpuIsLost`` when the GPU is gone,
    and may raise anything else on a bug: the source counts it and nulls this group only.
    """

    name: str
    fields: tuple[str, ...]

    def collect(self, ctx: DeviceContext) -> dict[str, Any]: ...

    def release(self, ctx: DeviceContext) -> None:
        """Free NVML resources held for ``ctx`` (GPM samples); called at shutdown."""
        ...
