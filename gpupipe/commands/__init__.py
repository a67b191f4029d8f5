"""The roof: the ``gpupipe`` command line (``cli``) and the ground floor's own command (``acls``).
Imported by nothing in the package; the CLI finds every command through the entry-point table."""
