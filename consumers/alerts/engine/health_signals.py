"""Alert signals from the health fields of ``GpuSample`` records (pure: no clock, no I/O).

:class:`HealthTracker` keeps a little state per GPU (keyed by host and canonical PCI bus id) and turns
each sample into zero or more :class:`SignalEvent` s for the alert engine:

Rules and reasons in full: docs/alerts.md, "Module notes", ``engine/health_signals.py``.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from gpupipe_consumers.alerts.engine.alert_record import NVLINK_SIGNAL, AlertName, alert_device_key
from gpupipe_consumers.alerts.engine.link_health import LinkChange, LinkHealthConfig, LinkHealthTracker
from gpupipe_consumers.alerts.rules.classify import GpuHealth
from gpupipe_consumers.alerts.rules.notice import (
    RECOVERY_ACTION_NAME,
    recovery_decision,
    recovery_name,
    recovery_runbook,
)

__all__ = [
    "SIGNAL_INFO",
    "THERMAL_MASK",
    "GpuIdentity",
    "HealthConfig",
    "HealthTracker",
    "InvalidRecord",
    "SignalEvent",
    "SignalInfo",
    "signal_info",
]

THERMAL_MASK = 0x20 | 0x40  # SwThermalSlowdown | HwThermalSlowdown
MINUTE_MS = 60_000
LINK_READ_MS = 5_000
"""The agent reads NVLink counters every 10 s (fabric group) and sends them on those samples only; a
sender that repeats them on every sample has them read at most this often."""

SignalKind = Literal["occurrence", "active", "clear"]


@dataclass(frozen=True, slots=True)
class SignalInfo:
    """How a health signal is presented (fixed per signal; recovery_action refines per value)."""

    alertname: str
    name: str
    severity: str
    cause_class: str
    action: str
    drain_node: bool
    runbook: str


SIGNAL_INFO: dict[str, SignalInfo] = {
    "ecc_dbe": SignalInfo(
        AlertName.ECC_UNCORRECTABLE,
        "ECC_DBE_VOLATILE_INCREASE",
        "critical",
        "hardware_memory",
        "RESET_GPU",
        False,
        "Uncorrectable (double-bit) ECC errors on this GPU. Check the XID alerts on the same GPU (48, 94, "
        "95, 63/64) for the exact recovery; reset the GPU once its jobs are drained so the row remapper "
        "can act. If errors keep coming after the reset or row remapping fails, run field diagnostics "
        "and RMA.",
    ),
    "row_remap_failure": SignalInfo(
        AlertName.ROW_REMAP_FAILURE,
        "ROW_REMAP_FAILURE",
        "critical",
        "hardware_memory",
        "CONTACT_SUPPORT",
        True,
        "Row remapping failed: the GPU has run out of spare memory rows or the remap could not be applied. "
        "Cordon and drain the node, take the GPU out of service and open an RMA case "
        "(NVIDIA GPU memory error management guide).",
    ),
    "row_remap_pending": SignalInfo(
        AlertName.ROW_REMAP_PENDING,
        "ROW_REMAP_PENDING",
        "warning",
        "hardware_memory",
        "RESET_GPU",
        False,
        "A memory row was marked for remapping and waits for a GPU reset. Let the jobs on this GPU finish "
        "(or drain them), then reset the GPU with nvidia-smi -r -i <gpu> to apply the remap.",
    ),
    "bank_remap_pending": SignalInfo(
        AlertName.BANK_REMAP_PENDING,
        "BANK_REMAP_PENDING",
        "warning",
        "hardware_memory",
        "RESET_GPU",
        False,
        "A memory bank was marked for remapping (NVML bank remapper, driver R615+) and waits for a GPU "
        "reset. Let the jobs on this GPU finish (or drain them), then reset the GPU with nvidia-smi -r -i "
        "<gpu> to apply it.",
    ),
    "memory_unrepairable": SignalInfo(
        AlertName.MEMORY_UNREPAIRABLE,
        "MEMORY_UNREPAIRABLE",
        "critical",
        "hardware_memory",
        "CONTACT_SUPPORT",
        True,
        "NVML flags the GPU's memory as unrepairable: remapping can no longer fix its errors and a reset "
        "will not either. The GPU needs replacement: cordon and drain the node, take the GPU out of "
        "service and open an RMA case.",
    ),
    "thermal": SignalInfo(
        AlertName.THERMAL_THROTTLING,
        "THERMAL_SLOWDOWN_SUSTAINED",
        "warning",
        "thermal_power",
        "CHECK_MECHANICALS",
        False,
        "The GPU has been clocked down for thermal reasons for minutes: jobs run slower. Check the node's "
        "cooling (fans, airflow, inlet temperature, blocked heatsink), the GPU's seating, and whether other "
        "GPUs of the node are hot too (then it is the chassis or the room).",
    ),
    "recovery_action": SignalInfo(
        AlertName.RECOVERY_ACTION,
        RECOVERY_ACTION_NAME,
        "critical",
        "hardware_memory",
        "RESET_GPU",
        True,
        "NVML reports that the driver requires a recovery action on this GPU (field GPU_RECOVERY_ACTION). "
        "Cordon the node and do what it says: reset the GPU, drain peer-to-peer jobs, or reboot the node.",
    ),
    NVLINK_SIGNAL: SignalInfo(
        AlertName.NVLINK_DEGRADING,
        "NVLINK_LINK_DEGRADING",
        "warning",
        "nvlink_fabric",
        "RUN_FIELDDIAG",
        False,
        "An NVLink link of this GPU shows a sustained rise of its error counters (CRC, replay, recovery): "
        "it is likely to fail, and the jobs of every GPU named here (its NVLink domain) with it. Let them "
        "checkpoint; then take the node out of scheduling, read nvidia-smi nvlink -e -i <gpu>, run "
        "dcgmi diag -r 3 (NVLink tests) and reseat or replace the link's cable, NVSwitch tray or baseboard "
        "as the diagnostic says. Escalates to critical when the link fails (DCGM's NVLink health FAIL).",
    ),
}

#: The link-health presentation once the link has failed (the same alert, escalated).
NVLINK_FAILED = ("critical", False, "WORKFLOW_NVLINK_ERR")


def signal_info(signal: str) -> SignalInfo:
    """The presentation of a health signal; a link's signal (``nvlink_link:<link>``) is the NVLink one."""
    return SIGNAL_INFO[NVLINK_SIGNAL if signal.startswith(NVLINK_SIGNAL + ":") else signal]


