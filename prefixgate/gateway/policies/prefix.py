"""`prefix` (the default): the worker whose serving this turn costs the fewest seconds.

The rule (docs/routing.md, "The scoring rule"), per worker, at its measured rates:

    cost = load_weight   * (queue_s + decode_s)
         + prefix_weight * (prefill_s + miss_s)
         + work_weight   * work_s          (work_weight 0 by default: off)

  queue_s    prefill queued ahead: queued prefill tokens / the worker's rate
  prefill_s  this turn's uncached prompt tokens / the worker's rate
  decode_s   the decode work running there that delays this prefill: engine steps the
             prefill needs (tokens / prefill_chunk_tokens) x the measured decode step,
             where steps interleave; without a measured step, running_weight
             token-equivalents per running sequence
  miss_s     what the choice costs later: the cached tokens it forgoes against the
             best-cached worker are prefilled again here and evict as many of this
             worker's once its cache is full; each evicted token costs its prefill again
             as often as evicted tokens are asked for again (`Candidates.reuse`, measured
             by the router: re-prefills per evicted token, Router._measure_reuse; the
             evicted ones are the least recently used, not average cached ones):
               miss_s = (best - credited) / rate x reuse x kv_fill
  work_s     what the choice costs the turns after it: the seconds of delay the prefill it
             adds imposes on them. Choosing w adds W = prefill_s of work to w's queue. A
             turn that arrives at w while w works through the wait_s (queue_s + decode_s)
             ahead of this one queues behind W and waits all of it; one arriving during W
             waits what is left of it, W/2 on average. With turns arriving at w at
             lambda_w per second, that is lambda_w x wait_s turns delayed W and
             lambda_w x W turns delayed W/2:
               work_s = lambda_w x W x (wait_s + W/2)
             lambda_w = the router's measured arrival rate (turns/s, Router.
             arrival_rate_per_s) / the number of candidate workers: the fleet's share a
             worker sees, the same for every worker, not each worker's own recent share,
             which the routing itself sets (a worker that drew no turns lately would read
             as free to load, whatever comes next). The term weighs only what differs
             between choices: a turn that finds its prefix cached adds little W anywhere;
             one that recomputes a prefix its holder is still prefilling (the holder's
             wait_s then is about that prefill, so waiting or recomputing cost this turn
             alike) adds the whole prefix to a second worker and is charged for every turn
             behind it. It vanishes at low load (lambda_w -> 0 and wait_s -> 0) and grows
             with the queue under saturation. It is first order: below saturation
             (lambda_w x mean service = rho < 1) the delay also reaches turns arriving in
             the rest of w's busy period, about 1/(1 - rho) times these, and at rho >= 1
             every later turn (the queue never drains); charging that tail would make the
             rule swing on a noisy estimate of rho near 1, while wait_s already grows with
             the backlog that saturation builds, so the term grows with it. Behind several
             gateway replicas, each measures the turns it routes (about 1/replicas of the
             fleet's) and so charges that share of the delay: less than all of it, never
             more. A pull is charged the same way for the rest it computes (its transfer
             does not occupy the worker's prefill).
  pull       a third way to serve on a worker: pull the leading blocks it lacks from a
             holder (block transfer), then prefill the rest; the queue ahead drains while
             the blocks come, so only the part of the transfer it does not hide is paid:
               transfer_s = export_queued_bytes(holder) / bw + setup_s(worker)
                            + pulled tokens x kv_bytes_per_token / bw
               cost = load_weight x wait_s
                    + prefix_weight x (max(0, transfer_s - wait_s) + rest_s + miss_s)
                    + work_weight x lambda_w x rest_s x (wait_s + rest_s / 2)
             bw: the slower end's rate; holders: workers whose *events* (not predictions)
             say they hold more leading blocks, at the same KV bytes per token.

Shared prefixes: a match that ends where `spread_fanout` or more continuations are indexed
(a system prompt other conversations share) is credited at `shared_prefix_weight` on
workers whose cache holds more than (1 + occupancy_slack) x the mean indexed blocks:
holding a popular prefix is no reason to attract a new conversation.

Ties: costs closer than half a block of prefill at the worker's rate go, in order, to the
conversation's previous worker, the less loaded, the emptier cache, a rendezvous hash of
the conversation (or first block), the worker id.
"""

