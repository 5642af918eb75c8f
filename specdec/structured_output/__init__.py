"""Structured output: grammars that constrain what a request may generate (JSON schema, regex,
choice, EBNF), enforced on every row the target verifies and on every draft, so speculation
stays lossless with respect to the constrained target distribution."""
from specdec.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
