"""Overlap scheduling: a launched step whose sampled tokens the host reads one step later.

`LLMEngine.step()` with `EngineConfig.overlap_scheduling` (SGLang's overlap scheduler, vLLM's
async scheduling) works on two steps at once:

    schedule t → launch t (stage inputs, replay/run the model, sample: all queued on the
    device) → read t-1 (`InflightStep.results`: the one wait on the device per step) →
    postprocess t-1 (append tokens, stop checks, detokenize, outputs)

so the host's work for t-1 and t+1 runs while the device computes t. A token sampled at t-1
is a placeholder when t is scheduled (`Request.num_output_placeholders`): its decode is
staged with token 0 and the runner overwrites that row on the device with the id from t-1's
sampled tensor (`ModelRunner.keep_sampled`), so no host sync sits inside the loop.

Invariants the engine keeps:
- at most one step is in flight; everything it samples is read before the step after the
  next is scheduled, so a placeholder always refers to the latest launched step;
- a request that stops (or is aborted) while its next decode is in flight emits nothing
  more: that token is read and discarded, its blocks were freed by `Scheduler.finish`
  (the step in flight may still write the freed slot: only later steps on the same stream
  reuse it, and a KV transfer into the pool waits for the step first, `wait_device`);
- a step with a constrained request (structured output, engine/structured) whose newest
  token is still in the step before reads that step early, after queuing its own model run
  and before sampling (`InflightStep.keep_outputs`): the mask needs the token, and is filled
  on the host while the device runs the model; those outputs go out as usual;
- host→device values of a step (sampling parameters, placeholder indices) go through pinned
  memory with non-blocking copies (`to_device`): a plain `torch.tensor(..., device="cuda")`
  waits for the device to drain, which would serialize the loop again.

On CPU the device work is synchronous, so the same code runs without any overlap.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from engine.batch import SeqChunk
from engine.core.request import Request, RequestStatus
from engine.core.sampler import SamplingRow

if TYPE_CHECKING:
    from engine.core.prompt_logprobs import PromptLogprobsStep
    from engine.core.sampler import SampledTokens, SamplerOutput
    from vocabulary.engine_io import RequestOutput


class InflightStep:
    """A launched step: its requests, what it sampled (still on the device) and the
    asynchronous copy of those tokens to the host.

    `sampled[i]` is the request whose token is row i of `tokens`; `requests` holds every
    request of the batch (the engine caches their computed blocks once the step is read).
    """

    def __init__(
        self,
        requests: tuple[Request, ...],
        sampled: tuple[Request, ...],
        tokens: SampledTokens,
        prompt: PromptLogprobsStep | None = None,
    ) -> None:
        """`prompt`: the step's prompt logprobs (their copies to the host queued already)."""
        self.requests = requests
        self.sampled = sampled
        self.tokens = tokens
        self.prompt = prompt
        self._rows = {r.request_id: i for i, r in enumerate(sampled)}
        host = tokens.device_tensors()
        self._done: torch.cuda.Event | None = None
        if tokens.token_ids.device.type == "cuda":  # D2H into pinned memory, then an event
            host = tuple(None if t is None else t.to("cpu", non_blocking=True) for t in host)
            self._done = torch.cuda.Event()
            self._done.record()
        self._host = host
        self.read_early = False
        """Read before the next step sampled (`keep_outputs`): that step has constrained
        rows whose mask needed these tokens (engine/structured)."""
        self._outputs: list[RequestOutput] = []

    def keep_outputs(self, outputs: list[RequestOutput]) -> None:
        """This step was read early; its outputs go out with the step that reads it."""
        self.read_early = True
        self._outputs = outputs

    def take_outputs(self) -> list[RequestOutput]:
        outputs, self._outputs = self._outputs, []
        return outputs

    def row_of(self, request: Request) -> int:
        """The row of `request`'s token in `tokens` (KeyError if it sampled nothing here)."""
        row = self._rows.get(request.request_id)
        if row is None or self.sampled[row] is not request:
            raise KeyError(f"request {request.request_id!r} sampled nothing in this step")
        return row

    def released_blocks(self) -> bool:
        """Whether a request of this step has given its blocks back since it was launched
        (finished, aborted or preempted): the step may still write one of them."""
        return any(r.is_finished or r.status is RequestStatus.PREEMPTED for r in self.requests)

    def is_done(self) -> bool:
        """The device has finished the step (never waits; always True on CPU)."""
        return self._done is None or self._done.query()

    def order_before_current_stream(self) -> None:
        """Make the current stream wait for this step on the device (the host goes on)."""
        if self._done is not None:
            torch.cuda.current_stream().wait_event(self._done)

    def wait_device(self) -> None:
        """Block until the device has finished the step (its KV writes included)."""
        if self._done is not None:
            self._done.synchronize()

    def results(self) -> SamplerOutput:
        """Token id, raw logprob and top alternatives (None where not asked) per sampled
        row; waits for the device. The step's prompt logprobs go to their requests here."""
        self.wait_device()
        if self.prompt is not None:
            self.prompt.apply()
        return self.tokens.host_output(self._host)


def sampling_rows(
    chunks: Sequence[tuple[Request, SeqChunk]],
    previous: InflightStep | None,
    generators: Mapping[str, torch.Generator],
) -> tuple[list[Request], list[SamplingRow]]:
    """The requests a launched step samples and their sampler rows. A placeholder's newest
    output is still `previous`'s (the row points at it, for penalties), unless `previous`
    was read early: then the request holds it."""
    sampled: list[Request] = []
    rows: list[SamplingRow] = []
    for request, chunk in chunks:
        pending = -1
        if chunk.placeholder and not (previous is not None and previous.read_early):
            if previous is None:
                raise RuntimeError(f"request {request.request_id}: placeholder, no step read")
            pending = previous.row_of(request)
        sampled.append(request)
        rows.append(
            SamplingRow(
                request.sampling_params,
                request.prompt_token_ids,
                request.output_token_ids,
                generators.get(request.request_id),
                pending,
            )
        )
    return sampled, rows
