"""LoRA adapters composed with the rest of the service, on a real `splitserve serve` (Ray, CPU,
1 decode replica prefilling locally) under the official `openai` client, with tenants, a
state directory (the Batch API) and a config file:
- an alias (`aliases:`) and a rules route (`model_routes:`) whose target is an adapter answer
  with that adapter's tokens (transformers + peft), and the base where the route says so;
- a tenant limited (`models:`) to one adapter is served it, and gets 404 model_not_found for
  another adapter and for the base;
- a batch whose lines name adapters gives each line its adapter's tokens."""

from __future__ import annotations

import openai
import pytest
import transformers
import yaml

from splitserve.engine.io.tokenizer import Tokenizer
from tests.helpers.batch_api import completion_line, jsonl, read_lines, wait_for_status
from tests.helpers.peft_adapters import peft_greedy, write_peft_adapter
from tests.helpers.serve_process import ServeProcess
from tests.helpers.transformers_checkpoint import SERVABLE_SHAPE, write_transformers_checkpoint

pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]
ADAPTERS = {"sql": (1, 8, 16, ["q_proj", "v_proj"]), "mlp": (2, 4, 8, ["gate_proj", "up_proj", "down_proj"])}
PROMPT = [5 + (7 * j) % 500 for j in range(37)]
MAX_TOKENS = 8
SQL_ONLY_KEY, ALL_KEY, ADMIN = "sk-sql-only", "sk-all", "sk-admin"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-composition")
    base = root / "base"
    write_transformers_checkpoint(transformers.LlamaConfig(**SERVABLE_SHAPE), base, seed=7, tokenizer=True)
    adapters = {name: write_peft_adapter(base, root / name, *spec) for name, spec in ADAPTERS.items()}
    tokenizer = Tokenizer.from_pretrained(str(base))
    expected = {
        name: tokenizer.decode(peft_greedy(base, path, PROMPT, MAX_TOKENS))
        for name, path in {None: None, **adapters}.items()
    }
    config = root / "serve.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "enable_lora": True,
                "lora_modules": {name: str(path) for name, path in adapters.items()},
                "aliases": {"sql-stable": "sql"},
                "model_routes": [
                    {
                        "name": "auto",
                        "policy": "rules",
                        "default": str(base),
                        "rules": [{"target": "mlp", "header": "x-team", "header_value": "ml"}],
                    }
                ],
                "tenants": [
                    {"name": "analyst", "api_keys": [SQL_ONLY_KEY], "models": ["sql", "sql-stable"]},
                    {"name": "platform", "api_keys": [ALL_KEY]},
                ],
                "admin_api_key": ADMIN,
            }
        )
    )
    flags = ("--config", str(config), "--state-dir", str(root / "state"), "--batch.poll-interval-s", "0.1")
    proc = ServeProcess(str(base), root / "serve.log", *flags, "--prefill-replicas", "0", "--decode-replicas", "1")
    try:
        yield proc, str(base), expected
    finally:
        assert proc.stop() == 0, proc.log_path.read_text()[-3000:]


def client(proc: ServeProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{proc.base_url}/v1", api_key=key, timeout=120, max_retries=0)


def complete(api: openai.OpenAI, model: str, **extra) -> str:
    answer = api.completions.create(
        model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}, **extra
    )
    return answer.choices[0].text


def test_aliases_and_model_routes_target_adapters(served):
    proc, base, expected = served
    api = client(proc, ALL_KEY)
    assert expected["sql"] != expected[None] and expected["mlp"] != expected[None]
    assert complete(api, "sql-stable") == expected["sql"]
    assert complete(api, "auto", extra_headers={"x-team": "ml"}) == expected["mlp"]
    assert complete(api, "auto") == expected[None]  # no rule matched: the route's default, the base


def test_a_tenant_limited_to_an_adapter_gets_404_for_the_others(served):
    proc, base, expected = served
    api = client(proc, SQL_ONLY_KEY)
    assert complete(api, "sql") == complete(api, "sql-stable") == expected["sql"]
    for model in ("mlp", base):
        with pytest.raises(openai.NotFoundError) as refused:
            complete(api, model)
        assert refused.value.code == "model_not_found"


def test_batch_lines_naming_adapters_run_with_them(served):
    proc, base, expected = served
    api = client(proc, ALL_KEY)
    models = ["sql", "mlp", base, "sql-stable"]
    lines = [
        completion_line(f"line-{i}", model, PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True)
        for i, model in enumerate(models)
    ]
    uploaded = api.files.create(file=jsonl(lines), purpose="batch")
    batch = api.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
    done = wait_for_status(api, batch.id, timeout_s=300)
    assert done.status == "completed", done
    output = {x["custom_id"]: x["response"]["body"] for x in read_lines(api, done.output_file_id)}
    want = {"sql": expected["sql"], "mlp": expected["mlp"], base: expected[None], "sql-stable": expected["sql"]}
    for i, model in enumerate(models):
        body = output[f"line-{i}"]
        assert body["choices"][0]["text"] == want[model], model
        # A route's answer names the model that answered (as for any alias): the adapter.
        assert body["model"] == ("sql" if model == "sql-stable" else model)
