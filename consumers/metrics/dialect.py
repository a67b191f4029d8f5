"""Metric-name dialects: the names (and units) of each dcgm-exporter generation (pure data).

``--dialect`` picks what ``/metrics`` speaks: ``dcgm-4.8`` (default), ``dcgm-4.9``, ``dcgm-4.10``, a
comma list of these, or ``both``. :data:`RENAMES` is the only declaration of a mapping: a newer
:class:`FieldSpec` is derived from its 4.8 spec in :mod:`gpupipe_consumers.metrics.fields`, and
:func:`lookup` finds any generation's name for a counters CSV.
More (the generations, where each name comes from): docs/inside-metrics.md, "dialect.py".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from gpupipe_consumers.metrics import fields
from gpupipe_consumers.metrics.fields import FieldSpec, Kind

#: dcgm-exporter's naming generations, oldest first.
GENERATIONS = ("dcgm-4.8", "dcgm-4.9", "dcgm-4.10")
#: ``both``: the oldest and the newest generation (a migration window).
BOTH = (GENERATIONS[0], GENERATIONS[-1])
#: The single words ``--dialect`` takes; a comma list of generations is accepted too.
DIALECTS = (*GENERATIONS, "both")
DEFAULT_DIALECT = GENERATIONS[0]


@dataclass(frozen=True, slots=True)
class Rename:
    """One field's newer name, from generation ``since`` on; ``kind``/``source``/``help`` only
    where the unit changes."""

    old: str
    new: str
    dcgm_id: int
    origin: str  # alias | base | ref | rel (see the module doc)
    kind: Kind | None = None
    source: str | None = None
    help: str | None = None
    since: str = "dcgm-4.9"

    @property
    def unit_change(self) -> bool:
        return self.kind is not None


def _u(old: str, new: str, dcgm_id: int, origin: str, kind: Kind, source: str, help_: str) -> Rename:
    return Rename(old, new, dcgm_id, origin, kind, source, help_)


#: The renames from the 4.8 names, default CSV order: 4.9's, then 4.10's. Ratios are DCGM doubles
#: (``%f``); bytes are the exact byte counts GpuSample carries (DCGM's byte fields are byte-exact,
#: not MiB x 2**20).
RENAMES: tuple[Rename, ...] = (
    _u(
        "DCGM_FI_DEV_SM_CLOCK",
        "DCGM_FI_DEV_SM_CLOCK_HERTZ",
        1603,
        "base",
        Kind.HERTZ,
        "sm_clock_mhz",
        "SM clock frequency (in Hz).",
    ),
    _u(
        "DCGM_FI_DEV_MEM_CLOCK",
        "DCGM_FI_DEV_MEMORY_CLOCK_HERTZ",
        1604,
        "base",
        Kind.HERTZ,
        "mem_clock_mhz",
        "Memory clock frequency (in Hz).",
    ),
    Rename("DCGM_FI_DEV_MEMORY_TEMP", "DCGM_FI_DEV_MEMORY_TEMP_CELSIUS", 140, "alias"),
    Rename("DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_GPU_TEMP_CELSIUS", 150, "alias"),
    Rename("DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_BOARD_POWER_WATTS", 155, "alias"),
    _u(
        "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
        "DCGM_FI_DEV_GPU_ENERGY_JOULES_TOTAL",
        1611,
        "base",
        Kind.JOULES,
        "total_energy_mj",
        "Total energy consumption since boot (in J).",
    ),
    Rename("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "DCGM_FI_DEV_PCIE_REPLAY_TOTAL", 202, "alias"),
    _u(
        "DCGM_FI_DEV_GPU_UTIL",
        "DCGM_FI_DEV_GPU_UTIL_RATIO",
        1613,
        "ref",
        Kind.FLOAT,
        "gpu_util_ratio",
        "GPU utilization (ratio 0-1).",
    ),
    _u(
        "DCGM_FI_DEV_MEM_COPY_UTIL",
        "DCGM_FI_DEV_MEMORY_UTIL_RATIO",
        1614,
        "ref",
        Kind.FLOAT,
        "mem_copy_util_ratio",
        "Memory utilization (ratio 0-1).",
    ),
    _u(
        "DCGM_FI_DEV_ENC_UTIL",
        "DCGM_FI_DEV_ENC_UTIL_RATIO",
        1615,
        "ref",
        Kind.FLOAT,
        "enc_util_ratio",
        "Encoder utilization (ratio 0-1).",
    ),
    _u(
        "DCGM_FI_DEV_DEC_UTIL",
        "DCGM_FI_DEV_DEC_UTIL_RATIO",
        1616,
        "ref",
        Kind.FLOAT,
        "dec_util_ratio",
        "Decoder utilization (ratio 0-1).",
    ),
    Rename("DCGM_FI_DEV_XID_ERRORS", "DCGM_FI_DEV_XID_ERROR", 230, "alias"),
    _u(
        "DCGM_FI_DEV_FB_FREE",
        "DCGM_FI_DEV_FB_FREE_BYTES",
        1626,
        "ref",
        Kind.INT,
        "fb_free_bytes",
        "Framebuffer memory free (in bytes).",
    ),
    _u(
        "DCGM_FI_DEV_FB_USED",
        "DCGM_FI_DEV_FB_USED_BYTES",
        1627,
        "ref",
        Kind.INT,
        "fb_used_bytes",
        "Framebuffer memory used (in bytes).",
    ),
    _u(
        "DCGM_FI_DEV_FB_RESERVED",
        "DCGM_FI_DEV_FB_RESERVED_BYTES",
        1628,
        "ref",
        Kind.INT,
        "fb_reserved_bytes",
        "Framebuffer memory reserved (in bytes).",
    ),
    # gpupipe's value under the 4.8 name is NVML's cumulative KiB counter, not DCGM's MB/s rate;
    # the new name gets the same counter in bytes (docs/metrics.md: differences that remain).
    _u(
        "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL",
        "DCGM_FI_DEV_NVLINK_THROUGHPUT_BYTES_PER_SECOND",
        1648,
        "ref",
        Kind.KIB,
        "nvlink_bandwidth_total_kib",
        "Total NVLink traffic for all lanes (in bytes).",
    ),
    Rename(
        "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", "DCGM_FI_DEV_ROW_REMAP_UNCORRECTABLE_TOTAL", 393, "alias"
    ),
    Rename("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "DCGM_FI_DEV_ROW_REMAP_CORRECTABLE_TOTAL", 394, "alias"),
    Rename("DCGM_FI_DEV_ROW_REMAP_FAILURE", "DCGM_FI_DEV_ROW_REMAP_FAILED", 395, "alias"),
    Rename("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "DCGM_FI_PROF_GR_ENGINE_UTIL_RATIO", 1001, "alias"),
    Rename("DCGM_FI_PROF_SM_ACTIVE", "DCGM_FI_PROF_SM_UTIL_RATIO", 1002, "alias"),
    Rename("DCGM_FI_PROF_SM_OCCUPANCY", "DCGM_FI_PROF_SM_OCCUPANCY_RATIO", 1003, "alias"),
    Rename("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "DCGM_FI_PROF_TENSOR_UTIL_RATIO", 1004, "alias"),
    Rename("DCGM_FI_PROF_DRAM_ACTIVE", "DCGM_FI_PROF_DRAM_UTIL_RATIO", 1005, "alias"),
    Rename("DCGM_FI_PROF_PIPE_FP64_ACTIVE", "DCGM_FI_PROF_FP64_UTIL_RATIO", 1006, "alias"),
    Rename("DCGM_FI_PROF_PIPE_FP32_ACTIVE", "DCGM_FI_PROF_FP32_UTIL_RATIO", 1007, "alias"),
    Rename("DCGM_FI_PROF_PIPE_FP16_ACTIVE", "DCGM_FI_PROF_FP16_UTIL_RATIO", 1008, "alias"),
    # a label row: the label name changes, its value does not
    Rename("DCGM_FI_DRIVER_VERSION", "DCGM_FI_SYSTEM_DRIVER_VERSION", 1, "alias"),
    # 4.10: same fields, same unit (a rate in B/s), under names that say so
    Rename(
        "DCGM_FI_PROF_PCIE_TX_BYTES", "DCGM_FI_PROF_PCIE_TX_BYTES_PER_SECOND", 1009, "rel", since="dcgm-4.10"
    ),
    Rename(
        "DCGM_FI_PROF_PCIE_RX_BYTES", "DCGM_FI_PROF_PCIE_RX_BYTES_PER_SECOND", 1010, "rel", since="dcgm-4.10"
    ),
    Rename(
        "DCGM_FI_PROF_NVLINK_TX_BYTES",
        "DCGM_FI_PROF_NVLINK_TX_BYTES_PER_SECOND",
        1011,
        "rel",
        since="dcgm-4.10",
    ),
    Rename(
        "DCGM_FI_PROF_NVLINK_RX_BYTES",
        "DCGM_FI_PROF_NVLINK_RX_BYTES_PER_SECOND",
        1012,
        "rel",
        since="dcgm-4.10",
    ),
)

BY_OLD: Mapping[str, Rename] = MappingProxyType({r.old: r for r in RENAMES})


def _derive(r: Rename) -> FieldSpec:
    """The newer spec: the 4.8 spec under the new name, with the new unit where it changes."""
    old = fields.BY_NAME[r.old]
    spec = dataclasses.replace(old, name=r.new, renames=r.old)
    if r.unit_change:
        assert r.kind is not None and r.source is not None and r.help is not None
        spec = dataclasses.replace(spec, kind=r.kind, source=r.source, help=r.help)
    return spec


#: newer name -> its spec.
NEW_SPECS: Mapping[str, FieldSpec] = MappingProxyType({r.new: _derive(r) for r in RENAMES})


def lookup(name: str) -> FieldSpec | None:
    """The spec for a field name of any generation (or a 1.x name), None when not served."""
    return fields.lookup(name) or NEW_SPECS.get(name)


def generations(dialect: str) -> tuple[str, ...]:
    """The generations a ``--dialect`` value names, oldest first (``both`` is :data:`BOTH`);
    ValueError naming the choices for anything else."""
    picked: set[str] = set()
    for word in (w.strip() for w in dialect.split(",")):
        if word == "both":
            picked.update(BOTH)
        elif word in GENERATIONS:
            picked.add(word)
        else:
            raise ValueError(
                f"unknown dialect {word!r} in {dialect!r} (use one of {', '.join(DIALECTS)}, "
                "or a comma list of generations)"
            )
    return tuple(g for g in GENERATIONS if g in picked)


def name_in(r: Rename, generation: str) -> str:
    """The name of renamed field ``r`` in ``generation``."""
    return r.new if GENERATIONS.index(generation) >= GENERATIONS.index(r.since) else r.old
