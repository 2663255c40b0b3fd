"""A transition-aware layout policy: switch only when the expected gain pays for the move.

Every `interval_steps` the engine asks `decide()`. The policy
  1. describes the load: running requests and their cached tokens, the longest context, and the
     requests waiting for admission;
  2. drops layouts that cannot hold the running requests (the engine's own capacity accounting,
     with a margin) and says why;
  3. for each remaining layout, counts the requests it would run (the running ones plus the
     waiting ones its free capacity admits, in queue order: DOP's larger pool admits more) and
     estimates its decode step time, from a measured calibration table when
     `calibration` names one (splash_jax/calibration.py), else from a roofline (bytes the busiest
     device reads over HBM bandwidth + bytes it exchanges over the link);
  4. ranks layouts by seconds per output token over `horizon_steps`: that many decode steps of
     the batch plus the prefill of every prompt token still to compute (waiting requests and
     running ones mid-prompt; calibrated only: a layout's prefill speed decides bursts of long
     prompts). It switches to the best one only if that is `min_step_gain` cheaper per token than
     the current layout (gains inside the cost model's own error are noise), the time it saves
     over the horizon exceeds the switch cost (measured per pair when calibrated, else bytes moved
     over the link) by `min_gain`, and no switch happened in the last `cooldown_steps`.
     Leaving a layout that can no longer hold the load is always allowed.
It looks every `interval_steps` and, with `evaluate_on_arrival`, at the first step after new
requests arrive (a burst is judged before its prompts are cached in the wrong layout).
Every evaluation is kept (the last `history` of them) with its per-layout estimates, so the log
and `summary()` say why the policy switched or stayed.
"""

from __future__ import annotations

import collections
import dataclasses
import logging

from splash_jax.kv.placement import STRIPED, copies_per_page
from splash_jax.mesh.layouts import LAYOUTS, Layout

log = logging.getLogger(__name__)


@dataclasses.dataclass
class PolicyConfig:
    interval_steps: int = 16  # how often the policy looks
    horizon_steps: int = 256  # steps over which a gain must repay the switch
    min_gain: float = 0.2  # the saving must exceed the switch cost by this fraction
    min_step_gain: float = 0.1  # the best layout must be this fraction cheaper per token (calibrated held-out error on 2 x H200: 9% median)
    evaluate_on_arrival: bool = True  # also look at the first step after new requests arrive
    cooldown_steps: int = 64  # steps after a switch before another is considered
    capacity_margin: float = 0.1  # keep this fraction of a layout's pool free
    hbm_bytes_per_s: float = 4.3e12  # roofline only: per device (H200, measured by copy)
    link_bytes_per_s: float = 450e9  # roofline only: per device per direction (NVLink)
    calibration: str = ""  # measured cost table (benchmarks/calibrate.py); empty = roofline model
    history: int = 64  # evaluations kept for summary()


@dataclasses.dataclass(frozen=True)
class Load:
    requests: int
    cached_tokens: int  # over all running requests
    max_context: int
    waiting: tuple[int, ...] = ()  # tokens of each waiting request, in queue order
    prompts: tuple[tuple[int, int], ...] = ()  # (computed, still to compute) of every unfinished prompt
    # Distinct tokens the running requests' pages hold (a prefix they share counted once per copy the
    # current layout keeps: dp/dop once per owner); 0 = cached_tokens (no sharing known).
    pool_tokens: int = 0

    @classmethod
    def of(cls, engine) -> "Load":
        """The engine's load now. With prefix caching, a waiting request's prompt counts only the
        tokens its cached prefix does not cover (what admission will compute), and the pool holds
        what the running requests' pages hold, shared pages once."""
        sched = engine.scheduler
        running, waiting = sched.running, sched.waiting
        prompts = tuple((r.num_computed, r.num_tokens - r.num_computed) for r in running
                        if r.num_tokens - r.num_computed > 1)
        prompts += tuple((c, r.num_tokens - c) for r in waiting for c in (sched.cached_prefix(r),)
                         if r.num_tokens - c > 1)
        held = engine.allocator.num_referenced() * engine.config.page_size // engine.layout.kv_placement.distinct_copies(engine.n)
        return cls(
            len(running), sum(r.num_tokens for r in running), max((r.num_tokens for r in running), default=0),
            tuple(r.num_tokens for r in waiting), prompts, held if sched.cache is not None else 0,
        )

    @property
    def held_tokens(self) -> int:
        return self.pool_tokens or self.cached_tokens

    def summary(self) -> dict:
        return {"requests": self.requests, "cached_tokens": self.cached_tokens, "pool_tokens": self.held_tokens,
                "max_context": self.max_context,
                "waiting": len(self.waiting), "prompt_tokens_left": sum(t for _, t in self.prompts)}


