"""The repository carries the licence its package metadata declares (pyproject: Apache-2.0).

Without the file, the metadata's claim is all a company's legal review has to go on, and most
refuse to adopt a project on that.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_license_file_is_the_complete_apache_2_text() -> None:
    assert tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["license"] == "Apache-2.0"
    text = (REPO / "LICENSE").read_text()
    assert "Apache License\n                           Version 2.0, January 2004" in text
    sections = ["1. Definitions.", "2. Grant of Copyright License.", "3. Grant of Patent License.",
                "4. Redistribution.", "5. Submission of Contributions.", "6. Trademarks.",
                "7. Disclaimer of Warranty.", "8. Limitation of Liability.",
                "9. Accepting Warranty or Additional Liability.", "END OF TERMS AND CONDITIONS",
                "APPENDIX: How to apply the Apache License to your work."]  # fmt: skip
    positions = [text.index(s) for s in sections]
    assert positions == sorted(positions)
    assert len(text.split()) > 1500  # the whole text, not a pointer to it
