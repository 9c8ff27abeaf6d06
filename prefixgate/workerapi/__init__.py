"""The Worker API: what an engine implements and the gRPC service that serves it
(torch-free). The torch engine (`prefixgate.worker`), vLLM behind its adapter
(`prefixgate.engines`) and the emulated workers (`prefixgate.emulate`) all build on
this package and on nothing of each other; `tests/test_layering.py` keeps it free of
torch and of the torch engine.

  api.py       the `Engine` contract: requests in, token and final events out, status,
               `EngineConfig`
  calls.py     the calls' scope (`CallScope`), their typed refusal (`Refused`), and the
               one adapter serving a service's call-level methods over gRPC
  server.py    WorkerServiceBase (Generate's validation, GetInfo, the health service)
               and WorkerService (the whole Worker gRPC service over an `Engine`)
  client.py    how a gateway calls a worker (`WorkerClient`): over gRPC, or a service
               held in its own process, called directly
  events.py    the KV event log behind WatchEvents, and the Redis publisher
  transfer.py  block transfer between workers: the `BlockTransfer` contract an engine's
               paged side implements, the wire (chunks, digests) and the pull
  handoff.py   a draining worker's hand-off of its most reused chains to peers
  rates.py     service rates measured on finished requests (routing by cost)
  metrics.py   the worker's Prometheus metrics, named as vLLM's and SGLang's
  startup.py   listening, the registry lease and the published KV events

The engine's own parts (blocks.py, prefix_cache.py, scheduler.py, sequence.py) stay in
`prefixgate.worker` although some of them need no torch themselves: only the torch
engine imports them, and they hold the paged pool (`worker.kv_pool`) or a sampler.
"""
