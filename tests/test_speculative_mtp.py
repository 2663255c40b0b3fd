"""MTP speculative decoding (engine/mtp_draft.py): the drafts are the MTP layer's (equal to
mtp_forward chained by hand on one device, also for steps mixing verify, plain sampling and
prefill chunks; the head's argmax per vocabulary shard equals one over the gathered logits),
greedy outputs equal decoding one token per step (max_tokens and stop strings landing inside
verify chunks), in every layout and across live switches, nothing compiles after warm-up, and a
checkpoint without an MTP layer is refused."""

import collections
import dataclasses
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from splash_jax.compile_guard import count_compiles
from splash_jax.engine import Engine, EngineConfig, SamplingParams
from splash_jax.kv.cache import StepInput
from splash_jax.mesh.layouts import LAYOUT_NAMES
from splash_jax.model import DeepseekForCausalLM, RuntimeOptions
from splash_jax.model_config import ModelConfig
from splash_jax.weights.export import hf_tensors
from splash_jax.weights.loader import load_model
from switch_workload import run_with_switches, settle_in

RANDOM_TINY = Path(__file__).parent / "fixtures" / "splash_tiny_random"  # 3 layers, vocab 1024, a tokenizer
PAGE = 8
K = 3
PROMPTS = [
    "Latent attention keeps one vector per token.",
    "def add(a, b):\n    return a + b\n",
    "ok",
    "The quick brown fox jumps over the lazy dog, again and again and again",
]
KW = dict(page_size=PAGE, max_num_seqs=4, max_num_batched_tokens=16, min_token_bucket=16, max_pages=48,
          compile_cache_dir=None, speculative_method="mtp", speculative_tokens=K)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """splash_tiny_random plus a random MTP layer (model.layers.3.*, its own safetensors file)."""
    dst = tmp_path_factory.mktemp("mtp") / "tiny-mtp"
    shutil.copytree(RANDOM_TINY, dst)
    config = json.loads((dst / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (dst / "config.json").write_text(json.dumps(config))
    cfg = ModelConfig.from_json(dst)
    model = DeepseekForCausalLM(cfg, RuntimeOptions(dtype="float32", mtp=True), nnx.Rngs(3))
    prefix = f"model.layers.{cfg.num_layers}."
    rng = np.random.default_rng(3)
    tensors = {}
    for name, t in hf_tensors(model, "float32").items():
        if not name.startswith(prefix):
            continue
        if name.endswith("norm.weight"):
            t = 1.0 + 0.2 * rng.standard_normal(t.shape)
        elif name.endswith("mlp.gate.weight"):
            t = rng.standard_normal(t.shape) * 2.0 / np.sqrt(cfg.hidden_size)
        elif name.endswith("bias"):
            t = rng.random(t.shape) * 0.1
        else:
            t = rng.standard_normal(t.shape) * 0.08
        tensors[name] = np.asarray(t, np.float32)
    save_file(tensors, str(dst / "model-mtp.safetensors"))
    return dst


@pytest.fixture(scope="module")
def engine(folder):
    return Engine(EngineConfig(model=str(folder), **KW))


def _generate(engine, method, prompts, params):
    engine.set_speculative(method)
    try:
        return engine.generate(prompts, params)
    finally:
        engine.set_speculative("mtp")


def _seq_batch(tokens, start, rows):
    """A single-device StepInput for one sequence at positions start.. in pages 0.. of its own pool."""
    n = len(tokens)
    pos = np.arange(start, start + n)
    return StepInput(jnp.asarray(tokens, jnp.int32), jnp.asarray(pos, jnp.int32), jnp.zeros(n, jnp.int32),
                     jnp.asarray(pos // PAGE, jnp.int32), jnp.asarray(pos % PAGE, jnp.int32), jnp.asarray(pos + 1, jnp.int32),
                     jnp.arange(16, dtype=jnp.int32)[None], jnp.asarray(rows, jnp.int32))


class _OracleDrafter:
    """Proposes the reference continuation with about a third of the tokens wrong, so verify chunks
    accept none, some or all of their drafts (a random MTP layer's drafts are rarely right); the
    MTP programs still run after every step and their drafts are recorded (and checked)."""

    lookahead = K - 1

    def __init__(self, reference, seed=5):
        self.reference = reference
        self.rng = np.random.default_rng(seed)

    def propose(self, request, k):
        want = self.reference[tuple(request.prompt_ids)][len(request.output_ids):][:k]
        wrong = self.rng.random(len(want)) < 0.3
        return [(t + 1) % 100 if w else t for t, w in zip(want, wrong)]


class _Reference:
    """The MTP drafts for a sequence state, computed by hand on one device: the main model over
    tokens 0..N-2 (hidden states), the MTP layer over the same positions fed tokens 1..N-1, its
    logits at N-2 give draft 1, then the layer chained on its output. One padded shape: one compile."""

    SLOTS = 64

    def __init__(self, folder):
        self.model = load_model(folder, RuntimeOptions(dtype="float32", attention_impl="xla", mtp=True))

        def drafts(m, main_tokens, mtp_tokens, n):
            kv = m.new_cache(self.SLOTS // PAGE + 1, PAGE)
            b = _padded_batch(main_tokens, n, self.SLOTS)
            _, hidden, kv = m(kv, b, return_hidden="all")
            logits, h, kv = m.mtp_forward(kv, dataclasses.replace(b, tokens=mtp_tokens), hidden)
            out = [jnp.argmax(logits[0])]
            for j in range(1, K):
                pos = jnp.reshape(n - 1 + j, (1,)).astype(jnp.int32)
                step = StepInput(jnp.reshape(out[-1], (1,)).astype(jnp.int32), pos, jnp.zeros(1, jnp.int32), pos // PAGE,
                                 pos % PAGE, pos + 1, b.page_table, jnp.zeros(1, jnp.int32))
                logits, h, kv = m.mtp_forward(kv, step, h)
                out.append(jnp.argmax(logits[0]))
            return jnp.stack(out)

        self._drafts = jax.jit(drafts)

    def __call__(self, seq):
        n = len(seq) - 1  # positions 0..n-1 = 0..N-2
        main = np.zeros(self.SLOTS, np.int32)
        main[:n] = seq[:n]
        nxt = np.zeros(self.SLOTS, np.int32)
        nxt[:n] = seq[1 : n + 1]
        return [int(t) for t in self._drafts(self.model, jnp.asarray(main), jnp.asarray(nxt), jnp.int32(n))]


def _padded_batch(tokens, n, slots):
    """Positions 0..n-1 of one sequence in `slots` token slots (the rest padding); logits row n-1."""
    pos = jnp.arange(slots, dtype=jnp.int32)
    real = pos < n
    return StepInput(tokens, jnp.where(real, pos, 0), jnp.zeros(slots, jnp.int32),
                     jnp.where(real, pos // PAGE, jnp.iinfo(jnp.int32).max), pos % PAGE, jnp.where(real, pos + 1, 0),
                     jnp.arange(slots // PAGE + 1, dtype=jnp.int32)[None], jnp.reshape(n - 1, (1,)), None, real)


def _recording(engine, monkeypatch):
    """(token sequence the request knew, its recorded MTP drafts) for every draft record."""
    seen = []
    record = engine.mtp_drafter.record

    def spy(request, drafts):
        seen.append((list(request.prompt_ids) + list(request.output_ids), [int(t) for t in drafts]))
        record(request, drafts)

    monkeypatch.setattr(engine.mtp_drafter, "record", spy)
    return seen


def test_first_drafts_are_the_mtp_layer_chained_on_itself(engine, folder, monkeypatch):
    """After a prompt's prefill the recorded drafts equal mtp_forward run by hand on one device:
    position n-1 with (h_{n-1}, the sampled token) gives draft 1; each next draft runs the layer at
    the next position on its own output hidden state and the previous draft."""
    seen = _recording(engine, monkeypatch)
    ids = engine.tokenizer.encode(PROMPTS[3], add_bos=True)
    engine.add_request(ids, SamplingParams(max_tokens=8), request_id="probe")
    request = engine._requests["probe"]
    while not request.output_ids:
        engine.step()
    assert len(request.output_ids) == 1  # the prefill's token (its chunks fit one step each)
    assert seen[0][0] == ids + request.output_ids  # recorded as the prefill's token reached the host
    got = seen[0][1]
    engine.abort("probe")

    model = load_model(folder, RuntimeOptions(dtype="float32", attention_impl="xla", mtp=True))
    n = len(ids)
    kv = model.new_cache(16, PAGE)
    logits, hidden, kv = jax.jit(lambda m, kv, b: m(kv, b, return_hidden="all"))(model, kv, _seq_batch(ids, 0, [n - 1]))
    first = int(np.argmax(np.asarray(logits)[0]))
    assert first == request.output_ids[0]
    mtp = jax.jit(lambda m, kv, b, h: m.mtp_forward(kv, b, h))
    logits, h, kv = mtp(model, kv, _seq_batch(ids[1:] + [first], 0, [n - 1]), hidden)
    want = [int(np.argmax(np.asarray(logits)[0]))]
    for j in range(1, K):
        logits, h, kv = mtp(model, kv, _seq_batch([want[-1]], n - 1 + j, [0]), h)
        want.append(int(np.argmax(np.asarray(logits)[0])))
    assert got == want


def test_greedy_outputs_equal_decoding_one_token_per_step(engine):
    params = [SamplingParams(max_tokens=m) for m in (24, 17, 21, 9)]
    want = _generate(engine, "off", PROMPTS, params)
    dispatched, before = engine.mtp.num_dispatched + engine.mtp.num_in_step, engine.stats()["speculative"]
    with count_compiles() as compiles:
        got = engine.generate(PROMPTS, params)
    assert compiles.count == 0, compiles.events  # step and draft programs were all compiled at start-up
    spec = engine.stats()["speculative"]
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert [g.text for g in got] == [w.text for w in want]
    assert spec["verify_chunks"] > before["verify_chunks"] and spec["draft_tokens"] > before["draft_tokens"]
    assert engine.mtp.num_dispatched + engine.mtp.num_in_step > dispatched  # drafts were computed in this generate


@pytest.fixture(scope="module", params=[16, 0], ids=["in-step", "draft-program"])
def by_launch(folder, request):
    """An MTP engine whose greedy steps draft inside their own step program (every bucket: 16
    tokens at most here) or in the draft program after it (0); every step drafts (no draft
    budget), so every greedy step takes that path."""
    return Engine(EngineConfig(model=str(folder), **dict(KW, mtp_drafts_in_step_max_tokens=request.param,
                                                         speculative_adaptive=False)))


def test_drafts_inside_the_step_program_or_after_it(by_launch, reference, monkeypatch):
    """--mtp-drafts-in-step-max-tokens: greedy steps compute their drafts in their own step program
    and launch no draft program after it; at 0 the draft program after each step does. Either way
    greedy outputs equal speculation off, every recorded draft equals the hand-chained reference
    (the MTP pass over the step's tokens, the acceptance count, the chain), nothing compiles after
    warm-up; steps with logprobs (a sampler program) run the draft program after them."""
    in_step = by_launch
    params = [SamplingParams(max_tokens=m) for m in (24, 17, 21, 9)]
    want = _generate(in_step, "off", PROMPTS, params)
    seen = _recording(in_step, monkeypatch)
    before = in_step.stats()["speculative"]["mtp_launches"]
    with count_compiles() as compiles:
        got = in_step.generate(PROMPTS, params)
    assert compiles.count == 0, compiles.events
    launches = in_step.stats()["speculative"]["mtp_launches"]
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    if in_step.mtp.in_step_max_tokens:
        assert launches["in_step"] > before["in_step"] + 20 and launches["draft_programs"] == before["draft_programs"]
    else:
        assert launches["in_step"] == 0 and launches["draft_programs"] > before["draft_programs"] + 20
    assert len(seen) > 20
    wrong = [(seq, d, reference(seq)) for seq, d in seen if d != reference(seq)]
    assert not wrong, f"{len(wrong)} of {len(seen)} draft records differ: {wrong[:3]}"
    lp = [SamplingParams(max_tokens=m, logprobs=1) for m in (12, 9)]
    want_lp = _generate(in_step, "off", PROMPTS[:2], lp)
    got_lp = in_step.generate(PROMPTS[:2], lp)
    assert [g.token_ids for g in got_lp] == [w.token_ids for w in want_lp]
    assert in_step.stats()["speculative"]["mtp_launches"]["draft_programs"] > launches["draft_programs"]


def test_max_tokens_and_stop_strings_inside_verify_chunks(engine):
    base = _generate(engine, "off", PROMPTS[:2], SamplingParams(max_tokens=20))
    for i, w in enumerate(base):
        params = [SamplingParams(max_tokens=m) for m in (1, 2, 5, 7)]
        got = engine.generate([PROMPTS[i]] * len(params), params)
        assert [g.token_ids for g in got] == [w.token_ids[:m] for m in (1, 2, 5, 7)]
        text = w.text
        stop = text[len(text) // 2 : len(text) // 2 + 2]
        got = engine.generate([PROMPTS[i]], SamplingParams(max_tokens=20, stop=[stop]))[0]
        assert got.text == text[: text.index(stop)] and got.finish_reason == "stop"



@pytest.fixture(scope="module")
def reference(folder):
    return _Reference(folder)


def test_drafts_after_every_step_are_the_mtp_layers(engine, reference, monkeypatch):
    """With verify chunks that accept none, some or all of their drafts (oracle proposals), the
    MTP drafts the device computes after each step equal the hand-chained reference for the
    sequence the request knows then: the MTP pass over verify rows, the device's acceptance count,
    the chain from the last accepted position and the rewritten slots all hold; outputs unchanged."""
    params = [SamplingParams(max_tokens=m) for m in (24, 17, 21, 9)]
    want = _generate(engine, "off", PROMPTS, params)
    oracle = {tuple(engine.tokenizer.encode(p, add_bos=True)): w.token_ids for p, w in zip(PROMPTS, want)}
    seen = _recording(engine, monkeypatch)
    before = engine.stats()["speculative"]["accepted_histogram"]
    engine.scheduler.set_speculation(_OracleDrafter(oracle), K)
    try:
        got = engine.generate(PROMPTS, params)
        hist = np.subtract(engine.stats()["speculative"]["accepted_histogram"], before)
    finally:
        engine.set_speculative("mtp")
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert hist[0] > 0 and hist[K] > 0 and sum(hist[1:K]) > 0, hist
    assert len(seen) > 20
    wrong = [(seq, d, reference(seq)) for seq, d in seen if d != reference(seq)]
    assert not wrong, f"{len(wrong)} of {len(seen)} draft records differ: {wrong[:3]}"


@pytest.mark.parametrize("logprobs", [None, 1], ids=["step-writes", "latents-program"])
def test_steps_without_drafts_write_the_latents_drafting_reads(engine, reference, monkeypatch, logprobs):
    """A step whose drafts nobody reads (speculation off on an MTP engine, or the draft budget at
    level 0) writes only the MTP latents: its step program does, when it samples its own tokens
    (greedy, or a fused full step), and no draft program runs; a step that hands its logits to a
    sampler program (here: logprobs, which on CPU never fuse) runs the latents-only draft program.
    Prompts prefilled and decoded that way for a few steps, then drafted by the MTP layer: the
    drafts equal the reference (the whole MTP layer run over every position), so those steps wrote
    the latents the full program writes; outputs equal one token per step."""
    params = SamplingParams(max_tokens=24, logprobs=logprobs)
    want = _generate(engine, "off", PROMPTS, [params] * len(PROMPTS))
    seen = _recording(engine, monkeypatch)
    ran = collections.Counter()
    compiled = engine.mtp.compiled

    def spy(layout, bucket, expanded, latents_only=False):
        ran[latents_only] += 1
        return compiled(layout, bucket, expanded, latents_only)

    monkeypatch.setattr(engine.mtp, "compiled", spy)
    run = engine.executor.run

    drafted = []  # per step: whether a draft program reads its input (else it goes to the call as a host buffer)

    def counted(*args, **kw):  # steps dispatched (a step() call may only read back a first token)
        ran["steps"] += 1
        drafted.append(kw.get("drafted"))
        return run(*args, **kw)

    monkeypatch.setattr(engine.executor, "run", counted)
    got = collections.defaultdict(list)
    engine.set_speculative("off")
    in_step0 = engine.mtp.num_in_step
    ids = [engine.add_request(p, params) for p in PROMPTS]
    outs = [o for _ in range(8) for o in engine.step()]
    off_steps, off_dispatched = ran[True], ran["steps"]
    assert drafted == [bool(logprobs)] * off_dispatched  # greedy: the step program wrote the latents itself
    assert (engine.executor.step_inputs is None) == (not logprobs)
    outs += engine.set_speculative("mtp")
    while engine.has_work():
        outs += engine.step()
    for o in outs:
        got[o.request_id] += o.delta_token_ids
    assert [got[i] for i in ids] == [w.token_ids for w in want]
    # drafting then: the draft program after full steps, the step program itself for greedy ones
    drafting = ran[False] if logprobs else engine.mtp.num_in_step - in_step0
    assert off_dispatched >= 6 and off_steps == (off_dispatched if logprobs else 0) and drafting > 0, ran
    assert len(seen) > 10
    wrong = [(seq, d, reference(seq)) for seq, d in seen if d != reference(seq)]
    assert not wrong, f"{len(wrong)} of {len(seen)} draft records differ: {wrong[:3]}"


def test_a_step_mixing_verify_plain_and_prefill_chunks_drafts_as_the_reference(engine, reference, monkeypatch):
    """Steps holding a verify chunk (oracle drafts: none, some or all kept), a plain sampling chunk
    (a request with a penalty is never speculated) and a prefill chunk that samples nothing (a new
    prompt longer than the step's budget): the drafts the draft program computes for them (the MTP
    pass's head only at each chain row's last accepted position, then the chain) equal the MTP
    layer run by hand on one device, and outputs equal decoding one token per step."""
    prompts = [PROMPTS[1], PROMPTS[2], "Pages of latent vectors move between devices while requests keep running."]
    params = [SamplingParams(max_tokens=14), SamplingParams(max_tokens=14, repetition_penalty=1.3),
              SamplingParams(max_tokens=3)]
    want = _generate(engine, "off", prompts[:2], params[:2])  # the third prompt stays out of the prefix cache
    ids = [engine.tokenizer.encode(p, add_bos=True) for p in prompts]
    assert len(ids[2]) > 2 * KW["max_num_batched_tokens"]
    oracle = collections.defaultdict(list, {tuple(i): w.token_ids for i, w in zip(ids, want)})  # drafts for the first
    steps, take = [], engine.mtp.take

    def spy(chunks):  # (chunk kinds of the step, (sequence known, drafts) per sampling chunk)
        got = take(chunks)
        kinds = {"verify" if c.drafts else "plain" if c.samples else "prefill" for c in chunks}
        steps.append((kinds, [(list(r.prompt_ids) + list(r.output_ids), [int(t) for t in d]) for r, d in got or ()]))
        return got

    monkeypatch.setattr(engine.mtp, "take", spy)
    engine.scheduler.set_speculation(_OracleDrafter(oracle), K)
    try:
        for i in range(2):
            engine.add_request(ids[i], params[i], request_id=f"mix-{i}")
        requests = [engine._requests[f"mix-{i}"] for i in range(2)]
        while not all(r.output_ids for r in requests):
            engine.step()
        engine.add_request(ids[2], params[2], request_id="mix-2")  # its prefill beside the two decoding
        requests.append(engine._requests["mix-2"])
        while not all(r.is_finished for r in requests):
            engine.step()
    finally:
        engine.set_speculative("mtp")
    want += _generate(engine, "off", prompts[2:], params[2:])
    assert [list(r.output_ids) for r in requests] == [w.token_ids for w in want]
    mixed = [records for kinds, records in steps if kinds == {"verify", "plain", "prefill"}]
    assert len(mixed) >= 2 and all(len(records) == 2 for records in mixed), [(sorted(k), len(r)) for k, r in steps]
    wrong = [(seq, d, reference(seq)) for records in mixed for seq, d in records if d != reference(seq)]
    assert not wrong, wrong[:3]


def test_full_sampler_steps_feed_the_draft_program(engine, reference, monkeypatch):
    """Steps whose rows want logprobs or draw run the sampler program after the step program; the
    draft program runs on its tokens: greedy rows with logprobs keep the outputs and the drafts
    equal the reference; seeded sampled rows reproduce."""
    params = SamplingParams(max_tokens=12, logprobs=2)
    want = _generate(engine, "off", PROMPTS[:2], params)
    seen = _recording(engine, monkeypatch)
    got = engine.generate(PROMPTS[:2], params)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    np.testing.assert_allclose(got[0].logprobs, want[0].logprobs, atol=2e-4)
    assert seen and all(d == reference(seq) for seq, d in seen)
    sampled = SamplingParams(max_tokens=12, temperature=0.8, seed=3)
    a, b = (engine.generate(PROMPTS[:2], sampled) for _ in range(2))
    assert [x.token_ids for x in a] == [x.token_ids for x in b]


@pytest.mark.parametrize("in_step", [0, 16], ids=["draft-program", "in-step"])
def test_drafts_read_the_step_input_from_pinned_host_memory(folder, engine, reference, monkeypatch, in_step):
    """With step inputs in pinned host memory (the GPU default) the draft program reads the step's
    packed input there, also after a full step, whose input stays in device memory
    (executor.draft_step_input), and a greedy step program with drafts inside takes its input
    there: outputs as with device memory, drafts equal the reference."""
    pinned = Engine(EngineConfig(model=str(folder), **dict(KW, step_input_memory="pinned_host", warmup=False,
                                                           mtp_drafts_in_step_max_tokens=in_step)))
    seen = _recording(pinned, monkeypatch)
    for params in (SamplingParams(max_tokens=12), SamplingParams(max_tokens=12, logprobs=2)):  # greedy, then full steps
        want = _generate(engine, "off", PROMPTS[:2], params)
        got = pinned.generate(PROMPTS[:2], params)
        assert [g.token_ids for g in got] == [w.token_ids for w in want]
    # both kinds of step ran: greedy ones in the program with drafts inside, or apart
    assert {key[3] for key in pinned.executor._compiled} == ({True} if in_step else {False, True})
    assert bool(pinned.mtp._in_step) == bool(in_step)
    assert seen and all(d == reference(seq) for seq, d in seen)


def test_greedy_tokens_equal_the_argmax_of_the_gathered_logits():
    """The draft head's argmax per vocabulary shard (mtp.greedy_tokens, engine/mtp_draft.py) equals
    jnp.argmax over the gathered logits sliced to the vocabulary: small integer logits tie often,
    within and across shards (the first index wins), and padded columns larger than every real one
    never win; on one device and on 8."""
    from jax.sharding import PartitionSpec as Spec

    from splash_jax.layers import logits_dot
    from splash_jax.mesh.layouts import AXIS, make_mesh
    from splash_jax.mtp import greedy_tokens

    rng = np.random.default_rng(2)
    vocab, padded, rows = 120, 128, 40
    h = jnp.asarray(rng.integers(0, 3, (rows, 4)), jnp.float32)
    head = rng.integers(0, 3, (4, padded)).astype(np.float32)
    head[:, vocab:] = 9.0  # padding columns (zero in a real head) above every real logit
    head[:, 5] = head[:, 77]  # a tie across shards: 5 on shard 0, 77 on shard 4
    head = jnp.asarray(head)
    logits = np.asarray(logits_dot(h, head))[:, :vocab]
    want = np.argmax(logits, axis=-1)
    assert (logits == logits.max(-1, keepdims=True)).sum(-1).max() > 1  # ties are exercised
    np.testing.assert_array_equal(np.asarray(jax.jit(greedy_tokens, static_argnums=2)(h, head, vocab)), want)
    sharded = jax.jit(jax.shard_map(lambda h, head: greedy_tokens(h, head, vocab, AXIS), mesh=make_mesh(8),
                                    in_specs=(Spec(), Spec(None, AXIS)), out_specs=Spec(), check_vma=False))
    np.testing.assert_array_equal(np.asarray(sharded(h, head)), want)


# --- every layout and live switches (8 CPU devices) ----------------------------------------------
def _switching(folder, n, in_step=True):
    """n = 2 compiles what it runs (every program of four layouts takes minutes of compiles on a
    2-core host; zero compiles after warm-up is checked at n = 8 and on one device). in_step=False:
    the draft program after every step (--mtp-drafts-in-step-max-tokens 0)."""
    return Engine(EngineConfig(model=str(folder), layout="tp", enable_switching=True, switch_chunk_pages=1,
                               num_devices=n, warmup=n == 8, mtp_drafts_in_step_max_tokens=512 if in_step else 0,
                               **dict(KW, max_num_batched_tokens=8, min_token_bucket=8, max_pages=64)))


@pytest.fixture(scope="module")
def switching(folder, request):
    n, in_step = request.param if isinstance(request.param, tuple) else (request.param, True)
    return _switching(folder, n, in_step)


def _run(engine, params, switches=(), rng=None):
    """PROMPTS arriving every other step; each switch in `switches` starts once the previous is done."""
    done, handles = run_with_switches(engine, PROMPTS, [p.max_tokens for p in params], range(0, 2 * len(PROMPTS), 2),
                                      switches, rng, max_steps=1000)
    return [done[i] for i in range(len(PROMPTS))], handles


# Compiles dominate on a 2-core host: 2 devices, compiled as used, ~50-70 s (default suite);
# 8 devices with every program of four layouts warmed up, ~6 min (slow: -m slow -k layout).
# (2, False): the draft program after every step, as before drafts moved into the step (slow: the
# 2-device default still runs it for steps that move pages; one device checks it in the default suite)
@pytest.mark.parametrize("switching", [2, pytest.param((2, False), marks=pytest.mark.slow),
                                       pytest.param(8, marks=pytest.mark.slow)], indirect=True,
                         ids=["2-devices", "2-devices-draft-program", "8-devices"])
def test_every_layout_and_live_switches_keep_outputs_and_drafts(switching, engine, reference, monkeypatch):
    """In tp, dp, dop and cp, and while live switches move the pages (the MTP layer's latents with
    them): greedy outputs equal one token per step, the MTP drafts recorded after every step equal
    the single-device reference, and nothing compiles. With the draft pass inside greedy step
    programs (the default; steps that move pages keep the draft program after them) and with the
    draft program after every step."""
    from splash_jax.switch.controller import SwitchState

    params = [SamplingParams(max_tokens=m) for m in (20, 14, 17, 9)]
    want = _generate(engine, "off", PROMPTS, params)  # the one-device engine, one token per step
    oracle = {tuple(engine.tokenizer.encode(p, add_bos=True)): w.token_ids for p, w in zip(PROMPTS, want)}
    seen = _recording(switching, monkeypatch)
    hist = np.zeros(K + 1, np.int64)
    with count_compiles() as compiles:
        for layout in LAYOUT_NAMES:
            settle_in(switching, layout)
            switching.scheduler.set_speculation(_OracleDrafter(oracle), K)  # accepts none, some or all
            got, _ = _run(switching, params)
            assert [g.token_ids for g in got] == [w.token_ids for w in want], layout
            hist += switching.stats()["speculative"]["accepted_histogram"]
        settle_in(switching, "tp")
        switching.scheduler.set_speculation(_OracleDrafter(oracle, seed=9), K)
        got, handles = _run(switching, params, ["dp", "dop", "cp", "tp", "dop"], np.random.default_rng(3))
        assert [g.token_ids for g in got] == [w.token_ids for w in want]
        switching.set_speculative("mtp")  # the MTP layer's own drafts, across switches again
        got, more = _run(switching, params, ["cp", "dp", "tp"], np.random.default_rng(4))
        assert [g.token_ids for g in got] == [w.token_ids for w in want]
    if switching.config.warmup:
        assert compiles.count == 0, compiles.events
    assert hist[0] > 0 and hist[K] > 0 and hist[1:K].sum() > 0, hist
    assert sum(h.state == SwitchState.DONE for h in handles + more) >= 5
    assert any(h.steps_overlapped > 1 and h.pages_copied > 0 for h in handles + more)  # pages moved in the background
    wrong = [(seq, d) for seq, d in seen if d != reference(seq)]
    assert len(seen) > 50 and not wrong, f"{len(wrong)} of {len(seen)} draft records differ: {wrong[:3]}"
    assert (switching.mtp.num_in_step > 50) == bool(switching.mtp.in_step_max_tokens)


# --- overlapped MTP steps with a trained head (the bundled model) -------------------------------
TRAINED_PROMPTS = ["def fibonacci(n):", "The capital of France is", "1, 2, 3, 4, 5,",
                   "class Stack:\n    def push(self, x):"]


@pytest.fixture(scope="module")
def trained(request):
    """The bundled model with its trained MTP head (its drafts are often kept, so ahead chunks move
    by 1..K on the device), fixed K (outputs and steps do not depend on timing)."""
    from splash_jax.paths import DEFAULT_MODEL

    n = request.param
    return Engine(EngineConfig(model=str(DEFAULT_MODEL), layout="tp", enable_switching=n > 1, switch_chunk_pages=1,
                               num_devices=n, warmup=False, speculative_adaptive=False,
                               **dict(KW, max_num_batched_tokens=32, max_pages=160)))


def _trained_run(engine, params, switches=(), rng=None):
    done, handles = run_with_switches(engine, TRAINED_PROMPTS, [p.max_tokens for p in params],
                                      range(0, 2 * len(TRAINED_PROMPTS), 2), switches, rng, max_steps=1000)
    return [done[i].token_ids for i in range(len(TRAINED_PROMPTS))], handles


# one device, tp (default suite, ~2 min on a 2-core host); 2 devices, four layouts and switches (slow, ~8 min)
@pytest.mark.parametrize("trained", [1, pytest.param(2, marks=pytest.mark.slow)], indirect=True,
                         ids=["1-device", "2-devices"])
def test_overlapped_mtp_steps_keep_outputs_and_drafts(trained, monkeypatch):
    """MTP steps overlap: the next step is dispatched before this one's tokens and drafts reach
    the host, its verify chunks read the drafts the draft program left on the device and move by
    the drafts the step before kept. With the trained head (drafts often kept): greedy outputs
    equal speculation off in tp, dp, dop and cp and across live switches; in each layout the drafts
    recorded equal synchronous steps' (set_overlap(False)) for the same sequences, and as many are
    kept (MTP drafts do not lag a step, unlike n-gram's)."""
    params = [SamplingParams(max_tokens=m) for m in (40, 33, 41, 29)]
    trained.set_speculative("off")
    want, _ = _trained_run(trained, params)
    trained.set_speculative("mtp")
    seen = _recording(trained, monkeypatch)

    def run(overlap):
        trained.set_overlap(overlap)
        trained.set_speculative("mtp")  # counters start again
        del seen[:]
        got, _ = _trained_run(trained, params)
        spec = trained.stats()["speculative"]
        return got, dict(seen_pairs()), spec["accepted_histogram"], spec["ahead_chunks"]

    def seen_pairs():
        return [(tuple(seq), tuple(d)) for seq, d in seen]

    try:
        for layout in LAYOUT_NAMES if trained.n > 1 else ["tp"]:
            settle_in(trained, layout)
            got, drafts, hist, ahead = run(True)
            assert got == want, layout
            assert ahead > 20 and sum(hist[1:]) > sum(hist) // 2 and hist[K] > 0, (layout, hist, ahead)
            got_sync, drafts_sync, hist_sync, ahead_sync = run(False)
            assert got_sync == want and ahead_sync == 0
            assert drafts == drafts_sync, layout  # the same sequence states, the same drafts
            # the drafts kept per verify chunk: as many (n-gram's lag a step costs it 28-57%); the
            # histograms differ a little near max_tokens, where an ahead chunk's draft count is
            # capped before the host knows what the chunk before it kept
            kept = [np.dot(h, np.arange(K + 1)) / sum(h) for h in (hist, hist_sync)]
            assert kept[0] >= 0.9 * kept[1], (layout, hist, hist_sync)
        if trained.n > 1:
            settle_in(trained, "tp")
            trained.set_overlap(True)
            got, handles = _trained_run(trained, params, ["dp", "dop", "cp", "tp", "dop"], np.random.default_rng(3))
            assert got == want
            assert sum(h.state.value == "done" for h in handles) >= 4
    finally:
        trained.set_overlap(True)
        trained.set_speculative("mtp")


def test_clear_errors(folder):
    with pytest.raises(ValueError, match="num_nextn_predict_layers > 0.*has none"):
        Engine(EngineConfig(model=str(RANDOM_TINY), **dict(KW, warmup=False)))
    plain = Engine(EngineConfig(model=str(RANDOM_TINY), **dict(KW, warmup=False, speculative_method="ngram")))
    assert plain.mtp is None and plain.executor.kv.num_layers == plain.model_config.num_layers  # no MTP layer pooled
    with pytest.raises(ValueError, match="started with --speculative-method mtp"):
        plain.set_speculative("mtp")
    assert plain.config.speculative_method == "ngram"
    off = load_model(folder, RuntimeOptions(dtype="float32"))  # an MTP checkpoint loaded without its layer
    with pytest.raises(ValueError, match="built with its MTP layer"):
        Engine(EngineConfig(**dict(KW, warmup=False)), model=off)