def recovery_presentation(value: int | None) -> tuple[str, str, bool, str]:
    """(action, severity, drain, runbook) for an NVML recovery-action value; unknown values:
    CONTACT_SUPPORT.

    The same decision as NVML's recovery-action *event* (:func:`rules_notice.recovery_decision`): the
    engine makes the sampled field and the event one alert, so they must grade a value alike."""
    action, severity, drain = recovery_decision(value)
    return action.value, severity.value, drain, recovery_runbook(value)


def link_signal(link: int) -> str:
    return f"{NVLINK_SIGNAL}:{link}"


def _link_event(c: LinkChange, ts: int, related: tuple[GpuIdentity, ...]) -> SignalEvent:
    """The level signal of an unhealthy link (value 2: failed)."""
    return SignalEvent(
        link_signal(c.link),
        "active",
        ts,
        since_ms=c.since_ms,
        detail=f"NVLink link {c.link} (peer {c.peer or 'unknown'}) {c.state}: {c.reason}",
        value=2 if c.state == "failed" else 1,
        related=related,
    )


class InvalidRecord(ValueError):
    """An input record without what every record of its type has (host, time...): dead-letter it."""


@dataclass(frozen=True, slots=True)
class HealthConfig:
    thermal_for_ms: int = 5 * MINUTE_MS
    """Thermal clock-event bits must be set this long (every sample) to raise ``thermal``."""
    thermal_clear_ms: int = MINUTE_MS
    """...and clear this long to clear it (hysteresis against flapping)."""
    links: LinkHealthConfig = field(default_factory=LinkHealthConfig)
    """NVLink link health (:mod:`gpupipe_consumers.alerts.engine.link_health`)."""

    def __post_init__(self) -> None:
        if self.thermal_for_ms < 0 or self.thermal_clear_ms < 0:
            raise ValueError("thermal durations must not be negative")