@dataclasses.dataclass(frozen=True)
class Estimate:
    layout: str
    batch: int  # requests it would run (running + waiting it admits)
    step_s: float
    s_per_token: float  # (horizon decode steps + prefill left) / tokens the batch outputs over the horizon
    source: str  # grid | fit | roofline
    prefill_s: float = 0.0  # the prompt tokens still to compute, at this layout's prefill speed

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


class RooflineCosts:
    """Decode step time from bytes read and bytes exchanged by the busiest device (uncalibrated)."""

    def __init__(self, engine, config: PolicyConfig):
        cfg = engine.model_config
        self.n = engine.n
        self.config = config
        self.layers = cfg.num_layers
        self.heads = cfg.num_heads
        self.hidden = cfg.hidden_size
        self.dtype_bytes = engine.executor.pool.latent.dtype.itemsize
        # every pool layer's latent is read each step: the MTP layer's too (its draft program attends)
        self.kv_bytes_per_token = engine.pool_config.num_layers * cfg.latent_dim * self.dtype_bytes
        self.head_bytes = engine.head_sharded_bytes
        total = sum(x.nbytes for _, x in engine.executor.param_items())
        self.other_weight_bytes = (total - engine.head_sharded_bytes) / engine.n  # sharded in every layout

    def step_seconds(self, layout: Layout, requests: int, cached_tokens: float) -> tuple[float, str]:
        n, c = self.n, self.config
        if requests == 0:
            return 0.0, "roofline"
        weights = self.other_weight_bytes + (self.head_bytes / n if layout.heads_sharded else self.head_bytes)
        kv = layout.kv_placement.cached_bytes_read(cached_tokens, requests, n)
        read = weights + kv * self.kv_bytes_per_token
        t = requests  # one query token per running request
        q = t * self.heads * 576 * self.dtype_bytes  # absorbed query / latent output rows
        exchange = {
            "tp": 2 * t * self.hidden * self.dtype_bytes,  # all-reduce
            "dp": t * self.hidden * self.dtype_bytes,  # all-gather of owner rows
            "dop": 2 * q + 2 * t * self.hidden * self.dtype_bytes,  # 2 all-to-alls + reduce-scatter/gather
            "cp": q + q + t * self.hidden * self.dtype_bytes,  # all-gather q, all-to-all partials, all-reduce
        }[layout.name] * self.layers * (n - 1) / n
        return read / c.hbm_bytes_per_s + (exchange / c.link_bytes_per_s if n > 1 else 0.0), "roofline"

    def prefill_seconds(self, layout: Layout, prompts, budget: int) -> float:
        """Not modelled: every layout computes the same prompt FLOPs (ranked by decode alone)."""
        return 0.0

    def switch_seconds(self, src: Layout, dst: Layout, cached_tokens: float) -> float:
        """Cache the switch copies and weights it gathers, over the link."""
        cache = cached_tokens * copies_per_page(src.kv_placement, dst.kv_placement, self.n)
        weights = self.head_bytes * (self.n - 1) / self.n if (src.heads_sharded and not dst.heads_sharded) else 0
        return (cache * self.kv_bytes_per_token + weights) / self.config.link_bytes_per_s


