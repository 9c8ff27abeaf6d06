"""Replay recorded multi-turn traffic against prefixgate or any OpenAI-compatible server.

Torch-free (gateway side). Modules, one job each (the command is prefixgate/cli/replay.py;
the gateway's `--record-trace` writer is prefixgate/telemetry/trace_recorder.py):

* `traces`    readers: ShareGPT, Mooncake, prefixgate's recorded traces; token synthesis
* `targets`   where turns go: a prefixgate gateway (gRPC) or an OpenAI-compatible server
* `loadgen`   arrival modes (open / closed / Poisson), bounded in turns and time
* `metrics`   TTFT / ITL / E2E percentiles, hit rate, load balance, errors, throughput
* `report`    JSON, Markdown and PNG plots of one or more runs
* `plan`      `FleetPlan`: the workers and gateways --simulate and --fleet both model
* `simulate`  routing simulator on the gateway's own routing and index code
* `fleet`     replay through real gateways in front of an emulated fleet
"""
