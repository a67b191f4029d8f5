"""Clients of the outside services other than Kafka: the Kubernetes API and Alertmanager."""
