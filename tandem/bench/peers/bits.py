"""Bits per weight of what a decode runner streams, split as users compare formats: the transformer blocks' matmul
weights, the LM head and the embeddings. tandem's from its served Linear copies (packed int8 / int4 / bf16 and their
scales, or the dense fp32 weight); a GGUF's from its tensors' stored bytes (block scales included). Norm vectors and
biases are left out on both sides (a few thousand values a layer)."""
from __future__ import annotations

from pathlib import Path

from tandem.bench.kernels.forward import served_bytes


def model_bits(model) -> dict:
    """{"blocks", "lm_head", "embeddings"}: bits per weight of a tandem Transformer as it is served."""
    head = model.lm_head
    blocks = [lin for lin in model.linears() if lin is not head]
    return {"blocks": _linear_bits(blocks), "lm_head": _linear_bits([head]), "embeddings": 8 * model.embed.weight.element_size()}


def _linear_bits(linears) -> float:
    stored = sum(served_bytes(lin, 4) for lin in linears)
    return round(8 * stored / sum(lin.in_features * lin.out_features for lin in linears), 3)


def gguf_bits(path: Path) -> dict:
    """{"blocks", "lm_head", "embeddings"}: bits per weight of a GGUF's 2-D tensors, with their formats ("types") and the
    file's type ("file_type", llama.cpp's name); a model without output.weight ties its head to the embeddings."""
    from tandem.bench.peers.llama_worker import FILE_TYPES
    from tandem.models.gguf_convert import open_gguf, read_field

    reader = open_gguf(Path(path))
    groups: dict[str, list] = {"blocks": [], "lm_head": [], "embeddings": []}
    for tensor in reader.tensors:
        if len(tensor.shape) < 2:
            continue
        key = {"token_embd.weight": "embeddings", "output.weight": "lm_head"}.get(tensor.name, "blocks")
        groups[key].append(tensor)
    if not groups["lm_head"]:
        groups["lm_head"] = groups["embeddings"]
    file_type = read_field(reader, "general.file_type", None)
    return {key: _tensor_bits(tensors) for key, tensors in groups.items()} | {
        "types": {key: sorted({t.tensor_type.name for t in tensors}) for key, tensors in groups.items()},
        "file_type": FILE_TYPES.get(file_type, "other") if file_type is not None else None}


def _tensor_bits(tensors) -> float:
    return round(8 * sum(int(t.n_bytes) for t in tensors) / sum(int(t.n_elements) for t in tensors), 3)
