"""The engine on the compiled forward: greedy output token-identical to eager plain decoding (with and
without a drafter, batched and ragged), sampled output identical to the eager engine's for the same
seeds (so the losslessness tests of the eager path carry over), no recompilation once warm.

Fast tests capture the graph with dynamo's eager backend (padding, masks, cache writes, the engine
wiring); the slow ones build the real inductor graph through EngineConfig(compile=True)."""
import pytest
from torch._dynamo.utils import counters

from tandem.config import EngineConfig, SamplingParams
from tandem.drafters import build_drafter
from tandem.engine.engine import Engine
from tandem.models.compiled import CompiledForward
from tandem.models.loader import load_transformer

GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


def repetitive_prompts(n=4):
    base = [[11, 12, 13, 14, 15], [40, 41, 42], [7, 8, 9, 10], [90, 91, 92, 93, 94, 95]]
    return [(p + [3] + p + p[:2]) for p in base[:n]]


def engine(path, drafter=None, batch=4, compile=False, backend=None, k=4):
    model = load_transformer(path)
    model.pack()
    draft = build_drafter(drafter, target=model, num_draft_tokens=k, max_batch=batch, max_len=256) if drafter else None
    eng = Engine(model, EngineConfig(max_batch_size=batch, max_model_len=128, compile=compile), drafter=draft)
    if backend is not None:  # the compiled path without a C++ build
        eng.compiled = CompiledForward(model, eng.cache, eng.taps, backend=backend)
    return eng


def outputs(eng, prompts, params):
    return [r.output_ids for r in eng.run(prompts, params)]


@pytest.mark.parametrize("drafter", [None, "ngram", "self_draft"])  # self_draft writes its drafts into the compiled path's cache
def test_greedy_identity_on_the_compiled_path(tiny_dirs, drafter):
    prompts = repetitive_prompts()
    want = outputs(engine(tiny_dirs["llama"]), prompts, [GREEDY] * 4)
    eng = engine(tiny_dirs["llama"], drafter, backend="eager")
    assert outputs(eng, prompts, [GREEDY] * 4) == want
    assert eng.compiled.eager_calls == 0 and len(eng.compiled.compiled_shapes) >= 1


def test_sampled_outputs_equal_the_eager_engine(tiny_dirs):
    prompts = repetitive_prompts(3) * 2
    params = [SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=s) for s in range(6)]
    want = outputs(engine(tiny_dirs["qwen2"], "ngram", batch=3), prompts, params)
    assert outputs(engine(tiny_dirs["qwen2"], "ngram", batch=3, backend="eager"), prompts, params) == want


@pytest.mark.slow  # inductor builds <= 3 shapes (batch 1, 1-3 tokens): ~10 s each with the disk cache, minutes cold on a busy machine
def test_compile_switch_greedy_identity_and_no_recompilation(tiny_dirs):
    prompts = repetitive_prompts(2)
    want = outputs(engine(tiny_dirs["qwen3"], batch=1), prompts, [GREEDY] * 2)
    eng = engine(tiny_dirs["qwen3"], "ngram", batch=1, compile=True, k=2)
    if not eng.compiled.enabled:
        pytest.skip("no C++ compiler")
    assert outputs(eng, prompts, [GREEDY] * 2) == want
    graphs = counters["stats"]["unique_graphs"]
    assert outputs(eng, prompts, [GREEDY] * 2) == want  # the same shapes again: steady state
    assert counters["stats"]["unique_graphs"] == graphs
