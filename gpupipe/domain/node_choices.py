"""The choices of the node identity flags, stated once and light to import.

Both the check (:mod:`gpupipe.domain.node_check`) and the verifier
(:mod:`gpupipe.domain.node_identity`, which loads the cryptography package) read them from here, so
neither imports the other for them and a service's flags need neither."""

#: ``--node-identity``: the first is the default.
NODE_IDENTITY_MODES = ("enforce", "audit")
#: ``--node-cert-names`` (which certificates name a node; see :mod:`gpupipe.domain.node_identity`):
#: the first is the default.
NODE_CERT_RULES = ("kubelet", "dedicated-ca")
