"""Fabric group (default every 10 s): what a Blackwell / GB200 NVL72 node needs beyond Hopper.

Reads fabric registration state and health, NVLink link states and error counters, C2C links and
the platform's rack position (read once) into GpuSample fields; link and error counters take two
``nvmlDeviceGetFieldValues`` calls per GPU, plus, per active link, ``nvmlDeviceGetNvLinkErrorCounter``
for its CRC, replay and recovery counters (NVLink up to 4) into ``nvlink_link_counters`` with the
link's far end (read once). What a device does not answer is learned once and stays null.
More (NVML call -> field table, why): docs/producer.md, "The fabric field group".
"""

from __future__ import annotations

import ctypes
from typing import Any

from gpupipe_producer.nvml import convert
from gpupipe_producer.nvml.base import DeviceContext, FieldSpec, read_field_values

FI_NVLINK_LINK_COUNT = 91
FI_NVLINK_GET_STATE = 165
FI_C2C_LINK_COUNT = 170
FI_C2C_LINK_GET_STATUS = 171
FI_NVLINK_RCV_ERRORS = 208
FI_NVLINK_RECOVERY_FAILED = 214
FI_NVLINK_SYMBOL_ERRORS = 221
MAX_LINKS = 36  # NVML_NVLINK_MAX_LINKS in NVML 13
#: Device-wide NVLink error counters (all links) up to Hopper: (GpuSample field, NVML_FI_DEV_ name, id).
NVLINK_ERROR_TOTALS = (
    ("nvlink_crc_flit_errors_total", "NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL", 38),
    ("nvlink_crc_data_errors_total", "NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL", 45),
    ("nvlink_replay_errors_total", "NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL", 52),
    ("nvlink_recovery_errors_total", "NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL", 59),
)

#: Per-link data-link counters up to NVLink 4: (NvLinkCounters field, nvmlNvLinkErrorCounter_t name, value).
LINK_ERROR_COUNTERS = (
    ("crc_flit", "NVML_NVLINK_ERROR_DL_CRC_FLIT", 2),
    ("crc_data", "NVML_NVLINK_ERROR_DL_CRC_DATA", 3),
    ("replay", "NVML_NVLINK_ERROR_DL_REPLAY", 0),
    ("recovery", "NVML_NVLINK_ERROR_DL_RECOVERY", 1),
)
REMOTE_SWITCH = 2  # NVML_NVLINK_DEVICE_TYPE_SWITCH
REMOTE_GPU = 0  # NVML_NVLINK_DEVICE_TYPE_GPU

FABRIC_STATES = {1: "not_started", 2: "in_progress", 3: "completed"}
FABRIC_HEALTH = {1: "healthy", 2: "unhealthy", 3: "limited_capacity"}


