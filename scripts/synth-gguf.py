#!/usr/bin/env python3
"""Write a GGUF with random weights in the shape of a real model, for memory and speed benchmarks
(scripts/scaling). Random weights are enough to measure load time, peak memory and decode speed;
correctness stays with the real models' tests.

Usage: synth-gguf.py PRESET TYPE OUT.gguf
  PRESET: smollm2-135m, llama-3.2-1b, llama-3.1-8b
  TYPE:   Q4_0, Q4_K, Q8_0 (every matrix, embedding and output included; norms in F32)

Blocks are random bytes with their scales set to small finite f16 values, so every value is a
modest number (no NaN or infinity) and activations stay finite through the layers. Tensors are
written one at a time: an 8B model takes about 4.5 GB of disk and little memory.

The tokenizer is a byte-level BPE ("gpt2") vocabulary made up here: the 256 byte symbols, then
pairs and triples of them with their merges, then two control tokens (BOS and EOS), so both
selfspec and llama.cpp load it.
"""
import sys

import numpy as np
import gguf

PRESETS = {
    # name: (vocab, hidden, layers, heads, kv_heads, ffn, tied, rope_theta, context)
    "smollm2-135m": (49152, 576, 30, 9, 3, 1536, True, 100000.0, 8192),
    "llama-3.2-1b": (128256, 2048, 16, 32, 8, 8192, True, 500000.0, 131072),
    "llama-3.1-8b": (128256, 4096, 32, 32, 8, 14336, False, 500000.0, 131072),
}

TYPES = {
    "Q4_0": gguf.GGMLQuantizationType.Q4_0,
    "Q4_K": gguf.GGMLQuantizationType.Q4_K,
    "Q8_0": gguf.GGMLQuantizationType.Q8_0,
}


def byte_symbols():
    """GPT-2's printable stand-ins for the 256 byte values."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def vocabulary(size):
    syms = byte_symbols()
    tokens, merges = list(syms), []
    # Pairs of common symbols first, then triples, until the vocabulary is full.
    common = syms[:96]
    for a in common:
        for b in common:
            if len(tokens) >= size - 2:
                break
            tokens.append(a + b)
            merges.append(f"{a} {b}")
    pairs = tokens[256:]
    for ab in pairs:
        for c in common:
            if len(tokens) >= size - 2:
                break
            tokens.append(ab + c)
            merges.append(f"{ab} {c}")
        if len(tokens) >= size - 2:
            break
    tokens += ["<|begin_of_text|>", "<|end_of_text|>"]
    assert len(tokens) == size, (len(tokens), size)
    types = [gguf.TokenType.NORMAL] * (size - 2) + [gguf.TokenType.CONTROL] * 2
    return tokens, merges, types


def random_blocks(rng, qtype, n, k):
    """Random blocks for an [n, k] matrix as a [n, row_bytes] uint8 array."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    nb = n * k // block
    b = rng.integers(0, 256, size=(nb, size), dtype=np.uint8)
    def f16(scale, lo=0.5):
        return (rng.uniform(lo, 1.0, size=nb) * scale).astype(np.float16).view(np.uint8).reshape(nb, 2)
    if qtype == gguf.GGMLQuantizationType.Q4_0:
        b[:, 0:2] = f16(0.02)
    elif qtype == gguf.GGMLQuantizationType.Q8_0:
        b[:, 0:2] = f16(0.001)
    elif qtype == gguf.GGMLQuantizationType.Q4_K:
        b[:, 0:2] = f16(0.0005)
        b[:, 2:4] = f16(0.0005)
    else:
        raise ValueError(qtype)
    return b.reshape(n, k // block * size)


def main():
    if len(sys.argv) != 4 or sys.argv[1] not in PRESETS or sys.argv[2] not in TYPES:
        sys.exit(__doc__)
    preset, tname, out = sys.argv[1], sys.argv[2], sys.argv[3]
    vocab, hidden, layers, heads, kv_heads, ffn, tied, theta, ctx = PRESETS[preset]
    qtype = TYPES[tname]
    head_dim = hidden // heads
    rng = np.random.default_rng(0)

    w = gguf.GGUFWriter(out, "llama")
    w.add_name(f"synthetic {preset} {tname} (random weights)")
    w.add_context_length(ctx)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type({"Q4_0": 2, "Q8_0": 7, "Q4_K": 15}[tname])
    tokens, merges, types = vocabulary(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab - 2)
    w.add_eos_token_id(vocab - 1)
    w.add_add_bos_token(True)

    # (name, shape [out, in] or [n], quantized)
    plan = [("token_embd.weight", (vocab, hidden), True)]
    for i in range(layers):
        b = f"blk.{i}"
        plan += [
            (f"{b}.attn_norm.weight", (hidden,), False),
            (f"{b}.attn_q.weight", (heads * head_dim, hidden), True),
            (f"{b}.attn_k.weight", (kv_heads * head_dim, hidden), True),
            (f"{b}.attn_v.weight", (kv_heads * head_dim, hidden), True),
            (f"{b}.attn_output.weight", (hidden, heads * head_dim), True),
            (f"{b}.ffn_norm.weight", (hidden,), False),
            (f"{b}.ffn_gate.weight", (ffn, hidden), True),
            (f"{b}.ffn_up.weight", (ffn, hidden), True),
            (f"{b}.ffn_down.weight", (hidden, ffn), True),
        ]
    plan.append(("output_norm.weight", (hidden,), False))
    if not tied:
        plan.append(("output.weight", (vocab, hidden), True))

    block, size = gguf.GGML_QUANT_SIZES[qtype]
    if any(quant and shape[1] % block for _, shape, quant in plan):
        sys.exit(f"{preset}'s rows are not whole {tname} blocks of {block} values")
    for name, shape, quant in plan:
        if quant:
            n, k = shape
            w.add_tensor_info(name, (n, k // block * size), np.dtype(np.uint8), n * k // block * size, raw_dtype=qtype)
        else:
            w.add_tensor_info(name, shape, np.dtype(np.float32), shape[0] * 4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, shape, quant in plan:
        if quant:
            w.write_tensor_data(random_blocks(rng, qtype, *shape))
        else:
            w.write_tensor_data(rng.uniform(0.5, 1.5, size=shape).astype(np.float32))
    w.close()


if __name__ == "__main__":
    main()
