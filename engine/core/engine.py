"""The engine loop of one worker: `step()` = schedule → run the model → postprocess.

`LLMEngine` ties the scheduler (decisions, block bookkeeping), the model runner (tensors)
and the sampler/stop checker (tokens, text) together, and is the only thing workers call.

Overlap scheduling (`EngineConfig.overlap_scheduling`, on by default; engine/core/overlap.py):
`step()` launches step t (schedule, stage, model, sample: queued on the device) before it
reads step t-1's sampled tokens and postprocesses them, so host work hides behind the device.
Its outputs are therefore those of the previous step, plus this one's when nothing could run
next without its tokens (the end of a burst; a prefill-only batch). The one host wait per
step is reading t-1's tokens. Off, every step is read before `step()` returns; it is the same
code with the step in flight read at once.

Hand-off hooks (the Prefill and Hand-off steps of a request, router/orchestrator.py):
- prefill-only: a request finishes after its first token with `FinishReason.HANDOFF`; its
  `RequestOutput.kv_handoff` lists the blocks, which stay held (never evicted) until
  `release_request_blocks(request_id)`. A request that stops on its first token (eos,
  max_tokens=1) finishes normally and holds nothing.
- decode-only: `allocate_for_transfer` reserves blocks (reusing locally cached prefix blocks,
  which need no transfer); the worker fills the rest, then `add_transferred_request` starts
  decoding, or `free_transfer_blocks` gives them back on failure.

Every mode accepts `add_request` (a decode-only worker prefills short prompts itself:
conditional disaggregation); the mode only decides whether a request stops after its first
token (prefill-only) or runs to completion. A split engine prefills on a loop of its own,
`prefill_lane` (engine/core/prefill_lane.py), beside the decode loop over the same pool.

LoRA (engine/lora/lora_registry.py): a request's `lora_name` is part of its block hashes and must
be registered (else LoraNotFound, before anything is queued); it runs only while it holds
the adapter's device slot (engine/core/scheduler.py). `load_lora` / `unload_lora` at run time.

Tensor and pipeline parallelism (engine/core/tp_runner.py, engine/core/pp_runner.py): this
engine is rank 0 (it schedules; with stages, its model is stage 0's part, and the last stage
samples); `step_runner`, a `TPLeader` or `PPLeader`, runs each step on the other ranks too;
`close()` ends them.

Not thread-safe: every method must be called from one thread; `engine.core.driver.EngineDriver`
runs the engine on a thread of its own and posts add/abort/hand-off calls to it between steps.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Sequence
from pathlib import Path

from engine.batch import ScheduledBatch
from engine.config import EngineConfig, EngineMode
from engine.core.overlap import InflightStep, sampling_rows
from engine.core.pp_runner import PPLeader, step_runner
from engine.core.pp_steps import PipelinedSteps
from engine.core.prefill_lane import PrefillLane, schedulers
from engine.core.prompt_logprobs import PromptLogprobsStep
from engine.core.rank_setup import build_rank, serving_max_model_len
from engine.core.request import Request, RequestStatus
from engine.core.request_limits import RequestLimits
from engine.core.runner import ModelRunner, resolve_device, resolve_dtype
from engine.core.sampler import SampledRow, Sampler
from engine.core.scheduler import Scheduler
from engine.core.sm_split import SMSplit
from engine.core.tracking import RequestTracking
from engine.kv.block_pool import BlockPool
from engine.kv.host_tier import CopyBudget, HostTier
from engine.lora.lora_registry import LoraRegistry
from engine.modeling.llama import LlamaModel
from engine.pp.pipeline_group import PPGroup
from engine.structured.constrained import ConstrainedRequests
from engine.structured.grammars import Grammars
from engine.tp.tensor_parallel import TPGroup
from vocabulary.block_hash import BlockHash, hash_extra
from vocabulary.engine_io import (
    NO_PRIOR,
    EngineLoad,
    LoraInfo,
    LoraNotFound,
    PriorOutput,
    RequestOutput,
    TransferAllocation,
)
from vocabulary.kv_events import CacheSnapshot, KVEvent
from vocabulary.model_config import ModelConfig
from vocabulary.sampling import SamplingParams
from vocabulary.step_stats import StepMeter
from vocabulary.tokenizer import Tokenizer


class LLMEngine:
    """One model, one KV pool, one scheduler: add requests, call `step()` until done."""

    def __init__(
        self,
        config: EngineConfig,
        model: LlamaModel | None = None,
        tokenizer: Tokenizer | None = None,
        tp: TPGroup | None = None,
        pp: PPGroup | None = None,
    ) -> None:
        """`model`/`tokenizer` may be passed to share one loaded copy between engines
        (tests); the model must already be on the configured device and dtype. `tp`: rank
        0's TP group when `config.tensor_parallel_size` > 1 (engine/core/tp_runner.py); `pp`:
        rank 0's group when `config.pipeline_parallel_size` > 1 (engine/core/pp_runner.py;
        then `tp` is None)."""
        self.config = config
        self.model_config = ModelConfig.from_pretrained(config.model_dir)
        self.model_id = config.model_id or Path(config.model_dir).name
        device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype, device)
        # Adapters first: a bad one fails before the model loads, and the slots' memory is
        # spent before the KV pool is sized from what is left.
        self.loras = LoraRegistry.from_config(
            config, self.model_config, dtype, device, pp.stage.layers if pp else None
        )
        self.tokenizer = tokenizer or Tokenizer.from_model_dir(config.model_dir)
        self.eos_token_ids = tuple(
            dict.fromkeys(self.model_config.eos_token_ids + self.tokenizer.eos_token_ids)
        )
        self.max_model_len = serving_max_model_len(config, self.model_config)
        split = (
            SMSplit(device, config.split_decode_sms) if config.mode is EngineMode.SPLIT else None
        )
        with split.decode() if split is not None else contextlib.nullcontext():
            # (a split engine's decode graphs are captured in, and run on, its decode SMs)
            parts = build_rank(
                config, self.model_config, device, dtype, self.tokenizer, tp=tp, pp=pp,
                model=model, lora_weights=self.loras.weights,
            )  # fmt: skip
        self.model, self.kv_cache, self.runner = parts.model, parts.kv_cache, parts.runner
        self.layer_bounds: tuple[int, ...] = pp.stage.bounds if pp is not None else ()
        """A pipeline worker's stage boundaries (vocabulary/pipeline.py; its KV hand-off reads
        each stage's layers from that stage's ranks); empty: one stage."""
        self.model_kv_scales = parts.model_kv_scales
        """A pipeline worker's e4m3 KV scales of every stage (its hand-off hashes them)."""
        spec = self.kv_cache.spec
        num_blocks, num_host = spec.num_blocks, parts.num_host_blocks
        per_step = config.host_kv_max_blocks_per_step
        self.host_tier = (
            HostTier(num_host, self.kv_cache.tensor, per_step, spec.block_dim) if num_host else None
        )
        self.step_runner = step_runner(self.runner, tp, pp, self.loras.cache, self.host_tier)
        self.pipelined = None
        """A cross-step pipeline's steps in flight (engine/core/pp_steps.py); None otherwise."""
        if isinstance(self.step_runner, PPLeader) and self.step_runner.cross_step:
            self.pipelined = PipelinedSteps(self.step_runner, config.micro_batches)
        self.block_pool = BlockPool(
            num_blocks, config.enable_prefix_caching, host_tier=self.host_tier
        )
        self.scheduler = Scheduler(
            self.block_pool,
            block_size=config.block_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            enable_chunked_prefill=config.enable_chunked_prefill,
            keep_blocks_on_prefill_finish=config.mode is EngineMode.PREFILL_ONLY,
            max_model_len=self.max_model_len,
            finish_after_first_token=config.mode is EngineMode.PREFILL_ONLY,
            adapters=self.loras.cache,
            # (a pipeline's other stages do not lend their host blocks: hand off from the pool)
            lend_host_copies=config.host_kv_handoff and num_host > 0 and pp is None,
        )
        self.sampler = Sampler(config.seed, device, self.model_config.vocab_size)
        self.prefill_lane = None
        if split is not None:
            self.prefill_lane = PrefillLane.build(self, device, split)
        """A split engine's prefill loop (engine/core/prefill_lane.py); None otherwise."""
        self.limits = RequestLimits(
            vocab_size=self.model_config.vocab_size,
            max_model_len=self.max_model_len,
            num_blocks=num_blocks,
            block_size=config.block_size,
            max_num_batched_tokens=config.max_num_batched_tokens,
            chunked_prefill=config.enable_chunked_prefill,
        )
        self.constrained = ConstrainedRequests(functools.partial(
            Grammars, self.tokenizer, self.model_config.vocab_size, self.eos_token_ids,
            cache_size=config.grammar_cache_size,
            compile_timeout_s=config.grammar_compile_timeout_s,
        ))  # fmt: skip
        """Structured output: the matchers of constrained requests (engine/structured)."""
        self.tracking = RequestTracking(
            self.tokenizer, self.eos_token_ids, self.max_model_len, self.sampler, self.constrained
        )
        self._ready: list[RequestOutput] = []  # outputs decided outside step()
        self._inflight: InflightStep | None = None  # launched, tokens not read yet
        self._latest_launch: InflightStep | None = None  # the prefill lane orders after it
        self.step_meter = StepMeter()
        self.last_step_idle = False
        """The latest `step()` launched nothing and read nothing: what is unfinished waits on
        something outside the loop (an adapter's disk read, blocks a hand-off holds)."""

    # ---- requests -------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams | None = None,
        *,
        cache_salt: str = "",
        lora_name: str = "",
        arrival_time: float | None = None,
        prior: PriorOutput | None = None,
    ) -> None:
        """Queue a request (prefilled here) on LoRA adapter `lora_name` ("": base model).
        Raises ValueError naming the bad field, LoraNotFound / LoraLoadError for an adapter
        not registered here / whose read failed.

        With `prior` (a migrated request) its tokens are prefilled after the prompt and
        sampling goes on after them: the outputs are those of one undisturbed run."""
        params = sampling_params or SamplingParams()
        self.limits.check_prompt(prompt_token_ids, params)
        self.loras.check(lora_name)
        prior = prior or NO_PRIOR
        self.limits.check_prior(prompt_token_ids, params, prior)
        self.constrained.compile(params.structured)  # (a worker compiled it beside the loop)
        request = Request(
            request_id=request_id,
            prompt_token_ids=tuple(prompt_token_ids),
            sampling_params=params,
            block_size=self.config.block_size,
            hash_extra=hash_extra(self.model_id, cache_salt, lora_name),
            arrival_time=arrival_time if arrival_time is not None else time.time(),
            lora_name=lora_name,
        )
        for token_id in prior.token_ids:
            request.append_output(token_id, None)
        self.constrained.start(request_id, params.structured, prior.token_ids)
        lane = self.prefill_lane
        (lane.scheduler if lane is not None else self.scheduler).add_request(request)
        draws = 0 if params.greedy else len(prior.token_ids)
        checker = self.tracking.start(request, prompt_token_ids, params, num_draws_done=draws)
        checker.replay(prior.token_ids)
        checker.mark_released(prior.text_chars)

    def abort_request(self, request_id: str) -> bool:
        """End a request wherever it is (queued, running, held for hand-off, or reserved for
        a transfer) and free everything it held. False if nothing was held under that id."""
        found = self.scheduler.abort(request_id)
        if self.prefill_lane is not None:
            found = self.prefill_lane.abort(request_id) or found
        found = self.release_request_blocks(request_id) or found
        found = self.free_transfer_blocks(request_id) or found
        self.tracking.stop(request_id)
        return found

    def has_unfinished(self) -> bool:
        """Whether `step()` has work (requests waiting or running, or outputs to deliver)."""
        lane = self.prefill_lane
        return (
            self.scheduler.has_unfinished()
            or bool(self._ready)
            or (lane is not None and lane.has_work())
            or (self.pipelined is not None and self.pipelined.busy)
        )

    # ---- the loop -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Launch one scheduled batch and read the one before it (see the module docstring);
        one output per request that sampled or finished in the steps read.

        A step that raises loses what was in flight: abort every request (EngineDriver does).
        """
        started = time.perf_counter()
        outputs, self._ready = self._ready, []
        if self.pipelined is not None:  # a cross-step pipeline (engine/core/pp_steps.py)
            return outputs + self.pipelined.step(self, started)
        lane = self.prefill_lane
        prefilled = lane.advance(self) if lane is not None else None
        if prefilled is not None:
            outputs += prefilled
        previous, self._inflight = self._inflight, None
        on_decode_stream = lane.streams.decode if lane is not None else contextlib.nullcontext
        with on_decode_stream():  # its host-tier copies in order with the step (prefill_lane.py)
            decision = self.scheduler.schedule()
        if lane is not None:
            lane.take_back(self.scheduler)  # preempted decodes are recomputed by the lane
        shape = decision.batch.shape(self.scheduler.requests)
        for request in decision.finished:  # ended by the scheduler (pool too small; adapter)
            outputs.append(self._final_output(request))
        launched = None
        if decision.batch.chunks:
            with on_decode_stream():
                launched = self._launch(decision.batch, previous)
        if previous is not None:
            outputs += self._complete(previous)
        if launched is not None:
            if self.config.overlap_scheduling and self.scheduler.has_ready_work():
                self._inflight = launched  # read by the next step(), after it launches
            else:
                outputs += self._complete(launched)
            self._latest_launch = launched
        if decision.batch.chunks:
            elapsed = time.perf_counter() - started
            self.step_meter.record(*shape, elapsed)
            if lane is not None:
                lane.observe_decode_step(elapsed)
        self.last_step_idle = not (launched or previous or outputs or prefilled)
        return outputs

    def _launch(
        self, batch: ScheduledBatch, previous: InflightStep | None, lane: PrefillLane | None = None
    ) -> InflightStep:
        """Queue a batch's model run and sampling on the device; returns without waiting.
        Placeholder inputs and pending outputs (penalties) come from `previous`'s tokens.
        `lane`: a split engine's prefill lane runs the batch (else the engine's own loop)."""
        scheduler = lane.scheduler if lane is not None else self.scheduler
        runner = lane.runner if lane is not None else self.step_runner
        sampler = lane.sampler if lane is not None else self.sampler
        requests = tuple(scheduler.requests[c.request_id] for c in batch.chunks)
        self.block_pool.flush_host_tier(offload=lane is None)  # fence, offload (host_tier.py)
        # a pipeline samples on its last stage: the rows and mask go with the step
        executed = None if isinstance(runner, PPLeader) else runner.execute(batch)
        chunks = [(r, c) for r, c in zip(requests, batch.chunks, strict=True) if c.sample]
        # a constrained row's mask needs its newest token, still in `previous`: read it now,
        # while the device runs this step's model (the overlap's slack; a pipeline's later)
        constrained = self.constrained
        if (
            previous is not None
            and constrained
            and not previous.read_early
            and any(c.placeholder and r.request_id in constrained for r, c in chunks)
        ):
            previous.keep_outputs(self._complete(previous))
        sampled, rows = sampling_rows(chunks, previous, self.tracking.generators)
        mask = None
        if self.constrained:
            mask = self.constrained.mask([None if r.is_finished else r.request_id for r in sampled])
        if isinstance(runner, PPLeader):
            tokens, prompt = runner.execute_sampled(batch, requests, rows, mask)
        else:
            assert executed is not None
            logits, prompt = PromptLogprobsStep.split(executed, batch, requests)
            previous_ids = previous.tokens.token_ids if previous is not None else None
            tokens = sampler.sample(logits, rows, previous_ids, mask)
        runner.keep_sampled(tokens.token_ids, [r.request_id for r in sampled])
        return InflightStep(requests, tuple(sampled), tokens, prompt)

    def _complete(
        self, step: InflightStep, scheduler: Scheduler | None = None
    ) -> list[RequestOutput]:
        """Read a launched step's tokens (the host's one wait on the device) and postprocess
        them. A request that finished since it was launched (aborted; or stopped by the token
        before, read after this step was launched) gets nothing: its token is discarded."""
        if step.read_early:
            return step.take_outputs()
        out = step.results()
        for request in step.requests:
            if not request.is_finished:
                (scheduler or self._owner(request)).cache_computed_blocks(request)
        now = time.time()
        outputs: list[RequestOutput] = []
        for request, sample in zip(step.sampled, out.rows(), strict=True):
            if not request.is_finished:
                outputs.append(self._postprocess(request, sample, now))
        return outputs

    def _postprocess(self, request: Request, sample: SampledRow, now: float) -> RequestOutput:
        token_id = sample[0]
        request.append_output(*sample)
        if request.first_token_time is None:
            request.first_token_time = now
        checker = self.tracking.checkers[request.request_id]
        status = checker.update(request, token_id)
        if self.constrained.accept(request.request_id, token_id) and status is None:
            status = RequestStatus.FINISHED_STOPPED  # the constraint is complete
        if status is None and self.config.mode is EngineMode.PREFILL_ONLY:
            status = RequestStatus.FINISHED_PREFILLED
        text = checker.take_text_delta(request, finished=status is not None)
        if status is not None:
            self._owner(request).finish(request, status)
            self.tracking.stop(request.request_id)
        return self._output(request, 1, text)

    def _owner(self, request: Request) -> Scheduler:
        """The scheduler that holds an unfinished request (a split engine has two)."""
        lane = self.prefill_lane
        if lane is not None and request.request_id in lane.scheduler.requests:
            return lane.scheduler
        return self.scheduler

    def _output(self, request: Request, num_new: int, text: str) -> RequestOutput:
        return request.output(num_new, text, self.scheduler.handoffs.kv_handoff(request))

    def _final_output(self, request: Request) -> RequestOutput:
        """The last output of a request ended outside a sample; stops tracking it."""
        text = self.tracking.checkers[request.request_id].take_text_delta(request, finished=True)
        self.tracking.stop(request.request_id)
        return self._output(request, 0, text)

    # ---- hand-off: prefill side -----------------------------------------------------------

    def release_request_blocks(self, request_id: str) -> bool:
        """Free the blocks a prefill-only request kept for hand-off (idempotent: False if
        none are held, e.g. already released or the lease reaper got there first)."""
        if request_id not in self.scheduler.handed_off:
            return False
        self.scheduler.release(request_id)
        return True

    # ---- hand-off: decode side ------------------------------------------------------------

    def allocate_for_transfer(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        block_hashes: Sequence[BlockHash],
        *,
        cache_salt: str = "",
        lora_name: str = "",
    ) -> TransferAllocation:
        """Reserve local blocks for a prompt's KV (block_hashes: its full blocks' hashes, as
        the prefill side reported them, with LoRA adapter `lora_name`, whose read starts
        now if needed). Raises NoFreeBlocksError when the pool is short, and as add_request."""
        self.limits.check_prompt(prompt_token_ids, None)
        self.loras.check(lora_name)
        if self._inflight is not None and self._inflight.released_blocks():
            # The transfer writes the pool from outside the device stream, and the step in
            # flight may still write a block one of its requests gave back: let it finish.
            self._inflight.wait_device()
        if self.pipelined is not None and self.pipelined.released_blocks():
            self._ready += self.pipelined.drain(self)  # (its steps may write such a block)
        extra = hash_extra(self.model_id, cache_salt, lora_name)
        reserved = self.scheduler.reserve_transfer(
            request_id, prompt_token_ids, block_hashes, extra, lora_name
        )
        return TransferAllocation(request_id, reserved.block_ids, reserved.num_cached_blocks)

    def free_transfer_blocks(self, request_id: str) -> bool:
        """Give back the blocks reserved for a transfer that failed (False if none)."""
        if request_id not in self.scheduler.transferring:
            return False
        self.scheduler.free_transfer(request_id)
        return True

    def add_transferred_request(
        self,
        request_id: str,
        first_token_id: int,
        sampling_params: SamplingParams,
        *,
        first_token_logprob: float | None = None,
        arrival_time: float | None = None,
        prior: PriorOutput | None = None,
    ) -> None:
        """Start decoding a request whose prompt KV now fills its reserved blocks.

        `first_token_id` is the token the prefill side sampled (already streamed to the
        client: its text is not returned again). If it already ends the request (eos,
        max_tokens=1) the request finishes at once and the next `step()` reports it.

        With `prior` (a migrated request) the reserved KV is the prompt's and then the prior
        tokens', `first_token_id` is the last token the client has (not sampled by the
        prefill side), and the text sent is `prior.text_chars` characters up to and with it.
        It runs on its transfer's LoRA adapter once it holds the adapter's slot.
        """
        reserved = self.scheduler.transferring.get(request_id)
        if reserved is None:
            raise KeyError(f"no transfer reserved for request {request_id!r}")
        prior = prior or NO_PRIOR
        n_prior = len(prior.token_ids)
        kv_tokens = reserved.prompt_token_ids
        if n_prior and kv_tokens[len(kv_tokens) - n_prior :] != prior.token_ids:
            raise ValueError("prior: its tokens are not those that end the transferred KV")
        request = Request(
            request_id=request_id,
            prompt_token_ids=kv_tokens[: len(kv_tokens) - n_prior],
            sampling_params=sampling_params,
            block_size=self.config.block_size,
            hash_extra=reserved.hash_extra,
            arrival_time=arrival_time if arrival_time is not None else time.time(),
            # (a prior's tokens hash as they are appended)
            block_hashes=[] if n_prior else list(reserved.block_hashes),
            lora_name=reserved.lora_name,
        )
        self.limits.check_prior(request.prompt_token_ids, sampling_params, prior, with_next=True)
        # the matcher resumes from the tokens so far (the hand-off carries no grammar state)
        done = self.constrained.start(
            request_id, sampling_params.structured, (*prior.token_ids, first_token_id)
        )
        for token_id in prior.token_ids:
            request.append_output(token_id, None)
        request.append_output(first_token_id, first_token_logprob)
        request.first_token_time = time.time()
        self.scheduler.add_transferred(request)
        # The prefill side drew once from a seeded generator for the first token (a
        # migrated request: once for each token the client has).
        draws = 0 if sampling_params.greedy else n_prior + 1
        checker = self.tracking.start(request, request.prompt_token_ids, sampling_params, draws)
        checker.replay(prior.token_ids)
        status = checker.update(request, first_token_id)
        if n_prior:
            checker.mark_released(prior.text_chars)
        else:
            checker.take_text_delta(request, finished=True)  # the prefill side sent this text
        if done and status is None:
            status = RequestStatus.FINISHED_STOPPED
        if status is not None:
            self.scheduler.finish(request, status)
            self.tracking.stop(request_id)
            self._ready.append(self._output(request, 0, ""))

    # ---- LoRA adapters --------------------------------------------------------------------

    def load_lora(self, name: str, path: str) -> None:
        """Serve the PEFT folder at `path` as adapter `name` (checked now, read at its first
        request); a no-op for the same name and folder. ValueError naming the adapter when
        it cannot be served here (engine/lora/lora_registry.py)."""
        self.loras.register(name, path)

    def unload_lora(self, name: str) -> bool:
        """Stop serving adapter `name` (False if it is not registered); new requests on it
        raise LoraNotFound. Requests holding its slot finish normally (its weights go with
        the last); those on it that hold none end now (`Scheduler.abort_without_slot`),
        reported by the next `step()`."""
        if not self.loras.unregister(name):
            return False
        reason = LoraNotFound(f"lora adapter {name!r} was unloaded before it ran")
        for scheduler in schedulers(self.scheduler, self.prefill_lane):
            for request in scheduler.abort_without_slot(name, reason):
                self._ready.append(self._final_output(request))
        return True

    def list_loras(self) -> tuple[LoraInfo, ...]:
        """The adapters registered here, in registration order (none when LoRA is off)."""
        return self.loras.infos()

    # ---- observability --------------------------------------------------------------------

    def load(self) -> EngineLoad:
        s, lane = self.scheduler, self.prefill_lane
        both = schedulers(s, lane)
        return EngineLoad(
            num_waiting=sum(x.num_waiting for x in both),
            num_running=sum(x.num_running for x in both),
            num_waiting_prefill_tokens=sum(x.num_pending_prefill_tokens() for x in both),
            num_free_blocks=self.block_pool.num_free,
            num_total_blocks=self.block_pool.num_blocks,
            num_handoff_blocks=s.num_handoff_blocks(),
            num_transfer_blocks=s.num_transfer_blocks(),
            num_cache_query_tokens=sum(x.num_cache_query_tokens for x in both),
            num_cache_hit_tokens=sum(x.num_cache_hit_tokens for x in both),
            num_preemptions=sum(x.num_preemptions for x in both),
            num_host_hit_tokens=sum(x.num_host_hit_tokens for x in both),
            host_tier=self.host_tier.stats() if self.host_tier is not None else None,
            steps=self.step_meter.snapshot(),
            loras=self.loras.held(),
            split=lane.status() if lane is not None else None,
        )

    def take_kv_events(self) -> list[KVEvent]:
        """Prefix-cache changes since the previous call (for the prefix-index publisher)."""
        return self.block_pool.take_events()

    def cached_block_hashes(self) -> tuple[tuple[BlockHash, ...], int]:
        """(every hash cached in the device pool, seq of the last event they include)."""
        return self.block_pool.cached_hashes(), self.block_pool.last_seq

    def cache_snapshot(self) -> CacheSnapshot:
        """Every hash held, by tier, as of one event sequence number: a full index resync."""
        pool = self.block_pool
        return CacheSnapshot(pool.last_seq, pool.cached_hashes(), pool.host_only_hashes())

    def reset_prefix_cache(self) -> None:
        self.block_pool.reset_prefix_cache()

    def use_copy_budget(self, budget: CopyBudget) -> None:
        """Budget the host tier's copies with the worker's KV transfers (engine/kv/host_tier.py)."""
        if self.host_tier is not None:
            self.host_tier.budget = budget

    def close(self) -> None:
        """Tell the other ranks of a TP or pipeline engine to return (their group stays the
        caller's to close); nothing to do with one rank. Stops the grammar compiles."""
        self.constrained.close()
        if self.pipelined is not None:
            self.pipelined.close(self)
        if not isinstance(self.step_runner, ModelRunner):
            self.step_runner.close()

    # ---- convenience ----------------------------------------------------------------------

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling_params: SamplingParams | None = None,
        lora_name: str = "",
    ) -> list[list[int]]:
        """Run prompts to completion (all added at once, on adapter `lora_name`); output token
        ids per prompt."""
        ids = [f"generate-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
        for request_id, prompt in zip(ids, prompts, strict=True):
            self.add_request(request_id, prompt, sampling_params, lora_name=lora_name)
        tokens: dict[str, list[int]] = {i: [] for i in ids}
        while self.has_unfinished():
            for out in self.step():
                tokens[out.request_id] += out.new_token_ids
        return [tokens[i] for i in ids]
