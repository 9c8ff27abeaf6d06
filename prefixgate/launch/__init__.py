"""Starting and stopping prefixgate's processes (torch-free; imports no command).

  processes.py  `ProcessGroup`: the one launcher of child processes (`prefixgate up`'s
                workers, the emulated fleet, the benches, the test fleets): start with
                a log file or the parent's terminal, SIGTERM when the parent dies,
                readiness over gRPC health, stop in order (SIGTERM, then SIGKILL)
  redis_server.py  a private redis-server on a free loopback port (the emulated fleet's
                Redis, benchmarks and tests)
  serving.py    inside one process: the stop signal (SIGINT/SIGTERM) and starting a server
                task that reports its bound port
"""
