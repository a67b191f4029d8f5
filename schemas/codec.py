"""Avro framing for every gpupipe topic.

Two framings, chosen by the producer, both accepted by every decoder:

* **Single-object encoding** (default): ``C3 01`` + 8-byte CRC-64-AVRO fingerprint
  (little-endian) + Avro binary. Self-describing with no extra server: a reader
  maps the fingerprint to the writer schema among the current and released ones.
* **Confluent wire format** (with ``--schema-registry-url``): ``00`` + 4-byte
  big-endian schema id + Avro binary, schemas registered/fetched through
  ``confluent_kafka.schema_registry``.

Decoding always resolves the writer schema against the reader's (current) schema,
so records written by an older or newer producer read fine as long as the
schemas stay compatible (which ``tests/unit/schemas/test_compat.py`` enforces).
"""

from __future__ import annotations

import io
import json
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar, cast, overload

from fastavro import schemaless_reader, schemaless_writer

from gpupipe_schemas import catalog
from gpupipe_schemas.catalog import SchemaVersion
from gpupipe_schemas.errors import DecodeError, EncodeError
from gpupipe_schemas.records import ChargebackWindow, GpuAlert, GpuRecommendation, GpuSample, XidEvent

SINGLE_OBJECT_MAGIC = b"\xc3\x01"
CONFLUENT_MAGIC = 0
_CONFLUENT_HEADER = struct.Struct(">bI")


@dataclass(frozen=True, slots=True)
class Decoded:
    """A decoded record with the name of its schema (a topic may carry several)."""

    name: str
    record: dict[str, Any]
    framing: str  # "single-object" | "confluent"


#: The record type an encoder takes: one of :mod:`gpupipe_schemas.records`' TypedDicts.
R = TypeVar("R", bound=Mapping[str, Any])


class Encoder(Generic[R]):
    """Encodes plain dicts of one record type. Built once at startup (bad schema fails early)."""

    __slots__ = ("_header", "_parsed", "name")

    def __init__(self, name: str, header: bytes, parsed: dict[str, Any]) -> None:
        self.name = name
        self._header = header
        self._parsed = parsed

    def encode(self, record: R) -> bytes:
        buf = io.BytesIO()
        buf.write(self._header)
        try:
            schemaless_writer(buf, self._parsed, record)
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise EncodeError(f"{self.name} record does not match its schema: {exc}") from exc
        return buf.getvalue()


class _Reader:
    __slots__ = ("name", "reader", "writer")

    def __init__(self, name: str, writer: dict[str, Any], reader: dict[str, Any] | None) -> None:
        self.name = name
        self.writer = writer
        self.reader = reader  # None: writer is the reader (fast path)


