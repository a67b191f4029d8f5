"""Avro framing for every gpupipe topic.

Three framings, chosen per topic by the writer, all accepted by every decoder:

* **Single-object encoding** (default): ``C3 01`` + 8-byte CRC-64-AVRO fingerprint
  (little-endian) + Avro binary. Self-describing with no extra server: a reader
  maps the fingerprint to the writer schema among the current and released ones.
* **Confluent wire format** (with ``--schema-registry-url``): ``00`` + 4-byte
  big-endian schema id + Avro binary, schemas registered/fetched through
  ``confluent_kafka.schema_registry``.
* **Raw** (headed): the value is the Avro binary alone, what stock SQL engines decode
  without a registry; the Kafka record header ``gpupipe.schema`` names the writer
  schema as ``<record name>@<fingerprint hex, wire order>``. The header wins over
  the value's first bytes (a raw body may start with anything).

Decoding always resolves the writer schema against the reader's (current) schema,
so records written by an older or newer producer read fine as long as the
schemas stay compatible (which ``tests/unit/schemas/test_compat.py`` enforces).
"""

from __future__ import annotations

import io
import json
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar, cast, overload

from fastavro import schemaless_reader, schemaless_writer

from gpupipe_schemas import catalog
from gpupipe_schemas.catalog import SchemaVersion
from gpupipe_schemas.errors import DecodeError, EncodeError
from gpupipe_schemas.records import (
    ChargebackWindow,
    GpuAlert,
    GpuRecommendation,
    GpuSample,
    GpuTopology,
    XidEvent,
)

SINGLE_OBJECT_MAGIC = b"\xc3\x01"
#: The Kafka record header that names the writer schema of a raw-framed value.
SCHEMA_HEADER = "gpupipe.schema"
SINGLE_OBJECT, CONFLUENT, RAW = "single-object", "confluent", "raw"
FRAMINGS = (SINGLE_OBJECT, CONFLUENT, RAW)
Headers = Sequence[tuple[str, bytes | None]] | None  # a Kafka record's headers, as confluent_kafka gives them
CONFLUENT_MAGIC = 0
_CONFLUENT_HEADER = struct.Struct(">bI")


@dataclass(frozen=True, slots=True)
class Decoded:
    """A decoded record with the name of its schema (a topic may carry several)."""

    name: str
    record: dict[str, Any]
    framing: str  # one of FRAMINGS


#: The record type an encoder takes: one of :mod:`gpupipe_schemas.records`' TypedDicts.
R = TypeVar("R", bound=Mapping[str, Any])


