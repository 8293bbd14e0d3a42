"""Tiny random-weight models built from real configs with transformers (the oracle), saved as
Hugging Face folders; and a minimal single-sequence runner over our paged forward pass."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from superslm.cache.kv import KVCache
from superslm.cache.state import RecurrentStates
from superslm.kernels.attention import AttnMetadata
from superslm.models.transformer import Transformer

SMALL = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)

CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    # SmolLM2-135M's config, shrunk (llama, GQA 3:1 there)
    "llama": ("LlamaConfig", dict(SMALL, rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)),
    # Llama 3.2's rope scaling
    "llama3": (
        "LlamaConfig",
        dict(
            SMALL,
            rope_theta=500000.0,
            max_position_embeddings=2048,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
    ),
    "llama_linear": ("LlamaConfig", dict(SMALL, rope_scaling={"rope_type": "linear", "factor": 4.0})),
    "llama_yarn": (
        "LlamaConfig",
        dict(
            SMALL,
            max_position_embeddings=1024,
            rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
        ),
    ),
    "mistral": ("MistralConfig", dict(SMALL, sliding_window=6, head_dim=16)),
    # Phi-3-mini-128k's layout, shrunk: q/k/v and gate/up stored fused, LongRoPE (short factors within the 64
    # trained positions, cos/sin scaled for the 256 of max_position_embeddings), a sliding window, and
    # Phi-4-mini's partial rotary dimensions (12 of 16)
    "phi3": ("Phi3Config", dict(SMALL, max_position_embeddings=256, original_max_position_embeddings=64,
                                bos_token_id=0, eos_token_id=1, pad_token_id=None,
                                sliding_window=12, rope_parameters={
                                    "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                                    "short_factor": [1.0, 1.1, 1.3, 1.7, 2.4, 3.0],
                                    "long_factor": [1.2, 2.0, 3.5, 6.0, 9.0, 14.0]})),
    # SmolLM3-3B's layout, shrunk: layers 1 and 3 without rotary positions (NoPE), tied, GQA
    "smollm3": ("SmolLM3Config", dict(SMALL, num_hidden_layers=4, no_rope_layers=[1, 0, 1, 0], bos_token_id=0,
                                      eos_token_id=1, pad_token_id=None,
                                      rope_theta=2000000.0, tie_word_embeddings=True)),
    # Qwen2.5-0.5B's config, shrunk: q/k/v biases, tied
    "qwen2": ("Qwen2Config", dict(SMALL, rope_theta=1000000.0, tie_word_embeddings=True)),
    # Qwen3-0.6B's config, shrunk: q/k norms, explicit head_dim != dim/heads
    "qwen3": ("Qwen3Config", dict(SMALL, head_dim=32, rope_theta=1000000.0, tie_word_embeddings=True)),
    # Qwen3.5-0.8B's layout, shrunk: three gated delta-rule layers, then gated attention (a quarter of each head
    # rotated); value heads twice the key heads, as Qwen3.5's larger sizes have
    "qwen3_5": ("Qwen3_5TextConfig", dict(SMALL, num_hidden_layers=4, head_dim=16, tie_word_embeddings=True,
                                          layer_types=["linear_attention"] * 3 + ["full_attention"],
                                          linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                                          linear_value_head_dim=8, linear_conv_kernel_dim=4)),
    # Qwen3.5-35B-A3B's layout, shrunk: the same layers, every MLP 8 experts (top 2) and a shared expert
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", dict(SMALL, num_hidden_layers=4, head_dim=16,
                                                 layer_types=["linear_attention"] * 3 + ["full_attention"],
                                                 linear_num_key_heads=2, linear_num_value_heads=4,
                                                 linear_key_head_dim=16, linear_value_head_dim=8, num_experts=8,
                                                 num_experts_per_tok=2, moe_intermediate_size=32,
                                                 shared_expert_intermediate_size=48)),
    # Qwen3-Next-80B-A3B's layout, shrunk: delta-rule projections stored fused by key head, experts on every layer
    # but the first (mlp_only_layers), top-k renormalized, a shared expert
    "qwen3_next": ("Qwen3NextConfig", dict(SMALL, num_hidden_layers=4, head_dim=16, mlp_only_layers=[0],
                                           layer_types=["linear_attention"] * 3 + ["full_attention"],
                                           linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                                           linear_value_head_dim=8, num_experts=8, num_experts_per_tok=2,
                                           moe_intermediate_size=32, shared_expert_intermediate_size=48)),
    # Qwen3-30B-A3B's layout, shrunk: Qwen3's attention, 8 experts (top 2, renormalized) on every other layer
    "qwen3_moe": ("Qwen3MoeConfig", dict(SMALL, head_dim=16, num_experts=8, num_experts_per_tok=2,
                                         moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=2,
                                         rope_theta=1000000.0)),
    # Gemma 3 270M's config, shrunk: sliding window 6 so the window matters at 36 tokens
    "gemma3": (
        "Gemma3TextConfig",
        dict(
            SMALL,
            num_hidden_layers=4,
            num_key_value_heads=1,
            head_dim=32,
            sliding_window=6,
            query_pre_attn_scalar=24,
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        ),
    ),
}

#: families whose layers are other parts (gated attention, delta rule, experts): the reference path runs them, the
#: C++ plan refuses them (tests/test_hybrid.py); PLAIN: the rest
PARTS_FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next", "qwen3_moe")
PLAIN = tuple(sorted(set(CONFIGS) - set(PARTS_FAMILIES)))


TEXT = (
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs! "
    "def main():\n    return 42\n# comment\n\tindented = [1, 2, 3]\n"
    "Zwölf Boxkämpfer jagen Viktor quer über den großen Sylter Deich. 日本語のテキスト。 "
)


def two_layers(family: str) -> tuple[str, dict[str, Any]]:
    """CONFIGS[family] with 2 layers (Gemma 3: one sliding-window layer, then one full-attention layer), for
    build_hf_model's `spec`: a model-level kernel test whose property holds layer by layer (each layer runs the
    same kernels, a residual still crosses a layer boundary) needs no more, and under the Triton interpreter
    every layer costs seconds."""
    cls, kwargs = CONFIGS[family]
    kwargs = dict(kwargs, num_hidden_layers=2)
    if "layer_types" in kwargs:
        kinds = list(dict.fromkeys(kwargs["layer_types"]))  # each kind once, in the order the family has them
        if len(kinds) != 2:
            raise ValueError(f"{family}: two layers cannot hold its layer kinds {kinds}")
        kwargs["layer_types"] = kinds
    return cls, kwargs


def write_tokenizer(folder: Path, vocab: int) -> None:
    """A byte-level BPE tokenizer of exactly `vocab` tokens (<s>=0, </s>=1) trained on TEXT."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([TEXT] * 4, trainer)
    assert tok.get_vocab_size() == vocab, tok.get_vocab_size()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        '{"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": false, '
        '"chat_template": "{% for m in messages %}<s>{{ m.role }}\\n{{ m.content }}</s>{% endfor %}'
        '{% if add_generation_prompt %}<s>assistant\\n{% endif %}"}'
    )


