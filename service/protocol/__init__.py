"""The wire: gRPC and HTTP, protobuf and JSON, status codes, shared memory."""
