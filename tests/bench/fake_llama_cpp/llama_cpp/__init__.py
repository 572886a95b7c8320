"""A stand-in for llama-cpp-python's interface (only what tandem/bench/peers/llama_worker.py calls), to test the worker's
protocol and its acceptance counting without a build of llama.cpp. Its "model" counts up: the greedy next token after
... t is t + 1 (t + 2 for a GGUF whose file name contains "skip", a model that disagrees with the others). Its logits after
... t (`eval`, kept per position only with logits_all, as llama-cpp-python keeps them): LOGIT_NEXT at that next token,
LOGIT_SAME at t itself, 0 elsewhere. Its vocabulary: 256 ids, EOS 255; for a GGUF whose file name contains "tiny", the
320 ids and EOS 258 of tandem.models.tiny's byte tokenizer (its ids 0..255 are the bytes, as here). File type: Q4_K_M
when the file name contains "q4", else Q8_0."""
import os

import numpy as np

LOGIT_NEXT, LOGIT_SAME = 2.0, 1.0
__version__ = "0.0-fake"
LLAMA_FTYPE_MOSTLY_Q8_0 = 7


def llama_model_ftype(model) -> int:
    return model["ftype"]


def llama_print_system_info() -> bytes:
    return b"fake: no CPU features\n"


class Llama:
    def __init__(self, model_path: str, draft_model=None, n_ctx: int = 512, n_batch: int = 512, logits_all: bool = False, **kwargs):
        name = os.path.basename(model_path)  # not the test's directory, whatever its name
        self.model = {"ftype": 15 if "q4" in name else 7}
        self.step = 2 if "skip" in name else 1
        self.vocab, self.eos = (320, 258) if "tiny" in name else (256, 255)
        self.draft_model = draft_model
        self.resets = 0
        self._logits_all = logits_all
        self.n_tokens = 0
        self.scores = np.zeros((n_ctx if logits_all else n_batch, self.n_vocab()), dtype=np.single)

    def reset(self):
        self.resets += 1
        self.n_tokens = 0

    def eval(self, tokens):
        """Appends `tokens` to the KV cache; with logits_all each one's logits go to its row of `scores`."""
        for token in tokens:
            if self._logits_all:
                row = self.scores[self.n_tokens]
                row[:] = 0.0
                row[(token + self.step) % self.n_vocab()] = LOGIT_NEXT
                row[token] = LOGIT_SAME
            self.n_tokens += 1

    def n_vocab(self) -> int:
        return self.vocab

    def token_eos(self) -> int:
        return self.eos

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
