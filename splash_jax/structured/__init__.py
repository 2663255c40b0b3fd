"""Structured outputs: what a request's text must match (JSON schema, regex, choice, grammar),
compiled with llguidance and enforced by a per-step token mask the sampler applies on the device."""

from splash_jax.structured.spec import StructuredOutputs

__all__ = ["StructuredOutputs"]
