"""What the HTTP and gRPC frontends call: tokenization, validation, admission control,
metrics, and streaming generation through the disaggregated cluster."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

from splitserve.cluster.config import ServeConfig
from splitserve.cluster.control.disagg_cluster import DisaggCluster
from splitserve.cluster.control.in_process_controller_client import InProcessControllerClient
from splitserve.cluster.frontend.admission import Admission
from splitserve.cluster.frontend.first_token_stages import observe_first_token, with_ingress_stage
from splitserve.cluster.frontend.ingress_identity import check_unicode, default_ingress_id
from splitserve.cluster.frontend.metrics import GrammarCheckCollector, Metrics, RouterViewCollector
from splitserve.cluster.frontend.pool_health import pool_health
from splitserve.cluster.frontend.serving_api import ChoiceRequest
from splitserve.cluster.frontend.token_meter import TokenMeter
from splitserve.cluster.ingress.controller_client import ControllerClient
from splitserve.cluster.ingress.ingress_reporter import IngressReporter
from splitserve.cluster.request_error import ErrorKind, RequestError, invalid
from splitserve.cluster.routing.replica_pools import DECODE, PREFILL
from splitserve.cluster.state.database import open_state_engine, state_database_url
from splitserve.cluster.tenants.tenant_gate import TenantGate
from splitserve.cluster.tenants.tenant_metrics import TenantMetrics
from splitserve.engine.io.request_validation import validate_prompt
from splitserve.engine.io.tokenizer import Tokenizer
from splitserve.engine.kv_cache_sizing import kv_cache_summary
from splitserve.engine.model_config import ModelConfig
from splitserve.engine.structured_output.grammar_limits import check_schema
from splitserve.engine.structured_output.isolated_grammar_checker import IsolatedGrammarChecker
from splitserve.proto.messages.grammar_spec import GrammarSpec
from splitserve.proto.messages.handoff import StreamChunk
from splitserve.proto.messages.ingress_report import encode_families, families_of
from splitserve.proto.messages.invalid_request import InvalidRequestError
from splitserve.proto.messages.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
# splitserve_requests_total{status}: OK, CANCELLED, or the ErrorKind that ended the request.
OK, CANCELLED = "ok", "cancelled"


class ServingBackend:
    def __init__(
        self,
        cfg: ServeConfig,
        model_dir: str,
        cluster: DisaggCluster | None = None,
        controller: ControllerClient | InProcessControllerClient | None = None,
        ingress_id: str | None = None,
        share_with: ServingBackend | None = None,
        hash_seed: str | None = None,
    ):
        """controller: the controller deployment's client (an ingress replica); None: run
        the controller in-process (tests, tools). cluster: a ready-made DisaggCluster.
        share_with: the backend of another model of this ingress replica, whose admission and
        tenant gate this one shares (one replica-wide queue and one set of tenant leases).
        hash_seed: the model's block-hash seed, as its engines have it (ModelControllers)."""
        self.cfg = cfg
        # Names this ingress replica: the prefix of its request ids, and the response header
        # / gRPC metadata that says which replica carried a request.
        self.ingress_id = ingress_id or default_ingress_id()
        self.model_dir = model_dir
        self.model_name = cfg.model_id
        self.tokenizer = Tokenizer.from_pretrained(model_dir)
        self.model_config = ModelConfig.from_pretrained(model_dir)
        self.max_model_len = self.model_config.resolve_max_model_len(cfg.max_model_len)
        # Each pool's KV cache as its replicas size it (kv_cache_memory_bytes -> blocks), for
        # /health and the longest request a replica can hold.
        sizing = (self.model_config, cfg.block_size)
        self.kv_caches = {
            name: kv_cache_summary(
                *sizing, p.kv_cache_dtype, cfg.dtype, p.num_kv_blocks, p.kv_cache_memory_bytes, self.max_model_len
            )
            for name, p in ((PREFILL, cfg.prefill), (DECODE, cfg.decode))
        }
        pools = [DECODE] + ([PREFILL] if cfg.prefill.replicas or cfg.prefill.autoscaling.enabled else [])
        self.max_cache_tokens = min(self.kv_caches[p]["num_blocks"] for p in pools) * cfg.block_size
        self.vocab_size = self.model_config.vocab_size  # token ids are below it (/openapi.json says so)
        eos = self.tokenizer.eos_token_ids or self.model_config.eos_token_ids
        # Checks constrained requests before any compute: static bounds here, then a compile in
        # an isolated process (a crash there costs one request); replicas compile their own copies.
        self.grammar = IsolatedGrammarChecker(self.tokenizer.to_json(), self.model_config.vocab_size, eos, cfg.grammar)
        self.metrics = Metrics(self.model_name)
        # What the controller hears from this ingress: latencies (the autoscaler's TTFT / ITL
        # signals), in-flight requests (drains), and the samples it merges into /metrics.
        self.reporter = IngressReporter(self.metrics.registry)
        # In-process (no controller deployment): that controller autoscales, as the service's does.
        self.cluster = cluster or DisaggCluster(
            cfg,
            model_dir,
            controller=controller,
            make_report=self.reporter.report,
            autoscale=controller is None,
            ingress_id=self.ingress_id,
            hash_seed=hash_seed,
        )
        host_blocks = self._indexed_host_blocks if cfg.kv_offloading_size > 0 else None
        self.metrics.registry.register(
            RouterViewCollector(self.model_name, self.ingress_id, self._indexed_blocks, host_blocks)
        )
        self.metrics.registry.register(GrammarCheckCollector(self.model_name, self.ingress_id, self.grammar.stats))
        self.num_inflight = 0  # this model's interactive requests (admission counts every model's)
        self.num_sheddable_inflight = 0  # this model's batch requests
        self.admission = share_with.admission if share_with is not None else Admission(cfg)
        # Tenants (keys with limits, budgets, metering): enforced here, leased from the state store.
        self._owns_tenants = share_with is None
        self.tenants: TenantGate | None = share_with.tenants if share_with is not None else None
        if self._owns_tenants and (cfg.tenants or cfg.tenants_file):
            engine = open_state_engine(state_database_url(cfg.state_dir, cfg.state_url))
            self.tenants = TenantGate(cfg, engine, self.ingress_id, TenantMetrics(self.metrics.registry))

    async def start(self) -> None:
        if self.tenants is not None and self._owns_tenants:
            self.tenants.start()
        if self.grammar.config.prestart_workers:
            await asyncio.gather(self.cluster.start(), asyncio.to_thread(self.grammar.warm))
        else:
            await self.cluster.start()

    def _indexed_blocks(self) -> dict[str, int]:
        router = self.cluster.router
        return {pool: router.index(pool).num_indexed_hashes for pool in (PREFILL, DECODE)}

    def _indexed_host_blocks(self) -> dict[str, int]:
        router = self.cluster.router
        return {pool: router.index(pool).num_indexed_host_hashes for pool in (PREFILL, DECODE)}

    async def shutdown(self) -> None:
        if self.tenants is not None and self._owns_tenants:
            await self.tenants.close()
        self.grammar.close()
        await self.cluster.shutdown()

    # ---- model facts ---------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str) or not text:
            raise invalid("the prompt is empty")
        check_unicode(text)
        return self.tokenizer.encode(text)

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """/tokenize: like encode, but an empty text is fine."""
        check_unicode(text)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def render_chat(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        add_special_tokens: bool = False,
    ) -> list[int]:
        if not messages:
            raise invalid("messages must not be empty")
        extra = {} if tools is None else {"tools": tools}  # templates that know tools show them
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **extra)
        except (ValueError, TypeError, KeyError) as exc:
            raise invalid(f"could not apply the chat template: {exc}") from None
        check_unicode(text)
        # The template writes the special tokens itself; encoding must not add them again.
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        try:
            validate_prompt(
                prompt_token_ids, params, self.model_config.vocab_size, self.max_model_len, self.max_cache_tokens
            )
        except InvalidRequestError as exc:
            raise invalid(str(exc)) from None

    def health(self) -> dict:
        """This model's pools: see cluster/frontend/pool_health.py."""
        return pool_health(self.cluster, self.kv_caches)

    # ---- generation ----------------------------------------------------------------------
    def generate(self, choice: ChoiceRequest) -> AsyncIterator[StreamChunk]:
        """_generate's chunks, metered for the choice's tenant part (if any) however they end."""
        return choice.metered(self._generate(choice))

    async def _generate(self, choice: ChoiceRequest) -> AsyncIterator[StreamChunk]:
        """Admit, stream (ModelService validated the choice). Raises RequestError (before the first chunk on refusal).
        sheddable (batch work): outside the interactive limits, and routed only to decode
        replicas with headroom (the router's BatchHeadroom), else 429.
        timeout_s: the client's own deadline, capped by request_timeout_s; past it the
        request fails with kind DEADLINE and its KV blocks are freed. label: the client's own
        id for the request (gRPC request_id, HTTP x-request-id), only logged: the chunks carry
        the server's request id, which is unique."""
        prompt_token_ids, params, label, timeout_s = (
            choice.prompt_token_ids,
            choice.params,
            choice.label,
            choice.timeout_s,
        )
        sheddable = choice.sheddable
        if timeout_s is not None and not timeout_s > 0:
            raise invalid(f"the request timeout must be a positive number of seconds, got {timeout_s!r}")
        deadline = time.time() + min(timeout_s or self.cfg.request_timeout_s, self.cfg.request_timeout_s)
        if params.lora_adapter is not None:
            self.metrics.lora_requests.labels(params.lora_adapter).inc()
        if params.structured_output is not None:
            self.metrics.structured_requests.labels(params.structured_output.kind).inc()
            await self.check_grammar(params.structured_output, deadline)
        try:
            key = self.admission.admit(choice.api_key, sheddable)
        except RequestError as exc:
            self.metrics.requests.labels(exc.kind.value).inc()
            raise
        # Batch work is not counted against the interactive limits (nor drives autoscaling,
        # unless priority.autoscale_on_batch).
        counted = not sheddable
        reported = counted or self.cfg.priority.autoscale_on_batch
        if counted:
            self.num_inflight += 1
        else:
            self.num_sheddable_inflight += 1
        self.metrics.frontend_inflight.set(self.num_inflight)
        self.metrics.prompt_tokens.inc(len(prompt_token_ids))
        start = last = time.perf_counter()
        status = OK
        first = True
        finished = False
        meter = TokenMeter(self.metrics, self.reporter if reported else None)
        try:
            async for chunk in self.cluster.generate(
                prompt_token_ids,
                params,
                label,
                deadline=deadline,
                on_route=self._on_route,
                sheddable=sheddable,
                migrations=self.metrics.migrations,
            ):
                now = time.perf_counter()
                gap = None
                if first:
                    self.metrics.ttft.observe(now - start)
                    ingress_s = None if choice.received_at is None else start - choice.received_at
                    chunk = with_ingress_stage(chunk, ingress_s)
                    observe_first_token(self.metrics.first_token_stage, chunk)
                    if reported:
                        self.reporter.observe_ttft(now - start)
                    self.metrics.prefix_query_tokens.inc(len(prompt_token_ids))
                    self.metrics.prefix_hit_tokens.inc(chunk.num_cached_tokens)
                    if chunk.queue_seconds is not None:
                        self.metrics.queue_time.observe(chunk.queue_seconds)
                    first = False
                elif chunk.token_ids:
                    gap = (now - last) / len(chunk.token_ids)
                last = now
                meter.add(len(chunk.token_ids), gap)
                if chunk.finished:
                    finished = True
                    meter.flush()
                    self.metrics.observe_finished(chunk.finish_reason, len(prompt_token_ids), chunk.num_output_tokens)
                yield chunk
        except RequestError as exc:
            status = exc.kind.value
            raise
        except BaseException:
            status = CANCELLED  # the client went away or the frontend failed
            raise
        finally:
            meter.flush()
            if counted:
                self.num_inflight -= 1
            else:
                self.num_sheddable_inflight -= 1
            self.admission.release(key, sheddable)
            self.metrics.frontend_inflight.set(self.num_inflight)
            self.metrics.requests.labels(status).inc()
            if status == CANCELLED and not finished:
                self.metrics.request_success.labels("abort").inc()
            if status == OK:
                self.metrics.e2e.observe(time.perf_counter() - start)

    async def check_constraint(
        self,
        spec: GrammarSpec | None,
        field: str,
        parts: dict[str, object] | None = None,
        deadline: float | None = None,
    ) -> None:
        """The one check of a structured-output or tool constraint, for HTTP and gRPC alike,
        before any compute: parts (a tool's parameters schema, by its field) against the static
        bounds, then the whole constraint: bounds, and a compile in an isolated worker (cached
        verdicts). Raises RequestError INVALID naming the field and the limit, or DEADLINE."""
        for name, schema in (parts or {}).items():
            try:
                check_schema(schema, self.cfg.grammar, "the schema")
            except InvalidRequestError as exc:
                raise invalid(f"{name}: {exc}", name) from None
        if spec is not None:
            deadline = deadline or time.time() + self.cfg.request_timeout_s
            await self.check_grammar(spec, deadline, field)

    async def check_grammar(self, spec: GrammarSpec, deadline: float, field: str | None = None) -> None:
        """Check a request's grammar (a cached verdict, or an isolated compile) on a worker thread:
        an invalid, unsatisfiable or over-the-limit schema, regex or grammar is an invalid-request
        error with the grammar engine's message; the time counts toward the deadline."""
        start = time.perf_counter()
        try:
            await asyncio.wait_for(asyncio.to_thread(self.grammar.check, spec), max(deadline - time.time(), 0.001))
        except InvalidRequestError as exc:
            raise invalid(f"{field}: {exc}" if field else str(exc), field) from None
        except TimeoutError:
            raise RequestError(
                ErrorKind.DEADLINE, "compiling the request's grammar did not finish before its deadline"
            ) from None
        self.metrics.grammar_compile.observe(time.perf_counter() - start)

    # ---- metrics plumbing ----------------------------------------------------------------
    def _on_route(self, decision) -> None:
        self.metrics.router_decisions.labels(decision.reason).inc()
        for pool, hit in decision.adapter_hits:
            self.metrics.router_lora_routes.labels(pool).inc()
            if hit:
                self.metrics.router_lora_adapter_hits.labels(pool).inc()

    async def render_metrics(self) -> bytes:
        """The deployment's /metrics: every ingress's samples merged with the controller's
        pool series. If the controller cannot answer (it is restarting), this ingress's own."""
        families = encode_families(families_of(self.metrics.registry))
        try:
            return await self.cluster.render_metrics(families)
        except Exception as exc:
            logger.warning("merged metrics unavailable (%r); serving this ingress's own", exc)
            return self.metrics.render()
