"""KV blocks outside every layer's sliding window go back to the pool (Mistral-style models,
whose every layer slides): long answers hold a bounded number of blocks, and greedy output
still equals HF transformers (fp32)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from zeroserve.common.messages import StepResult
from zeroserve.common.model_config import ModelConfig
from zeroserve.common.sampling_params import SamplingParams
from zeroserve.services.scheduler.block_manager import BlockManager
from zeroserve.services.scheduler.policy import Scheduler
from zeroserve.services.scheduler.request import Request
from tests.helpers import cached_model_dir, load_hf_model, random_prompt, torch_single_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("torch_single_thread")

WINDOW = 16


def test_kv_window_only_when_every_layer_slides():
    assert ModelConfig.from_dir(cached_model_dir("mistral", sliding_window=WINDOW)).kv_window == WINDOW
    assert ModelConfig.from_dir(cached_model_dir("gemma2")).kv_window is None  # every other layer is global
    assert ModelConfig.from_dir(cached_model_dir("llama")).kv_window is None


def test_the_policy_frees_blocks_no_layer_reads_and_keeps_their_positions():
    bm = BlockManager(64, 16, enable_prefix_caching=True)
    pol = Scheduler(bm, 8, 64, 1024, eos_token_ids=[2], vocab_size=100, kv_window=WINDOW)
    req = Request("a#0", list(range(3, 43)), SamplingParams(max_tokens=100), 0, 1024)
    pol.add_request(req)
    step = pol.schedule()  # the 40-token prompt in one chunk: 3 blocks
    assert len(req.block_ids) == 3 and bm.num_used_blocks == 3
    ids = list(req.block_ids)
    for _ in range(60):  # the worker's answer: one sampled token per step
        pol.update(step, StepResult(seq=0, req_ids=step.req_ids(), sampled_token_ids=np.array([5], np.int32)))
        step = pol.schedule()
        # the next query at position p reads keys > p - 16: blocks ending at or before it are free
        assert req.num_released == max(0, (req.num_computed_tokens - 1 - WINDOW + 1) // 16)
        assert bm.num_used_blocks == len(req.block_ids) - req.num_released <= 3
    assert req.block_ids[:3] == ids  # positions keep their block ids in the table
    pol.finish_request("a#0", "abort")
    assert bm.num_used_blocks == 0 and all(c == 0 for c in bm.ref_cnt)


def test_long_answers_in_a_small_cache_equal_hf_without_preemption():
    from zeroserve import LLM

    d = cached_model_dir("mistral", sliding_window=WINDOW)
    # 4 requests of up to 26 + 120 tokens need ~10 blocks each with every block kept: 40 > 16
    llm = LLM(str(d), num_kv_blocks=16, max_num_seqs=4, block_size=16)
    prompts = [random_prompt(n, seed=n) for n in (9, 17, 26, 12)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=120, ignore_eos=True))
    assert llm.engine.scheduler.num_preemptions == 0
    assert llm.engine.block_manager.num_used_blocks == 0
    hf = load_hf_model(d)
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=120, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(p):].tolist()
        assert o.outputs[0].token_ids == ref
