"""Xid 144-150 decoded as NVIDIA's "XID 144-150 Decode" sheet says.

Messages are built in the driver's format (WORKFLOW_NVLINK5_ERR [CAT]: ``<unit> <Fatal|Nonfatal>
XC<n> i<n> Link <n> (<intrInfo> <errorStatus> <debug data> x4)``, as the real lines in
``tests/fixtures/kmsg/xid_real.txt``), parsed by the producer's kernel-log parser, and classified. The
table test walks every row of the sheet in both message layouts (V1 before R575, V2 from R575), with the
don't-care bits clear and set, the "Action 2" decode where a row has one, and the Fatal word both ways
(the bits decide, not the word).
"""

from __future__ import annotations

import json

import pytest

from gpupipe_consumers.alerts.rules.classify import FaultEvent, GpuXidHistory, classify
from gpupipe_consumers.alerts.rules.nvlink5_decode import (
    SheetError,
    SheetRow,
    decode_nvlink5,
    layout_for_driver,
    load_sheet,
    sheet,
)
from gpupipe_producer.xid.kmsg_parse import KernelXid, parse_line
from tests.paths import REPO, TESTS

T0 = 1_800_000_000_000
SHEET_JSON = REPO / "consumers" / "alerts" / "rules" / "nvlink5_decode.json"
FIXTURE = TESTS / "fixtures" / "kmsg" / "xid_real.txt"


def kernel_line(xid: int, unit: str, fatal: bool, intr: int, status: int, link: int = 7) -> str:
    word = "Fatal" if fatal else "Nonfatal"
    return (
        f"NVRM: Xid (PCI:0000:3b:00): {xid}, {unit} {word} XC0 i0 Link {link:02d} "
        f"(0x{intr:08x} 0x{status:08x} 0x00000000 0x00000000 0x00000000 0x00000000)"
    )


def classify_line(line: str, driver_version: str | None = None, prior: tuple[FaultEvent, ...] = ()):
    ev = parse_line(line)
    assert isinstance(ev, KernelXid), line
    history = GpuXidHistory()
    for p in prior:
        history.record(p)
    fe = FaultEvent(kind="xid", ts_ms=T0, code=ev.xid, message=ev.message, driver_version=driver_version)
    return classify(fe, history)


def fill(pattern: str, bit: str) -> int:
    return int(pattern.replace("-", bit), 2)


def printed_name(row: SheetRow, layout: int) -> str:
    parts = row.unit.split("/")
    return parts[layout - 1] if len(parts) == 2 else row.unit.replace(" ", "_")


def expected(row: SheetRow, action: str) -> tuple[str, str, bool, str]:
    """(action, severity, drain, rule) our classifier gives a decoded sheet bucket."""
    if action == "XID_154_EVAL":  # no Xid 154 on the GPU: RESTART_APP
        return "RESTART_APP", "warning", False, "nvlink5.xid154_eval"
    if action == "IGNORE":
        return "IGNORE", "info", False, "nvlink5.decoded"
    if row.peer_at_fault:  # the peer took the link down: reset this GPU, do not drain the node
        return "RESET_GPU", "warning", False, "nvlink5.peer_device"
    return "RESET_GPU", "critical", True, "nvlink5.decoded"


def same_decision(a: SheetRow, b: SheetRow) -> bool:
    """V1 prints one name for TLW_RX pipes 0/1 (and TLW_TX): one pattern, two rows, one decision."""
    return (a.xid, a.patterns[0], a.error_status, a.action, a.investigatory) == (
        b.xid,
        b.patterns[0],
        b.error_status,
        b.action,
        b.investigatory,
    )


# --------------------------------------------------------------------------------- the sheet itself