from __future__ import annotations

from collections.abc import Iterator

from prefixgate.gateway.policies.base import (
    Candidates,
    Pull,
    Ranking,
    RoutingPolicy,
    WorkerLoad,
    measured_rate,
    rendezvous,
)


def work_s(arrivals_per_s: float, prefill_s: float, wait_s: float) -> float:
    """Seconds of delay that `prefill_s` of prefill added to a worker imposes on the turns
    arriving there after this one (the module docstring's work_s): those arriving while
    the `wait_s` ahead of it runs wait all of it, those arriving during it half of it on
    average: arrivals_per_s x prefill_s x (wait_s + prefill_s / 2). 0 at no arrivals."""
    return arrivals_per_s * prefill_s * (wait_s + 0.5 * prefill_s)


class _Link:
    """One worker's end of a block transfer, as priced (`PrefixCost._links`)."""

    __slots__ = ("bytes_per_s", "kv_bytes_per_token", "queued_bytes", "setup_s")

    def __init__(self, bytes_per_s: float, kv_bytes_per_token: int, queued_bytes: int,
                 setup_s: float) -> None:
        self.bytes_per_s = bytes_per_s
        self.kv_bytes_per_token = kv_bytes_per_token
        self.queued_bytes = queued_bytes
        self.setup_s = setup_s


