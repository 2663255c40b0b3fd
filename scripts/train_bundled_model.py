"""Train the bundled model: a small DeepSeek-V3-architecture LM on the Python standard library.

Why: a bundled model with random weights answers with noise, so nobody can tell a working engine
from a broken one. This trains one with the engine's own model code (MLA at the real latent
widths 512 + 64, sigmoid noaux_tc MoE with a shared expert) on a corpus every machine has
offline and whose license allows redistribution: the `.py` sources of the running Python's
standard library (PSF License; test suites, codec tables and pydoc data excluded). Every 50th
file is held out.

Output (a folder the engine loads like any DeepSeek checkpoint): config.json, model.safetensors
(bf16), tokenizer.json (byte-level BPE trained on the training files), tokenizer_config.json,
README.md (the model card: data, license, steps, loss, held-out perplexity).

    python scripts/train_bundled_model.py --out models/splash-tiny --minutes 6      # one H200
    python scripts/train_bundled_model.py --out /tmp/t --steps 3 --batch 2 --seq 64 --files 40   # CPU smoke test

Training uses a plain causal forward over the model's own modules (no paged cache) and an
auxiliary load-balancing loss on the router (the router bias stays 0: noaux_tc's bias update is
a long-run mechanism this short run does not need).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import importlib.metadata
import math
import random
import sys
import sysconfig
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from splash_jax.layers import MLP
from splash_jax.model import DeepseekForCausalLM, RuntimeOptions
from splash_jax.model_config import ModelConfig, RopeConfig
from splash_jax.moe import MoE, route, router_logits
from splash_jax.rope import apply_rope
from splash_jax.weights.export import save_hf_folder

log = logging.getLogger("train")
SPECIAL = ["<|bos|>", "<|eos|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
HELD_OUT_EVERY = 50


def architecture(vocab: int) -> ModelConfig:
    """~15 M parameters (~31 MB in bf16): V3's MLA widths, 8 heads, 8 routed experts + 1 shared."""
    return ModelConfig(
        vocab_size=vocab, hidden_size=384, num_layers=4, num_heads=8, q_lora_rank=192, kv_lora_rank=512,
        qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32, intermediate_size=1024,
        moe_intermediate_size=256, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
        n_group=4, topk_group=2, topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True,
        routed_scaling_factor=2.5, first_k_dense_replace=1, moe_layer_freq=1, rms_norm_eps=1e-6,
        tie_word_embeddings=False, max_position_embeddings=4096, rope=RopeConfig(theta=10000.0),
        bos_token_id=0, eos_token_ids=(1,),
    )


# --- data -----------------------------------------------------------------------------------
# Licenses whose terms allow redistributing a model trained on the code (with attribution).
PERMISSIVE = ("apache", "bsd", "mit", "psf", "python software foundation")
COPYLEFT = ("gpl", "mpl", "epl", "cddl", "eupl", "osl")  # any of these in a license excludes the package
SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "encodings", "pydoc_data", "idle_test"}


