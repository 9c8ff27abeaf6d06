"""The wire contract shared by gateway, workers and clients (torch-free, no engine code).

  protocol   validation and conversion of the v1 protobuf messages (INVALID_ARGUMENT texts)
  token_ids  packed prompt token ids (little-endian uint32) read and checked at C speed
  rpc        gRPC plumbing: servers, channels, TLS, errors mapped to status codes
  events     KV cache events (stored / removed / cleared) and their batches
  status     the worker side of WorkerService.WatchStatus (pushed load)
  client     a small ChatService client (`prefixgate chat`, the demo, replay)
"""
