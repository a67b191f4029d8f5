"""What every consumer service stands on: the consume loop, dead letters, and reading a topic
from a time. Imports no service."""
