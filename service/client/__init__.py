"""What a user runs against a server: the client, the load generator, plots."""
