"""Detection latency through the whole path, kernel-log line -> alert on gpu.alerts.v1.

Runs, as separate processes on the benchmark broker: the node producer (`gpupipe produce --source nvml`
with the fake NVML for 8 GPUs and a kernel-log FILE as its `--kmsg-path`) and the alerts service
(`gpupipe alerts`). The benchmark appends real-format `NVRM: Xid` lines to that file one at a time,
noting the wall time, and reads gpu.alerts.v1 until the firing alert for that (GPU, XID) arrives.
Each line is a new (GPU, XID) pair so every line must raise its own alert.

Prints `alerts_detection_p99 ratio=<1.0/p99_s> target=1.00` (p99 under 1 s) and the p50/p99/max.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from common import REPO, bench_kafka, figure, ratio_line
from confluent_kafka import OFFSET_END, Consumer, TopicPartition

from gpupipe.kafka import topics
from gpupipe.kafka.admin import ensure_topics
from gpupipe_schemas.codec import AvroCodec

BUS = ("1b", "43", "52", "61", "9d", "c3", "d1", "df")  # the fake NVML's DGX H100 bus ids
CODES = (13, 31, 43, 48, 63, 74, 79, 94, 95, 119)
MESSAGES = {
    13: "pid=4242, name=python3, Graphics SM Warp Exception on (GPC 0, TPC 1, SM 0): Out Of Range Address",
    31: "pid=4242, name=python3, Ch 00000010, intr 10000000. MMU Fault: ENGINE GRAPHICS GPCCLIENT_T1_0",
    43: "pid=4242, name=python3, Ch 00000008",
    48: "pid='<unknown>', name=<unknown>, An uncorrectable double bit error (DBE) has been detected on GPU",
    63: "pid='<unknown>', name=<unknown>, Row Remapper: New row (0x3a21) was marked for remapping",
    74: "pid='<unknown>', name=<unknown>, NVLink: fatal error detected on link 3(0x0, 0x0, 0x10000, 0x0)",
    79: "pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
    94: "pid=4242, name=python3, Contained: SM (0x1). RST: No, D-RST: No",
    95: "pid='<unknown>', name=<unknown>, Uncontained: FBHUB. RST: Yes, D-RST: No",
    119: "pid='<unknown>', name=<unknown>, Timeout after 6s of waiting for RPC response from GPU0 GSP!",
}


def _wait_http(url: str, timeout_s: float = 60.0) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise SystemExit(f"{url} did not come up")


def main() -> int:
    n = int(os.environ.get("GPUPIPE_BENCH_LATENCY_EVENTS", "40"))
    bootstrap = bench_kafka()
    prefix = f"lat-{uuid.uuid4().hex[:8]}."
    ensure_topics(bootstrap, topics.ALL, prefix=prefix)
    tmp = Path(tempfile.mkdtemp(prefix="gpupipe-lat-"))
    kmsg = tmp / "kmsg.log"
    kmsg.write_text("")
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "GPUPIPE_BOOTSTRAP_SERVERS": bootstrap,
        "GPUPIPE_TOPIC_PREFIX": prefix,
        "GPUPIPE_LOG_LEVEL": "warning",
        "GPUPIPE_FAKE_NVML": "H100:8",
    }
    producer = subprocess.Popen(
        [
            sys.executable,
            str(REPO / "tests" / "fake_nvml_cli.py"),
            "produce",
            "--source",
            "nvml",
            "--hostname",
            "lat-node",
            "--kmsg-path",
            str(kmsg),
            "--no-nvml-events",
            "--kubelet-socket",
            "",
            "--spool-dir",
            str(tmp / "spool"),
            "--listen",
            "127.0.0.1:19501",
            "--no-create-topics",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=open(tmp / "producer.log", "w"),  # noqa: SIM115
    )
    alerts = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gpupipe",
            "alerts",
            "--listen",
            "127.0.0.1:19502",
            "--no-create-topics",
            "--restore-lookback",
            "0",
            "--no-health-signals",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=open(tmp / "alerts.log", "w"),  # noqa: SIM115
    )
    codec = AvroCodec()
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"lat-{uuid.uuid4()}",
            "enable.auto.commit": False,
            "fetch.wait.max.ms": 10,
        }
    )
    t_alerts = prefix + topics.ALERTS
    try:
        _wait_http("http://127.0.0.1:19501/healthz")
        _wait_http("http://127.0.0.1:19502/healthz")
        parts = consumer.list_topics(t_alerts, timeout=10).topics[t_alerts].partitions
        consumer.assign([TopicPartition(t_alerts, p, OFFSET_END) for p in parts])
        consumer.consume(10, 1.0)
        time.sleep(3.0)  # let the alerts service's group join settle before the clock starts (not a test)
        latencies = []
        pairs = [(b, c) for c in CODES for b in BUS][:n]
        kernel_t = 5000.0
        for bus, code in pairs:
            kernel_t += 1.5
            line = f"[{kernel_t:12.6f}] NVRM: Xid (PCI:0000:{bus}:00): {code}, {MESSAGES[code]}\n"
            t0 = time.time()
            with open(kmsg, "a") as fh:
                fh.write(line)
            got = None
            deadline = time.monotonic() + 10
            while got is None and time.monotonic() < deadline:
                for m in consumer.consume(100, 0.05):
                    if m.error():
                        continue
                    rec = codec.decode(m.value()).record
                    if (
                        rec["status"] == "firing"
                        and rec["scope"] == "gpu"
                        and code in rec["xid_codes"]
                        and (rec["pci_bus_id"] or "").lower().startswith(f"0000:{bus}:")
                    ):
                        got = time.time()
                        break
            if got is None:
                print(f"no alert for XID {code} on {bus} within 10 s", file=sys.stderr)
                latencies.append(10.0)
            else:
                latencies.append(got - t0)
            time.sleep(0.2)
        latencies.sort()
        p50 = latencies[len(latencies) // 2]
        p99 = latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))]
        ratio_line("alerts_detection_p99", 1.0 / p99, 1.0)
        figure("detection_p50_s", p50)
        figure("detection_p99_s", p99)
        figure("detection_max_s", latencies[-1])
        figure("events", len(latencies))
        return 0
    finally:
        consumer.close()
        for p in (alerts, producer):
            p.terminate()
        for p in (alerts, producer):
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()


if __name__ == "__main__":
    sys.exit(main())
