"""kubelet PodResources enrichment: GPU/MIG/replica device id -> namespace/pod/container.

- ``mapping``: pure logic (PodRef, AllocationMap, AllocationMapper, lookup); imports no gRPC.
- ``client``: PodResourcesClient (gRPC over the kubelet unix socket) and AllocationRefresher.
- ``api.proto`` / ``api_pb2*.py``: the v1 API and its generated bindings (scripts/gen-proto).

Nothing is imported here, so importing ``gpupipe_producer.kubelet.mapping`` does not load gRPC.
"""
