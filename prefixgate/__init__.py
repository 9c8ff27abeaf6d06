"""prefixgate: a conversational prefix-cache gateway for LLM serving.

Packages, one job each (the README's layout section draws them and their imports):
  wire/       the wire contract: message validation, packed token ids, gRPC plumbing,
              KV events, pushed status, the Chat client
  security/   bearer tokens and tenants (auth), per-worker keys and signatures (identity),
              `up --secure` credentials (local)
  model/      model catalogue, chat tokenizer, context-overflow policy (torch-free)
  telemetry/  logging, Prometheus exposition, trace recording
  radix/      block hashing and the radix tree; pure Python, no torch, no I/O
  registry/   worker leases, block ownership and events: embedded or Redis
  gateway/    Chat gRPC service and OpenAI HTTP front, routing; never imports torch
  workerapi/  the Worker API: the Engine contract, the Worker gRPC service and its
              validation, KV events, the block transfer wire, start-up (torch-free)
  worker/     the torch engine: paged KV pool, scheduler, model runner, kernels
  engines/    other serving engines behind the Worker API (vLLM)
  vllm_connector/  prefixgate's KV connector, loaded by vLLM (block transfer in vLLM; torch)
  emulate/    a worker with no model (LRU blocks + a service-time model) for fleet tests
  launch/     starting and stopping processes: the one launcher, a private redis-server
  replay/     traces, load generation, the routing simulator, reports
  bench/      `prefixgate bench ...` commands
  cli/        the command line: parses flags into configuration, calls the libraries
  v1/         generated gRPC stubs of proto/prefixgate/v1 (do not edit)
"""

__version__ = "0.1.0"
