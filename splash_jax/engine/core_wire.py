"""The messages between API-server front ends and the engine core process, and their encoding.

Transport: ZeroMQ over ipc sockets. Front ends PUSH to the core's one PULL socket; the core
PUSHes to a PULL socket each front end binds (named in its HELLO), so each side's sockets are
used by one thread and messages keep their order. Encoding: msgpack via msgspec (typed structs,
no pickling); one message per step per front end carries every request's new tokens.
"""

from __future__ import annotations

import dataclasses

import msgspec
import numpy as np

from splash_jax.engine.core_output import CoreOutput
from splash_jax.engine.request import Request, SamplingParams

# message kinds (the first frame)
HELLO = b"H"  # front end -> core: (client index, its output address, its pid)
ADD = b"A"  # front end -> core: (client index, [NewRequest])
ABORT = b"X"  # front end -> core: [(request id, reason)]
CALL = b"C"  # front end -> core: Call
GONE = b"G"  # launcher -> core: a front end died (its index): abort its requests
STOP = b"S"  # launcher -> core: shut down
OUTPUTS = b"O"  # core -> front end: [CoreOutput] of one step
STATS = b"T"  # core -> front end: the engine's stats dict (a few times a second)
RESULT = b"R"  # core -> front end: CallResult


class NewRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    prompt_ids: list[int]
    params: dict  # SamplingParams as a dict (structured_outputs nested)
    sample_seed: int
    cache_salt: str | None = None

    @classmethod
    def of(cls, request: Request) -> "NewRequest":
        return cls(request.request_id, request.prompt_ids, _params_dict(request.params), request.sample_seed,
                   request.cache_salt)

    def to_request(self) -> Request:
        from splash_jax.structured.spec import StructuredOutputs

        p = dict(self.params)
        so = p.pop("structured_outputs", None)
        p["logit_bias"] = {int(k): v for k, v in (p.get("logit_bias") or {}).items()}
        params = SamplingParams(**p, structured_outputs=StructuredOutputs(**so) if so is not None else None)
        return Request(self.request_id, self.prompt_ids, params, sample_seed=self.sample_seed, cache_salt=self.cache_salt)


class Call(msgspec.Struct, array_like=True, gc=False):
    call_id: int
    name: str
    args: list


class CallResult(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    call_id: int
    ok: bool
    value: object = None
    error: str | None = None
    error_type: str | None = None  # "ValueError", "RuntimeError", ... (the front end raises the same kind)


def _params_dict(params: SamplingParams) -> dict:
    d = {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}
    so = d.pop("structured_outputs")
    if so is not None:
        d["structured_outputs"] = {f.name: getattr(so, f.name) for f in dataclasses.fields(so)}
    return d


def _enc_hook(obj):
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if dataclasses.is_dataclass(obj):
        return dataclasses.asdict(obj)
    return str(obj)


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
encode = _encoder.encode
decode_outputs = msgspec.msgpack.Decoder(list[CoreOutput]).decode
decode_new = msgspec.msgpack.Decoder(tuple[int, list[NewRequest]]).decode
decode_call = msgspec.msgpack.Decoder(Call).decode
decode_result = msgspec.msgpack.Decoder(CallResult).decode
decode_any = msgspec.msgpack.Decoder().decode


# What a front end may ask the core between steps, by name (plain data in, plain data out): the
# same table serves the in-process AsyncEngine.utility and the core process's CALL messages.
CALLS = {
    "stats": lambda engine: engine.stats(),
    "switch_layout": lambda engine, dst, preempt=False: engine.switch_layout(dst, preempt).as_dict(),
    "switch_done": lambda engine: engine.switch_done(),
    "last_switch": lambda engine: engine.last_switch(),
    "reset_prefix_cache": lambda engine: engine.reset_prefix_cache(),
    "set_prefix_caching": lambda engine, enabled: engine.set_prefix_caching(enabled),
    "capacities": lambda engine: engine.capacities(),
}
