"""Exact acceptance replay for greedy decoding, and the target-trace cache it replays against.

For greedy decoding the emitted sequence is the target's greedy continuation whatever the drafter does,
and a greedy chain drafter's acceptance depends only on its weights and the target's outputs: at a step
whose pending token sits at position n, the head's chain is what `eagle_train.unroll` predicts at root
n - 1 (step 0 from the target features of the committed context, step s from its own hidden state fed
back, exactly as `EagleDrafter` drafts), and the accepted count is the leading run of predictions equal
to the committed tokens, capped by the step's budget (the engine's: min(k, max_tokens - output - 1)).
Chains are full (the flywheel's drafters run with `min_confidence` 0; a confidence cut is not modelled).
So the target runs once per prompt (`target_traces`, cached on disk) and each drafter version is
replayed with k batched head passes per request instead of a live decode. tests/flywheel/test_replay.py
checks that replay and a live engine give the same steps per request.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from tandem.flywheel.buffer import load_traces, write_shard
from tandem.flywheel.traces import TRACE_SCHEMA, SequenceTrace, TraceAssembler
from tandem.flywheel.objective import Lookup, generated_roots, trace_example
from tandem.models.eagle import EagleHead
from tandem.ops.ngram import ngram_candidates
from tandem.ops.tree import depths as tree_depths, graft_sequence
from tandem.ops.verify import verify_tokens
from tandem.training.offline import eagle_logits


@dataclass
class ReplayResult:
    steps: list[tuple[int, int, int]]  # (pending position n, drafted k, accepted)
    rejections: list[tuple[int, int, int]]  # (root n - 1, depth, rejected target token)
    output_tokens: int
    deployed: list[tuple[int, int, int]] | None = None  # with a Lookup: the deployed drafter's (n, nodes drafted, accepted)

    @property
    def acceptance_length(self) -> float:
        """The engine's per-request metric: (output tokens - 1) / verify steps."""
        return (self.output_tokens - 1) / len(self.steps) if self.steps else 0.0

    @property
    def deployed_acceptance_length(self) -> float | None:
        """The same metric for the drafter as deployed: the chain with the lookup branch grafted on."""
        if self.deployed is None:
            return None
        return (self.output_tokens - 1) / len(self.deployed) if self.deployed else 0.0


@torch.inference_mode()
@torch.inference_mode()  # the serving numerics: a packed head's int8 kernel, as the live engine runs it
def chain_predictions(head: EagleHead, trace: SequenceTrace, k: int) -> tuple[torch.Tensor, int]:  # [k, R] target ids, first root
    """Row s, column t - first: the token the head drafts at depth s for the step whose pending token is at
    t + 1, for the generated roots t = first .. M - 2 only (the engine never drafts inside the prompt)."""
    roots = generated_roots(trace)
    logits, _ = eagle_logits(head, [trace_example(trace)], k, roots, roots)
    return torch.stack([head.draft_to_target[step[0].argmax(-1)].cpu() for step in logits]), int(roots[0])


def replay_request(head: EagleHead, trace: SequenceTrace, k: int, max_tokens: int, lookup: Lookup | None = None) -> ReplayResult:
    """The head's chain replayed; with `lookup`, also the drafter as `eagle_ngram` deploys it (`deployed`), from the
    same predictions."""
    tokens = trace.tokens.tolist()
    length, prompt = len(tokens), trace.prompt_len
    predicted, first = chain_predictions(head, trace, k) if length - prompt > 1 else (torch.zeros(k, 0, dtype=torch.long), 0)
    predicted = predicted.tolist()
    steps, rejections = [], []
    n, output = prompt, 1  # prefill emitted the first output token, pending at position `prompt`
    while output < length - prompt:
        budget = max(0, min(k, max_tokens - output - 1))
        accepted = 0
        while accepted < budget and n + 1 + accepted < length and predicted[accepted][n - 1 - first] == tokens[n + 1 + accepted]:
            accepted += 1
        if accepted < budget and n + 1 + accepted < length:
            rejections.append((n - 1, accepted, predicted[accepted][n - 1 - first]))
        steps.append((n, budget, accepted))
        output += accepted + 1
        n += accepted + 1
    deployed = None if lookup is None else deployed_steps(tokens, prompt, predicted, first, k, max_tokens, lookup)
    return ReplayResult(steps, rejections, min(output, length - prompt), deployed)


def deployed_steps(tokens: list[int], prompt: int, predicted: list[list[int]], first: int, k: int, max_tokens: int,
                   lookup: Lookup) -> list[tuple[int, int, int]]:
    """(n, nodes drafted, accepted) per step of `eagle_ngram` with full chains: the engine's budget b (the tokens left
    but one), the head's chain of min(k, b), the lookup continuation of the context so far grafted on it within b
    nodes (where the chain is not empty), and the greedy walk along the target's tokens (the trace's)."""
    length = len(tokens)
    steps = []
    n, output = prompt, 1
    while output < length - prompt:
        budget = max(0, max_tokens - output - 1)
        chain = [predicted[d][n - 1 - first] for d in range(min(k, budget))]
        draft, parents = chain, list(range(-1, len(chain) - 1))
        found = ngram_candidates(np.asarray(tokens[: n + 1]), lookup.n_min, lookup.n_max, lookup.k, 1) if chain else []
        if found:
            draft, parents = graft_sequence(chain, parents, found[0], budget)
        depth = [0] + [d + 1 for d in tree_depths(torch.tensor(parents, dtype=torch.long)).tolist()]
        target = lambda row: tokens[n + 1 + depth[row]] if n + 1 + depth[row] < length else -1  # noqa: E731
        accepted = verify_tokens(torch.tensor(parents, dtype=torch.long), torch.tensor(draft, dtype=torch.long), target).num_accepted
        steps.append((n, len(draft), accepted))
        output += accepted + 1
        n += accepted + 1
    return steps


