"""LLMEngine: the cluster in one process, behind `zeroserve.LLM` (offline batch generation).

There is one request lifecycle. The engine runs the scheduler's own state (`Cluster`: admission,
fan-out, routing, the group's policy, delivery), the worker's `ModelRunner` and the
detokenizer's state over an in-process transport: what a handler puts in its `Outbox` is handed
to its addressee by a direct call instead of a socket, and the answers go back to the same
handlers. Tokenizing, stop strings, the hidden stop token, logprobs and output assembly are the
cluster's code (vLLM's `LLM` drives the same EngineCore; mini-sglang's offline mode swaps only
the I/O). Only the timers stay off: one process has no heartbeats or clients to watch.
"""

from __future__ import annotations

import os
import socket
import time
from collections import deque
from dataclasses import dataclass, field, fields

from zeroserve.common import messages as P
from zeroserve.common.chat import check_messages
from zeroserve.common.config import EngineArgs, LoRAArgs, SchedulerConfig
from zeroserve.common.embeddings import request_pooling
from zeroserve.common.errors import InvalidRequest
from zeroserve.common.model_config import ModelConfig
from zeroserve.common.outputs import RequestOutput, completion_from_items, embedding_from_items
from zeroserve.common.prompts import split_prompt
from zeroserve.common.sampling_params import MODEL_DEFAULT_FIELDS, SamplingParams, with_model_defaults
from zeroserve.common.tokenizer import load_tokenizer
from zeroserve.services.detokenizer.state import Detokenizer
from zeroserve.services.scheduler.cluster import Cluster
from zeroserve.services.scheduler.models import load_models
from zeroserve.services.scheduler.outbox import BACKEND, CLIENT, STEPS, Outbox
from zeroserve.services.scheduler.structured import GrammarCompiler
from zeroserve.services.worker import pipeline
from zeroserve.services.worker.model_runner import ModelRunner
from zeroserve.services.worker.service import shard_hello

# the peers' identities on the in-process "sockets"
CLIENT_ID, WORKER_ID, DETOK_ID = b"llm", b"local-worker", b"local-detokenizer"
GROUP = "local"


@dataclass
class _Tracked:
    """A request as its caller sees it: the Output items of each completion, until all end."""

    params: SamplingParams
    prompt: str | None  # the text, or the rendered chat template (None: token ids were given)
    chat_template: str | None = None
    parts: list[list[P.Output]] = field(default_factory=list)
    finish: list = field(default_factory=list)
    stop: list = field(default_factory=list)
    prompt_ids: list[int] | None = None
    num_cached: int = 0
    remaining: int = 0


def stage_runner(tp_rank: int, tp_size: int, pp_rank: int, wire: str | None = None):
    """`make_runner` for an in-process LLMEngine that is one shard of a pipeline group (tests,
    benchmarks): every shard runs the same engine, so all get the same steps, as from the
    scheduler. The group's torch.distributed world must exist (services/worker/pipeline.py)."""

    def make(args, cfg):
        r = ModelRunner(args, cfg, tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank)
        if r.pp_size > 1:
            pipeline.connect(r, tp_rank, tp_size, wire=wire)
        return r

    return make


