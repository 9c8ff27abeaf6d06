"""The worker: a paged KV engine with exact prefix reuse behind the Worker gRPC service
(torch; `server.py`, `events.py`, `startup.py` and `transfer.py` are torch-free, so that
emulated workers share them).

  server.py           WorkerService (gRPC) over any `Engine` (api.py: the contract)
  startup.py          listening, the registry lease and the published KV events
  engine.py           the engine loop: continuous batching over the paged pool
  scheduler.py        which sequences run and how many tokens each computes per step
  reuse.py            prefix hits, tails and shifted reuse (what is already computed)
  blocks.py           KV block acquisition: evict, allocate, preempt
  sequence.py         one sequence's state; prefix_cache.py the radix tree of its blocks
  kv_pool.py          the paged KV pool; paged_attention.py attention over it
  model_loader.py     weights and formats (float32, bfloat16, int8, q4_1)
  model_runner.py     one flat batch per step through the model
  reindex.py          RoPE re-rotation of cached K/V (context overflow)
  transfer.py         block transfer between workers; kv_transfer.py its paged side
  handoff.py          drain hand-off of cached chains to peers
  events.py           KV event log, WatchEvents and the Redis publisher
  sampling.py, rates.py, metrics.py (detokenizing: model/detokenizer.py)
  kernels/            CPU kernels (C in kernels/csrc/) and GPU kernels (Triton)
"""
