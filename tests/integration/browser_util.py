"""Headless Debian chromium for tests: screenshot and DOM dump of a local file or a served URL, plus a
PNG reader.

Chromium runs in its own process group with a private profile directory, and the whole group is
killed when a call ends or times out, so no renderer or zygote outlives the test. The PNG reader
(Pillow) tells a blank screenshot from a page by its colours.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

from PIL import Image

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")


def chromium_path() -> str:
    """The browser binary; a missing one fails the test (CI installs Debian's ``chromium``)."""
    for name in CHROMIUM_NAMES:
        found = shutil.which(name)
        if found:
            return found
    raise AssertionError("chromium is not installed (apt-get install chromium); the HTML tests need it")


def run_chromium(args: list[str], profile: Path, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    cmd = [
        chromium_path(),
        "--headless",
        "--no-sandbox",  # root in CI
        "--disable-gpu",
        "--hide-scrollbars",
        "--no-first-run",
        "--disable-extensions",
        "--disable-background-networking",
        f"--user-data-dir={profile}",
        *args,
    ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _address(page: Path | str) -> str:
    """A local file's URI, or a URL as given (a page a service serves)."""
    return page if isinstance(page, str) else page.resolve().as_uri()


def screenshot(page: Path | str, png: Path, profile: Path, size: str = "1000,1400") -> None:
    res = run_chromium([f"--window-size={size}", f"--screenshot={png}", _address(page)], profile)
    assert png.exists() and png.stat().st_size > 0, f"no screenshot ({res.returncode}): {res.stderr[-2000:]}"


def print_pdf(page: Path, pdf: Path, profile: Path) -> bytes:
    """Chromium's print of the page (A4/Letter per locale, print CSS applied), as PDF bytes."""
    res = run_chromium(["--no-pdf-header-footer", f"--print-to-pdf={pdf}", page.resolve().as_uri()], profile)
    assert pdf.exists() and pdf.stat().st_size > 0, f"no PDF ({res.returncode}): {res.stderr[-2000:]}"
    return pdf.read_bytes()


def dump_dom(page: Path | str, profile: Path) -> str:
    res = run_chromium(["--dump-dom", _address(page)], profile)
    assert res.returncode == 0 and "<html" in res.stdout, res.stderr[-2000:]
    return res.stdout


def page_width(page: Path, profile: Path, window_width: int) -> tuple[int, int]:
    """(document width, window width) in CSS pixels as chromium lays the page out in a window that
    wide: a document wider than its window scrolls sideways, and its right-hand columns are cut off
    on screen. A copy of the page writes both numbers into the DOM that chromium dumps."""
    probe = page.with_name(page.stem + ".width.html")
    script = (
        "<script>document.body.dataset.width = document.documentElement.scrollWidth + ' ' + "
        "document.documentElement.clientWidth</script>"
    )
    probe.write_text(
        page.read_text(encoding="utf-8").replace("</body>", script + "</body>"), encoding="utf-8"
    )
    res = run_chromium(
        [f"--window-size={window_width},1200", "--dump-dom", probe.resolve().as_uri()], profile
    )
    m = re.search(r'data-width="(\d+) (\d+)"', res.stdout)
    assert m, f"no width ({res.returncode}): {res.stderr[-2000:]}"
    return int(m.group(1)), int(m.group(2))


def colour_stats(path: Path) -> tuple[int, float]:
    """(distinct colours, share of the most common colour) of a PNG screenshot."""
    with Image.open(path) as img:
        rgb = img.convert("RGB")
        colours = rgb.getcolors(maxcolors=1 << 24) or []
    total = rgb.width * rgb.height
    return len(colours), max(n for n, _ in colours) / total
