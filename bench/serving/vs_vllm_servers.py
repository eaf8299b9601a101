"""The servers vs_vllm_bench starts (tuned vLLM-CPU, splitserve colocated and 1P+1D), and the
variants of them a run adds from its command line: `--variant NAME=BASE` starts BASE again
under NAME, `--server-arg NAME=ARGS` appends arguments to NAME's command and `--server-env
NAME=KEY=VALUE` sets a variable in its environment, so that a flag or an environment switch
can be compared against the default in one run, every server measured by the same clients on
the same machine state."""

from __future__ import annotations

import dataclasses
import shlex
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ServerUnderTest:
    """A server command line (with {port}) and the environment it starts with."""

    name: str
    command: str  # contains {port}
    env: dict[str, str]


def vllm_server(vllm_python: Path, model_dir: Path, threads: int, kv_cache_gib: int) -> ServerUnderTest:
    """vLLM-CPU as its docs tune it: tcmalloc and the venv's Intel OpenMP preloaded, OpenMP
    threads bound to the cores it may use, its KV cache space set."""
    venv = vllm_python.parent.parent
    iomp = sorted(venv.glob("lib/libiomp5.so")) + sorted(venv.glob("lib/python3*/site-packages/**/libiomp5.so"))
    preload = ["/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"] + [str(p) for p in iomp[:1]]
    command = (
        f"{vllm_python} -m vllm.entrypoints.openai.api_server --model {model_dir} --host 127.0.0.1 --port {{port}}"
        " --dtype float32 --max-num-seqs 64 --max-model-len 4096"
    )
    env = {
        "LD_PRELOAD": ":".join(p for p in preload if Path(p).exists()),
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
    }
    return ServerUnderTest(f"vllm-{threads}t", command, env)


def splitserve_servers(model_dir: Path, splitserve_bin: Path, kv_cache_gib: int) -> list[ServerUnderTest]:
    """Each replica's KV cache as large as vLLM's (the default 1,024 blocks hold 16k tokens:
    fewer than 32 requests of 1,000 prompt tokens, which would then queue for blocks)."""
    kv = f"--decode.kv-cache-memory-bytes {kv_cache_gib}Gi"
    serve = f"{splitserve_bin} serve --model {model_dir} --http-port {{port}} --grpc-port 0 --decode-replicas 1 {kv}"
    one_p_one_d = (
        f"{serve} --prefill-replicas 1 --prefill-num-cpus 1 --decode-num-cpus 1"
        f" --prefill.kv-cache-memory-bytes {kv_cache_gib}Gi"
    )
    return [
        ServerUnderTest("splitserve-colocated", f"{serve} --prefill-replicas 0 --decode-num-cpus 2", {}),
        ServerUnderTest("splitserve-1p1d", f"{one_p_one_d}", {}),
        # The prefill replica's GEMMs on both cores: at low load the decode replica's core is
        # idle while a prompt prefills.
        ServerUnderTest("splitserve-1p1d-prefill2t", f"{one_p_one_d} --prefill.torch-threads 2", {}),
    ]


def _split_named(option: str, value: str) -> tuple[str, str]:
    """'NAME=REST' -> (NAME, REST); ValueError naming the option when NAME or '=' is missing."""
    name, sep, rest = value.partition("=")
    if not sep or not name.strip():
        raise ValueError(f"{option} takes NAME=..., got {value!r}")
    return name.strip(), rest


def with_overrides(
    servers: dict[str, ServerUnderTest],
    variants: list[str],
    server_args: list[str],
    server_envs: list[str],
) -> dict[str, ServerUnderTest]:
    """servers plus each variant (NAME=BASE: BASE's command and environment under NAME), then
    each NAME=ARGS appended to NAME's command and each NAME=KEY=VALUE set in NAME's
    environment, in the order given. ValueError on an unknown name or a malformed value."""
    result = dict(servers)

    def known(option: str, name: str) -> ServerUnderTest:
        if name not in result:
            raise ValueError(f"{option}: no server {name!r}; known: {', '.join(sorted(result))}")
        return result[name]

    for value in variants:
        name, base = _split_named("--variant", value)
        if name in result:
            raise ValueError(f"--variant: {name!r} is already a server")
        result[name] = dataclasses.replace(known("--variant", base.strip()), name=name)
    for value in server_args:
        name, extra = _split_named("--server-arg", value)
        server = known("--server-arg", name)
        result[name] = dataclasses.replace(server, command=f"{server.command} {extra.strip()}")
    for value in server_envs:
        name, assignment = _split_named("--server-env", value)
        server = known("--server-env", name)
        key, sep, env_value = assignment.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--server-env takes NAME=KEY=VALUE, got {value!r}")
        result[name] = dataclasses.replace(server, env={**server.env, key.strip(): env_value})
    return result


def shell_command(server: ServerUnderTest) -> str:
    """The server's command line with its environment in front, for /bin/sh (values quoted)."""
    env_prefix = " ".join(f"{key}={shlex.quote(value)}" for key, value in server.env.items())
    return f"{env_prefix} {server.command}".strip()
