"""The vLLM-style entry point: LLM(model=...).generate(prompts, SamplingParams(...)).

This is the edge: it owns the tokenizer, applies chat templates, detokenizes and cuts stop strings.
The engine underneath sees token ids only.
"""
from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tandem.config import WEIGHTS, EngineConfig, SamplingParams
from tandem.engine.calibrate import CalibrationGrid, calibrate, calibration_path, measure_options
from tandem.engine.engine import Engine
from tandem.engine.request import Request
from tandem.errors import InvalidParameterError, ModelLoadError
from tandem.models.loader import load_transformer
from tandem.models.zoo import DEFAULT_MODEL, resolve_model
from tandem.sim.calibration import Calibration, save_calibration

DEFAULT_MAX_MODEL_LEN = 2048  # KV cache per request unless max_model_len says otherwise
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str
    metrics: dict = field(default_factory=dict)


class LLM:
    """Load a model (zoo name or local HF-format directory) and generate with optional speculation."""

    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        drafter: str | None = None,
        num_draft_tokens: int = 4,
        drafter_model: str | None = None,
        drafter_path: str | None = None,
        adaptive_k: bool = False,
        max_batch_size: int = 8,
        max_model_len: int | None = None,
        dtype: str = "float32",
        device: str = "cpu",
        num_threads: int | None = None,
        pack_weights: bool = True,
        compile: bool = False,
        weights: str = "fp32",
    ):
        if dtype not in DTYPES:
            raise InvalidParameterError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        self.model_name = str(model)  # the calibration record is looked up by this name
        self.model_dir = resolve_model(model)
        self.tokenizer = load_tokenizer(self.model_dir)
        self.target = load_transformer(self.model_dir, DTYPES[dtype], device)
        self.device = device
        max_len = min(max_model_len or DEFAULT_MAX_MODEL_LEN, self.target.cfg.max_position)
        self.config = EngineConfig(max_batch_size=max_batch_size, max_model_len=max_len, num_threads=num_threads, pack_weights=pack_weights,
                                   compile=compile, weights=weights)
        if pack_weights:
            self.target.pack(gemm=WEIGHTS[weights])
        self.engine = self._make_engine(drafter, num_draft_tokens, drafter_model, drafter_path, adaptive_k)
        if drafter and dtype != "float32":
            warnings.warn(
                f"speculative decoding with a {dtype} target is not bit-exact: a k-token verify and 1-token steps round "
                "differently (attention, and single-row GEMMs), so outputs can differ from plain decoding of the same "
                f"{dtype} model (docs/BENCHMARKS.md 1.3); float32 is the exact mode", stacklevel=2)

    def _make_engine(self, drafter, num_draft_tokens, drafter_model, drafter_path, adaptive_k, **drafter_options) -> Engine:
        draft, policy = None, None
        options = dict(drafter_model=drafter_model, drafter_path=drafter_path, device=self.device, **drafter_options)
        if drafter:
            from tandem.drafters import build_drafter

            draft = build_drafter(drafter, target=self.target, num_draft_tokens=num_draft_tokens, max_batch=self.config.max_batch_size,
                                  max_len=self.config.max_model_len, **options)
        if adaptive_k and draft is not None:
            from tandem.engine.control import SpeculationController

            factory = calibration_drafter_factory(drafter, self.target, num_draft_tokens, **options)  # the served drafter's options
            policy = SpeculationController.for_engine(self.target, draft, model_name=self.model_name, max_k=num_draft_tokens,
                                                      drafter_factory=factory)
        return Engine(self.target, self.config, drafter=draft, draft_policy=policy)

    def with_drafter(self, drafter: str | None, num_draft_tokens: int = 4, drafter_model: str | None = None,
                     drafter_path: str | None = None, adaptive_k: bool = False, **drafter_options) -> "LLM":
        """A second LLM over the same loaded target and tokenizer, with another drafter (benchmarks); drafter_options go
        to the drafter's builder (e.g. eagle_tree's max_nodes, tree_topk, tree_depth)."""
        other = object.__new__(LLM)
        other.__dict__.update(self.__dict__)
        other.engine = self._make_engine(drafter, num_draft_tokens, drafter_model, drafter_path, adaptive_k, **drafter_options)
        return other

    # ---- generation ---------------------------------------------------------------------------------
    def generate(
        self,
        prompts: str | list[int] | list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        tags: list[dict] | None = None,
    ) -> list[RequestOutput]:
        prompts = _as_prompt_list(prompts)
        params_list = _as_params_list(params, len(prompts))
        token_lists = [self._encode(p) for p in prompts]
        start = time.perf_counter()
        requests = self._run(token_lists, params_list, tags)
        wall = time.perf_counter() - start
        return [self._output(p, r, wall) for p, r in zip(prompts, requests)]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        return self.generate([self.apply_chat_template(c) for c in conversations], params)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise InvalidParameterError(f"model {self.model_dir.name} has no chat template")
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def _encode(self, prompt: str | list[int]) -> list[int]:
        return self.tokenizer.encode(prompt, add_special_tokens=False) if isinstance(prompt, str) else list(prompt)

    def _run(self, token_lists: list[list[int]], params_list: list[SamplingParams], tags) -> list[Request]:
        engine = self.engine
        first = len(engine.waiting)
        for i, (ids, sp) in enumerate(zip(token_lists, params_list)):  # validate everything before queueing anything
            engine.validate(ids, sp)
        for i, (ids, sp) in enumerate(zip(token_lists, params_list)):
            engine.add_request(ids, sp, tags=tags[i] if tags else None)
        requests = list(engine.waiting)[first:]
        by_id = {r.request_id: r for r in requests}
        while engine.has_unfinished():
            for out in engine.step():
                request = by_id.get(out.request_id)
                if request is not None and not out.finished and request.params.stop and self._hit_stop_string(request):
                    engine.abort(request.request_id)
        return requests

    def _hit_stop_string(self, request: Request) -> bool:
        return self._stop_in(request.output_ids, request.params) is not None

    def _stop_in(self, token_ids: list[int], params: SamplingParams) -> int | None:
        """Where the text of `token_ids` ends at its first stop string (`stop_cut`), or None."""
        if len(token_ids) <= params.min_tokens:
            return None
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        floor = len(self.tokenizer.decode(token_ids[: params.min_tokens], skip_special_tokens=True)) if params.min_tokens else 0
        return stop_cut(text, params.stop, floor, params.include_stop_str_in_output)

    def _output(self, prompt, request: Request, wall: float) -> RequestOutput:
        text = self.tokenizer.decode(request.output_ids, skip_special_tokens=True)
        token_ids, reason = list(request.output_ids), request.finish_reason.value
        cut = self._stop_in(token_ids, request.params)
        if cut is not None:
            text, reason = text[:cut], "stop"
            token_ids = self._tokens_for_text(token_ids, cut)
        elif reason == "abort":
            reason = "stop"
        metrics = request.metrics.as_dict() | {"wall_time_s": round(wall, 4)}
        return RequestOutput(request.request_id, prompt if isinstance(prompt, str) else None, request.prompt_ids, text, token_ids, reason, metrics)

    def _tokens_for_text(self, token_ids: list[int], cut: int) -> list[int]:
        """The shortest token prefix whose text reaches the stop string's position."""
        for n in range(len(token_ids) + 1):
            if len(self.tokenizer.decode(token_ids[:n], skip_special_tokens=True)) >= cut:
                return token_ids[:n]
        return token_ids


