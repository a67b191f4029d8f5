"""Kafka plumbing every command shares: clients' settings and authentication, topics and ACLs,
readiness, transactions, the keyed sink, replay, lag and the partitioner. Imports no other room
of the ground floor but ``gpupipe.common``."""
