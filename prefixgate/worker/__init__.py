"""Worker: model runner and Worker gRPC service (torch)."""
