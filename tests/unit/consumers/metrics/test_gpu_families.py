"""The incremental family join gives the bytes of a join from scratch, whatever changed (pure).

:class:`BodyJoiner` keeps the last build's pieces and re-copies only the GPUs whose line list was
replaced; these tests hold it to a stateless reference (every family joined from its columns, as
the joiner did before it kept state) across random ingest, XIDs, expiry, dropped partitions and
MIG changes, and check that an unchanged family keeps its chunk object.
"""

from __future__ import annotations

import random

import pytest

from gpupipe_consumers.metrics.collectors_csv import all_counters, default_counters
from gpupipe_consumers.metrics.gpu_families import BodyJoiner
from gpupipe_consumers.metrics.render import Family, RenderOptions
from gpupipe_consumers.metrics.store import SeriesStore
from tests.unit.consumers.metrics.test_store import T_MS, alloc, blank, xid


def reference(families: tuple[Family, ...], lines: list[list[bytes]]) -> tuple[bytes, ...]:
    """The join from scratch: per family its header, then head and value of every GPU in turn."""
    if not lines:
        return ()
    cols = list(zip(*lines, strict=True))
    out = []
    for fam in families:
        heads, values = cols[2 * fam.index], cols[2 * fam.index + 1]
        if not any(values):
            continue
        out.append(fam.header.encode() + b"".join(h + v for h, v in zip(heads, values, strict=True)))
    return tuple(out)


def store_lines(store: SeriesStore) -> list[list[bytes]]:
    return [g.lines for g in store._gpus.values() if g.lines]


# -- the joiner alone, on synthetic line lists -----------------------------------------------------
FAMS = tuple(Family(i, f"F{i}", "gauge", "x", None) for i in range(6))


def synthetic(rng: random.Random, gpu: int, gen: int) -> list[bytes]:
    out: list[bytes] = []
    for f in range(len(FAMS)):
        if f == 5 or rng.random() < 0.1:  # family 5 never has a line; others now and then
            out += [b"", b""]
        else:
            out += [f'F{f}{{gpu="{gpu}"}} '.encode(), f"{rng.randrange(3) + gen}\n".encode()]
    return out


def test_random_changes_match_the_join_from_scratch() -> None:
    rng = random.Random(7)
    joiner = BodyJoiner(FAMS)
    gpus = list(range(20))
    lines = {g: synthetic(rng, g, 0) for g in gpus}
    for step in range(400):
        op = rng.random()
        if op < 0.5:  # some GPUs get a new line list, some of its pieces the very objects as before
            for g in rng.sample(gpus, rng.randrange(1, 4)):
                new = lines[g].copy()
                f = rng.randrange(len(FAMS) - 1)
                new[2 * f + 1] = f"{step}\n".encode() if rng.random() < 0.8 else b""
                lines[g] = new
        elif op < 0.6:  # a new line list with every piece the same object: nothing changes
            g = rng.choice(gpus)
            lines[g] = lines[g].copy()
        elif op < 0.7 and len(gpus) > 1:  # a GPU goes
            gpus.remove(rng.choice(gpus))
        elif op < 0.8:  # a GPU comes
            g = max(gpus, default=0) + 1
            gpus.append(g)
            lines[g] = synthetic(rng, g, step)
        elif op < 0.9 and len(gpus) > 1:  # same count, another order
            rng.shuffle(gpus)
        snapshot = [lines[g] for g in gpus]
        got = joiner.join(snapshot)
        assert got == reference(FAMS, snapshot), step
    assert joiner.reused > 0


def test_an_unchanged_family_keeps_its_chunk_object() -> None:
    rng = random.Random(1)
    joiner = BodyJoiner(FAMS)
    lines = [synthetic(rng, g, 0) for g in range(5)]
    lines[2][1] = b"1\n"  # family 0 has a value
    first = joiner.join(lines)
    new = lines[3].copy()
    new[3] = b"changed\n"  # family 1 of one GPU
    lines = [*lines[:3], new, *lines[4:]]
    second = joiner.join(lines)
    assert second == reference(FAMS, lines)
    by_name = {c.split(b"\n", 1)[0]: c for c in first}
    for c in second:
        name = c.split(b"\n", 1)[0]
        assert (c is by_name[name]) == (name != b"# HELP F1 x"), name


