"""The gRPC inference service for the MHA model."""