class AvroCodec:
    """Encoders and a decoder for all our record types.

    ``reader_schemas`` lets a consumer read only the fields it needs (projection):
    fastavro skips the rest, which is what makes chargeback decoding cheap.
    """

    def __init__(
        self,
        registry: Any | None = None,
        reader_schemas: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        self._registry = registry
        self._readers: dict[bytes, _Reader] = {}
        self._confluent_readers: dict[int, _Reader] = {}
        self._reader_for_name: dict[str, dict[str, Any]] = {}
        overrides = dict(reader_schemas or {})
        for name in catalog.available_names():
            cur = catalog.current(name)
            self._reader_for_name[name] = (
                catalog.parsed_schema(overrides[name]) if name in overrides else cur.parsed
            )
        for sv in (*(catalog.current(n) for n in catalog.available_names()), *catalog.released()):
            if sv.name in self._reader_for_name:
                self._readers.setdefault(sv.fingerprint, self._make_reader(sv.name, sv.parsed))

    def _make_reader(self, name: str, writer: dict[str, Any]) -> _Reader:
        reader = self._reader_for_name[name]
        return _Reader(name, writer, None if reader is writer else reader)

    # -- encoding ---------------------------------------------------------------
    @overload
    def encoder(self, name: Literal["GpuSample"], topic: str | None = None) -> Encoder[GpuSample]: ...
    @overload
    def encoder(self, name: Literal["XidEvent"], topic: str | None = None) -> Encoder[XidEvent]: ...
    @overload
    def encoder(
        self, name: Literal["ChargebackWindow"], topic: str | None = None
    ) -> Encoder[ChargebackWindow]: ...
    @overload
    def encoder(self, name: Literal["GpuAlert"], topic: str | None = None) -> Encoder[GpuAlert]: ...
    @overload
    def encoder(
        self, name: Literal["GpuRecommendation"], topic: str | None = None
    ) -> Encoder[GpuRecommendation]: ...
    def encoder(self, name: str, topic: str | None = None) -> Encoder[Any]:
        """The encoder of record type ``name``, typed by its TypedDict."""
        sv = catalog.current(name)
        if self._registry is None:
            return Encoder(name, SINGLE_OBJECT_MAGIC + sv.fingerprint, sv.parsed)
        schema_id = self._register(self._registry, sv, topic or name)
        return Encoder(name, _CONFLUENT_HEADER.pack(CONFLUENT_MAGIC, schema_id), sv.parsed)

    @staticmethod
    def _register(registry: Any, sv: SchemaVersion, topic: str) -> int:
        from confluent_kafka.schema_registry import Schema

        try:
            return int(registry.register_schema(f"{topic}-value", Schema(sv.text, "AVRO")))
        except Exception as exc:
            from gpupipe.errors import ConfigError

            raise ConfigError(f"cannot register schema {sv.name} for {topic}: {exc}") from exc

    # -- decoding ---------------------------------------------------------------
    def decode(self, payload: bytes | None) -> Decoded:
        if not payload:
            raise DecodeError("empty-payload")
        if payload[:2] == SINGLE_OBJECT_MAGIC:
            rd = self._readers.get(payload[2:10])
            if rd is None:
                raise DecodeError("unknown-schema-fingerprint", payload[2:10].hex())
            body, framing = 10, "single-object"
        elif payload[0] == CONFLUENT_MAGIC and len(payload) >= 5:
            schema_id = _CONFLUENT_HEADER.unpack_from(payload)[1]
            rd = self._confluent_reader(schema_id)
            body, framing = 5, "confluent"
        else:
            raise DecodeError("not-gpupipe-avro", f"first bytes {payload[:4].hex()}")
        stream = io.BytesIO(payload[body:])
        try:
            rec = schemaless_reader(stream, rd.writer, rd.reader)
        except Exception as exc:  # truncated or corrupt body: fastavro raises many types
            raise DecodeError("corrupt-avro-body", f"{rd.name}: {type(exc).__name__}: {exc}") from exc
        left = len(payload) - body - stream.tell()
        if left:  # a body is exactly one record: bytes after it mean a writer other than ours
            raise DecodeError("trailing-bytes", f"{rd.name}: {left} bytes after the record")
        return Decoded(rd.name, cast(dict[str, Any], rec), framing)  # a record schema: a dict

    def _confluent_reader(self, schema_id: int) -> _Reader:
        rd = self._confluent_readers.get(schema_id)
        if rd is not None:
            return rd
        if self._registry is None:
            raise DecodeError("confluent-framing-without-registry", f"schema id {schema_id}")
        try:
            schema = self._registry.get_schema(schema_id)
            raw = json.loads(schema.schema_str)
        except Exception as exc:
            raise DecodeError("schema-registry-lookup-failed", f"id {schema_id}: {exc}") from exc
        name = raw.get("name", "") if isinstance(raw, dict) else ""
        if name not in self._reader_for_name:
            raise DecodeError("unknown-record-type", f"schema id {schema_id} is {name!r}")
        rd = self._make_reader(name, catalog.parsed_schema(raw))
        self._confluent_readers[schema_id] = rd
        return rd


def make_registry_client(url: str | None) -> Any | None:
    """A Schema Registry client for ``url`` (``mock://...`` gives an in-process one for tests)."""
    if not url:
        return None
    from confluent_kafka.schema_registry import SchemaRegistryClient

    return (
        SchemaRegistryClient.new_client({"url": url})
        if url.startswith("mock://")
        else (SchemaRegistryClient({"url": url}))
    )


def codec_from_url(url: str | None, **kwargs: Any) -> AvroCodec:
    return AvroCodec(make_registry_client(url), **kwargs)


EncodeFn = Callable[[Mapping[str, Any]], bytes]