def stdlib_files() -> list[Path]:
    """The `.py` files of this Python's standard library (test suites included: they are code too)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if not SKIP_DIRS & set(p.relative_to(root).parts))


def package_license(dist) -> str:
    """The license a package declares: its SPDX expression, else its classifiers, else the first
    line of its License field."""
    meta = dist.metadata
    if meta.get("License-Expression"):
        return meta["License-Expression"]
    classifiers = [c.split("::")[-1].strip() for c in meta.get_all("Classifier") or [] if c.startswith("License ::")]
    if classifiers:
        return ", ".join(classifiers)
    return (meta.get("License") or "").strip().splitlines()[0][:80] if meta.get("License") else ""


def package_files() -> list[tuple[Path, str, str]]:
    """`.py` files of the installed packages whose metadata names a permissive license
    (the machine's own dependencies: jax, numpy, flax, ...), as (path, package, license)."""
    files = []
    for dist in sorted(importlib.metadata.distributions(), key=lambda d: d.metadata["Name"] or ""):
        lic = package_license(dist)
        if not any(k in lic.lower() for k in PERMISSIVE) or any(k in lic.lower() for k in COPYLEFT) or not dist.files:
            continue
        own = [Path(dist.locate_file(f)) for f in dist.files if str(f).endswith(".py")]
        own = [p for p in own if p.is_file() and "__pycache__" not in p.parts]
        files += [(p, f"{dist.metadata['Name']} {dist.version}", lic) for p in own]
    return files
    return sorted(set(files)), used


def corpus_files(sources: str, limit: int | None, max_mb: float) -> tuple[list[Path], list[Path], dict]:
    """(train, held-out, provenance): every HELD_OUT_EVERY-th file is held out; at most max_mb of text."""
    files = []
    if "stdlib" in sources:
        files += [(p, f"Python {sysconfig.get_python_version()} standard library", "PSF-2.0") for p in stdlib_files()]
    if "packages" in sources:
        files += package_files()
    files = sorted(set(files))
    files = files[:limit] if limit else files
    random.Random(0).shuffle(files)  # the size cap then samples every source, not the first ones
    kept, total, licenses = [], 0, {}
    for f, source, lic in files:
        size = f.stat().st_size
        if total + size > max_mb * 2**20:
            continue
        kept.append(f)
        licenses[source] = lic
        total += size
    licenses = dict(sorted(licenses.items()))
    held = kept[::HELD_OUT_EVERY]
    held_set = set(held)
    return [f for f in kept if f not in held_set], held, licenses


def read_texts(files: list[Path]) -> list[str]:
    return [f.read_text(encoding="utf-8", errors="replace") for f in files]


def train_tokenizer(texts: list[str], vocab: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return tok


def token_stream(tok: Tokenizer, texts: list[str]) -> np.ndarray:
    """All files as one stream: <bos> file tokens <eos>, file after file."""
    ids = []
    for enc in tok.encode_batch(texts):
        ids += [0] + enc.ids + [1]
    return np.asarray(ids, np.int32)


def batches(stream: np.ndarray, batch: int, seq: int, rng: np.random.Generator):
    while True:
        starts = rng.integers(0, len(stream) - seq - 1, batch)
        yield np.stack([stream[s : s + seq + 1] for s in starts])


# --- a plain causal forward over the model's modules ------------------------------------------
def attention(attn, x, cos_sin, b: int, s: int):
    """Causal MLA over [B*S, D] rows in the absorbed form (the same weights the engine serves)."""
    q_nope, q_pe = attn.queries(x)
    q_pe = apply_rope(q_pe, cos_sin, attn.cfg.rope.interleaved)
    c, k_pe = attn.latent(x)
    k_pe = apply_rope(k_pe, cos_sin, attn.cfg.rope.interleaved)
    q_lat = attn.absorb(q_nope).reshape(b, s, -1, attn.cfg.kv_lora_rank)
    c, k_pe, q_pe = c.reshape(b, s, -1), k_pe.reshape(b, s, -1), q_pe.reshape(b, s, q_pe.shape[1], -1)
    scores = jnp.einsum("bqhl,bkl->bhqk", q_lat, c) + jnp.einsum("bqhr,bkr->bhqk", q_pe, k_pe)
    scores = scores.astype(jnp.float32) * attn.cfg.softmax_scale
    scores = jnp.where(jnp.tril(jnp.ones((s, s), bool)), scores, -jnp.inf)
    o = jnp.einsum("bhqk,bkl->bqhl", jax.nn.softmax(scores, -1).astype(c.dtype), c)
    return attn.output(o.reshape(b * s, o.shape[2], -1))


def balance_loss(cfg: ModelConfig, moe: MoE, h):
    """Switch-style auxiliary loss: E * sum_i (share of tokens routed to i) * (mean normalized score of i)."""
    logits = h.astype(jnp.float32) @ moe.router[...]
    ids, _ = route(cfg, logits, moe.router_bias[...])
    share = jax.lax.stop_gradient(jax.nn.one_hot(ids, cfg.n_routed_experts).sum(1).mean(0) / cfg.num_experts_per_tok)
    scores = jax.nn.sigmoid(logits)
    prob = (scores / scores.sum(-1, keepdims=True)).mean(0)
    return cfg.n_routed_experts * jnp.sum(share * prob)


def decoder_layer(cfg: ModelConfig, layer, x, cos_sin, b: int, s: int, attend=None):
    """One decoder layer over [B*S, D] rows -> (rows, its balance loss). `attend`: the attention
    function (default `attention`, the absorbed form)."""
    x = x + (attend or attention)(layer.attn, layer.input_norm(x), cos_sin, b, s)
    h = layer.post_attn_norm(x)
    if isinstance(layer.mlp, MoE):
        return x + moe_xla(cfg, layer.mlp, h), balance_loss(cfg, layer.mlp, h)
    assert isinstance(layer.mlp, MLP)
    return x + layer.mlp(h), 0.0


def moe_xla(cfg: ModelConfig, moe: MoE, h):
    """The MoE on its XLA paths only (routing included): differentiable on every backend (on GPUs
    MoE.__call__ routes with a Pallas kernel, which has no VJP)."""
    ids, weights = route(cfg, router_logits(h, moe.router[...]), moe.router_bias[...] if cfg.topk_method == "noaux_tc" else None)
    out = moe.routed(h, ids, weights, "xla")
    return out + moe.shared(h) if cfg.n_shared_experts else out


def hidden_states(model: DeepseekForCausalLM, tokens, attend=None):
    """tokens [B, S] -> the final hidden state after the final norm [B*S, D] (the LM head's input,
    what the MTP head consumes) and the summed balance loss."""
    b, s = tokens.shape
    x = model.embed[...][tokens.reshape(-1)]
    cos_sin = model.rope_cos_sin(jnp.tile(jnp.arange(s), b))
    aux = 0.0
    for layer in (model.layer(i) for i in range(model.cfg.num_layers)):  # scanned or unrolled models
        x, layer_aux = decoder_layer(model.cfg, layer, x, cos_sin, b, s, attend)
        aux = aux + layer_aux
    return model.norm(x), aux


def forward(model: DeepseekForCausalLM, tokens):
    """tokens [B, S] -> logits [B, S, V] (float32) and the summed balance loss."""
    h, aux = hidden_states(model, tokens)
    logits = jnp.dot(h, model.lm_head[...], preferred_element_type=jnp.float32)
    return logits.reshape(tokens.shape + (-1,)), aux


def loss_fn(model, batch, aux_weight: float):
    logits, aux = forward(model, batch[:, :-1])
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()
    return nll + aux_weight * aux, nll


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int
    minutes: float
    batch: int
    seq: int
    lr: float
    warmup: int
    aux_weight: float
    eval_batches: int
    eval_every: int  # held-out loss every this many steps; the best parameters are kept (early stopping)


def train(model: DeepseekForCausalLM, train_ids, held_ids, tc: TrainConfig, seed: int) -> dict:
    graphdef, params = nnx.split(model, nnx.Param)
    schedule = optax.warmup_cosine_decay_schedule(0.0, tc.lr, tc.warmup, max(tc.steps, tc.warmup + 1), tc.lr / 10)
    decay_mask = jax.tree.map(lambda p: p.ndim >= 2, params)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, b2=0.95, weight_decay=0.1, mask=decay_mask))
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, batch):
        (loss, nll), grads = jax.value_and_grad(
            lambda p: loss_fn(nnx.merge(graphdef, p), batch, tc.aux_weight), has_aux=True
        )(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, nll

    @jax.jit
    def eval_nll(params, batch):
        return loss_fn(nnx.merge(graphdef, params), batch, 0.0)[1]

    rng = np.random.default_rng(seed)
    data, held = batches(train_ids, tc.batch, tc.seq, rng), batches(held_ids, tc.batch, tc.seq, np.random.default_rng(1))
    held_batches = [next(held) for _ in range(tc.eval_batches)]

    def held_out(params) -> float:
        return float(np.mean([eval_nll(params, b) for b in held_batches]))

    t0, done = time.perf_counter(), 0
    best = (math.inf, 0, params, math.nan)  # held-out loss, step, parameters, training loss
    while done < tc.steps and (time.perf_counter() - t0) < tc.minutes * 60:
        params, opt_state, nll = step(params, opt_state, next(data))
        done += 1
        if done % 10 == 0:  # steps dispatch asynchronously: keep the time budget honest
            nll.block_until_ready()
        if done % tc.eval_every == 0:
            h = held_out(params)
            log.info("step %d loss %.3f held-out %.3f (%.0fs)", done, float(nll), h, time.perf_counter() - t0)
            if h < best[0]:
                best = (h, done, params, float(nll))
    h = held_out(params)
    if h < best[0]:
        best = (h, done, params, float(nll))
    held_nll, best_step, params, train_nll = best
    nnx.update(model, params)
    return {"steps": done, "kept_step": best_step, "seconds": time.perf_counter() - t0,
            "final_train_loss": train_nll, "held_out_loss": held_nll, "held_out_perplexity": math.exp(held_nll),
            "tokens_seen": done * tc.batch * tc.seq}


def model_card(cfg: ModelConfig, stats: dict, data: dict, tc: TrainConfig, params: int) -> str:
    licenses = "\n".join(f"  - {name}: {lic}" for name, lic in data["licenses"].items())
    return f"""# splash-tiny

A small language model of the DeepSeek-V3 architecture, trained by `scripts/train_bundled_model.py`
with splash-jax's own model code, so `python -m serve.main` completes Python code out of the box.

- Architecture: DeepseekV3ForCausalLM, {params / 1e6:.1f} M parameters (bf16): hidden {cfg.hidden_size},
  {cfg.num_layers} layers ({cfg.first_k_dense_replace} dense), {cfg.num_heads} MLA heads at the real latent widths
  (kv_lora_rank {cfg.kv_lora_rank}, rope {cfg.qk_rope_head_dim}), q_lora_rank {cfg.q_lora_rank};
  {cfg.n_routed_experts} routed experts (top-{cfg.num_experts_per_tok}, sigmoid noaux_tc, {cfg.n_group} groups)
  + {cfg.n_shared_experts} shared.
- Tokenizer: byte-level BPE, {cfg.vocab_size} tokens, trained on the training files.
- Data: `.py` source files (Python {data['python']} standard library, and the installed packages whose
  metadata names a permissive license; list below): {data['train_files']} files / {data['train_tokens']:,}
  tokens for training, every {HELD_OUT_EVERY}th file ({data['held_files']} files / {data['held_tokens']:,} tokens)
  held out.
- Licenses of the data (the weights are derived from these sources; keep their notices):
{licenses}
- Training: {stats['steps']} steps of batch {tc.batch} x {tc.seq} tokens ({stats['tokens_seen']:,} tokens,
  {stats['seconds'] / 60:.1f} min on {data['device']}), AdamW (peak lr {tc.lr}, warm-up {tc.warmup}, cosine),
  auxiliary balance loss {tc.aux_weight}; the parameters of step {stats['kept_step']} are kept (lowest
  held-out loss, checked every {tc.eval_every} steps).
- Results: training loss {stats['final_train_loss']:.3f} at that step; held-out loss {stats['held_out_loss']:.3f},
  perplexity {stats['held_out_perplexity']:.1f} per token (vocabulary {cfg.vocab_size}).
- Limits: a few minutes of training on one library's code: it continues Python plausibly, it does
  not follow instructions or know facts.
"""


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--minutes", type=float, default=6.0, help="stop training after this long")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--aux-weight", type=float, default=0.01)
    parser.add_argument("--eval-batches", type=int, default=8)
    parser.add_argument("--eval-every", type=int, default=250)
    parser.add_argument("--files", type=int, default=None, help="use only the first N files (smoke tests)")
    parser.add_argument("--sources", default="stdlib,packages",
                        help="stdlib and/or packages (installed packages under permissive licenses)")
    parser.add_argument("--max-corpus-mb", type=float, default=150.0, help="cap on the corpus text")
    parser.add_argument("--seed", type=int, default=0)
    mtp = parser.add_argument_group("MTP head (scripts/train_mtp_head.py)")
    mtp.add_argument("--mtp", action="store_true", help="after the main model, train its MTP draft head")
    mtp.add_argument("--mtp-only", type=Path, default=None, metavar="FOLDER",
                     help="train only the MTP head of the model in FOLDER (frozen); write the new files to --out")
    mtp.add_argument("--mtp-minutes", type=float, default=3.0, help="the MTP head's training budget")
    mtp.add_argument("--deadline-minutes", type=float, default=1e6,
                     help="MTP: stop training this long after start, less --reserve-seconds (a hard wall-clock limit)")
    mtp.add_argument("--reserve-seconds", type=float, default=60.0, help="MTP: time kept for export and evaluation")
    mtp.add_argument("--mtp-eval-tokens", type=int, default=65536, help="MTP: positions per final held-out measurement")
    mtp.add_argument("--greedy-prompts", type=int, default=32, help="MTP: held-out prompts for the greedy acceptance")
    mtp.add_argument("--greedy-prompt-len", type=int, default=96)
    mtp.add_argument("--greedy-new-tokens", type=int, default=48)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.mtp_only:
        return train_mtp_head(args, args.mtp_only, args.out)

    train_files, held_files, licenses = corpus_files(args.sources, args.files, args.max_corpus_mb)
    train_texts, held_texts = read_texts(train_files), read_texts(held_files)
    tok = train_tokenizer(train_texts, args.vocab)
    for i, s in enumerate(SPECIAL):
        assert tok.token_to_id(s) == i, s
    train_ids, held_ids = token_stream(tok, train_texts), token_stream(tok, held_texts)
    log.info("corpus: %d train files (%d tokens), %d held-out files (%d tokens)",
             len(train_files), len(train_ids), len(held_files), len(held_ids))

    cfg = dataclasses.replace(architecture(tok.get_vocab_size()), max_position_embeddings=max(4096, args.seq))
    # One module per layer while training (the engine stacks them for its scan when it loads the export).
    model = DeepseekForCausalLM(cfg, RuntimeOptions(dtype="float32", scan_layers=False), nnx.Rngs(args.seed))
    tc = TrainConfig(args.steps, args.minutes, args.batch, args.seq, args.lr, args.warmup, args.aux_weight,
                     args.eval_batches, args.eval_every)
    stats = train(model, train_ids, held_ids, tc, args.seed)
    log.info("trained: %s", stats)

    args.out.mkdir(parents=True, exist_ok=True)
    save_hf_folder(model, args.out, "bfloat16")
    tok.save(str(args.out / "tokenizer.json"))
    (args.out / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>",
        "chat_template": CHAT_TEMPLATE, "model_max_length": cfg.max_position_embeddings,
    }, indent=2))
    params = sum(int(np.prod(v.shape)) for v in jax.tree.leaves(nnx.state(model, nnx.Param)))
    data = {"python": sysconfig.get_python_version(), "train_files": len(train_files), "held_files": len(held_files),
            "train_tokens": len(train_ids), "held_tokens": len(held_ids), "device": jax.devices()[0].device_kind,
            "licenses": licenses}
    (args.out / "README.md").write_text(model_card(cfg, stats, data, tc, params))
    (args.out / "training.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                        "stats": stats, "data": data, "params": params}, indent=2))
    if args.mtp:
        train_mtp_head(args, args.out, args.out)
    size = sum(p.stat().st_size for p in args.out.iterdir())
    log.info("wrote %s (%.1f MB)", args.out, size / 2**20)


def train_mtp_head(args, src: Path, out: Path) -> dict:
    """Train the MTP head of the model in `src` (scripts/train_mtp_head.py) and write model-mtp.safetensors,
    config.json, training.json ("mtp") and the model card's MTP section into `out` (src may equal out)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import train_mtp_head as head

    result = head.run_mtp_only(args, src, out)
    record = json.loads((src / "training.json").read_text()) if (src / "training.json").exists() else {}
    record["mtp"] = {"args": {k: str(v) for k, v in vars(args).items()}} | result
    (out / "training.json").write_text(json.dumps(record, indent=2))
    card = (src / "README.md").read_text() if (src / "README.md").exists() else "# model\n"
    (out / "README.md").write_text(head.replace_section(card, head.card_section(result)))
    log.info("MTP head written to %s (%.2f MiB)", out, result["bytes"] / 2**20)
    return result


if __name__ == "__main__":
    main()
