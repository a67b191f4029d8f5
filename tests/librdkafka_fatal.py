"""Make a real librdkafka producer fail fatally, as the idempotent producer does on a sequence gap
it cannot mend: librdkafka's own test hook ``rd_kafka_test_fatal_error()`` (rdkafka.h: "for use
in tests only"), called through ctypes on the library confluent-kafka loaded. Together with
librdkafka's mock cluster (``test.mock.num.brokers``) no broker is needed.

The ``rd_kafka_t *`` comes from confluent-kafka's ``Handle`` object: ``PyObject_HEAD`` followed
by ``rd_kafka_t *rk`` (confluent_kafka/src/confluent_kafka.h). It is checked with
``rd_kafka_type()`` and ``rd_kafka_name()`` before use, so a different layout fails the test
clearly instead of corrupting memory.
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path
from typing import Any

import confluent_kafka

RD_KAFKA_PRODUCER = 0


def _librdkafka() -> ctypes.CDLL:
    libs = Path(confluent_kafka.__file__).resolve().parent.parent / "confluent_kafka.libs"
    found = sorted(libs.glob("librdkafka-*.so*"))
    if not found:
        raise AssertionError(f"librdkafka of confluent-kafka not found in {libs}")
    lib = ctypes.CDLL(str(found[0]))  # the library already loaded: dlopen hands the same one
    lib.rd_kafka_test_fatal_error.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_char_p]
    lib.rd_kafka_test_fatal_error.restype = ctypes.c_int
    lib.rd_kafka_type.argtypes = [ctypes.c_void_p]
    lib.rd_kafka_type.restype = ctypes.c_int
    lib.rd_kafka_name.argtypes = [ctypes.c_void_p]
    lib.rd_kafka_name.restype = ctypes.c_char_p
    return lib


def inject_fatal_error(producer: Any, code: int, reason: str) -> None:
    """Raise fatal error ``code`` in ``producer`` (a ``confluent_kafka.Producer``)."""
    lib = _librdkafka()
    header = sys.getsizeof(object())  # PyObject_HEAD: refcount and type pointer
    rk = ctypes.c_void_p.from_address(id(producer) + header).value
    name = lib.rd_kafka_name(rk) if rk else b""
    if not rk or lib.rd_kafka_type(rk) != RD_KAFKA_PRODUCER or not name.startswith(b"rdkafka#producer-"):
        raise AssertionError(f"not a librdkafka producer handle at {rk!r} ({name!r})")
    rc = lib.rd_kafka_test_fatal_error(rk, code, reason.encode())
    if rc != 0:
        raise AssertionError(f"rd_kafka_test_fatal_error failed: {rc}")
