"""The workers use the engine through its API only: parse prefill/, decode/ and the replica
runtime they share (runtime/), and fail on any engine attribute outside EngineProtocol
(engine/engine_protocol.py), any EngineLoop attribute outside its API, any engine import outside
the allowed names, and any underscore attribute of an object other than the worker itself."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from splitserve.engine.engine_loop import EngineLoop
from splitserve.engine.engine_protocol import EngineProtocol, protocol_members
from splitserve.engine.llm_engine import LLMEngine

REPO = Path(__file__).resolve().parents[2]
WORKER_SOURCES = sorted([*REPO.glob("prefill/*.py"), *REPO.glob("decode/*.py"), *REPO.glob("runtime/*.py")])

# The workers' engine API is the EngineProtocol: every name it declares, nothing else.
LLM_ENGINE_API = protocol_members()
# make_sequence: LLMEngine.make_sequence with a constrained request's grammar compiled off the loop.
ENGINE_LOOP_API = {
    "call",
    "make_sequence",
    "add_sequence",
    "admit_prefilled",
    "accept_first_token",
    "reserve_prompt_blocks",
    "abort",
    "stop",
    # a dead loop: whether it runs, why it stopped, what it left; and the chaos-test faults
    "alive",
    "stop_reason",
    "final_stats",
    "inject_faults",
    "holding",
}
ENGINE_IMPORTS = {
    "splitserve.engine.config": {"EngineConfig"},
    "splitserve.engine.engine_loop": {"EngineLoop"},
    "splitserve.engine.fault_injector": {"StepFaults"},  # what the loop's inject_faults takes
    "splitserve.engine.engine_errors": {
        "EngineLoopStopped",
        "EngineStepError",
        "LoraAdapterBusyError",
        "LoraAdapterError",
    },
    "splitserve.engine.engine_protocol": {"EngineProtocol", "LayerHookFactory"},
    "splitserve.engine.engine_factory": {"build_engine"},
    "splitserve.engine.core.scheduler": {"ScheduledBatch"},  # what a layer hook is given
    "splitserve.engine.core.sequence": {"Sequence"},  # what make_sequence returns
    "splitserve.proto.messages.kv_events": {"KVEvent"},  # what take_events returns (kept in the event log)
    "splitserve.engine.io.block_reservation": {"BlockReservation"},
    "splitserve.engine.io.request_output": {"RequestOutput"},
    "splitserve.proto.messages.sampling_params": {"SamplingParams"},
    # A tensor-parallel replica's follower ranks (runtime/tp_rank_actor.py): how rank 0 starts
    # them, and the loop each runs (the same forward on the batch rank 0 sends).
    "splitserve.engine.parallel.tp_ranks": {"FollowerLauncher", "FollowerStart"},
    "splitserve.engine.parallel.tp_follower": {"run_follower"},
}


ENGINE_TYPES = {"EngineProtocol", "LLMEngine", "SimulatedEngine"}


def _is_annotated_engine(arg: ast.arg) -> bool:
    ann = arg.annotation
    return (isinstance(ann, ast.Name) and ann.id in ENGINE_TYPES) or (
        isinstance(ann, ast.Constant) and ann.value in ENGINE_TYPES
    )


def _engine_names(tree: ast.AST) -> set[str]:
    """Names bound to an engine: `engine`, parameters annotated with an engine type, names assigned
    self.engine, and the parameter of a lambda handed to EngineLoop.call (run as fn(engine))."""
    names = {"engine"}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            names.update(a.arg for a in node.args.args if _is_annotated_engine(a))
        if isinstance(node, ast.Assign) and _is_self_attr(node.value, "engine"):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "call":
            fn = node.args[0] if node.args else None
            if isinstance(fn, ast.Lambda) and fn.args.args:
                names.add(fn.args.args[0].arg)
    return names


def _is_self_attr(node: ast.AST, attr: str) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and node.attr == attr
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    )


def _is_self_or_super(node: ast.AST) -> bool:
    if isinstance(node, ast.Call):
        node = node.func
    return isinstance(node, ast.Name) and node.id in ("self", "super")


def violations(source: str, filename: str = "<source>") -> list[str]:
    tree = ast.parse(source, filename)
    engine_names = _engine_names(tree)
    found = []
    for node in ast.walk(tree):
        where = f"{filename}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Attribute):
            target = node.value
            if _is_self_attr(target, "engine") or (isinstance(target, ast.Name) and target.id in engine_names):
                if node.attr not in LLM_ENGINE_API:
                    found.append(f"{where}: EngineProtocol.{node.attr} is not in the workers' engine API")
            elif _is_self_attr(target, "loop") and node.attr not in ENGINE_LOOP_API:
                found.append(f"{where}: EngineLoop.{node.attr} is not in the workers' loop API")
            private = node.attr.startswith("_") and not node.attr.endswith("__")
            if private and not _is_self_or_super(target):
                found.append(f"{where}: {ast.unparse(node)} reaches into another object's private state")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("splitserve.engine"):
            allowed = ENGINE_IMPORTS.get(node.module, set())
            for alias in node.names:
                if alias.name not in allowed:
                    found.append(f"{where}: imports {node.module}.{alias.name}, not part of the engine API")
        elif isinstance(node, ast.Import):
            found.extend(
                f"{where}: imports {a.name} whole" for a in node.names if a.name.startswith("splitserve.engine")
            )
    return found


def test_workers_use_only_the_engine_api():
    assert {p.parent.name for p in WORKER_SOURCES} == {"prefill", "decode", "runtime"}
    found = []
    used = set()
    for path in WORKER_SOURCES:
        source = path.read_text()
        found += violations(source, str(path.relative_to(REPO)))
        used |= {name for name in LLM_ENGINE_API | ENGINE_LOOP_API if f".{name}(" in source or f".{name}," in source}
    assert not found, "\n".join(found)
    # The check sees the real traffic (it is not vacuous): the handoff operations are in use.
    assert {"reserve_prompt_blocks", "admit_prefilled", "release_prefilled", "take_events", "call"} <= used


def test_the_engine_loop_uses_only_the_protocol():
    """EngineLoop runs either engine: it too touches nothing outside EngineProtocol."""
    source = (REPO / "engine/engine_loop.py").read_text()
    found = [v for v in violations(source, "engine/engine_loop.py") if "EngineProtocol." in v]
    assert not found, "\n".join(found)
    assert ".step(" in source and "engine.abort_all()" in source  # the check sees its engine calls


def test_allow_lists_name_public_api_that_exists():
    assert {"reserve_prompt_blocks", "admit_prefilled", "take_events", "step", "kv_cache"} <= LLM_ENGINE_API
    for name in LLM_ENGINE_API:
        assert not name.startswith("_")
    # LLMEngine declares the Protocol, and defines (or sets in __init__) every name of it.
    assert EngineProtocol in LLMEngine.__mro__
    engine_source = (REPO / "engine/paged_engine.py").read_text()
    for name in LLM_ENGINE_API:
        defined = any(name in vars(cls) for cls in LLMEngine.__mro__ if cls is not EngineProtocol)
        assert defined or f"self.{name} = " in engine_source, name
    for name in ENGINE_LOOP_API:
        assert hasattr(EngineLoop, name), name


@pytest.mark.parametrize(
    "snippet,what",
    [
        ("self.engine.scheduler.requests[rid]", "EngineProtocol.scheduler"),
        ("self.loop.call(lambda e: e.kv.free(seq))", "EngineProtocol.kv"),
        ("def f(eng: LLMEngine):\n    eng.runner.forget(rid)", "EngineProtocol.runner"),
        ("engine.outputs.process(seq)", "EngineProtocol.outputs"),
        ("eng = self.engine\neng.scheduler.finish(seq)", "EngineProtocol.scheduler"),
        ("def f(eng: EngineProtocol):\n    eng.tokenizer.encode(text)", "EngineProtocol.tokenizer"),
        ("self.loop.register_sink(rid, sink)", "EngineLoop.register_sink"),
        ("self.loop._sinks[rid] = sink", "private state"),
        ("seq._secret", "private state"),
        ("super()._x\nself.engine.kv_cache._kv", "private state"),
        ("from splitserve.engine.core.kv_cache_manager import KVCacheManager", "not part of the engine API"),
        ("import splitserve.engine.core.scheduler", "whole"),
    ],
)
def test_the_check_catches_internals(snippet, what):
    found = violations(snippet)
    assert any(what in v for v in found), found
    assert (
        violations("self.engine.reserve_prompt_blocks(seq)\nself._mine = 1\nself.loop.call(lambda e: e.stats())") == []
    )
