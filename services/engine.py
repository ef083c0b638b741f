"""LLMEngine: the scheduling policy and a model runner in one process.

Used by `zeroserve.LLM` (offline batch generation), by tests and by the overhead benchmark as
the in-process baseline. The cluster runs the same policy in the scheduler process and the
same runner in worker processes.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

from zeroserve.common.chat import chat_prompt, check_messages
from zeroserve.common.config import EngineArgs
from zeroserve.common.detokenize import IncrementalDetokenizer
from zeroserve.common.errors import InvalidRequest
from zeroserve.common.log import get_logger
from zeroserve.common.model_config import ModelConfig, resolve_sampling_defaults
from zeroserve.common.outputs import CompletionOutput, RequestOutput, logprob_entries
from zeroserve.common.sampling_params import MODEL_DEFAULT_FIELDS, SamplingParams, with_model_defaults
from zeroserve.common.tokenizer import load_tokenizer
from zeroserve.services.scheduler.admission import (
    check_params_for_model,
    check_prompt_ids,
    fan_out,
    split_prompt,
)
from zeroserve.services.scheduler.block_manager import BlockManager
from zeroserve.services.scheduler.policy import Scheduler, TokenEvent
from zeroserve.services.scheduler.structured import GrammarCompiler
from zeroserve.services.tiny_model import default_model_dir
from zeroserve.services.worker.model_runner import ModelRunner

log = get_logger(__name__)


@dataclass
class _Tracked:
    """What the engine assembles for one client request (n sequences)."""

    output: RequestOutput
    params: SamplingParams
    detoks: list[IncrementalDetokenizer]
    remaining: int
    logprobs: list[list] = field(default_factory=list)


class LLMEngine:
    def __init__(self, args: EngineArgs, make_runner=ModelRunner) -> None:
        """`make_runner(args, model_cfg)`: the runner (a pipeline stage's: services/worker/pipeline.py)."""
        self.args = args
        if args.pp_size > 1 and make_runner is ModelRunner:  # one process holds one stage
            raise InvalidRequest("pp_size > 1 needs a process per pipeline stage: serve the model with "
                                 "`zeroserve up --pp N` (or one `zeroserve worker --pp-rank S` per stage)")
        model_dir = Path(args.model) if args.model else default_model_dir()
        self.model_cfg = ModelConfig.from_dir(model_dir)
        self.sampling_defaults = resolve_sampling_defaults(self.model_cfg, args.generation_config)
        self.tokenizer = load_tokenizer(model_dir)
        max_len = args.max_model_len or self.model_cfg.max_position_embeddings
        if max_len > self.model_cfg.max_position_embeddings:
            raise InvalidRequest(
                f"max_model_len={max_len} exceeds the model's max_position_embeddings "
                f"({self.model_cfg.max_position_embeddings})")
        self.runner = make_runner(args, self.model_cfg)
        self.block_manager = BlockManager(self.runner.num_blocks, args.block_size, args.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, args.max_num_seqs, args.max_num_batched_tokens,
                                   max_len, self.model_cfg.eos_token_ids, self.model_cfg.vocab_size,
                                   self.model_cfg.kv_window, self.runner.num_lookahead_tokens,
                                   max_num_prefill_tokens=args.max_num_prefill_tokens)
        self.rng = random.Random(args.seed)
        self.grammars = GrammarCompiler(lambda: self.tokenizer, self.model_cfg.vocab_size, self.model_cfg.eos_token_ids)
        self.tracked: dict[str, _Tracked] = {}
        self._next_id = 0

    @property
    def max_model_len(self) -> int:
        return self.scheduler.max_model_len

    # ---- requests -----------------------------------------------------------------------------
    def default_sampling_params(self) -> SamplingParams:
        """What a request without SamplingParams runs with: the model's generation config
        (``--generation-config``) over SamplingParams' defaults (vLLM's get_default_sampling_params)."""
        return with_model_defaults(SamplingParams(), MODEL_DEFAULT_FIELDS, self.sampling_defaults)

    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        """`prompt`: text, token ids, {"prompt_token_ids": ...}, {"prompt": ...} or a conversation
        {"messages": [...], "chat_template": optional template text, "tools": optional function
        definitions for the template}."""
        if params is None:
            params = self.default_sampling_params()
        elif not isinstance(params, SamplingParams):
            raise InvalidRequest(f"params must be a SamplingParams, got {type(params).__name__}")
        if isinstance(prompt, dict) and "messages" in prompt:
            text, ids = chat_prompt(self.tokenizer, check_messages(prompt["messages"]), prompt.get("chat_template"),
                                    prompt.get("tools"))
        else:
            text, arr = split_prompt(prompt, self.model_cfg.vocab_size)
            ids = self.tokenizer.encode(text) if text is not None else arr.tolist()
        check_prompt_ids(ids, self.model_cfg.vocab_size, self.max_model_len)
        check_params_for_model(params, self.model_cfg.vocab_size)
        so = params.structured_outputs
        grammar = self.grammars.compile(so) if so is not None else None
        if request_id is None:
            request_id = str(self._next_id)
            self._next_id += 1
        if request_id in self.tracked:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        for r in fan_out(request_id, ids, params, self.rng, self.max_model_len, grammar):
            self.scheduler.add_request(r)
        out = RequestOutput(request_id, text, list(ids),
                            [CompletionOutput(i, "", [], logprobs=[] if params.logprobs is not None else None)
                             for i in range(params.n)])
        detoks = [IncrementalDetokenizer(self.tokenizer, ids, params) for _ in range(params.n)]
        self.tracked[request_id] = _Tracked(out, params, detoks, params.n)
        return request_id

    def abort_request(self, request_id: str) -> None:
        tr = self.tracked.pop(request_id, None)
        if tr is None:
            return
        for i in range(tr.params.n):
            self.scheduler.finish_request(f"{request_id}#{i}", "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # ---- stepping -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one batch; return the client requests that finished in it."""
        step = self.scheduler.schedule()
        if step.empty:
            if step.finished_req_ids:
                self.runner.apply_state(step)
            return []
        return self._process(self.scheduler.update(step, self.runner.execute(step)))

    def _process(self, events: list[TokenEvent]) -> list[RequestOutput]:
        done = []
        decode = lambda t: self.tokenizer.decode([t])  # noqa: E731
        for ev in events:
            req = ev.req
            tr = self.tracked.get(req.client_id)
            if tr is None:
                continue
            comp = tr.output.outputs[req.index]
            comp.token_ids.append(ev.token_id)
            if comp.logprobs is not None and ev.logprobs is not None:
                ids, lps, rank = ev.logprobs
                comp.logprobs += logprob_entries(ids[None], lps[None], [rank], tr.params.logprobs, decode)
            hidden_stop = ev.finished and req.hides_stop_token_text
            delta = tr.detoks[req.index].add_tokens([] if hidden_stop else [ev.token_id])
            finished = ev.finished
            if delta.stop_str is not None and not finished:
                self.scheduler.finish_request(req.req_id, "stop", delta.stop_str)
                finished = True
            elif delta.stop_str is not None:
                req.finish_reason, req.stop_reason = "stop", delta.stop_str
            if finished:
                if delta.stop_str is None:
                    tr.detoks[req.index].finish()
                comp.text = tr.detoks[req.index].text
                comp.finish_reason = req.finish_reason
                comp.stop_reason = req.stop_reason
                tr.output.num_cached_tokens = max(tr.output.num_cached_tokens, req.num_cached_tokens)
                tr.remaining -= 1
                if tr.remaining == 0:
                    tr.output.finished = True
                    done.append(tr.output)
                    del self.tracked[req.client_id]
        return done

    def stats(self) -> dict:
        s = self.scheduler.stats()
        s["num_steps"] = self.runner.num_steps
        return s
