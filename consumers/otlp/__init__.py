"""`gpupipe otlp`: gpu.samples.v1 and gpu.xid.v1 pushed to an OpenTelemetry Collector as OTLP."""