class CalibratedCosts:
    """Step and switch times from a measured calibration table (splash_jax/calibration.py)."""

    def __init__(self, calibration, n: int, table=None):
        from splash_jax.calibration import StepTable

        if table is None and calibration.devices != n:
            raise ValueError(f"the calibration is for {calibration.devices} devices, the engine has {n}")
        self.cal = calibration
        self.table = table or StepTable(calibration)
        self.n = n
        self.kv_bytes_per_token = calibration.model["kv_bytes_per_token"]

    def step_seconds(self, layout: Layout, requests: int, cached_tokens: float) -> tuple[float, str]:
        if requests == 0:
            return 0.0, "grid"
        return self.table.seconds(layout.name, requests, cached_tokens / requests)

    def switch_seconds(self, src: Layout, dst: Layout, cached_tokens: float) -> float:
        measured = self.cal.switch.get(f"{src.name}->{dst.name}")
        cache = cached_tokens * copies_per_page(src.kv_placement, dst.kv_placement, self.n) * self.kv_bytes_per_token
        if measured is None:  # pair not measured: its bytes over the measured link
            return cache / self.cal.link_bytes_per_s if self.cal.link_bytes_per_s else 0.0
        rate = measured.bytes_per_s or self.cal.link_bytes_per_s
        # A line fitted through two loads can cross zero below the smaller one: a switch is never free.
        return max(measured.fixed_s, 0.0) + (cache / rate if rate and cache else 0.0)

    def prefill_seconds(self, layout: Layout, prompts, budget: int) -> float:
        """The measured prefill line over every unfinished prompt, in chunks of `budget` tokens."""
        return self.table.prefill_seconds(layout.name, prompts, budget)


class CostModel:
    """The policy's cost model: calibrated when `config.calibration` names a file, else roofline."""

    def __init__(self, engine, config: PolicyConfig, calibration=None, table=None):
        if calibration is None and config.calibration:
            from splash_jax.calibration import Calibration

            calibration = Calibration.load(config.calibration)
        self.costs = CalibratedCosts(calibration, engine.n, table) if calibration is not None else RooflineCosts(engine, config)
        self.kind = f"calibrated ({config.calibration or 'table'})" if calibration is not None else "roofline"

    def estimate(self, layout: Layout, requests: int, cached_tokens: float) -> tuple[float, str]:
        return self.costs.step_seconds(layout, requests, cached_tokens)

    def step_seconds(self, layout: Layout, load: Load) -> float:
        return self.estimate(layout, load.requests, load.cached_tokens)[0]

    def switch_seconds(self, src: Layout, dst: Layout, load: Load) -> float:
        return self.costs.switch_seconds(src, dst, load.held_tokens)  # a shared page moves once

    def prefill_seconds(self, layout: Layout, load: Load, budget: int) -> float:
        return self.costs.prefill_seconds(layout, load.prompts, budget)


