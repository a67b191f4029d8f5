"""Price table parsing and lookup (gpupipe/domain/prices.py)."""

from __future__ import annotations

import pytest

from gpupipe.domain.prices import (
    DEFAULT,
    EXACT,
    PATTERN,
    PriceTableError,
    load_price_table,
    parse_price_table,
)
from tests.paths import REPO

REPO = REPO

TABLE = {
    "currency": "EUR",
    "energy_per_kwh": 0.2,
    "default_per_gpu_hour": 1.0,
    "models": [
        {"match": "NVIDIA H100*", "per_gpu_hour": 3.0},
        {"match": "NVIDIA H100 80GB HBM3", "per_gpu_hour": 3.5},  # exact wins even when listed later
        {"match": "NVIDIA A100*80GB*", "per_gpu_hour": 2.0},
        {"match": "NVIDIA A100*", "per_gpu_hour": 1.5},
    ],
}


@pytest.mark.parametrize(
    ("model", "price", "source"),
    [
        ("NVIDIA H100 80GB HBM3", 3.5, EXACT),
        ("nvidia h100 80gb hbm3", 3.5, EXACT),  # case-insensitive
        ("NVIDIA H100 NVL", 3.0, PATTERN),
        ("NVIDIA A100-SXM4-80GB", 2.0, PATTERN),  # first matching pattern in file order
        ("NVIDIA A100-SXM4-40GB", 1.5, PATTERN),
        ("NVIDIA A100-SXM4-40GB MIG 1g.5gb", 1.5, PATTERN),
        ("Acme X1", 1.0, DEFAULT),  # unknown model: default price, flagged
        ("", 1.0, DEFAULT),
    ],
)
def test_lookup(model, price, source):
    table = parse_price_table(TABLE)
    got = table.gpu_price(model)
    assert (got.per_gpu_hour, got.source) == (price, source)
    assert table.gpu_price(model) is got  # cached


def test_defaults_when_empty():
    table = parse_price_table({})
    assert (table.currency, table.energy_per_kwh, table.gpu_price("x").per_gpu_hour) == ("USD", 0.0, 0.0)


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        ([], "mapping"),
        ({"curency": "USD"}, "unknown keys"),
        ({"currency": "dollars"}, "ISO 4217"),
        ({"energy_per_kwh": -1}, "non-negative"),
        ({"default_per_gpu_hour": "3"}, "number"),
        ({"default_per_gpu_hour": True}, "number"),
        ({"models": {"a": 1}}, "list"),
        ({"models": [{"match": "x"}]}, "models[0]"),
        ({"models": [{"match": "x", "per_gpu_hour": 1, "extra": 2}]}, "models[0]"),
        ({"models": [{"match": " ", "per_gpu_hour": 1}]}, "non-empty"),
        ({"models": [{"match": "x", "per_gpu_hour": 1}, {"match": "X", "per_gpu_hour": 2}]}, "twice"),
        ({"models": [{"match": "x", "per_gpu_hour": float("nan")}]}, "non-negative"),
    ],
)
def test_invalid_tables_name_the_problem(data, fragment):
    with pytest.raises(PriceTableError, match=None) as exc:
        parse_price_table(data, "prices.yaml")
    assert fragment in str(exc.value)
    assert "prices.yaml" in str(exc.value)


def test_example_file_loads():
    table = load_price_table(REPO / "deploy" / "prices.example.yaml")
    assert table.currency == "USD"
    assert table.gpu_price("NVIDIA H200").source == EXACT
    assert table.gpu_price("NVIDIA H100 PCIe").source == PATTERN
    assert table.gpu_price("Tesla T4").source == DEFAULT


def test_missing_and_invalid_files(tmp_path):
    with pytest.raises(PriceTableError, match="cannot read"):
        load_price_table(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("currency: [unclosed\n")
    with pytest.raises(PriceTableError, match="not valid YAML"):
        load_price_table(bad)