@dataclass(frozen=True, slots=True)
class SignalEvent:
    """One change of one health signal of one GPU.

    ``occurrence``: an edge (``count`` occurrences at ``ts_ms``); ``active``: the level condition holds
    at ``ts_ms`` (it has since ``since_ms``); ``clear``: the condition ended.
    """

    signal: str
    kind: SignalKind
    ts_ms: int
    count: int = 1
    since_ms: int = 0
    detail: str = ""
    value: int | None = None
    evidence: str = ""
    """For ``gpu_reset``: the evidence kind (``reset``, or ``gpu_back`` when the GPU is reported again after
    it was lost; see :mod:`gpupipe_consumers.alerts.engine.recovery_policy`)."""
    baseline: bool = False
    """The GPU's first sample since this tracker started: a condition it shows may have begun before."""
    related: tuple[GpuIdentity, ...] = ()
    """For an NVLink link: the other GPUs of its NVLink domain (whose jobs its failure hits)."""
    subject: GpuIdentity | None = None
    """The GPU the signal is about when it is not the sample's: a link of another GPU whose NVLink
    domain this sample's GPU turns out to be in (its samples came after that link's)."""


@dataclass(slots=True)
class GpuIdentity:
    hostname: str
    device: str
    uuid: str | None = None
    gpu_index: int | None = None
    model_name: str | None = None
    driver_version: str | None = None
    allocations: Any = ()


class _GpuState:
    __slots__ = (
        "dbe",
        "ident",
        "last_ts",
        "level",
        "links_ms",
        "lost",
        "sample",
        "sample_prev",
        "thermal_active",
        "thermal_clear_since",
        "thermal_since",
    )

    def __init__(self, ident: GpuIdentity) -> None:
        self.ident = ident
        self.last_ts = -1
        self.links_ms: int | None = None
        self.dbe: int | None = None
        self.lost = False
        self.level: dict[str, bool] = {}
        self.thermal_since: int | None = None
        self.thermal_clear_since: int | None = None
        self.thermal_active = False
        self.sample: dict[str, Any] | None = None
        self.sample_prev: dict[str, Any] | None = None


_LEVEL_FIELDS = (
    ("row_remap_failure", "row_remap_failure"),
    ("row_remap_pending", "row_remap_pending"),
    ("bank_remap_pending", "bank_remap_pending"),
    ("memory_unrepairable", "memory_unrepairable"),
)


def _counter(sample: dict[str, Any] | None, name: str) -> int | None:
    v = None if sample is None else sample.get(name)
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _identify(ident: GpuIdentity, sample: dict[str, Any]) -> None:
    """What the latest sample says about the GPU and who holds it."""
    ident.uuid = sample.get("uuid") or ident.uuid
    if sample.get("gpu_index") is not None:
        ident.gpu_index = sample["gpu_index"]
    ident.model_name = sample.get("model_name") or ident.model_name
    ident.driver_version = sample.get("driver_version") or ident.driver_version
    ident.allocations = sample.get("allocations") or ()


def _loss_and_reset(st: _GpuState, sample: dict[str, Any], ts: int, out: list[SignalEvent]) -> None:
    """The GPU lost (an occurrence when it goes, active while it stays), and evidence of a reset."""
    prev = st.sample_prev
    st.sample_prev = sample
    lost = bool(sample.get("gpu_lost"))
    if lost:
        kind: SignalKind = "active" if st.lost or prev is None else "occurrence"
        out.append(SignalEvent("gpu_lost", kind, ts, since_ms=ts, baseline=prev is None))
    how, evidence = _reset_evidence(st, prev, sample, lost)
    if evidence:
        out.append(SignalEvent("gpu_reset", "occurrence", ts, detail=evidence, evidence=how))
    st.lost = lost


def _dbe(st: _GpuState, sample: dict[str, Any], ts: int, out: list[SignalEvent]) -> None:
    """A rise of the volatile double-bit ECC counter is an occurrence of as many errors."""
    dbe = sample.get("ecc_dbe_volatile_total")
    if isinstance(dbe, int) and not isinstance(dbe, bool):
        if st.dbe is not None and dbe > st.dbe:
            out.append(
                SignalEvent(
                    "ecc_dbe",
                    "occurrence",
                    ts,
                    count=dbe - st.dbe,
                    detail=f"ecc_dbe_volatile_total {st.dbe} -> {dbe}",
                    value=dbe,
                )
            )
        st.dbe = dbe


