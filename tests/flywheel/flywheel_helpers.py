"""Shared set-up of the flywheel tests (tiny models, eagle engines)."""
from tandem.config import EngineConfig
from tandem.drafters import build_drafter
from tandem.engine.engine import Engine

from tiny_helpers import GREEDY, load_packed as load_target, make_prompts, plain_outputs

__all__ = ["GREEDY", "load_target", "make_prompts", "plain_outputs", "eagle_engine", "save_shared_head", "served_traces", "serve", "serve_past_a_publish"]


def eagle_engine(target, batch=4, record=True, drafter_path=None, k=4, **config):
    drafter = build_drafter("eagle", target=target, num_draft_tokens=k, max_batch=batch, max_len=256, draft_vocab_size=200, drafter_path=drafter_path,
                            min_confidence=0.0)  # full chains, as the flywheel's drafters draft and replay models
    return Engine(target, EngineConfig(max_batch_size=batch, max_model_len=256, record_steps=record, **config), drafter=drafter)


def save_shared_head(target, out_dir) -> str:
    """A saved untrained head (draft vocabulary 200) whose LM head is the target's rows, frozen (shared_lm_head, as
    every recipe-trained head): pass it as eagle_engine's drafter_path."""
    import torch

    from tandem.models.eagle import EagleConfig, draft_vocab_from_tokens, new_eagle_head, save_eagle

    cfg = EagleConfig.for_target(target.cfg, 200, shared_lm_head=True)
    head = new_eagle_head(target, cfg, draft_vocab_from_tokens([], 200, target.cfg.vocab_size), torch.Generator().manual_seed(0))
    return str(save_eagle(head, out_dir))


def served_traces(target, n=4, seed=0, params=GREEDY, engine=None, branch_depth=1):
    """Serve n prompts with an eagle engine and return the finished requests' traces."""
    from tandem.flywheel.traces import TraceCollector

    engine = engine or eagle_engine(target)
    traces = []
    collector = TraceCollector(traces.append, branch_depth=branch_depth)
    engine.observers.append(collector)
    engine.run(make_prompts(n, seed), [params] * n)
    collector.flush()
    collector.close()
    engine.observers.remove(collector)
    return traces


def serve(flywheel, prompts, params):
    """Serve the prompts to completion through the flywheel's step; returns the requests."""
    engine = flywheel.engine
    for prompt in prompts:
        engine.add_request(prompt, params)
    requests = list(engine.waiting)
    while engine.has_unfinished():
        flywheel.step()
    return requests


def serve_past_a_publish(flywheel, target):
    """Serve until the trainer has published a version, then 4 more prompts, whose greedy outputs must equal
    plain decoding (whatever versions served them); returns those requests."""
    from tandem.flywheel.trainer import wait_for

    serve(flywheel, make_prompts(4, seed=5), GREEDY)
    assert wait_for(lambda: flywheel.trainer.published is not None, timeout=60)
    later = make_prompts(4, seed=6)
    requests = serve(flywheel, later, GREEDY)
    assert [r.output_ids for r in requests] == plain_outputs(target, later, [GREEDY] * 4)
    return requests