def build_hf_model(family: str, folder: Path, seed: int = 0, spec: tuple[str, dict[str, Any]] | None = None) -> Any:
    """A transformers model with random weights (norms perturbed too), saved to `folder`; `spec`: (config class,
    kwargs) instead of CONFIGS[family]."""
    import transformers

    cls_name, kwargs = CONFIGS[family] if spec is None else spec
    config = getattr(transformers, cls_name)(**kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.08)
    model.eval()
    model.save_pretrained(folder, safe_serialization=True)
    write_tokenizer(folder, config.vocab_size)
    return model


class SingleSequence:
    """Runs one sequence through our forward pass, a chunk at a time, on shuffled KV pages."""

    def __init__(self, net: Transformer, pages: int = 64, page_size: int = 4, seed: int = 0) -> None:
        a, d = net.arch, net.arch.delta
        self.net, self.page_size = net, page_size
        self.kv = KVCache(net.kv_layers, pages, page_size, a.kv_heads, a.head_dim, net.dtype)
        self.states = None if d is None else RecurrentStates(net.state_layers, 1, d.conv_width, d.conv, d.v_heads,
                                                             d.k_dim, d.v_dim, net.dtype)
        g = torch.Generator().manual_seed(seed)
        self.block_table = tuple(torch.randperm(pages, generator=g).tolist())
        self.length = 0

    def step(self, tokens: list[int]) -> torch.Tensor:
        """Feed tokens; returns the logits [len(tokens), vocab] of every row."""
        n, ps = len(tokens), self.page_size
        pos = torch.arange(self.length, self.length + n)
        slots = torch.tensor([self.block_table[p // ps] * ps + p % ps for p in pos.tolist()])
        meta = AttnMetadata(pos, slots, (0, n), (self.length + n,), (self.block_table,), ps, state_slots=(0,))
        h = self.net.embed(torch.tensor(tokens))
        h = self.net.run_layers(h, meta, self.kv.k, self.kv.v, states=self.states)
        self.length += n
        return self.net.logits(h)


def hf_greedy(hf: Any, prompt: list[int], n: int) -> list[int]:
    """transformers' own greedy continuation, with no logits processor (EOS is just a token)."""
    out: list[int] = []
    with torch.no_grad():
        res = hf(torch.tensor([prompt]), use_cache=True)
        for _ in range(n):
            tok = int(res.logits[0, -1].argmax())
            out.append(tok)
            res = hf(torch.tensor([[tok]]), past_key_values=res.past_key_values, use_cache=True)
    return out
