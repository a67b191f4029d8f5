"""NVIDIA's XID / SXid catalog under the alerts service's name: :mod:`gpupipe_schemas.xid_catalog`.

The catalog is shared meaning (the OTLP exporter reads the same severities and actions), so it lives
in the contract; this module keeps the alerts' import path.
"""

from gpupipe_schemas.xid_catalog import *  # noqa: F403
from gpupipe_schemas.xid_catalog import __all__  # noqa: F401
