"""Generated gRPC stubs of proto/prefixgate/v1 (regenerate with scripts/gen_proto.py)."""
