"""Train a DeepSeek-V3 multi-token-prediction (MTP) head on top of a frozen bundled model.

Why: MTP speculative decoding (issue 32) needs a draft layer trained for the model it drafts for.
DeepSeek-V3's MTP objective at depth 1: from the main model's final hidden state h_t (after its
final norm, the LM head's input: what vLLM and SGLang feed the MTP layer at serving time) and the
embedding of token t+1, predict token t+2 (cross-entropy through the shared LM head). The main
model is frozen, so its weights stay byte-identical and only the MTP layer (splash_jax/mtp.py)
learns; the router gets the same auxiliary balance loss as the main training.

Output, beside the main model's files: `model-mtp.safetensors` (the layer as
`model.layers.{num_layers}.*`, its linears block-FP8 as DeepSeek-V3's release stores them: e4m3
values + 128 x 128 `weight_scale_inv`; norms bf16, router float32) and config.json with
`num_nextn_predict_layers: 1` and a quantization_config whose modules_to_not_convert names the
whole main model. Metrics are measured on the stored (FP8) weights, reloaded by the engine's loader.

Run through `scripts/train_bundled_model.py --mtp-only FOLDER --out DIR` (a time budget, not a
step count: the learning rate follows the elapsed share of it).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
from flax import nnx
from safetensors.numpy import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_bundled_model as tb  # noqa: E402  (the corpus, the causal forward, the balance loss)

from splash_jax.model import RuntimeOptions  # noqa: E402
from splash_jax.mtp import MTPLayer  # noqa: E402
from splash_jax.rope import apply_rope  # noqa: E402
from splash_jax.weights.export import hf_tensors  # noqa: E402
from splash_jax.weights.fp8 import is_block_fp8_linear, quantization_config, quantize_checkpoint  # noqa: E402
from splash_jax.weights.loader import load_model  # noqa: E402

log = logging.getLogger("train_mtp")
MTP_FILE = "model-mtp.safetensors"
KEEP_F32 = ("mlp.gate.weight", "e_score_correction_bias")  # the router, as the main export keeps it


def expanded_attention(attn, x, cos_sin, b: int, s: int):
    """Causal MLA over [B*S, D] rows in the non-absorbed form (keys and values expanded per head
    from the latent): the same function as `tb.attention`, ~5x fewer FLOPs at these widths (the
    absorbed form contracts over the 576-wide latent), which is what makes CPU training bearable."""
    cfg = attn.cfg
    q_nope, q_pe = attn.queries(x)
    q_pe = apply_rope(q_pe, cos_sin, cfg.rope.interleaved)
    c, k_pe = attn.latent(x)
    k_pe = apply_rope(k_pe, cos_sin, cfg.rope.interleaved)
    k_nope = jnp.einsum("tl,lhn->thn", c, attn.w_uk[...]).reshape(b, s, -1, cfg.qk_nope_head_dim)
    v = jnp.einsum("tl,lhv->thv", c, attn.w_uv[...]).reshape(b, s, -1, cfg.v_head_dim)
    q_nope, q_pe = q_nope.reshape(k_nope.shape[:2] + q_nope.shape[1:]), q_pe.reshape((b, s) + q_pe.shape[1:])
    scores = jnp.einsum("bqhn,bkhn->bhqk", q_nope, k_nope) + jnp.einsum("bqhr,bkr->bhqk", q_pe, k_pe.reshape(b, s, -1))
    scores = jnp.where(jnp.tril(jnp.ones((s, s), bool)), scores.astype(jnp.float32) * cfg.softmax_scale, -jnp.inf)
    o = jnp.einsum("bhqk,bkhv->bqhv", jax.nn.softmax(scores, -1).astype(v.dtype), v)
    return attn.project(o.reshape(b * s, o.shape[2], -1))


def main_hidden(model, tokens):
    """The frozen main model's final hidden state (after its final norm) [B*S, D]."""
    return tb.hidden_states(model, tokens, expanded_attention)[0]