class FabricCollector:
    name = "fabric"
    fields = (
        "fabric_state",
        "fabric_health",
        "fabric_health_mask",
        "fabric_clique_id",
        "fabric_cluster_uuid",
        "nvlink_links",
        "nvlink_links_up",
        "nvlink_rcv_errors_total",
        "nvlink_symbol_errors_total",
        "nvlink_recovery_failed_total",
        *(f for f, _, _ in NVLINK_ERROR_TOTALS),
        "nvlink_link_counters",
        "c2c_links",
        "c2c_links_up",
        "platform_chassis_serial",
        "platform_slot",
        "platform_tray",
        "platform_host_id",
        "platform_module_id",
    )

    def __init__(self, nvml: Any) -> None:
        self._nvml = nvml
        self._totals = tuple((f, int(getattr(nvml, name, fid))) for f, name, fid in NVLINK_ERROR_TOTALS)
        self._link_counters = tuple((f, int(getattr(nvml, name, v))) for f, name, v in LINK_ERROR_COUNTERS)
        self._fi = {
            "count": int(getattr(nvml, "NVML_FI_DEV_NVLINK_LINK_COUNT", FI_NVLINK_LINK_COUNT)),
            "state": int(getattr(nvml, "NVML_FI_DEV_NVLINK_GET_STATE", FI_NVLINK_GET_STATE)),
            "c2c_count": int(getattr(nvml, "NVML_FI_DEV_C2C_LINK_COUNT", FI_C2C_LINK_COUNT)),
            "c2c_status": int(getattr(nvml, "NVML_FI_DEV_C2C_LINK_GET_STATUS", FI_C2C_LINK_GET_STATUS)),
            "rcv": int(getattr(nvml, "NVML_FI_DEV_NVLINK_COUNT_RCV_ERRORS", FI_NVLINK_RCV_ERRORS)),
            "symbol": int(getattr(nvml, "NVML_FI_DEV_NVLINK_COUNT_SYMBOL_ERRORS", FI_NVLINK_SYMBOL_ERRORS)),
            "recovery_failed": int(
                getattr(
                    nvml, "NVML_FI_DEV_NVLINK_COUNT_LINK_RECOVERY_FAILED_EVENTS", FI_NVLINK_RECOVERY_FAILED
                )
            ),
        }

    def collect(self, ctx: DeviceContext) -> dict[str, Any]:
        if ctx.is_mig:
            return {}
        out: dict[str, Any] = {}
        self._fabric(ctx, out)
        self._links(ctx, out)
        out.update(self._platform(ctx))
        return out

    # -- fabric -----------------------------------------------------------------------------------
    def _fabric(self, ctx: DeviceContext, out: dict[str, Any]) -> None:
        nvml = self._nvml
        for key, struct in (
            ("fabric_v3", "c_nvmlGpuFabricInfo_v3_t"),
            ("fabric_v2", "c_nvmlGpuFabricInfo_v2_t"),
        ):
            if key in ctx.unsupported or not hasattr(nvml, struct):
                continue
            info = getattr(nvml, struct)()
            # By reference: the binding hands the argument to C as is, and the C function takes a
            # pointer (a struct passed by value crashed NVIDIA's mock with a wild pointer).
            if ctx.call(key, "nvmlDeviceGetGpuFabricInfoV", ctx.handle, ctypes.byref(info)) is None:
                continue
            state = FABRIC_STATES.get(int(info.state))
            if state is None:  # NOT_SUPPORTED (0): no fabric on this GPU
                ctx.learn(key, "fabric state NOT_SUPPORTED")
                return
            out["fabric_state"] = state
            out["fabric_health_mask"] = int(info.healthMask)
            out["fabric_clique_id"] = int(info.cliqueId)
            uuid = bytes(info.clusterUuid)
            out["fabric_cluster_uuid"] = uuid.hex() if any(uuid) else None
            summary = getattr(info, "healthSummary", None)
            out["fabric_health"] = FABRIC_HEALTH.get(int(summary)) if summary is not None else None
            return

    # -- NVLink and C2C links -----------------------------------------------------------------------
    def _links(self, ctx: DeviceContext, out: dict[str, Any]) -> None:
        fi = self._fi
        counts = ctx.state.get("link_counts")
        if counts is None:
            got = read_field_values(
                ctx,
                (("fi_nvlink_count", fi["count"], None, True), ("fi_c2c_count", fi["c2c_count"], None, True)),
            )
            counts = ctx.state["link_counts"] = (
                _small(got.get("fi_nvlink_count")),
                _small(got.get("fi_c2c_count")),
            )
        nvlinks, c2c = counts
        per_link: list[FieldSpec] = []
        for link in range(nvlinks or 0):
            per_link += [
                (f"fi_nvlink_state:{link}", fi["state"], link, True),
                (f"fi_nvlink_rcv:{link}", fi["rcv"], link, True),
                (f"fi_nvlink_symbol:{link}", fi["symbol"], link, True),
                (f"fi_nvlink_recovery_failed:{link}", fi["recovery_failed"], link, True),
            ]
        if nvlinks:
            per_link += [(f"fi_{field}", fid, None, False) for field, fid in self._totals]
        for link in range(c2c or 0):
            per_link.append((f"fi_c2c_status:{link}", fi["c2c_status"], link, True))
        got = read_field_values(ctx, per_link) if per_link else {}
        if nvlinks:
            out["nvlink_links"] = nvlinks
            states = [got.get(f"fi_nvlink_state:{i}") for i in range(nvlinks)]
            if any(s is not None for s in states):
                out["nvlink_links_up"] = sum(1 for s in states if s == 1)
            for field, kind in (
                ("nvlink_rcv_errors_total", "rcv"),
                ("nvlink_symbol_errors_total", "symbol"),
                ("nvlink_recovery_failed_total", "recovery_failed"),
            ):
                vals = [got.get(f"fi_nvlink_{kind}:{i}") for i in range(nvlinks)]
                if any(v is not None for v in vals):
                    out[field] = sum(int(v) for v in vals if v is not None)
            for field, _ in self._totals:
                ctx.put(out, field, convert.count, got.get(f"fi_{field}"))
            out["nvlink_link_counters"] = [self._link(ctx, i, states[i], got) for i in range(nvlinks)]
        if c2c:
            out["c2c_links"] = c2c
            status = [got.get(f"fi_c2c_status:{i}") for i in range(c2c)]
            if any(s is not None for s in status):
                out["c2c_links_up"] = sum(1 for s in status if s == 1)

    def _link(self, ctx: DeviceContext, link: int, state: Any, got: dict[str, Any]) -> dict[str, Any]:
        """One link's entry of ``nvlink_link_counters``: state, far end, and its error counters.

        An inactive link is not asked for its counters (nothing crosses it); a counter the device
        refuses (NotSupported: NVLink 5 counts by field instead) is learned once for all its links."""
        up = None if state is None else state == 1
        entry: dict[str, Any] = {"link": link, "up": up, "peer": self._peer(ctx, link) if up else None}
        for field, counter in self._link_counters:
            raw = None
            if up is not False:
                raw = ctx.call(
                    f"nvlink_error_counter:{field}",
                    "nvmlDeviceGetNvLinkErrorCounter",
                    ctx.handle,
                    link,
                    counter,
                )
            entry[field] = convert.count(raw) if raw is not None else None
        for field, kind in (("rcv", "rcv"), ("symbol", "symbol"), ("recovery_failed", "recovery_failed")):
            raw = got.get(f"fi_nvlink_{kind}:{link}")
            entry[field] = convert.count(raw) if raw is not None else None
        return entry

    def _peer(self, ctx: DeviceContext, link: int) -> str | None:
        """The far end of an active link: ``nvswitch``, or the remote GPU's PCI bus id (cached: the
        cabling does not change while the GPU is up)."""
        peers = ctx.state.setdefault("nvlink_peers", {})
        if link in peers:
            return peers[link]
        h, peer = ctx.handle, None
        kind = ctx.call(
            f"nvlink_remote_type:{link}", "nvmlDeviceGetNvLinkRemoteDeviceType", h, link, probe=True
        )
        if kind is not None and int(kind) == REMOTE_SWITCH:
            peer = "nvswitch"
        elif kind is not None and int(kind) == REMOTE_GPU:
            pci = ctx.call(
                f"nvlink_remote_pci:{link}", "nvmlDeviceGetNvLinkRemotePciInfo", h, link, probe=True
            )
            bus = getattr(pci, "busId", None) if pci is not None else None
            if isinstance(bus, bytes):
                bus = bus.decode("ascii", "replace")
            peer = str(bus).rstrip("\0") or None if bus is not None else None
        if kind is not None:
            peers[link] = peer
        return peer

    # -- placement --------------------------------------------------------------------------------
    def _platform(self, ctx: DeviceContext) -> dict[str, Any]:
        cached = ctx.state.get("platform")
        if cached is not None:
            return cached
        nvml = self._nvml
        out: dict[str, Any] = {}
        if "platform" not in ctx.unsupported and hasattr(nvml, "c_nvmlPlatformInfo_v2_t"):
            info = nvml.c_nvmlPlatformInfo_v2_t()
            if ctx.call("platform", "nvmlDeviceGetPlatformInfo", ctx.handle, ctypes.byref(info)) is not None:
                raw = info.chassisSerialNumber  # pynvml turns char arrays into str
                raw = raw.encode("latin-1") if isinstance(raw, str) else bytes(raw)
                serial = raw.split(b"\0", 1)[0].decode("ascii", "replace")
                out = {
                    "platform_chassis_serial": serial or None,
                    "platform_slot": _byte(info.slotNumber),
                    "platform_tray": _byte(info.trayIndex),
                    "platform_host_id": _byte(info.hostId),
                    "platform_module_id": _byte(info.moduleId),
                }
        if out or "platform" in ctx.unsupported:
            ctx.state["platform"] = out  # placement does not change while the GPU is up
        return out

    def release(self, ctx: DeviceContext) -> None:
        return None


def _small(value: Any) -> int | None:
    try:
        n = int(value)
    except (TypeError, ValueError):
        return None
    return n if 0 <= n <= MAX_LINKS else None


def _byte(value: Any) -> int | None:
    if isinstance(value, str):
        return ord(value[0]) if value else 0  # an empty c_char reads as "" (NUL)
    if isinstance(value, bytes | bytearray):
        return value[0] if value else 0
    try:
        return int(value)
    except (TypeError, ValueError):
        return None
