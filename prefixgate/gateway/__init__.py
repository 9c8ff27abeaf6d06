"""The gateway (torch-free: never imports torch): the Chat gRPC service and the OpenAI HTTP
front over one turn core, routing each turn to the worker holding its prefix.

  config.py         GatewayConfig, the gateway's configuration
  turn.py           the turn core: admit, route, relay, account (no transport in it)
  placement.py      one attempt's placement: hash, decide, pull, dispatch, predict, lease
  grpc_front.py     ChatService, the gRPC front: holds the turn core
  http.py           the OpenAI-compatible HTTP front (aiohttp): holds the same turn core
  server.py         `serve`: builds the core and both fronts, the process's main loop
  startup.py        a gateway process's start-up (GatewayStartup: model, registry, metrics)
  processes.py      several gateway processes sharing one port (SO_REUSEPORT)
  pool.py           the gateway's view of its workers: connections, identity, load leases
  routing.py        routing policies: rank the candidate workers for a turn (no I/O)
  index.py          the routing index: which workers hold which KV blocks
  feeds.py          WatchEvents feeds keeping the index in step with the workers
  redis_feed.py     the Redis feed: bootstrap from Redis, then follow pg:events
  status.py         fresh worker load (WatchStatus, pushed)
  pulls.py          a routed block pull on the wire (block transfer between workers)
  resume.py         mid-stream resume of a reply whose worker was lost
  logprobs.py       OpenAI `logprobs` objects from a turn's deltas
  tokenize_pool.py  long tokenizations off the event loop, on a bounded pool
  metrics.py        the gateway's Prometheus metrics
"""
