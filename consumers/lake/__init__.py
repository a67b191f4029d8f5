"""The cold path: gpupipe topics as Apache Iceberg tables (``gpupipe lake write`` / ``lake query``)."""
