from gpupipe_schemas.docs import render_markdown
from tests.paths import REPO

DOC = REPO / "docs" / "schemas.md"


def test_committed_schema_docs_are_current() -> None:
    assert DOC.read_text() == render_markdown(), "run: python -m gpupipe_schemas.docs > docs/schemas.md"


def test_every_record_type_has_a_section() -> None:
    text = render_markdown()
    for name in ("GpuSample", "XidEvent", "ChargebackWindow", "PodAllocation", "MigIdentity"):
        assert f"`{name}`" in text
