"""gpupipe.domain.pci: each bus-id form on literal spellings; one device's spellings compare equal."""

from __future__ import annotations

import pytest

from gpupipe.domain import pci

# One GPU as each source spells it.
NVML = "00000000:3B:00.0"  # nvmlDeviceGetPciInfo().busId
KMSG = "PCI:0000:3b:00"  # NVRM: Xid (PCI:0000:3b:00): 79, pid=...
KMSG_BARE = "0000:3b:00"  # the bus id as the kmsg parser hands it on
LSPCI = "3b:00.0"
# One NVSwitch: the SXid line prints the function, NVML the 8-digit domain.
SXID = "0000:05:00.0"  # nvidia-nvswitch2: SXid (PCI:0000:05:00.0): 12028, ...
NVSWITCH_NVML = "00000000:05:00.0"


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("00000000:3B:00.0", "0000:3b:00.0"),  # NVML
        ("0000:3b:00", "0000:3b:00.0"),  # kmsg Xid line
        ("PCI:0000:3b:00", "0000:3b:00.0"),
        ("pci:0000:3B:00", "0000:3b:00.0"),
        ("0000:05:00.0", "0000:05:00.0"),  # kmsg SXid line
        ("3b:00.0", "0000:3b:00.0"),  # lspci
        ("0009:01:00", "0009:01:00.0"),
        ("00000009:01:00.0", "0009:01:00.0"),
        ("0000:10:1c", "0000:10:1c.0"),
        ("  0000:3b:00.3\n", "0000:3b:00.3"),
        ("0000:3b:00.", "0000:3b:00.0"),  # an empty function is function 0
        ("10000:01:00.0", "10000:01:00.0"),  # domains above 0xffff keep their digits
    ],
)
def test_canonical(given: str, expected: str) -> None:
    assert pci.canonical(given) == expected


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "3b",
        "0000:3b",
        "zz:00.0",
        "0000:3b:00.8",
        "0000:3b:20.0",  # a device number has 5 bits
        "0000:3b:00.0.1",
        "0000:-1:00",
        "0000:3b:0_0",
        "0000:3b:+0",
        "0:1:2:3",
        "000000000:3b:00.0",
        "0000:3bb:00.0",
        "0000::00",
        ":3b:00",
        "PCI: 0000:3b:00",
    ],
)
def test_canonical_rejects(bad: str) -> None:
    with pytest.raises(ValueError, match="not a PCI bus id"):
        pci.canonical(bad)


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("00000000:3B:00.0", "0000:3b:00"),  # NVML
        ("0000:3b:00", "0000:3b:00"),  # kernel log
        ("PCI:0000:3b:00", "0000:3b:00"),
        ("pci:0000:3B:00.7", "0000:3b:00"),
        ("3b:00.0", "0000:3b:00"),
        ("00000001:C3:00.0", "0001:c3:00"),
        (" 0000:3b:00.1\n", "0000:3b:00"),
        ("0000:3b:20.0", "0000:3b:20"),  # the device number is not range-checked here
        ("not a bus id", None),
        ("00010000:3B:00.0", None),  # a domain above 0xffff
        ("0000:3b:00.8", None),
        ("0000:3b:00.", None),
        ("0000:3b", None),
        ("", None),
    ],
)
def test_device_key(given: str, expected: str | None) -> None:
    assert pci.device_key(given) == expected


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("0000:3b:00", "00000000:3B:00.0"),
        ("0000:3b:00.1", "00000000:3B:00.1"),
        ("00000000:3B:00.0", "00000000:3B:00.0"),
        ("3b:00.0", "00000000:3B:00.0"),
        (" 0000:05:00.0 ", "00000000:05:00.0"),
        ("garbage", "garbage"),  # unchanged: a label keeps what the record said
        ("PCI:0000:3b:00", "PCI:0000:3b:00"),  # the kmsg prefix is not stripped here
        ("", ""),
    ],
)
def test_nvml_form(given: str, expected: str) -> None:
    assert pci.nvml_form(given) == expected


def test_the_sources_spellings_of_one_device_compare_equal() -> None:
    gpu = {NVML, KMSG, KMSG_BARE, LSPCI}
    assert {pci.canonical(s) for s in gpu} == {"0000:3b:00.0"}
    assert {pci.device_key(s) for s in gpu} == {"0000:3b:00"}
    assert {pci.nvml_form(s) for s in (NVML, KMSG_BARE, LSPCI)} == {NVML}
    assert pci.canonical(SXID) == pci.canonical(NVSWITCH_NVML) == "0000:05:00.0"
    assert pci.device_key(SXID) == pci.device_key(NVSWITCH_NVML) == "0000:05:00"
    assert pci.nvml_form(SXID) == NVSWITCH_NVML
    # and two devices stay apart in every form
    other = "00000000:3C:00.0"
    assert pci.canonical(KMSG) != pci.canonical(other)
    assert pci.device_key(KMSG) != pci.device_key(other)
    assert pci.nvml_form(KMSG_BARE) != pci.nvml_form(other)


def test_the_forms_agree_with_each_other() -> None:
    for s in (NVML, KMSG, KMSG_BARE, LSPCI, SXID, "0001:c3:1f.7"):
        key = pci.canonical(s)
        assert pci.device_key(s) == key.rsplit(".", 1)[0]
        assert pci.canonical(pci.nvml_form(key)) == key
