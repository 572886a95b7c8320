"""Set-up shared by tests that serve random prompts on the tiny models (importable from any test dir)."""
import torch

from tandem.config import EngineConfig, SamplingParams
from tandem.engine.engine import Engine
from tandem.models.loader import load_transformer

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def make_prompts(n=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (int(length),), generator=gen).tolist() for length in torch.randint(4, 20, (n,), generator=gen)]


def load_packed(path):
    model = load_transformer(path)
    model.pack()
    return model


def plain_outputs(target, prompt_ids, params):
    """Plain greedy/sampled decoding of the prompts (target: a loaded model or a model directory)."""
    model = load_packed(target) if isinstance(target, str) else target
    return [r.output_ids for r in Engine(model, EngineConfig(max_batch_size=4, max_model_len=256)).run(prompt_ids, params)]
