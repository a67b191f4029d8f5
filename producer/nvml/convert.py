"""Pure unit conversions from NVML's units to the GpuSample contract, with the garbage policy.

Policy (one rule for every field): a value NVML hands back that cannot be a real reading is
**dropped to null and counted** (the collector calls ``DeviceContext.garbage(field)``, which feeds
``NvmlSource.garbage_counts`` and the ``on_garbage`` hook), never clamped into a plausible number.
A null says "unknown", a clamped 100 % would be a lie the chargeback bills. Garbage is:

* not a number at all (``None`` is "not asked/unsupported", not garbage), NaN or infinity;
* NVML's "not available" sentinels (``0xFFFFFFFF``, ``0xFFFFFFFFFFFFFFFF``), which the ctypes
  wrappers hand through as large unsigned ints, and negatives wrapped into them;
* outside the physical range: a percentage outside 0..100, a power above 10 kW, a temperature
  outside -50..200 C, a clock above 100 GHz, a count that does not fit Avro's ``long``.

The single exception is GPM's floating-point percentages: they are ratios of two hardware
counters and can overshoot by rounding, so values within ``GPM_PCT_SLACK`` points of the 0..100
range are clamped; farther out they are garbage like everything else.
"""

from __future__ import annotations

import math
from typing import Any

UINT32_NA = 0xFFFFFFFF
UINT64_NA = 0xFFFFFFFFFFFFFFFF
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1

KIB = 1024
MIB = 1024 * 1024

MAX_POWER_MW = 10_000_000  # 10 kW: no single GPU board draws more
MIN_TEMP_C = -50
MAX_TEMP_C = 200
MAX_CLOCK_MHZ = 100_000
GPM_PCT_SLACK = 1.0  # percentage points

_SENTINELS = frozenset((UINT32_NA, UINT64_NA))


def _real(v: Any) -> float | int | None:
    """``v`` as a finite int/float that is not an NVML sentinel, else None."""
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, int):
        return None if v in _SENTINELS else v
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    return None


def pct_to_ratio(v: Any) -> float | None:
    """Integer-ish NVML percentage (utilisation, enc/dec) -> 0..1; out of 0..100 -> None."""
    x = _real(v)
    if x is None or x < 0 or x > 100:
        return None
    return x / 100.0


def gpm_pct_to_ratio(v: Any) -> float | None:
    """GPM floating-point percentage -> 0..1, clamping rounding overshoot of ``GPM_PCT_SLACK``."""
    x = _real(v)
    if x is None or x < -GPM_PCT_SLACK or x > 100.0 + GPM_PCT_SLACK:
        return None
    return min(max(x, 0.0), 100.0) / 100.0


def mw_to_w(v: Any) -> float | None:
    """Milliwatts -> watts (power draw, enforced limit)."""
    x = _real(v)
    if x is None or x < 0 or x > MAX_POWER_MW:
        return None
    return x / 1000.0


def watts(v: Any) -> float | None:
    """A power value NVML already gives in watts (power-smoothing floor and ceiling)."""
    x = _real(v)
    if x is None or x < 0 or x > MAX_POWER_MW / 1000:
        return None
    return float(x)


def kib_per_s_to_bytes_per_s(v: Any) -> float | None:
    """NVML PCIe throughput (KB/s, KiB as NVML counts memory) -> bytes/s."""
    x = _real(v)
    if x is None or x < 0:
        return None
    return float(x) * KIB


def mib_per_s_to_bytes_per_s(v: Any) -> float | None:
    """GPM bandwidth (MiB/s) -> bytes/s."""
    x = _real(v)
    if x is None or x < 0:
        return None
    return float(x) * MIB


def count(v: Any) -> int | None:
    """A non-negative integer counter or size that fits Avro ``long`` (bytes, mJ, ns, events)."""
    x = _real(v)
    if x is None or x < 0 or x > INT64_MAX:
        return None
    if isinstance(x, float):
        if not x.is_integer():
            return None
        x = int(x)
    return x


def small_int(v: Any) -> int | None:
    """A non-negative integer that fits Avro ``int`` (enums such as the recovery action)."""
    x = count(v)
    return None if x is None or x > INT32_MAX else x


def celsius(v: Any) -> float | None:
    x = _real(v)
    if x is None or x < MIN_TEMP_C or x > MAX_TEMP_C:
        return None
    return float(x)


def mhz(v: Any) -> int | None:
    x = count(v)
    return None if x is None or x > MAX_CLOCK_MHZ else x


def flag(v: Any) -> bool | None:
    """NVML 0/1 state -> bool; anything else (sentinel, 2, NaN) -> None."""
    x = _real(v)
    if x == 0:
        return False
    if x == 1:
        return True
    return None


def field_value(fv: Any) -> int | float | None:
    """The number in a ``c_nvmlFieldValue_t`` union, chosen by its ``valueType``.

    Type codes are NVML's ``NVML_VALUE_TYPE_*`` (0 double, 1 uint, 2 ulong, 3 ulonglong,
    4 signed long long, 5 signed int, 6 unsigned short).
    """
    member = _VALUE_MEMBERS.get(fv.valueType)
    if member is None:
        return None
    return getattr(fv.value, member)


_VALUE_MEMBERS = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}