def replay_trace(trace: SequenceTrace, result: ReplayResult, version: int) -> SequenceTrace:
    """The trace the engine would have recorded serving `trace` with the replayed drafter (greedy: r = 1
    for every rejection, 0 for every acceptance; nodes: the evaluated ones only, i.e. the accepted chain
    and its first rejected token; no branch states: the target never ran on rejected nodes in replay)."""
    steps = torch.tensor(result.steps, dtype=torch.long).reshape(-1, 3)
    rejects = torch.tensor(result.rejections, dtype=torch.long).reshape(-1, 3)
    tokens, rejected = trace.tokens.tolist(), {root + 1: token for root, _, token in result.rejections}
    nodes = []  # (step, token, parent, accepted)
    for i, (n, _, accepted) in enumerate(result.steps):
        nodes += [(i, tokens[n + 1 + d], d - 1, True) for d in range(accepted)]
        if n in rejected:
            nodes.append((i, rejected[n], accepted - 1, False))
    node = torch.tensor([x[:3] for x in nodes], dtype=torch.long).reshape(-1, 3)
    accepted = torch.tensor([x[3] for x in nodes], dtype=torch.bool)
    return replace(
        trace, reject_root=rejects[:, 0], reject_depth=rejects[:, 1], reject_token=rejects[:, 2],
        reject_weight=torch.ones(len(rejects)), step_root=steps[:, 0], step_drafted=steps[:, 1], step_accepted=steps[:, 2],
        step_version=torch.full((len(steps),), version, dtype=torch.long), node_step=node[:, 0], node_token=node[:, 1],
        node_parent=node[:, 2], node_accepted=accepted, node_draft_prob=torch.ones(len(nodes)), node_target_prob=accepted.float(),
        sampling=(0.0, 0, 1.0),
    )


# ---- the target-trace cache -----------------------------------------------------------------------------------
def trace_cache_dir(home: Path, model_dir: Path, max_tokens: int, taps: tuple[int, ...]) -> Path:
    key = hashlib.sha256(json.dumps([str(model_dir), max_tokens, list(taps), TRACE_SCHEMA]).encode()).hexdigest()[:16]
    return home / "replay" / f"{model_dir.name}-{key}"


def target_traces(
    target, prompts: dict[str, list[int]], max_tokens: int, taps: tuple[int, ...], cache: Path | None = None, batch_size: int = 16,
    shard_prompts: int = 256,
) -> dict[str, SequenceTrace]:
    """Greedy target continuations with hidden states, keyed by prompt key; cached as Parquet shards, one per
    `shard_prompts` prompts generated, so an interrupted run keeps what it finished."""
    if cache is None:
        return _generate_traces(target, prompts, max_tokens, taps, batch_size)
    fill_trace_cache(target, prompts, max_tokens, taps, cache, batch_size, shard_prompts)
    return {t.request_id: t for t in load_traces(cache) if t.request_id in prompts}


def cached_trace_ids(cache: Path) -> set[str]:
    """The prompt keys whose traces `cache` holds (reads one column, not the hidden states)."""
    import pyarrow.parquet as pq

    return {key for shard in sorted(Path(cache).glob("traces-*.parquet")) for key in pq.read_table(shard, columns=["request_id"]).column(0).to_pylist()}


def fill_trace_cache(
    target, prompts: dict[str, list[int]], max_tokens: int, taps: tuple[int, ...], cache: Path, batch_size: int = 16, shard_prompts: int = 256,
) -> int:
    """Generate the traces of the `prompts` that `cache` lacks, a shard per `shard_prompts`; returns how many were
    generated. Several processes may fill one cache at once with disjoint prompts (shard names are unique)."""
    have = cached_trace_ids(cache) if cache.is_dir() else set()
    missing = [key for key in prompts if key not in have]
    for first in range(0, len(missing), shard_prompts):
        fresh = _generate_traces(target, {key: prompts[key] for key in missing[first : first + shard_prompts]}, max_tokens, taps, batch_size)
        cache.mkdir(parents=True, exist_ok=True)
        write_shard(cache / f"traces-{len(list(cache.glob('traces-*.parquet'))):06d}-{os.getpid()}-{time.time_ns()}.parquet", list(fresh.values()))
    return len(missing)


def _generate_traces(target, prompts: dict[str, list[int]], max_tokens: int, taps: tuple[int, ...], batch_size: int) -> dict[str, SequenceTrace]:
    from tandem.config import EngineConfig, SamplingParams
    from tandem.engine.engine import Engine

    longest = max(len(p) for p in prompts.values()) + max_tokens + 1
    config = EngineConfig(max_batch_size=batch_size, max_model_len=min(longest, target.cfg.max_position), record_steps=True, record_topk=0, hidden_taps=taps)
    engine = Engine(target, config)
    assembler = TraceAssembler(branch_depth=0, max_inflight=len(prompts) + 1)
    done: dict[str, SequenceTrace] = {}
    engine.observers.append(lambda record: done.update((t.request_id, t) for t in assembler.add(record)))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    for key, ids in prompts.items():
        engine.add_request(ids, params, request_id=key)
    with tqdm(total=len(prompts), desc="target traces", unit="req", disable=None) as bar:
        while engine.has_unfinished():
            before = len(done)
            engine.step()
            bar.update(len(done) - before)
    return done