# ---- calibration: composition (which target, which drafters) lives here; engine.calibrate measures and fits -------
def calibration_drafter_factory(name: str, target, num_draft_tokens: int, **options) -> Callable:
    """A factory building drafter `name` over `target` with its own options (head path, tree shape, ...), sized and
    set as calibration measures drafters (engine.calibrate.measure_options)."""
    from tandem.drafters import build_drafter

    return lambda: build_drafter(name, target=target, num_draft_tokens=num_draft_tokens, **(options | measure_options()))


def calibrate_model(model_name: str, drafter_names: tuple[str, ...] = (), quick: bool = False, json_out: str | None = None,
                    drafter_path: str | None = None, store: bool = True) -> Calibration:
    """`tandem calibrate`: load the model (zoo name or directory), measure, fit, store (and write json_out)."""
    target = load_transformer(resolve_model(model_name))
    target.pack()
    k = max(CalibrationGrid.for_mode(quick).draft_ks)
    factories = {name: calibration_drafter_factory(name, target, k, drafter_path=drafter_path) for name in drafter_names}
    record = calibrate(target, model_name, factories, quick)
    if store:
        save_calibration(record, calibration_path(model_name))
    if json_out:
        save_calibration(record, json_out)
    return record


def load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot load the tokenizer from {model_dir}: {e}") from e


def stop_cut(text: str, stops: tuple[str, ...], floor: int = 0, include: bool = False, start: int = 0) -> int | None:
    """Where `text` ends at its first stop string (found at or after `start`), None if none: the match's start, or its
    end with `include` (include_stop_str_in_output). A match counts only if it ends after `floor`, the text of the
    first min_tokens tokens (vLLM does not look for stop strings before min_tokens are emitted)."""
    hits = []
    for stop in stops:
        at = text.find(stop, max(start, floor - len(stop) + 1, 0))
        if at >= 0:
            hits.append((at, at + len(stop)))
    if not hits:
        return None
    first = min(hits)
    return first[1] if include else first[0]


def _as_prompt_list(prompts) -> list:
    if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise InvalidParameterError("prompts must be a string, a token-id list, or a non-empty list of those")
    return list(prompts)


def _as_params_list(params, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise InvalidParameterError(f"got {len(params)} SamplingParams for {n} prompts")
    return list(params)
