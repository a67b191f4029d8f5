"""The code generated from the schemas (gpupipe_schemas.codegen): current, and what it emits."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest

from gpupipe_schemas import catalog, records
from gpupipe_schemas.codegen import EMITTERS, groups, run, typed
from gpupipe_schemas.codegen.__main__ import main


def test_generated_files_are_current() -> None:
    assert run.stale() == [], f"regenerate with {run.REGENERATE}"


def test_check_exits_0_when_current(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--check"]) == 0
    assert capsys.readouterr().err == ""


def test_stale_names_each_missing_or_changed_file(tmp_path: Path) -> None:
    files = run.render()
    assert set(run.stale(tmp_path)) == set(files)
    for path, text in files.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    assert run.stale(tmp_path) == []
    (tmp_path / typed.PATH).write_text(files[typed.PATH].replace("TypedDict", "dict", 1))
    assert run.stale(tmp_path) == [typed.PATH]


def test_every_emitter_returns_repo_relative_texts() -> None:
    schemas = run.load_schemas()
    assert [s["name"] for s in schemas] == sorted(catalog.available_names())
    for emitter in EMITTERS:
        out = emitter.outputs(schemas)
        assert out, emitter.__name__
        for path, text in out.items():
            assert not Path(path).is_absolute() and ".." not in Path(path).parts, path
            assert text.endswith("\n"), path


_SCHEMA = {
    "type": "record",
    "name": "Thing",
    "namespace": "t.v1",
    "fields": [
        {"name": "id", "type": {"type": "long", "logicalType": "timestamp-millis"}},
        {"name": "note", "type": ["null", "string"], "default": None, "gpupipe.bound": "finite"},
        {"name": "state", "type": {"type": "enum", "name": "State", "symbols": ["a", "b"]}},
        {"name": "again", "type": "State", "gpupipe.bound": ["finite", "ratio"]},
        {"name": "tags", "type": {"type": "map", "values": "string"}, "default": {}},
        {
            "name": "parts",
            "type": {
                "type": "array",
                "items": {"type": "record", "name": "Part", "fields": [{"name": "x", "type": "double"}]},
            },
        },
    ],
}
_OTHER = {
    "type": "record",
    "name": "Other",
    "fields": [{"name": "state", "type": {"type": "enum", "name": "State", "symbols": ["c"]}}],
}


def test_typed_maps_avro_types_and_groups() -> None:
    text = typed.outputs([_SCHEMA, _OTHER])[typed.PATH]
    assert 'State: TypeAlias = Literal["a", "b"]' in text
    assert 'OtherState: TypeAlias = Literal["c"]' in text  # same name, another definition
    assert "class Part(TypedDict):\n" in text and "    x: float\n" in text
    assert text.index("class Part(") < text.index("class Thing(")  # a type before its users
    for line in (
        "    id: int\n",
        "    note: NotRequired[str | None]\n",
        "    state: State\n",
        "    again: State\n",
        "    tags: NotRequired[dict[str, str]]\n",
        "    parts: list[Part]\n",
    ):
        assert line in text
    assert "AnyRecord: TypeAlias = Thing | Other\n" in text
    assert 'THING_BOUND_FINITE: tuple[str, ...] = ("note", "again")\n' in text
    assert 'THING_BOUND_RATIO: tuple[str, ...] = ("again",)\n' in text
    namespace: dict[str, object] = {}
    exec(compile(text, typed.PATH, "exec", dont_inherit=True), namespace)
    part = namespace["Part"]
    assert typing.get_type_hints(namespace["Thing"])["parts"] == list[part]  # type: ignore[valid-type]


def test_unknown_gpupipe_attribute_is_refused() -> None:
    bad = {**_SCHEMA, "fields": [{"name": "a", "type": "int", "gpupipe.colour": "red"}]}
    with pytest.raises(ValueError, match=r"Thing\.a: unknown attribute 'gpupipe.colour'"):
        typed.outputs([bad])


def test_generated_records_match_the_schemas() -> None:
    for name in catalog.available_names():
        td = getattr(records, name)
        fields = catalog.current(name).raw["fields"]
        assert list(td.__annotations__) == [f["name"] for f in fields], name
        assert td.__required_keys__ == {f["name"] for f in fields if "default" not in f}, name
    assert records.GPU_SAMPLE_BOUND_POWER == ("power_w", "module_power_w")


def test_group_names() -> None:
    assert groups.group_name("GpuSample", "gpupipe.bound", "non_negative") == "GPU_SAMPLE_BOUND_NON_NEGATIVE"