class PrefixCost(RoutingPolicy):
    """The module docstring's rule."""

    name = "prefix"

    def rank(self, c: Candidates) -> Ranking:
        cfg = self.config
        workers = c.workers
        credit = self._credit(c)
        best = max(credit.values(), default=0.0)
        prompt = c.turn.num_prompt_tokens
        rate = (measured_rate(workers, cfg.default_prefill_tokens_per_s)
                if cfg.measured_rates else
                {w.worker_id: cfg.default_prefill_tokens_per_s for w in workers})
        links, holders = self._links(c) if cfg.transfer else ({}, [])
        # Turns per second arriving at each worker: the fleet's share (work_s).
        per_worker = c.arrival_rate_per_s / max(1, len(workers)) * cfg.work_weight
        out = Ranking([])
        for w in workers:
            wid = w.worker_id
            r = rate[wid]
            miss_s = (best - credit[wid]) / r * c.reuse * min(1.0, w.kv_fill)
            rest = prompt - credit[wid]
            wait_s = self._wait_s(w, rest, r)
            out.cost_s[wid] = (cfg.load_weight * wait_s
                               + cfg.prefix_weight * (rest / r + miss_s)
                               + work_s(per_worker, rest / r, wait_s))
            for pull in self._pulls(w, credit[wid], links, holders):
                rest = prompt - credit[wid] - pull.num_tokens
                wait_s = self._wait_s(w, rest, r)
                cost = cfg.load_weight * wait_s + cfg.prefix_weight * (
                    max(0.0, pull.transfer_s - wait_s) + rest / r + miss_s) + work_s(
                    per_worker, rest / r, wait_s)
                if cost < out.cost_s[wid]:
                    out.cost_s[wid] = cost
                    out.pulls[wid] = pull
        out.ranked = self._order(c, out.cost_s,
                                 {wid: 0.5 * c.turn.block_size / r for wid, r in rate.items()})
        return out

    def _credit(self, c: Candidates) -> dict[str, float]:
        """The router's credit, a shared prefix discounted on fuller-than-average caches:
        the first holder of a system prompt does not collect every new conversation, while
        caches that are all full (the steady state under a working set larger than memory)
        keep following shared prefixes."""
        cfg = self.config
        if c.match is None or not c.match.shared:
            return c.credit
        occ = c.occupancy
        limit = (1 + cfg.occupancy_slack) * sum(occ.values()) / max(1, len(c.workers))
        return {wid: tokens * (cfg.shared_prefix_weight if occ.get(wid, 0) > limit else 1.0)
                for wid, tokens in c.credit.items()}

    def _wait_s(self, w: WorkerLoad, prefill_tokens: float, rate: float) -> float:
        """Seconds before this turn's prefill is done queuing on `w`: the prefill queued
        ahead, plus the decode work that delays it and this turn's `prefill_tokens`."""
        queued = w.num_queued_prefill_tokens
        total = queued + prefill_tokens
        step_s = w.decode_step_s if self.config.measured_rates else 0.0
        if step_s > 0:  # measured: decode delays prefill only where steps interleave
            chunk = w.prefill_chunk_tokens
            decode_s = (step_s * -(-total // chunk)
                        if chunk > 0 and w.num_running_requests else 0.0)
        else:
            decode_s = self.config.running_weight * w.num_running_requests / rate
        return queued / rate + decode_s

    @staticmethod
    def _links(c: Candidates) -> tuple[dict[str, _Link], list[tuple[str, float, int]]]:
        """Each worker's link (a worker that has measured no transfer rate or set-up
        counts at the mean of those that have) and the holders a pull may come from:
        (worker id, tokens its events say it holds, leading blocks), trusted ones only.
        Empty when no pull can be priced (no holder, no rate measured)."""
        if c.match is None or not c.certain:
            return {}, []
        measured = [w for w in c.workers if w.transfer_bytes_per_s > 0]
        if not measured:
            return {}, []
        mean_rate = sum(w.transfer_bytes_per_s for w in measured) / len(measured)
        mean_setup = sum(w.transfer_setup_s for w in measured) / len(measured)
        links = {w.worker_id: _Link(
            w.transfer_bytes_per_s or mean_rate, w.kv_bytes_per_token, w.export_queued_bytes,
            w.transfer_setup_s if w.transfer_bytes_per_s > 0 else mean_setup)
            for w in c.workers}
        n = len(c.turn.block_hashes)
        # A holder is credited at its confidence like any claim: one whose served turns
        # keep finding less than it claims is no source of KV either.
        holders = [(wid, tokens * c.trust.get(wid, 1.0),
                    min(c.match.cached_blocks[wid], n))
                   for wid, tokens in c.certain.items()
                   if wid in links and links[wid].kv_bytes_per_token > 0]
        return links, holders

    @staticmethod
    def _pulls(w: WorkerLoad, have: float, links: dict[str, _Link],
               holders: list[tuple[str, float, int]]) -> Iterator[Pull]:
        """Every pull into `w` (holding `have` tokens of the prompt) from a holder with more
        of it in the same KV layout."""
        me = links.get(w.worker_id)
        if me is None or me.kv_bytes_per_token <= 0:
            return
        for hid, tokens, blocks in holders:
            h = links[hid]
            if hid == w.worker_id or tokens <= have:
                continue
            if h.kv_bytes_per_token != me.kv_bytes_per_token:  # the receiver would refuse
                continue
            bw = min(me.bytes_per_s, h.bytes_per_s)  # the slower end sets the pace
            num_tokens = int(tokens - have)
            yield Pull(hid, blocks, num_tokens,
                       me.setup_s + (h.queued_bytes + num_tokens * me.kv_bytes_per_token) / bw)

    @staticmethod
    def _order(c: Candidates, cost_s: dict[str, float], tie_s: dict[str, float]) -> list:
        """Workers by cost, costs closer than `tie_s` counting as a tie.

        Cached prefixes count in whole blocks, so a real difference in what a turn finds
        cached is at least one block's prefill; anything smaller comes from the rates, and
        rates are measured (a running mean of tokens / seconds): identical workers report
        rates that differ by float noise. Comparing exact seconds would let that noise pick
        the worker every time and the tie-breakers would never run. Groups form in cost
        order: a worker within the tolerance of its group's cheapest joins it; each group
        is ordered by the tie-breakers."""
        key = c.key
        previous = c.previous

        def tie_key(w: WorkerLoad) -> tuple:
            wid = w.worker_id
            return (wid != previous, w.num_queued_prefill_tokens, w.num_running_requests,
                    c.occupancy.get(wid, 0), -rendezvous(key, wid) if key else 0, wid)

        ranked: list = []
        group: list = []
        for w in sorted(c.workers, key=lambda w: cost_s[w.worker_id]):
            if group:
                lead = group[0].worker_id
                if cost_s[w.worker_id] - cost_s[lead] >= max(tie_s[lead], tie_s[w.worker_id]):
                    ranked += sorted(group, key=tie_key)
                    group = []
            group.append(w)
        return ranked + sorted(group, key=tie_key)
