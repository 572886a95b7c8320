"""Target features on disk: teacher-forced forwards written as fp16 safetensors shards, streamed back.

A document is a chat-rendered prompt + answer. One target forward over it (no KV cache, logits only at the
last position) gives, at every position t, the tapped hidden states (EAGLE's input feature f_t) and the
final hidden state, from which the trainer recomputes the target's distribution over the draft vocabulary.

Layout of a feature directory:
    index.json          schema version, target identity, taps, the shards and the keys of documents written
    shard-00000.safetensors
        tokens    [N] int32        every document's ids, concatenated
        taps      [N, 3 d] fp16    tapped hidden states (low, mid, high)
        final     [N, d] fp16      hidden state after the target's final norm
        doc_start [D + 1] int64    document boundaries in the concatenation
        prompt_len [D] int64       prompt tokens per document (the answer starts there)
        domain    [D] int64        index into index.json's `domains`
Shards are written to a temporary name and renamed, then the index is replaced atomically, so an
interrupted run resumes after the last complete shard (documents are keyed by kind/source/id).
"""
from __future__ import annotations

import json
import os
import random
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from tandem.errors import InvalidParameterError, ModelLoadError
from tandem.models.transformer import Transformer

SCHEMA_VERSION = 1
INDEX_FILE = "index.json"
DOMAIN_NAMES = ("code", "sql", "math", "chat", "translation")


@dataclass
class FeatureDoc:
    """One document and what the target computed over it (CPU tensors)."""

    key: str  # kind/source/id: unique within a feature directory
    domain: str
    tokens: torch.Tensor  # [L] long
    prompt_len: int
    taps: torch.Tensor  # [L, 3 d] fp16
    final: torch.Tensor  # [L, d] fp16