def _reset_evidence(
    st: _GpuState, prev: dict[str, Any] | None, sample: dict[str, Any], lost: bool
) -> tuple[str, str]:
    """(evidence kind, why) this sample shows the GPU was reset or its node rebooted since the previous
    one (``("", "")`` if not).

    Evidence, as NVSentinel and GPUd use it: the GPU reachable again after NVML reported it lost; the
    volatile ECC counters or the energy counter (both restart at a driver reload or GPU reset) going
    down; NVML's recovery action going back to none. The first sample after our own restart is a
    baseline and proves nothing. The GPU answering again after it was lost is ``gpu_back`` (it mends
    more than a reset: the GPU is there again); the rest is ``reset``."""
    if prev is None:
        return "", ""
    if st.lost and not lost:
        return "gpu_back", "NVML reports the GPU again after it was lost"
    for name in ("ecc_dbe_volatile_total", "ecc_sbe_volatile_total", "total_energy_mj"):
        before, now = _counter(prev, name), _counter(sample, name)
        if before is not None and now is not None and now < before:
            return "reset", f"{name} restarted ({before} -> {now}): driver reload, GPU reset or reboot"
    before_ra, now_ra = _counter(prev, "gpu_recovery_action"), _counter(sample, "gpu_recovery_action")
    if before_ra and now_ra == 0:
        return "reset", f"NVML recovery action back to none (was {before_ra})"
    return "", ""