def test_a_line_list_of_another_length_fails_and_the_next_build_is_whole() -> None:
    rng = random.Random(2)
    joiner = BodyJoiner(FAMS)
    lines = [synthetic(rng, g, 0) for g in range(4)]
    joiner.join(lines)
    bad = [*lines[:3], lines[3][:-2]]
    with pytest.raises(ValueError):
        joiner.join(bad)
    lines[1] = synthetic(rng, 1, 5)
    assert joiner.join(lines) == reference(FAMS, lines)
    assert joiner.join([]) == ()


# -- through the store -----------------------------------------------------------------------------
MIG_PARENTS = ("GPU-M0", "GPU-M1")


def mig_slice(parent: str, n: int, **kw) -> dict:
    mig = {
        "mig_uuid": f"MIG-{parent}-{n}",
        "gpu_instance_id": n,
        "compute_instance_id": 0,
        "profile": "1g.18gb",
        "slice_fraction": 1 / 7,
    }
    return blank(parent, mig=mig, **kw)


@pytest.mark.parametrize(
    ("counters", "layout"),
    [(default_counters, "instances"), (all_counters, "instances"), (all_counters, "gpu+instances")],
)
def test_store_scrapes_match_the_join_from_scratch(counters, layout) -> None:
    rng = random.Random(f"{counters.__name__}-{layout}")
    store = SeriesStore(counters(), options=RenderOptions(mig_layout=layout), stale_after_s=5.0)
    now = T_MS / 1000
    ts = T_MS
    known: list[str] = []
    reused = 0
    for step in range(150):
        ts += 1000
        for _ in range(rng.randrange(0, 4)):
            op = rng.random()
            if op < 0.45 and known:  # a new sample of a known GPU, sometimes with pods
                g = rng.choice(known)
                pods = [alloc("ns", f"p{rng.randrange(3)}")] if rng.random() < 0.2 else []
                store.apply_sample(
                    blank(g, timestamp_ms=ts, gpu_temp_c=float(rng.randrange(40, 43)), allocations=pods),
                    rng.randrange(3),
                    now,
                )
            elif op < 0.6:  # a new GPU
                g = f"GPU-{step}-{rng.randrange(1000)}"
                known.append(g)
                store.apply_sample(blank(g, timestamp_ms=ts), rng.randrange(3), now)
            elif op < 0.7:  # a MIG parent and its slices
                p = rng.choice(MIG_PARENTS)
                store.apply_sample(blank(p, timestamp_ms=ts, mig_enabled=True, power_w=300.0), 0, now)
                for n in rng.sample(range(1, 4), rng.randrange(1, 3)):
                    store.apply_sample(mig_slice(p, n, timestamp_ms=ts), 0, now)
            elif op < 0.8 and known:  # an XID, on a GPU or on a slice
                uuid = rng.choice(known + list(MIG_PARENTS))
                mig = f"MIG-{uuid}-1" if uuid in MIG_PARENTS and rng.random() < 0.5 else None
                store.apply_xid(xid(rng.choice((13, 48, 79)), uuid, ts=ts, mig_uuid=mig), 1, now)
            elif op < 0.85:  # partitions revoked
                store.drop_partitions([rng.randrange(3)])
            elif op < 0.9:  # nothing arrives for a while: GPUs expire
                now += rng.choice((1.0, 4.0, 8.0))
        now += 1.0
        parts = store.render_parts(now)
        assert tuple(parts[:-1]) == reference(store.families, store_lines(store)), step
        reused = store._joiner.reused
    assert reused > 0


def test_equal_text_in_new_objects_keeps_every_chunk() -> None:
    rng = random.Random(3)
    joiner = BodyJoiner(FAMS)
    lines = [synthetic(rng, g, 0) for g in range(5)]
    first = joiner.join(lines)
    copies = [[bytes(bytearray(x)) for x in line] for line in lines]  # same text, other objects
    second = joiner.join(copies)
    assert second == first and all(a is b for a, b in zip(first, second, strict=True))
