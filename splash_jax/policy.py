"""A transition-aware layout policy: switch only when the expected gain pays for the move.

Every `interval_steps` the engine asks `decide()`. The policy
  1. describes the current load (running requests, their cached tokens, the longest context),
  2. drops layouts that cannot hold it (the engine's own capacity accounting, with a margin),
  3. estimates each remaining layout's decode step time with a roofline cost model
     (bytes each device must read + bytes it must exchange, over the machine's bandwidths,
     taking the busiest device: owner layouts leave devices idle when requests < devices),
  4. switches to the cheapest layout only if the time it saves over `horizon_steps` exceeds the
     transition cost (bytes the switch would move over the interconnect) by `min_gain`, and no
     switch happened in the last `cooldown_steps`.
The cost model is analytic (DESIGN.md §2, §6 numbers); it has not been calibrated on a
multi-GPU machine yet, so its constants are fields to tune, not measurements.
"""

from __future__ import annotations

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
    cooldown_steps: int = 64  # steps after a switch before another is considered
    capacity_margin: float = 0.1  # keep this fraction of a layout's pool free
    hbm_bytes_per_s: float = 4.3e12  # per device (H200, measured by copy)
    link_bytes_per_s: float = 450e9  # per device per direction (NVLink)


@dataclasses.dataclass(frozen=True)
class Load:
    requests: int
    cached_tokens: int  # over all running requests
    max_context: int

    @classmethod
    def of(cls, engine) -> "Load":
        running = engine.scheduler.running
        return cls(len(running), sum(r.num_tokens for r in running), max((r.num_tokens for r in running), default=0))


class CostModel:
    """Decode step time per layout from bytes read and bytes exchanged by the busiest device."""

    def __init__(self, engine, config: PolicyConfig):
        cfg = engine.model_config
        self.n = engine.n
        self.config = config
        self.layers = cfg.num_layers
        self.heads = cfg.num_heads
        self.hidden = cfg.hidden_size
        self.kv_bytes_per_token = cfg.num_layers * cfg.latent_dim * engine.executor.pool.latent[0].dtype.itemsize
        self.head_bytes = engine.head_sharded_bytes
        self.dtype_bytes = engine.executor.pool.latent[0].dtype.itemsize
        self.other_weight_bytes = self._other_weight_bytes(engine)

    @staticmethod
    def _other_weight_bytes(engine) -> float:
        import jax

        total = sum(x.nbytes for _, x in engine.executor.param_items())
        return (total - engine.head_sharded_bytes) / engine.n  # FFN/embeddings: sharded in every layout

    def step_seconds(self, layout: Layout, load: Load) -> float:
        n, c = self.n, self.config
        if load.requests == 0:
            return 0.0
        weights = self.other_weight_bytes + (self.head_bytes / n if layout.heads_sharded else self.head_bytes)
        kv = layout.kv_placement.cached_bytes_read(load.cached_tokens, load.requests, n)
        read = weights + kv * self.kv_bytes_per_token
        t = load.requests  # one query token per running request
        q = t * self.heads * 576 * self.dtype_bytes  # absorbed query / latent output rows
        exchange = {
            "tp": 2 * t * self.hidden * self.dtype_bytes,  # all-reduce
            "dp": t * self.hidden * self.dtype_bytes,  # all-gather of owner rows
            "dop": 2 * q + 2 * t * self.hidden * self.dtype_bytes,  # 2 all-to-alls + reduce-scatter/gather
            "cp": q + q + t * self.hidden * self.dtype_bytes,  # all-gather q, all-to-all partials, all-reduce
        }[layout.name] * self.layers * (n - 1) / n
        return read / c.hbm_bytes_per_s + (exchange / c.link_bytes_per_s if n > 1 else 0.0)

    def switch_seconds(self, src: Layout, dst: Layout, load: Load) -> float:
        """Bytes a switch moves between devices (the cache it copies, weights it gathers) over the link."""
        cache = load.cached_tokens * copies_per_page(src.kv_placement, dst.kv_placement, self.n)
        weights = self.head_bytes * (self.n - 1) / self.n if (src.heads_sharded and not dst.heads_sharded) else 0
        return (cache * self.kv_bytes_per_token + weights) / self.config.link_bytes_per_s


class TransitionAwarePolicy:
    def __init__(self, engine, config: PolicyConfig | None = None):
        self.engine = engine
        self.config = config or PolicyConfig()
        self.model = CostModel(engine, self.config)
        self.last_switch_step = -10**9
        self.decisions: list[dict] = []

    def feasible(self, load: Load) -> list[str]:
        ok = []
        for name in LAYOUTS:
            capacity = self.engine.kv_capacity_tokens(name) * (1 - self.config.capacity_margin)
            fits_one_device = load.max_context <= self.engine.allocator.pages_per_device * self.engine.config.page_size
            if load.cached_tokens <= capacity and (fits_one_device or LAYOUTS[name].kv_placement is STRIPED):
                ok.append(name)
        return ok

    def decide(self, step: int) -> str | None:
        """The layout to switch to now, or None."""
        engine, c = self.engine, self.config
        if step - self.last_switch_step < c.cooldown_steps:
            return None
        load = Load.of(engine)
        current = engine.layout
        options = self.feasible(load)
        if not options:
            return None
        costs = {name: self.model.step_seconds(LAYOUTS[name], load) for name in options}
        best = min(costs, key=costs.get)
        if best == current.name:
            return None
        saving = ((costs.get(current.name, float("inf"))) - costs[best]) * c.horizon_steps
        move = self.model.switch_seconds(current, LAYOUTS[best], load)
        record = {"step": step, "load": dataclasses.asdict(load), "costs_s": costs, "from": current.name,
                  "to": best, "saving_s": saving, "switch_s": move}
        if current.name not in options or saving > move * (1 + c.min_gain):
            self.decisions.append(record)
            self.last_switch_step = step
            log.info("policy: %s -> %s (%s)", current.name, best, record)
            return best
        return None
