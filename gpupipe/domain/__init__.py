"""Facts the services share about the world they report on: prices and their schedule, teams, PCI
bus ids, and which node wrote a record (node identity). No Kafka, no service wiring."""
