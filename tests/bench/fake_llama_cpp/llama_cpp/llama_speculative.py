import abc


class LlamaDraftModel(abc.ABC):
    @abc.abstractmethod
    def __call__(self, input_ids, **kwargs):
        raise NotImplementedError()


class LlamaPromptLookupDecoding(LlamaDraftModel):
    """Fake lookup: proposes the next two tokens right, then a wrong one (at most num_pred_tokens)."""

    def __init__(self, max_ngram_size: int = 2, num_pred_tokens: int = 10):
        self.num_pred_tokens = num_pred_tokens

    def __call__(self, input_ids, **kwargs):
        last = int(input_ids[-1])
        return [last + 1, last + 2, 0][: self.num_pred_tokens]
