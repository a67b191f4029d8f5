"""What an idle pod should hold instead: release, a smaller MIG profile, a shared GPU or a cheaper model.

Pure: peaks and prices in, one suggestion out. The inputs are what the detector saw during the idle
streak: the highest framebuffer memory used and the highest activity (0..1 of the GPU or slice held).

Rules, in order:

1. **release** when the memory peak is under ``release_memory_bytes`` (default 1 GiB: a CUDA context
   and nothing else): the pod never put anything on the GPU, so it needs none.
2. Otherwise every option that fits is priced per hour and the cheapest strictly cheaper than what
   the pod holds now wins (ties: MIG, then shared, then model, the least disruptive first):

   * **right_size_mig**: the smallest MIG profile of the same model (NVIDIA's MIG user guide, table
     "Supported MIG profiles") whose memory holds ``peak x (1 + headroom)`` and whose compute slices
     (of 7) hold the SM peak; priced ``slices / 7`` of the model's GPU-hour, as chargeback bills a slice;
   * **shared_gpu**: a time-sliced replica (``nvidia.com/gpu.shared``) when the memory need and the
     SM peak fit ``1 / shared_replicas`` of the GPU; priced ``1 / shared_replicas`` of the GPU-hour;
   * **cheaper_model**: the cheapest model of the price table with a known memory size (``MODEL_MEMORY``)
     that holds the memory need.

3. With nothing cheaper that fits, the suggestion is **release** (an idle pod still wastes the GPU).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

GIB = 1024**3
MIB = 1024**2

RELEASE = "release"
RIGHT_SIZE_MIG = "right_size_mig"
SHARED_GPU = "shared_gpu"
CHEAPER_MODEL = "cheaper_model"
SHARED_RESOURCE = "nvidia.com/gpu.shared"

# (profile, compute slices of 7, memory MiB as NVML reports the GPU instance), smallest first.
# From NVIDIA's MIG user guide ("Supported MIG Profiles"); the +me and media-extension variants
# are left out (same memory and compute as their base profile).
MIG_PROFILES: dict[str, tuple[tuple[str, int, int], ...]] = {
    "a100-40": (("1g.5gb", 1, 4864), ("2g.10gb", 2, 9984), ("3g.20gb", 3, 19968), ("4g.20gb", 4, 19968)),
    "a100-80": (("1g.10gb", 1, 9728), ("2g.20gb", 2, 19968), ("3g.40gb", 3, 40192), ("4g.40gb", 4, 40192)),
    "h100-80": (
        ("1g.10gb", 1, 9984),
        ("1g.20gb", 1, 19968),
        ("2g.20gb", 2, 19968),
        ("3g.40gb", 3, 40448),
        ("4g.40gb", 4, 40448),
    ),
    "h200": (
        ("1g.18gb", 1, 16384),
        ("1g.35gb", 1, 32768),
        ("2g.35gb", 2, 32768),
        ("3g.71gb", 3, 71424),
        ("4g.71gb", 4, 71424),
    ),
}

# Datasheet framebuffer sizes of common models (lower-cased name prefix -> bytes), for cheaper_model.
MODEL_MEMORY: tuple[tuple[str, int], ...] = (
    ("nvidia h200", 141 * GIB),
    ("nvidia h100 nvl", 94 * GIB),
    ("nvidia h100", 80 * GIB),
    ("nvidia a100-sxm4-80gb", 80 * GIB),
    ("nvidia a100 80gb", 80 * GIB),
    ("nvidia a100", 40 * GIB),
    ("nvidia l40s", 48 * GIB),
    ("nvidia l40", 48 * GIB),
    ("nvidia a10", 24 * GIB),
    ("nvidia l4", 24 * GIB),
    ("tesla t4", 16 * GIB),
    ("nvidia t4", 16 * GIB),
)


def mig_family(model: str) -> str | None:
    """Which MIG profile table applies to ``model`` (None: not MIG-capable or unknown)."""
    m = model.lower()
    if "h200" in m:
        return "h200"
    if "h100" in m or "h800" in m:
        return "h100-80"
    if "a100" in m or "a800" in m:
        return "a100-80" if "80gb" in m else "a100-40"
    return None


def model_memory(model: str) -> int | None:
    m = model.lower()
    for prefix, size in MODEL_MEMORY:
        if m.startswith(prefix):
            return size
    return None


@dataclass(frozen=True, slots=True)
class RightSizeConfig:
    release_memory_bytes: int = GIB
    """Memory peak under which the pod is taken never to have used the GPU."""
    headroom: float = 0.2
    """Extra memory a target must offer over the peak (0.2: 20 %)."""
    shared_replicas: int = 4
    """Replicas per time-sliced GPU in the cluster's shared pool (price and memory divide by it)."""


@dataclass(frozen=True, slots=True)
class Suggestion:
    action: str
    target: str | None
    price_per_hour: float  # of the target (0 for release)
    saving_per_hour: float  # current price minus the target's


def suggest(
    *,
    model: str,
    fraction: float,
    memory_peak_bytes: int | None,
    activity_peak: float | None,
    gpu_price: Callable[[str], float],
    candidate_models: Iterable[str] = (),
    cfg: RightSizeConfig = RightSizeConfig(),
) -> Suggestion:
    """The suggestion for a pod idle on ``fraction`` of a ``model`` GPU (see the module doc)."""
    price = gpu_price(model)
    current = price * fraction
    peak = memory_peak_bytes or 0
    if peak < cfg.release_memory_bytes:
        return Suggestion(RELEASE, None, 0.0, current)
    need = int(peak * (1.0 + cfg.headroom))
    # SM peak in sevenths of the whole GPU (activity is relative to what the pod holds).
    sm_slices = max(1, math.ceil((activity_peak or 0.0) * fraction * 7 - 1e-9))
    options: list[tuple[float, int, str, str]] = []
    family = mig_family(model)
    if family is not None:
        for profile, slices, mem_mib in MIG_PROFILES[family]:
            if mem_mib * MIB >= need and slices >= sm_slices:
                options.append((price * slices / 7, 0, RIGHT_SIZE_MIG, profile))
                break
    total = model_memory(model)
    sm_need = (activity_peak or 0.0) * fraction
    if total is not None and need <= total / cfg.shared_replicas and sm_need <= 1.0 / cfg.shared_replicas:
        options.append((price / cfg.shared_replicas, 1, SHARED_GPU, SHARED_RESOURCE))
    best_model: tuple[float, str] | None = None
    for other in candidate_models:
        size = model_memory(other)
        if other.lower() == model.lower() or size is None or size < need:
            continue
        p = gpu_price(other)
        if best_model is None or (p, other) < best_model:
            best_model = (p, other)
    if best_model is not None:
        options.append((best_model[0], 2, CHEAPER_MODEL, best_model[1]))
    cheaper = [o for o in options if o[0] < current - 1e-9]
    if not cheaper:
        return Suggestion(RELEASE, None, 0.0, current)
    cost, _, action, target = min(cheaper)
    return Suggestion(action, target, cost, current - cost)
