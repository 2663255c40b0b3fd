"""DeepSeek mixture-of-experts: the router (V2 softmax / V3 sigmoid with bias) and the experts.

Experts are stacked [E, ...] so one sharding rule ("shard the expert axis") places them.
Experts may be sharded over devices (each holds a contiguous range); ids outside the local
range get weight 0 and the caller sums the partial results.
The routed experts have several exact implementations, picked in Python from static shapes and
the backend by `resolve_moe_impl` (like `attention/dispatch.py`; `RuntimeOptions.moe_impl`, the
engine's `--moe-impl`):

  "xla"      the XLA reference, itself two paths by token count: with very few tokens
             (4 * tokens * top_k <= experts) only the chosen experts' weights are gathered
             ("gathered"); otherwise every expert runs over every token with a sparse combine
             weight ("dense"). Any backend; the reference for the others.
  "pallas"   GPU: `pallas_kernels.moe_grouped`, (token, k) pairs grouped into expert tiles, a
             Triton grouped GEMM that reads each routed expert once (gate/up + SiLU + weight
             fused, then down); other devices' pairs cost nothing. CPU: interpret mode (tests).
  "ragged"   the same grouping through XLA's `lax.ragged_dot_general` (any backend).
  "mgpu"     the grouping through jax's Mosaic GPU `ragged_dot_mgpu` (Hopper only).
  "auto"     GPU -> the measured winner per token count (MOE_AUTO_GPU); elsewhere "xla".
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from splash_jax.layers import MLP, init_param
from splash_jax.model_config import ModelConfig

MOE_IMPLS = ("auto", "xla", "gathered", "dense", "pallas", "ragged", "mgpu")
# GPU winner for "auto" by tokens per step: (max tokens, impl), first match wins. From
# benchmarks/moe.py on an H200 (V2-Lite and V3-width layers, 1-512 tokens, 1 and 2 GPUs).
MOE_AUTO_GPU = ((1 << 30, "pallas"),)


def resolve_moe_impl(impl: str, backend: str, num_tokens: int, top_k: int, num_local: int,
                     hidden: int, inter: int, scale_block: int = 0) -> str:
    """The concrete routed-expert path for static shapes on `backend`; unknown names fail.

    "xla" resolves to "gathered" or "dense" by the token count, so the result is always the path
    that runs. "auto" picks the Pallas grouped kernel on GPU for shapes it takes, else XLA.
    """
    if impl not in MOE_IMPLS:
        raise ValueError(f"unknown MoE implementation {impl!r}; choose from {MOE_IMPLS}")
    if impl == "auto":
        impl = "xla"
        if backend == "gpu":
            from pallas_kernels.moe_grouped import supports

            if supports(hidden, inter, scale_block):
                impl = next(name for limit, name in MOE_AUTO_GPU if num_tokens <= limit)
    if impl == "xla":
        impl = "gathered" if 4 * num_tokens * top_k <= num_local else "dense"
    return impl


def sort_pairs(ids: jax.Array, num_local: int):
    """(token, k) pairs sorted by local expert, other devices' pairs last and in no group.

    Returns (order [P] pair index per sorted row, group_sizes [E] int32)."""
    flat = ids.reshape(-1)
    key = jnp.where((flat >= 0) & (flat < num_local), flat, num_local)
    order = jnp.argsort(key, stable=True)
    sizes = jnp.zeros(num_local + 1, jnp.int32).at[key].add(1)[:num_local]
    return order, sizes


def _unsort(y, order, ids, num_local, num_tokens, top_k):
    """Rows of sorted pairs back to tokens; rows outside every group are masked (never summed)."""
    flat = ids.reshape(-1)
    valid = ((flat >= 0) & (flat < num_local))[order]
    y = jnp.where(valid[:, None], y.astype(jnp.float32), 0.0)
    return jnp.zeros((num_tokens, y.shape[1]), jnp.float32).at[order // top_k].add(y)


def ragged_routed(x, ids, weights, gate, up, down):
    """Grouped GEMM by XLA's ragged dot; gate/up/down read in their stored [E, I, D] layout."""
    t, k = ids.shape
    num_local = gate.shape[0]
    order, sizes = sort_pairs(ids, num_local)
    xs = x[order // k].astype(gate.dtype)
    nt = jax.lax.RaggedDotDimensionNumbers((((1,), (2,)), ((), ())), [0], [0])
    nn = jax.lax.RaggedDotDimensionNumbers((((1,), (1,)), ((), ())), [0], [0])
    g = jax.lax.ragged_dot_general(xs, gate, sizes, nt, preferred_element_type=jnp.float32)
    u = jax.lax.ragged_dot_general(xs, up, sizes, nt, preferred_element_type=jnp.float32)
    h = (jax.nn.silu(g) * u * weights.reshape(-1)[order][:, None].astype(jnp.float32)).astype(gate.dtype)
    y = jax.lax.ragged_dot_general(h, down, sizes, nn, preferred_element_type=jnp.float32)
    return _unsort(y, order, ids, num_local, t, k).astype(x.dtype)


def mgpu_routed(x, ids, weights, gate, up, down, block_m=64, block_n=128, block_k=64, steps=4):
    """Grouped GEMM by jax's Mosaic GPU `ragged_dot_mgpu` (Hopper). Rows of other devices'
    pairs lie past every group: the kernel never stores them and `_unsort` masks them."""
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    t, k = ids.shape
    num_local = gate.shape[0]
    order, sizes = sort_pairs(ids, num_local)
    xs = x[order // k].astype(gate.dtype)
    rd = lambda a, b, n, tr: ragged_dot_mgpu.ragged_dot(  # noqa: E731
        a, b, group_sizes=sizes, block_m=block_m, block_n=min(block_n, n), block_k=block_k,
        max_concurrent_steps=steps, grid_block_n=1, transpose_rhs=tr)
    inter, dim = gate.shape[1], gate.shape[2]
    g = rd(xs, gate, inter, True).astype(jnp.float32)
    u = rd(xs, up, inter, True).astype(jnp.float32)
    h = (jax.nn.silu(g) * u * weights.reshape(-1)[order][:, None]).astype(gate.dtype)
    y = rd(h, down, dim, False)
    return _unsort(y, order, ids, num_local, t, k).astype(x.dtype)


def route(cfg: ModelConfig, logits: jax.Array, bias: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """Router logits [T, E] (float32) -> (top-k expert ids [T, k], combine weights [T, k]).

    Exactly transformers' two routers (the parity reference):
    - DeepseekV2 (softmax; greedy or group_limited_greedy): groups scored by their best expert,
      the other groups' scores set to 0.0, weights read from those masked scores, never renormalized;
    - DeepseekV3 (sigmoid; noaux_tc): choice = score + e_score_correction_bias, groups scored by the
      sum of their top-2 choices, the other groups set to -inf (transformers >= 5 and DeepSeek's own
      inference code; older transformers and the hub's remote code used 0.0), weights from the
      unbiased scores, renormalized when norm_topk_prob.
    Ties break toward the lower expert id in both (lax.top_k and torch.topk on CPU).
    """
    num_tokens, num_experts = logits.shape
    k = cfg.num_experts_per_tok
    v3 = cfg.topk_method == "noaux_tc"
    scores = jax.nn.sigmoid(logits) if cfg.scoring_func == "sigmoid" else jax.nn.softmax(logits, axis=-1)
    choice = scores + bias if (v3 and bias is not None) else scores
    if cfg.topk_method != "greedy" and cfg.n_group > 1:
        grouped = choice.reshape(num_tokens, cfg.n_group, num_experts // cfg.n_group)
        group_score = jax.lax.top_k(grouped, 2)[0].sum(-1) if v3 else grouped.max(-1)
        _, top_groups = jax.lax.top_k(group_score, cfg.topk_group)
        keep = jnp.zeros((num_tokens, cfg.n_group), bool).at[jnp.arange(num_tokens)[:, None], top_groups].set(True)
        keep = jnp.repeat(keep, num_experts // cfg.n_group, axis=1)
        choice = jnp.where(keep, choice, -jnp.inf if v3 else 0.0)
    _, ids = jax.lax.top_k(choice, k)
    weights = jnp.take_along_axis(scores if v3 else choice, ids, axis=-1)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return ids, weights * cfg.routed_scaling_factor


SMALL_ROUTER_TOKENS = 64
# Backends where the router's selection runs as one Pallas kernel (pallas_kernels/moe_route.py,
# equal to `route`); elsewhere the XLA `route` above.
ROUTE_KERNEL_BACKENDS = ("gpu",)


def router_logits(x, router):
    """Router logits in float32 ([T, D] x [D, E]). Up to SMALL_ROUTER_TOKENS rows as one fused
    multiply-and-reduce: as a float32 GEMM, XLA ran 8 rows x 64 experts as one cuBLAS tile looping
    over D (20 us per layer on an H200, 0.5 ms per V2-Lite decode step)."""
    xf = x.astype(jnp.float32)
    if x.shape[0] <= SMALL_ROUTER_TOKENS:
        return jnp.sum(xf[:, :, None] * router.astype(jnp.float32)[None], axis=1)
    return jnp.dot(xf, router)


EXPERT_FORMATS = ("model", "fp8")  # routed experts in the model dtype, or FP8 e4m3 + block scales
FP8_SCALE_BLOCK = 128  # DeepSeek's weight_block_size (square); used when a checkpoint has none


def fp8_scale_block(cfg: ModelConfig) -> int:
    """The square block of FP8 expert scales: the checkpoint's `weight_block_size`, else DeepSeek's."""
    if cfg.weight_quant is None:
        return FP8_SCALE_BLOCK
    rows, cols = cfg.weight_quant.block
    if rows != cols:
        raise ValueError(f"FP8 experts need square weight_block_size, got {[rows, cols]}; use --expert-weights model")
    return rows


def dequantize_blocks(values: jax.Array, scales: jax.Array, block: int, dtype) -> jax.Array:
    """[..., I, D] FP8 values * their [..., I/b, D/b] block scales, in `dtype` (the XLA paths)."""
    *_, rows, cols = values.shape
    full = jnp.repeat(jnp.repeat(scales, block, axis=-2, total_repeat_length=scales.shape[-2] * block), block,
                      axis=-1, total_repeat_length=scales.shape[-1] * block)[..., :rows, :cols]
    return (values.astype(jnp.float32) * full).astype(dtype)


class MoE(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs, expert_format: str = "model", impl: str = "auto"):
        e, d, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.cfg = cfg
        resolve_moe_impl(impl, "cpu", 1, 1, 1, 16, 16)  # an unknown name fails at construction
        self.impl = impl  # the routed-expert path when a call names none
        # The router scores only the real experts, so padded experts (array rows >= e) are never routed.
        self.router = init_param(rngs, (d, e), jnp.float32, std=d ** -0.5)
        if cfg.topk_method == "noaux_tc":
            self.router_bias = init_param(rngs, (e,), jnp.float32, std=0.0)
        e = cfg.arrays.n_routed_experts
        # All three [E, I, D] (gate/up as HF's [out, in]): on GPU the dense path then needs no
        # per-step relayout of the expert tensors (benchmarks/moe_paths.py measured 2x).
        if expert_format not in EXPERT_FORMATS:
            raise ValueError(f"unknown expert weight format {expert_format!r}; choose from {EXPERT_FORMATS}")
        # FP8: HBM holds 1 byte per expert weight (DeepSeek's checkpoints ship them so) and the
        # Pallas kernel applies each 128x128 block's scale to its partial products.
        self.scale_block = fp8_scale_block(cfg) if expert_format == "fp8" else 0
        for name in ("experts_gate", "experts_up", "experts_down"):
            if self.scale_block:
                b = self.scale_block
                values = init_param(rngs, (e, i, d), jnp.float32, std=1.0)[...].astype(jnp.float8_e4m3fn)
                setattr(self, name, nnx.Param(values))
                setattr(self, name + "_scale", nnx.Param(jnp.full((e, -(-i // b), -(-d // b)), 0.02, jnp.float32)))
            else:
                setattr(self, name, init_param(rngs, (e, i, d), dtype))
        if cfg.n_shared_experts:
            self.shared = MLP(d, cfg.arrays.shared_intermediate_size, dtype, rngs)

    def __call__(self, x, expert_offset=None, impl: str | None = None, layer=None, valid=None):
        """Routed + shared experts. With experts sharded, `expert_offset(num_local)` gives this
        device's first expert id and the result is this device's partial sum. `impl` picks the
        routed-expert path (module doc); the shared experts stay an XLA MLP (dense GEMMs that
        already run at HBM bandwidth; benchmarks/moe.py measures them). `layer`: see `routed`.
        `valid` [T] bool: rows that are real tokens; the others are routed to no expert (their
        routed output is 0), so a step's padding rows never make it read another expert."""
        cfg = self.cfg
        num_local = self.experts_gate.shape[-3]
        offset = expert_offset(num_local) if expert_offset else 0
        logits = router_logits(x, self.router[...])
        bias = self.router_bias[...] if cfg.topk_method == "noaux_tc" else None
        if jax.default_backend() in ROUTE_KERNEL_BACKENDS:  # one kernel instead of four (moe_route doc)
            from pallas_kernels.moe_route import route_local_for

            local, weights = route_local_for(cfg, logits, bias, valid, offset)
        else:
            ids, weights = route(cfg, logits, bias)
            local = ids - offset
            if valid is not None:
                local = jnp.where(valid[:, None], local, -1)  # -1: no device's expert
        out = self.routed(x, local, weights, impl or self.impl, layer)
        if cfg.n_shared_experts:
            out = out + self.shared(x)
        return out

    def routed(self, x, local, weights, impl: str | None = None, layer=None):
        """Routed experts for local ids [T,k] (outside [0, num_local): another device's expert).

        `layer` (int32 scalar, may be traced): the expert weights are a scanned group's stacked
        [L, E, I, D] and this is the layer to use. The Pallas kernel reads it from the stack in
        place; the XLA paths slice it out (what a scan over the weights would do)."""
        num_local, inter, dim = self.experts_gate.shape[-3:]
        backend = jax.default_backend()
        impl = resolve_moe_impl(impl or self.impl, backend, x.shape[0], local.shape[1], num_local, dim, inter, self.scale_block)
        experts = (self.experts_gate[...], self.experts_up[...], self.experts_down[...])
        scales = None
        if self.scale_block:
            scales = (self.experts_gate_scale[...], self.experts_up_scale[...], self.experts_down_scale[...])
        if impl == "pallas":
            from pallas_kernels.moe_grouped import routed_experts

            return routed_experts(x, local, weights, *experts, layer, scales, scale_block=self.scale_block,
                                  interpret=backend != "gpu")
        if layer is not None:
            experts = tuple(jax.lax.dynamic_index_in_dim(w, layer, keepdims=False) for w in experts)
            if scales:
                scales = tuple(jax.lax.dynamic_index_in_dim(s, layer, keepdims=False) for s in scales)
        if scales:  # XLA paths: dequantize this layer's experts (what a bf16 checkpoint would hold)
            experts = tuple(dequantize_blocks(w, s, self.scale_block, x.dtype) for w, s in zip(experts, scales))
        if impl == "ragged":
            return ragged_routed(x, local, weights, *experts)
        if impl == "mgpu":
            return mgpu_routed(x, local, weights, *experts)
        weights = jnp.where((local >= 0) & (local < num_local), weights, 0.0)
        local = jnp.clip(local, 0, num_local - 1)
        return _gathered(x, local, weights, *experts) if impl == "gathered" else _dense(x, local, weights, *experts)

    def _gathered(self, x, ids, weights):
        return _gathered(x, ids, weights, self.experts_gate[...], self.experts_up[...], self.experts_down[...])

    def _dense(self, x, ids, weights):
        return _dense(x, ids, weights, self.experts_gate[...], self.experts_up[...], self.experts_down[...])


def _gathered(x, ids, weights, gate, up, down):
    """Few tokens: read only the chosen experts' weights (decode at small batch is weight-read bound)."""
    gate, up, down = gate[ids], up[ids], down[ids]
    h = jax.nn.silu(jnp.einsum("td,tkid->tki", x, gate)) * jnp.einsum("td,tkid->tki", x, up)
    h = h * weights.astype(h.dtype)[..., None]
    return jnp.einsum("tki,tkid->td", h, down)


def _dense(x, ids, weights, gate, up, down):
    """Many tokens: every expert over every token with a sparse combine weight (exact)."""
    combine = jnp.zeros((x.shape[0], gate.shape[0]), jnp.float32)
    combine = combine.at[jnp.arange(x.shape[0])[:, None], ids].add(weights)
    h = jax.nn.silu(jnp.einsum("td,eid->tei", x, gate))
    h = h * jnp.einsum("td,eid->tei", x, up)
    h = h * combine.astype(h.dtype)[..., None]
    return jnp.einsum("tei,eid->td", h, down)
