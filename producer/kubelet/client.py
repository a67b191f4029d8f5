"""kubelet PodResources client (I/O adapter) and the per-interval refresher the producer uses.

:class:`PodResourcesClient` calls ``v1.PodResourcesLister/List`` over the kubelet's unix socket with a
deadline and returns an :class:`~gpupipe_producer.kubelet.mapping.AllocationMap`; it raises on failure.

:class:`AllocationRefresher` wraps it for the sample loop: ``refresh()`` never raises. On any failure
(socket absent, UNAVAILABLE, DEADLINE_EXCEEDED, other RpcError, undecodable or malformed response) it
returns an EMPTY map, so samples go out without pod fields. The previous map is deliberately NOT
reused: a pod that ended in the meantime would keep its attribution, and we prefer no labels over wrong
labels (design section 4). Each failure increments a counter by kind (``error_counts``, and the
optional ``on_error(kind)`` hook, meant for ``gpupipe_kubelet_errors_total{kind}``) and is logged on the
``gpupipe.kubelet`` logger at most once per ``log_interval_s`` (60 s) per kind; the first success after
a failure is logged at INFO (rate-limited the same way). After a failure the gRPC channel is dropped and
recreated on the next call, so a kubelet restart (socket deleted and recreated) is picked up at the next
refresh without waiting for gRPC's reconnect backoff.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from gpupipe_producer.kubelet import api_pb2, api_pb2_grpc
from gpupipe_producer.kubelet.mapping import (
    DEFAULT_DRA_DRIVERS,
    AllocationMap,
    AllocationMapper,
    ClaimResource,
    ContainerDevices,
    ContainerResources,
    DynamicResource,
    PodResources,
)

DEFAULT_SOCKET_PATH = "/var/lib/kubelet/pod-resources/kubelet.sock"
# The kubelet's own podresources client allows 16 MiB messages; gRPC Python defaults to 4 MiB.
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
LIST_METHOD = "/v1.PodResourcesLister/List"

LOGGER_NAME = "gpupipe.kubelet"
log = logging.getLogger(LOGGER_NAME)

# Error kinds (the label values of gpupipe_kubelet_errors_total{kind}); a closed set.
ERR_SOCKET_ABSENT = "socket_absent"
ERR_UNAVAILABLE = "unavailable"
ERR_DEADLINE = "deadline_exceeded"
ERR_RPC = "rpc_error"
ERR_BAD_RESPONSE = "bad_response"
ERR_UNEXPECTED = "unexpected"
ERROR_KINDS: tuple[str, ...] = (
    ERR_SOCKET_ABSENT,
    ERR_UNAVAILABLE,
    ERR_DEADLINE,
    ERR_RPC,
    ERR_BAD_RESPONSE,
    ERR_UNEXPECTED,
)


class KubeletSocketAbsent(FileNotFoundError):
    """The PodResources socket does not exist (kubelet down/restarting, or the directory not mounted)."""


class KubeletBadResponse(ValueError):
    """The kubelet answered with something that could not be decoded or converted."""


# --------------------------------------------------------------------------------------------------
# protobuf -> plain dataclasses


def pod_resources_from_proto(msg: api_pb2.ListPodResourcesResponse) -> tuple[PodResources, ...]:
    """Convert a ``ListPodResourcesResponse`` into the plain structure ``mapping`` works on."""
    return tuple(
        PodResources(
            name=p.name,
            namespace=p.namespace,
            containers=tuple(
                ContainerResources(
                    name=c.name,
                    devices=tuple(ContainerDevices(d.resource_name, tuple(d.device_ids)) for d in c.devices),
                    dynamic_resources=tuple(
                        DynamicResource(
                            claim_name=dr.claim_name,
                            claim_namespace=dr.claim_namespace,
                            claim_resources=tuple(
                                ClaimResource(
                                    driver_name=cr.driver_name,
                                    pool_name=cr.pool_name,
                                    device_name=cr.device_name,
                                    cdi_devices=tuple(x.name for x in cr.cdi_devices),
                                    share_id=cr.share_id if cr.HasField("share_id") else None,
                                )
                                for cr in dr.claim_resources
                            ),
                        )
                        for dr in c.dynamic_resources
                    ),
                )
                for c in p.containers
            ),
        )
        for p in msg.pod_resources
    )


# --------------------------------------------------------------------------------------------------
# client


class PodResourcesClient:
    """Thin client of the kubelet PodResources v1 API on a unix socket. Methods raise on failure.

    The channel is created lazily and reused; :meth:`reset` drops it (the next call makes a new one).
    Not thread-safe by itself; :class:`AllocationRefresher` serialises its calls.
    """

    def __init__(self, socket_path: str = DEFAULT_SOCKET_PATH, timeout_s: float = 2.0) -> None:
        if not os.path.isabs(socket_path):
            raise ValueError(f"kubelet socket path must be absolute, got {socket_path!r}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self.socket_path = socket_path
        self.timeout_s = float(timeout_s)
        self.target = "unix://" + socket_path
        self._channel: grpc.Channel | None = None
        self._stub: api_pb2_grpc.PodResourcesListerStub | None = None
        self._list_raw: grpc.UnaryUnaryMultiCallable | None = None

    def _connect(self) -> tuple[api_pb2_grpc.PodResourcesListerStub, grpc.UnaryUnaryMultiCallable]:
        if self._stub is None or self._list_raw is None:
            self._channel = grpc.insecure_channel(
                self.target,
                options=[
                    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                    ("grpc.initial_reconnect_backoff_ms", 100),
                    ("grpc.min_reconnect_backoff_ms", 100),
                    ("grpc.max_reconnect_backoff_ms", 1000),
                ],
            )
            self._stub = api_pb2_grpc.PodResourcesListerStub(self._channel)
            # List without a response deserializer: we parse the bytes ourselves, so an undecodable
            # answer is a KubeletBadResponse (rate-limited by the refresher) instead of an ERROR with
            # traceback from grpc's own logger on every call.
            self._list_raw = self._channel.unary_unary(
                LIST_METHOD,
                request_serializer=api_pb2.ListPodResourcesRequest.SerializeToString,
                response_deserializer=None,
            )
        return self._stub, self._list_raw

    def _check_socket(self) -> None:
        if not os.path.exists(self.socket_path):
            raise KubeletSocketAbsent(f"kubelet pod-resources socket {self.socket_path} does not exist")

    def list_response(self) -> api_pb2.ListPodResourcesResponse:
        """Raw ``List`` call. Raises KubeletSocketAbsent, grpc.RpcError or KubeletBadResponse."""
        self._check_socket()
        _, list_raw = self._connect()
        raw = list_raw(api_pb2.ListPodResourcesRequest(), timeout=self.timeout_s)
        if not isinstance(raw, bytes):
            raise KubeletBadResponse(f"unexpected List response type {type(raw).__name__}")
        try:
            return api_pb2.ListPodResourcesResponse.FromString(raw)
        except DecodeError as exc:
            raise KubeletBadResponse(f"undecodable List response ({len(raw)} bytes): {exc}") from exc

    def list_pod_resources(self) -> tuple[PodResources, ...]:
        """``List`` as plain dataclasses. Raises KubeletSocketAbsent, grpc.RpcError, KubeletBadResponse."""
        resp = self.list_response()
        if not isinstance(resp, api_pb2.ListPodResourcesResponse):
            raise KubeletBadResponse(f"unexpected List response type {type(resp).__name__}")
        try:
            return pod_resources_from_proto(resp)
        except (AttributeError, TypeError, ValueError) as exc:  # defensive: malformed message
            raise KubeletBadResponse(f"cannot convert List response: {exc}") from exc

    def list_allocations(
        self,
        extra_resource_names: Iterable[str] = (),
        *,
        mapper: AllocationMapper | None = None,
    ) -> AllocationMap:
        """``List`` + mapping. ``mapper`` (if given) overrides ``extra_resource_names``."""
        if mapper is None:
            mapper = AllocationMapper(tuple(extra_resource_names))
        amap = mapper.build(self.list_pod_resources())
        try:
            allocatable = self.get_allocatable()
            devices = tuple(
                ContainerDevices(d.resource_name, tuple(d.device_ids)) for d in allocatable.devices
            )
        except (grpc.RpcError, KubeletSocketAbsent, AttributeError, TypeError, ValueError) as exc:
            # Replica counts only refine shared GPUs' bills: a kubelet that cannot tell them
            # (too old, or the call failed) still gives the allocations.
            log.debug("kubelet GetAllocatableResources failed: %s", exc)
            return amap
        return amap.with_replicas(mapper.replica_counts(devices))

    def get_allocatable(self) -> api_pb2.AllocatableResourcesResponse:
        """Raw ``GetAllocatableResources`` (allocatable, not free, devices). Raises like list_response."""
        self._check_socket()
        stub, _ = self._connect()
        return stub.GetAllocatableResources(api_pb2.AllocatableResourcesRequest(), timeout=self.timeout_s)

    def reset(self) -> None:
        """Close the channel; the next call opens a new one."""
        channel, self._channel, self._stub, self._list_raw = self._channel, None, None, None
        if channel is not None:
            try:
                channel.close()
            except Exception:  # closing must never be the thing that fails
                log.debug("error closing kubelet channel", exc_info=True)

    close = reset

    def __enter__(self) -> PodResourcesClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def classify_error(exc: BaseException) -> str:
    """Map an exception from :class:`PodResourcesClient` to one of ``ERROR_KINDS``."""
    if isinstance(exc, KubeletSocketAbsent):
        return ERR_SOCKET_ABSENT
    if isinstance(exc, KubeletBadResponse | DecodeError):
        return ERR_BAD_RESPONSE
    if isinstance(exc, grpc.RpcError):
        code = exc.code() if callable(getattr(exc, "code", None)) else None
        if code == grpc.StatusCode.UNAVAILABLE:
            return ERR_UNAVAILABLE
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return ERR_DEADLINE
        details = exc.details() if callable(getattr(exc, "details", None)) else ""
        # A response that fails to parse surfaces as INTERNAL "Exception deserializing response!".
        if code == grpc.StatusCode.INTERNAL and "deserializ" in (details or "").lower():
            return ERR_BAD_RESPONSE
        return ERR_RPC
    return ERR_UNEXPECTED


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.RpcError) and callable(getattr(exc, "code", None)):
        try:
            return f"{exc.code().name}: {exc.details()}"
        except Exception:
            pass
    return f"{type(exc).__name__}: {exc}"


# --------------------------------------------------------------------------------------------------
# refresher


class AllocationRefresher:
    """Fetches a fresh :class:`AllocationMap` each sample interval; ``refresh()`` never raises.

    Failure -> empty map (never the previous one), ``error_counts[kind] += 1``, ``on_error(kind)``,
    a rate-limited WARNING. Success after failure -> one INFO line. Thread-safe.

    ``healthy`` is True iff the last refresh succeeded (False before the first one).
    ``last_success_time`` is the wall-clock time (``time.time()``) of the last success, or None.
    """

    def __init__(
        self,
        client: PodResourcesClient | None = None,
        *,
        socket_path: str = DEFAULT_SOCKET_PATH,
        timeout_s: float = 2.0,
        extra_resource_names: Iterable[str] = (),
        dra_driver_names: Iterable[str] = DEFAULT_DRA_DRIVERS,
        mapper: AllocationMapper | None = None,
        on_error: Callable[[str], None] | None = None,
        log_interval_s: float = 60.0,
        logger: logging.Logger | None = None,
        monotonic: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.client = client if client is not None else PodResourcesClient(socket_path, timeout_s)
        self.mapper = mapper or AllocationMapper(tuple(extra_resource_names), tuple(dra_driver_names))
        self.on_error = on_error
        self.log_interval_s = log_interval_s
        self._log = logger or log
        self._monotonic = monotonic
        self._wall_clock = wall_clock
        self._lock = threading.Lock()  # serialises refresh(); held for up to timeout_s
        self._counts_lock = threading.Lock()  # short: readers (metrics scrape) never wait on a refresh
        self._errors: dict[str, int] = dict.fromkeys(ERROR_KINDS, 0)
        self._last_logged: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}
        self._failures_since_success = 0
        self._healthy = False
        self._last_success_time: float | None = None
        self._last_error: str | None = None
        self._current = AllocationMap.empty()

    # -- state ------------------------------------------------------------------------------------

    @property
    def healthy(self) -> bool:
        return self._healthy

    @property
    def last_success_time(self) -> float | None:
        return self._last_success_time

    @property
    def last_error(self) -> str | None:
        """Kind and description of the most recent failure (kept after recovery), or None."""
        return self._last_error

    @property
    def current(self) -> AllocationMap:
        """The map returned by the latest ``refresh()`` (empty before the first one)."""
        return self._current

    @property
    def error_counts(self) -> dict[str, int]:
        """Copy of the cumulative error counters, every kind of ``ERROR_KINDS`` present."""
        with self._counts_lock:
            return dict(self._errors)

    # -- work -------------------------------------------------------------------------------------

    def refresh(self) -> AllocationMap:
        with self._lock:
            try:
                amap = self.client.list_allocations(mapper=self.mapper)
                if not isinstance(amap, AllocationMap):
                    raise KubeletBadResponse(f"mapping returned {type(amap).__name__}")
            except Exception as exc:
                self._on_failure(exc)
                self._current = AllocationMap.empty()
                return self._current
            self._on_success()
            self._current = amap
            return amap

    def _on_success(self) -> None:
        if self._failures_since_success and self._may_log("recovered"):
            self._log.info(
                "kubelet pod-resources recovered on %s after %d failed refresh(es); pod attribution resumes",
                self.client.socket_path,
                self._failures_since_success,
            )
        self._failures_since_success = 0
        self._healthy = True
        self._last_success_time = self._wall_clock()

    def _may_log(self, key: str) -> bool:
        """Rate limit: True at most once per ``log_interval_s`` per key; counts what it suppresses."""
        now = self._monotonic()
        last = self._last_logged.get(key)
        if last is not None and now - last < self.log_interval_s:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return False
        self._last_logged[key] = now
        return True

    def _on_failure(self, exc: BaseException) -> None:
        kind = classify_error(exc)
        with self._counts_lock:
            self._errors[kind] = self._errors.get(kind, 0) + 1
        self._failures_since_success += 1
        self._healthy = False
        self._last_error = f"{kind}: {_describe(exc)}"
        self.client.reset()
        if self.on_error is not None:
            try:
                self.on_error(kind)
            except Exception:
                self._log.debug("kubelet on_error hook failed", exc_info=True)
        if not self._may_log(kind):
            return
        suppressed = self._suppressed.pop(kind, 0)
        extra: dict[str, Any] = {"kubelet_error_kind": kind}
        self._log.warning(
            "kubelet pod-resources %s on %s (%s); samples go out without pod attribution%s",
            kind,
            self.client.socket_path,
            _describe(exc),
            f" ({suppressed} similar failure(s) not logged)" if suppressed else "",
            extra=extra,
        )

    def close(self) -> None:
        with self._lock:
            self.client.reset()
