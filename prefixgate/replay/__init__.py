"""Replay recorded multi-turn traffic against prefixgate or any OpenAI-compatible server.

Torch-free (gateway side). Modules, one job each:

* `traces`    readers: ShareGPT, Mooncake, prefixgate's recorded traces; token synthesis
* `record`    the gateway's `--record-trace` writer (read back by `traces`)
* `targets`   where turns go: a prefixgate gateway (gRPC) or an OpenAI-compatible server
* `loadgen`   arrival modes (open / closed / Poisson), bounded in turns and time
* `metrics`   TTFT / ITL / E2E percentiles, hit rate, load balance, errors, throughput
* `report`    JSON, Markdown and PNG plots of one or more runs
* `simulate`  routing simulator on the gateway's own routing and index code
* `cli`       the `prefixgate replay` command
"""
