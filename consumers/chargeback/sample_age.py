"""How old a sample may be when it reaches Kafka and still be billed: closed periods stay closed.

Contract: :func:`too_old` gets a sample's ``timestamp_ms``, the time it reached Kafka (its record's
timestamp; the service passes its own clock only for a record without one) and the bound
(``--max-sample-age``); it returns None when the sample may be billed, else the one-line detail the
service dead-letters it with, under the reason :data:`TOO_OLD`. Pure: no Kafka, no clock.

Why: the shared contract (``gpupipe_schemas.validate``) accepts events dated up to 400 days back,
which the lake and the reports need for history. Billed, such a sample forms new windows on a
partition whose watermark is older, or empty, and changes a month invoiced long ago with nothing
marking it (any producer credential could bill any namespace). A node's samples reach Kafka late
only by what it buffers while the broker is away, so chargeback bills a sample only within
``--max-sample-age`` of its record's timestamp; older ones go to the dead-letter topic, counted in
``gpupipe_chargeback_dead_letters_total{reason="too-old"}``, never into a window or a correction.

Why the record's timestamp and not the service's clock: the same record gets the same answer in
every run, so a replay after a crash rebuilds exactly the windows the first run built (a clock
would turn an accepted sample into a dead letter once the replay runs late), and a chargeback that
catches up after its own outage still bills what reached Kafka in time. The samples topic is
created with LogAppendTime (broker time); on a CreateTime topic the bound trusts the producer's
record timestamp, as ``--max-clock-skew`` does.
"""

from __future__ import annotations

from gpupipe.common.durations import format_duration_ms

__all__ = ["DEFAULT_MAX_SAMPLE_AGE_MS", "TOO_OLD", "too_old"]

#: One day: more than a node buffers (its sample queue holds 10,000 samples, under 3 hours for one
#: GPU at the 1 s default interval, and librdkafka drops what it held over 5 min) and more than a
#: node clock a day behind; no longer than the FOCUS export's ``--invoice-lag`` (1d).
DEFAULT_MAX_SAMPLE_AGE_MS = 86_400_000

#: The dead-letter reason (header ``gpupipe.dlq.reason``, metric label).
TOO_OLD = "too-old"


def too_old(sample_ts_ms: int, arrived_ms: int, max_age_ms: int) -> str | None:
    """None when a sample stamped ``sample_ts_ms`` that reached Kafka at ``arrived_ms`` may be
    billed; else why not, in one line."""
    age = arrived_ms - sample_ts_ms
    if age <= max_age_ms:
        return None
    return (
        f"timestamp_ms: {sample_ts_ms}, {format_duration_ms(age - age % 1000)} before its Kafka "
        f"timestamp, more than --max-sample-age {format_duration_ms(max_age_ms)}: its period is "
        "closed to billing"
    )
