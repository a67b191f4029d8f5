"""A fake kubelet: a real gRPC server implementing ``v1.PodResourcesLister`` on a unix socket.

Usage::

    from tests.kubelet_fake import FakeKubelet, load_fixture

    with FakeKubelet(load_fixture("whole_gpus")) as kubelet:
        client = PodResourcesClient(kubelet.socket_path, timeout_s=0.5)
        ...
        kubelet.set_fixture(load_fixture("churn_after"))   # swap what List returns (thread-safe)
        kubelet.fail_with(grpc.StatusCode.INTERNAL)          # every RPC fails with that status
        kubelet.set_delay(1.0)                               # every RPC sleeps first (released by stop())
        kubelet.set_garbage(True)                            # List answers bytes that do not parse
        kubelet.clear_failures()
        kubelet.stop(); kubelet.start()                      # socket removed, then recreated

Fixtures are dicts in protobuf JSON form, as stored in ``tests/fixtures/kubelet/*.json``: the key
``pod_resources`` is the ``ListPodResourcesResponse``; ``allocatable`` (optional) the
``AllocatableResourcesResponse``; other keys (``description``, ``expected``, ...) are ignored here.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
from collections.abc import Mapping
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import json_format

from gpupipe_producer.kubelet import api_pb2

FIXTURES_DIR = Path(__file__).resolve().parent / "fixtures" / "kubelet"
SERVICE = "v1.PodResourcesLister"
# A length-delimited field 1 announcing 5 bytes but carrying 2: never parses as a message.
GARBAGE = b"\x0a\x05ab"


def load_fixture(name: str) -> dict[str, Any]:
    """Load ``tests/fixtures/kubelet/<name>.json``."""
    with open(FIXTURES_DIR / f"{name}.json", encoding="utf-8") as f:
        return json.load(f)


def fixture_names() -> list[str]:
    return sorted(p.stem for p in FIXTURES_DIR.glob("*.json"))


def _to_list_response(fixture: Mapping[str, Any] | api_pb2.ListPodResourcesResponse | None):
    if fixture is None:
        return api_pb2.ListPodResourcesResponse()
    if isinstance(fixture, api_pb2.ListPodResourcesResponse):
        return fixture
    return json_format.ParseDict(
        {"pod_resources": fixture.get("pod_resources", [])}, api_pb2.ListPodResourcesResponse()
    )


def _to_allocatable(fixture: Mapping[str, Any] | api_pb2.ListPodResourcesResponse | None):
    if not isinstance(fixture, Mapping) or "allocatable" not in fixture:
        return api_pb2.AllocatableResourcesResponse()
    return json_format.ParseDict(fixture["allocatable"], api_pb2.AllocatableResourcesResponse())


class FakeKubelet:
    """Real gRPC ``v1.PodResourcesLister`` server on a unix socket; state setters are thread-safe.

    ``socket_path`` defaults to ``kubelet.sock`` in a fresh short temporary directory (unix socket
    paths are limited to ~107 bytes, which pytest's ``tmp_path`` can exceed). The directory is removed
    by :meth:`close` when it was created here.
    """

    def __init__(
        self,
        fixture: Mapping[str, Any] | api_pb2.ListPodResourcesResponse | None = None,
        *,
        socket_path: str | None = None,
        max_workers: int = 4,
        start: bool = True,
    ) -> None:
        self._own_dir: str | None = None
        if socket_path is None:
            self._own_dir = tempfile.mkdtemp(prefix="kfake-")
            socket_path = os.path.join(self._own_dir, "kubelet.sock")
        self.socket_path = os.path.abspath(socket_path)
        self.max_workers = max_workers
        self._lock = threading.Lock()
        self._calls_cond = threading.Condition(self._lock)
        self._list = _to_list_response(fixture)
        self._allocatable = _to_allocatable(fixture)
        self._error: tuple[grpc.StatusCode, str] | None = None
        self._delay_s = 0.0
        self._garbage = False
        self._release = threading.Event()  # set by stop(): ends pending delays at once
        self._server: grpc.Server | None = None
        self.calls: dict[str, int] = {"List": 0, "GetAllocatableResources": 0, "Get": 0}
        if start:
            self.start()

    # -- lifecycle --------------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._server is not None

    def start(self) -> None:
        """Bind the socket and serve. A stale socket file at the path is removed first."""
        if self._server is not None:
            return
        if os.path.lexists(self.socket_path):
            os.unlink(self.socket_path)
        self._release.clear()
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=self.max_workers))
        server.add_generic_rpc_handlers((self._handler(),))
        port = server.add_insecure_port("unix:" + self.socket_path)
        if port == 0:  # older grpcio returns 0 instead of raising
            raise RuntimeError(f"cannot bind unix socket {self.socket_path}")
        server.start()
        self._server = server

    def stop(self, grace: float | None = 0) -> None:
        """Stop serving (pending slow calls are released) and remove the socket, like a dead kubelet."""
        server, self._server = self._server, None
        self._release.set()
        if server is not None:
            server.stop(grace).wait(5)
        if os.path.lexists(self.socket_path):
            os.unlink(self.socket_path)

    def restart(self) -> None:
        self.stop()
        self.start()

    def close(self) -> None:
        self.stop()
        if self._own_dir is not None:
            shutil.rmtree(self._own_dir, ignore_errors=True)
            self._own_dir = None

    def __enter__(self) -> FakeKubelet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- state (thread-safe) ----------------------------------------------------------------------

    def set_fixture(self, fixture: Mapping[str, Any] | api_pb2.ListPodResourcesResponse | None) -> None:
        """Replace what List/Get/GetAllocatableResources answer from now on."""
        lst, alloc = _to_list_response(fixture), _to_allocatable(fixture)
        with self._lock:
            self._list, self._allocatable = lst, alloc

    def fail_with(self, code: grpc.StatusCode, details: str = "injected failure") -> None:
        """Every RPC aborts with ``code`` until :meth:`clear_failures`."""
        with self._lock:
            self._error = (code, details)

    def set_delay(self, seconds: float) -> None:
        """Every RPC waits ``seconds`` before answering (``stop()`` cuts the wait short)."""
        with self._lock:
            self._delay_s = float(seconds)

    def set_garbage(self, enabled: bool = True) -> None:
        """List answers bytes that are not a valid ListPodResourcesResponse."""
        with self._lock:
            self._garbage = enabled

    def clear_failures(self) -> None:
        with self._lock:
            self._error, self._delay_s, self._garbage = None, 0.0, False

    def call_count(self, method: str = "List") -> int:
        with self._lock:
            return self.calls[method]

    def wait_for_calls(self, n: int, method: str = "List", timeout: float = 5.0) -> bool:
        """Block until ``method`` has been called at least ``n`` times in total."""
        with self._calls_cond:
            return self._calls_cond.wait_for(lambda: self.calls[method] >= n, timeout)

    # -- service ----------------------------------------------------------------------------------

    def _enter(self, method: str, context: grpc.ServicerContext) -> tuple[Any, Any, bool]:
        with self._calls_cond:
            self.calls[method] += 1
            self._calls_cond.notify_all()
            error, delay, garbage = self._error, self._delay_s, self._garbage
            lst, alloc = self._list, self._allocatable
        if delay > 0:
            self._release.wait(delay)
        if error is not None:
            context.abort(error[0], error[1])
        return lst, alloc, garbage

    def _list_rpc(self, request: api_pb2.ListPodResourcesRequest, context: grpc.ServicerContext) -> bytes:
        lst, _, garbage = self._enter("List", context)
        return GARBAGE if garbage else lst.SerializeToString()

    def _allocatable_rpc(
        self, request: api_pb2.AllocatableResourcesRequest, context: grpc.ServicerContext
    ) -> bytes:
        _, alloc, _ = self._enter("GetAllocatableResources", context)
        return alloc.SerializeToString()

    def _get_rpc(self, request: api_pb2.GetPodResourcesRequest, context: grpc.ServicerContext) -> bytes:
        lst, _, _ = self._enter("Get", context)
        for pod in lst.pod_resources:
            if pod.name == request.pod_name and pod.namespace == request.pod_namespace:
                return api_pb2.GetPodResourcesResponse(pod_resources=pod).SerializeToString()
        context.abort(
            grpc.StatusCode.NOT_FOUND,
            f"pod {request.pod_name} in namespace {request.pod_namespace} not found",
        )
        raise AssertionError("unreachable")

    def _handler(self) -> grpc.GenericRpcHandler:
        # Responses are serialised by the handlers themselves (identity serializer) so that the
        # garbage mode can put arbitrary bytes on the wire.
        def raw(b: bytes) -> bytes:
            return b

        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "List": grpc.unary_unary_rpc_method_handler(
                    self._list_rpc,
                    request_deserializer=api_pb2.ListPodResourcesRequest.FromString,
                    response_serializer=raw,
                ),
                "GetAllocatableResources": grpc.unary_unary_rpc_method_handler(
                    self._allocatable_rpc,
                    request_deserializer=api_pb2.AllocatableResourcesRequest.FromString,
                    response_serializer=raw,
                ),
                "Get": grpc.unary_unary_rpc_method_handler(
                    self._get_rpc,
                    request_deserializer=api_pb2.GetPodResourcesRequest.FromString,
                    response_serializer=raw,
                ),
            },
        )
