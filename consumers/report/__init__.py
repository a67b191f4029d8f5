"""Per-team chargeback reports from ChargebackWindow records (pure: building, mapping, formatting)."""
