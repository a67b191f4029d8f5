"""Chargeback windows of the producer's simulated fleet, accounted in-process, with no broker.

The simulated fleet (``gpupipe_producer.simulated``) is fed through the chargeback window engine, the same
code ``gpupipe chargeback`` runs, so the example report, its screenshot in ``docs/`` and the browser
test show what a real run would. Deterministic: same arguments, same records.
"""

from __future__ import annotations

import zlib
from collections import Counter
from pathlib import Path
from typing import Any

from gpupipe.domain.prices import PriceTable, load_price_table
from gpupipe_consumers.chargeback.windows import WindowEngine
from gpupipe_producer.simulated.fleet import FleetConfig, SimulatedFleet
from gpupipe_schemas.meaning import gpu_key

EXAMPLE_PRICES = Path(__file__).resolve().parents[1] / "deploy" / "prices.example.yaml"
T0 = 1_795_000_000_000 - 1_795_000_000_000 % 86_400_000  # a UTC midnight in 2026

EXAMPLE_TEAMS: dict[str, Any] = {
    "teams": [
        {"namespace": "llm-training", "team": "foundation-models"},
        {"namespace": "ml-research", "team": "research"},
        {"namespace": "inference-*", "team": "serving"},
        {"namespace": "data-science", "team": "analytics"},
        {"namespace": "notebooks", "team": "analytics"},
        {"namespace": "vision", "team": "applied-ml"},
        {"namespace": "recsys", "team": "applied-ml"},
    ]
}
"""A namespace-to-team mapping for the simulated fleet's namespaces (``parse_team_map`` input)."""


def simulated_windows(
    hours: float,
    *,
    nodes: int = 4,
    gpus_per_node: int = 8,
    interval_ms: int = 60_000,
    start_ms: int = T0,
    seed: int = 11,
    prices: PriceTable | None = None,
) -> list[dict[str, Any]]:
    """ChargebackWindow records (1 h windows, every window flushed) for ``hours`` of the fleet."""
    fleet = SimulatedFleet(
        FleetConfig(nodes=nodes, gpus_per_node=gpus_per_node, seed=seed, interval_ms=interval_ms)
    )
    engine = WindowEngine(prices=prices if prices is not None else load_price_table(EXAMPLE_PRICES))
    offsets: Counter[int] = Counter()
    out: list[dict[str, Any]] = []
    for k in range(int(hours * 3_600_000 // interval_ms)):
        samples, _ = fleet.tick(start_ms + k * interval_ms)
        for s in samples:
            p = zlib.crc32(gpu_key(s).encode()) % 3  # spread as three input partitions would
            engine.add(s, p, offsets[p])
            offsets[p] += 1
        out += engine.poll_closed()
    return out + engine.flush_all()
