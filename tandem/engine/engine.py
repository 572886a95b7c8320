"""The engine: owns requests and the target's KV cache; one step loop for plain and speculative decoding.

Each step: admit and prefill waiting requests -> the drafter proposes a draft (chain or tree, maybe
empty) per running request -> ONE target forward over [pending token + draft] of every request ->
verify each draft against the target's sampling distribution -> commit the emitted tokens and keep only
the accepted path in the KV cache. Plain decoding is the empty draft, so both share one code path.
Token ids only: detokenization and stop strings live at the edge (tandem.llm).
"""
from __future__ import annotations

import itertools
import sys
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch

from tandem.config import WEIGHTS, EngineConfig, SamplingParams
from tandem.engine.admission import first_of_each_prompt, prefill_groups, take_waiting
from tandem.engine.request import FinishReason, Request
from tandem.engine.adjust import draft_paths
from tandem.engine.sampling_step import emitted_logprobs, seeded_draw, step_target_probs, target_probs
from tandem.engine.stats import EngineStats, add_position_counts
from tandem.engine.policy_update import copy_named_, validate_named_tensors
from tandem.errors import InvalidParameterError, PolicyUpdateError, PromptTooLongError
from tandem.models.compiled import CompiledForward
from tandem.models.kv_cache import KVCache
from tandem.models.transformer import ForwardOutput, Transformer, packable
from tandem.ops.sampling import draw_uniform
from tandem.ops.verify import verify_tokens, verify_tree
from tandem.engine.records import build_abort_record, build_prefill_record, build_step_record
from tandem.engine.verify_inputs import pad_output, padded_inputs, ragged_inputs
from tandem.types import DraftTree, StepRecord


def _progress(message: str) -> None:
    print(f"[tandem] {message}", file=sys.stderr, flush=True)


@dataclass
class StepOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None
    error: str | None = None  # chunked prefill: this request's prefill raised; it was aborted, the step went on