def test_sheet_has_every_row_of_nvidias_decode_sheet_with_its_source():
    rows = sheet()
    per_xid = {x: sum(1 for r in rows if r.xid == x) for x in range(144, 151)}
    # counted on NVIDIA's page: 144 SAW_MVB 6; 145 RLW_* 33; 146 TLW_* 20; 147 TREX 2; 148 NVLPW 1;
    # 149 NETIR 1 + NETIR_LINK_EVT 21 + BER 4 + MFDE 5; 150 MSE 2
    assert per_xid == {144: 6, 145: 33, 146: 20, 147: 2, 148: 1, 149: 31, 150: 2}
    assert all(r.source.startswith(f"NVIDIA, 'XID 144-150 Decode' sheet, row {r.row}") for r in rows)
    doc = json.loads(SHEET_JSON.read_text())
    assert doc["source"] == "https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html"


def test_v2_subcodes_agree_with_the_drivers_nvlink_error_codes():
    """V2 IntrInfo[6:0] per unit vs open-gpu-kernel-modules 595.45.04 MODSDRV_NVLINK_ERROR_CODE_* (an
    independent source of the same numbers; MSE_WATCHDOG is 25 there but 0 in the sheet)."""
    driver = {
        "SAW_MVB": 1, "RLW_CTRL": 3, "RLW_REMAP": 4, "RLW_RSPCOL": 5, "RLW_RXPIPE": 6, "RLW_SRC_TRACK": 7,
        "RLW_TAGSTATE": 8, "TLW_CTRL": 9, "TLW_RX_PIPE0": 10, "TLW_RX_PIPE1": 11, "TLW_TX_PIPE0": 12,
        "TLW_TX_PIPE1": 13, "TREX": 14, "NVLPW": 15, "NETIR_LINK_DOWN": 17, "NETIR_BER_EVENT": 19,
        "NETIR_MFDE_EVENT": 20, "NETIR_INT": 24,
    }  # fmt: skip
    seen = {}
    for r in sheet():
        if r.xid != 150:
            seen[printed_name(r, 2)] = int(r.patterns[1][-7:], 2)
    assert seen == driver


def test_v1_low_bits_name_the_xid_and_bits_25_20_are_the_link_down_reason():
    for r in sheet():
        p1, p2 = r.patterns
        assert len(p1) == len(p2) == 32
        assert p1[:6] == p2[:6] == "------"
        assert p1[6:12] == p2[6:12]  # IntrInfo[25:20]
        if r.xid != 150:
            assert int(p1[-5:], 2) == r.xid - 143  # IntrInfo[4:0]
        if "LINK_EVT" not in r.unit:
            assert p1[6:12] == "000000"


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("{", "not JSON"),
        ('{"rows": []}', "no rows"),
        ('{"rows": [{"row": 1, "xid": 151}]}', "not 144-150"),
        ('{"rows": [{"row": 1, "xid": 144, "intr_v1": "0101", "intr_v2": "0"}]}', "32 characters"),
        (
            '{"rows": [{"row": 1, "xid": 144, "intr_v1": "' + "-" * 32 + '", "intr_v2": "' + "-" * 32
            + '", "error_status": null, "action": "REBOOT"}]}',
            "unknown bucket",
        ),
    ],
)  # fmt: skip
def test_a_malformed_sheet_is_a_clear_error(text, match):
    with pytest.raises(SheetError, match=match):
        load_sheet(text)


def test_driver_version_picks_the_layout():
    assert layout_for_driver("570.158.01") == 1
    assert layout_for_driver("575.51.02") == 2
    assert layout_for_driver("580.95.05") == 2
    assert layout_for_driver(None) is None
    assert layout_for_driver("unknown") is None
    v2_only = (144, "SAW_MVB", 0x00000001, 0x2)  # a V2 message: no V1 row has these bits
    assert decode_nvlink5(*v2_only).layout == 2
    assert decode_nvlink5(*v2_only, driver_version="580.65.06").action == "RESET_GPU"
    assert decode_nvlink5(*v2_only, driver_version="570.158.01") is None  # a V1 driver cannot print it


# ------------------------------------------------------------------------------ every row, both ways