def mtp_logits(model, mtp: MTPLayer, next_tokens, hidden):
    """The MTP step over whole sequences (no paged cache): next_tokens [B, S] (token t+1 at slot t),
    hidden [B*S, D] (h_t) -> logits [B, S, V] float32 for token t+2, balance loss."""
    b, s = next_tokens.shape
    e = mtp.enorm(model.embed[...][next_tokens.reshape(-1)])
    x = jnp.concatenate([e, mtp.hnorm(hidden)], axis=-1) @ mtp.eh_proj[...]
    cos_sin = model.rope_cos_sin(jnp.tile(jnp.arange(s), b))
    x, aux = tb.decoder_layer(model.cfg, mtp.decoder, x, cos_sin, b, s, expanded_attention)
    logits = jnp.dot(mtp.norm(x), model.lm_head[...], preferred_element_type=jnp.float32)
    return logits.reshape(b, s, -1), aux


@dataclasses.dataclass(frozen=True)
class MTPTrainConfig:
    minutes: float  # training-loop budget (the learning rate decays over it)
    batch: int
    seq: int
    lr: float
    warmup: int
    aux_weight: float
    eval_batches: int
    eval_every: int


def _split_batch(batch, seq):
    """[B, S+2] tokens -> main-model input [B, S], MTP input tokens (t+1), targets (t+2)."""
    return batch[:, :seq], batch[:, 1 : seq + 1], batch[:, 2 : seq + 2]