class LLMEngine:
    def __init__(self, args: EngineArgs, make_runner=ModelRunner) -> None:
        """`make_runner(args, model_cfg)`: the runner (a pipeline stage's: `stage_runner`)."""
        self.args = args
        if args.pp_size > 1 and make_runner is ModelRunner:  # one process holds one stage
            raise InvalidRequest("pp_size > 1 needs a process per pipeline stage: serve the model with "
                                 "`zeroserve up --pp N` (or one `zeroserve worker --pp-rank S` per stage)")
        if not args.model:
            raise InvalidRequest("engine args: give a model directory or GGUF file (LLM picks the built-in one)")
        model_dir = str(args.model)
        self.model_cfg = ModelConfig.from_dir(model_dir)
        self.tokenizer = load_tokenizer(model_dir)
        self.runner = make_runner(args, self.model_cfg)
        cfg = SchedulerConfig(
            models=[model_dir], generation_config=args.generation_config, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens, max_num_prefill_tokens=args.max_num_prefill_tokens,
            max_model_len=args.max_model_len, enable_prefix_caching=args.enable_prefix_caching, seed=args.seed,
            pooling=args.pooling, max_queue_len=1 << 62,  # a batch is what the caller gave: no queue cap offline
            **{f.name: getattr(args, f.name) for f in fields(LoRAArgs)})  # the adapters: the cluster's registry
        models = load_models(cfg.models, cfg.generation_config, cfg.pooling)
        self.name = self.model_cfg.name
        self.sampling_defaults = models[self.name].sampling_defaults
        self.cluster = Cluster(cfg, models, "in-process", now=time.monotonic())
        self.cluster.overlap = False  # nothing to overlap with in one thread (cluster.py)
        # nobody scrapes an offline engine's Prometheus series: skip the per-output ones (TTFT,
        # inter-token latency), half of the scheduler state's CPU per step at 64 requests
        self.cluster.delivery.metrics = None
        self.detok = Detokenizer({self.name: self.tokenizer})
        self.grammars = GrammarCompiler(lambda: self.tokenizer, self.model_cfg.vocab_size,
                                        self.model_cfg.eos_token_ids)
        self.tracked: dict[str, _Tracked] = {}
        self.done: list[RequestOutput] = []
        self._next_id = 0
        self._join()

    def _join(self) -> None:
        """The worker and the detokenizer say HELLO, the worker answers the group's probe: the
        group is READY the way a cluster's is (a refusal, e.g. max_model_len past the model's
        positions, is raised in the scheduler's words)."""
        now = time.monotonic()
        hello = shard_hello(self.runner, self.args, self.model_cfg, worker_id=WORKER_ID.decode(), group=GROUP,
                            tp_rank=0, tp_size=1, device=str(self.runner.device), host=socket.gethostname(),
                            pid=os.getpid())
        self._deliver(self.cluster.on_hello(WORKER_ID, hello, now))
        self._deliver(self.cluster.on_hello(DETOK_ID, P.Hello(role="detokenizer", worker_id=DETOK_ID.decode(),
                                                              model=self.name), now))
        self._deliver(self.cluster.tick(now))  # publishes the probe
        if self.scheduler is None:
            raise RuntimeError("the in-process worker group did not become ready")

    # ---- what tests and benchmarks look at ----------------------------------------------------
    @property
    def group(self):
        return self.cluster.groups.get(GROUP)

    @property
    def scheduler(self):
        """The group's policy (continuous batching, block manager)."""
        g = self.group
        return g.policy if g is not None else None

    @property
    def block_manager(self):
        return self.scheduler.bm

    @property
    def max_model_len(self) -> int:
        return self.cluster.groups.max_model_len(self.name)

    def stats(self) -> dict:
        s = self.scheduler.stats()
        s["num_steps"] = self.runner.num_steps
        return s

    # ---- requests -----------------------------------------------------------------------------
    def default_sampling_params(self) -> SamplingParams:
        """What a request without SamplingParams runs with: the model's generation config
        (``--generation-config``) over SamplingParams' defaults (vLLM's get_default_sampling_params)."""
        return with_model_defaults(SamplingParams(), MODEL_DEFAULT_FIELDS, self.sampling_defaults)

    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    pooling: str | None = None) -> str:
        """`prompt`: text, token ids, {"prompt_token_ids": ...}, {"prompt": ...} or a conversation
        {"messages": [...], "chat_template": optional template text, "tools": optional function
        definitions for the template}. `pooling` ("" = the model's, "last", "mean"): an embedding
        request instead (common/embeddings.py), whose output has `embedding`. Refused requests
        raise here, before any step."""
        if params is not None and not isinstance(params, SamplingParams):
            raise InvalidRequest(f"params must be a SamplingParams, got {type(params).__name__}")
        if request_id is None:
            request_id = str(self._next_id)
            self._next_id += 1
        if request_id in self.tracked:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        # no params: every model-default field comes from the generation config, as in a Submit
        # whose caller left them all unset
        kw = dict(request_id=request_id, params=params or SamplingParams(),
                  model_defaults=list(MODEL_DEFAULT_FIELDS) if params is None else [])
        if pooling is not None:  # the cluster gives an embedding its own params (a prefill)
            kw.update(kind="embed", pooling=request_pooling(pooling), model_defaults=[])
        chat_template = text = None
        if isinstance(prompt, dict) and "messages" in prompt:
            kw["messages"] = [P.ChatMessage(**m) for m in check_messages(prompt["messages"])]
            kw["tools"] = prompt.get("tools")
            chat_template = prompt.get("chat_template")
        else:
            text, ids = split_prompt(prompt, self.model_cfg.vocab_size)
            kw["prompt"], kw["prompt_token_ids"] = text, ids
        submit = P.Submit(**kw)
        p = submit.params
        tr = _Tracked(p, text, chat_template, [[] for _ in range(p.n)], [None] * p.n, [None] * p.n, remaining=p.n)
        self.tracked[request_id] = tr
        try:
            self._deliver(self.cluster.on_submit(CLIENT_ID, submit, time.monotonic()))
        except BaseException:
            self.tracked.pop(request_id, None)
            self.cluster.on_abort(CLIENT_ID, P.Abort(request_id=request_id), time.monotonic())
            raise
        return request_id

    def abort_request(self, request_id: str) -> None:
        if self.tracked.pop(request_id, None) is None:
            return
        self._deliver(self.cluster.on_abort(CLIENT_ID, P.Abort(request_id=request_id), time.monotonic()))
        self._deliver(self.cluster.flush())  # its final (abort) outputs go nowhere: nobody waits

    def load_lora_adapter(self, name: str, path: str) -> None:
        """Serve the adapter at `path` as `name`: the cluster's LoadLoRA (checked against the model)."""
        self._deliver(self.cluster.loras.on_load(CLIENT_ID, P.LoadLoRA(name=name, path=path), time.monotonic()))

    def unload_lora_adapter(self, name: str) -> None:
        """The cluster's UnloadLoRA (the worker's slot is reused once no request holds it)."""
        self._deliver(self.cluster.loras.on_unload(CLIENT_ID, P.UnloadLoRA(name=name), time.monotonic()))

    def has_unfinished(self) -> bool:
        return bool(self.cluster.live) or self.scheduler.has_work()

    # ---- stepping -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one batch; return the requests that finished in it. A turn of the scheduler's
        loop: the group's next step, its result into the policy, the tokens to the
        detokenizer and its text back, then the outputs to the caller."""
        self._deliver(self.cluster.dispatch(time.monotonic()))
        self._deliver(self.cluster.flush())  # DetokTokens -> DetokOutputs (text, stop strings)
        self._deliver(self.cluster.flush())  # Outputs
        done, self.done = self.done, []
        return done

    def _deliver(self, ob: Outbox) -> None:
        """Hand each item of an outbox to its addressee, in order, and every answer back to the
        scheduler's handlers (their outboxes join the queue)."""
        queue = deque([ob])
        while queue:
            ob = queue.popleft()
            for job in ob.tokenize:
                queue.append(self._tokenize(job))
            for it in ob:
                now = time.monotonic()
                msg = it.msg
                if it.role == STEPS and isinstance(msg, P.Step):
                    result = self._execute(msg)
                    queue.append(self.cluster.on_step_result(WORKER_ID, result, time.monotonic()))
                elif it.role == STEPS and isinstance(msg, P.Probe):
                    queue.append(self.cluster.on_probe_ack(WORKER_ID, P.ProbeAck(
                        worker_id=WORKER_ID.decode(), probe_id=msg.probe_id), now))
                elif it.role == BACKEND and it.to == DETOK_ID:
                    reply = self.detok.handle(msg)
                    if reply is not None:
                        queue.append(self.cluster.on_detok_outputs(DETOK_ID, reply, now))
                elif it.role == BACKEND and isinstance(msg, P.Welcome) and msg.status == "refused":
                    raise InvalidRequest(msg.detail)
                elif it.role == CLIENT:
                    self._to_caller(msg)
                # else: Welcome(accepted), Shutdown, stats events: nothing to do in one process

    def _execute(self, step: P.Step) -> P.StepResult:
        g = self.group
        try:
            out = self.runner.execute(step)
        except BaseException:
            # nothing of the step is accepted; the caller aborts its requests (LLM.generate),
            # whose ids the next step drops from the runner's state
            g.flights.clear()
            g.policy.returned(step)
            raise
        out.worker_id = WORKER_ID.decode()
        return out

    def _tokenize(self, job) -> Outbox:
        """The scheduler's tokenize job, inline; the rendered chat prompt is the output's prompt."""
        live = self.cluster.live.get(job.key)
        tr = self.tracked.get(live.request_id) if live is not None else None
        if tr is None:
            return Outbox()
        template = tr.chat_template
        try:
            text, ids, grammar = job.run(lambda: self.tokenizer, template, self.grammars)
        except Exception as e:  # noqa: BLE001 - refused in the scheduler's words, raised by _to_caller
            return self.cluster.on_tokenized(job.key, None, e, time.monotonic())
        tr.prompt = text
        return self.cluster.on_tokenized(job.key, ids, None, time.monotonic(), grammar)

    # ---- the caller's side: the client's assembly of Outputs ---------------------------------
    def _to_caller(self, msg) -> None:
        if isinstance(msg, P.Error):
            self.tracked.pop(msg.request_id, None)
            raise msg.to_exception()
        if isinstance(msg, P.LoRAReply) and not msg.ok:
            raise InvalidRequest(msg.detail)
        if not isinstance(msg, P.Outputs):
            return
        for item in msg.items:
            tr = self.tracked.get(item.request_id)
            if tr is None:
                continue  # aborted
            if item.prompt_token_ids is not None:
                tr.prompt_ids = item.prompt_token_ids.tolist()
                tr.num_cached = item.num_cached_tokens
            i = item.index
            tr.parts[i].append(item)
            if item.finish_reason is not None and tr.finish[i] is None:
                tr.finish[i], tr.stop[i] = item.finish_reason, item.stop_reason
                tr.remaining -= 1
                if tr.remaining == 0:
                    self.done.append(self._result(item.request_id, tr))

    def _result(self, rid: str, tr: _Tracked) -> RequestOutput:
        del self.tracked[rid]
        decode = (lambda t: self.tokenizer.decode([t])) if tr.params.logprobs is not None else None  # noqa: E731
        outs = [completion_from_items(i, items, tr.finish[i], tr.stop[i], tr.params.logprobs is not None, decode)
                for i, items in enumerate(tr.parts)]
        return RequestOutput(rid, tr.prompt, tr.prompt_ids or [], outs, finished=True, num_cached_tokens=tr.num_cached,
                             embedding=embedding_from_items(tr.parts[0]))