class Encoder(Generic[R]):
    """Encodes plain dicts of one record type. Built once at startup (bad schema fails early)."""

    __slots__ = ("_header", "_parsed", "framing", "headers", "name")

    def __init__(
        self,
        name: str,
        framing: str,
        header: bytes,
        parsed: dict[str, Any],
        headers: list[tuple[str, bytes]] | None = None,
    ) -> None:
        self.name = name
        self.framing = framing  # one of FRAMINGS
        self._header = header
        self._parsed = parsed
        #: Kafka record headers every value of this encoder must carry (raw framing), else None.
        self.headers = headers

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
    ``framings`` (topic -> framing) is what :meth:`encoder` writes to a topic when not told.
    """

    def __init__(
        self,
        registry: Any | None = None,
        reader_schemas: Mapping[str, Mapping[str, Any]] | None = None,
        framings: Mapping[str, str] | None = None,
    ) -> None:
        self._registry = registry
        self._framings = dict(framings or {})  # topic -> framing its encoders write
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
    def encoder(
        self, name: Literal["GpuSample"], topic: str | None = None, framing: str | None = None
    ) -> Encoder[GpuSample]: ...
    @overload
    def encoder(
        self, name: Literal["XidEvent"], topic: str | None = None, framing: str | None = None
    ) -> Encoder[XidEvent]: ...
    @overload
    def encoder(
        self, name: Literal["ChargebackWindow"], topic: str | None = None, framing: str | None = None
    ) -> Encoder[ChargebackWindow]: ...
    @overload
    def encoder(
        self, name: Literal["GpuAlert"], topic: str | None = None, framing: str | None = None
    ) -> Encoder[GpuAlert]: ...
    @overload
    def encoder(
        self, name: Literal["GpuRecommendation"], topic: str | None = None, framing: str | None = None
    ) -> Encoder[GpuRecommendation]: ...
    @overload
    def encoder(
        self, name: Literal["GpuTopology"], topic: str | None = None, framing: str | None = None
    ) -> Encoder[GpuTopology]: ...
    def encoder(self, name: str, topic: str | None = None, framing: str | None = None) -> Encoder[Any]:
        """The encoder of record type ``name``, typed by its TypedDict; ``framing`` None: Confluent
        with a registry, single-object without."""
        sv = catalog.current(name)
        if framing is None:
            default = SINGLE_OBJECT if self._registry is None else CONFLUENT
            framing = self._framings.get(topic or "", default)
        if framing == SINGLE_OBJECT:
            return Encoder(name, SINGLE_OBJECT, SINGLE_OBJECT_MAGIC + sv.fingerprint, sv.parsed)
        if framing == RAW:
            return Encoder(name, RAW, b"", sv.parsed, [(SCHEMA_HEADER, schema_header_value(sv))])
        if framing != CONFLUENT:
            raise ValueError(f"unknown framing {framing!r}")
        if self._registry is None:
            from gpupipe.common.errors import ConfigError

            raise ConfigError(f"the confluent framing of {topic or name} needs --schema-registry-url")
        schema_id = self._register(self._registry, sv, topic or name)
        return Encoder(name, CONFLUENT, _CONFLUENT_HEADER.pack(CONFLUENT_MAGIC, schema_id), sv.parsed)

    @staticmethod
    def _register(registry: Any, sv: SchemaVersion, topic: str) -> int:
        from confluent_kafka.schema_registry import Schema

        try:
            return int(registry.register_schema(f"{topic}-value", Schema(sv.text, "AVRO")))
        except Exception as exc:
            from gpupipe.common.errors import ConfigError

            raise ConfigError(f"cannot register schema {sv.name} for {topic}: {exc}") from exc

    # -- decoding ---------------------------------------------------------------
    def decode(self, payload: bytes | None, headers: Headers = None) -> Decoded:
        """``headers``: the record's Kafka headers; only a raw-framed value needs them."""
        named = schema_header(headers) if headers else None
        rd: _Reader | None
        if named is not None:
            rd = self._headed_reader(named)
            body, framing = 0, RAW
            if payload is None:
                raise DecodeError("empty-payload")
        elif not payload:
            raise DecodeError("empty-payload")
        elif payload[:2] == SINGLE_OBJECT_MAGIC:
            rd = self._readers.get(payload[2:10])
            if rd is None:
                raise DecodeError("unknown-schema-fingerprint", payload[2:10].hex())
            body, framing = 10, SINGLE_OBJECT
        elif payload[0] == CONFLUENT_MAGIC and len(payload) >= 5:
            schema_id = _CONFLUENT_HEADER.unpack_from(payload)[1]
            rd = self._confluent_reader(schema_id)
            body, framing = 5, CONFLUENT
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

    def _headed_reader(self, named: bytes) -> _Reader:
        name, _, fp_hex = named.decode("ascii", "replace").rpartition("@")
        try:
            fp = bytes.fromhex(fp_hex)
        except ValueError:
            fp = b""
        rd = self._readers.get(fp) if len(fp) == 8 else None
        if rd is None:
            raise DecodeError("unknown-schema-fingerprint", f"{SCHEMA_HEADER}: {named[:60]!r}")
        if name != rd.name:
            raise DecodeError("schema-header-mismatch", f"{name!r} names fingerprint of {rd.name}")
        return rd

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


def schema_header_value(sv: SchemaVersion) -> bytes:
    """``<name>@<fingerprint hex in wire order>``: what the raw framing's header carries."""
    return f"{sv.name}@{sv.fingerprint.hex()}".encode("ascii")


def schema_header(headers: Headers) -> bytes | None:
    """The value of the ``gpupipe.schema`` header among a record's Kafka headers, else None."""
    for key, value in headers or ():
        if key == SCHEMA_HEADER:
            return value or b""
    return None


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
