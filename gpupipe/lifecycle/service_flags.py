"""The flags that every service declares alike, each declared once.

Where a service serves its own ``/metrics`` and ``/healthz``, whether it creates missing topics, and
where a new consumer group starts, which node's certificate a record's hostname needs (the node
identity flags of every service that acts on it): one name, default and help for all, so a fix to
one cannot miss the others. A service says only what differs (what its port serves, what its input is)."""

from __future__ import annotations

import argparse

from gpupipe.domain.node_check import NODE_CERT_RULES, NODE_IDENTITY_MODES
from gpupipe.kafka import replication as topic_replication


def add_listen(p: argparse.ArgumentParser | argparse._ArgumentGroup, *, serves: str = "/metrics") -> None:
    """``--listen``: off unless given (the producer and consumers serve their own metrics there)."""
    p.add_argument("--listen", default=None, metavar="HOST:PORT", help=f"address of {serves} and /healthz")


def add_create_topics(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--create-topics`` / ``--no-create-topics``: on, so a fresh cluster needs no set-up step; and
    ``--topic-replication``, the copies of the topics created (gpupipe.kafka.replication)."""
    p.add_argument(
        "--create-topics",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="create missing topics with default partitions and retention",
    )
    p.add_argument(
        "--topic-replication",
        default=topic_replication.AUTO,
        metavar="auto|RF[:MIN_ISR]",
        help="replication factor and min.insync.replicas of the topics created here; auto asks the "
        "cluster: 3:2 with three or more brokers alive, else 1:1 (docs/operations.md, Replication)",
    )


def add_from_beginning(
    p: argparse.ArgumentParser | argparse._ArgumentGroup, *, what: str = "records"
) -> None:
    """``--from-beginning``: where a consumer group without committed offsets starts."""
    p.add_argument(
        "--from-beginning",
        action="store_true",
        help=f"a new consumer group starts at the oldest retained {what} instead of the newest",
    )


def add_node_identity(
    p: argparse.ArgumentParser | argparse._ArgumentGroup, *, records: str, refused: str
) -> None:
    """``--node-ca-file``, ``--node-identity`` and ``--node-cert-names``, alike in every service.

    ``records``: whose hostname is checked (``an XID's or a sample's``); ``refused``: what
    ``enforce`` does with a record that fails (``dead-letters it``)."""
    p.add_argument(
        "--node-ca-file",
        default=None,
        metavar="PATH",
        help=f"accept {records} hostname only when the record is signed by that node's certificate, "
        "issued by a CA in this PEM bundle (the producers' --node-cert; for kubelet client "
        "certificates, the cluster CA, as in ConfigMap kube-root-ca.crt) (default: not checked)",
    )
    p.add_argument(
        "--node-identity",
        choices=NODE_IDENTITY_MODES,
        default=NODE_IDENTITY_MODES[0],
        help=f"with --node-ca-file: enforce {refused} (reason node-identity); audit only counts and "
        "logs them, for a fleet still rolling out certificates",
    )
    p.add_argument(
        "--node-cert-names",
        choices=NODE_CERT_RULES,
        default=NODE_CERT_RULES[0],
        help="which certificates name a node: kubelet, only kubelet client certificates (CN "
        "system:node:NAME, O system:nodes, client auth); dedicated-ca, any leaf of the CA naming the "
        "node in its CN or a DNS SAN (for a CA that issues node identities only)",
    )
