"""Idle-GPU detection: GpuSample dicts in, GpuRecommendation revisions out. Pure: no I/O, no clock.

:class:`IdleDetector` keeps one track per (GPU key, namespace, pod); a streak of samples with activity
under ``idle_threshold`` fires a recommendation once it has lasted ``idle_after``, updates it every
``update_interval`` and resolves it (``busy``, ``pod_ended``, ``gone``). Event time only, so replays
give the same records. At most ``max_gpus`` GPU keys: a new GPU is never refused, the least recently
sampled one is forgotten.
More: docs/recommend.md, "Module notes", ``detector.py``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, cast

from gpupipe_consumers.recommend.rightsize import RightSizeConfig, suggest
from gpupipe_schemas.meaning import activity_ratio, gpu_key
from gpupipe_schemas.records import (
    GpuRecommendation,
    GpuRecommendationRecommendedAction,
    RecommendationStatus,
)

HOUR_MS = 3_600_000
#: GPU models remembered as right-sizing candidates (a fleet has a handful; made-up names are forgotten).
MAX_MODELS = 64


@dataclass(frozen=True, slots=True)
class DetectorConfig:
    idle_threshold: float = 0.05
    idle_after_ms: int = 2 * HOUR_MS
    update_interval_ms: int = 15 * 60_000
    gone_after_ms: int = 10 * 60_000
    default_interval_ms: int = 10_000
    max_gpus: int = 20_000
    """GPU keys tracked at most; beyond it the least recently sampled is forgotten (see module doc)."""
    currency: str = "USD"
    rightsize: RightSizeConfig = field(default_factory=RightSizeConfig)


@dataclass(slots=True)
class Track:
    """One pod on one GPU slot, and its current idle streak."""

    key: str
    partition: int
    namespace: str
    pod: str
    alloc: dict[str, Any]
    sample: dict[str, Any]  # the latest sample (identity, memory total)
    fraction: float
    since_ms: int | None = None  # start of the idle streak; None while busy
    last_ms: int = 0
    interval_ms: int = 0
    mem_peak: int | None = None
    act_peak: float | None = None
    firing_id: str | None = None
    sequence: int = 0
    next_update_ms: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def _interval(sample: dict[str, Any], cfg: DetectorConfig) -> int:
    iv = sample.get("interval_ms")
    return int(iv) if iv and iv > 0 else cfg.default_interval_ms


def _pods(sample: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for a in sample.get("allocations") or ():
        out.setdefault((a["namespace"], a["pod"]), a)
    return out


def _fraction(sample: dict[str, Any], holders: int) -> float:
    mig = sample.get("mig")
    if mig:
        return min(max(float(mig.get("slice_fraction") or 0.0), 0.0), 1.0)
    return 1.0 / holders if holders > 1 else 1.0


def _pod_usage(sample: dict[str, Any], ns: str, pod: str, holders: int) -> tuple[float | None, int | None]:
    """(activity 0..1 of what the pod holds, memory bytes the pod uses) in this sample."""
    procs = [p for p in sample.get("processes") or () if p.get("pod") is not None]
    if holders > 1 and procs:
        mine = [p for p in procs if p.get("namespace") == ns and p.get("pod") == pod]
        act = sum(float(p.get("sm_util_ratio") or 0.0) for p in mine)
        mem = sum(int(p.get("used_memory_bytes") or 0) for p in mine)
        return min(act * holders, 1.0), mem  # share of the GPU -> share of the pod's replica
    used = sample.get("fb_used_bytes")
    return activity_ratio(sample), int(used) if used is not None else None


def recommendation_id(host: str, key: str, ns: str, pod: str, since_ms: int) -> str:
    text = "\x1f".join((host, key, ns, pod, str(since_ms)))
    return hashlib.sha256(text.encode()).hexdigest()[:24]


class IdleDetector:
    """Feeds on samples (per partition, in order) and yields recommendation revisions (dicts)."""

    def __init__(
        self,
        cfg: DetectorConfig = DetectorConfig(),
        *,
        gpu_price: Callable[[str], float] = lambda _model: 0.0,
        team_of: Callable[[str, dict[str, str]], str | None] = lambda _ns, _labels: None,
    ) -> None:
        self.cfg = cfg
        self.gpu_price = gpu_price
        self.team_of = team_of
        # gpu key -> (ns, pod) -> track, least recently sampled first
        self.tracks: dict[str, dict[tuple[str, str], Track]] = {}
        self.watermark: dict[int, int] = {}  # partition -> newest sample timestamp
        self.models_seen: dict[str, None] = {}  # least recently seen first, at most MAX_MODELS
        self.evicted = 0  # GPU keys forgotten at max_gpus

    # -- input -------------------------------------------------------------------------------------
    def observe(self, sample: dict[str, Any], partition: int = 0) -> list[GpuRecommendation]:
        """Account one sample; returns the revisions it causes (possibly none)."""
        out: list[GpuRecommendation] = []
        ts = int(sample["timestamp_ms"])
        if ts > self.watermark.get(partition, -1):
            self.watermark[partition] = ts
        model = sample.get("model_name")
        if model:
            self._model_seen(model)
        key = gpu_key(sample)
        pods = _pods(sample)
        lost = bool(sample.get("gpu_lost"))
        held = self.tracks.pop(key, None)  # re-inserted last: the most recently sampled
        if held is None:
            held = {}
            while len(self.tracks) >= self.cfg.max_gpus:
                out.extend(self._evict_oldest())
        self.tracks[key] = held
        # Pods that held this GPU before and no longer do.
        for pair in [k for k in held if k not in pods]:
            track = held.pop(pair)
            if track.firing_id is not None:
                out.append(self._record(track, "resolved", ts, "pod_ended"))
        if lost:
            return out
        holders = len(pods)
        iv = _interval(sample, self.cfg)
        for (ns, pod), alloc in pods.items():
            track = held.get((ns, pod))
            if track is not None and track.partition < 0:
                track.partition = partition  # restored at start: adopt the partition now
            if track is None:
                track = held[(ns, pod)] = Track(
                    key, partition, ns, pod, alloc, sample, _fraction(sample, holders)
                )
            elif ts <= track.last_ms:
                continue  # duplicate or reordered: the streak only moves forward
            out.extend(self._follow(track, sample, alloc, ts, iv, holders))
        return out

    def _follow(
        self, track: Track, sample: dict[str, Any], alloc: dict[str, Any], ts: int, iv: int, holders: int
    ) -> list[dict[str, Any]]:
        """One pod's new sample: a busy one ends its idle streak, an idle one starts or extends it,
        and the streak fires once it lasted ``idle_after`` (then updates every ``update_interval``)."""
        out: list[dict[str, Any]] = []
        track.sample, track.alloc, track.interval_ms = sample, alloc, iv
        track.fraction = _fraction(sample, holders)
        act, mem = _pod_usage(sample, track.namespace, track.pod, holders)
        if act is not None and act >= self.cfg.idle_threshold:
            if track.firing_id is not None:  # the streak ended with the previous sample
                out.append(self._record(track, "resolved", ts, "busy"))
            track.since_ms = None
            track.firing_id = None
        track.last_ms = ts
        if act is None or (track.firing_id is None and act >= self.cfg.idle_threshold):
            return out
        if track.since_ms is None:
            track.since_ms, track.mem_peak, track.act_peak, track.sequence = ts, mem, act, 0
        else:
            if mem is not None and (track.mem_peak is None or mem > track.mem_peak):
                track.mem_peak = mem
            if track.act_peak is None or act > track.act_peak:
                track.act_peak = act
        idle_ms = ts - track.since_ms + iv
        if track.firing_id is None and idle_ms >= self.cfg.idle_after_ms:
            track.firing_id = recommendation_id(
                sample["hostname"], track.key, track.namespace, track.pod, track.since_ms
            )
            track.next_update_ms = ts + self.cfg.update_interval_ms
            out.append(self._record(track, "firing", ts, None))
        elif track.firing_id is not None and ts >= track.next_update_ms:
            track.next_update_ms = ts + self.cfg.update_interval_ms
            out.append(self._record(track, "firing", ts, None))
        return out

    def _model_seen(self, model: str) -> None:
        seen = self.models_seen
        seen.pop(model, None)
        seen[model] = None
        if len(seen) > MAX_MODELS:
            del seen[next(iter(seen))]

    def _evict_oldest(self) -> list[GpuRecommendation]:
        """Forget the least recently sampled GPU (``max_gpus`` reached): its open recommendations end
        ``gone`` at their last sample, as :meth:`expire` would end them once its samples stopped."""
        key = next(iter(self.tracks))
        held = self.tracks.pop(key)
        self.evicted += 1
        firing = [t for t in held.values() if t.firing_id is not None]
        return [self._record(t, "resolved", t.last_ms, "gone") for t in firing]

    def expire(self, partition: int | None = None) -> list[GpuRecommendation]:
        """Resolve (``gone``) and forget tracks whose GPU was silent for ``gone_after`` behind the
        newest sample of their partition."""
        out = []
        for key, held in list(self.tracks.items()):
            for pair, track in list(held.items()):
                if partition is not None and track.partition != partition:
                    continue
                if track.partition < 0:  # restored, not seen since: judge by the newest partition
                    wm = max(self.watermark.values(), default=None)
                else:
                    wm = self.watermark.get(track.partition)
                if wm is None or wm - track.last_ms < self.cfg.gone_after_ms:
                    continue
                del held[pair]
                if track.firing_id is not None:
                    out.append(self._record(track, "resolved", track.last_ms, "gone"))
            if not held:
                del self.tracks[key]
        return out

    def drop_partitions(self, partitions: Iterable[int]) -> None:
        """Forget the state of revoked partitions (the next owner rebuilds it from the stream)."""
        gone = set(partitions)
        for key, held in list(self.tracks.items()):
            if any(t.partition in gone for t in held.values()):
                del self.tracks[key]
        for p in gone:
            self.watermark.pop(p, None)

    def restore(self, records: Iterable[GpuRecommendation]) -> int:
        """Re-open the recommendations still firing in ``records`` (a GpuRecommendation topic read at
        start), so that a restart continues them (same id, next sequence) instead of starting a new
        streak. Returns how many were re-opened."""
        latest: dict[str, GpuRecommendation] = {}
        for r in records:
            prev = latest.get(r["recommendation_id"])
            if prev is None or r["sequence"] > prev["sequence"]:
                latest[r["recommendation_id"]] = r
        n = 0
        for r in latest.values():
            if r["status"] != "firing":
                continue
            key = r["mig_uuid"] or r["uuid"]
            mig = (
                {"mig_uuid": r["mig_uuid"], "profile": r["mig_profile"], "slice_fraction": r["gpu_fraction"]}
                if r["mig_uuid"]
                else None
            )
            sample = {
                "hostname": r["hostname"],
                "uuid": r["uuid"],
                "mig": mig,
                "gpu_index": r["gpu_index"],
                "model_name": r["model_name"],
                "fb_total_bytes": r["memory_total_bytes"],
            }
            alloc = {
                "namespace": r["namespace"],
                "pod": r["pod"],
                "container": r["container"],
                "resource_name": r["resource_name"],
                "owner_kind": r["owner_kind"],
                "owner_name": r["owner_name"],
                "labels": r["labels"],
            }
            iv = round(r["idle_seconds"] * 1000) - (r["last_seen_ms"] - r["idle_since_ms"])
            if key not in self.tracks and len(self.tracks) >= self.cfg.max_gpus:
                continue  # more open than the bound: the rest start again from their samples
            self.tracks.setdefault(key, {})[(r["namespace"], r["pod"])] = Track(
                key,
                -1,
                r["namespace"],
                r["pod"],
                alloc,
                sample,
                r["gpu_fraction"],
                since_ms=r["idle_since_ms"],
                last_ms=r["last_seen_ms"],
                interval_ms=iv if iv > 0 else self.cfg.default_interval_ms,
                mem_peak=r["memory_peak_bytes"],
                act_peak=r["activity_peak_ratio"],
                firing_id=r["recommendation_id"],
                sequence=r["sequence"],
                next_update_ms=r["timestamp_ms"] + self.cfg.update_interval_ms,
            )
            if r["model_name"]:
                self._model_seen(r["model_name"])
            n += 1
        return n

    def open_recommendations(self) -> list[Track]:
        return [t for held in self.tracks.values() for t in held.values() if t.firing_id is not None]

    # -- output ------------------------------------------------------------------------------------
    def _record(
        self, t: Track, status: RecommendationStatus, ts: int, reason: str | None
    ) -> GpuRecommendation:
        assert t.firing_id is not None and t.since_ms is not None
        t.sequence += 1
        s, a = t.sample, t.alloc
        mig = s.get("mig")
        model = s["model_name"]
        labels = dict(a.get("labels") or {})
        idle_s = (t.last_ms - t.since_ms + t.interval_ms) / 1000.0
        gpu_hours = idle_s / 3600.0 * t.fraction
        price = self.gpu_price(model)
        total = s.get("fb_total_bytes")
        sug = suggest(
            model=model,
            fraction=t.fraction,
            memory_peak_bytes=t.mem_peak,
            activity_peak=t.act_peak,
            gpu_price=self.gpu_price,
            candidate_models=sorted(self.models_seen),
            cfg=self.cfg.rightsize,
        )
        owner = f"{a.get('owner_kind')}/{a.get('owner_name')}" if a.get("owner_name") else None
        what = f"{model}" + (f" MIG {mig['profile']}" if mig else "") + f" on {s['hostname']}"
        todo = {
            "release": "release it",
            "right_size_mig": f"right-size to MIG {sug.target}",
            "shared_gpu": f"move to a shared GPU ({sug.target})",
            "cheaper_model": f"move to {sug.target}",
        }[sug.action]
        message = (
            f"{t.namespace}/{t.pod}{f' ({owner})' if owner else ''} has held {what} idle for "
            f"{idle_s / 3600:.1f} h ({gpu_hours:.2f} GPU-h, {gpu_hours * price:.2f} {self.cfg.currency}): "
            f"{todo}"
        )
        if status == "resolved":
            message = f"resolved ({reason}): " + message
        rec: GpuRecommendation = {
            "recommendation_id": t.firing_id,
            "sequence": t.sequence,
            "status": status,
            "resolve_reason": reason,
            "timestamp_ms": ts,
            "hostname": s["hostname"],
            "uuid": s["uuid"],
            "mig_uuid": mig["mig_uuid"] if mig else None,
            "gpu_index": s.get("gpu_index"),
            "model_name": model,
            "mig_profile": mig["profile"] if mig else None,
            "gpu_fraction": t.fraction,
            "resource_name": a.get("resource_name"),
            "namespace": t.namespace,
            "pod": t.pod,
            "container": a.get("container"),
            "owner_kind": a.get("owner_kind"),
            "owner_name": a.get("owner_name"),
            "team": self.team_of(t.namespace, labels),
            "labels": labels,
            "idle_since_ms": t.since_ms,
            "last_seen_ms": t.last_ms,
            "idle_seconds": idle_s,
            "gpu_hours_idle": gpu_hours,
            "cost_wasted": gpu_hours * price,
            "currency": self.cfg.currency,
            "idle_threshold": self.cfg.idle_threshold,
            "activity_peak_ratio": t.act_peak,
            "memory_peak_bytes": t.mem_peak,
            "memory_total_bytes": int(total) if total is not None else None,
            "action": cast(GpuRecommendationRecommendedAction, sug.action),  # rightsize's four
            "target": sug.target,
            "saving_per_hour": sug.saving_per_hour,
            "message": message,
        }
        if status == "resolved":
            t.firing_id = None
        return rec