@torch.inference_mode()
def target_features(target: Transformer, tokens: list[int], taps: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:  # [L, 3d], [L, d] fp16
    out = target(torch.tensor([tokens]), taps=taps, last_only=True)
    return torch.cat([h[0] for h in out.hidden], dim=-1).half(), out.final_hidden[0].half()


# ---- writing --------------------------------------------------------------------------------------------
class ShardWriter:
    """Accumulates documents and writes a shard every `shard_tokens` tokens; resumable by document key."""

    def __init__(self, directory: str | Path, target_id: str, taps: tuple[int, ...], shard_tokens: int = 32768, wait: bool = False):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock = _exclusive_lock(self.dir / ".writer.lock", wait)
        self.shard_tokens = shard_tokens
        self.index = read_index(self.dir) if (self.dir / INDEX_FILE).exists() else new_index(target_id, taps)
        if self.index["target_id"] != target_id or tuple(self.index["taps"]) != tuple(taps):
            raise InvalidParameterError(f"{self.dir} holds features of target {self.index['target_id']} taps {self.index['taps']}, not {target_id} taps {taps}")
        self.done = set(self.index["keys"])
        self.pending: list[FeatureDoc] = []

    def has(self, key: str) -> bool:
        return key in self.done or any(d.key == key for d in self.pending)

    def add(self, doc: FeatureDoc) -> None:
        self.pending.append(doc)
        if sum(len(d.tokens) for d in self.pending) >= self.shard_tokens:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        name = f"shard-{len(self.index['shards']):05d}.safetensors"
        _save_atomic(self.dir / name, _shard_tensors(self.pending, self.index["domains"]))
        self.index["shards"].append(_shard_entry(name, self.pending))
        self.index["keys"].extend(d.key for d in self.pending)
        self.done.update(d.key for d in self.pending)
        _write_json_atomic(self.dir / INDEX_FILE, self.index)
        self.pending = []


def _exclusive_lock(path: Path, wait: bool = False):
    """One writer per feature directory: a second process would write shards under the same names. With
    `wait` a second writer blocks until the first is done instead of failing."""
    import fcntl

    handle = open(path, "w")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except BlockingIOError:
        handle.close()
        raise InvalidParameterError(f"another process is writing features into {path.parent}") from None
    return handle


def new_index(target_id: str, taps: tuple[int, ...]) -> dict:
    return {"schema_version": SCHEMA_VERSION, "target_id": target_id, "taps": list(taps), "domains": list(DOMAIN_NAMES), "shards": [], "keys": []}


def read_index(directory: str | Path) -> dict:
    path = Path(directory) / INDEX_FILE
    try:
        index = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read feature index {path}: {e}") from e
    if index.get("schema_version") != SCHEMA_VERSION:
        raise ModelLoadError(f"{path} has schema version {index.get('schema_version')}, expected {SCHEMA_VERSION}")
    return index


def _shard_tensors(docs: list[FeatureDoc], domains: list[str]) -> dict[str, torch.Tensor]:
    for d in docs:
        if d.domain not in domains:
            domains.append(d.domain)
    lengths = torch.tensor([len(d.tokens) for d in docs])
    return {
        "tokens": torch.cat([d.tokens for d in docs]).int(),
        "taps": torch.cat([d.taps for d in docs]).half(),
        "final": torch.cat([d.final for d in docs]).half(),
        "doc_start": torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
        "prompt_len": torch.tensor([d.prompt_len for d in docs], dtype=torch.long),
        "domain": torch.tensor([domains.index(d.domain) for d in docs], dtype=torch.long),
    }


def _shard_entry(name: str, docs: list[FeatureDoc]) -> dict:
    per_domain: dict[str, int] = {}
    answer: dict[str, int] = {}
    for d in docs:
        per_domain[d.domain] = per_domain.get(d.domain, 0) + len(d.tokens)
        answer[d.domain] = answer.get(d.domain, 0) + len(d.tokens) - d.prompt_len
    kinds = sorted({d.key.split("/", 1)[0] for d in docs})
    return {"file": name, "docs": len(docs), "tokens": sum(per_domain.values()), "tokens_per_domain": per_domain, "answer_tokens_per_domain": answer, "kinds": kinds}


def _save_atomic(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    tmp = path.with_name(path.name + ".tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
    os.replace(tmp, path)


def _write_json_atomic(path: Path, data: dict) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


# ---- the two producers ------------------------------------------------------------------------------------
@dataclass
class ProduceStats:
    docs: int = 0
    tokens: int = 0
    seconds: float = 0.0
    per_domain: dict[str, int] = field(default_factory=dict)

    def add(self, domain: str, tokens: int) -> None:
        self.docs += 1
        self.tokens += tokens
        self.per_domain[domain] = self.per_domain.get(domain, 0) + tokens

    def as_dict(self) -> dict:
        return {"docs": self.docs, "tokens": self.tokens, "seconds": round(self.seconds, 1), "tokens_per_s": round(self.tokens / max(self.seconds, 1e-9), 1), "tokens_per_domain": self.per_domain}


def doc_key(doc) -> str:
    return f"{doc.kind}/{doc.source}/{doc.id}"


def write_reference_features(writer: ShardWriter, target: Transformer, tokenizer, docs, max_len: int) -> ProduceStats:
    """Teacher-forced features of documents whose answer exists (prefill speed)."""
    stats, start = ProduceStats(), time.perf_counter()
    todo = [d for d in docs if not writer.has(doc_key(d))]
    with tqdm(total=len(todo), desc="reference features", unit="doc", disable=None) as bar:
        for doc in todo:
            prompt_ids, ids = chat_pair_ids(tokenizer, doc.prompt, doc.answer)
            ids = ids[:max_len]
            if len(ids) - len(prompt_ids) >= 2:
                taps, final = target_features(target, ids, writer.index["taps"])
                writer.add(FeatureDoc(doc_key(doc), doc.domain, torch.tensor(ids), len(prompt_ids), taps, final))
                stats.add(doc.domain, len(ids))
            bar.update()
            stats.seconds = time.perf_counter() - start
            bar.set_postfix(tok_s=f"{stats.tokens / max(stats.seconds, 1e-9):.0f}")
    writer.flush()
    return stats


def write_regenerated_features(writer: ShardWriter, target: Transformer, tokenizer, docs, max_new_tokens: int, batch_size: int = 16, chunk: int = 64) -> ProduceStats:
    """The target's own greedy answers (batched decoding), then one teacher-forced forward each."""
    from tandem.data.prompts import Prompt, render_chat

    stats, start = ProduceStats(), time.perf_counter()
    todo = [d for d in docs if not writer.has(doc_key(d))]
    with tqdm(total=len(todo), desc="regenerated features", unit="doc", disable=None) as bar:
        for i in range(0, len(todo), chunk):
            part = todo[i : i + chunk]
            prompts = render_chat([Prompt(d.domain, d.prompt) for d in part], tokenizer)
            answers = greedy_answers(target, prompts, max_new_tokens, batch_size)
            for doc, prompt_ids, answer in zip(part, prompts, answers):
                ids = prompt_ids + answer
                taps, final = target_features(target, ids, writer.index["taps"])
                writer.add(FeatureDoc(doc_key(doc), doc.domain, torch.tensor(ids), len(prompt_ids), taps, final))
                stats.add(doc.domain, len(ids))
            writer.flush()  # a chunk is expensive to regenerate: never lose one
            bar.update(len(part))
            stats.seconds = time.perf_counter() - start
            bar.set_postfix(tok_s=f"{stats.tokens / max(stats.seconds, 1e-9):.0f}")
    return stats


def greedy_answers(target: Transformer, prompts: list[list[int]], max_new_tokens: int, batch_size: int) -> list[list[int]]:
    from tandem.config import EngineConfig, SamplingParams
    from tandem.engine.engine import Engine

    max_len = min(max(len(p) for p in prompts) + max_new_tokens + 1, target.cfg.max_position)
    engine = Engine(target, EngineConfig(max_batch_size=batch_size, max_model_len=max_len))
    params = SamplingParams(max_tokens=max_new_tokens, temperature=0.0)
    return [r.output_ids for r in engine.run(prompts, [params] * len(prompts))]


def chat_pair_ids(tokenizer, prompt: str, answer: str) -> tuple[list[int], list[int]]:
    """(prompt ids ending with the assistant header, prompt + answer + end-of-turn ids)."""
    user = [{"role": "user", "content": prompt}]
    prompt_ids = list(tokenizer.apply_chat_template(user, add_generation_prompt=True, tokenize=True, return_dict=False))
    full = list(tokenizer.apply_chat_template(user + [{"role": "assistant", "content": answer}], tokenize=True, return_dict=False))
    if full[: len(prompt_ids)] != prompt_ids:  # templates that re-render the prefix differently: fall back to plain concatenation
        full = prompt_ids + list(tokenizer.encode(answer, add_special_tokens=False)) + [tokenizer.eos_token_id]
    return prompt_ids, full


# ---- reading: shards streamed as packed rows -----------------------------------------------------------------
@dataclass
class PackedBatch:
    """Documents packed end to end into rows; segment 0 marks padding."""

    tokens: torch.Tensor  # [B, L] long
    taps: torch.Tensor  # [B, L, 3 d] fp16
    final: torch.Tensor  # [B, L, d] fp16
    segment: torch.Tensor  # [B, L] long: 1.. per document within a row, 0 = pad
    position: torch.Tensor  # [B, L] long: position inside the document (RoPE)
    answer: torch.Tensor  # [B, L] bool: position t+1 is an answer token (t's next token is generated text)
    domain: torch.Tensor  # [B, L] long: domain index per position (-1 = pad)

    @property
    def num_tokens(self) -> int:
        return int((self.segment > 0).sum())


class FeatureStream:
    """Random packed batches over one or more feature directories, one shard in memory at a time."""

    def __init__(self, directories: list[str | Path], target_id: str, domains: tuple[str, ...] | None = None):
        self.shards: list[tuple[Path, dict, list[str]]] = []
        for d in directories:
            index = read_index(d)
            if index["target_id"] != target_id:
                raise ModelLoadError(f"{d} holds features of target {index['target_id']}, not {target_id}")
            self.shards += [(Path(d) / s["file"], s, index["domains"]) for s in index["shards"]]
        if not self.shards:
            raise InvalidParameterError(f"no feature shards in {directories}")
        self.domains = domains

    @property
    def tokens(self) -> int:
        return sum(s["tokens"] for _, s, _ in self.shards)

    def batches(self, rows: int, row_len: int, rng: random.Random) -> Iterator[PackedBatch]:
        """Endless: shards in a fresh random order each pass, documents shuffled within a shard."""
        while True:
            for path, _, names in rng.sample(self.shards, len(self.shards)):
                docs = shard_docs(path, names, self.domains)
                rng.shuffle(docs)
                yield from pack_documents(docs, rows, row_len)


def shard_docs(path: Path, names: list[str], domains: tuple[str, ...] | None) -> list[dict]:
    from safetensors.torch import load_file

    t = load_file(str(path))
    starts = t["doc_start"].tolist()
    docs = []
    for i in range(len(starts) - 1):
        name = names[int(t["domain"][i])]
        if domains is not None and name not in domains:
            continue
        a, b = starts[i], starts[i + 1]
        docs.append({"tokens": t["tokens"][a:b].long(), "taps": t["taps"][a:b], "final": t["final"][a:b], "prompt_len": int(t["prompt_len"][i]), "domain": DOMAIN_NAMES.index(name) if name in DOMAIN_NAMES else len(DOMAIN_NAMES)})
    return docs


def pack_documents(docs: list[dict], rows: int, row_len: int) -> Iterator[PackedBatch]:
    """First-fit packing of whole documents (cut to row_len) into `rows` rows per batch."""
    current: list[list[dict]] = []
    for doc in docs:
        if len(doc["tokens"]) > row_len:
            doc = {**doc, "tokens": doc["tokens"][:row_len], "taps": doc["taps"][:row_len], "final": doc["final"][:row_len]}
        for row in current:
            if sum(len(d["tokens"]) for d in row) + len(doc["tokens"]) <= row_len:
                row.append(doc)
                break
        else:
            if len(current) == rows:
                yield _collate(current, row_len)
                current = []
            current.append([doc])
    if current:
        yield _collate(current, row_len)


def _collate(rows: list[list[dict]], row_len: int) -> PackedBatch:
    b = len(rows)
    d3, d = rows[0][0]["taps"].shape[-1], rows[0][0]["final"].shape[-1]
    out = PackedBatch(
        tokens=torch.zeros(b, row_len, dtype=torch.long), taps=torch.zeros(b, row_len, d3, dtype=torch.float16),
        final=torch.zeros(b, row_len, d, dtype=torch.float16), segment=torch.zeros(b, row_len, dtype=torch.long),
        position=torch.zeros(b, row_len, dtype=torch.long), answer=torch.zeros(b, row_len, dtype=torch.bool),
        domain=torch.full((b, row_len), -1, dtype=torch.long),
    )
    for r, docs in enumerate(rows):
        at = 0
        for s, doc in enumerate(docs, 1):
            n = len(doc["tokens"])
            span = slice(at, at + n)
            out.tokens[r, span], out.taps[r, span], out.final[r, span] = doc["tokens"], doc["taps"], doc["final"]
            out.segment[r, span] = s
            out.position[r, span] = torch.arange(n)
            out.answer[r, span] = torch.arange(n) >= doc["prompt_len"] - 1
            out.domain[r, span] = doc["domain"]
            at += n
    return out
