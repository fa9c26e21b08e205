"""Which running requests a cross-step pipeline's next step computes (pure: no tensors).

The cross-step schedule (`EngineConfig.pipeline_schedule` = cross_step, the engine side in
engine/core/pp_steps.py) keeps up to G steps in flight on the stages at once (G = the
engine's micro-batches, by default the stages S), each over its own requests, so while stage
1 runs group A's step t, stage 0 already runs group B's step t, and A's step t + 1 starts on
stage 0 as soon as A's sampled tokens are back on rank 0 (vLLM's virtual engines, SGLang's
micro-batch event loop; the schedule of one step within the stages is still
engine/core/pp_runner.py's). Rank 0's `step()`:

    read the oldest step in flight once G are (its tokens: the one wait); schedule with
    `schedulable` below; launch that batch (send it, run stage 0's part, go on without its
    tokens); read the oldest step when nothing could be launched

A request belongs to no fixed group: it is in flight from the step that samples it until
rank 0 reads that step (it then holds a placeholder, `Request.num_output_placeholders`), and
a step computes only requests that are not in flight. So:

- a request joins the group of the step that admits it (waiting requests are admitted in
  FCFS order under the token budget and `max_num_seqs`, as with one stage); its prompt chunks
  are computed by consecutive steps whoever's turn it is (a prompt chunk does not sample,
  so the request is not in flight until its last chunk; each stage runs the steps in the
  order they were sent, so a chunk reads its earlier chunks' KV on every stage): the chunks
  of a long prompt are the pipeline's micro-batches;
- a step computes at most ceil(D / G) decodes, D the decoding requests (in flight or not),
  oldest first: a group that grew past its share (a burst admitted in one step) leaves its
  newest decodes for the next step, which is another group's, and groups shrunk by finished
  requests take them in; steady decoding settles into G groups that differ by at most one
  request (a request that moves waits one step once);
- a request that finishes, is aborted or preempted while in flight gets nothing more: its
  token is read and discarded with its step, as with overlap scheduling. Its blocks are
  freed on rank 0's books at once (the same block ids on every stage), and a later step that
  reuses them runs after the step in flight on every stage (each runs the steps in order);
  a preempted request is re-admitted only once its step is read (`Scheduler._admit`);
- every launched step is read, in launch order (the last stage sends its tokens in that
  order): `has_unfinished` holds while a step is in flight, and close, drain and a KV
  transfer's allocation read the steps still in flight first (`PipelinedSteps.drain`), so
  no stage is left mid-step and no block is handed to a transfer while a step may still
  write it.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.core.request import Request
from vocabulary.numeric import cdiv


def is_decoding(request: Request) -> bool:
    """In flight (it sampled and the step is not read), or one token away from sampling."""
    return bool(request.num_output_placeholders) or request.num_pending_tokens <= 1


def schedulable(running: Sequence[Request], num_groups: int) -> frozenset[str]:
    """The ids of the running requests (oldest first) the next step may compute: every one
    not in flight, but at most ceil(decoding / `num_groups`) decodes (module docstring)."""
    if num_groups < 1:
        raise ValueError(f"decode groups: must be >= 1, got {num_groups}")
    seats = cdiv(sum(1 for r in running if is_decoding(r)), num_groups)
    out: list[str] = []
    for request in running:
        if request.num_output_placeholders:
            continue
        if is_decoding(request):
            if seats == 0:
                continue
            seats -= 1
        out.append(request.request_id)
    return frozenset(out)
