"""Random traffic through the chunked engine with an EAGLE drafter: arrivals, duplicate prompts, requests that end at
their first token, aborts between steps and prefills that raise (alone or packed). After every step the rows are
contiguous and the drafter holds state for exactly the running rows; every request ends."""
import random

import pytest

from tandem.config import EngineConfig, SamplingParams
from tandem.drafters import build_drafter
from tandem.engine.engine import Engine
from tandem.models.loader import load_transformer


class FailingOnce:
    """The target; once armed, the next prefill (alone or packed) of a prompt starting with token 7 raises."""

    def __init__(self, model):
        self.model, self.armed = model, False

    def __call__(self, ids, *args, **kwargs):
        if self.armed and kwargs.get("last_only") and ids.tolist()[0][0] == 7:
            self.armed = False
            raise RuntimeError("injected prefill fault")
        return self.model(ids, *args, **kwargs)

    def forward_packed(self, prompts, *args, **kwargs):
        if self.armed and any(p[0] == 7 for p in prompts):
            raise RuntimeError("injected packed prefill fault")
        return self.model.forward_packed(prompts, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.model, name)


@pytest.mark.parametrize("seed", range(4))
def test_random_traffic_keeps_rows_and_drafter_state_consistent(tiny_llama, seed):
    rng = random.Random(seed)
    model = load_transformer(tiny_llama)
    model.pack()
    drafter = build_drafter("eagle", target=model, num_draft_tokens=3, max_batch=8, max_len=160)
    engine = Engine(model, EngineConfig(max_batch_size=8, max_model_len=128, prefill_chunk_tokens=96), drafter=drafter)
    engine.model = FailingOnce(engine.model)
    pool = [[rng.randrange(20, 250) for _ in range(rng.choice([5, 40, 50, 70]))] for _ in range(5)]
    ids = []
    for step in range(80):
        for _ in range(rng.choice([0, 0, 1, 2, 3]) if step < 60 else 0):
            prompt = list(rng.choice(pool))
            if rng.random() < 0.15:
                prompt, engine.model.armed = [7] + prompt, True
            params = SamplingParams(max_tokens=rng.randint(1, 10), temperature=rng.choice([0.0, 0.8]), seed=rng.randrange(1000))
            ids.append(engine.add_request(prompt, params))
        if ids and rng.random() < 0.15:
            engine.abort(rng.choice(ids))  # a client gone: waiting, prefilling, running or already finished
        engine.step()
        assert [r.row for r in engine.running] == list(range(len(engine.running)))
        assert sorted(drafter.pending) == [r.row for r in engine.running]
    while engine.has_unfinished():
        engine.step()
    assert not engine.running and not drafter.pending and len(ids) > 40