class HealthTracker:
    """Per-GPU health state from samples; see module doc."""

    def __init__(self, config: HealthConfig | None = None) -> None:
        self.cfg = config or HealthConfig()
        self._gpus: dict[tuple[str, str], _GpuState] = {}
        self.links = LinkHealthTracker(self.cfg.links)
        self._bad_links: dict[str, dict[tuple[str, int], LinkChange]] = {}
        """host -> (device, link) -> the change that made the link unhealthy: its domain may grow."""
        self._named: dict[tuple[str, str, int], set[str]] = {}
        """(host, device, link) -> devices already named in that link's domain."""
        self.samples = 0
        self.skipped = 0
        self.awaiting_clear: dict[tuple[str, str, str], int] = {}
        """(host, device, signal) -> time of level alerts open that these samples never showed active: one
        restored open after a restart (time 0: the condition may have ended while the service was down),
        or one an XidEvent raised (NVML's recovery-action event, at its time: the 30 s samples may never
        see the value before it is gone). The GPU's first sample from that time on that reads normal
        clears it (see :meth:`await_clear`)."""

    def await_clear(self, hostname: str, device: str, signal: str, since_ms: int = 0) -> None:
        """A ``signal`` alert of this GPU is open without these samples having raised it: clear it at the
        first sample at or after ``since_ms`` that reads normal."""
        if signal.startswith(NVLINK_SIGNAL + ":"):
            # the link tracker clears it the way it clears its own: after clean windows in a row (a
            # link that never reports again leaves it to end by quiet time, like any level alert)
            link = signal.split(":", 1)[1]
            if link.isdigit():
                self.links.assume(hostname, device, int(link), "degrading")
            return
        item = (hostname, device, signal)
        self.awaiting_clear[item] = max(since_ms, self.awaiting_clear.get(item, since_ms))

    def _clears(self, key: tuple[str, str], signal: str, was: bool | None, ts: int) -> bool:
        """Whether a sample reading normal at ``ts`` clears ``signal``: it was active, or awaited."""
        item = (key[0], key[1], signal)
        since = self.awaiting_clear.get(item)
        if was or (since is not None and ts >= since):
            self.awaiting_clear.pop(item, None)
            return True
        return False

    def __len__(self) -> int:
        return len(self._gpus)

    def forget(self, hosts: Collection[str], gpus: Collection[tuple[str, str]]) -> None:
        """Drop the state of ``hosts`` and of the devices ``gpus`` (evicted by admission)."""
        for key in [k for k in self._gpus if k[0] in hosts] if hosts else []:
            del self._gpus[key]
        for key in gpus:
            self._gpus.pop(key, None)
            self.links.forget(key[0], key[1])
        for host in hosts:
            self.links.forget(host)
            self._bad_links.pop(host, None)
        for item in [i for i in self._named if i[0] in hosts or (i[0], i[1]) in gpus]:
            del self._named[item]
        for host, bad in list(self._bad_links.items()):
            for item in [i for i in bad if (host, i[0]) in gpus]:
                del bad[item]
            if not bad:
                del self._bad_links[host]
        for item in [i for i in self.awaiting_clear if i[0] in hosts or (i[0], i[1]) in gpus]:
            del self.awaiting_clear[item]

    def observe(self, sample: dict[str, Any]) -> tuple[GpuIdentity | None, list[SignalEvent]]:
        """Update state from one sample; return the GPU's identity and the signal changes it caused."""
        if sample.get("mig"):
            self.skipped += 1
            return None, []
        host = sample.get("hostname") or ""
        device = alert_device_key(sample.get("pci_bus_id"), sample.get("uuid"))
        ts = sample.get("timestamp_ms")
        if not host or not device or not isinstance(ts, int) or isinstance(ts, bool):
            self.skipped += 1
            raise InvalidRecord("sample without hostname, PCI bus id/UUID or integer timestamp_ms")
        key = (host, device)
        st = self._gpus.get(key)
        if st is None:
            st = self._gpus[key] = _GpuState(GpuIdentity(host, device))
        if ts < st.last_ts:
            self.skipped += 1
            return st.ident, []
        self.samples += 1
        st.last_ts = ts
        st.sample = sample
        _identify(st.ident, sample)
        out: list[SignalEvent] = []
        _loss_and_reset(st, sample, ts, out)
        _dbe(st, sample, ts, out)
        self._levels(key, st, sample, ts, out)
        reasons = sample.get("clock_event_reasons")
        if isinstance(reasons, int):
            self._thermal(st, ts, reasons, sample.get("gpu_temp_c"), out)
        links = sample.get("nvlink_link_counters")
        if links and (st.links_ms is None or ts - st.links_ms >= LINK_READ_MS):
            st.links_ms = ts
            self._links(key, ts, links, out)
        if host in self._bad_links:
            self._joins(key, st, ts, out)
        return st.ident, out

    def _links(self, key: tuple[str, str], ts: int, links: list[Any], out: list[SignalEvent]) -> None:
        """Link-health changes of the GPU's NVLink links; a link not healthy stays active each sample."""
        changed = {c.link for c in self.links.observe(key[0], key[1], ts, links) if c.state == "healthy"}
        for link in sorted(changed):
            out.append(
                SignalEvent(link_signal(link), "clear", ts, detail=f"NVLink link {link} healthy again")
            )
        host, device = key
        bad = self._bad_links.setdefault(host, {})
        for item in [i for i in bad if i[0] == device]:
            del bad[item]
        for link in changed:
            self._named.pop((host, device, link), None)
        for c in sorted(self.links.unhealthy(host, device), key=lambda c: c.link):
            bad[(device, c.link)] = c
            related = self._domain(key, c)
            self._named.setdefault((host, device, c.link), set()).update(r.device for r in related)
            out.append(_link_event(c, ts, related))
        if not bad:
            del self._bad_links[host]

    def _joins(self, key: tuple[str, str], st: _GpuState, ts: int, out: list[SignalEvent]) -> None:
        """This GPU's sample may put it in the NVLink domain of another GPU's unhealthy link (its
        samples came first: partitions are read in any order): name it there once."""
        host, device = key
        for (other, link), c in self._bad_links[host].items():
            named = self._named.setdefault((host, other, link), set())
            owner = self._gpus.get((host, other))
            if (
                other == device
                or device in named
                or owner is None
                or not self._in_domain(owner, c, device, st)
            ):
                continue
            named.add(device)
            out.append(replace(_link_event(c, ts, (st.ident,)), subject=owner.ident))

    def _domain(self, key: tuple[str, str], c: LinkChange) -> tuple[GpuIdentity, ...]:
        """The other GPUs a fault of link ``c`` hits: its peer GPU (a direct link, NVLink bridge), or
        behind an NVSwitch every GPU of the node with NVLink links in the same fabric clique (the
        node's NVLink domain; the sample has no finer topology)."""
        host, me = key[0], self._gpus[key]
        return tuple(
            st.ident
            for (h, device), st in self._gpus.items()
            if h == host and device != key[1] and self._in_domain(me, c, device, st)
        )

    @staticmethod
    def _in_domain(owner: _GpuState, c: LinkChange, device: str, st: _GpuState) -> bool:
        """Whether GPU ``device`` (state ``st``) is in the NVLink domain of ``owner``'s link ``c``."""
        if st.sample is None:
            return False
        if c.peer not in (None, "nvswitch"):
            return alert_device_key(c.peer, None) == device
        mine = (owner.sample or {}).get("fabric_clique_id")
        return bool(st.sample.get("nvlink_links")) and st.sample.get("fabric_clique_id") == mine

    def _levels(
        self, key: tuple[str, str], st: _GpuState, sample: dict[str, Any], ts: int, out: list[SignalEvent]
    ) -> None:
        """The level fields, and the recovery action the driver requires: raised while set, cleared once."""
        for signal, fld in _LEVEL_FIELDS:
            value = sample.get(fld)
            if value is None:
                continue
            was = st.level.get(signal)
            if value:
                out.append(SignalEvent(signal, "active", ts, since_ms=ts, detail=f"{fld}=true"))
            elif self._clears(key, signal, was, ts):
                out.append(SignalEvent(signal, "clear", ts, detail=f"{fld}=false"))
            st.level[signal] = bool(value)

        rec = sample.get("gpu_recovery_action")
        if isinstance(rec, int) and not isinstance(rec, bool):
            was = st.level.get("recovery_action")
            if rec != 0:
                out.append(
                    SignalEvent(
                        "recovery_action",
                        "active",
                        ts,
                        since_ms=ts,
                        detail=f"gpu_recovery_action={rec} ({recovery_name(rec)})",
                        value=rec,
                    )
                )
            elif self._clears(key, "recovery_action", was, ts):
                out.append(SignalEvent("recovery_action", "clear", ts, detail="gpu_recovery_action=0"))
            st.level["recovery_action"] = rec != 0

    def _thermal(
        self, st: _GpuState, ts: int, reasons: int, temp: float | None, out: list[SignalEvent]
    ) -> None:
        cfg = self.cfg
        hot = bool(reasons & THERMAL_MASK)
        if hot:
            st.thermal_clear_since = None
            if st.thermal_since is None:
                st.thermal_since = ts
            if st.thermal_active or ts - st.thermal_since >= cfg.thermal_for_ms:
                st.thermal_active = True
                temp_text = f", {temp:g} C" if temp is not None else ""
                out.append(
                    SignalEvent(
                        "thermal",
                        "active",
                        ts,
                        since_ms=st.thermal_since,
                        detail=f"clock_event_reasons=0x{reasons:x}{temp_text}",
                    )
                )
            return
        st.thermal_since = None
        if not st.thermal_active:
            return
        if st.thermal_clear_since is None:
            st.thermal_clear_since = ts
        if ts - st.thermal_clear_since >= cfg.thermal_clear_ms:
            st.thermal_active = False
            st.thermal_clear_since = None
            out.append(SignalEvent("thermal", "clear", ts, detail=f"clock_event_reasons=0x{reasons:x}"))

    def identity(self, hostname: str, device: str) -> GpuIdentity | None:
        st = self._gpus.get((hostname, device))
        return st.ident if st is not None else None

    def health(self, hostname: str, device: str) -> GpuHealth | None:
        """The memory-health snapshot of the GPU's latest sample (``None``: no sample seen)."""
        st = self._gpus.get((hostname, device))
        if st is None or st.sample is None:
            return None
        s = st.sample
        return GpuHealth(
            remap_pending=s.get("row_remap_pending"),
            remap_failure=s.get("row_remap_failure"),
            uncorrectable_remapped_rows=s.get("remapped_rows_uncorrectable"),
            correctable_remapped_rows=s.get("remapped_rows_correctable"),
            ecc_dbe_volatile=s.get("ecc_dbe_volatile_total"),
            ecc_sbe_volatile=s.get("ecc_sbe_volatile_total"),
            ecc_dbe_aggregate=s.get("ecc_dbe_aggregate_total"),
            ecc_sbe_aggregate=s.get("ecc_sbe_aggregate_total"),
            recovery_action=s.get("gpu_recovery_action"),
        )
