"""A stand-in for llama-cpp-python's interface (only what tandem/bench/llama_worker.py calls), to test the worker's
protocol and its acceptance counting without a build of llama.cpp. Its "model" counts up: the greedy next token after
... t is t + 1 (t + 2 for a GGUF whose path contains "skip", a model that disagrees with the others)."""
__version__ = "0.0-fake"
LLAMA_FTYPE_MOSTLY_Q8_0 = 7


def llama_model_ftype(model) -> int:
    return model["ftype"]


def llama_print_system_info() -> bytes:
    return b"fake: no CPU features\n"


class Llama:
    def __init__(self, model_path: str, draft_model=None, **kwargs):
        self.model = {"ftype": 15 if "q4" in model_path else 7}
        self.step = 2 if "skip" in model_path else 1
        self.draft_model = draft_model
        self.resets = 0

    def reset(self):
        self.resets += 1

    def n_vocab(self) -> int:
        return 256

    def token_eos(self) -> int:
        return 255

    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = False) -> list:
        return list(text)

    def generate(self, tokens, reset=True, temp=0.8, top_k=40, **kwargs):
        """llama-cpp-python's loop: the prompt's next token, then per round the draft model's proposal verified greedily
        (drafted tokens yielded while they match, then the model's own token)."""
        assert temp == 0.0 and top_k == 1, "the worker decodes greedily"
        ids = list(tokens)
        ids.append(ids[-1] + self.step)
        yield ids[-1]
        while True:
            draft = [] if self.draft_model is None else [int(t) for t in self.draft_model(ids)]
            for token in draft:
                if token != ids[-1] + self.step:
                    break
                ids.append(token)
                yield token
            ids.append(ids[-1] + self.step)
            yield ids[-1]
