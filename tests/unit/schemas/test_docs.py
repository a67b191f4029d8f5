from gpupipe_schemas import catalog
from gpupipe_schemas.docs import render_markdown
from tests.paths import REPO

DOC = REPO / "docs" / "schemas.md"


def test_committed_schema_docs_are_current() -> None:
    assert DOC.read_text() == render_markdown(), "run: python -m gpupipe_schemas.docs > docs/schemas.md"


def test_every_record_type_has_a_section() -> None:
    text = render_markdown()
    for name in ("GpuSample", "XidEvent", "ChargebackWindow", "PodAllocation", "MigIdentity"):
        assert f"`{name}`" in text


def _rabin64(data: bytes) -> int:
    # CRC-64-AVRO written out from the Avro specification, independent of fastavro and of the catalog.
    empty = 0xC15D213AA4D7A795
    table = []
    for i in range(256):
        fp = i
        for _ in range(8):
            fp = (fp >> 1) ^ (empty & -(fp & 1))
        table.append(fp)
    fp = empty
    for b in data:
        fp = (fp >> 8) ^ table[(fp ^ b) & 0xFF]
    return fp


def test_fingerprints_are_printed_in_both_forms_with_the_value_java_prints() -> None:
    from fastavro.schema import to_parsing_canonical_form

    text = render_markdown()
    assert "wire bytes" in text and "parsingFingerprint64" in text
    for name in catalog.available_names():
        value = _rabin64(to_parsing_canonical_form(catalog.current(name).parsed).encode())
        java_long = value - (1 << 64) if value >= 1 << 63 else value  # Long.toString of the same bits
        wire = value.to_bytes(8, "little").hex()
        assert f"wire bytes `{wire}`; value `0x{value:016x}` (Java `long` `{java_long}`)" in text, name
