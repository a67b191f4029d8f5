"""What every room stands on: errors and exit codes, durations, flag types, files named by flags,
YAML files, structured logs. Imports nothing else of gpupipe."""
