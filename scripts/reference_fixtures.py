#!/usr/bin/env python3
"""Tiny random-weight checkpoints and their logits from Hugging Face transformers, the reference
the Rust loaders are tested against (tests/reference.rs). Run by scripts/reference-fixtures,
which installs torch and transformers into a venv; the outputs are small and committed, so the
tests need no Python.

For each family: tests/fixtures/reference/<family>/config.json and model.safetensors (written by
transformers' save_pretrained), and expected.json: the input ids, the logits of the last
positions (float32, eager attention) and the greedy continuation. The vocabulary is 266 tokens,
the size of the tiny byte-level tokenizer the tests attach (src/model/fixtures.rs).
"""
import json
import os
import sys

import torch
import transformers
from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, Qwen2Config, Qwen3Config

VOCAB = 266
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=False,
              bos_token_id=VOCAB - 2, eos_token_id=VOCAB - 1, attn_implementation="eager")
FAMILIES = {
    # Llama 3.1's rope scaling against an original context of 64 tokens: with head dimension 16
    # and base 10^4 one frequency is kept, two are blended and five are divided, and the
    # 160-token input runs well past the original context.
    "llama3": LlamaConfig(rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}, **COMMON),
    # q/k/v biases, NeoX rotary layout.
    "qwen2": Qwen2Config(rms_norm_eps=1e-6, rope_theta=1000000.0, **COMMON),
    # Per-head q/k RMS norms, no biases.
    "qwen3": Qwen3Config(rms_norm_eps=1e-6, rope_theta=1000000.0, attention_bias=False, **COMMON),
    # Embeddings times sqrt(hidden), (1 + w) norms before and after attention and MLP, per-head
    # q/k norms, GELU-tanh, a local (sliding-window) layer with its own rotary base and a
    # global one. The 160-token input runs past the 128-token window, so the window clips.
    # query_pre_attn_scalar = head_dim: llama.cpp's GGUF reader takes 1/sqrt(head_dim) (as the
    # released models have it), so the GGUF conversion agrees only then.
    "gemma3": Gemma3TextConfig(rms_norm_eps=1e-6, sliding_window=128, layer_types=["sliding_attention", "full_attention"],
                               query_pre_attn_scalar=16, hidden_activation="gelu_pytorch_tanh",
                               rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
                               **COMMON),
}
PROMPT_LEN = 160
NEW_TOKENS = 16
LAST = 8


def main():
    out_root = sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/reference"
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    for name, cfg in FAMILIES.items():
        model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32).eval()
        with torch.no_grad():
            # Norm weights near 1 and heads with some spread, as trained models have; the
            # default initialisation leaves norms at exactly 1 and would not test them.
            for pname, p in model.named_parameters():
                if "norm" in pname:
                    p.copy_(1.0 + 0.2 * (torch.rand(p.shape, generator=gen) - 0.5))
                elif pname.endswith("bias"):
                    p.copy_(0.5 * (torch.rand(p.shape, generator=gen) - 0.5))
                else:
                    fan_in = p.shape[-1]
                    scale = 1.0 if "embed" in pname else 3.0 / fan_in ** 0.5
                    p.copy_(scale * (torch.rand(p.shape, generator=gen) - 0.5))
        ids = torch.randint(0, VOCAB - 3, (1, PROMPT_LEN), generator=gen)
        with torch.no_grad():
            logits = model(ids).logits[0]
            greedy = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)[0, PROMPT_LEN:]
        d = os.path.join(out_root, name)
        os.makedirs(d, exist_ok=True)
        model.save_pretrained(d, safe_serialization=True)
        for extra in ["generation_config.json"]:
            p = os.path.join(d, extra)
            if os.path.exists(p):
                os.remove(p)
        expected = {
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "input_ids": ids[0].tolist(),
            "last_positions": LAST,
            "logits": logits[-LAST:].tolist(),
            "greedy": greedy.tolist(),
        }
        with open(os.path.join(d, "expected.json"), "w") as f:
            json.dump(expected, f)
        print(f"{name}: {sum(p.numel() for p in model.parameters())} parameters -> {d}")


if __name__ == "__main__":
    main()
