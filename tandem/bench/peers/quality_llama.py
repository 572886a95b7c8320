"""llama.cpp's GGUFs as columns of `tandem bench quality` (`--peers llama --llama-gguf q8_0,shipped`).

Each GGUF runs in its own llama_worker.py child (the peer venv's llama-cpp-python, tandem/bench/peers/llama_peer.py), one
after another and after tandem's precisions (one model in memory at a time), on the same samples: the chat-rendered
prompt ids and tandem fp32's greedy continuation ids (the GGUF's tokenizer is checked to give tandem's ids). `score`
reads prompt + continuation teacher-forced (one eval, every position's logits); `plain` decodes the prompt greedily
for as many tokens as the longest continuation. A column is named after the GGUF's file type: `llama:Q8_0`,
`llama:Q4_K_M`.
"""
from __future__ import annotations

from pathlib import Path

from tandem.bench.peers.llama_peer import LlamaPeer, check_same_tokens, context_size, ensure_gguf, gguf_dir, llama_python
from tandem.bench.speculation.quality_metrics import Sample, forced_metrics, prefix_agreement


def prepare_ggufs(config, threads: int) -> tuple[Path, list[Path]]:
    """The peer venv's Python and every GGUF (a missing shipped / q8_0 one built now): before any model loads."""
    python = llama_python(config.llama_python)
    return python, [ensure_gguf(spec, config.model, "--llama-gguf", python, threads) for spec in config.llama_gguf]


def peer_rows(peer: LlamaPeer, samples: list[Sample], references: list[list[int]]) -> list[dict[str, float]]:
    """What `_measure` reports for a tandem precision, from the worker: teacher-forced metrics and greedy agreement."""
    max_tokens = max(len(s.continuation) for s in samples)
    rows = []
    for sample, reference in zip(samples, references):
        logprobs, argmax = peer.score(sample.prompt + sample.continuation)
        row = forced_metrics(logprobs, argmax, sample)
        output = peer.generate(sample.prompt, max_tokens, "plain").token_ids
        row["greedy_prefix_agreement"] = prefix_agreement(output[: len(reference)], reference)
        rows.append(row)
    return rows


def column_name(file_type: str, gguf: Path, taken) -> str:
    name = f"llama:{file_type}"
    return name if name not in taken else f"{name}:{gguf.name}"


def llama_columns(python: Path, ggufs: list[Path], samples: list[Sample], tokenizer, eos: list[int], threads: int):
    """Per GGUF, its column name -> (rows per sample, what ran), one worker at a time."""
    n_ctx = context_size([s.prompt for s in samples], max(len(s.continuation) for s in samples), 0)
    references = [s.continuation for s in samples]
    columns = {}
    for gguf in ggufs:
        peer = LlamaPeer(python, gguf, threads, eos, n_ctx, num_pred_tokens=0, score=True)
        try:
            check_same_tokens(peer, tokenizer, eos)
            rows = peer_rows(peer, samples, references)
        finally:
            peer.close()
        info = {"version": peer.ready["ready"], "gguf": str(gguf), "file_type": peer.ready["file_type"], "n_ctx": n_ctx,
                "threads": threads, "system_info": peer.ready["system_info"]}
        columns[column_name(peer.ready["file_type"], gguf, columns)] = (rows, info)
    return columns


def llama_notes(model: str, columns: dict[str, dict]) -> list[str]:
    """What a reader must know to read a GGUF column against tandem's fp32 (zoo models are GGUFs dequantized to fp32)."""
    from tandem.models.zoo import ZOO

    if model not in ZOO:
        return []
    shipped, q8_0 = gguf_dir() / f"{model}.gguf", gguf_dir() / f"{model}.Q8_0.gguf"
    notes = []
    for name, info in columns.items():
        path = Path(info["gguf"])
        if path == shipped:
            notes.append(f"{name} is the GGUF the zoo ships for {model}, the very weights tandem's fp32 model is dequantized "
                         "from: its delta against fp32 is ~0 by construction (what is left is llama.cpp's arithmetic, e.g. "
                         "activations rounded to 8 bits in its quantized dot products), not the cost of 4-bit weights")
        elif path == q8_0:
            notes.append(f"{name} is llama.cpp's Q8_0 of the GGUF the zoo ships for {model} (dequantized to fp32, then "
                         "quantized), as tandem's int8 and int4 are quantized from the same fp32 weights")
    return notes
