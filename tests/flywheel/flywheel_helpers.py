"""Shared set-up of the flywheel tests (tiny models, eagle engines)."""
import torch

from tandem.config import EngineConfig, SamplingParams
from tandem.drafters import build_drafter
from tandem.engine.engine import Engine
from tandem.models.loader import load_transformer

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def make_prompts(n=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (int(length),), generator=gen).tolist() for length in torch.randint(4, 20, (n,), generator=gen)]


def load_target(path):
    model = load_transformer(path)
    model.pack()
    return model


def eagle_engine(target, batch=4, record=True, drafter_path=None, k=4, **config):
    drafter = build_drafter("eagle", target=target, num_draft_tokens=k, max_batch=batch, max_len=256, draft_vocab_size=200, drafter_path=drafter_path)
    return Engine(target, EngineConfig(max_batch_size=batch, max_model_len=256, record_steps=record, **config), drafter=drafter)


def plain_outputs(target, prompts, params):
    return [r.output_ids for r in Engine(target, EngineConfig(max_batch_size=4, max_model_len=256)).run(prompts, params)]




def served_traces(target, n=4, seed=0, params=GREEDY, engine=None):
    """Serve n prompts with an eagle engine and return the finished requests' traces."""
    from tandem.flywheel.traces import TraceCollector

    engine = engine or eagle_engine(target)
    traces = []
    collector = TraceCollector(traces.append)
    engine.observers.append(collector)
    engine.run(make_prompts(n, seed), [params] * n)
    collector.flush()
    collector.close()
    engine.observers.remove(collector)
    return traces
