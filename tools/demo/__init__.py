"""The demo target's training pipeline (issue 14), split by job; tools/train_target.py runs it.

corpus      the Python sources of this machine: read, filter, deduplicate, split, prompts
bpe         the byte-level BPE tokenizer and the flat uint16 token streams
target      the DeepseekV3ForCausalLM presets, the expert implementation, the router balancer
trainer     batches, learning-rate schedule, train step, held-out evaluation
checkpoint  the resumable checkpoint (sized for the GPU machine's transfers) and the export

Needs torch, transformers, tokenizers, safetensors and numpy; nothing here is imported by
kdtree_numba.  docs/DEMO.md has the recipe and the numbers.
"""
