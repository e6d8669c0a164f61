"""Small real GGUF files for tests, written with the `gguf` package's writer.

`write_gguf(path, ...)` writes a llama-architecture model with f32 weights and a small byte-level
SentencePiece-style vocabulary (or any `tokens` given, e.g. a real model's vocabulary with one token changed);
`split=N` writes it as N shards `<stem>-0000i-of-0000N.gguf`. `vocabulary(path)` reads a file's tokenizer as
write_gguf's arguments (to craft a file that differs from a real one in one token).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

SPM_TOKENS = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + ["\u2581" + c for c in "abcdefghij"]
SPM_TYPES = [2, 3, 3] + [6] * 256 + [1] * 10
TEMPLATE = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}</s>{% endfor %}<|assistant|>"


def vocabulary(path: str | Path) -> dict:
    """A GGUF file's tokenizer as write_gguf's keyword arguments: tokens, types, merges, model, pre, bos, eos,
    add_bos (to write a file that differs from a real one in chosen ways)."""
    from offload.gguf_header import read_header

    keys = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges")
    m = read_header(path, keep=keys).metadata
    return {"tokens": list(m["tokenizer.ggml.tokens"]), "types": m["tokenizer.ggml.token_type"].tolist(),
            "merges": list(m.get("tokenizer.ggml.merges") or []) or None, "model": m["tokenizer.ggml.model"],
            "pre": m.get("tokenizer.ggml.pre"), "bos": m.get("tokenizer.ggml.bos_token_id"),
            "eos": m.get("tokenizer.ggml.eos_token_id"), "add_bos": m.get("tokenizer.ggml.add_bos_token")}


def write_gguf(path: str | Path, *, name: str = "test-model", basename: str | None = None, size_label: str | None = None,
               tokens: list[str] | None = None, types: list[int] | None = None, model: str = "llama",
               merges: list[str] | None = None, pre: str | None = None,
               n_layer: int = 2, n_embd: int = 16, n_ff: int = 32, n_head: int = 2, n_head_kv: int = 1,
               context: int = 2048, bos: int | None = 1, eos: int | None = 2, add_bos: bool | None = True,
               chat_template: str | None = TEMPLATE, split: int = 0, seed: int = 0, unk: int | None = None,
               scores: bool = False, embed_scale: float | None = None) -> list[Path]:
    """Write the model; returns the files written (one, or `split` shards in order). `embed_scale`: the
    token embeddings' standard deviation (default 1/sqrt(n_embd), as every other matrix)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tokens = SPM_TOKENS if tokens is None else tokens
    types = (SPM_TYPES if tokens is SPM_TOKENS else [1] * len(tokens)) if types is None else types
    rng = np.random.default_rng(seed)
    n_tensors = 3 + 9 * n_layer
    w = gguf.GGUFWriter(str(path), "llama", split_max_tensors=-(-n_tensors // split) if split > 1 else 0)
    w.add_name(name)
    if basename:
        w.add_basename(basename)
    if size_label:
        w.add_size_label(size_label)
    w.add_block_count(n_layer)
    w.add_context_length(context)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_dimension_count(n_embd // n_head)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model(model)
    if pre:
        w.add_tokenizer_pre(pre)
    if merges:
        w.add_token_merges(merges)
    w.add_token_list(tokens)
    if scores:
        w.add_token_scores([0.0] * len(tokens))
    w.add_token_types(types)
    if bos is not None:
        w.add_bos_token_id(bos)
    if eos is not None:
        w.add_eos_token_id(eos)
    if unk is not None:
        w.add_unk_token_id(unk)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if chat_template:
        w.add_chat_template(chat_template)

    def rand(tname, rows, cols, scale=None):
        w.add_tensor(tname, (rng.standard_normal((rows, cols)) * (scale or cols ** -0.5)).astype(np.float32))

    hd = n_embd // n_head
    rand("token_embd.weight", len(tokens), n_embd, embed_scale)
    rand("output.weight", len(tokens), n_embd)
    w.add_tensor("output_norm.weight", np.ones(n_embd, np.float32))
    for i in range(n_layer):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(n_embd, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(n_embd, np.float32))
        rand(f"blk.{i}.attn_q.weight", n_embd, n_embd)
        rand(f"blk.{i}.attn_k.weight", n_head_kv * hd, n_embd)
        rand(f"blk.{i}.attn_v.weight", n_head_kv * hd, n_embd)
        rand(f"blk.{i}.attn_output.weight", n_embd, n_embd)
        rand(f"blk.{i}.ffn_gate.weight", n_ff, n_embd)
        rand(f"blk.{i}.ffn_up.weight", n_ff, n_embd)
        rand(f"blk.{i}.ffn_down.weight", n_embd, n_ff)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if split > 1:
        return [path.with_name(gguf.gguf_writer.SHARD_NAME_FORMAT.format(path.stem, i + 1, split))
                for i in range(split)]
    return [path]
