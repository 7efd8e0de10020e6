"""The MoE shapes of the records (``bench/ep_plan.py``), as Hugging Face Qwen3-MoE configs
the planner builds on the meta device: Qwen3-30B-A3B's published config, and Kimi K2's and
DeepSeek-V3's widths and expert counts. ``python -m service.job.plan --model kimi-k2-shape``
and the bench read them from here."""

from __future__ import annotations

# the experts' module its own DMuon hook boundary, attention another: the workers refuse
# a boundary that holds expert-parallel and other params (dmuon.dedicate._members)
BOUNDARIES = r"model\.layers\.\d+\.(self_attn|mlp)"

QWEN3_30B_A3B_URL = "https://huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json"
KIMI_K2_URL = "https://huggingface.co/moonshotai/Kimi-K2-Instruct/blob/main/config.json"
KIMI_K2_REPORT = "https://arxiv.org/abs/2507.20534"
DEEPSEEK_V3_URL = "https://huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json"
# Qwen3-30B-A3B's published config (QWEN3_30B_A3B_URL)
QWEN3_30B_A3B = {"vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
                 "moe_intermediate_size": 768, "num_hidden_layers": 48,
                 "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                 "num_experts": 128, "num_experts_per_tok": 8,
                 "max_position_embeddings": 40960, "tie_word_embeddings": False}
# Kimi K2's widths and expert counts (KIMI_K2_URL, a DeepseekV3 config) as a Qwen3-MoE:
# GQA (64 heads of 128, 8 KV heads) in place of MLA, the first layer dense
# (first_k_dense_replace 1), no shared expert (Qwen3-MoE has none)
KIMI_K2 = {"vocab_size": 163840, "hidden_size": 7168, "intermediate_size": 18432,
           "moe_intermediate_size": 2048, "num_hidden_layers": 61,
           "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128,
           "num_experts": 384, "num_experts_per_tok": 8, "mlp_only_layers": [0],
           "max_position_embeddings": 131072, "tie_word_embeddings": False}
# DeepSeek-V3's (DEEPSEEK_V3_URL) the same way: 256 experts, 128 heads, 3 dense layers
DEEPSEEK_V3 = {**KIMI_K2, "vocab_size": 129280, "num_attention_heads": 128,
               "num_experts": 256, "mlp_only_layers": [0, 1, 2],
               "max_position_embeddings": 163840}
MOE_SHAPES = {"qwen3-30b-a3b": QWEN3_30B_A3B, "kimi-k2-shape": KIMI_K2,
              "deepseek-v3-shape": DEEPSEEK_V3}
MOE_ARCH = "Qwen3MoeForCausalLM"
