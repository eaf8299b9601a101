"""GrammarConfig: the bounds a structured-output constraint must stay within, and how the
ingress compiles new grammars in isolated worker processes, validated on construction (pydantic).

One definition for every surface: ServeConfig nests it as `grammar` (so the CLI flags
`--grammar.max-rules` ..., the YAML file and the Helm values schema all derive from it), the
engine reads it (EngineConfig.grammar) and the ingress's isolated checker reads it. Each
field's docstring is its help text. Torch-free.

Why these defaults: llguidance segfaults on a GBNF chain 10,000 rules deep (3,000 was fine),
its JSON reader stops at 128 levels, and a regex like `a{1000000}` compiles but fails lazily
mid-generation ("too many expressions constructed"). The defaults sit well below each.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from splitserve.proto.messages.grammar_spec import HARD_MAX_JSON_DEPTH


class GrammarConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True)

    max_rules: int = Field(2000, ge=1, le=100_000)
    """Most rules a GBNF or Lark grammar may define."""
    max_rule_depth: int = Field(500, ge=1, le=100_000)
    """Longest chain of rule references (root -> r1 -> r2 ...) in a GBNF or Lark grammar."""
    max_schema_depth: int = Field(64, ge=2, le=HARD_MAX_JSON_DEPTH)
    """Deepest nesting of objects and arrays in a JSON schema (its JSON text)."""
    max_regex_repeat: int = Field(10_000, ge=1)
    """Largest counted repetition in a regex (nested ones multiply: (a{100}){100} is 10,000)."""
    cache_size: int = Field(256, ge=1)
    """Compiled grammars each process keeps (LRU); the ingress keeps as many verdicts."""
    compile_workers: int = Field(2, ge=1, le=64)
    """Isolated processes per ingress that compile new grammars (a crash there costs one request)."""
    prestart_workers: bool = True
    """Start the compile workers with the ingress, so no constrained request waits for one to start
    (~1 s: an interpreter, llguidance and the tokenizer); off, each starts on its first compile."""
    compile_timeout_s: float = Field(10.0, gt=0)
    """Longest an isolated grammar compile may run before its worker is killed (the request: 400)."""
    compile_memory_mb: int = Field(2048, ge=256)
    """Address-space cap (RLIMIT_AS) of each isolated compile worker, in MiB."""
