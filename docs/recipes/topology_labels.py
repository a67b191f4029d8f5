"""Node labels and an annotation for topology-aware scheduling, from the compacted gpu.topology.v1.

Reads every node's latest GpuTopology (the topic is compacted: reading it from the beginning gives
each node's current record last) with gpupipe's codec, and prints the kubectl commands that put on
each node:

* labels (``gpupipe.io/...``, values within Kubernetes' label syntax) for nodeSelector / nodeAffinity,
  which the default scheduler, Volcano and the scheduler-plugins all honour:
  ``gpu-numa-nodes`` (the NUMA nodes with GPUs, ``0_1``), ``nvlink-domains`` (how many),
  ``nvlink-domain-size`` (GPUs in the largest), ``nvlink-all-to-all`` (``true`` when every GPU
  reaches every other over NVLink: an NVSwitch board);
* the annotation ``gpupipe.io/gpu-topology``: JSON, per GPU its uuid, index, NUMA node, CPU list and
  NVLink domain, for a scheduler extension or a device plugin that places by UUID.

Usage: python topology_labels.py BOOTSTRAP [TOPIC] [--apply]
Prints the commands; with --apply runs them (kubectl on PATH, rights to label nodes).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

from gpupipe_schemas.codec import AvroCodec

PREFIX = "gpupipe.io/"


def node_labels(topology: dict[str, Any]) -> tuple[dict[str, str], str]:
    """(labels, annotation JSON) of one GpuTopology record. Pure."""
    gpus = [g for g in topology["gpus"] if not g["gpu_lost"]]
    numa = sorted({g["numa_node"] for g in gpus if g["numa_node"] is not None})
    domains: dict[int, int] = {}
    for g in gpus:
        if g["nvlink_domain"] is not None:
            domains[g["nvlink_domain"]] = domains.get(g["nvlink_domain"], 0) + 1
    labels = {
        PREFIX + "gpu-numa-nodes": "_".join(str(n) for n in numa),
        PREFIX + "nvlink-domains": str(len(domains)),
        PREFIX + "nvlink-domain-size": str(max(domains.values(), default=0)),
        PREFIX + "nvlink-all-to-all": str(len(gpus) > 1 and list(domains.values()) == [len(gpus)]).lower(),
    }
    annotation = json.dumps(
        [
            {
                "uuid": g["uuid"],
                "index": g["gpu_index"],
                "numa": g["numa_node"],
                "cpus": g["cpu_affinity"],
                "nvlink_domain": g["nvlink_domain"],
            }
            for g in gpus
        ],
        separators=(",", ":"),
    )
    return labels, annotation


def latest(bootstrap: str, topic: str) -> dict[str, dict[str, Any]]:
    """hostname -> its latest GpuTopology, reading the topic from the beginning to its end."""
    c = Consumer(
        {"bootstrap.servers": bootstrap, "group.id": "gpupipe-read-topology", "enable.auto.commit": False}
    )
    parts = c.list_topics(topic, timeout=10).topics[topic].partitions
    ends = {p: c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in parts}
    c.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in parts if ends[p] > 0])
    codec, out, left = AvroCodec(), {}, {p for p, end in ends.items() if end > 0}
    try:
        while left:
            for m in c.consume(500, timeout=1.0):
                if m.error():
                    continue
                if m.value() is not None:  # a tombstone would delete the node
                    rec = codec.decode(m.value(), m.headers()).record
                    out[rec["hostname"]] = rec
                if m.offset() + 1 >= ends[m.partition()]:
                    left.discard(m.partition())
    finally:
        c.close()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bootstrap")
    p.add_argument("topic", nargs="?", default="gpu.topology.v1")
    p.add_argument("--apply", action="store_true", help="run the kubectl commands instead of printing them")
    args = p.parse_args(argv)
    for host, rec in sorted(latest(args.bootstrap, args.topic).items()):
        labels, annotation = node_labels(rec)
        cmds = [
            ["kubectl", "label", "node", host, "--overwrite", *(f"{k}={v}" for k, v in labels.items())],
            ["kubectl", "annotate", "node", host, "--overwrite", f"{PREFIX}gpu-topology={annotation}"],
        ]
        for cmd in cmds:
            if args.apply:
                subprocess.run(cmd, check=True)
            else:
                print(shlex.join(cmd))
    return 0


if __name__ == "__main__":
    sys.exit(main())
