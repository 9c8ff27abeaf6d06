"""Emulated workers and the emulated fleet (torch-free): the fleet test bed.

  engine.py  `EmulatedEngine`: the worker engine contract with an LRU block cache and a
             service-time model instead of a model (`prefixgate worker --emulate`)
  worker.py  `prefixgate worker --emulate`: that engine behind the real WorkerService
  model.py   the model directory an emulated fleet serves (a real tokenizer, a long context)
  fleet.py   `prefixgate replay --fleet N`: emulated workers (and Redis) plus one or more
             real gateways brought up, replayed through, and torn down
"""