class TransitionAwarePolicy:
    """Reads from its engine only: scheduler.running/waiting/num_added, layout, n,
    kv_capacity_tokens(), allocator.pages_per_device, config.page_size, config.max_num_seqs and
    config.max_num_batched_tokens (the simulator provides the same attributes)."""

    def __init__(self, engine, config: PolicyConfig | None = None, calibration=None, table=None):
        self.engine = engine
        self.config = config or PolicyConfig()
        self.model = CostModel(engine, self.config, calibration, table)
        self.last_switch_step = -10**9
        self._arrivals_seen = -1
        self.decisions: list[dict] = []  # the switches it asked for
        self.recent: collections.deque[dict] = collections.deque(maxlen=self.config.history)  # every evaluation

    def capacity(self, name: str) -> float:
        return self.engine.kv_capacity_tokens(name) * (1 - self.config.capacity_margin)

    def infeasible(self, load: Load) -> dict[str, str]:
        """Layouts that cannot hold the running requests, with the reason."""
        out = {}
        one_device = self.engine.allocator.pages_per_device * self.engine.config.page_size
        for name in LAYOUTS:
            if load.held_tokens > self.capacity(name):
                out[name] = f"{load.held_tokens} cached tokens > {self.capacity(name):.0f} usable"
            elif load.max_context > one_device and LAYOUTS[name].kv_placement is not STRIPED:
                out[name] = f"a {load.max_context}-token context exceeds one device's {one_device}"
        return out

    def feasible(self, load: Load) -> list[str]:
        bad = self.infeasible(load)
        return [name for name in LAYOUTS if name not in bad]

    def batch(self, name: str, load: Load) -> tuple[int, int]:
        """(requests, cached tokens) layout `name` would run: the running ones plus the waiting ones
        its free capacity and request limit admit, in queue order."""
        requests, tokens = load.requests, load.cached_tokens
        room = self.capacity(name) - load.held_tokens
        for t in load.waiting:
            if requests >= self.engine.config.max_num_seqs or t > room:
                break
            requests, tokens, room = requests + 1, tokens + t, room - t
        return requests, tokens

    def estimates(self, load: Load) -> dict[str, Estimate]:
        out, h = {}, self.config.horizon_steps
        budget = self.engine.config.max_num_batched_tokens
        for name in self.feasible(load):
            b, tokens = self.batch(name, load)
            step, source = self.model.estimate(LAYOUTS[name], b, tokens)
            prefill = self.model.prefill_seconds(LAYOUTS[name], load, budget)
            out[name] = Estimate(name, b, step, (h * step + prefill) / (h * b) if b else 0.0, source, prefill)
        return out

    def due(self, step: int) -> bool:
        """Whether to evaluate at this step: every `interval_steps`, and (with
        `evaluate_on_arrival`) at the first step after requests were added."""
        added = self.engine.scheduler.num_added
        arrived = self.config.evaluate_on_arrival and added != self._arrivals_seen
        self._arrivals_seen = added
        return arrived or step % self.config.interval_steps == 0

    def decide(self, step: int) -> str | None:
        """The layout to switch to now, or None."""
        c = self.config
        if step - self.last_switch_step < c.cooldown_steps:
            return None
        load = Load.of(self.engine)
        if load.requests == 0 and not load.waiting:
            return None  # nothing to run: any layout is as good, and a switch now costs nothing later
        current = self.engine.layout
        est = self.estimates(load)
        record = {"step": step, "from": current.name, "load": load.summary(),
                  "estimates": {k: e.as_dict() for k, e in est.items()}, "infeasible": self.infeasible(load),
                  "cost_model": self.model.kind}
        if not est:
            self._keep(record | {"action": "stay", "reason": "no layout holds the running requests"})
            return None
        best = min(est, key=lambda k: (est[k].s_per_token, k != current.name))
        if best == current.name:
            self._keep(record | {"action": "stay", "to": best, "reason": f"{best} is the cheapest per token"})
            return None
        cur = est.get(current.name)
        saving = c.horizon_steps * est[best].batch * ((cur.s_per_token if cur else float("inf")) - est[best].s_per_token)
        move = self.model.switch_seconds(current, LAYOUTS[best], load)
        record |= {"to": best, "saving_s": saving, "switch_s": move}
        if cur is not None and est[best].s_per_token > (1 - c.min_step_gain) * cur.s_per_token:
            gain = 1 - est[best].s_per_token / cur.s_per_token
            self._keep(record | {"action": "stay", "reason": f"{best} is {gain:.1%} cheaper per token, under {c.min_step_gain:.0%}"})
            return None
        if cur is None or saving > move * (1 + c.min_gain):
            why = f"{current.name} cannot hold the load" if cur is None else (
                f"saves {saving:.4g}s over {c.horizon_steps} steps > switch {move:.4g}s x {1 + c.min_gain:g}")
            record |= {"action": "switch", "reason": why}
            self._keep(record)
            self.decisions.append(record)
            self.last_switch_step = step
            log.info("policy: %s -> %s at step %d: %s (%s)", current.name, best, step, why, _brief(est))
            return best
        self._keep(record | {"action": "stay", "reason": f"saving {saving:.4g}s does not repay switch {move:.4g}s x {1 + c.min_gain:g}"})
        return None

    def switch_refused(self, reason: str) -> None:
        """The controller refused the switch just decided (e.g. the destination cannot hold the
        requests): the decision is marked, and the cooldown still applies so it is not retried
        every interval."""
        if self.decisions:
            self.decisions[-1] |= {"action": "refused", "refused_reason": reason}
        log.info("policy: switch refused: %s", reason)

    def _keep(self, record: dict) -> None:
        self.recent.append(record)
        log.debug("policy at step %d: %s (%s)", record["step"], record["action"], record["reason"])

    def summary(self, last: int = 8) -> dict:
        """What stats() shows: the cost model, the last switches and the last evaluation."""
        return {"cost_model": self.model.kind, "switches": self.decisions[-last:],
                "last_evaluation": self.recent[-1] if self.recent else None}


def _brief(est: dict[str, Estimate]) -> str:
    return ", ".join(f"{k}: {e.step_s * 1e3:.3g} ms/step x{e.batch} [{e.source}]" for k, e in est.items())