@pytest.mark.parametrize("row", sheet(), ids=lambda r: f"row{r.row}-{r.xid}-{r.unit.replace('/', '|')}")
def test_every_sheet_row_decodes_in_both_layouts(row: SheetRow):
    variants = [(row.patterns, row.action, False)]
    if row.action2_patterns is not None:
        assert row.action2 is not None
        variants.append((row.action2_patterns, row.action2, True))
    status = min(row.error_status) if row.error_status else 0
    checked = 0
    for patterns, action, promoted in variants:
        want = expected(row, action)
        for layout in (1, 2):
            for dont_care in "01":
                intr = fill(patterns[layout - 1], dont_care)
                for fatal in (True, False):
                    line = kernel_line(row.xid, printed_name(row, layout), fatal, intr, status)
                    for version in (None, "570.158.01" if layout == 1 else "580.95.05"):
                        if row.xid == 150 and version is None:
                            continue  # all-zero IntrInfo is both layouts: only the version tells
                        c = classify_line(line, version)
                        assert (c.action.value, c.severity.value, c.drain_node, c.rule) == want, line
                        name = printed_name(row, layout)
                        d = decode_nvlink5(row.xid, name, intr, status, driver_version=version)
                        assert d is not None and d.layout == layout and d.action2 is promoted
                        assert d.row is row or same_decision(d.row, row), (line, d.row.row)
                        assert f"sheet row {d.row.row}" in c.reason
                        checked += 1
    assert checked >= 8


# ----------------------------------------------------------------------- the review's MISMATCH rows


def test_review_mismatch_149_link_down_by_the_host_is_ignore():
    # NETIR_LINK_EVT sub-code 101000 (40): the sheet says IGNORE / INVESTIGATE_HOST although "Fatal"
    for line, version in (
        (kernel_line(149, "NETIR_LINK_DOWN", True, 0b101000 << 20 | 0b0010001, 0), "580.95.05"),
        (kernel_line(149, "NETIR_LINK_EVT", True, 0b101000 << 20 | 0b0111000110, 0), "570.158.01"),
    ):
        c = classify_line(line, version)
        assert (c.action.value, c.severity.value, c.drain_node) == ("IGNORE", "info", False), line
        assert "INVESTIGATE_HOST" in c.reason


def test_review_mismatch_149_link_down_by_software_is_ignore():
    # sub-code 100110 (38), Link Fatal: IGNORE / INVESTIGATE_SW/USER
    for line in (
        kernel_line(149, "NETIR_LINK_DOWN", True, 0b100110 << 20 | 0b0010001, 0),
        kernel_line(149, "NETIR_LINK_EVT", True, 0b100110 << 20 | 0b0111000110, 0),
    ):
        c = classify_line(line)
        assert (c.action.value, c.severity.value, c.drain_node) == ("IGNORE", "info", False), line
        assert "INVESTIGATE_SW/USER" in c.reason


def test_review_mismatch_145_rxpipe_promoted_by_action_2_is_reset_gpu():
    # RLW_RXPIPE Non-fatal* 0x1 with the Action-2 bit (V2 bit 7, V1 bit 10): RESET_GPU although "Nonfatal"
    for line in (
        kernel_line(145, "RLW_RXPIPE", False, 0b10000110, 0x1),
        kernel_line(145, "RLW_RXPIPE", False, 0b10011000010, 0x1),
    ):
        c = classify_line(line)
        assert (c.action.value, c.severity.value, c.drain_node) == ("RESET_GPU", "critical", True), line
        assert "Action 2" in c.reason
    c = classify_line(kernel_line(145, "RLW_RXPIPE", False, 0b00000110, 0x1))  # not promoted
    assert c.action.value == "IGNORE"


# ---------------------------------------------------------------------------------- peer, undecoded


def test_link_fatal_caused_by_the_peer_says_so_and_does_not_drain_this_node():
    line = kernel_line(149, "NETIR_LINK_EVT", True, 0x025001C6, 0)  # reason 37 = 100101
    c = classify_line(line)
    assert (c.action.value, c.drain_node, c.rule) == ("RESET_GPU", False, "nvlink5.peer_device")
    assert "peer" in c.reason and "link 07" in c.reason
    assert "do not cordon" in c.runbook.lower()