class Engine:
    def __init__(self, model: Transformer, config: EngineConfig = EngineConfig(), drafter=None, draft_policy=None):
        self.model = model
        self.config = config
        self.drafter = drafter
        self.draft_policy = draft_policy  # plan(requests) / choose_k per request (tandem.engine.control); None = drafter's own k
        self.max_model_len = min(config.max_model_len or model.cfg.max_position, model.cfg.max_position)
        draft_room = (drafter.max_nodes if drafter is not None else 0) + 1
        device = model.embed.weight.device
        self.cache = KVCache(model.cfg, config.max_batch_size, self.max_model_len + draft_room, model.embed.weight.dtype, device)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # running[i] lives in cache row i
        self.prefilling: Request | None = None  # chunked prefill in progress, in cache row len(running)
        self._prefill_parts: list[ForwardOutput] = []  # its chunks' outputs so far
        self._prefill_start = 0.0
        self.observers: list[Callable[[StepRecord], None]] = []  # called after each forward committed (must not block)
        self.between_steps: list[Callable[["Engine"], None]] = []  # called before each step (weight hot-swap)
        self.stats = EngineStats()
        self.eos_ids = set(model.cfg.eos_token_ids)
        drafter_taps = tuple(drafter.taps) if drafter is not None else ()
        self.taps = tuple(sorted(set(config.hidden_taps) | set(drafter_taps)))  # target layers returned by every forward
        self.compiled = self._compile(draft_room) if config.compile else None  # decode / verify forward; None = eager
        self._ids = itertools.count()
        self.target_version = 0  # policy version of the target's weights (update_target)

    def _compile(self, draft_room: int) -> CompiledForward:
        """The compiled forward, warmed up for batch 1 at the shapes this drafter's steps use (a progress line
        per shape); other shapes compile on first use."""
        compiled = CompiledForward(self.model, self.cache, self.taps, progress=_progress)
        compiled.warmup(batches=(1,), tokens=tuple(sorted({1, min(draft_room, compiled.max_tokens)})), cache_lens=(0,))
        return compiled

    # ---- requests -------------------------------------------------------------------------------
    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise a typed error if this request cannot run; changes nothing."""
        if not isinstance(params, SamplingParams):
            raise InvalidParameterError(f"params must be SamplingParams, got {type(params).__name__}")
        if not prompt_ids:
            raise InvalidParameterError("prompt is empty")
        vocab = self.model.cfg.vocab_size
        if any((not isinstance(t, int)) or t < 0 or t >= vocab for t in prompt_ids):
            raise InvalidParameterError(f"prompt token ids must be ints in [0, {vocab})")
        need = len(prompt_ids) + params.max_tokens
        if need > self.max_model_len:
            raise PromptTooLongError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) = {need} exceeds the context of {self.max_model_len} tokens"
            )

    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None, tags: dict | None = None) -> str:
        """Validate and queue a request; raises before any state changes."""
        self.validate(prompt_ids, params)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if any(r.request_id == request_id for r in itertools.chain(self.waiting, self.running)):
            raise InvalidParameterError(f"request id {request_id!r} is already in use")
        request = Request(request_id, list(prompt_ids), params, Request.make_generator(params.seed), tags=dict(tags or {}),
                          min_tokens_stops=frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else frozenset(self.eos_ids)))
        request.metrics.prompt_tokens = len(prompt_ids)
        self.waiting.append(request)
        return request_id

    def abort(self, request_id: str) -> None:
        """Drop a request wherever it is (waiting, prefilling, running); observers get an "abort" record for it,
        so whatever they hold for the request (the trace collector's partial trace) is released."""
        self._abort({request_id})

    def _abort(self, request_ids: set[str]) -> None:
        """Abort these requests together: all are marked before any row moves, so no row of one is moved into
        another's hole (a request whose prefill failed holds no drafter state to move)."""
        aborted = [r for r in [*self.waiting, *self.running, self.prefilling] if r is not None and r.request_id in request_ids and not r.finished]
        for request in aborted:
            if request in self.waiting:
                self.waiting.remove(request)
            request.finish_reason = FinishReason.ABORT
        self._release_finished()
        if aborted and self.observers:
            self._emit(build_abort_record(self.stats.steps, self.drafter.version if self.drafter is not None else 0, aborted))

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.prefilling)

    def in_flight(self) -> int:
        """Requests queued, prefilling or decoding."""
        return len(self.waiting) + len(self.running) + (self.prefilling is not None)

    # ---- the step loop ----------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        for hook in self.between_steps:
            hook(self)
        outputs = self._admit()
        self._release_finished()  # a request can finish at its first token
        if self.running:
            outputs += self._decode()
        self._release_finished()
        return outputs

    def _admit(self) -> list[StepOutput]:
        """Waiting requests into free batch rows, prefilled. Unchunked: every one that fits in the batch, whole.
        Chunked (prefill_chunk_tokens > 0): at most that many prompt tokens this step, first come first served:
        the prompt being read continues; the whole prompts that fit in the rest of the budget are prefilled
        together (packed, as unchunked); the next prompt, which does not fit, starts to be read (in row
        len(running), outside the decode batch), so running requests keep decoding every step while a long
        prompt is read. A prefill that raises there ends its own request alone (an output with the error)."""
        chunk = self.config.prefill_chunk_tokens
        if not chunk:
            return self._prefill_whole(take_waiting(self.waiting, self._free_rows(), None)[0], isolate=False)
        outputs: list[StepOutput] = []
        if self.prefilling is not None:
            chunk = self._read_chunk(chunk, outputs)
            if self.prefilling is not None:
                return outputs
        admitted, chunk = take_waiting(self.waiting, self._free_rows(), chunk)
        outputs += self._prefill_whole(admitted, isolate=True)
        if chunk and self.waiting and self._free_rows():
            self._start_prefill(self.waiting.popleft())
            self._read_chunk(chunk, outputs)
        return outputs

    def _free_rows(self) -> int:
        return self.config.max_batch_size - len(self.running) - (self.prefilling is not None)

    def _prefill_whole(self, admitted: list[Request], isolate: bool) -> list[StepOutput]:
        copies: list[Request] = []
        if self.config.share_prompt_prefill:  # a repeated prompt (a GRPO group) is forwarded once, then copied
            admitted, copies = first_of_each_prompt(admitted)
        batched = self.config.prefill_batch_tokens and len(admitted) > 1
        for request in admitted + copies:
            request.row = len(self.running)  # admitted requests take consecutive rows (the prompts forwarded first)
            self.running.append(request)
        done: dict[tuple[int, ...], tuple[int, ForwardOutput, float]] = {}  # prompt -> (row, prefill output, start)
        failed: dict[str, str] | None = {} if isolate else None  # request id -> why its prefill raised
        outputs = self._prefill_batched(admitted, done, failed) if batched else [o for r in admitted for o in self._prefill_one(r, done, failed)]
        for request in copies:
            if tuple(request.prompt_ids) in done:
                outputs.append(self._reuse_prefill(request, *done[tuple(request.prompt_ids)]))
            else:
                failed[request.request_id] = "the prefill of its prompt failed"
        if failed:  # after every prefill of the step, so no row moves under one
            self._abort(set(failed))
        return outputs + [StepOutput(i, [], True, FinishReason.ABORT, error=f"prefill failed: {why}") for i, why in (failed or {}).items()]

    @torch.inference_mode()
    def _read_chunk(self, budget: int, outputs: list[StepOutput]) -> int:
        """Read up to `budget` more tokens of the prompt being prefilled (finishing it if they are its last);
        returns the budget left."""
        request = self.prefilling
        done = int(self.cache.lengths[request.row])
        take = min(budget, len(request.prompt_ids) - done)
        ids = torch.tensor([request.prompt_ids[done : done + take]], device=self.cache.k.device)
        try:
            self._prefill_parts.append(self.model(ids, cache=self.cache, rows=slice(request.row, request.row + 1), last_only=True, taps=self.taps))
        except Exception as e:  # noqa: BLE001 - one request's prefill: it alone ends (with the error), the step goes on
            self.abort(request.request_id)
            outputs.append(StepOutput(request.request_id, [], True, FinishReason.ABORT, error=f"prefill failed: {type(e).__name__}: {e}"))
            return budget - take
        if done + take == len(request.prompt_ids):
            outputs.append(self._finish_prefill())
        return budget - take

    def _start_prefill(self, request: Request) -> None:
        request.row = len(self.running)
        self.cache.reset(request.row)
        self.prefilling, self._prefill_parts, self._prefill_start = request, [], time.perf_counter()

    def _finish_prefill(self) -> StepOutput:
        request, parts = self.prefilling, self._prefill_parts
        self.prefilling, self._prefill_parts = None, []
        whole = ForwardOutput(parts[-1].logits, tuple(torch.cat(h, dim=1) for h in zip(*(p.hidden for p in parts))),
                              torch.cat([p.final_hidden for p in parts], dim=1))
        self.running.append(request)  # its row is len(running) before the append
        return self._first_token(request, whole, self._prefill_start)

    @torch.inference_mode()
    def _prefill(self, request: Request, done: dict) -> StepOutput:
        """One forward over the prompt; records (row, output, start) in `done` for requests that repeat it."""
        start = time.perf_counter()
        self.cache.reset(request.row)
        ids = torch.tensor([request.prompt_ids], device=self.cache.k.device)
        out = self.model(ids, cache=self.cache, rows=slice(request.row, request.row + 1), last_only=True, taps=self.taps)
        done[tuple(request.prompt_ids)] = (request.row, out, start)
        return self._first_token(request, out, start)

    def _prefill_one(self, request: Request, done: dict, failed: dict | None) -> list[StepOutput]:
        """`failed` None: a prefill that raises raises; else it is noted there (the caller ends the request)."""
        if failed is None:
            return [self._prefill(request, done)]
        try:
            return [self._prefill(request, done)]
        except Exception as e:  # noqa: BLE001 - this request alone ends (with the error)
            failed[request.request_id] = f"{type(e).__name__}: {e}"
            return []

    @torch.inference_mode()
    def _prefill_batched(self, requests: list[Request], done: dict, failed: dict | None = None) -> list[StepOutput]:
        """Packable prompts (transformer.packable: prefill-shaped) packed into forwards of <= prefill_batch_tokens tokens
        (Transformer.forward_packed: no padding, each prompt attends within itself); the others one forward each.
        Every request sees exactly its own prefill's output (recorded in `done`, as `_prefill` does). With `failed`, a
        packed forward that raises is redone one prompt at a time, so only a prompt that fails alone is noted there."""
        packs = [packable(len(r.prompt_ids)) for r in requests]
        outputs = [o for request, packed in zip(requests, packs) if not packed for o in self._prefill_one(request, done, failed)]
        for group in prefill_groups([r for r, packed in zip(requests, packs) if packed], self.config.prefill_batch_tokens):
            start = time.perf_counter()
            for request in group:
                self.cache.reset(request.row)
            try:
                outs = self.model.forward_packed([r.prompt_ids for r in group], self.cache, [r.row for r in group], self.taps)
            except Exception:
                if failed is None:
                    raise
                outputs += [o for request in group for o in self._prefill_one(request, done, failed)]
                continue
            for request, own in zip(group, outs):
                done[tuple(request.prompt_ids)] = (request.row, own, start)
                outputs.append(self._first_token(request, own, start))
        return outputs

    def _reuse_prefill(self, request: Request, row: int, out: ForwardOutput, start: float) -> StepOutput:
        """The prefill of the same prompt in `row` this step, for `request`: a copy of its KV row and its output,
        what its own forward would compute, bit for bit (a single-row forward does not depend on the row)."""
        self.cache.move_row(row, request.row)  # copies: the source row stays
        self.stats.shared_prefill_tokens += len(request.prompt_ids)
        return self._first_token(request, out, start)

    def _first_token(self, request: Request, out: ForwardOutput, start: float) -> StepOutput:
        """Sample / verify the first token from a prefill's last logits, commit it, tell the drafter and observers."""
        logits = out.logits[0, -1:]
        result = self._verify(request, DraftTree.empty(), logits)[0]
        token = result.tokens[0]
        request.metrics.prefill_time_s = time.perf_counter() - start
        request.metrics.first_token_time = time.perf_counter()
        self.stats.prefill_tokens += len(request.prompt_ids)
        output = self._commit(request, [token], emitted_logprobs([request], [result], logits.unsqueeze(0))[0])
        if self.drafter is not None:
            self.drafter.on_prefill(request, out)
        if self.observers:
            version = self.drafter.version if self.drafter is not None else 0
            self._emit(build_prefill_record(self.stats.steps, version, request, token, out, self.config.record_steps, self.config.record_topk, self.taps))
        return output

    @torch.inference_mode()
    def _decode(self) -> list[StepOutput]:
        requests = list(self.running)
        t0 = time.perf_counter()
        drafts = self._propose(requests)
        t1 = time.perf_counter()
        starts = [int(self.cache.lengths[r.row]) for r in requests]
        verified_before = self.stats.verified_tokens
        out = self._verify_forward(requests, drafts, starts)
        results = []
        argmax = self._greedy_argmax(requests, out.logits)
        probs = step_target_probs(requests, drafts, out.logits, [self._needs_target_probs(r) for r in requests])
        for b, (request, draft) in enumerate(zip(requests, drafts)):
            logits = out.logits[b, : len(draft) + 1]
            result, row_probs = self._verify(request, draft, logits, None if argmax is None else argmax[b, : len(draft) + 1], probs[b])
            self.cache.keep_path(request.row, starts[b], [0] + [1 + i for i in result.accepted_nodes])
            results.append((result, row_probs))
        logprobs = emitted_logprobs(requests, [result for result, _ in results], out.logits, [p for _, p in results])
        outputs = [self._commit(request, result.tokens, lp) for request, (result, _), lp in zip(requests, results, logprobs)]
        t2 = time.perf_counter()
        if self.drafter is not None:
            self.drafter.on_verified(requests, drafts, [r for r, _ in results], starts, out)
        t3 = time.perf_counter()  # the drafter's time is its propose and its on_verified (an EAGLE head's feature fusing)
        self._account(requests, drafts, results, (t1 - t0) + (t3 - t2), t2 - t1, self.stats.verified_tokens - verified_before)
        self._notify(requests, drafts, results, out, starts, argmax)
        return outputs

    def _verify_forward(self, requests: list[Request], drafts: list[DraftTree], starts: list[int]) -> ForwardOutput:
        """The one target forward over every row's pending token + draft (logits etc. [B, T, ...]). Rows that draft
        different amounts go ragged where the model can (no padding: a row costs its own 1 + len(draft) tokens);
        else every row is padded to the widest, as the compiled forward and the SDPA path need."""
        pending = [r.pending_token for r in requests]
        ragged = len({len(d) for d in drafts}) > 1 and self.compiled is None and self.config.ragged_verify and self.model.ragged_ready(self.cache)
        if ragged:
            inputs = ragged_inputs(pending, drafts, starts)
            device = self.cache.k.device
            out = self.model.forward_ragged(inputs.ids.to(device), inputs.positions.to(device), self.cache, inputs.lengths,
                                            None if inputs.tree is None else inputs.tree.to(device), self.taps)
            self.stats.ragged_steps += 1
            self.stats.verified_tokens += len(inputs.ids)
            return pad_output(out, inputs.lengths)
        ids, positions, mask = (t if t is None else t.to(self.cache.k.device) for t in padded_inputs(pending, drafts, starts))
        self.stats.verified_tokens += ids.numel()
        if self.compiled is not None:
            return self.compiled(ids, positions, mask)
        return self.model(ids, positions=positions, cache=self.cache, rows=slice(0, len(requests)), tree_mask=mask, taps=self.taps)

    def _greedy_argmax(self, requests: list[Request], logits: torch.Tensor) -> torch.Tensor | None:  # [B, T, V] -> [B, T]
        """The target's argmax at every position of the step, in one op for the batch (one per row cost ~80 us each at
        60 rows), when some request is verified greedily; a row's argmax does not depend on the other rows."""
        if not any(r.params.greedy for r in requests):
            return None
        return logits.argmax(-1).cpu()

    def _needs_target_probs(self, request: Request) -> bool:
        """Greedy rows whose logits are adjusted (min_tokens, penalties) verify against the adjusted argmax's one-hot. A
        recorded greedy row needs none either: its nodes' target probabilities are the argmax's one-hot (records.py)."""
        return not request.params.greedy or request.params.adjusts_logits

    def _verify(self, request: Request, draft: DraftTree, logits: torch.Tensor, argmax: torch.Tensor | None = None,
                probs: torch.Tensor | None = None):  # logits [N+1, V]
        """Verify one request's draft (argmax [N+1] / probs, its target_probs [N+1, V]: already computed for the step,
        or None); the target_probs are returned only when they were needed or recorded."""
        if not self._needs_target_probs(request):
            best = (logits.argmax(-1).cpu() if argmax is None else argmax).tolist()
            return verify_tokens(draft.parents, draft.tokens, best.__getitem__), None
        n = len(draft)
        if probs is None:
            probs = target_probs([request] * (n + 1), logits, draft_paths(draft))
        if request.params.seed is not None:
            return verify_tokens(draft.parents, draft.tokens, seeded_draw(request, draft, probs)), probs
        uniform = draw_uniform([request.generator], n + 1)[0]
        return verify_tree(draft.parents, draft.tokens, draft.probs(probs.shape[-1]), probs, uniform), probs

    def _propose(self, requests: list[Request]) -> list[DraftTree]:
        if self.drafter is None:
            return [DraftTree.empty() for _ in requests]
        budgets = [max(0, r.params.max_tokens - len(r.output_ids) - 1) for r in requests]
        if self.draft_policy is not None:
            plan = getattr(self.draft_policy, "plan", None)  # batch-aware policies decide once per step
            chosen = plan(requests) if plan is not None else [self.draft_policy.choose_k(r) for r in requests]
            budgets = [min(b, k) for b, k in zip(budgets, chosen)]
        self.drafter.attach_target_cache(self.cache)  # each step: a drafter may serve more than one engine
        return self.drafter.propose(requests, budgets)

    def _commit(self, request: Request, tokens: list[int], logprobs: list[tuple] | None = None) -> StepOutput:
        """Append emitted tokens, stopping at EOS / a stop token / max_tokens (later tokens are dropped)."""
        new = []
        for i, token in enumerate(tokens):
            new.append(token)
            request.output_ids.append(token)
            if logprobs is not None:
                request.output_logprobs.append(logprobs[i][0])
                request.output_policy_logprobs.append(logprobs[i][1])
                if logprobs[i][2] is not None:
                    request.output_top_logprobs.append(logprobs[i][2])
            if self._is_stop_token(request, token):
                request.finish_reason = FinishReason.STOP
                break
            if len(request.output_ids) >= request.params.max_tokens:
                request.finish_reason = FinishReason.LENGTH
                break
        request.metrics.output_tokens = len(request.output_ids)
        self.stats.output_tokens += len(new)
        return StepOutput(request.request_id, new, request.finished, request.finish_reason)

    def _is_stop_token(self, request: Request, token: int) -> bool:
        return (token in self.eos_ids and not request.params.ignore_eos) or token in request.params.stop_token_ids

    def _release_finished(self) -> None:
        """Drop finished requests and keep the remaining rows contiguous (move the last row into a hole)."""
        now = time.perf_counter()
        finished = [r for r in self.running if r.finished]
        for request in finished:
            request.metrics.finish_time = now
            if self.drafter is not None:
                self.drafter.release(request)
            if self.draft_policy is not None:
                self.draft_policy.release(request)
        if finished:
            keep = len(self.running) - len(finished)
            holes = [r.row for r in self.running[:keep] if r.finished]
            movers = [r for r in self.running[keep:] if not r.finished]  # only live rows move: a finished one may hold no
            for hole, mover in zip(holes, movers):  # drafter state (a prefill that failed beside one that finished at once)
                self.cache.move_row(mover.row, hole)
                if self.drafter is not None:
                    self.drafter.move_row(mover.row, hole)
                mover.row = hole
            self.running[:] = sorted((r for r in self.running if not r.finished), key=lambda r: r.row)
            for request in finished:
                request.row = -1
        if self.prefilling is not None and self.prefilling.finished:  # aborted mid-prefill
            self.prefilling.metrics.finish_time, self.prefilling.row = now, -1
            self.prefilling, self._prefill_parts = None, []
        if self.prefilling is not None and self.prefilling.row != len(self.running):  # keep it right after the decode rows
            self.cache.move_row(self.prefilling.row, len(self.running))
            self.prefilling.row = len(self.running)

    # ---- accounting ---------------------------------------------------------------------------------
    def _account(self, requests, drafts, results, draft_s: float, verify_s: float, verified: int) -> None:
        share = 1.0 / len(requests)
        for request, draft, (result, _) in zip(requests, drafts, results):
            m = request.metrics
            m.steps += 1
            m.draft_time_s += draft_s * share
            m.verify_time_s += verify_s * share
            m.draft_lengths.append(len(draft))
            if len(draft):
                m.drafts += 1
                m.drafted_tokens += len(draft)
                m.accepted_tokens += result.num_accepted
                add_position_counts(m.drafted_per_position, m.accepted_per_position, draft.nodes_per_depth(), result.num_accepted)
        self.stats.record_step(requests, drafts, [r for r, _ in results], draft_s, verify_s)
        if self.draft_policy is not None:
            self.draft_policy.observe(requests, drafts, [r for r, _ in results], draft_s, verify_s, verified)

    def _notify(self, requests, drafts, results, out, starts, argmax: torch.Tensor | None = None) -> None:
        if not self.observers:
            return
        version = self.drafter.version if self.drafter is not None else 0
        self._emit(build_step_record(
            self.stats.steps, version, requests, drafts, results, out, starts, self.config.record_steps, self.config.record_topk, self.taps, argmax,
        ))

    def _emit(self, record: StepRecord) -> None:
        for observer in self.observers:
            observer(record)

    # ---- policy updates (RL) ------------------------------------------------------------------------
    def update_target(self, named_tensors: dict[str, torch.Tensor], version: int) -> None:
        """Copy new target weights in place between steps (no request may be in flight: their KV entries
        and drafts came from the old weights). Validated first: on any error nothing changes. Then the
        prepacked weights are rebuilt and every KV row is reset. Drafters re-sync separately (tandem.rl)."""
        if self.has_unfinished():
            raise PolicyUpdateError("update_target between rollouts only: requests are still waiting or running")
        validate_named_tensors(self.model, named_tensors)
        if named_tensors:
            self.model.unpack()  # dense parameters back (packing may have dropped them), write, repack
            copy_named_(self.model, named_tensors)
            if self.config.pack_weights:
                self.model.pack(gemm=WEIGHTS[self.config.weights])
        for row in range(self.cache.max_batch):
            self.cache.reset(row)
        self.target_version = int(version)

    # ---- convenience ----------------------------------------------------------------------------------
    def run(self, prompts: list[list[int]], params: list[SamplingParams], tags: list[dict] | None = None) -> list[Request]:
        """Add all prompts, step until every one finished, return the requests in input order."""
        first = len(self.waiting)
        for i, (prompt, sp) in enumerate(zip(prompts, params)):
            self.add_request(prompt, sp, tags=tags[i] if tags else None)
        requests = list(self.waiting)[first:]
        while self.has_unfinished():
            self.step()
        return requests
