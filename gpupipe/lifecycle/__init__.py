"""A service's life: the flags every service declares, start-up and shutdown, and the run
sequence (``runner``) that starts the web server, waits for Kafka and runs the service."""