def test_rows_not_in_the_sheet_keep_the_fatal_word_and_are_flagged_undecoded():
    # NETIR_LINK_DOWN with link-down reason 3: no row of the sheet
    c = classify_line(kernel_line(149, "NETIR_LINK_DOWN", True, 0b000011 << 20 | 0b0010001, 0))
    assert (c.action.value, c.severity.value, c.drain_node, c.rule) == (
        "RESET_GPU",
        "critical",
        True,
        "nvlink5.undecoded_fatal",
    )
    assert "not in NVIDIA's 'XID 144-150 Decode' sheet" in c.reason
    c = classify_line(kernel_line(146, "TLW_CTRL", False, 0b0001001, 0x40))  # a status the sheet lacks
    assert (c.action.value, c.rule) == ("IGNORE", "nvlink5.undecoded_nonfatal")


def test_a_bit_field_status_takes_the_worst_of_its_bits():
    # SAW_MVB status 0x3 = 0x1 (IGNORE) | 0x2 (RESET_GPU)
    d = decode_nvlink5(144, "SAW_MVB", 0x1, 0x3)
    assert d is not None and d.action == "RESET_GPU" and [r.row for r in d.rows] == [2, 1]
    # NETIR_BER_EVENT's status is an enumeration (0-3), not bits: 0x5 is no row
    assert decode_nvlink5(149, "NETIR_BER_EVENT", 0b1000100110, 0x5) is None


def test_xid154_eval_rows_follow_an_xid_154():
    line = kernel_line(145, "RLW_REMAP", False, 0b0000100, 0x1)
    text = "GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)"
    prior = FaultEvent(kind="xid", ts_ms=T0 - 10, code=154, message=text)
    c = classify_line(line, prior=(prior,))
    assert (c.action.value, c.rule) == ("RESET_GPU", "nvlink5.follow_154")


# ----------------------------------------------------------------------------- the real kernel lines


def _real_nvlink5_lines() -> list[str]:
    lines = [ln for ln in FIXTURE.read_text().splitlines() if ln and not ln.startswith("#")]
    return [ln for ln in lines if any(f"): {x}, " in ln for x in range(144, 151))]


def test_real_nvlink5_lines_decode():
    """The three NVLink5 lines of the fixture (sources named there: GPUd PRs 1174 and 1160)."""
    got = {}
    for line in _real_nvlink5_lines():
        ev = parse_line(line)
        assert isinstance(ev, KernelXid)
        c = classify_line(line)
        got[ev.xid] = (c.action.value, c.drain_node, c.rule)
    assert got == {
        # NETIR Fatal Link -1 (0x000fe406 ...): V1 NETIR (row 63), Link Fatal, SYMPATHETIC_REPORT_SOLO
        149: ("RESET_GPU", True, "nvlink5.decoded"),
        # RLW_RXPIPE Nonfatal (0x0409a0c2 0x00000008): V1 RLW_RXPIPE status 0x8, IGNORE
        145: ("IGNORE", False, "nvlink5.decoded"),
        # SAW_MVB Nonfatal (0x00000001 0x00000008): V2 SAW_MVB status 0x8, IGNORE / CONTACT_SUPPORT
        144: ("IGNORE", False, "nvlink5.decoded"),
    }
    assert decode_nvlink5(149, "NETIR", 0x000FE406, 0).row.row == 63


def test_the_engine_passes_the_events_driver_version_to_the_decoder():
    from gpupipe_consumers.alerts.engine.facade import EngineConfig, EngineFacade

    line = kernel_line(144, "SAW_MVB", True, 0x00000001, 0x2)  # a V2 (>= R575) message
    message = parse_line(line).message
    rules = {}
    for version in ("580.95.05", "570.158.01"):
        e = EngineFacade(EngineConfig())
        ev = {
            "event_id": f"e-{version}",
            "timestamp_ms": T0,
            "hostname": "node-a",
            "kind": "xid",
            "xid": 144,
            "pci_bus_id": "0000:3b:00",
            "driver_version": version,
            "message": message,
            "source": "kmsg",
        }
        rules[version] = e.on_xid(ev, T0).rule
    # a pre-R575 driver cannot have printed V2 bits: not decoded, the Fatal word stands
    assert rules == {"580.95.05": "nvlink5.decoded", "570.158.01": "nvlink5.undecoded_fatal"}