def train_mtp(model, mtp: MTPLayer, train_ids, held_ids, tc: MTPTrainConfig, seed: int, deadline: float,
              on_best=None) -> dict:
    """AdamW on the MTP parameters only; warm-up then cosine to lr/10 over the time budget; the
    parameters with the lowest held-out MTP loss are kept (checked every eval_every steps)."""
    mgraph, mparams = nnx.split(model, nnx.Param)
    graphdef, params = nnx.split(mtp, nnx.Param)
    decay_mask = jax.tree.map(lambda p: p.ndim >= 2, params)
    tx = optax.chain(optax.clip_by_global_norm(1.0),
                     optax.inject_hyperparams(optax.adamw)(learning_rate=0.0, b2=0.95, weight_decay=0.1, mask=decay_mask))
    opt_state = tx.init(params)

    def losses(p, mp, batch):
        main = nnx.merge(mgraph, mp)
        inputs, nxt, target = _split_batch(batch, tc.seq)
        hidden = jax.lax.stop_gradient(main_hidden(main, inputs))  # frozen main model
        logits, aux = mtp_logits(main, nnx.merge(graphdef, p), nxt, hidden)
        return optax.softmax_cross_entropy_with_integer_labels(logits, target).mean(), aux

    def objective(p, mp, batch):
        nll, aux = losses(p, mp, batch)
        return nll + tc.aux_weight * aux, nll

    @jax.jit
    def step(p, opt_state, mp, batch, lr):
        opt_state[1].hyperparams["learning_rate"] = lr
        (_, nll), grads = jax.value_and_grad(objective, has_aux=True)(p, mp, batch)
        updates, opt_state = tx.update(grads, opt_state, p)
        return optax.apply_updates(p, updates), opt_state, nll

    eval_nll = jax.jit(lambda p, mp, batch: losses(p, mp, batch)[0])
    data = tb.batches(train_ids, tc.batch, tc.seq + 1, np.random.default_rng(seed))
    held = tb.batches(held_ids, tc.batch, tc.seq + 1, np.random.default_rng(1))
    held_batches = [next(held) for _ in range(tc.eval_batches)]

    def held_out(p) -> float:
        return float(np.mean([eval_nll(p, mparams, b) for b in held_batches]))

    t0 = time.perf_counter()
    budget = max(1.0, min(tc.minutes * 60, deadline - t0))
    done, nll, best = 0, math.nan, (math.inf, 0, params, math.nan)
    while time.perf_counter() - t0 < budget:
        frac = (time.perf_counter() - t0) / budget
        lr = tc.lr * min(1.0, (done + 1) / tc.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        params, opt_state, nll = step(params, opt_state, mparams, next(data), jnp.float32(lr))
        done += 1
        if done % 10 == 0:  # steps dispatch asynchronously: keep the time budget honest
            nll.block_until_ready()
        if done % tc.eval_every == 0:
            h = held_out(params)
            log.info("mtp step %d loss %.3f held-out %.3f lr %.2e (%.0fs)", done, float(nll), h, lr, time.perf_counter() - t0)
            if h < best[0]:
                best = (h, done, params, float(nll))
                if on_best:  # written as it goes: an interrupted run keeps its best head
                    on_best(params)
    h = held_out(params)
    if h < best[0]:
        best = (h, done, params, float(nll))
    held_nll, kept, params, train_nll = best
    nnx.update(mtp, params)
    return {"steps": done, "kept_step": kept, "seconds": time.perf_counter() - t0, "final_train_loss": train_nll,
            "held_out_loss": held_nll, "tokens_seen": done * tc.batch * tc.seq}


def mtp_metrics(model, mtp: MTPLayer, batches, seq: int) -> dict:
    """Held-out MTP numbers over [B, S+2] batches: loss and top-1 accuracy against the true token
    t+2, and top-1 agreement with the main model's own greedy prediction of t+2 (from the true
    prefix through t+1: the K=1 acceptance greedy speculation would see on this text)."""

    mgraph, mstate = nnx.split(model)
    hgraph, hstate = nnx.split(mtp)

    @jax.jit
    def counts(mstate, hstate, batch):
        main, head = nnx.merge(mgraph, mstate), nnx.merge(hgraph, hstate)
        hidden = main_hidden(main, batch[:, : seq + 1]).reshape(batch.shape[0], seq + 1, -1)
        main_next = jnp.dot(hidden[:, 1:], main.lm_head[...], preferred_element_type=jnp.float32).argmax(-1)
        _, nxt, target = _split_batch(batch, seq)
        logits, _ = mtp_logits(main, head, nxt, hidden[:, :seq].reshape(-1, hidden.shape[-1]))
        draft = logits.argmax(-1)
        nll = optax.softmax_cross_entropy_with_integer_labels(logits, target)
        return jnp.stack([nll.sum(), (draft == target).sum(), (draft == main_next).sum(),
                          (main_next == target).sum()]).astype(jnp.float32)

    total = sum(np.asarray(counts(mstate, hstate, b), np.float64) for b in batches)
    n = len(batches) * batches[0].shape[0] * seq
    return {"tokens": n, "mtp_loss": total[0] / n, "mtp_top1_vs_true_t2": total[1] / n,
            "mtp_top1_vs_main_greedy": total[2] / n, "main_top1_vs_true_t2": total[3] / n}


def greedy_acceptance(model, mtp: MTPLayer, prompts: np.ndarray, new_tokens: int) -> dict:
    """K=1 acceptance along the main model's own greedy continuations of held-out prompts [B, P]:
    at each generated position the draft (MTP on h_t and the greedy token t+1) against the greedy
    token t+2: what speculative greedy decoding accepts."""
    b, p = prompts.shape
    total = p + new_tokens
    seqs = np.zeros((b, total), np.int32)
    seqs[:, :p] = prompts

    mgraph, mstate = nnx.split(model)
    hgraph, hstate = nnx.split(mtp)

    @jax.jit
    def next_token(mstate, tokens, pos):
        main = nnx.merge(mgraph, mstate)
        h = main_hidden(main, tokens).reshape(b, total, -1)
        return jnp.dot(h[:, pos - 1], main.lm_head[...], preferred_element_type=jnp.float32).argmax(-1)

    for pos in range(p, total):  # one fixed-shape program: positions past pos do not reach pos - 1
        seqs[:, pos] = np.asarray(next_token(mstate, jnp.asarray(seqs), pos))

    @jax.jit
    def drafts(mstate, hstate, tokens):
        main, head = nnx.merge(mgraph, mstate), nnx.merge(hgraph, hstate)
        h = main_hidden(main, tokens[:, :-1])
        return mtp_logits(main, head, tokens[:, 1:], h)[0].argmax(-1)  # slot t predicts t+2

    d = np.asarray(drafts(mstate, hstate, jnp.asarray(seqs)))  # [B, total-1]
    t = np.arange(p - 1, total - 2)  # drafts whose token t+1 and target t+2 are both generated
    hits = d[:, t] == seqs[:, t + 2]
    return {"prompts": b, "prompt_tokens": p, "new_tokens": new_tokens, "drafts": int(hits.size),
            "acceptance": float(hits.mean())}


def mtp_checkpoint_tensors(model, mtp: MTPLayer, block: int = 128) -> dict[str, np.ndarray]:
    """The MTP layer's HF tensors as stored: linears block-FP8, norms bf16, the router float32."""
    model.mtp = nnx.List([mtp])  # attached for the export (the main tensors are dropped below)
    try:
        tensors = hf_tensors(model, "float32")
    finally:
        del model.mtp
    prefix = f"model.layers.{model.cfg.num_layers}."
    mine = {k: v for k, v in tensors.items() if k.startswith(prefix)}
    stored = quantize_checkpoint(mine, is_block_fp8_linear, (block, block))
    return {k: np.ascontiguousarray(v if (v.dtype != np.float32 or k.endswith(KEEP_F32) or k.endswith("_scale_inv"))
                                    else v.astype(ml_dtypes.bfloat16)) for k, v in stored.items()}


def mtp_config(config: dict, num_layers: int, block: int = 128) -> dict:
    """config.json announcing the FP8 MTP layer; the main model's modules stay unconverted."""
    main = ["model.embed_tokens", "model.norm", "lm_head"] + [f"model.layers.{i}" for i in range(num_layers)]
    return config | {"num_nextn_predict_layers": 1, "quantization_config": quantization_config((block, block), main)}


def served_model(src: Path, out: Path):
    """The main model of `src` with the MTP layer written to `out`, loaded by the engine's loader
    (float32, FP8 dequantized): the weights the metrics are measured on are the stored ones."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for name in ("model.safetensors", "tokenizer.json"):
            (tmp / name).symlink_to((src / name).resolve())
        shutil.copy(out / MTP_FILE, tmp / MTP_FILE)
        shutil.copy(out / "config.json", tmp / "config.json")
        return load_model(tmp, RuntimeOptions(dtype="float32", scan_layers=False, mtp=True))


def run_mtp_only(args, src: Path, out: Path) -> dict:
    """Train, store and measure the MTP head of the model at `src`; writes into `out`."""
    t_start = time.perf_counter()
    deadline = t_start + args.deadline_minutes * 60 - args.reserve_seconds
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    train_files, held_files, _ = tb.corpus_files(args.sources, args.files, args.max_corpus_mb)
    train_ids = tb.token_stream(tok, tb.read_texts(train_files))
    held_ids = tb.token_stream(tok, tb.read_texts(held_files))
    log.info("corpus: %d train files (%d tokens), %d held-out files (%d tokens), %.0fs", len(train_files),
             len(train_ids), len(held_files), len(held_ids), time.perf_counter() - t_start)
    model = load_model(src, RuntimeOptions(dtype="float32", scan_layers=False))  # frozen: as served
    cfg = dataclasses.replace(model.cfg, num_mtp_layers=1)
    mtp = MTPLayer(cfg, cfg.num_layers, jnp.float32, nnx.Rngs(args.seed + 1))
    tc = MTPTrainConfig(args.mtp_minutes, args.batch, args.seq, args.lr, args.warmup, args.aux_weight,
                        args.eval_batches, args.eval_every)
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(mtp_config(config, cfg.num_layers), indent=2) + "\n")

    def save(params=None):
        if params is not None:
            nnx.update(mtp, params)
        save_file(mtp_checkpoint_tensors(model, mtp), str(out / MTP_FILE), metadata={"format": "pt"})

    stats = train_mtp(model, mtp, train_ids, held_ids, tc, args.seed, deadline, on_best=save)
    log.info("mtp trained: %s", stats)
    save()

    served = served_model(src, out)
    repo_files = repo_code_files()
    repo_ids = tb.token_stream(tok, tb.read_texts(repo_files))
    n = max(1, args.mtp_eval_tokens // (tc.batch * tc.seq))
    sets = {"corpus_held_out": held_ids, "repo_code": repo_ids}
    evals = {k: [next(tb.batches(ids, tc.batch, tc.seq + 1, np.random.default_rng(2 + i))) for i in range(n)]
             for k, ids in sets.items()}
    metrics = {f"fp8_stored_{k}": mtp_metrics(served, served.mtp[0], b, tc.seq) for k, b in evals.items()}
    metrics["float32_trained_corpus_held_out"] = mtp_metrics(model, mtp, evals["corpus_held_out"], tc.seq)
    prompts = tb.batches(repo_ids, args.greedy_prompts, args.greedy_prompt_len - 1, np.random.default_rng(3))
    metrics["greedy_continuations_repo_code"] = greedy_acceptance(served, served.mtp[0], next(prompts), args.greedy_new_tokens)
    log.info("mtp metrics: %s", json.dumps(metrics))
    size = (out / MTP_FILE).stat().st_size
    return {"stats": stats, "metrics": metrics, "config": dataclasses.asdict(tc), "bytes": size,
            "held_files": len(held_files), "train_files": len(train_files), "held_tokens": len(held_ids),
            "repo_files": len(repo_files), "repo_tokens": len(repo_ids),
            "device": device_name(), "total_seconds": time.perf_counter() - t_start}


def device_name() -> str:
    d = jax.devices()[0]
    return f"{os.cpu_count()} CPU cores" if d.platform == "cpu" else d.device_kind


def repo_code_files() -> list[Path]:
    """This repository's own Python: in neither model's training data (the corpus is the standard
    library and installed packages that declare a permissive license; splash-jax declares none)."""
    repo = Path(__file__).resolve().parents[1]
    dirs = ("splash_jax", "serve", "benchmarks", "tests", "scripts", "pallas_kernels")
    return sorted(p for d in dirs for p in (repo / d).rglob("*.py") if not {"fixtures", "__pycache__"} & set(p.parts))


SECTION = "## MTP draft head"


def card_section(result: dict) -> str:
    """The model card's MTP section (written by the script; replaces an earlier one)."""
    st, m, tc = result["stats"], result["metrics"], result["config"]
    held, repo, f32 = m["fp8_stored_corpus_held_out"], m["fp8_stored_repo_code"], m["float32_trained_corpus_held_out"]
    g = m["greedy_continuations_repo_code"]

    def row(name, x):
        return (f"| {name} | {x['tokens']:,} | {x['mtp_loss']:.3f} | {x['mtp_top1_vs_true_t2']:.1%} | "
                f"{x['mtp_top1_vs_main_greedy']:.1%} | {x['main_top1_vs_true_t2']:.1%} |")

    return f"""{SECTION}
A DeepSeek-V3 multi-token-prediction layer (`model.layers.4.*` in `{MTP_FILE}`, config.json
`num_nextn_predict_layers: 1`): the draft model of MTP speculative decoding (`RuntimeOptions(mtp=True)`,
`splash_jax/mtp.py`). Trained by `scripts/train_bundled_model.py --mtp-only` with DeepSeek-V3's MTP
objective on top of the frozen model above (its weights and `model.safetensors` are unchanged, byte
for byte): from the main model's final hidden state h_t (after its final norm) and the embedding of
token t+1, predict token t+2 through the shared LM head.

- Training: {st['steps']} steps of batch {tc['batch']} x {tc['seq']} tokens ({st['tokens_seen']:,} tokens,
  {st['seconds'] / 60:.1f} min on {result['device']}), AdamW (peak lr {tc['lr']}, warm-up {tc['warmup']}, cosine to
  lr/10 over the time budget), balance loss {tc['aux_weight']}; kept step {st['kept_step']} (lowest held-out loss);
  training loss {st['final_train_loss']:.3f}, held-out MTP loss {st['held_out_loss']:.3f} nats per token t+2.
- Stored as DeepSeek-V3's release stores its weights: every linear in block FP8 (e4m3 + a float32
  `weight_scale_inv` per 128 x 128 block), norms bf16, router float32: {result['bytes'] / 2**20:.2f} MiB
  (quantization_config's modules_to_not_convert names the bf16 main model).
- Held-out numbers, measured on the stored FP8 weights through the engine's loader. "vs main greedy" is
  the MTP draft's agreement with the main model's own greedy prediction of token t+2 (true text up to
  t+1): the acceptance rate greedy speculation with K=1 would see on that text. The last column is
  the main model's own top-1 for token t+2, one position later, for scale.

| text | positions | MTP loss (nats) | MTP top-1 vs true t+2 | MTP top-1 vs main greedy | main top-1 vs true t+2 |
|---|---|---|---|---|---|
{row(f"corpus held-out files ({result['held_files']}, every 50th)", held)}
{row(f"this repository's Python ({result['repo_files']} files, in no training data)", repo)}
{row("corpus held-out, float32 weights before FP8 storage", f32)}

- Along the main model's own greedy continuations ({g['prompts']} prompts of {g['prompt_tokens']} tokens from this
  repository's code, {g['new_tokens']} new tokens each, {g['drafts']:,} drafts), K=1 acceptance is
  **{g['acceptance']:.1%}**: what greedy speculative decoding accepts.
"""


def replace_section(card: str, section: str) -> str:
    """`card` with its MTP section replaced by `section` (appended when it has none)."""
    if SECTION not in card:
        return card.rstrip("\n") + "\n\n" + section
    head, rest = card.split(SECTION, 1)
    nxt = rest.find("\n## ")
    return head + section + ("" if nxt < 0 else rest[nxt + 1 :])
