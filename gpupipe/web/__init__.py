"""Every service's HTTP server: ``/metrics``, ``/healthz`` and routes, TLS and basic auth from an
exporter-toolkit web config file, reloaded while it runs."""
