"""Emulated workers and the emulated fleet (torch-free): the fleet test bed.

  engine.py    `EmulatedEngine`: the worker engine contract with an LRU block cache and a
               service-time model instead of a model (`prefixgate worker --emulate`)
  service.py   `ServiceModel`: prefill and decode speed, shared with the simulator
  cache.py     the block cache, shared with the simulator
  transfer.py  block transfer of an emulated worker over the real transfer path
  worker.py    that engine behind the real WorkerService (workerapi/startup.py)
  http.py      its minimal OpenAI completions face, for HTTP routers
  model.py     the model directory an emulated fleet serves (a real tokenizer, a long context)
  fleet.py     `prefixgate replay --fleet N`: emulated workers (and Redis) plus one or more
               real gateways brought up (prefixgate/launch), replayed through, torn down
"""
