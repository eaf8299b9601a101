"""LoRA adapters loaded and unloaded at runtime (vLLM's POST /v1/load_lora_adapter and
/v1/unload_lora_adapter) on a real `splitserve serve` (Ray, CPU, 1P+1D, every prompt prefilled
remotely) behind an API key, under the official `openai` client and httpx: without the key or
with a wrong one, 401; a missing directory or a rank above --max-lora-rank, 400 with the
adapter's one-line refusal and nothing served; a loaded adapter is listed in /v1/models with
the base as `parent` and its next request gives transformers + peft's greedy tokens on both
pools; loading a name twice is 400; unloading takes it out (the next request 404, /v1/models
without it; unloading it again 404), and it loads again after; the block pools end at baseline."""

from __future__ import annotations

import httpx
import openai
import pytest

from splitserve.engine.io.tokenizer import Tokenizer
from tests.cluster import test_lora_serving
from tests.cluster.test_lora_serving import MAX_TOKENS, PATHS, PROMPT, TIMEOUT_S, _at_baseline
from tests.helpers.cluster import wait_until
from tests.helpers.peft_adapters import write_peft_adapter
from tests.helpers.serve_process import ServeProcess

pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]
checkpoint = test_lora_serving.checkpoint  # the base, its three adapters and peft's tokens
API_KEY = "lora-admin-key"


def test_adapters_loaded_and_unloaded_at_runtime(checkpoint, tmp_path):
    base, adapters, expected = checkpoint
    wide = write_peft_adapter(base, tmp_path / "wide", 4, 32, 16, ["q_proj"])  # r=32 > --max-lora-rank 16
    flags = ("--enable-lora", "--lora-modules", f"sql={adapters['sql']}", "--max-loras", "2", "--max-lora-rank", "16")
    proc = ServeProcess(str(base), tmp_path / "serve.log", *flags, "--api-key", API_KEY, *PATHS["disaggregated"])
    try:
        http = httpx.Client(base_url=proc.base_url, timeout=TIMEOUT_S, headers={"Authorization": f"Bearer {API_KEY}"})
        client = openai.OpenAI(base_url=f"{proc.base_url}/v1", api_key=API_KEY, timeout=TIMEOUT_S, max_retries=0)
        tokenizer = Tokenizer.from_pretrained(str(base))

        def complete(model: str) -> str:
            answer = client.completions.create(
                model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}
            )
            return answer.choices[0].text

        def listed() -> dict[str, str | None]:
            return {m["id"]: m.get("parent") for m in http.get("/v1/models").json()["data"]}

        def load(name: str, path, **kw) -> httpx.Response:
            return http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)}, **kw)

        def unload(name: str) -> httpx.Response:
            return http.post("/v1/unload_lora_adapter", json={"lora_name": name})

        baseline = listed()
        assert baseline == {str(base): None, "sql": str(base)}
        # Who may: the API key's holder only.
        assert load("mlp", adapters["mlp"], headers={"Authorization": "Bearer wrong"}).status_code == 401
        no_key = httpx.post(f"{proc.base_url}/v1/load_lora_adapter", json={"lora_name": "mlp", "lora_path": "x"})
        assert no_key.status_code == 401
        # Bad adapters: one line each, nothing served.
        missing = load("mlp", tmp_path / "nowhere")
        assert missing.status_code == 400, missing.text
        assert "mlp" in missing.json()["error"]["message"] and "\n" not in missing.json()["error"]["message"]
        too_wide = load("wide", wide)
        assert too_wide.status_code == 400, too_wide.text
        assert "rank" in too_wide.json()["error"]["message"]
        assert listed() == baseline
        with pytest.raises(openai.NotFoundError):
            complete("wide")
        # Loaded at runtime: listed with its parent, served on the next request with peft's tokens.
        loaded = load("mlp", adapters["mlp"])
        assert loaded.status_code == 200, loaded.text
        assert listed() == {**baseline, "mlp": str(base)}
        assert complete("mlp") == tokenizer.decode(expected["mlp"])
        assert complete("sql") == tokenizer.decode(expected["sql"])
        assert load("mlp", adapters["mlp"]).status_code == 400  # already loaded
        # Unloaded: out of the catalog, the next request 404; the others serve on.
        unloaded = unload("mlp")
        assert unloaded.status_code == 200, unloaded.text
        with pytest.raises(openai.NotFoundError):
            complete("mlp")
        assert listed() == baseline
        assert unload("mlp").status_code == 404
        assert complete(str(base)) == tokenizer.decode(expected[None])
        # Every replica let it go: it loads again.
        assert load("mlp", adapters["mlp"]).status_code == 200
        assert complete("mlp") == tokenizer.decode(expected["mlp"])
        assert unload("mlp").status_code == 200
        wait_until(lambda: _at_baseline(proc.base_url), None, "block pools not back to baseline", interval_s=0.2)
    finally:
        assert proc.stop() == 0, proc.log_path.read_text()[-3000:]
