"""Print the records of a gpupipe topic as JSON lines (like kafka-avro-console-consumer).

For people and for data-platform jobs that want JSON: reads any of our topics,
either framing, and says on stderr, per record, when bytes are not our Avro
(then goes on). Reads without a consumer group commit, so it never moves
anyone's offsets.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from typing import Any, TextIO

from confluent_kafka import OFFSET_BEGINNING, OFFSET_END, Consumer, KafkaError, TopicPartition

from gpupipe.common.argtypes import positive_duration_ms
from gpupipe.common.errors import ConfigError
from gpupipe.kafka import topics
from gpupipe.kafka.admin import client_config, parse_kafka_overrides, wait_for_broker
from gpupipe_schemas.codec import AvroCodec, codec_from_url
from gpupipe_schemas.errors import DecodeError

#: One line for `gpupipe --help`.
HELP = "print records of a gpupipe topic as JSON lines"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "topic", help="topic name, e.g. gpu.samples.v1 (the --topic-prefix is added to known names)"
    )
    p.add_argument("--from-beginning", action="store_true", help="start at the oldest retained record")
    p.add_argument("--max", type=int, default=None, metavar="N", help="stop after N records")
    p.add_argument(
        "--idle-timeout",
        type=positive_duration_ms,
        default=None,
        metavar="DURATION",
        help="stop when no record arrived for this long",
    )
    p.add_argument(
        "--with-meta", action="store_true", help="wrap each record with topic/partition/offset/key"
    )


def resolve_topic(prefix: str, topic: str) -> str:
    return topics.with_prefix(prefix, topic) if topic in topics.ALL else topic


def format_record(codec: AvroCodec, msg: Any, with_meta: bool) -> tuple[str | None, str | None]:
    """(json line, None) for a decodable record, (None, error line) otherwise."""
    try:
        decoded = codec.decode(msg.value(), msg.headers())
    except DecodeError as exc:
        return None, (
            f"gpupipe tail: {msg.topic()}[{msg.partition()}]@{msg.offset()}: not a gpupipe Avro record "
            f"({exc.reason}{': ' + exc.detail if exc.detail else ''})"
        )
    if not with_meta:
        return json.dumps(decoded.record, separators=(",", ":")), None
    key = msg.key()
    return json.dumps(
        {
            "topic": msg.topic(),
            "partition": msg.partition(),
            "offset": msg.offset(),
            "key": key.decode("utf-8", "replace") if key else None,
            "schema": decoded.name,
            "value": decoded.record,
        },
        separators=(",", ":"),
    ), None


def run(args: argparse.Namespace, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    if args.max is not None and args.max < 1:
        raise ConfigError("--max must be at least 1")
    extra = parse_kafka_overrides(args.kafka_config)
    wait_for_broker(args.bootstrap_servers, extra=extra)
    topic = resolve_topic(args.topic_prefix, args.topic)
    codec = codec_from_url(args.schema_registry_url)
    consumer = Consumer(
        client_config(
            args.bootstrap_servers,
            extra,
            **{
                "group.id": f"gpupipe-tail-{uuid.uuid4()}",
                "enable.auto.commit": False,
                "isolation.level": "read_committed",
            },
        )
    )
    try:
        md = consumer.list_topics(topic, timeout=10)
        tmd = md.topics.get(topic)
        if tmd is None or tmd.error is not None:
            raise ConfigError(f"topic {topic} does not exist")
        start = OFFSET_BEGINNING if args.from_beginning else OFFSET_END
        consumer.assign([TopicPartition(topic, p, start) for p in sorted(tmd.partitions)])
        shown = 0
        last = time.monotonic()
        while args.max is None or shown < args.max:
            msgs = consumer.consume(num_messages=500, timeout=0.5)
            if not msgs:
                if args.idle_timeout is not None and time.monotonic() - last > args.idle_timeout / 1000:
                    break
                continue
            last = time.monotonic()
            for msg in msgs:
                if msg.error():
                    if msg.error().code() != KafkaError._PARTITION_EOF:
                        print(f"gpupipe tail: {msg.error().str()}", file=err)
                    continue
                line, problem = format_record(codec, msg, args.with_meta)
                if problem:
                    print(problem, file=err)
                    continue
                out.write(line + "\n")
                shown += 1
                if args.max is not None and shown >= args.max:
                    break
            out.flush()
    except KeyboardInterrupt:
        pass
    finally:
        consumer.close()
    return 0
